"""PPO math on response-aligned tensors: GAE, masked whitening, clipped policy and value losses.

Pure torch. Shapes: B sequences, T response positions; ``mask`` is [B, T] float 0/1, the action mask: a
prefix per row for a single response, with gaps at the environment's tokens for a multi-turn trajectory.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

Aggregation = Literal["token_mean", "sequence_mean", "seq_mean_token_sum_norm"]
AGGREGATIONS = ("token_mean", "sequence_mean", "seq_mean_token_sum_norm")


def masked_sum(x: Tensor, mask: Tensor) -> Tensor:
    """Scalar sum of ``x`` [B, T] over masked positions."""
    return (x * mask).sum()


def loss_denominator(mask: Tensor, aggregation: Aggregation = "token_mean",
                     width: int | None = None) -> Tensor:
    """Scalar count a mean over ``mask`` [B, T] divides by: its tokens (``token_mean``), its rows with
    any token (``sequence_mean``), or B * T (``seq_mean_token_sum_norm``: Dr. GRPO's constant normaliser T
    per row, every row counted; T is the response width, which the engines pad to rollout.max_new_tokens;
    ``width`` gives it where the rows are an episode's laid end to end, wider than one response).
    Additive, so W ranks all-reduce theirs into the global count."""
    if aggregation == "token_mean":
        return mask.sum()
    if aggregation == "sequence_mean":
        return (mask.sum(dim=-1) > 0).sum().to(mask.dtype)
    if aggregation == "seq_mean_token_sum_norm":
        row_width = mask.shape[-1] if width is None else width
        return torch.tensor(float(mask.shape[0] * row_width), dtype=mask.dtype, device=mask.device)
    raise ValueError(f"unknown loss aggregation {aggregation!r}; expected one of {AGGREGATIONS}")


def masked_mean(x: Tensor, mask: Tensor, aggregation: Aggregation = "token_mean",
                denominator: Tensor | float | None = None) -> Tensor:
    """Scalar mean of ``x`` [B, T] over masked positions.

    ``token_mean``: every response token weighs the same (sum x*mask / sum mask).
    ``sequence_mean``: each row is averaged over its own tokens, then rows with any token are averaged,
    so long and short responses weigh the same. Returns 0 when the mask is empty.
    ``seq_mean_token_sum_norm`` (Dr. GRPO): each row's token sum over the constant T, averaged over all B
    rows: sum x*mask / (B * T), no length bias from a per-row token count.
    ``denominator``: divide by this count instead of this batch's own ``loss_denominator`` (a rank's
    share of a global count, so W ranks compute what one rank would).
    """
    if denominator is None:
        denominator = loss_denominator(mask, aggregation).clamp(min=1)
    if aggregation in ("token_mean", "seq_mean_token_sum_norm"):
        return masked_sum(x, mask) / denominator
    if aggregation == "sequence_mean":
        per_row = (x * mask).sum(dim=-1) / mask.sum(dim=-1).clamp(min=1)
        return per_row.sum() / denominator
    raise ValueError(f"unknown loss aggregation {aggregation!r}; expected one of {AGGREGATIONS}")


class Reducer:
    """The algorithm layer's collectives: sums over the learner's ranks. This one is a single process (a test,
    or one rank); ``DistributedReducer`` sums over torch.distributed's default group."""

    world_size = 1

    def sum(self, x: Tensor) -> Tensor:
        """``x`` summed over every rank (here: ``x`` itself)."""
        return x


class DistributedReducer(Reducer):
    """Sums over the default ``torch.distributed`` group (one process when there is none), all-reduced on
    ``device``: NCCL takes only CUDA tensors, gloo CPU ones. Every rank must make the same calls."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        import torch.distributed as dist

        self.device = device
        self.distributed = dist.is_available() and dist.is_initialized()
        self.world_size = dist.get_world_size() if self.distributed else 1

    def sum(self, x: Tensor) -> Tensor:
        if not self.distributed:
            return x
        import torch.distributed as dist

        total = x.to(self.device).clone()
        dist.all_reduce(total)
        return total.to(x.device)


LOCAL = Reducer()


def global_loss_denominator(mask: Tensor, aggregation: Aggregation = "token_mean", reducer: Reducer = LOCAL,
                            width: int | None = None) -> Tensor:
    """This rank's share (global count / W) of the token or row count of a minibatch split over the W ranks
    ``reducer`` sums over (this batch's own count for the local one).

    DeepSpeed averages gradients over the W ranks, so ``masked_mean(..., denominator=this)`` on each rank
    gives the gradient of the global mean: tokens weigh the same whichever rank holds them. Every rank
    must call it once per minibatch. ``width``: ``loss_denominator``'s.
    """
    count = reducer.sum(loss_denominator(mask, aggregation, width).to(torch.float64))
    return (count.clamp(min=1) / reducer.world_size).to(torch.float32)


def masked_var(x: Tensor, mask: Tensor) -> Tensor:
    """Scalar unbiased variance of ``x`` [B, T] over masked positions."""
    n = mask.sum()
    mean = masked_sum(x, mask) / n.clamp(min=1)
    return masked_sum((x - mean).square(), mask) / (n - 1).clamp(min=1)


def masked_whiten(x: Tensor, mask: Tensor, shift_mean: bool = True, eps: float = 1e-8) -> Tensor:
    """[B, T] ``x`` normalised to unit variance (and zero mean if ``shift_mean``) over masked positions.
    Masked-out positions are 0 in the result."""
    mean = masked_sum(x, mask) / mask.sum().clamp(min=1)
    whitened = (x - mean) * torch.rsqrt(masked_var(x, mask) + eps)
    if not shift_mean:
        whitened = whitened + mean
    return whitened * mask


def whiten_moments(x: Tensor, mask: Tensor) -> Tensor:
    """[3] float64 (sum, sum of squares, count) of ``x`` [B, T] over masked positions: additive over
    ranks, and exact enough to whiten a whole batch from W ranks' shares."""
    x, mask = x.double(), mask.double()
    return torch.stack([(x * mask).sum(), (x * x * mask).sum(), mask.sum()])


def whiten_from_moments(x: Tensor, mask: Tensor, moments: Tensor, eps: float = 1e-8,
                        shift_mean: bool = True) -> Tensor:
    """``x`` [B, T] whitened with the mean and unbiased variance of ``moments`` (``whiten_moments``,
    summed over any number of ranks); 0 where ``mask`` is 0. ``shift_mean=False`` adds the mean back
    (unit variance, mean kept), as lm-human-preferences' ``whiten(rewards, shift_mean=False)``."""
    total, total_sq, n = moments.tolist()
    mean = total / max(n, 1)
    var = (total_sq / max(n, 1) - mean**2) * n / max(n - 1, 1)
    whitened = (x - mean) / (max(var, 0.0) + eps) ** 0.5
    if not shift_mean:
        whitened = whitened + mean
    return (whitened * mask).to(x.dtype)


def global_whiten(x: Tensor, mask: Tensor, reducer: Reducer = LOCAL, shift_mean: bool = True) -> Tensor:
    """``masked_whiten`` over the whole batch of every rank ``reducer`` sums over (this batch alone for the
    local one)."""
    moments = reducer.sum(whiten_moments(x, mask))
    return whiten_from_moments(x, mask, moments, shift_mean=shift_mean)


def penalize_missing_eos(scores: Tensor, finish_reason: Tensor,
                         penalty: float | None) -> tuple[Tensor, Tensor]:
    """lm-human-preferences' ``penalty_reward_value``: a response that reached the length cap without
    EOS (``finish_reason`` FINISH_LENGTH) scores ``penalty`` instead of its own score.

    Args: scores: [B] sequence scores; finish_reason: [B] long (``services.experience`` codes);
        penalty: the replacement score, or None to keep every score.
    Returns: (scores [B], penalized [B] bool: the rows replaced; all False when ``penalty`` is None).
    """
    from services.experience import FINISH_LENGTH

    if scores.shape != finish_reason.shape:
        raise ValueError(f"scores {tuple(scores.shape)} and finish_reason {tuple(finish_reason.shape)} must "
                         "share one [B] shape")
    if penalty is None:
        return scores, torch.zeros_like(finish_reason, dtype=torch.bool)
    penalized = finish_reason == FINISH_LENGTH
    return torch.where(penalized, torch.full_like(scores, penalty), scores), penalized


def overlong_penalty(lengths: Tensor, max_length: int, buffer: int, penalty: float) -> Tensor:
    """DAPO's soft overlong punishment (eq. 13), added to the score: 0 for a response of L <= Lmax - B tokens,
    ``-(L - (Lmax - B)) / B * penalty`` within the buffer, ``-penalty`` at Lmax and beyond.

    Args: lengths: [B] response tokens L (EOS included); max_length: Lmax (rollout.max_new_tokens);
        buffer: B, 0 < B < Lmax; penalty: > 0. Returns: [B] float32, <= 0.
    """
    if not 0 < buffer < max_length:
        raise ValueError(f"overlong buffer {buffer} must be in (0, {max_length}): reward.overlong_buffer "
                         "below rollout.max_new_tokens")
    if not penalty > 0:
        raise ValueError(f"overlong penalty {penalty} must be > 0 (reward.overlong_penalty)")
    into_buffer = (lengths.double() - (max_length - buffer)) / buffer
    return (-penalty * into_buffer.clamp(0.0, 1.0)).to(torch.float32)


def truncated_loss_mask(mask: Tensor, finish_reason: Tensor) -> Tensor:
    """DAPO's overlong filtering: the loss mask without the responses cut at the cap (``finish_reason``
    FINISH_LENGTH). Args: mask: [B, T] action mask; finish_reason: [B] long. Returns: [B, T], ``mask``'s
    dtype."""
    from services.experience import FINISH_LENGTH

    if finish_reason.shape != mask.shape[:1]:
        raise ValueError(f"finish_reason {tuple(finish_reason.shape)} must be [B] of mask "
                         f"{tuple(mask.shape)}")
    return mask * (finish_reason != FINISH_LENGTH).unsqueeze(-1).to(mask.dtype)


def scheduled_lr(lr: float, schedule: Literal["constant", "linear"], iteration: int,
                 iterations: int) -> float:
    """The learning rate of 1-based ``iteration`` of ``iterations``: ``lr`` (constant), or falling linearly
    toward 0 over the run, one step per iteration, as lm-human-preferences' ``lr * (1 - step /
    nupdates)``: ``lr * (1 - (iteration - 1) / iterations)``, from ``lr`` down to ``lr / iterations``.
    A pure function of the iteration, so a resumed run continues the same schedule."""
    if schedule == "constant":
        return lr
    if schedule != "linear":
        raise ValueError(f"unknown ppo.lr_schedule {schedule!r}; expected 'constant' or 'linear'")
    if not 1 <= iteration <= iterations:
        raise ValueError(f"ppo.lr_schedule='linear': iteration {iteration} is outside 1..{iterations} "
                         "(run.iterations)")
    return lr * (1.0 - (iteration - 1) / iterations)


def gae_advantages(
    rewards: Tensor, values: Tensor, mask: Tensor, gamma: float = 1.0, lam: float = 0.95
) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation over the model's tokens, right to left.

    Tokens where ``mask`` is 0 are skipped as if they were not there: in a multi-turn trajectory a turn's
    last model token bootstraps from the value at the next turn's first model token, and the environment's
    tokens between them are neither discounted nor given an advantage.

    Args:
        rewards: [B, T] per-token rewards (KL penalty plus the score at the last token, or each turn's reward
            at the turn's last model token).
        values: [B, T] value estimates V(s_t) for the state before token t.
        mask: [B, T] action mask; the state after the last model token is terminal (V = 0).
        gamma, lam: discount and GAE lambda, per model token.
    Returns:
        (advantages [B, T], returns [B, T]), both 0 where ``mask`` is 0; returns = advantages + values.
    """
    if not (rewards.shape == values.shape == mask.shape):
        raise ValueError(
            f"rewards {tuple(rewards.shape)}, values {tuple(values.shape)} and mask {tuple(mask.shape)} "
            "must share one [B, T] shape"
        )
    rewards, values = rewards * mask, values * mask
    advantages = torch.zeros_like(rewards)
    next_value = torch.zeros_like(rewards[:, 0])
    next_advantage = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[1])):
        model = mask[:, t] > 0
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        # off the model's tokens the running terms pass through unchanged, to the model token before
        next_advantage = torch.where(model, delta + gamma * lam * next_advantage, next_advantage)
        advantages[:, t] = next_advantage * mask[:, t]
        next_value = torch.where(model, values[:, t], next_value)
    return advantages, (advantages + values) * mask


def value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    mask: Tensor,
    clip_range_value: float = 0.2,
    aggregation: Aggregation = "token_mean",
    denominator: Tensor | float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped value loss: 0.5 * mean of max((V - R)^2, (V_clip - R)^2), V_clip = old_V +- clip.

    Args: values, old_values, returns, mask: [B, T]; denominator: see ``masked_mean``.
    Returns: (scalar loss, {"vf_clipfrac"}).
    """
    clipped_values = old_values + (values - old_values).clamp(-clip_range_value, clip_range_value)
    unclipped_error = (values - returns).square()
    clipped_error = (clipped_values - returns).square()
    loss = 0.5 * masked_mean(torch.maximum(unclipped_error, clipped_error), mask, aggregation, denominator)
    with torch.no_grad():
        stats = {"vf_clipfrac": masked_mean((clipped_error > unclipped_error).to(values.dtype), mask)}
    return loss, stats


def explained_variance_moments(values: Tensor, returns: Tensor, mask: Tensor) -> Tensor:
    """[5] float64 (count, sum R, sum R^2, sum R-V, sum (R-V)^2) of ``values`` and ``returns`` [B, T] over
    masked positions: additive, so W ranks' moments sum to the whole batch's."""
    v, r, m = values.double(), returns.double(), mask.double()
    residual = r - v
    return torch.stack([m.sum(), (r * m).sum(), (r * r * m).sum(), (residual * m).sum(),
                        (residual * residual * m).sum()])


def explained_variance_from_moments(moments: Tensor | list[float]) -> float:
    """1 - Var(R - V) / Var(R) from ``explained_variance_moments`` (summed over any number of ranks);
    nan when the returns have no variance."""
    n, r_sum, r_sq, e_sum, e_sq = (float(x) for x in moments)
    if n < 2:
        return float("nan")
    var_returns = (r_sq - r_sum**2 / n) / (n - 1)
    if var_returns <= 1e-12 * r_sq / n:  # zero up to the rounding of the moments
        return float("nan")
    return 1.0 - (e_sq - e_sum**2 / n) / (n - 1) / var_returns


def ppo_stats_from_sums(parts: list[dict]) -> dict[str, float]:
    """The PPO diagnostics of one update, exact over ranks, from every rank's ``ppo_sums``:
    ``{"stats": {name: [sum, count]}, "explained_variance_moments": [5], "optimizer_steps": n}``.

    Each statistic is the sum of its sums over the sum of its counts. Token statistics (entropy,
    clipfrac, ...) count tokens. Losses count optimizer steps: a rank's loss is its share of the global
    minibatch mean (``global_loss_denominator``), so W ranks' sums over W * steps are the mean over steps of
    the global loss. Explained variance is taken from the summed moments (omitted when no rank has any:
    a critic-free ``ppo.advantage``).
    """
    if not parts:
        raise ValueError("ppo_stats_from_sums needs at least one rank's sums")
    totals: dict[str, list[float]] = {}
    for part in parts:
        for name, (total, count) in part["stats"].items():
            acc = totals.setdefault(name, [0.0, 0.0])
            acc[0] += total
            acc[1] += count
    stats = {name: total / count if count else float("nan") for name, (total, count) in totals.items()}
    if all("explained_variance_moments" in part for part in parts):  # absent without a critic
        moments = torch.tensor([part["explained_variance_moments"] for part in parts],
                               dtype=torch.float64).sum(0)
        stats["explained_variance"] = explained_variance_from_moments(moments)
    stats["optimizer_steps"] = max(part["optimizer_steps"] for part in parts)
    return stats
