"""LearnerGroup: W DeepSpeed ranks as Ray actors, driven as one."""

from __future__ import annotations

import ray

from learner.cluster import ClusterError, Placement, start_actor
from learner.config import JobConfig
from learner.rank import LearnerRank


class LearnerGroup:
    def __init__(self, cfg: JobConfig, model_dir: str, placement: Placement | None, tag: str = "") -> None:
        self.world_size = cfg.learner.world_size
        self.ranks = [
            start_actor(LearnerRank, "learner", i, cfg.cluster.learner, placement, i, self.world_size, tag=tag)
            for i in range(self.world_size)
        ]
        master_addr, master_port = ray.get(self.ranks[0].address.remote())
        setups = [
            rank.setup.remote(master_addr, master_port, model_dir, cfg.learner.model_dump(), cfg.ppo.model_dump(),
                              cfg.kl.model_dump(), cfg.rollout.temperature, cfg.run.seed)
            for rank in self.ranks
        ]
        self._get(setups, "setup")

    def _get(self, refs: list, what: str):
        """ray.get over all ranks; a lost rank ends the job with a message naming it."""
        try:
            return ray.get(refs)
        except ray.exceptions.RayActorError as err:
            for i, ref in enumerate(refs):
                try:
                    ray.get(ref, timeout=0)
                except ray.exceptions.RayActorError:
                    raise ClusterError(f"learner rank {i} (actor learner-rank-{i}) died during {what}: {err}") from err
                except Exception:
                    pass
            raise

    def train(self, chunk_refs: list, ref_logprob_refs: list, score_refs: list, kl_coef: float,
              iteration: int) -> list[dict]:
        """Chunk i goes to rank i % W; every rank trains at once. Returns each rank's result."""
        w = self.world_size
        refs = [
            rank.train.remote(chunk_refs[r::w], ref_logprob_refs[r::w], score_refs[r::w], kl_coef, iteration)
            for r, rank in enumerate(self.ranks)
        ]
        return self._get(refs, "train")

    def policy_weights(self) -> ray.ObjectRef:
        """Rank 0's full weights as an ObjectRef: the driver passes it on without materialising it."""
        refs = [rank.policy_state_dict.remote() for rank in self.ranks]
        self._get(refs[1:], "weight gather")
        return refs[0]

    def probe(self, sequences: list[list[int]], prompt_lengths: list[int]) -> list[list[float]]:
        return self._get([r.probe_logprobs.remote(sequences, prompt_lengths) for r in self.ranks], "probe")[0]
