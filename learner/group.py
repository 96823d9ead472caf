"""LearnerGroup: W DeepSpeed ranks as Ray actors, driven as one."""

from __future__ import annotations

import ray

from learner.cluster import ClusterError, Placement, start_actor
from learner.config import JobConfig
from learner.rank import LearnerRank
from services.model_source import ModelSource


class LearnerGroup:
    def __init__(self, cfg: JobConfig, model: ModelSource | str, placement: Placement | None, tag: str = "") -> None:
        self.world_size = cfg.learner.world_size
        self.ranks = [
            start_actor(LearnerRank, "learner", i, cfg.cluster.learner, placement, i, self.world_size, tag=tag)
            for i in range(self.world_size)
        ]
        master_addr, master_port = ray.get(self.ranks[0].address.remote())
        setups = [
            rank.setup.remote(master_addr, master_port, model, cfg.learner.model_dump(), cfg.ppo.model_dump(),
                              cfg.kl.model_dump(), cfg.rollout.temperature, cfg.run.seed, cfg.device("learner"))
            for rank in self.ranks
        ]
        self._get(setups, "setup")

    def _get(self, refs: list, what: str, ranks: list[int] | None = None):
        """ray.get over ``refs`` (one per rank in ``ranks``, default all); a lost rank ends the job
        with a message naming it."""
        ranks = list(range(len(refs))) if ranks is None else ranks
        try:
            return ray.get(refs)
        except ray.exceptions.RayActorError as err:
            for rank, ref in zip(ranks, refs, strict=True):
                try:
                    ray.get(ref, timeout=0)
                except ray.exceptions.RayActorError:
                    raise ClusterError(f"learner rank {rank} (actor learner-rank-{rank}) died during {what}: "
                                       f"{err}") from err
                except (ray.exceptions.GetTimeoutError, ray.exceptions.RayTaskError):
                    continue
            raise

    def collect(self, chunk_refs: dict[int, object], ref_logprob_refs: dict[int, object],
                score_refs: dict[int, object]) -> list[int]:
        """Chunk slot i goes to rank i % W, which fetches it and runs its forward. Returns the slots
        lost to dead actors (to regenerate and collect again)."""
        calls = []
        for r, rank in enumerate(self.ranks):
            slots = [s for s in sorted(chunk_refs) if s % self.world_size == r]
            calls.append(rank.collect.remote(slots, [chunk_refs[s] for s in slots],
                                             [ref_logprob_refs[s] for s in slots], [score_refs[s] for s in slots]))
        return sorted(s for result in self._get(calls, "collect") for s in result["failed"])

    def update(self, kl_coef: float, iteration: int) -> list[dict]:
        """Every rank trains at once on what it collected. Returns each rank's result."""
        return self._get([rank.update.remote(kl_coef, iteration) for rank in self.ranks], "update")

    def train(self, chunk_refs: list, ref_logprob_refs: list, score_refs: list, kl_coef: float,
              iteration: int) -> list[dict]:
        """collect + update, for callers that need no retries."""
        failed = self.collect(dict(enumerate(chunk_refs)), dict(enumerate(ref_logprob_refs)),
                              dict(enumerate(score_refs)))
        if failed:
            raise ClusterError(f"chunks {failed} were lost to dead actors")
        return self.update(kl_coef, iteration)

    def policy_weights(self) -> ray.ObjectRef:
        """Rank 0's full weights as an ObjectRef: the driver passes it on without materialising it."""
        # rank 0 puts the weights in the object store and returns only [ref]: small enough to get here
        return self._get([rank.policy_state_dict.remote() for rank in self.ranks], "weight gather")[0][0]

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

    def connect_engines(self, rollouts: list) -> None:
        """NCCL weight sync: rank 0 is rank 0 of a group with one rank per engine worker (TP=1)."""
        master_addr, master_port = ray.get(self.ranks[0].address.remote())
        world = 1 + len(rollouts)
        joins = [r.init_weight_sync.remote(master_addr, master_port, 1 + i, world) for i, r in enumerate(rollouts)]
        self.sync_metadata = self._get([self.ranks[0].init_weight_broadcast.remote(master_addr, master_port, world)],
                                       "weight-sync setup")[0]
        ray.get(joins)

    def broadcast_to(self, rollouts: list, bucket_bytes: int, policy_version: int, kl_coef: float) -> float:
        """One NCCL broadcast from rank 0, received by every engine at once; returns the slowest engine's seconds."""
        receives = [r.receive_weights.remote(self.sync_metadata, bucket_bytes, policy_version, kl_coef)
                    for r in rollouts]
        self._get([rank.broadcast_weights.remote(bucket_bytes) for rank in self.ranks], "NCCL weight broadcast")
        return max(ray.get(receives))
