"""LearnerGroup: W DeepSpeed ranks as Ray actors, driven as one."""

from __future__ import annotations

import time

import ray

from learner.cluster import ClusterError, Placement, start_actor
from learner.kl import kl_stats_from_sums
from learner.plan import RankSpec
from learner.rank import LearnerRank
from learner.records import Admission, ChunkRefs, UpdateResult
from services.cpu_share import cpu_share


def rank_slots(slots, world_size: int) -> list[list[int]]:
    """Each rank's chunk slots, in order: slot i goes to rank i % W. A whole chunk goes to one rank, so a
    chunk of whole prompt groups keeps each group on one rank (``learner.fleet.chunk_layout``)."""
    return [[s for s in sorted(slots) if s % world_size == r] for r in range(world_size)]


class LearnerGroup:
    def __init__(self, spec: RankSpec, placement: Placement | None, tag: str = "",
                 ranks: list | None = None) -> None:
        """``ranks``: the live ranks of an earlier group of this world size, to set up again with ``spec``
        instead of starting new ones (tests share them: a rank's start, its imports, costs several times its
        set-up). A job starts its own."""
        self.world_size = spec.learner.world_size
        self.collective_timeout_s = spec.learner.collective_timeout_s
        self.weight_sync_timeout_s = spec.learner.weight_sync_timeout_s
        self.weights_bytes: int | None = None  # of the last weights put in the object store
        if ranks is not None and len(ranks) != self.world_size:
            raise ValueError(f"{len(ranks)} ranks given for learner.world_size={self.world_size}")
        self.ranks = ranks or [
            start_actor(LearnerRank, "learner", i, spec.resources, placement, i, self.world_size, tag=tag)
            for i in range(self.world_size)
        ]
        master_addr, master_port = ray.get(self.ranks[0].address.remote())
        setups = [rank.setup.remote(master_addr, master_port, spec) for rank in self.ranks]
        self.niceness: list[int] = self._get(setups, "setup")

    def _get(self, refs: list, what: str, ranks: list[int] | None = None):
        """ray.get over ``refs`` (one per rank in ``ranks``, default all), within
        ``learner.collective_timeout_s``. A lost rank ends the job with a message naming it; so do
        ranks that do not answer in time (a collective that hangs waits for the ones that are named)."""
        ranks = list(range(len(refs))) if ranks is None else ranks
        rank_of = dict(zip(refs, ranks, strict=True))
        timeout = self.collective_timeout_s
        deadline = time.monotonic() + timeout
        pending = list(refs)
        while pending:
            done, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not done:
                late = sorted(rank_of[ref] for ref in pending)
                answered = sorted(set(ranks) - set(late))
                raise ClusterError(
                    f"learner rank(s) {late} did not finish {what} within {timeout:.0f}s "
                    f"(learner.collective_timeout_s); rank(s) {answered} did")
            for ref in done:
                try:
                    ray.get(ref)
                except ray.exceptions.RayActorError as err:
                    raise ClusterError(f"learner rank {rank_of[ref]} (actor learner-rank-{rank_of[ref]}) "
                                       f"died during {what}: {err}") from err
        return ray.get(refs)

    def collect(self, chunks: dict[int, ChunkRefs], admission: Admission | None = None) -> list[int]:
        """Chunk slot i goes to rank i % W, which fetches it and runs its forward. Returns the slots lost to
        dead actors, or with rows ``admission`` refuses (another version or beta; async: too stale), to
        regenerate and collect again, with only those slots."""
        by_rank = rank_slots(chunks, self.world_size)
        calls = [rank.collect.remote(slots, [chunks[s] for s in slots], admission)
                 for rank, slots in zip(self.ranks, by_rank, strict=True)]
        return sorted(s for result in self._get(calls, "collect") for s in result["failed"])

    def evaluation_kl(self, chunks: dict[int, ChunkRefs]) -> dict:
        """The KL of the current policy to the reference on evaluation chunks (``kl_stats_from_sums``, k1 per
        episode): chunk slot i goes to rank i % W, as in ``collect``."""
        by_rank = rank_slots(chunks, self.world_size)
        calls = [rank.evaluation_kl.remote([chunks[s] for s in slots])
                 for rank, slots in zip(self.ranks, by_rank, strict=True)]
        parts = [part for part in self._get(calls, "the evaluation's KL") if part]
        return kl_stats_from_sums({k: sum(part[k] for part in parts) for k in parts[0]})

    def evaluate_rewards(self, chunk_refs: dict[int, object], keep_samples: int) -> list[dict]:
        """reward.placement learner: each evaluation chunk's metrics from the rank it goes to (slot i to rank
        i % W), in slot order, as the reward actors' ``evaluate`` gives them."""
        by_rank = rank_slots(chunk_refs, self.world_size)
        calls = [rank.evaluate_rewards.remote([chunk_refs[s] for s in slots], slots, keep_samples)
                 for rank, slots in zip(self.ranks, by_rank, strict=True)]
        parts = [p for parts in self._get(calls, "the evaluation's rewards") for p in parts]
        return [part for _, part in sorted(parts, key=lambda p: p[0])]

    def cpu_share(self) -> float | None:
        """The ranks' share of the time their threads were ready to run that they ran, since the last call."""
        run, wait = map(sum, zip(*self._get([r.cpu_seconds.remote() for r in self.ranks], "cpu_seconds"),
                                 strict=True))
        return cpu_share(run, wait)

    def differing_groups(self) -> list[int]:
        """Dynamic sampling: per rank, the whole groups it has collected whose scores differ (penalties
        applied)."""
        return self._get([rank.differing_groups.remote() for rank in self.ranks], "the count of groups")

    def update(self, kl_coef: float, iteration: int) -> UpdateResult:
        """Every rank trains at once on what it collected. Returns their results combined."""
        return UpdateResult.combine(self._get([rank.update.remote(kl_coef, iteration) for rank in self.ranks],
                                              "update"))

    def policy_weights(self, adapter: bool = False) -> ray.ObjectRef:
        """Rank 0's full weights (``adapter``: its LoRA adapter alone) as an ObjectRef: the driver passes it
        on without materialising it."""
        # rank 0 puts the weights in the object store and returns only [ref, bytes]: small enough to get here
        ref, self.weights_bytes = self._get([rank.policy_state_dict.remote(adapter=adapter)
                                             for rank in self.ranks], "weight gather")[0]
        return ref

    def probe(self, sequences: list[list[int]], prompt_lengths: list[int]) -> list[list[float]]:
        return self._get([r.probe_logprobs.remote(sequences, prompt_lengths) for r in self.ranks], "probe")[0]

    def save(self, storage_url: str) -> list[dict]:
        """Every rank saves its engine (policy, value head, optimizer) locally and uploads it under
        ``learner/`` of the checkpoint storage; returns each rank's {relative path: {sha256, bytes}}."""
        return self._get([r.save_checkpoint.remote(storage_url) for r in self.ranks], "checkpoint save")

    def load(self, storage_url: str, manifest: dict, saved_world_size: int) -> None:
        """Every rank downloads what it needs (verified against ``manifest``) and loads it; a checkpoint
        written by another number of ranks is re-partitioned for this group."""
        from learner.checkpoint import CheckpointError

        try:
            self._get([r.load_checkpoint.remote(storage_url, manifest, saved_world_size) for r in self.ranks],
                      "checkpoint load")
        except ray.exceptions.RayTaskError as err:
            if isinstance(err.cause, CheckpointError):
                raise CheckpointError(str(err.cause)) from err
            raise

    def export_hf(self, storage_url: str) -> None:
        """The policy as a Hugging Face model directory (safetensors, config, tokenizer) at ``storage_url``;
        rank 0 writes it (every rank takes part in the gather under ZeRO-3)."""
        self._get([r.export_hf.remote(storage_url) for r in self.ranks], "Hugging Face export")

    def weight_metadata(self) -> list[tuple[str, str, list[int]]]:
        """``[(name, dtype, full HF shape)]`` of what the engines receive (rank 0's announcement, no
        collective)."""
        return self._get([self.ranks[0].weight_metadata.remote()], "weight metadata")[0]

    def connect_engines(self, rollouts: list, backend: str, buffer_bytes: int,
                        workers_per_engine: int = 1) -> None:
        """GPU weight transfer through vLLM's API (``learner.weight_transfer``): every rank builds its
        trainer engine; rank 0 also sets up the engines' side (``nccl``: one group of rank 0 and every
        engine worker; ``ipc``: engines on the learner's GPUs)."""
        if backend == "ipc":
            from learner.weight_transfer import check_ipc_colocation

            check_ipc_colocation(ray.get([r.gpu_location.remote() for r in rollouts]),
                                 self._get([rank.gpu_location.remote() for rank in self.ranks], "GPU lookup"))
        master_addr, master_port = ray.get(self.ranks[0].address.remote())
        self._get([rank.init_weight_transfer.remote(backend, rollouts, workers_per_engine, master_addr,
                                                    master_port, buffer_bytes, self.collective_timeout_s)
                   for rank in self.ranks], "weight-transfer setup")

    def send_weights(self, rollouts: list, policy_version: int, kl_coef: float) -> float:
        """Full weights to every engine through vLLM's transfer, then their new version and beta; returns
        the seconds it took. Every rank takes part (ZeRO-3 gathers each parameter)."""
        start = time.perf_counter()
        processes = ray.get([r.alive.remote() for r in rollouts])
        sends = [rank.send_weights.remote(policy_version) for rank in self.ranks]
        watch_transfer(sends, rollouts, processes, self.weight_sync_timeout_s)
        self._get(sends, "weight transfer")
        ray.get([r.set_state.remote(policy_version, kl_coef) for r in rollouts])
        return time.perf_counter() - start


def watch_transfer(sends: list, rollouts: list, processes: list[int], timeout_s: float,
                   poll_s: float = 2.0) -> None:
    """Wait for the ranks' ``sends`` of a weight transfer through vLLM (NCCL, IPC), asking the engines
    ``rollouts`` whether they are alive as they are every ``poll_s`` (``Answering.alive``, on a thread of
    their own, answers while an engine receives). vLLM's broadcast blocks rank 0 until every engine has
    received, so an engine that dies, or restarts (its process id no longer ``processes``), would hold the
    transfer until ``learner.collective_timeout_s``: ClusterError naming it at once instead, and one at
    ``timeout_s`` naming the engines that do not answer."""
    deadline = time.monotonic() + timeout_s
    while True:
        _, pending = ray.wait(sends, num_returns=len(sends), timeout=min(poll_s, timeout_s))
        if not pending:
            return
        pings = [r.alive.remote() for r in rollouts]
        answered, _ = ray.wait(pings, num_returns=len(pings), timeout=poll_s)
        for i, ping in enumerate(pings):
            if ping not in answered:
                continue
            try:
                pid = ray.get(ping)
            except ray.exceptions.RayActorError as err:
                raise ClusterError(f"rollout engine {i} (actor rollout-{i}) died during the weight transfer: "
                                   f"{' '.join(str(err).split())[:300]}") from err
            if pid != processes[i]:
                raise ClusterError(f"rollout engine {i} (actor rollout-{i}) restarted during the weight "
                                   "transfer (its process changed): the transfer it was in cannot finish")
        if time.monotonic() > deadline:
            silent = [i for i, ping in enumerate(pings) if ping not in answered]
            raise ClusterError(f"the weight transfer did not finish within {timeout_s:.0f}s "
                               "(learner.weight_sync_timeout_s); every engine is alive"
                               + (f", engine(s) {silent} not answering" if silent else ""))
