"""EnvironmentWorker: runs environments' resets and steps for the rollout engines, outside their processes.

A worker holds the live environments of the episodes given to it, one per episode (the factory is called at
each episode's reset), and runs the resets or steps of one call concurrently (a blocking environment's in a
thread of its own), each under the step deadline; blocking resets one at a time, so that a reset that seeds
and then draws from process-global random state (Python's ``random``, numpy's; GEM's games do) draws what it
seeded while the episodes of a group reset together. It encodes each observation once, with the policy's
tokenizer, into the ids the trajectory gets. An environment that raises, hangs past the deadline or returns a
malformed result fails its episode, never the worker; the rollout engine regenerates the episode
(``actors/rollout.py``).
"""

from __future__ import annotations

import asyncio
import inspect
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from actors.base import starting_up, take_cpu_priority
from actors.specs import EnvironmentSpec
from services.model_source import as_source

# threads for blocking environments: one per episode in flight, and a hung one keeps its thread
MAX_THREADS = 256


@dataclass
class Outcome:
    """What one reset or step of one episode gave: the observation's ids, the reward, done, the tool calls,
    the seconds it took; or the failure (``error``), after which the episode's environment is gone."""

    ids: list[int]
    reward: float = 0.0
    done: bool = False
    tool_calls: int = 0
    seconds: float = 0.0
    error: str | None = None
    lost_worker: int | None = None  # set by the rollout side: the worker that held the episode was lost


class EnvironmentWorker:
    role = "environment"

    @starting_up()
    def __init__(self, index: int, spec: EnvironmentSpec) -> None:
        from services.environments import load_environment_factory
        from services.models import load_tokenizer

        take_cpu_priority("cpu")  # the user's priority, as every other role's
        # its name, in errors
        self.index, self.environment, self.kwargs = index, spec.environment, spec.kwargs
        self.step_timeout_s = spec.step_timeout_s
        self.factory = load_environment_factory(spec.environment)
        self.tokenizer = load_tokenizer(as_source(spec.policy).resolve(f"environment-{index}"))
        self.environments: dict[str, object] = {}
        self.threads = ThreadPoolExecutor(MAX_THREADS, thread_name_prefix="environment")
        self.blocking_reset = asyncio.Lock()

    def ready(self) -> bool:
        return True

    # async methods: Ray runs this worker's calls on its event loop, each call's episodes concurrently

    async def reset(self, keys: list[str], rows: list[dict], row_index: list[int],
                    seeds: list[int]) -> list[Outcome]:
        """A new environment per episode, reset to its row: the first observation's ids (the prompt)."""
        asyncio.get_running_loop().set_default_executor(self.threads)
        return await asyncio.gather(*map(self._reset, keys, rows, row_index, seeds))

    async def step(self, keys: list[str], actions: list[str], row_index: list[int], turns: list[int],
                   closed: list[bool]) -> list[Outcome]:
        """Each episode's environment takes the model's turn as text (``closed``: the turn ended with its EOS,
        not at its token cap): the next observation's ids, the reward and done. An episode that ends (or
        fails) lets its environment go."""
        asyncio.get_running_loop().set_default_executor(self.threads)
        return await asyncio.gather(*map(self._step, keys, actions, row_index, turns, closed))

    async def close(self, keys: list[str]) -> None:
        for key in keys:
            self._close(key)

    async def _reset(self, key: str, row: dict, row_index: int, seed: int) -> Outcome:
        from services.environments import check_reset_result, encode_observation, make_environment

        start = time.perf_counter()
        try:
            env = self.environments[key] = make_environment(self.factory, self.kwargs, self.environment)
            if inspect.iscoroutinefunction(env.reset):  # on the event loop: it interleaves only at its awaits
                observation = await self._call(env.reset, row, seed)
            else:
                async with self.blocking_reset:
                    observation = await self._call(env.reset, row, seed)
            observation = check_reset_result(observation, self.environment, row=row_index)
            ids = encode_observation(observation, self.tokenizer, first=True)
        except Exception as err:  # noqa: BLE001 - whatever the environment does wrong fails this episode only
            self._close(key)
            return Outcome([], seconds=time.perf_counter() - start,
                           error=_reason("reset", err, self.step_timeout_s))
        return Outcome(ids, seconds=time.perf_counter() - start)

    async def _step(self, key: str, action: str, row_index: int, turn: int, closed: bool) -> Outcome:
        from services.environments import check_step_result, encode_observation

        start = time.perf_counter()
        env = self.environments.get(key)
        if env is None:  # this worker restarted since the reset: the episode's environment is gone
            return Outcome([], error=f"environment worker {self.index} lost the episode (it restarted)")
        try:
            result = check_step_result(await self._call(env.step, action), self.environment, row=row_index,
                                       turn=turn)
            ids = [] if result.done else encode_observation(result.observation, self.tokenizer, first=False,
                                                            turn_closed=closed)
            tool_calls = int(result.info.get("tool_calls", 0))
        except Exception as err:  # noqa: BLE001 - as in _reset
            self._close(key)
            return Outcome([], seconds=time.perf_counter() - start,
                           error=_reason("step", err, self.step_timeout_s))
        if result.done:
            self._close(key)
        return Outcome(ids, result.reward, result.done, tool_calls, time.perf_counter() - start)

    async def _call(self, method, *args):
        from services.environments import call_maybe_async

        return await asyncio.wait_for(call_maybe_async(method, *args), self.step_timeout_s)

    def _close(self, key: str) -> None:
        env = self.environments.pop(key, None)
        close = getattr(env, "close", None)
        if callable(close):
            try:
                close()
            except Exception:  # noqa: BLE001, S110 - an episode that is over; its close failing changes nothing
                pass


def _reason(what: str, err: Exception, timeout_s: float) -> str:
    from services.environments import EnvironmentFailure

    if isinstance(err, TimeoutError):
        return f"{what} did not return within {timeout_s:g}s (task.environment_step_timeout_s)"
    if isinstance(err, EnvironmentFailure):
        return err.reason
    return f"{what} raised {type(err).__name__}: {err}"
