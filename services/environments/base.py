"""What an environment for a multi-turn agent is, and the checks around one.

An environment is any object with ``reset(row, seed)`` and ``step(action)``; either may be ``async def``.
A job names it as ``package.module:factory`` (a class or a function returning one). The model's turn reaches
``step`` as text; what the environment returns is checked here and encoded once, as token ids that are
appended to the trajectory after the model's tokens.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import numbers
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from services.errors import TetherError

# text, chat messages [{"role", "content"}], or token ids
Observation = str | list[dict] | list[int]

# the adapters' evaluation rows seed their games from here, apart from the training rows' seeds
EVAL_SEEDS_START = 1_000_000


def as_observation(text: str, chat: bool, system: str | None = None) -> str | list[dict]:
    """``text`` as a user turn (after ``system`` as the system turn) for the model's chat template, or,
    without ``chat``, as plain text (after ``system`` and a newline)."""
    if not chat:
        return f"{system}\n{text}" if system else text
    return [*([{"role": "system", "content": system}] if system else []), {"role": "user", "content": text}]


class Environment:
    """A multi-turn environment: subclass and implement ``reset`` and ``step``; either may be ``async def``.

    ``reset`` starts an episode for one row of the job's data and returns the first observation (the prompt).
    ``step`` takes the model's turn decoded as text (special tokens skipped) and returns
    ``(observation, reward, done, info)``: the next observation (None or "" once done), the turn's reward,
    whether the episode ended, and an info dict (``"tool_calls"``, an int, is counted in the metrics; other
    keys are ignored).
    """

    def reset(self, row: dict, seed: int) -> Observation:
        raise NotImplementedError

    def step(self, action: str) -> tuple[Observation | None, float, bool, dict]:
        raise NotImplementedError

    def close(self) -> None:
        """Release what the environment holds (optional)."""


@dataclass(frozen=True)
class StepResult:
    observation: Observation | None
    reward: float
    done: bool
    info: dict = field(default_factory=dict)


class EnvironmentFailure(TetherError, RuntimeError):
    """An environment that raised, hung past its deadline, returned something malformed, or whose worker died.
    Counted and named, never trained on."""

    def __init__(self, environment: str, reason: str, row: int | None = None, turn: int | None = None):
        self.environment = environment
        self.reason = reason
        self.row = row
        self.turn = turn
        where = ", ".join(f"{name} {value}" for name, value in (("row", row), ("turn", turn))
                          if value is not None)
        super().__init__(f"environment {environment!r} failed{' at ' + where if where else ''}: {reason}")

    def __reduce__(self):
        # it crosses Ray as a pickle; the default would call __init__ with the message alone
        return type(self), (self.environment, self.reason, self.row, self.turn)


def observation_problem(observation: Any) -> str | None:
    """What is wrong with ``observation`` as an Observation (None allowed), or None if nothing is."""
    if observation is None or isinstance(observation, str):
        return None
    if not isinstance(observation, list):
        return f"observation of type {type(observation).__name__}, expected str, chat messages or token ids"
    if all(_is_token_id(x) for x in observation):
        return None
    for i, message in enumerate(observation):
        if not isinstance(message, dict):
            return (f"observation[{i}] of type {type(message).__name__}: a list observation must be all "
                    f"token ids (ints) or all chat messages (dicts)")
        for key in ("role", "content"):
            if not isinstance(message.get(key), str):
                return (f"observation[{i}] has no str {key!r} "
                        f"(a chat message is {{'role': str, 'content': str}})")
    return None


def check_step_result(result: Any, env_name: str, *, row: int | None = None,
                      turn: int | None = None) -> StepResult:
    """``result`` of a step as a StepResult; EnvironmentFailure naming the environment and what is
    malformed."""

    def fail(reason: str) -> EnvironmentFailure:
        return EnvironmentFailure(env_name, f"step returned {reason}", row, turn)

    if isinstance(result, StepResult):
        observation, reward, done, info = result.observation, result.reward, result.done, result.info
    elif isinstance(result, tuple | list) and len(result) == 4:
        observation, reward, done, info = result
    else:
        kind = f"a {len(result)}-tuple" if isinstance(result, tuple | list) else f"a {type(result).__name__}"
        raise fail(f"{kind}, expected (observation, reward, done, info)")
    # a bool reward is almost always reward and done swapped
    finite_real = isinstance(reward, numbers.Real) and math.isfinite(reward)
    if isinstance(reward, bool | np.bool_) or not finite_real:
        raise fail(f"reward {reward!r} ({type(reward).__name__}), expected a finite real number")
    if not isinstance(done, bool | np.bool_):
        raise fail(f"done {done!r} ({type(done).__name__}), expected a bool")
    if not isinstance(info, dict):
        raise fail(f"info of type {type(info).__name__}, expected a dict")
    problem = observation_problem(observation)
    if problem:
        raise fail(problem)
    if observation is None and not done:
        raise fail("observation None with done False: a step that goes on must return the next observation")
    if isinstance(observation, list) and observation and _is_token_id(observation[0]):
        observation = [int(x) for x in observation]
    return StepResult(observation, float(reward), bool(done), info)


def check_reset_result(observation: Any, env_name: str, *, row: int | None = None) -> Observation:
    """The first observation ``reset`` returned; EnvironmentFailure naming the environment if it is malformed
    or empty."""
    problem = observation_problem(observation)
    if problem is None and (observation is None or len(observation) == 0):
        problem = f"observation {observation!r}: the first observation is the prompt and cannot be empty"
    if problem:
        raise EnvironmentFailure(env_name, f"reset returned {problem}", row, turn=0)
    if isinstance(observation, list) and _is_token_id(observation[0]):
        observation = [int(x) for x in observation]
    return observation


async def call_maybe_async(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)``, awaited if it is async, else in a thread so that a blocking environment does not block
    the event loop. The caller applies the deadline (``asyncio.wait_for``)."""
    if inspect.iscoroutinefunction(fn):
        return await fn(*args)
    # a thread cannot be cancelled: past the deadline its episode fails, and the thread runs on to its end
    result = await asyncio.to_thread(fn, *args)
    if inspect.isawaitable(result):
        return await result
    return result


def encode_observation(observation: Observation | None, tokenizer, *, first: bool,
                       turn_closed: bool = True) -> list[int]:
    """The token ids of ``observation``, encoded once, to be appended to the trajectory as they are.

    Token ids are taken as they are (checked against the vocabulary); text is encoded without special tokens;
    None (a final step's) is no tokens. Chat messages, when ``first``, are the prompt with the generation
    prompt. Later they follow the model's turn, which ended with the template's end-of-turn token: they are
    the tokens the template adds after that token, up to and including the next generation prompt; a turn
    cut at its token cap (``turn_closed`` False) is closed by the observation, with that token first.
    """
    problem = observation_problem(observation)
    if problem:
        raise ValueError(problem)
    if observation is None:
        ids = []
    elif isinstance(observation, list) and all(_is_token_id(x) for x in observation):
        ids = [int(x) for x in observation]
        bad = [x for x in ids if not 0 <= x < len(tokenizer)]
        if bad:
            raise ValueError(f"observation token id {bad[0]} is outside the vocabulary [0, {len(tokenizer)})")
    elif isinstance(observation, str):
        ids = list(tokenizer(observation, add_special_tokens=False)["input_ids"])
    else:
        ids = _encode_messages(observation, tokenizer, first, turn_closed)
    if first and not ids:
        raise ValueError("the first observation (the prompt) encodes to no tokens")
    return ids


def _encode_messages(messages: list[dict], tokenizer, first: bool, turn_closed: bool = True) -> list[int]:
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("the observation is chat messages but the tokenizer has no chat template")
    if first:
        return _chat_ids(tokenizer, messages, add_generation_prompt=True)
    base = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]
    base_ids = _chat_ids(tokenizer, base, add_generation_prompt=False)
    eos = tokenizer.eos_token_id
    # the model sampled the template's end-of-turn token; what the template puts after it is the environment's
    end = len(base_ids) - base_ids[::-1].index(eos) if eos in base_ids else len(base_ids)
    if not turn_closed and eos in base_ids:
        end -= 1  # the model did not sample the end-of-turn token: it is the environment's
    full_ids = _chat_ids(tokenizer, base + messages, add_generation_prompt=True)
    if full_ids[:end] != base_ids[:end]:
        raise ValueError("the chat template renders a conversation's earlier turns differently once more "
                         "turns follow, so an observation's tokens cannot be appended after the model's turn")
    return full_ids[end:]


def _chat_ids(tokenizer, messages: list[dict], add_generation_prompt: bool) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True)
    if isinstance(ids, Mapping):  # transformers 5 returns a BatchEncoding by default
        ids = ids["input_ids"]
    return list(ids)


def _is_token_id(x: Any) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool | np.bool_)
