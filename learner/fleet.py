"""The non-learner actors of a job, handled as one: rollout engines, references and reward actors.

Rollout, reference and reward actors restart after a crash (Ray ``max_restarts``). A restarted engine
comes back with its initial weights, so before any generation the fleet compares every actor's
reported version with the driver's and re-syncs (and probes) the ones that are behind.
"""

from __future__ import annotations

import time

import ray

from actors.engines import SamplingSettings
from actors.reference import ReferenceActor
from actors.reward import RewardActor
from actors.rollout import RolloutActor
from learner import cluster
from learner.cluster import ClusterError
from learner.config import JobConfig
from services.model_source import ModelSource


class ProbeError(RuntimeError):
    pass


def seed_for(run_seed: int, iteration: int, row: int) -> int:
    """A distinct, reproducible sampling seed per episode."""
    return (run_seed * 1_000_003 + iteration * 100_003 + row) % (2**31 - 1)


class Fleet:
    def __init__(self, cfg: JobConfig, model: ModelSource, placement, sampling: SamplingSettings, pad_id: int,
                 max_model_len: int, reward_model: ModelSource | None = None, wait: bool = True) -> None:
        """Starts every actor at once; ``wait=False`` returns before they are ready (call ``wait_ready``), so
        the caller can start the learner ranks meanwhile."""
        self.cfg, self.sampling, self.pad_id = cfg, sampling, pad_id
        c, restarts, dtype = cfg.cluster, cfg.run.actor_max_restarts, cfg.learner.dtype
        # vLLM's transfer is set up once (an NCCL group cannot take back a restarted member): there a lost
        # engine ends the job (resume it)
        transfer = None if cfg.learner.weight_sync == "object_store" else cfg.learner.weight_sync
        engine_restarts = restarts if transfer is None else 0
        # engines and the reference compute in the learner's dtype, on the device their role reserved
        self.rollouts = [
            cluster.start_actor(RolloutActor, "rollout", i, c.rollout, placement, i, cfg.rollout.engine, model,
                                cfg.run.seed + i, max_model_len, cfg.rollout.kv_cache_mib, dtype, i,
                                cfg.device("rollout"), cfg.rollout.vllm_engine_args(), transfer,
                                max_restarts=engine_restarts)
            for i in range(cfg.rollout.num_engines)
        ]
        self.references = [
            cluster.start_actor(ReferenceActor, "reference", i, c.reference, placement, i, model,
                                cfg.reference.backend, dtype, max_model_len, 128, cfg.rollout.temperature,
                                cfg.device("reference"), max_restarts=restarts)
            for i in range(cfg.reference.num_actors)
        ]
        self.rewards = [
            cluster.start_actor(RewardActor, "reward", i, c.reward, placement, i, cfg.task.name,
                                {"seed": cfg.task.seed}, model, cfg.reward.kind, reward_model,
                                cfg.reward.score_clip, cfg.device("reward"), cfg.reward.label, max_restarts=restarts)
            for i in range(cfg.reward.num_actors)
        ]
        self.all = self.rollouts + self.references + self.rewards
        self.ready_refs = [a.ready.remote() for a in self.all]
        if wait:
            self.wait_ready()

    def wait_ready(self) -> None:
        """Blocks until every actor has started; raises the first constructor's error."""
        ray.get(self.ready_refs)

    # ------------------------------------------------------------------ streaming work

    def generate(self, prompt_rows: list[int], prompt_set: list[list[int]], iteration: int,
                 slots: list[int] | None = None) -> dict[int, ray.ObjectRef]:
        """Chunk refs by slot; slot i holds rows [i*chunk, (i+1)*chunk) and goes to engine i % R."""
        size = self.cfg.rollout.chunk_size
        n_slots = (len(prompt_rows) + size - 1) // size
        refs = {}
        for i in slots if slots is not None else range(n_slots):
            rows = prompt_rows[i * size:(i + 1) * size]
            seeds = [seed_for(self.cfg.run.seed, iteration, i * size + j) for j in range(len(rows))]
            engine = self.rollouts[i % len(self.rollouts)]
            refs[i] = engine.generate.remote([prompt_set[r] for r in rows], rows, seeds, self.sampling, self.pad_id)
        return refs

    def score(self, chunk_refs: dict[int, ray.ObjectRef]) -> tuple[dict, dict]:
        """Reference log-probs and reward scores, both started on the chunk refs at once."""
        ref_refs = {i: self.references[i % len(self.references)].score.remote(ch) for i, ch in chunk_refs.items()}
        score_refs = {i: self.rewards[i % len(self.rewards)].score.remote(ch, i) for i, ch in chunk_refs.items()}
        return ref_refs, score_refs

    def evaluate(self, eval_prompts: list[list[int]], iteration: int, learner=None, weights=None,
                 policy_version: int = 0, kl_coef: float = 0.0, probe_set: tuple = ()) -> tuple[dict, list]:
        """The task's eval metrics on sampled responses to the eval prompts (retried if an actor dies),
        and the first ``metrics.eval_samples_saved`` of those samples as text."""
        keep = self.cfg.metrics.eval_samples_saved
        rows = [r for r in range(len(eval_prompts)) for _ in range(self.cfg.rollout.eval_samples_per_prompt)]
        for attempt in range(self.cfg.run.max_chunk_retries + 1):
            chunks = self.generate(rows, eval_prompts, -1 - iteration)
            try:
                parts = ray.get([self.rewards[i % len(self.rewards)].evaluate.remote(ch, i, keep)
                                 for i, ch in chunks.items()])
                break
            except ray.exceptions.RayActorError:
                if attempt == self.cfg.run.max_chunk_retries or learner is None:
                    raise
                self.bring_up_to_date(learner, weights, policy_version, kl_coef, probe_set)
        count = sum(p["count"] for p in parts)
        metrics = {k: sum(p["sums"][k] for p in parts) / count for k in parts[0]["sums"]}
        return metrics, [s for p in parts for s in p["samples"]][:keep]

    # ------------------------------------------------------------------ versions, weights, probes

    def broadcast(self, weights: ray.ObjectRef | None, policy_version: int, kl_coef: float) -> float:
        """New weights (if any) to every engine, and (version, beta) to every actor. Returns the
        slowest engine's load seconds. An actor that is down is skipped here: it comes back at version 0
        and ``bring_up_to_date`` re-syncs it."""
        calls = {i: r.update_weights.remote(weights, policy_version, kl_coef) for i, r in enumerate(self.rollouts)} \
            if weights is not None else {}
        calls |= {i: a.set_state.remote(policy_version, kl_coef) for i, a in enumerate(self.all) if i not in calls}
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
        try:
            return ray.get(call, timeout=self.cfg.learner.collective_timeout_s)
        except ray.exceptions.GetTimeoutError as err:
            role, i = cluster.roles(self.cfg)[actor_index]  # self.all is in bundle order
            raise ClusterError(f"{role}-{i} did not answer {what} within "
                               f"{self.cfg.learner.collective_timeout_s:.0f}s (learner.collective_timeout_s)") from err

    def states(self, learner=None, weights=None, policy_version: int = 0, kl_coef: float = 0.0,
               probe_set: tuple = ()) -> list[dict]:
        """Every actor's (name, version, beta); an actor that died meanwhile is brought up to date first."""
        for attempt in range(self.cfg.run.max_chunk_retries + 1):
            try:
                return ray.get([a.get_state.remote() for a in self.all])
            except ray.exceptions.RayActorError:
                if learner is None or attempt == self.cfg.run.max_chunk_retries:
                    raise
                self.bring_up_to_date(learner, weights, policy_version, kl_coef, probe_set)
        raise AssertionError("unreachable")

    def probe(self, learner, sequences: list[list[int]], prompt_lengths: list[int], engines=None) -> float:
        """Max |engine - learner| log-prob over a fixed probe batch; raises ProbeError past tolerance."""
        expected = learner.probe(sequences, prompt_lengths)
        worst = 0.0
        for engine in engines if engines is not None else self.rollouts:
            try:
                got = self._get(engine.probe.remote(sequences, prompt_lengths), self.all.index(engine), "the probe")
            except ray.exceptions.RayActorError:
                if engines is not None:
                    raise
                continue  # down now; it is re-synced and probed when it is back
            error = max(abs(a - b) for e, g in zip(expected, got, strict=True) for a, b in zip(e, g, strict=True))
            if error > self.cfg.probe_tolerance:
                raise ProbeError(f"weight sync probe failed: engine log-probs differ from the learner's by "
                                 f"{error:.2e} > the probe tolerance {self.cfg.probe_tolerance} "
                                 f"(run.probe_tolerance, learner.dtype={self.cfg.learner.dtype})")
            worst = max(worst, error)
        return worst

    def bring_up_to_date(self, learner, weights: ray.ObjectRef | None, policy_version: int, kl_coef: float,
                         probe_set: tuple, timeout_s: float = 300.0) -> list[dict]:
        """Re-sync every actor whose reported version or beta differs from the driver's (a restarted
        one comes back at version 0); engines must pass the probe before they generate again."""
        deadline = time.monotonic() + timeout_s
        resynced = []
        for actor in self.all:
            while True:
                try:
                    state = ray.get(actor.get_state.remote(), timeout=max(deadline - time.monotonic(), 1))
                    break
                except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as err:
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"actor did not come back within {timeout_s:.0f}s: {err}") from err
                    time.sleep(1.0)
            if state["policy_version"] == policy_version and state["kl_coef"] == kl_coef:
                continue
            if actor in self.rollouts and state["policy_version"] != policy_version:
                if weights is None:
                    weights = learner.policy_weights()
                ray.get(actor.update_weights.remote(weights, policy_version, kl_coef))
                probe_error = self.probe(learner, *probe_set, engines=[actor])
                resynced.append({"actor": state["name"], "from_version": state["policy_version"],
                                 "to_version": policy_version, "probe_max_abs_error": probe_error})
            else:
                ray.get(actor.set_state.remote(policy_version, kl_coef))
                resynced.append({"actor": state["name"], "from_version": state["policy_version"],
                                 "to_version": policy_version})
        return resynced

    def take_busy_seconds(self) -> dict[str, float]:
        busy = []
        for call in [a.take_busy_seconds.remote() for a in self.all]:
            try:
                busy.append(ray.get(call))
            except ray.exceptions.RayActorError:
                busy.append(0.0)  # died since: its busy time went with it
        r, f = len(self.rollouts), len(self.references)
        return {"generate_seconds": sum(busy[:r]), "reference_seconds": sum(busy[r:r + f]),
                "reward_seconds": sum(busy[r + f:])}
