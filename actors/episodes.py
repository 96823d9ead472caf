"""Multi-turn episodes on one rollout engine: all episodes of a chunk advance turn by turn together.

Each turn is one batched engine call over every episode still running (the engine's prefix cache holds the
trajectories so far); then the environment workers step every episode's environment at once, outside the
engine's process. Token-in/token-out: the model's ids go into the trajectory as the engine sampled them,
never decoded and encoded again; each observation is encoded once, by the worker, and appended as ids
(docs/agents-and-environments.md, "The KL of a trajectory"). An episode whose environment failed is generated
again from its reset, and counted.
"""

from __future__ import annotations

import threading
import time
import uuid
from dataclasses import dataclass, field

from actors.engines import Engine, SamplingSettings


@dataclass
class EpisodeLimits:
    """One episode's bounds and the environment's tolerances (``rollout.max_turns``,
    ``rollout.max_trajectory_tokens``, ``task.max_prompt_tokens``, ``task.environment_*``)."""

    max_turns: int
    max_trajectory_tokens: int
    max_prompt_tokens: int
    step_timeout_s: float
    max_failures: int
    environment: str  # its package.module:factory, to name it in errors


@dataclass
class Episode:
    row: dict
    row_index: int
    seed: int
    worker: int
    episode: int  # its position in the chunk
    key: str = ""
    prompt: list[int] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)  # the trajectory after the prompt
    action_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    # in-flight updates: each sampled token's version, else -1
    versions: list[int] = field(default_factory=list)
    turn_rewards: list[float] = field(default_factory=list)
    turns: int = 0
    tool_calls: int = 0
    seconds: float = 0.0
    done: bool = False
    truncated: bool = False
    failure: str | None = None
    failed_turn: int = 0
    lost_with: int | None = None  # the worker whose loss failed it, with every episode that worker held
    turn_closed: bool = True  # the last model turn ended with its EOS (not at rollout.max_new_tokens)
    failures: int = 0  # failed attempts of this row before this one

    @property
    def finish_reason(self) -> int:
        from services.experience import FINISH_LENGTH, FINISH_STOP

        return FINISH_LENGTH if self.truncated else FINISH_STOP

    def append(self, ids: list[int], sampled: bool, logprobs: list[float] | None = None,
               versions: list[int] | None = None) -> None:
        self.ids += ids
        self.action_mask += [int(sampled)] * len(ids)
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(ids)
        self.versions += versions if versions is not None else [-1] * len(ids)
        self.turn_rewards += [0.0] * len(ids)


class EpisodeRunner:
    """Runs one chunk of episodes on ``engine`` with the environment ``workers`` (Ray actor handles)."""

    def __init__(self, engine: Engine, tokenizer, workers: list, limits: EpisodeLimits) -> None:
        self.engine, self.tokenizer, self.workers, self.limits = engine, tokenizer, workers, limits
        self.failures = 0  # over the engine's life: the job fails past limits.max_failures
        self.failures_lock = threading.Lock()  # in-flight updates: chunks of two batches run at once

    def run(self, rows: list[dict], row_index: list[int], seeds: list[int], sampling: SamplingSettings,
            first_worker: int = 0) -> list[Episode]:
        """Every episode to its end, in order; those whose environment failed are generated again (with
        another seed, on another worker) until they succeed, each counting its failed attempts."""
        episodes = [Episode(row, index, seed, (first_worker + i) % len(self.workers), i)
                    for i, (row, index, seed) in enumerate(zip(rows, row_index, seeds, strict=True))]
        pending, attempt = episodes, 0
        while pending:
            self._run_once(pending, sampling)
            failed = [e for e in pending if e.failure is not None]
            # a worker lost is one failure, not one per episode it held: only one of them can be the cause
            lost = {e.lost_with: e for e in failed if e.lost_with is not None}
            for episode in [e for e in failed if e.lost_with is None] + list(lost.values()):
                self._count_failure(episode)
            attempt += 1
            pending = [self._again(e, attempt) for e in failed]
            for fresh in pending:
                episodes[fresh.episode] = fresh
        return episodes

    def _again(self, episode: Episode, attempt: int) -> Episode:
        return Episode(episode.row, episode.row_index, (episode.seed + 7_919 * attempt) % (2**31 - 1),
                       (episode.worker + 1) % len(self.workers), episode.episode, seconds=episode.seconds,
                       failures=episode.failures + 1)

    def _count_failure(self, episode: Episode) -> None:
        from services.environments import EnvironmentFailure

        with self.failures_lock:
            self.failures += 1
        if self.failures > self.limits.max_failures:
            raise EnvironmentFailure(self.limits.environment, f"{episode.failure} ({self.failures} failed "
                                     "episodes on this engine, more than task.environment_max_failures="
                                     f"{self.limits.max_failures})", episode.row_index, episode.failed_turn)

    # ------------------------------------------------------------------ one attempt of a set of episodes

    def _run_once(self, episodes: list[Episode], sampling: SamplingSettings) -> None:
        batch_key = uuid.uuid4().hex[:12]
        for i, episode in enumerate(episodes):
            episode.key = f"{batch_key}-{i}"
        self._reset(episodes)
        for turn in range(1, self.limits.max_turns + 1):
            running = [e for e in episodes if not e.done and e.failure is None]
            if not running:
                break
            self._model_turn(running, sampling, turn)
            acting = [e for e in running if not e.done]
            if acting:
                self._environment_turn(acting, turn, last=turn == self.limits.max_turns)
        for episode in episodes:
            if not episode.done and episode.failure is None:  # out of turns: cut, as by the token budget
                episode.done = episode.truncated = True
        live = [e for e in episodes if e.failure is None]
        self._on_workers(live, "close", lambda e: (), wait=False)

    def _reset(self, episodes: list[Episode]) -> None:
        outcomes = self._on_workers(episodes, "reset", lambda e: (e.row, e.row_index, e.seed))
        for episode, outcome in zip(episodes, outcomes, strict=True):
            episode.seconds += outcome.seconds
            if outcome.error is not None:
                episode.failure, episode.failed_turn, episode.lost_with = (outcome.error, 0,
                                                                           outcome.lost_worker)
            elif len(outcome.ids) > self.limits.max_prompt_tokens:
                from services.environments import EnvironmentFailure

                # bad input, not a fault to retry: the same row resets to the same prompt
                raise EnvironmentFailure(self.limits.environment, f"the first observation (the prompt) is "
                                         f"{len(outcome.ids)} tokens, more than task.max_prompt_tokens="
                                         f"{self.limits.max_prompt_tokens}", episode.row_index, 0)
            else:
                episode.prompt = outcome.ids

    def _model_turn(self, running: list[Episode], sampling: SamplingSettings, turn: int) -> None:
        """One engine call for every running episode: its turn, up to its EOS, within the token budget."""
        budget = [self.limits.max_trajectory_tokens - len(e.ids) for e in running]
        generations = self.engine.generate([e.prompt + e.ids for e in running], sampling,
                                           [(e.seed + 104_729 * turn) % (2**31 - 1) for e in running], budget)
        for episode, generation, left in zip(running, generations, budget, strict=True):
            episode.append(generation.response_ids, True, generation.logprobs, generation.versions)
            episode.turns += 1
            episode.turn_closed = self._ends_turn(generation)
            if len(generation.response_ids) >= left and not self._ends_turn(generation):
                episode.done = episode.truncated = True  # the budget ran out inside the model's turn

    def _ends_turn(self, generation) -> bool:
        from services.experience import FINISH_STOP

        return generation.finish_reason == FINISH_STOP

    def _environment_turn(self, acting: list[Episode], turn: int, last: bool) -> None:
        """Every acting episode's environment takes the model's turn as text; the turn's reward lands on the
        turn's last model token, the observation's ids follow as context."""
        actions = {e.key: self.tokenizer.decode(e.ids[len(e.ids) - self._turn_length(e):],
                                                skip_special_tokens=True)
                   for e in acting}
        outcomes = self._on_workers(acting, "step",
                                    lambda e: (actions[e.key], e.row_index, turn, e.turn_closed))
        for episode, outcome in zip(acting, outcomes, strict=True):
            episode.seconds += outcome.seconds
            if outcome.error is not None:
                episode.failure, episode.failed_turn, episode.lost_with = (outcome.error, turn,
                                                                           outcome.lost_worker)
                continue
            episode.turn_rewards[-1] += outcome.reward
            episode.tool_calls += outcome.tool_calls
            if outcome.done:
                episode.done = True
                continue
            if last:
                continue  # no model turn follows: the observation would be context for nothing
            room = self.limits.max_trajectory_tokens - len(episode.ids)
            episode.append(outcome.ids[:room], False)
            if len(outcome.ids) >= room:  # no room left for the model's next turn: cut here
                episode.done = episode.truncated = True

    @staticmethod
    def _turn_length(episode: Episode) -> int:
        """Tokens of the episode's last model turn (the sampled ids at the end of its trajectory)."""
        n = 0
        for sampled in reversed(episode.action_mask):
            if not sampled:
                break
            n += 1
        return n

    def _on_workers(self, episodes: list[Episode], method: str, arguments, wait: bool = True) -> list:
        """``method`` of every episode's worker, one call per worker with its episodes; the outcomes in the
        order of ``episodes``. A worker that dies or does not answer in time fails its episodes."""
        import ray

        from actors.environment import Outcome

        by_worker: dict[int, list[int]] = {}
        for i, episode in enumerate(episodes):
            by_worker.setdefault(episode.worker, []).append(i)
        calls = {}
        for worker, members in by_worker.items():
            columns = list(zip(*(arguments(episodes[i]) for i in members), strict=True)) or []
            keys = [episodes[i].key for i in members]
            calls[worker] = getattr(self.workers[worker], method).remote(keys, *map(list, columns))
        if not wait:
            return []
        outcomes: list = [None] * len(episodes)
        # the worker runs its episodes' calls concurrently, each under the step deadline: a whole call that
        # takes much longer is a worker that hangs (an environment that holds the interpreter) or died
        deadline = time.monotonic() + 2 * self.limits.step_timeout_s + 30
        for worker, call in calls.items():
            try:
                results = ray.get(call, timeout=max(deadline - time.monotonic(), 1.0))
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as err:
                what = "died" if isinstance(err, ray.exceptions.RayActorError) else "did not answer in time"
                rows = ", ".join(str(episodes[i].row_index) for i in by_worker[worker])
                results = [Outcome([], error=f"environment worker {worker} {what} during {method} "
                                   f"(it held the episodes of rows {rows})",
                                   lost_worker=worker)] * len(by_worker[worker])
            for i, outcome in zip(by_worker[worker], results, strict=True):
                outcomes[i] = outcome
        return outcomes
