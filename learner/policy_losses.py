"""The policy losses (``ppo.policy_loss``), each one registered entry of ``POLICY_LOSSES``: PPO's clip, GSPO's
sequence ratio (and GSPO-token), CISPO's clipped detached weight, SAPO's soft gate. An entry is its per-token
terms, the ratio it takes, the settings and rules it reads, and its documented objective: written from the
paper's formula in float64 without calling the terms, the reference the settings-space harness checks the
terms against where the ratios leave every clip and gate.

Pure torch. Shapes: B rows, T response positions; ``mask`` [B, T] float 0/1, the action mask.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, get_args

import torch
from torch import Tensor

from learner.ppo import Aggregation, masked_mean
from learner.registry import Entry, Registry, entry_rule
from services.config import PPOConfig

RatioLevel = Literal["token", "sequence", "sequence_token"]
# beyond e^+-20 the gate's gradient is 0 in float32 anyway, and exp(ratio) never overflows
SAPO_LOG_RATIO_BOUND = 20.0
DEFAULT_SETTINGS = PPOConfig()


@dataclass(frozen=True, kw_only=True)
class PolicyLoss(Entry):
    """``terms(log_ratio, advantages, mask, ppo)``: ([B, T] each token's loss term of the log-ratio at
    ``ratio_level``, with grad; its statistics, over ``mask``); ``objective(token_log_ratio, advantages, mask,
    ppo)``: [B, T] terms of the documented objective (float64, from the token log-ratios, whose gradient the
    terms' must equal); ``clip(ppo)``: (eps_low, eps_high) of what it clips, or None."""

    terms: Callable[[Tensor, Tensor, Tensor, Any], tuple[Tensor, dict[str, Tensor]]]
    objective: Callable[[Tensor, Tensor, Tensor, Any], Tensor]
    ratio_level: RatioLevel = "token"
    clip: Callable[[Any], tuple[float, float]] | None = None


POLICY_LOSSES: Registry[PolicyLoss] = Registry("ppo.policy_loss")


# ---------------------------------------------------------------------------- the ratio and its factors


def sequence_log_ratio(logprobs: Tensor, old_logprobs: Tensor, mask: Tensor) -> Tensor:
    """GSPO's length-normalised log-ratio of each row, ``log s_b = mean_t (logprobs - old_logprobs)`` over the
    row's masked tokens (0 for a row without any).

    Args: logprobs, old_logprobs, mask: [B, T]. Returns: [B, 1] (with grad through ``logprobs``).
    """
    return ((logprobs - old_logprobs) * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)


def policy_log_ratio(logprobs: Tensor, old_logprobs: Tensor, mask: Tensor,
                     ratio_level: RatioLevel = "token") -> Tensor:
    """[B, T] log of the ratio each token's term takes (``logprobs``, ``old_logprobs``, ``mask``: [B, T]).

    ``token`` (PPO): ``log pi_t - log pi_old_t``. ``sequence`` (GSPO): the row's ``log s_b`` on each of its
    tokens, ``s_b = (pi(y_b) / pi_old(y_b))^(1 / |y_b|)``. ``sequence_token`` (GSPO-token): ``s_bt = sg[s_b] *
    pi_t / sg[pi_t]``, whose value is ``s_b`` and whose gradient reaches token t alone, times ``s_b``.
    """
    if ratio_level == "token":
        return logprobs - old_logprobs
    log_s = sequence_log_ratio(logprobs, old_logprobs, mask).expand_as(logprobs)
    if ratio_level == "sequence":
        return log_s
    if ratio_level == "sequence_token":
        return log_s.detach() + logprobs - logprobs.detach()
    raise ValueError(f"unknown ratio_level {ratio_level!r}; expected one of {get_args(RatioLevel)}")


def cispo_weight(log_ratio: Tensor, clip_low: float, clip_high: float) -> Tensor:
    """[B, T] CISPO's weight (MiniMax-M1, 2025): the token's ratio clipped to
    ``[1 - clip_low, 1 + clip_high]``, detached. ``log_ratio``: [B, T] ``log pi_t - log pi_old_t``;
    ``clip_low`` = 1 puts the floor at 0, no floor at all (the paper's choice: only the ceiling is tuned)."""
    return log_ratio.detach().exp().clamp(1.0 - clip_low, 1.0 + clip_high)


def sapo_gate(log_ratio: Tensor, advantages: Tensor, tau_pos: float, tau_neg: float) -> tuple[Tensor, Tensor]:
    """[B, T] SAPO's soft gate (Gao et al. 2025, "Soft Adaptive Policy Optimization") in place of PPO's clip:
    ``f(r) = 4 / tau * sigmoid(tau * (r - 1))``, tau = ``tau_pos`` where the token's advantage is > 0,
    ``tau_neg`` elsewhere (verl's convention; a zero advantage has no term). Its derivative in ``log r`` is
    ``4 * s * (1 - s) * r`` with ``s = sigmoid(tau * (r - 1))``: exactly 1 at r = 1, where the term's gradient
    is the policy gradient's, and smoothly down to 0 as r leaves 1, the faster the larger tau.

    Args: log_ratio, advantages: [B, T] (``log_ratio`` with grad). Returns: ([B, T] f(r), with grad; [B, T]
    its derivative in ``log r``, ``4 s (1 - s) r``, detached: the factor the gate puts on the policy
    gradient).
    """
    tau = torch.where(advantages > 0, torch.full_like(log_ratio, tau_pos),
                      torch.full_like(log_ratio, tau_neg))
    ratio = log_ratio.clamp(-SAPO_LOG_RATIO_BOUND, SAPO_LOG_RATIO_BOUND).exp()
    s = torch.sigmoid(tau * (ratio - 1.0))
    return s * 4.0 / tau, (4.0 * s * (1.0 - s) * ratio).detach()


def clip_fraction(ratio: Tensor, mask: Tensor, low: float, high: float) -> Tensor:
    """The fraction of ``mask``'s tokens whose ratio is outside ``[1 - low, 1 + high]``."""
    with torch.no_grad():
        return masked_mean(((ratio < 1.0 - low) | (ratio > 1.0 + high)).to(ratio.dtype), mask)


# ---------------------------------------------------------------------------- the loss over a batch


def policy_loss(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor,
                settings: Any = DEFAULT_SETTINGS, aggregation: Aggregation = "token_mean",
                denominator: Tensor | float | None = None,
                importance_weights: Tensor | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """The policy term of ``settings.policy_loss`` (a ``PPOConfig``): each token's term of its ratio rho to
    ``old_logprobs``, times its importance weight w when given (the rollout correction), averaged by
    ``aggregation``.

    The ratio rho is against ``old_logprobs``, the learner's own log-probs of the rows at the start of the
    update (pi_old; in async mode the proximal policy pi_prox), never the engine's: the clip (or gate) bounds
    the move from the learner's policy, and w = pi_old / pi_behav (truncated or masked) corrects for the
    engine having sampled.

    Args:
        logprobs: [B, T] current policy log-probs of the sampled tokens (with grad).
        old_logprobs: [B, T] pi_old (async: pi_prox); advantages: [B, T]; mask: [B, T].
        denominator: see ``learner.ppo.masked_mean``.
        importance_weights: [B, T] per-token weights, used detached; None = 1.
    Returns:
        (scalar loss, stats): the entry's (``clipfrac``: the tokens outside its clip; SAPO's
        ``gate_weight_mean``) and ``approx_kl``, the k3 estimate of KL(old || new) per token as CleanRL logs
        it.
    """
    loss_entry = POLICY_LOSSES.get(settings.policy_loss)
    log_ratio = policy_log_ratio(logprobs, old_logprobs, mask, loss_entry.ratio_level)
    terms, stats = loss_entry.terms(log_ratio, advantages, mask, settings)
    if importance_weights is not None:  # w >= 0 commutes with the max
        terms = terms * importance_weights.detach()
    loss = masked_mean(terms, mask, aggregation, denominator)
    with torch.no_grad():
        token_log_ratio = logprobs - old_logprobs
        stats["approx_kl"] = masked_mean(token_log_ratio.exp() - 1.0 - token_log_ratio, mask)
    return loss, stats


# ---------------------------------------------------------------------------- the entries


def clipped_terms(log_ratio: Tensor, advantages: Tensor, mask: Tensor,
                  bounds: tuple[float, float]) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO's clipped surrogate: ``max(-A * rho, -A * clip(rho, 1 - eps_low, 1 + eps_high))``, a token whose
    ratio left the range on the side its advantage pushes losing its gradient."""
    ratio = log_ratio.exp()
    clipped = ratio.clamp(1.0 - bounds[0], 1.0 + bounds[1])
    terms = torch.maximum(-advantages * ratio, -advantages * clipped)
    return terms, {"clipfrac": clip_fraction(ratio, mask, *bounds)}


def clipped_objective(ratio: Tensor, advantages: Tensor, bounds: tuple[float, float]) -> Tensor:
    """The clipped surrogate of PPO's paper, eq. 7: ``-min(r A, clip(r, 1 - eps, 1 + eps) A)``."""
    return -torch.minimum(ratio * advantages, ratio.clamp(1.0 - bounds[0], 1.0 + bounds[1]) * advantages)


def row_geometric_ratio(token_log_ratio: Tensor, mask: Tensor) -> Tensor:
    """[B, 1] ``(prod_t r_t)^(1 / |y|)`` of each row over its tokens."""
    return ((token_log_ratio * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)).exp()


def ppo_clip(p: Any) -> tuple[float, float]:
    """(eps_low, eps_high): ppo.clip_range_low and ppo.clip_range_high, each ppo.clip_range when unset."""
    return (p.clip_range if p.clip_range_low is None else p.clip_range_low,
            p.clip_range if p.clip_range_high is None else p.clip_range_high)


def gspo_clip(p: Any) -> tuple[float, float]:
    return p.gspo_clip_low, p.gspo_clip_high


@entry_rule("ppo.clip_range", "ppo.clip_range_low", "ppo.clip_range_high",
            example={"ppo": {"clip_range": 0.3, "clip_range_low": 0.1, "clip_range_high": 0.28}})
def clip_range_beside_both_bounds(cfg: Any) -> str | None:
    p = cfg.ppo
    if p.clip_range_low is None or p.clip_range_high is None or p.clip_range == PPOConfig().clip_range:
        return None
    return (f"ppo.clip_range={p.clip_range} is set but ppo.clip_range_low and ppo.clip_range_high are both "
            "set, and the ratio's clip takes them alone; drop ppo.clip_range or one of the two bounds")


@entry_rule("ppo.policy_loss", "ppo.clip_range", "ppo.clip_range_low", "ppo.gspo_clip_low",
            example={"ppo": {"clip_range_low": 1.0}})
def ratio_floor_above_zero(cfg: Any) -> str | None:
    p = cfg.ppo
    low = POLICY_LOSSES.get(p.policy_loss).clip(p)[0]
    if low < 1:
        return None
    field = ("gspo_clip_low" if p.policy_loss != "ppo" else "clip_range" if p.clip_range_low is None
             else "clip_range_low")
    return (f"ppo.{field}={low} puts the ratio's floor 1 - {low} at or below 0, where no ratio reaches it (a "
            "ratio is > 0): the lower clip epsilon must be < 1")


PPO = POLICY_LOSSES.register(PolicyLoss(
    name="ppo", doc="PPO's clipped surrogate, a ratio per token (Schulman et al. 2017)",
    reads={"clip_range": "PPO's clip epsilon of the token ratio",
           "clip_range_low": "the lower clip epsilon of PPO's token ratio",
           "clip_range_high": "the upper clip epsilon of PPO's token ratio (DAPO's clip-higher)"},
    rules=(clip_range_beside_both_bounds, ratio_floor_above_zero),
    terms=lambda log_ratio, a, mask, p: clipped_terms(log_ratio, a, mask, ppo_clip(p)),
    objective=lambda log_r, a, mask, p: clipped_objective(log_r.exp(), a, ppo_clip(p)),
    clip=ppo_clip))

GSPO_READS = {"gspo_clip_low": "the lower clip epsilon of GSPO's sequence ratio",
              "gspo_clip_high": "the upper clip epsilon of GSPO's sequence ratio"}


@entry_rule("ppo.policy_loss", "ppo.advantage", example={"ppo": {"policy_loss": "gspo", "advantage": "gae"}})
def gspo_needs_advantages_per_response(cfg: Any) -> str | None:
    if cfg.ppo.advantage != "gae":
        return None
    return ("ppo.policy_loss='gspo' gives every token of a response the sequence's one ratio, so its "
            "gradient averages GAE's per-token advantages over the response; use "
            "ppo.policy_loss='gspo_token' (GSPO's ratio, each token's own advantage) with gae")


@entry_rule("ppo.policy_loss", "ppo.correction", "ppo.correction_level",
            example={"ppo": {"policy_loss": "gspo", "advantage": "grpo", "correction": "tis"},
                     "rollout": {"samples_per_prompt": 2}})
def gspo_needs_a_sequence_correction(cfg: Any) -> str | None:
    p = cfg.ppo
    if p.correction == "icepop":
        return ("ppo.policy_loss='gspo' takes one ratio per response, but ppo.correction='icepop' weighs and "
                "masks each token by its own ratio; use ppo.policy_loss='gspo_token', or a sequence-level "
                "correction (ppo.correction 'tis', 'mis', 'geometric_mask' or 'off_policy_mask' with "
                "ppo.correction_level='sequence')")
    if p.correction != "none" and p.correction_level == "token":
        return ("ppo.policy_loss='gspo' takes one ratio per response; its rollout correction must be one "
                "weight per response too, the response's likelihood ratio pi_old(y) / pi_behav(y): set "
                "ppo.correction_level='sequence' (or ppo.correction='none' in sync mode)")
    return None


def gspo_objective(log_r: Tensor, a: Tensor, mask: Tensor, p: Any) -> Tensor:
    """GSPO's eq. 5 on each token: ``-min(s A, clip(s) A)``, s the row's geometric-mean ratio."""
    return clipped_objective(row_geometric_ratio(log_r, mask).expand_as(log_r), a, gspo_clip(p))


def gspo_token_objective(log_r: Tensor, a: Tensor, mask: Tensor, p: Any) -> Tensor:
    """GSPO-token's eq. 13: ``s_t = sg[s] * pi_t / sg[pi_t]`` in the clipped surrogate."""
    s = row_geometric_ratio(log_r, mask).detach() * (log_r - log_r.detach()).exp()
    return clipped_objective(s, a, gspo_clip(p))


POLICY_LOSSES.register(PolicyLoss(
    name="gspo", doc="GSPO: one length-normalised ratio (pi/pi_old)^(1/|y|) per response, clipped per "
    "response (Zheng et al. 2025)", reads=GSPO_READS,
    rules=(ratio_floor_above_zero, gspo_needs_advantages_per_response, gspo_needs_a_sequence_correction),
    terms=lambda log_ratio, a, mask, p: clipped_terms(log_ratio, a, mask, gspo_clip(p)),
    objective=gspo_objective, ratio_level="sequence", clip=gspo_clip))

POLICY_LOSSES.register(PolicyLoss(
    name="gspo_token", doc="GSPO-token: GSPO's ratio with each token's gradient, for per-token advantages",
    reads=GSPO_READS, rules=(ratio_floor_above_zero,),
    terms=lambda log_ratio, a, mask, p: clipped_terms(log_ratio, a, mask, gspo_clip(p)),
    objective=gspo_token_objective, ratio_level="sequence_token", clip=gspo_clip))


def cispo_clip(p: Any) -> tuple[float, float]:
    return p.cispo_clip_low, p.cispo_clip_high


def cispo_terms(log_ratio: Tensor, a: Tensor, mask: Tensor, p: Any) -> tuple[Tensor, dict[str, Tensor]]:
    """``-A * sg(clip(rho)) * pi / sg(pi)``: the value of ``-A * clip(rho)``, finite, and the gradient of the
    peers' ``-A * sg(clip(rho)) * log pi`` (whose value scales with log pi)."""
    pi_over_sg_pi = (log_ratio - log_ratio.detach()).exp()
    terms = -a * cispo_weight(log_ratio, *cispo_clip(p)) * pi_over_sg_pi
    return terms, {"clipfrac": clip_fraction(log_ratio.exp(), mask, *cispo_clip(p))}


def cispo_objective(log_r: Tensor, a: Tensor, mask: Tensor, p: Any) -> Tensor:
    """MiniMax-M1's eq. 4: ``-sg(clip(r, 1 - eps_low, 1 + eps_high)) A log pi`` (log pi = log r + const)."""
    low, high = cispo_clip(p)
    return -log_r.exp().clamp(1.0 - low, 1.0 + high).detach() * a * log_r


POLICY_LOSSES.register(PolicyLoss(
    name="cispo", doc="CISPO: -sg(clip(r)) * A * log pi, the token ratio clipped and detached, no token's "
    "gradient dropped (MiniMax-M1)",
    reads={"cispo_clip_low": "the floor 1 - it of CISPO's detached weight",
           "cispo_clip_high": "the ceiling 1 + it of CISPO's detached weight"},
    terms=cispo_terms, objective=cispo_objective, clip=cispo_clip))


def sapo_terms(log_ratio: Tensor, a: Tensor, mask: Tensor, p: Any) -> tuple[Tensor, dict[str, Tensor]]:
    gate, gradient_factor = sapo_gate(log_ratio, a, p.sapo_tau_pos, p.sapo_tau_neg)
    return -a * gate, {"gate_weight_mean": masked_mean(gradient_factor, mask)}


def sapo_objective(log_r: Tensor, a: Tensor, mask: Tensor, p: Any) -> Tensor:
    """SAPO's eq. 6: ``-A * 4 / tau * sigmoid(tau * (r - 1))``, tau_pos where A > 0, tau_neg elsewhere."""
    tau = torch.where(a > 0, p.sapo_tau_pos, p.sapo_tau_neg).to(log_r.dtype)
    return -a * 4.0 / tau * torch.sigmoid(tau * (log_r.exp() - 1.0))


POLICY_LOSSES.register(PolicyLoss(
    name="sapo", doc="SAPO: -A * 4/tau * sigmoid(tau * (r - 1)), a soft gate in place of the clip (Qwen)",
    reads={"sapo_tau_pos": "the temperature of SAPO's gate on tokens with a positive advantage",
           "sapo_tau_neg": "the temperature of SAPO's gate on tokens with a negative advantage"},
    terms=sapo_terms, objective=sapo_objective))
