"""The rollout correction: the detached factor on each token's policy term that corrects for the engine having
sampled the rows (``pi_old / pi_behav``, truncated, masked or banded), and the masks against
training-inference mismatch (IcePop, the geometric-mean sequence mask, DeepSeek-V3.2's off-policy sequence
mask).

Pure torch, part of the algorithm layer (``learner.algorithm`` calls it). Shapes: B rows, T response
positions; ``mask`` [B, T] float 0/1, the action mask.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor

from learner.ppo import masked_mean
from learner.registry import Entry, Registry, entry_rule

CorrectionLevel = Literal["token", "sequence"]
# the correction's statistics that count sequences (episodes with a token), not tokens
SEQUENCE_STATS = frozenset({"masked_sequence_fraction"})


def importance_log_weights(old_logprobs: Tensor, behaviour_logprobs: Tensor, mask: Tensor,
                           level: CorrectionLevel = "token") -> Tensor:
    """[B, T] detached ``log(pi_old / pi_behav)``: per token (``token``), or the row's sum over its masked
    tokens on each of them (``sequence``: the log-likelihood ratio of the whole response); 0 outside ``mask``.

    Args: old_logprobs: [B, T] the learner's at the start of the update; behaviour_logprobs: [B, T] the
        engine's sampled-token log-probs; mask: [B, T].
    """
    log_w = ((old_logprobs - behaviour_logprobs) * mask).detach()
    if level == "sequence":
        return log_w.sum(-1, keepdim=True) * mask
    if level != "token":
        raise ValueError(f"unknown correction level {level!r}; expected 'token' or 'sequence'")
    return log_w


def _row_mean(x: Tensor, mask: Tensor) -> Tensor:
    """[B, 1] mean of ``x`` [B, T] over each row's masked tokens (0 for a row without any)."""
    return (x * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)


def icepop_outside_band(log_k: Tensor, mask: Tensor, low: float, high: float) -> Tensor:
    """[B, T] bool: IcePop's masked tokens (Ring-1T, 2025), those whose ratio ``k = pi_old / pi_behav``
    (learner over engine) is outside ``[low, high]``; False outside ``mask``. ``log_k``: [B, T]
    ``importance_log_weights`` per token. In log space, so that a ratio of e^-800 or e^800 is compared, not
    overflowed."""
    return ((log_k < math.log(low)) | (log_k > math.log(high))) & (mask > 0)


def geometric_mean_outside_band(log_k: Tensor, mask: Tensor, low: float, high: float) -> Tensor:
    """[B, T] bool: the tokens of the rows whose geometric-mean ratio ``exp(mean_t log k_t)`` (k = pi_old /
    pi_behav) is outside ``[low, high]`` (verl's geometric rejection, ``rollout_rs: seq_mean_k1``; OpenRLHF's
    ``seq-mask-tis``): a length-normalised row statistic, where ``correction_level: sequence``'s likelihood
    ratio grows with the length. False outside ``mask`` and on rows without a token."""
    log_mean = _row_mean(log_k, mask)
    return ((log_mean < math.log(low)) | (log_mean > math.log(high))) & (mask > 0)


def sequence_advantage(advantages: Tensor, mask: Tensor) -> Tensor:
    """[B, 1] the advantage of each row as a whole: its first model token's, which credits everything the
    row sampled after it. For GRPO with the KL in the loss and for RLOO it is the row's one advantage (the
    group-normalised score, the leave-one-out return); for GRPO with the KL in the reward, that less beta
    times the row's whole KL; for GAE and REINFORCE++ the return to go from the row's first token, less the
    baseline (GAE's value of the prompt). 0 for a row without a token."""
    first = (mask > 0).to(torch.long).argmax(-1, keepdim=True)
    return advantages.gather(-1, first) * (mask.sum(-1, keepdim=True) > 0)


def off_policy_sequence_masked(logprobs: Tensor, behaviour_logprobs: Tensor, advantages: Tensor, mask: Tensor,
                               delta: float) -> Tensor:
    """[B, T] bool: DeepSeek-V3.2's off-policy sequence masking (2025, eq. 9): row b is masked when its
    advantage (``sequence_advantage``) is negative and its divergence from the sampler, ``D_b = (1 / |y_b|)
    sum_t log(pi_behav_t / pi_theta_t)`` over the row's masked tokens, exceeds ``delta``: the whole row, also
    where its tokens' advantages change sign along it (the KL to go, GAE). pi_theta is the policy being
    trained (``logprobs``, detached), pi_behav the engine's sampled log-probs, so D_b holds the
    engine-learner mismatch, the staleness of an older version (async) and the update's own move since its
    start. False outside ``mask``.

    Args: logprobs, behaviour_logprobs, advantages, mask: [B, T]; delta: the threshold, nats per token.
    """
    divergence = _row_mean((behaviour_logprobs - logprobs).detach(), mask)
    return (sequence_advantage(advantages, mask) < 0) & (divergence > delta) & (mask > 0)


def _mask_stats(masked: Tensor, mask: Tensor) -> dict[str, Tensor]:
    """The fractions a mask removed: of the tokens, and of the rows with a token (any of it masked)."""
    rows = mask.sum(-1) > 0
    masked_rows = masked.any(-1) & rows
    sequences = rows.sum().clamp(min=1).to(mask.dtype)
    return {"masked_token_fraction": masked_mean(masked.to(mask.dtype), mask),
            "masked_sequence_fraction": masked_rows.sum().to(mask.dtype) / sequences}


def rollout_correction_weights(old_logprobs: Tensor, behaviour_logprobs: Tensor, mask: Tensor,
                               correction: str = "tis", level: CorrectionLevel = "token",
                               cap: float = 2.0, *, band: tuple[float, float] | None = None,
                               delta: float | None = None, logprobs: Tensor | None = None,
                               advantages: Tensor | None = None) -> tuple[Tensor | None, dict[str, Tensor]]:
    """The rollout correction's detached factor on each token's policy term, from the weights ``w = pi_old /
    pi_behav`` (``importance_log_weights`` at ``level``) between the learner's policy at the start of the
    update and the engine that sampled, by the registered entry ``correction`` (``CORRECTIONS``).

    A masked token keeps its place in the loss's denominator (its term is 0, as MIS's): a mask drops terms,
    not the count the others are averaged over. In async mode pi_old is the proximal policy (decoupled PPO's
    ``pi_prox / pi_behav``), and w then holds the staleness of the engine's older version beside the numeric
    difference: IcePop's and the geometric band also drop the tokens (rows) the policy moved away from since
    they were sampled. In sync mode pi_old is the engine's own version, and w is the numeric difference alone.

    Args: old_logprobs, behaviour_logprobs, mask: [B, T]; level: token or sequence; cap: > 1; band: (low,
        high), low < 1 < high (icepop, geometric_mask); delta: nats per token (off_policy_mask); logprobs,
        advantages: [B, T] (off_policy_mask).
    Returns: (factor [B, T], 1 outside the mask, or None for ``none``; stats over ``mask``: ``is_weight_mean``
        (the mean factor), ``is_capped_fraction`` (tokens beyond the cap: truncated, or masked by mis),
        ``masked_token_fraction`` and ``masked_sequence_fraction`` (the masks': the tokens set to 0, and the
        rows with any; the second counts rows, ``SEQUENCE_STATS``)).
    """
    entry = CORRECTIONS.get(correction)
    if entry.weights is None:
        return None, {}
    inputs = CorrectionInputs(old_logprobs, behaviour_logprobs, mask, level, cap, band, delta, logprobs,
                              advantages)
    weights, beyond, masked = entry.weights(importance_log_weights(old_logprobs, behaviour_logprobs, mask,
                                                                   level), inputs)
    if masked is not None:
        weights = weights.masked_fill(masked, 0.0)
    weights = weights * mask + (1 - mask)
    stats = {"is_weight_mean": masked_mean(weights, mask)}
    if beyond is not None:
        stats["is_capped_fraction"] = masked_mean(beyond.to(mask.dtype), mask)
    if masked is not None:
        stats |= _mask_stats(masked, mask)
    return weights, stats


# ---------------------------------------------------------------------------- the entries


@dataclass(frozen=True)
class CorrectionInputs:
    """What an entry's weights may read beside the log-weights: the log-probs and mask [B, T], the level,
    ``ppo.is_cap``, and its own settings (band, delta) with the current log-probs and advantages [B, T]."""

    old_logprobs: Tensor
    behaviour_logprobs: Tensor
    mask: Tensor
    level: str
    cap: float
    band: tuple[float, float] | None
    delta: float | None
    logprobs: Tensor | None
    advantages: Tensor | None


@dataclass(frozen=True, kw_only=True)
class RolloutCorrection(Entry):
    """``weights(log_w, inputs)``: (the factor before the masks [B, T], the tokens beyond the cap or None, the
    tokens its mask drops or None) from ``log_w`` [B, T] = log(pi_old / pi_behav) at the level; None for no
    correction. ``arguments(ppo)``: its own settings as ``rollout_correction_weights``' keywords.
    ``beyond_cap``: what it does to the tokens beyond ``ppo.is_cap`` (the update's counts). ``objective(old,
    behaviour, current, advantages, mask, level, ppo)``: [B, T] the documented factor, written again from the
    paper in float64 from the three policies' log-probs without calling ``weights``: the reference the
    settings-space harness checks the update's gradient against, masks included (their bias is the
    objective's)."""

    weights: Callable[[Tensor, CorrectionInputs], tuple[Tensor, Tensor | None, Tensor | None]] | None
    objective: Callable[..., Tensor]
    arguments: Callable[[Any], dict[str, Any]] = lambda p: {}
    beyond_cap: Literal["truncated", "masked"] | None = None


CORRECTIONS: Registry[RolloutCorrection] = Registry("ppo.correction", "rollout correction")
LEVEL_READ = "whether its weight is each token's or the whole response's likelihood ratio"
CAP_READ = "the bound on the weight pi_old / pi_behav"


# ---- the documented factors (``RolloutCorrection.objective``), from the papers' formulas


def likelihood_ratio(old: Tensor, behaviour: Tensor, mask: Tensor, level: str) -> Tensor:
    """[B, T] w = pi_old / pi_behav of each token, or of the whole response on each of its tokens."""
    log_k = (old - behaviour) * mask
    return (log_k.sum(-1, keepdim=True).expand_as(log_k) if level == "sequence" else log_k).exp()


def tis_objective(old, behaviour, current, advantages, mask, level, p) -> Tensor:
    """TIS: min(w, C)."""
    return likelihood_ratio(old, behaviour, mask, level).clamp(max=p.is_cap)


def mis_objective(old, behaviour, current, advantages, mask, level, p) -> Tensor:
    """MIS: w 1[w <= C]."""
    w = likelihood_ratio(old, behaviour, mask, level)
    return torch.where(w <= p.is_cap, w, torch.zeros_like(w))


def icepop_objective(old, behaviour, current, advantages, mask, level, p) -> Tensor:
    """IcePop (Ring-1T, eq. 2): k 1[alpha <= k <= beta], k = pi_old / pi_behav of the token."""
    k = likelihood_ratio(old, behaviour, mask, "token")
    return torch.where((k >= p.icepop_low) & (k <= p.icepop_high), k, torch.zeros_like(k))


def geometric_mask_objective(old, behaviour, current, advantages, mask, level, p) -> Tensor:
    """TIS times 1[low <= (prod_t k_t)^(1/|y|) <= high] of the row."""
    k = likelihood_ratio(old, behaviour, mask, "token")
    geometric = (k.log() * mask).sum(-1, keepdim=True).div(mask.sum(-1, keepdim=True).clamp(min=1)).exp()
    keep = (geometric >= p.geometric_mask_low) & (geometric <= p.geometric_mask_high)
    return tis_objective(old, behaviour, current, advantages, mask, level, p) * keep


def off_policy_mask_objective(old, behaviour, current, advantages, mask, level, p) -> Tensor:
    """TIS times DeepSeek-V3.2's M: 0 on a row whose advantage A_i (its first model token's) is negative and
    whose (1 / |y|) sum_t log(pi_behav / pi_theta) exceeds delta."""
    tokens = mask.sum(-1, keepdim=True).clamp(min=1)
    divergence = ((behaviour - current) * mask).sum(-1, keepdim=True) / tokens
    first = [int(row.nonzero()[0]) if row.any() else 0 for row in mask > 0]  # the row's advantage: its first
    negative = (advantages[torch.arange(len(first)), first] < 0).unsqueeze(-1)
    dropped = negative & (divergence > p.off_policy_mask_delta)
    tis = tis_objective(old, behaviour, current, advantages, mask, level, p)
    return torch.where(dropped, torch.zeros_like(tis), tis)


def truncated(log_w: Tensor, x: CorrectionInputs) -> tuple[Tensor, Tensor, None]:
    """TIS: ``min(w, cap)``, in log space (a long row's product never overflows)."""
    log_cap = math.log(x.cap)
    return log_w.clamp(max=log_cap).exp(), (log_w > log_cap) & (x.mask > 0), None


def masked_beyond_cap(log_w: Tensor, x: CorrectionInputs) -> tuple[Tensor, Tensor, None]:
    """MIS: ``w * 1[w <= cap]``."""
    weights, beyond, _ = truncated(log_w, x)
    return weights.masked_fill(beyond, 0.0), beyond, None


@entry_rule("ppo.correction", "ppo.is_cap", example={"ppo": {"is_cap": 1.0}})
def cap_above_one(cfg: Any) -> str | None:
    p = cfg.ppo
    if p.is_cap > 1:
        return None
    cut = "mask" if p.correction == "mis" else "truncate"
    return (f"ppo.is_cap={p.is_cap} must be > 1 with ppo.correction={p.correction!r}: where the engine and "
            f"the learner agree the weight is 1, and a bound at or below it would {cut} the tokens the "
            "learner favours even there")


CAPPED_READS = {"correction_level": LEVEL_READ, "is_cap": CAP_READ}
CORRECTIONS.register(RolloutCorrection(
    name="tis", doc="truncated importance sampling: min(w, ppo.is_cap)", reads=CAPPED_READS,
    rules=(cap_above_one,), weights=truncated, objective=tis_objective, beyond_cap="truncated"))
CORRECTIONS.register(RolloutCorrection(
    name="mis", doc="masked importance sampling: w, and 0 where w exceeds ppo.is_cap", reads=CAPPED_READS,
    rules=(cap_above_one,), weights=masked_beyond_cap, objective=mis_objective, beyond_cap="masked"))


def icepop(log_w: Tensor, x: CorrectionInputs) -> tuple[Tensor, None, Tensor]:
    """IcePop (Ring-1T): per token, ``k * 1[low <= k <= high]``: two-sided, untruncated inside the band."""
    if x.band is None:
        raise ValueError("icepop needs its band (low, high)")
    if x.level != "token":
        raise ValueError("icepop masks tokens one by one: its level is 'token'")
    weights = log_w.clamp(math.log(x.band[0]), math.log(x.band[1])).exp()  # exp never overflows
    return weights, None, icepop_outside_band(log_w, x.mask, *x.band)


CORRECTIONS.register(RolloutCorrection(
    name="icepop", doc="IcePop (Ring-1T): each token's w kept inside [ppo.icepop_low, ppo.icepop_high], the "
    "token masked outside it",
    reads={"icepop_low": "the lower end of IcePop's band on each token's ratio",
           "icepop_high": "the upper end of IcePop's band on each token's ratio"},
    weights=icepop, objective=icepop_objective, arguments=lambda p: {"band": (p.icepop_low, p.icepop_high)}))


def geometric_mask(log_w: Tensor, x: CorrectionInputs) -> tuple[Tensor, Tensor, Tensor]:
    """TIS at the level, times 0 on the rows whose geometric-mean token ratio is outside the band."""
    if x.band is None:
        raise ValueError("geometric_mask needs its band (low, high)")
    weights, beyond, _ = truncated(log_w, x)
    log_k = log_w if x.level == "token" else importance_log_weights(x.old_logprobs, x.behaviour_logprobs,
                                                                     x.mask)
    return weights, beyond, geometric_mean_outside_band(log_k, x.mask, *x.band)


@entry_rule("ppo.correction", "ppo.geometric_mask_low", "ppo.geometric_mask_high", "rollout.mode",
            example={"rollout": {"mode": "async"}, "ppo": {"correction": "geometric_mask"}})
def geometric_band_set_for_async(cfg: Any) -> str | None:
    if cfg.rollout.mode != "async":
        return None
    if {"geometric_mask_low", "geometric_mask_high"} & set(cfg.ppo.changed_fields()):
        return None
    return ("ppo.correction='geometric_mask' with rollout.mode='async' keeps its default band [0.999, "
            "1.001], which is for the engine-learner numeric difference of sync mode: in async mode a row's "
            "geometric-mean ratio also holds one version's drift and leaves that band nearly always, so "
            "nearly every row is masked (randomwalks, GRPO, 3 seeds: sampled optimality never reached 0.95 "
            "and ended at 0.665; 8.7 iterations in sync mode). Set ppo.geometric_mask_low and "
            "ppo.geometric_mask_high to a band the drift stays inside (each iteration logs "
            "rollout_stale_logprob_shift), or take ppo.correction 'off_policy_mask' or 'tis'")


CORRECTIONS.register(RolloutCorrection(
    name="geometric_mask", doc="TIS, with the rows whose geometric-mean token ratio is outside "
    "[ppo.geometric_mask_low, ppo.geometric_mask_high] masked (verl's geo mask)",
    reads={**CAPPED_READS,
           "geometric_mask_low": "the lower end of the band on a row's geometric-mean ratio",
           "geometric_mask_high": "the upper end of the band on a row's geometric-mean ratio"},
    rules=(cap_above_one, geometric_band_set_for_async), weights=geometric_mask,
    objective=geometric_mask_objective,
    arguments=lambda p: {"band": (p.geometric_mask_low, p.geometric_mask_high)}, beyond_cap="truncated"))


def off_policy_mask(log_w: Tensor, x: CorrectionInputs) -> tuple[Tensor, Tensor, Tensor]:
    """TIS at the level, times 0 on the rows with a negative advantage that diverge from the sampler by more
    than delta."""
    if x.delta is None or x.logprobs is None or x.advantages is None:
        raise ValueError("off_policy_mask needs delta, the current logprobs and the advantages")
    weights, beyond, _ = truncated(log_w, x)
    return weights, beyond, off_policy_sequence_masked(x.logprobs, x.behaviour_logprobs, x.advantages, x.mask,
                                                       x.delta)


CORRECTIONS.register(RolloutCorrection(
    name="off_policy_mask", doc="TIS, with DeepSeek-V3.2's mask: a row whose advantage is negative and whose "
    "mean log(pi_behav / pi) exceeds ppo.off_policy_mask_delta",
    reads={**CAPPED_READS,
           "off_policy_mask_delta": "the divergence past which the off-policy mask drops a row"},
    rules=(cap_above_one,), weights=off_policy_mask, objective=off_policy_mask_objective,
    arguments=lambda p: {"delta": p.off_policy_mask_delta},
    beyond_cap="truncated"))


@entry_rule("ppo.correction", "rollout.mode",
            example={"rollout": {"mode": "async"}, "ppo": {"correction": "none"}})
def async_needs_a_correction(cfg: Any) -> str | None:
    if cfg.rollout.mode == "async":
        return ("ppo.correction='none' with rollout.mode='async' would train on rows an older policy sampled "
                "as if the learner's had: async mode needs the weight pi_prox / pi_behav; set ppo.correction "
                "to 'tis' (or 'mis', 'icepop', 'geometric_mask', 'off_policy_mask')")
    return None


CORRECTIONS.register(RolloutCorrection(
    name="none", doc="no correction (sync mode only)", reads={}, rules=(async_needs_a_correction,),
    weights=None, objective=lambda old, *_: torch.ones_like(old)))
