"""Compositions of the algorithm layer's own functions that only tests read: a response's KL, a batch's KL
statistics and the critic's explained variance, as the learner computes them from its sums."""

from __future__ import annotations

from torch import Tensor

from learner.kl import kl_stats_from_sums, kl_sums, masked_kl
from learner.ppo import explained_variance_from_moments, explained_variance_moments


def sequence_kl(logprobs: Tensor, ref_logprobs: Tensor, mask: Tensor, estimator: str = "k1") -> Tensor:
    """[B] response KL in nats: ``KL_b = sum_t k(r_t) * mask_t`` (0 for an empty response)."""
    return masked_kl(logprobs, ref_logprobs, mask, estimator).sum(dim=-1)


def kl_stats(logprobs: Tensor, ref_logprobs: Tensor, mask: Tensor, estimator: str = "k1") -> dict[str, float]:
    """The KL statistics of a batch (``kl_stats_from_sums`` of its ``kl_sums``), as the learner logs them."""
    return kl_stats_from_sums(kl_sums(logprobs, ref_logprobs, mask, estimator))


def explained_variance(values: Tensor, returns: Tensor, mask: Tensor) -> float:
    """1 - Var(R - V) / Var(R) over masked positions; nan when the returns have no variance."""
    return explained_variance_from_moments(explained_variance_moments(values, returns, mask))
