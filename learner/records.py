"""The records the driver and the learner ranks exchange around an update: a chunk's refs (``ChunkRefs``),
which rows the learner may train on (``Admission``), each rank's additive sums (``RankUpdate``) and the
group's combination of them (``UpdateResult``), exact over the whole batch because every statistic is a sum or
a max."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from learner.kl import kl_stats_from_sums
from learner.ppo import ppo_stats_from_sums


@dataclass(frozen=True)
class ChunkRefs:
    """One chunk slot's object refs, built once by the fleet: the rollout, and where an actor scores them the
    reference's log-probs, the reward's scores and the teacher's log-probs (None: the ranks score it, or no
    role)."""

    rollout: Any
    reference: Any = None
    score: Any = None
    teacher: Any = None

    def scored(self) -> dict[str, Any]:
        """{what: ref} of the refs beside the rollout that this chunk has."""
        return {name: ref for name in ("reference", "score", "teacher")
                if (ref := getattr(self, name)) is not None}


@dataclass(frozen=True)
class Admission:
    """Which rows a learner at ``policy_version`` may train on. Sync: exactly that version, under ``kl_coef``,
    the beta in force. Async (``kl_coef`` None): versions at most ``max_staleness`` behind, under any beta
    (the penalty takes the controller's at the update). A row of a version the learner does not have yet (an
    engine that restarted after the driver's version check) is refused too."""

    policy_version: int
    kl_coef: float | None = None
    max_staleness: int = 0

    def refused_versions(self, versions: Tensor) -> Tensor:
        behind = self.policy_version - versions
        return (behind < 0) | (behind > self.max_staleness)

    def refused_betas(self, betas: Tensor) -> Tensor:
        if self.kl_coef is None:
            return torch.zeros_like(betas, dtype=torch.bool)
        return (betas.double() - self.kl_coef).abs() > 1e-6 * max(abs(self.kl_coef), 1.0)

    def refuses(self, versions: Tensor, betas: Tensor) -> Tensor:
        """[B] bool: the rows of these stamps (``policy_version``, ``kl_coef``: [B] each) it refuses."""
        return self.refused_versions(versions) | self.refused_betas(betas)


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
    episodes: dict[str, list] = field(default_factory=dict)  # its trained episodes, column by column


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

    @property
    def episodes(self) -> list[dict]:
        """Every rank's trained episodes, one dict each (``learner.update.episode_table``)."""
        return [dict(zip(part.episodes, row, strict=True)) for part in self.ranks
                for row in zip(*part.episodes.values(), strict=True)]

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
        """The episodes the update trained on (the controller's statistic also counts dynamic sampling's
        dropped)."""
        return int(self.sums["trained_episodes"])
