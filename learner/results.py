"""What one PPO update returns: each rank's additive sums (``RankUpdate``) and the group's combination of
them (``UpdateResult``), exact over the whole batch because every statistic is a sum or a max."""

from __future__ import annotations

from dataclasses import dataclass, field

from learner.kl import kl_stats_from_sums
from learner.ppo import ppo_stats_from_sums


@dataclass
class RankUpdate:
    """One rank's share of an update."""

    sums: dict[str, float]  # kl_sums plus score, reward, length, ... sums over this rank's episodes
    ppo_sums: dict  # {"stats": {name: [sum, count]}, "optimizer_steps": n}, additive over ranks
    ppo: dict[str, float]  # this rank's own PPO statistics (ppo_stats_from_sums of ppo_sums)
    timings: dict[str, float]  # forward_seconds, wait_seconds, update_seconds
    policy_versions: list[int]  # the distinct versions its rows were generated under
    kl_coefs: list[float]  # the distinct betas its rows were stamped with
    lr: float  # what the optimizer stepped with
    rank: int


@dataclass
class UpdateResult:
    """The whole group's update: sums over ranks (``mismatch_max``: the max), the PPO statistics over
    every rank's minibatches, and the slowest rank's timings."""

    sums: dict[str, float]
    ppo: dict[str, float]
    policy_versions: list[int]
    kl_coefs: list[float]
    lr: float
    forward_seconds: float
    update_seconds: float
    ranks: list[RankUpdate] = field(default_factory=list)

    @classmethod
    def combine(cls, parts: list[RankUpdate]) -> UpdateResult:
        sums = {k: sum(p.sums[k] for p in parts) for k in parts[0].sums}
        sums["mismatch_max"] = max(p.sums["mismatch_max"] for p in parts)
        return cls(
            sums=sums,
            ppo=ppo_stats_from_sums([p.ppo_sums for p in parts]),
            policy_versions=sorted({v for p in parts for v in p.policy_versions}),
            kl_coefs=sorted({b for p in parts for b in p.kl_coefs}),
            lr=parts[0].lr,
            forward_seconds=max(p.timings.get("forward_seconds", 0.0) for p in parts),
            update_seconds=max(p.timings.get("update_seconds", 0.0) for p in parts),
            ranks=list(parts),
        )

    @property
    def kl(self) -> dict[str, float]:
        """The KL statistics of the batch (``kl_stats_from_sums``): the controller's input and diagnostics."""
        return kl_stats_from_sums(self.sums)

    @property
    def trained_episodes(self) -> int:
        """The episodes the update trained on (the controller's statistic also counts dynamic sampling's dropped)."""
        return int(self.sums["trained_episodes"])
