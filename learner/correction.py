"""The rollout correction: the detached factor on each token's policy term that corrects for the engine having
sampled the rows (``pi_old / pi_behav``, truncated, masked or banded), and the masks against
training-inference mismatch (IcePop, the geometric-mean sequence mask, DeepSeek-V3.2's off-policy sequence
mask).

Pure torch, part of the algorithm layer (``learner.algorithm`` calls it). Shapes: B rows, T response
positions; ``mask`` [B, T] float 0/1, the action mask.
"""

from __future__ import annotations

import math
from typing import Literal

from torch import Tensor

from learner.ppo import masked_mean

Correction = Literal["tis", "mis", "icepop", "geometric_mask", "off_policy_mask", "none"]
CORRECTIONS = ("tis", "mis", "icepop", "geometric_mask", "off_policy_mask", "none")
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


def off_policy_sequence_masked(logprobs: Tensor, behaviour_logprobs: Tensor, advantages: Tensor, mask: Tensor,
                               delta: float) -> Tensor:
    """[B, T] bool: DeepSeek-V3.2's off-policy sequence masking (2025): token t of row b is masked when its
    advantage is negative and the row's divergence from the sampler, ``D_b = (1 / |y_b|) sum_t log(pi_behav_t
    / pi_theta_t)`` over the row's masked tokens, exceeds ``delta``. pi_theta is the policy being trained
    (``logprobs``, detached), pi_behav the engine's sampled log-probs, so D_b holds the engine-learner
    mismatch, the staleness of an older version (async) and the update's own move since its start. False
    outside ``mask``.

    Args: logprobs, behaviour_logprobs, advantages, mask: [B, T]; delta: the threshold, nats per token.
    """
    divergence = _row_mean((behaviour_logprobs - logprobs).detach(), mask)
    return (advantages < 0) & (divergence > delta) & (mask > 0)


def _mask_stats(masked: Tensor, mask: Tensor) -> dict[str, Tensor]:
    """The fractions a mask removed: of the tokens, and of the rows with a token (any of it masked)."""
    rows = mask.sum(-1) > 0
    masked_rows = masked.any(-1) & rows
    sequences = rows.sum().clamp(min=1).to(mask.dtype)
    return {"masked_token_fraction": masked_mean(masked.to(mask.dtype), mask),
            "masked_sequence_fraction": masked_rows.sum().to(mask.dtype) / sequences}


def rollout_correction_weights(old_logprobs: Tensor, behaviour_logprobs: Tensor, mask: Tensor,
                               correction: Correction = "tis", level: CorrectionLevel = "token",
                               cap: float = 2.0, *, band: tuple[float, float] | None = None,
                               delta: float | None = None, logprobs: Tensor | None = None,
                               advantages: Tensor | None = None) -> tuple[Tensor | None, dict[str, Tensor]]:
    """The rollout correction's detached factor on each token's policy term, from the weights ``w = pi_old /
    pi_behav`` (``importance_log_weights``) between the learner's policy at the start of the update and the
    engine that sampled:

    - ``tis``: ``min(w, cap)``; ``mis``: ``w * 1[w <= cap]`` (``sequence``: the row's likelihood ratio);
    - ``icepop`` (Ring-1T): per token, ``k * 1[band[0] <= k <= band[1]]`` with k = w of the token: two-sided,
      the ratio kept untruncated inside the band (``level`` must be ``token``; ``cap`` is unread);
    - ``geometric_mask``: TIS's ``min(w, cap)`` at ``level``, times 0 on the rows whose geometric-mean token
      ratio is outside ``band`` (``geometric_mean_outside_band``);
    - ``off_policy_mask`` (DeepSeek-V3.2): TIS's ``min(w, cap)`` at ``level``, times 0 on the
      negative-advantage tokens of the rows that diverge from the sampler by more than ``delta``
      (``off_policy_sequence_masked``; it needs the current ``logprobs`` and the ``advantages``).

    A masked token keeps its place in the loss's denominator (its term is 0, as MIS's): a mask drops terms,
    not the count the others are averaged over. In async mode pi_old is the proximal policy (decoupled PPO's
    ``pi_prox / pi_behav``), and k then holds the staleness of the engine's older version beside the numeric
    difference: IcePop's and the geometric band also drop the tokens (rows) the policy moved away from since
    they were sampled. In sync mode pi_old is the engine's own version, and k is the numeric difference alone.

    Args: old_logprobs, behaviour_logprobs, mask: [B, T]; correction: one of ``CORRECTIONS``; level: token or
        sequence; cap: > 1; band: (low, high), low < 1 < high (icepop, geometric_mask); delta: nats per token
        (off_policy_mask); logprobs, advantages: [B, T] (off_policy_mask).
    Returns: (factor [B, T], 1 outside the mask, or None for ``none``; stats over ``mask``: ``is_weight_mean``
        (the mean factor), ``is_capped_fraction`` (tokens beyond the cap: truncated, or masked by mis; not
        icepop), ``masked_token_fraction`` and ``masked_sequence_fraction`` (the masks': the tokens set to 0,
        and the rows with any; the second counts rows, ``SEQUENCE_STATS``)).
    """
    if correction == "none":
        return None, {}
    if correction not in CORRECTIONS:
        raise ValueError(f"unknown rollout correction {correction!r}; expected one of {CORRECTIONS}")
    if correction in ("icepop", "geometric_mask") and band is None:
        raise ValueError(f"{correction} needs its band (low, high)")
    if correction == "icepop" and level != "token":
        raise ValueError("icepop masks tokens one by one: its level is 'token'")
    if correction == "off_policy_mask" and (delta is None or logprobs is None or advantages is None):
        raise ValueError("off_policy_mask needs delta, the current logprobs and the advantages")
    log_w = importance_log_weights(old_logprobs, behaviour_logprobs, mask, level)
    beyond, masked = None, None
    if correction == "icepop":  # untruncated inside the band (where exp never overflows), 0 outside it
        masked = icepop_outside_band(log_w, mask, *band)
        weights = log_w.clamp(math.log(band[0]), math.log(band[1])).exp()
    else:  # TIS's truncation at the cap, in log space: a long row's product never overflows
        log_cap = math.log(cap)
        beyond = (log_w > log_cap) & (mask > 0)
        weights = log_w.clamp(max=log_cap).exp()
        if correction == "mis":
            weights = weights.masked_fill(beyond, 0.0)
    if correction == "geometric_mask":  # the rows' mean of the token log-ratios
        log_k = log_w if level == "token" else importance_log_weights(old_logprobs, behaviour_logprobs, mask)
        masked = geometric_mean_outside_band(log_k, mask, *band)
    elif correction == "off_policy_mask":
        masked = off_policy_sequence_masked(logprobs, behaviour_logprobs, advantages, mask, delta)
    if masked is not None:
        weights = weights.masked_fill(masked, 0.0)
    weights = weights * mask + (1 - mask)
    stats = {"is_weight_mean": masked_mean(weights, mask)}
    if beyond is not None:
        stats["is_capped_fraction"] = masked_mean(beyond.to(mask.dtype), mask)
    if masked is not None:
        stats |= _mask_stats(masked, mask)
    return weights, stats
