"""A gymnasium.Env as a tether environment: the model reads text and writes its action as text.

A job names one registered with gymnasium as
``task.environment: services.environments.gym:gymnasium_environment`` with
``task.environment_kwargs: {id: CliffWalking-v1, render_mode: ansi, action_names: [up, right, down, left]}``
(plus any keyword ``gymnasium.make`` takes).

The observation the model reads is the env's own where its space is ``gymnasium.spaces.Text``; otherwise the
env must render text (``render_mode: ansi``) and the rendering is the observation. The model's turn is the
action as it is for a ``Text`` action space; for ``Discrete(n, start)`` it is read as the first of
``action_names`` it names (whole words, any case), or else its first integer in the space. A turn that is
neither ends the episode with ``invalid_action_reward`` and ``info["invalid_action"]``: the env never sees it.
``instructions`` (what the actions are, what the goal is) come before the first observation; ``chat: true``
gives observations as user turns for the model's chat template, the instructions as its system turn.

A row resets the env: its ``seed`` key is ``reset``'s seed (so a group's episodes start alike) and its other
keys are ``reset``'s ``options``. Without ``task.path`` the rows are ``{"seed": n}`` for ``episodes``
training and ``eval_episodes`` evaluation starts.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import gymnasium

from services.environments.base import EVAL_SEEDS_START, Environment, as_observation


@dataclass(frozen=True)
class TextPrompt:
    """How the env's text reaches the model: ``instructions`` before the first observation, and as chat
    turns (the instructions as the system turn) or as plain text."""

    instructions: str | None = None
    chat: bool = False

    def observation(self, text: str, first: bool) -> str | list[dict]:
        return as_observation(text, self.chat, self.instructions if first else None)


class GymnasiumEnvironment(Environment):
    """``env`` behind tether's interface; refuses, naming the space, an env whose observations or actions are
    not text and cannot be made text."""

    def __init__(self, env: gymnasium.Env, action_names: list[str] | None = None,
                 invalid_action_reward: float = 0.0, episodes: int = 256, eval_episodes: int = 32,
                 prompt: TextPrompt = TextPrompt()):
        self.env, self.episodes, self.eval_episodes, self.prompt = env, episodes, eval_episodes, prompt
        self.invalid_action_reward = float(invalid_action_reward)
        observations = getattr(env, "observation_space", None)
        self.rendered = observations is not None and not isinstance(observations, gymnasium.spaces.Text)
        if self.rendered and getattr(env, "render_mode", None) != "ansi":
            raise ValueError(f"gymnasium env {env} has observation space {observations} and render_mode "
                             f"{getattr(env, 'render_mode', None)!r}; a tether environment needs text: "
                             "gymnasium.spaces.Text observations, or render_mode: ansi (the rendering is "
                             "read)")
        actions = getattr(env, "action_space", None)
        self.discrete = isinstance(actions, gymnasium.spaces.Discrete)
        if actions is not None and not (self.discrete or isinstance(actions, gymnasium.spaces.Text)):
            raise ValueError(f"gymnasium env {env} has action space {actions}; a tether environment reads "
                             "the model's turn as gymnasium.spaces.Text or as a choice of "
                             "gymnasium.spaces.Discrete")
        if action_names is not None:
            if not self.discrete:
                raise ValueError(f"action_names {action_names} given for gymnasium env {env}, whose action "
                                 f"space {actions} is not Discrete")
            if len(action_names) != actions.n or len({n.lower() for n in action_names}) != actions.n:
                raise ValueError(f"action_names {action_names}: gymnasium env {env} has {actions}, so it "
                                 f"needs {actions.n} distinct names, one per action from "
                                 f"{int(actions.start)}")
        self.action_names = [n.lower() for n in action_names] if action_names else None

    def rows(self) -> list[dict]:
        return [{"seed": n} for n in range(self.episodes)]

    def eval_rows(self) -> list[dict]:
        return [{"seed": EVAL_SEEDS_START + n} for n in range(self.eval_episodes)]

    def reset(self, row: dict, seed: int) -> str | list[dict]:
        options = {key: value for key, value in row.items() if key != "seed"}
        observation, _ = self.env.reset(seed=int(row.get("seed", seed)), options=options or None)
        return self.prompt.observation(self._text(observation, "reset"), first=True)

    def step(self, action: str) -> tuple[str | list[dict] | None, float, bool, dict]:
        if self.discrete:
            choice = self.parse_action(action)
            if choice is None:
                return None, self.invalid_action_reward, True, {"invalid_action": True}
            action = choice
        observation, reward, terminated, truncated, info = self.env.step(action)
        turn = self.prompt.observation(self._text(observation, "step"), first=False)
        return turn, float(reward), bool(terminated or truncated), dict(info)

    def parse_action(self, text: str) -> int | None:
        """The Discrete action ``text`` names: the first of ``action_names`` in it, else its first integer
        in the space; None when it names none."""
        space = self.env.action_space
        if self.action_names:
            pattern = r"\b(" + "|".join(re.escape(n) for n in self.action_names) + r")\b"
            named = re.search(pattern, text.lower())
            if named:
                return int(space.start) + self.action_names.index(named.group(1))
        number = re.search(r"-?\d+", text)
        if number and space.contains(int(number.group())):
            return int(number.group())
        return None

    def close(self) -> None:
        self.env.close()

    def _text(self, observation, where: str) -> str:
        if self.rendered:
            observation = self.env.render()
        if not isinstance(observation, str):
            kind = "render()" if self.rendered else f"{where} observation"
            raise TypeError(f"gymnasium env {self.env} {kind} returned a {type(observation).__name__}, "
                            f"expected str")
        return observation


def gymnasium_environment(id: str, action_names: list[str] | None = None, invalid_action_reward: float = 0.0,
                          episodes: int = 256, eval_episodes: int = 32, instructions: str | None = None,
                          chat: bool = False, **kwargs) -> GymnasiumEnvironment:
    """``gymnasium.make(id, **kwargs)`` as a tether environment (the other arguments as in the module's
    docstring)."""
    return GymnasiumEnvironment(gymnasium.make(id, **kwargs), action_names, invalid_action_reward, episodes,
                                eval_episodes, TextPrompt(instructions, chat))
