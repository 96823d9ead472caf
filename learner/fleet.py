"""The non-learner actors of a job, handled as one: rollout engines, references and reward actors.

Rollout, reference and reward actors restart after a crash (Ray ``max_restarts``). A restarted engine
comes back with its initial weights, so before any generation the driver's ``WeightSync`` compares every
actor's reported version with its own and re-syncs (and probes) the ones that are behind.
"""

from __future__ import annotations

from collections.abc import Callable

import ray

from actors.environment import EnvironmentWorker
from actors.reference import ReferenceActor, TeacherActor
from actors.reward import RewardActor
from actors.rollout import RolloutActor
from learner import cluster
from learner.cluster import ClusterError, Placement
from learner.plan import FleetSpec
from learner.records import ChunkRefs
from services.cpu_share import cpu_share
from services.errors import TetherError

# a rollout actor's concurrent calls with in-flight updates (its chunks, a load, the probe)
IN_FLIGHT_THREADS = 16


class ProbeError(TetherError, RuntimeError):
    pass


def seed_for(run_seed: int, iteration: int, row: int) -> int:
    """A distinct, reproducible sampling seed per episode."""
    return (run_seed * 1_000_003 + iteration * 100_003 + row) % (2**31 - 1)


def chunk_layout(prompt_rows: list[int], samples_per_prompt: int,
                 chunk_size: int) -> list[tuple[list[int], list[int]]]:
    """Per chunk slot: (the prompt row of each episode, its group id). Each prompt is sampled
    ``samples_per_prompt`` (n) times in a row: episode e samples ``prompt_rows[e // n]``, in group e // n,
    and slot i holds episodes [i*chunk_size, (i+1)*chunk_size). A chunk size that is a multiple of n keeps
    every group inside one chunk, and so on one learner rank."""
    episodes = [r for r in prompt_rows for _ in range(samples_per_prompt)]
    return [(episodes[start:start + chunk_size],
             [e // samples_per_prompt for e in range(start, min(start + chunk_size, len(episodes)))])
            for start in range(0, len(episodes), chunk_size)]


class Fleet:
    def __init__(self, spec: FleetSpec, placement: Placement | None, wait: bool = True) -> None:
        """Starts every actor at once; ``wait=False`` returns before they are ready (call ``wait_ready``), so
        the caller can start the learner ranks meanwhile."""
        self.spec = spec

        def start(cls, role: str, specs: tuple, restarts: int, threads: int = 1) -> list:
            group = placement if role != "environment" else None  # environment workers: outside the bundles
            return [cluster.start_actor(cls, role, i, spec.resources[role], group, i, actor_spec,
                                        max_restarts=restarts, max_concurrency=threads)
                    for i, actor_spec in enumerate(specs)]

        # in-flight updates: a weight load, the probe and an evaluation reach the engine while chunks generate
        in_flight = bool(spec.rollouts) and spec.rollouts[0].engine.in_flight != "off"
        self.rollouts = start(RolloutActor, "rollout", spec.rollouts, spec.engine_restarts,
                              threads=IN_FLIGHT_THREADS if in_flight else 1)
        self.references = start(ReferenceActor, "reference", spec.references, spec.restarts)
        self.rewards = start(RewardActor, "reward", spec.rewards, spec.restarts)
        self.teachers = start(TeacherActor, "teacher", spec.teachers, spec.restarts)
        self.all = self.rollouts + self.references + self.rewards + self.teachers  # bundle order (spec.roles)
        self.environment_workers = start(EnvironmentWorker, "environment", spec.environments, spec.restarts)
        self.ready_refs = [a.ready.remote() for a in self.all + self.environment_workers]
        if wait:
            self.wait_ready()

    def wait_ready(self) -> None:
        """Blocks until every actor has started; raises the first constructor's error. ``niceness``: each
        actor's in ``all``'s order."""
        self.niceness: list[int] = ray.get(self.ready_refs)[:len(self.all)]

    # ------------------------------------------------------------------ streaming work

    def generate(self, prompt_rows: list[int], prompt_set: list[list[int]], iteration: int,
                 slots: list[int] | None = None,
                 samples_per_prompt: int | None = None) -> dict[int, ray.ObjectRef]:
        """Chunk refs by slot (``chunk_layout``: each prompt sampled ``samples_per_prompt`` times, default
        ``rollout.samples_per_prompt``); slot i goes to engine i % R, every episode with its own seed."""
        spec = self.spec
        size = spec.chunk_size
        n = spec.samples_per_prompt if samples_per_prompt is None else samples_per_prompt
        layout = chunk_layout(prompt_rows, n, size)
        refs = {}
        for i in slots if slots is not None else range(len(layout)):
            rows, groups = layout[i]
            seeds = [seed_for(spec.run_seed, iteration, i * size + j) for j in range(len(rows))]
            engine = self.rollouts[i % len(self.rollouts)]
            if self.environment_workers:  # multi-turn episodes: the prompt set holds the rows to reset from
                refs[i] = engine.run_episodes.remote([prompt_set[r] for r in rows], rows, seeds,
                                                     spec.sampling, spec.pad_id, groups,
                                                     self.environment_workers, spec.episode_limits,
                                                     first_worker=i * size)
                continue
            if spec.agent_settings is not None:  # agent programs: the prompt set holds the rows they get
                refs[i] = engine.run_agents.remote([prompt_set[r] for r in rows], rows, seeds, spec.sampling,
                                                   spec.pad_id, groups, spec.agent_settings)
                continue
            refs[i] = engine.generate.remote([prompt_set[r] for r in rows], rows, seeds, spec.sampling,
                                             spec.pad_id, groups)
        return refs

    def chunks(self, prompt_rows: list[int], prompt_set: list[list[int]], iteration: int,
               slots: list[int] | None = None) -> dict[int, ChunkRefs]:
        """``generate`` then ``score``: each training chunk's refs, by slot."""
        return self.score(self.generate(prompt_rows, prompt_set, iteration, slots=slots))

    def score(self, rollout_refs: dict[int, ray.ObjectRef],
              roles: tuple[str, ...] = ("reference", "score", "teacher")) -> dict[int, ChunkRefs]:
        """Each chunk's refs (``ChunkRefs``): the reference's log-probs, the reward's scores and
        (distillation) the teacher's log-probs, all started on the rollout refs at once, for the ``roles``
        that have actors: none where the learner ranks score it (reference.placement and reward.placement
        learner, LoRA's base reference), or without a teacher."""
        held = {"reference": self.references, "score": self.rewards, "teacher": self.teachers}
        chunks = {}
        for i, rollout in rollout_refs.items():
            refs = {}
            for role in roles:
                if actors := held[role]:
                    actor = actors[i % len(actors)]  # a reward actor takes the slot too (its samples' rows)
                    refs[role] = (actor.score.remote(rollout, i) if role == "score"
                                  else actor.score.remote(rollout))
            chunks[i] = ChunkRefs(rollout, **refs)
        return chunks

    def evaluate(self, eval_prompts: list[list[int]], iteration: int,
                 resync: Callable[[], object] | None = None, learner=None,
                 with_kl: bool = True) -> tuple[dict, list, dict | None]:
        """The task's eval metrics on sampled responses to the eval prompts, the first
        ``metrics.eval_samples_saved`` of those samples as text, and with ``learner`` (a ``LearnerGroup``) and
        ``with_kl`` the KL of the current policy to the reference on these fresh samples
        (``kl_stats_from_sums``: per episode, the learner's log-probs against the reference's; on-policy in
        every mode). With reward.placement learner the ranks of ``learner`` evaluate the chunks. An actor that
        dies is re-synced with ``resync`` (``WeightSync.bring_up_to_date``) and the evaluation retried;
        without it, it fails."""
        keep, retries = self.spec.eval_samples_saved, self.spec.max_chunk_retries
        rows = [r for r in range(len(eval_prompts)) for _ in range(self.spec.eval_samples_per_prompt)]
        for attempt in range(retries + 1):
            chunks = self.generate(rows, eval_prompts, -1 - iteration, samples_per_prompt=1)
            try:
                calls = ([self.rewards[i % len(self.rewards)].evaluate.remote(ch, i, keep)
                          for i, ch in chunks.items()]
                         if self.rewards else None)  # none with reward.placement learner: the ranks evaluate
                kl = None
                # no reference actors: the ranks score the reference themselves
                if learner is not None and with_kl:
                    kl = learner.evaluation_kl(self.score(chunks, roles=("reference",)))
                parts = ray.get(calls) if calls is not None else learner.evaluate_rewards(chunks, keep)
                break
            except ray.exceptions.RayActorError:
                if attempt == retries or resync is None:
                    raise
                resync()
        count = sum(p["count"] for p in parts)
        metrics = {k: sum(p["sums"][k] for p in parts) / count for k in parts[0]["sums"]}
        return metrics, [s for p in parts for s in p["samples"]][:keep], kl

    # ------------------------------------------------------------------ versions, weights, probes

    def broadcast(self, weights: ray.ObjectRef | None, policy_version: int, kl_coef: float) -> float:
        """New weights (if any) to every engine, and (version, beta) to every actor. Returns the
        slowest engine's load seconds. An actor that is down is skipped here: it comes back at version 0
        and ``WeightSync.bring_up_to_date`` re-syncs it."""
        calls = {i: r.update_weights.remote(weights, policy_version, kl_coef)
                 for i, r in enumerate(self.rollouts)} if weights is not None else {}
        calls |= {i: a.set_state.remote(policy_version, kl_coef) for i, a in enumerate(self.all)
                  if i not in calls}
        seconds = [0.0]
        for i, call in calls.items():
            try:
                result = self._get(call, i, f"the sync of version {policy_version}")
            except ray.exceptions.RayActorError:
                continue
            if isinstance(result, float):
                seconds.append(result)
        return max(seconds)

    def _get(self, call: ray.ObjectRef, actor_index: int, what: str):
        """``ray.get`` bounded by ``learner.collective_timeout_s``; a silent actor is named, never waited on
        forever."""
        timeout = self.spec.collective_timeout_s
        try:
            return ray.get(call, timeout=timeout)
        except ray.exceptions.GetTimeoutError as err:
            role, i = self.spec.roles[actor_index]  # self.all is in bundle order
            raise ClusterError(f"{role}-{i} did not answer {what} within {timeout:.0f}s "
                               "(learner.collective_timeout_s)") from err

    def probe(self, learner, sequences: list[list[int]], prompt_lengths: list[int], engines=None) -> float:
        """Max |engine - learner| log-prob over a fixed probe batch; raises ProbeError past tolerance."""
        named, engines = engines is not None, engines if engines is not None else self.rollouts
        # the engines score while the learner does: the probe costs the slower of the two, not their sum
        calls = [engine.probe.remote(sequences, prompt_lengths) for engine in engines]
        expected = learner.probe(sequences, prompt_lengths)
        worst = 0.0
        for engine, call in zip(engines, calls, strict=True):
            try:
                got = self._get(call, self.all.index(engine), "the probe")
            except ray.exceptions.RayActorError:
                if named:
                    raise
                continue  # down now; it is re-synced and probed when it is back
            error = max(abs(a - b) for e, g in zip(expected, got, strict=True)
                        for a, b in zip(e, g, strict=True))
            if error > self.spec.probe_tolerance:
                raise ProbeError(f"weight sync probe failed: engine log-probs differ from the learner's by "
                                 f"{error:.2e} > the probe tolerance {self.spec.probe_tolerance} "
                                 f"(run.probe_tolerance, learner.dtype={self.spec.dtype})")
            worst = max(worst, error)
        return worst

    def take_counts(self) -> dict[str, float]:
        """Per role since the last call: busy seconds (generate_seconds, reference_seconds, reward_seconds),
        the share of the time its processes were ready to run that they ran (rollout_cpu_share, ...: under
        1 when they waited for a core) and a judge's answers (reward_judge_answers,
        reward_judge_unparseable)."""
        totals: dict[str, float] = {}
        cpu: dict[str, list[float]] = {}
        roles = (["rollout"] * len(self.rollouts) + ["reference"] * len(self.references)
                 + ["reward"] * len(self.rewards) + ["teacher"] * len(self.teachers))
        for role, call in zip(roles, [a.take_counts.remote() for a in self.all], strict=True):
            try:
                counts = ray.get(call)
            except ray.exceptions.RayActorError:
                counts = {}  # died since: its counts went with it
            busy_key = "generate_seconds" if role == "rollout" else f"{role}_seconds"
            totals[busy_key] = totals.get(busy_key, 0.0) + counts.pop("busy_seconds", 0.0)
            run_wait = cpu.setdefault(role, [0.0, 0.0])
            run_wait[0] += counts.pop("cpu_seconds", 0.0)
            run_wait[1] += counts.pop("cpu_wait_seconds", 0.0)
            for name, value in counts.items():
                totals[f"{role}_{name}"] = totals.get(f"{role}_{name}", 0) + value
        for role, (run, wait) in cpu.items():
            if (share := cpu_share(run, wait)) is not None:
                totals[f"{role}_cpu_share"] = share
        return totals
