"""KL estimators, response-level KL penalties and rewards, and the KL controllers.

Pure torch: this module imports neither Ray nor DeepSpeed. It implements the KL accounting of
docs/kl-accounting.md exactly.

Every per-token tensor is *response-aligned*, shape [B, T]: position t is the t-th token after the prompt
of sequence b, and ``mask[b, t] = 1`` for the tokens the model sampled (up to and including the first
EOS), 0 after. In a multi-turn trajectory the mask is the action mask: 1 on the model's turns, 0 on the
environment's tokens between them, so it need not be a prefix; everything below sums over the model's
tokens only. Prompt tokens never appear in these tensors.

With ``r = logprobs - ref_logprobs``:

    k1 = r                  unbiased for KL(pi || pi_ref); the default; unbiased gradient in the reward
    k2 = r^2 / 2            biased, low variance
    k3 = exp(-r) - 1 + r    unbiased, always >= 0

The controller is fed ``response_mean = mean_b sum_t kl[b, t]``: the same nats the reward penalised.

With ``kl.placement: loss`` the KL is a loss term instead, summed per response like the controller's
statistic (``response_kl_loss``), its gradient over the policy term's tokens (``kl_loss_aggregation``) so beta
weighs it as it does in the reward. Its expected gradient is that of the response KL
``E_{y~pi}[sum_t r_t]``, which no per-token ``k(r_t)`` gives: k1's is 0, k3's is the reverse KL's, and
per-token k2 misses the later tokens' log-ratios. ``grpo_token_k3_loss`` keeps GRPO's form to reproduce it.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, get_args

import torch
from torch import Tensor

from learner.ppo import Aggregation, masked_mean
from learner.registry import Entry, Registry
from services.choices import GRPO_TOKEN_K3_WARNING, LossForm

Scope = Literal["response_sum", "token_mean"]
SCOPES: tuple[str, ...] = get_args(Scope)
LOSS_FORMS: tuple[str, ...] = get_args(LossForm)
# loss forms whose expected gradient is exactly that of the response KL (tests/test_kl_loss.py enumerates)
EXACT_LOSS_FORMS: tuple[str, ...] = ("kl_to_go", "response_k2")


# ---------------------------------------------------------------- input checks (fail loudly, change nothing)


def _first_index(bad: Tensor) -> tuple[int, ...]:
    return tuple(int(i) for i in bad.nonzero()[0])


def check_finite(name: str, x: Tensor) -> None:
    """Raise ValueError naming the count and first (row, token) of NaN/inf entries in ``x``."""
    bad = ~torch.isfinite(x)
    if bad.any():
        where = _first_index(bad)
        raise ValueError(
            f"{name} has {int(bad.sum())} non-finite value(s) (NaN or inf); first at (row, token) = {where}"
        )


@dataclass(frozen=True, kw_only=True)
class KLEstimator(Entry):
    """``per_token(r)``: [B, T] the estimate k(r) from ``r = logprobs - ref_logprobs`` of tokens sampled from
    pi; ``unbiased``: its expectation is KL(pi || pi_ref), so the controller's statistic is exact;
    ``exact_penalty_gradient``: its penalty in the reward has the policy gradient of KL(pi || pi_ref) (k1
    alone: the others' expectations are right or close, their gradients through the reward are not);
    ``objective(r)``: the documented k(r), written again in float64 (the harness's reference of the
    controller's statistic, whose expectation it computes by enumeration)."""

    per_token: Callable[[Tensor], Tensor]
    objective: Callable[[Tensor], Tensor]
    unbiased: bool
    exact_penalty_gradient: bool = False


KL_ESTIMATORS: Registry[KLEstimator] = Registry("kl.estimator", "KL estimator")
KL_ESTIMATORS.register(KLEstimator(
    name="k1", doc="r: unbiased, the default; an unbiased gradient in the reward", reads={},
    per_token=lambda r: r, objective=lambda r: r, unbiased=True, exact_penalty_gradient=True))
KL_ESTIMATORS.register(KLEstimator(
    name="k2", doc="r^2 / 2: biased, low variance", reads={}, per_token=lambda r: 0.5 * r.square(),
    objective=lambda r: r**2 / 2, unbiased=False))
# expm1 keeps k3 accurate (and >= 0) for small |r|, where exp(-r) - 1 cancels
KL_ESTIMATORS.register(KLEstimator(
    name="k3", doc="exp(-r) - 1 + r: unbiased, always >= 0", reads={},
    per_token=lambda r: torch.expm1(-r) + r, objective=lambda r: torch.exp(-r) - 1 + r, unbiased=True))


def check_estimator(estimator: str) -> KLEstimator:
    """The registered KL estimator ``estimator`` (ValueError naming the registered ones)."""
    return KL_ESTIMATORS.get(estimator)


def check_response_mask(mask: Tensor, shape: torch.Size | tuple[int, ...], prefix: bool = False) -> Tensor:
    """Validate a [B, T] mask and return it as a float tensor.

    It must have ``shape`` and hold only 0/1. An action mask may have gaps (a trajectory's environment
    tokens); with ``prefix`` it must be a prefix in each row (no 1 after a 0), as a single response's is.
    """
    if tuple(mask.shape) != tuple(shape):
        raise ValueError(f"mask has shape {tuple(mask.shape)}, expected {tuple(shape)} (response-aligned "
                         "[B, T])")
    m = mask.to(torch.float32) if mask.dtype == torch.bool else mask
    not_binary = (m != 0) & (m != 1)
    if not_binary.any():
        raise ValueError("mask must hold only 0/1; first other value at "
                         f"(row, token) = {_first_index(not_binary)}")
    if prefix and m.shape[-1] > 1:
        gap = m[:, 1:] > m[:, :-1]
        if gap.any():
            row, tok = _first_index(gap)
            raise ValueError(
                f"mask is not a prefix in row {row}: token {tok + 1} is 1 after a 0 at token {tok}; "
                "response masks must be 1 up to the first EOS and 0 after"
            )
    return m.to(torch.float32) if not m.is_floating_point() else m


def _check_logprob_pair(logprobs: Tensor, ref_logprobs: Tensor) -> None:
    if logprobs.dim() != 2:
        raise ValueError(f"logprobs must be response-aligned [B, T], got shape {tuple(logprobs.shape)}")
    if logprobs.shape != ref_logprobs.shape:
        raise ValueError(
            f"logprobs shape {tuple(logprobs.shape)} != ref_logprobs shape {tuple(ref_logprobs.shape)}"
        )
    check_finite("logprobs", logprobs)
    check_finite("ref_logprobs", ref_logprobs)


def _check_coef(name: str, value: float, *, positive: bool = False) -> float:
    value = float(value)
    if not math.isfinite(value) or value < 0 or (positive and value == 0):
        need = "positive" if positive else "non-negative"
        raise ValueError(f"{name} must be a finite {need} number, got {value!r}")
    return value


# ---------------------------------------------------------------- estimators, penalties, rewards


def kl_estimate(logprobs: Tensor, ref_logprobs: Tensor, estimator: str = "k1") -> Tensor:
    """Per-token KL estimate, unmasked.

    Args:
        logprobs: [B, T] log pi(a_t) of the sampled tokens under the policy.
        ref_logprobs: [B, T] log pi_ref(a_t) of the same tokens under the frozen reference.
        estimator: a registered one (``KL_ESTIMATORS``): "k1" (r), "k2" (r^2/2) or "k3" (exp(-r) - 1 + r),
            with r = logprobs - ref_logprobs.
    Returns:
        [B, T] per-token estimates.
    """
    entry = check_estimator(estimator)
    _check_logprob_pair(logprobs, ref_logprobs)
    return entry.per_token(logprobs - ref_logprobs)


def masked_kl(logprobs: Tensor, ref_logprobs: Tensor, mask: Tensor, estimator: str = "k1") -> Tensor:
    """[B, T] per-token penalty ``kl_t = k(r_t) * mask_t``."""
    kl = kl_estimate(logprobs, ref_logprobs, estimator)
    return kl * check_response_mask(mask, kl.shape).to(kl.dtype)


def last_token_index(mask: Tensor) -> Tensor:
    """[B] index of the last model token of each row (the last t with mask = 1); -1 for empty rows."""
    positions = torch.arange(-1, mask.shape[-1], device=mask.device)  # a column of -1 for empty rows
    padded = torch.nn.functional.pad(mask, (1, 0), value=1)
    return torch.where(padded > 0, positions, -1).amax(dim=-1)


def kl_penalized_rewards(
    scores: Tensor,
    logprobs: Tensor,
    ref_logprobs: Tensor,
    mask: Tensor,
    kl_coef: float,
    estimator: str = "k1",
    turn_rewards: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Per-token rewards: ``-kl_coef * kl_t``, plus each sequence's score at its last model token, or, for
    a multi-turn trajectory, each turn's reward where ``turn_rewards`` puts it (the turn's last model token).

    Args:
        scores: [B] sequence scores from the reward model or function (a trajectory's: its turns' sum).
        logprobs, ref_logprobs: [B, T] sampled-token log-probs of policy and reference.
        mask: [B, T] action mask (bool or 0/1): the tokens the model sampled.
        kl_coef: beta >= 0.
        estimator: KL estimator for the penalty.
        turn_rewards: [B, T] or None; nonzero only where ``mask`` is 1. Given, it replaces ``scores``'
            placement: ``scores`` must then be its row sums.
    Returns:
        (rewards [B, T], kl [B, T]) where ``kl`` is the masked per-token estimate. Rows with an empty
        mask get neither penalty nor score; ``kl_stats_from_sums`` counts them.
    """
    kl = masked_kl(logprobs, ref_logprobs, mask, estimator)
    beta = _check_coef("kl_coef", kl_coef)
    if scores.shape != kl.shape[:1]:
        raise ValueError(f"scores has shape {tuple(scores.shape)}, expected [B] = [{kl.shape[0]}]")
    check_finite("scores", scores.unsqueeze(-1))
    rewards = -beta * kl
    if turn_rewards is not None:
        if turn_rewards.shape != kl.shape:
            raise ValueError(f"turn_rewards has shape {tuple(turn_rewards.shape)}, expected "
                             f"{tuple(kl.shape)}")
        check_finite("turn_rewards", turn_rewards)
        off_model = (turn_rewards != 0) & (mask == 0)
        if off_model.any():
            raise ValueError(f"turn_rewards has a reward on a token the model did not sample, first at (row, "
                             f"token) = {_first_index(off_model)}: a turn's reward lands on its last model "
                             "token")
        return rewards + turn_rewards.to(rewards.dtype), kl
    last = last_token_index(mask)
    rows = (last >= 0).nonzero().squeeze(-1)
    rewards[rows, last[rows]] += scores[rows].to(rewards.dtype)
    return rewards, kl


def kl_logprob_roles(proximal_logprobs: Tensor, behaviour_logprobs: Tensor,
                     off_policy: bool) -> tuple[Tensor, Tensor]:
    """Which sampled-token log-probs each KL role takes: ``(penalised, sampler)``.

    - ``penalised``: the penalty in the reward and the controller's statistic. The policy gradient of
      ``E[score] - beta * KL(pi || pi_ref)`` needs the log-probs of the policy being optimised, which the
      learner holds for these rows at the start of the update: ``proximal_logprobs`` (its own forward at
      collection), in both modes. The engine's are an older version's in async mode (biased:
      tests/test_kl_loss.py enumerates).
    - ``sampler``: the old policy of the KL loss term's prefix importance weights (``response_kl_loss``),
      exact only against the policy that sampled the rows: async (``off_policy``), the engine's
      ``behaviour_logprobs``; sync, the learner's own of that same version (their numeric difference is left
      to the probe).

    Args: proximal_logprobs, behaviour_logprobs: [B, T]; off_policy: rollout.mode async.
    Returns: two [B, T] tensors, each one of the inputs.
    """
    if proximal_logprobs.shape != behaviour_logprobs.shape:
        raise ValueError(f"proximal_logprobs {tuple(proximal_logprobs.shape)} and behaviour_logprobs "
                         f"{tuple(behaviour_logprobs.shape)} must share one [B, T] shape")
    return proximal_logprobs, behaviour_logprobs if off_policy else proximal_logprobs


# ---------------------------------------------------------------- the KL as a loss term (kl.placement: loss)


def teacher_penalties(logprobs: Tensor, teacher_logprobs: Tensor, mask: Tensor, coef: float) -> Tensor:
    """On-policy distillation's per-token signal: ``-coef * (log pi(y_t) - log pi_teacher(y_t))`` on the
    ``mask``, the k1 estimate of the reverse KL(pi || teacher) at the token the student sampled, weighed by
    the fixed ``coef`` (``distill.coef``). Its expectation over the student's own token is
    ``-coef * KL(pi || teacher)`` at that state, whose gradient (through the score function) is the per-state
    reverse KL's.

    Args: logprobs, teacher_logprobs: [B, T] the student's (the learner's, as for the reference KL) and the
        teacher's sampled-token log-probs; mask: [B, T]; coef > 0. Returns: [B, T], 0 where ``mask`` is 0.
    """
    _check_logprob_pair(logprobs, teacher_logprobs)
    m = check_response_mask(mask, logprobs.shape).to(logprobs.dtype)
    return -_check_coef("distill.coef", coef, positive=True) * (logprobs - teacher_logprobs) * m


def kl_loss_aggregation(aggregation: Aggregation) -> Aggregation:
    """The count ``response_kl_loss``'s gradient divides by (its ``denominator``) under the policy term's
    ``ppo.loss_aggregation``: that policy term's tokens, so that beta weighs the KL against it as the KL in
    the reward does (with GAE at gamma = lambda = 1, unwhitened, both placements give one gradient).

    ``token_mean``: the tokens; ``seq_mean_token_sum_norm``: B * T; ``sequence_mean``: the tokens too, its
    rows times their mean length (per row, the 1 / length weights would make the KL's gradient length-biased;
    the reward's KL takes them, so the placements differ by them where lengths differ)."""
    if aggregation not in ("token_mean", "sequence_mean", "seq_mean_token_sum_norm"):
        raise ValueError(f"unknown loss aggregation {aggregation!r}")
    return "seq_mean_token_sum_norm" if aggregation == "seq_mean_token_sum_norm" else "token_mean"


def response_kl_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    ref_logprobs: Tensor,
    mask: Tensor,
    form: LossForm = "kl_to_go",
    num_responses: Tensor | float | None = None,
    denominator: Tensor | float | None = None,
) -> Tensor:
    """KL term for the loss whose expected gradient is that of the current policy's response KL
    ``KL(theta) = E_{y~pi_theta}[sum_t r_t]``, summed per response, over a count of responses or tokens.

    The rows were sampled by the behaviour policy (``old_logprobs``), the current policy is ``logprobs``
    (a PPO epoch after the first step is off-policy). Each token is weighted by the detached prefix
    importance weight ``W_t = prod_{s<=t} pi(y_s)/pi_old(y_s)``, so every minibatch is exact, not only the
    first. All W are 1 at the behaviour policy and grow with the distance from it; they are not truncated,
    which would bias the gradient.

    - ``kl_to_go``: gradient ``sum_t grad logp_t * G_t`` with the KL to go ``G_t = sum_{t'>=t} W_t' r_t'``
      (score function; the pathwise ``E[grad r_t]`` is 0, and earlier tokens' r drop out by causality).
    - ``response_k2``: gradient of ``W_T * (sum_t r_t)^2 / 2``, i.e. ``W_T R grad log pi(y)``, whose
      expectation is ``grad E[R]`` too; no causality, so more variance than ``kl_to_go``.

    Args:
        logprobs: [B, T] current policy log-probs of the sampled tokens (with grad).
        old_logprobs: [B, T] log-probs of the policy that sampled the rows: in async mode the engine's, not
            the proximal policy's (``kl_logprob_roles``).
        ref_logprobs: [B, T] frozen reference log-probs of the same tokens.
        mask: [B, T] action mask (bool or 0/1); the environment's tokens (0) carry no log-ratio and no
            importance weight: their probability is the environment's, the same under both policies.
        form: "kl_to_go" or "response_k2".
        num_responses: divide the sum over responses by this: a rank's share of the global count of
            responses, empty ones included, as the controller's mean counts them; default B.
        denominator: divide the gradient's sum over responses by this count instead of ``num_responses``:
            in the job the policy term's tokens (``kl_loss_aggregation``), so that beta weighs the KL against
            the policy term as it does in the reward; default ``num_responses``.
    Returns:
        Scalar. Its value is the mean over responses of ``sum_t W_t r_t``, unbiased for the current
        policy's response KL in nats; its gradient is the form's over ``denominator``.
    """
    if form not in EXACT_LOSS_FORMS:
        raise ValueError(f"response_kl_loss form must be one of {EXACT_LOSS_FORMS}, got {form!r}")
    _check_logprob_pair(logprobs, ref_logprobs)
    if old_logprobs.shape != logprobs.shape:
        raise ValueError(f"old_logprobs shape {tuple(old_logprobs.shape)} != logprobs shape "
                         f"{tuple(logprobs.shape)}")
    check_finite("old_logprobs", old_logprobs)
    m = check_response_mask(mask, logprobs.shape).to(logprobs.dtype)
    log_ratio = (logprobs - ref_logprobs) * m
    weights = torch.cumsum((logprobs - old_logprobs).detach() * m, dim=-1).exp()  # W_t, 1 after the end
    weighted = (weights * log_ratio).detach()
    value = weighted.sum(dim=-1)  # [B] importance-weighted k1 response KL
    if form == "kl_to_go":
        to_go = weighted.flip(-1).cumsum(-1).flip(-1)  # G_t = sum_{t' >= t} W_t' r_t'
        surrogate = ((logprobs - logprobs.detach()) * to_go * m).sum(dim=-1)  # value 0, the gradient above
    else:
        half_square = 0.5 * weights[:, -1] * log_ratio.sum(dim=-1).square()
        surrogate = half_square - half_square.detach()
    if num_responses is None:
        num_responses = float(logprobs.shape[0])
    if denominator is None:
        denominator = num_responses
    return value.sum() / num_responses + surrogate.sum() / denominator


def grpo_token_k3_loss(
    logprobs: Tensor,
    ref_logprobs: Tensor,
    mask: Tensor,
    aggregation: Aggregation = "token_mean",
    denominator: Tensor | float | None = None,
) -> Tensor:
    """GRPO's KL term, kept only to reproduce it: the masked mean of per-token k3 of the current policy.

    Its expected gradient is per-token ``-E[sum_a pi_ref(a) grad log pi(a)]`` (the reverse KL's), not the
    response KL's; it warns so. Args as ``learner.ppo.masked_mean``: [B, T] ``logprobs`` (with grad),
    ``ref_logprobs`` and ``mask``; ``aggregation`` and ``denominator`` those of the PPO losses.
    Returns a scalar.
    """
    warnings.warn(GRPO_TOKEN_K3_WARNING, stacklevel=2)
    m = check_response_mask(mask, logprobs.shape).to(logprobs.dtype)
    return masked_mean(kl_estimate(logprobs, ref_logprobs, "k3"), m, aggregation, denominator)


# ---------------------------------------------------------------- statistics (exact across ranks)


def prefix_log_weights(logprobs: Tensor, behaviour_logprobs: Tensor, mask: Tensor) -> Tensor:
    """[B, T] detached ``log W_t = sum_{s <= t} (log pi(y_s) - log pi_behav(y_s))`` over the ``mask``: the
    likelihood ratio of each token's prefix, which turns an expectation under the sampler into one under pi.
    Args: logprobs, behaviour_logprobs, mask: [B, T] (the environment's tokens, 0, carry no ratio)."""
    return torch.cumsum((logprobs - behaviour_logprobs).detach().double() * mask, dim=-1)


def episode_kl(logprobs: Tensor, ref_logprobs: Tensor, mask: Tensor, estimator: str = "k1",
               behaviour_logprobs: Tensor | None = None) -> Tensor:
    """[B] float64 ``x_b = sum_t W_t k(r_t)`` over the ``mask`` of each row, one row an episode (an agent's
    several rows laid end to end: ``learner.algorithm.EpisodeView``).

    ``behaviour_logprobs`` None (the rows were sampled by ``logprobs``' own policy): W = 1, and ``x_b`` is the
    response KL the reward penalises. Given (async: the engine's, an older version's): W is the prefix
    likelihood ratio pi / pi_behav (``prefix_log_weights``), so ``E_behav[x_b]`` is KL(pi || pi_ref) exactly
    for k1 and k3: the KL of the policy being optimised, not of the sampler.
    """
    m = check_response_mask(mask, logprobs.shape)
    per_token = kl_estimate(logprobs, ref_logprobs, estimator).double() * m
    if behaviour_logprobs is not None:
        per_token = per_token * prefix_log_weights(logprobs, behaviour_logprobs, m).exp()
    return per_token.sum(dim=-1)


def kl_sums(logprobs: Tensor, ref_logprobs: Tensor, mask: Tensor, estimator: str = "k1",
            behaviour_logprobs: Tensor | None = None) -> dict[str, float]:
    """Additive sums of the rows' ``episode_kl`` for every estimator: summing these over disjoint shards then
    calling ``kl_stats_from_sums`` gives the exact statistics of the whole batch.
    ``response_sq_sum`` (the sum of the configured estimator's ``x_b^2``) gives the mean's standard error."""
    check_estimator(estimator)
    m = check_response_mask(mask, logprobs.shape)
    sums: dict[str, float] = {}
    for k in KL_ESTIMATORS.names():
        values = episode_kl(logprobs, ref_logprobs, m, k, behaviour_logprobs)
        sums[f"{k}_response_sum"] = float(values.sum())
        if k == estimator:
            sums["response_sq_sum"] = float(values.square().sum())
    lengths = m.sum(dim=-1)
    sums["response_sum"] = sums[f"{estimator}_response_sum"]
    sums["num_tokens"] = float(lengths.sum())
    sums["num_responses"] = float(m.shape[0])
    sums["empty_responses"] = float((lengths == 0).sum())
    return sums


def kl_stats_from_sums(sums: dict[str, float]) -> dict[str, float]:
    """Turn (possibly all-reduced) ``kl_sums`` into the reported statistics."""
    n = sums["num_responses"]
    if n <= 0:
        raise ValueError("kl statistics need at least one response; the batch is empty")
    response_mean = sums["response_sum"] / n
    variance = max(sums.get("response_sq_sum", float("nan")) / n - response_mean**2, 0.0) * n / max(n - 1, 1)
    stats = {
        # the controller's statistic: mean over episodes of the response KL, in nats
        "response_mean": response_mean,
        # its standard error over the batch's episodes
        "response_stderr": math.sqrt(variance / n) if n > 1 else float("nan"),
        # diagnostics only: per-token mean (what other frameworks feed their controllers)
        "token_mean": sums["response_sum"] / sums["num_tokens"] if sums["num_tokens"] > 0 else 0.0,
        # sqrt(KL) as Anthropic reports it; k1's sample mean can dip below 0, so clamp at 0
        "response_sqrt": math.sqrt(max(response_mean, 0.0)),
        "empty_responses": sums["empty_responses"],
        "num_responses": n,
        "num_tokens": sums["num_tokens"],
    }
    for k in KL_ESTIMATORS.names():
        stats[f"{k}_response_mean"] = sums[f"{k}_response_sum"] / n
    # the unweighted response KL of the trained episodes: what the reward penalised
    if sums.get("penalty_episodes"):
        stats["penalty_mean"] = sums["penalty_sum"] / sums["penalty_episodes"]
    return stats


def controller_statistic(stats: dict[str, float], scope: Scope = "response_sum") -> float:
    """The statistic the controller is fed: ``response_mean`` for scope "response_sum" (the default,
    the KL the reward penalised), ``token_mean`` for "token_mean" (only to reproduce other frameworks)."""
    if scope == "response_sum":
        return stats["response_mean"]
    if scope == "token_mean":
        warnings.warn(
            "kl.scope='token_mean' feeds the controller a per-token mean, not the response KL the reward "
            "penalises; use it only to reproduce other frameworks",
            stacklevel=2,
        )
        return stats["token_mean"]
    raise ValueError(f"unknown kl scope {scope!r}; expected one of {SCOPES}")


# ---------------------------------------------------------------- controllers


class FixedKLController:
    """Constant beta."""

    kind = "fixed"

    def __init__(self, kl_coef: float) -> None:
        self.value = _check_coef("kl_coef", kl_coef)

    def update(self, current: float, n_steps: int) -> float:
        _check_update_args(current, n_steps)
        return self.value

    def state_dict(self) -> dict[str, float | str]:
        return {"kind": self.kind, "value": self.value}

    def load_state_dict(self, state: dict) -> None:
        _check_state_kind(state, self.kind)
        self.value = _check_coef("state['value']", state["value"])


class AdaptiveKLController:
    """lm-human-preferences' proportional controller (Ziegler et al. 2019).

    ``e = clip(current / target - 1, -0.2, 0.2)``; ``beta <- beta * (1 + e * n_steps / horizon)``.
    Call ``update`` once per rollout batch with ``n_steps`` = episodes in that batch.
    """

    kind = "adaptive"

    def __init__(self, init_kl_coef: float = 0.15, target: float = 6.0, horizon: int = 10000) -> None:
        self.value = _check_coef("init_kl_coef", init_kl_coef)
        self.target = _check_coef("target", target, positive=True)
        self.horizon = _check_coef("horizon", horizon, positive=True)

    def update(self, current: float, n_steps: int) -> float:
        _check_update_args(current, n_steps)
        if n_steps > self.horizon:
            raise ValueError(f"n_steps={n_steps} exceeds horizon={self.horizon}; beta could flip sign")
        proportional_error = min(max(current / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + proportional_error * n_steps / self.horizon
        return self.value

    def state_dict(self) -> dict[str, float | str]:
        return {"kind": self.kind, "value": self.value, "target": self.target, "horizon": self.horizon}

    def load_state_dict(self, state: dict) -> None:
        _check_state_kind(state, self.kind)
        for key in ("target", "horizon"):
            if float(state[key]) != getattr(self, key):
                raise ValueError(
                    f"KL controller state has {key}={state[key]}, but this controller has "
                    f"{key}={getattr(self, key)}; refusing to mix them"
                )
        self.value = _check_coef("state['value']", state["value"])


KLController = FixedKLController | AdaptiveKLController


def _check_update_args(current: float, n_steps: int) -> None:
    if not math.isfinite(float(current)):
        raise ValueError(f"KL controller got a non-finite statistic {current!r}")
    if int(n_steps) != n_steps or n_steps <= 0:
        raise ValueError(f"n_steps must be a positive integer (episodes in the batch), got {n_steps!r}")


def _check_state_kind(state: dict, kind: str) -> None:
    if not isinstance(state, dict) or state.get("kind") != kind or "value" not in state:
        got = state.get("kind") if isinstance(state, dict) else type(state).__name__
        raise ValueError(f"KL controller state is not a {kind!r} controller's (got kind {got!r})")
