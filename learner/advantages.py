"""Advantage estimators (``ppo.advantage``): GAE with a critic, and the critic-free GRPO, RLOO,
REINFORCE++ and REINFORCE++-baseline.

Pure torch. Shapes: B episodes, T response positions; ``mask`` is [B, T] float 0/1, the action mask (the
model's tokens: a prefix per row for a single response, with gaps at a trajectory's environment tokens);
``group_index`` is [B] long, the same id for the ``rollout.samples_per_prompt`` episodes of one prompt
(-1: the row belongs to no group).

Every estimator reads the same per-token ``rewards`` [B, T]: ``-beta * kl_t`` on every response token
(0 when the KL is in the loss, ``kl.placement: loss``) plus the score at the last token
(``learner.kl.kl_penalized_rewards``), or each turn's reward at its last model token for a trajectory. The
sequence return is ``R = sum_t rewards_t``: the score minus
``beta * KL_b`` with the KL in the reward, the score alone with it in the loss. A sequence-level
advantage is given to every token of its response. ``returns`` (the critic's targets) exist only for GAE.
GRPO alone also reads the penalty apart (``kl_rewards``): by default it normalises the score, not the return.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from learner.kl import last_token_index
from learner.ppo import LOCAL, Reducer, gae_advantages, global_whiten
from learner.registry import Entry, Registry, entry_rule

GRPO_EPS = 1e-6


# ---------------------------------------------------------------- groups


def sequence_returns(rewards: Tensor, mask: Tensor) -> Tensor:
    """[B] undiscounted sum of the per-token ``rewards`` [B, T] over the response ``mask`` [B, T]:
    score - beta * KL_b. A row with an empty mask has no token to carry a score: its return is 0."""
    return (rewards * mask).sum(dim=-1)


def check_whole_groups(group_index: Tensor, samples_per_prompt: int, where: str = "") -> None:
    """Raise ValueError unless every group in ``group_index`` [B] (one entry per episode) holds exactly
    ``samples_per_prompt`` episodes: a group split over chunks or ranks would get a baseline from part of its
    samples."""
    if bool((group_index < 0).any()):
        raise ValueError(f"{where}{int((group_index < 0).sum())} rows carry no group (group_index -1): a "
                         "group estimator needs the prompt group of every row (rollout.samples_per_prompt)")
    ids, counts = torch.unique(group_index, return_counts=True)
    bad = counts != samples_per_prompt
    if bool(bad.any()):
        shown = ", ".join(f"group {int(g)}: {int(c)} rows"
                          for g, c in zip(ids[bad][:5], counts[bad][:5], strict=True))
        raise ValueError(f"{where}a prompt group is split or incomplete ({shown}; rollout.samples_per_prompt="
                         f"{samples_per_prompt}): every group must be whole on the rank that computes its "
                         "baseline")


def _group_moments(x: Tensor, group_index: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Per row of ``x`` [B] (float64): (its group's size, sum, sum of squares of deviations from the
    group mean), each [B]. Rows need not be contiguous or ordered by group."""
    _, inverse = torch.unique(group_index, return_inverse=True)
    x = x.double()
    groups = int(inverse.max()) + 1 if inverse.numel() else 0
    count = torch.zeros(groups, dtype=torch.float64).index_add_(0, inverse, torch.ones_like(x))
    total = torch.zeros(groups, dtype=torch.float64).index_add_(0, inverse, x)
    mean = total / count
    squares = torch.zeros(groups, dtype=torch.float64).index_add_(0, inverse, (x - mean[inverse]).square())
    return count[inverse], total[inverse], squares[inverse]


def _group_all_equal(x: Tensor, group_index: Tensor) -> Tensor:
    """[B] bool: the row's group holds one value only (its max equals its min)."""
    _, inverse = torch.unique(group_index, return_inverse=True)
    groups = int(inverse.max()) + 1 if inverse.numel() else 0
    high = torch.full((groups,), -torch.inf, dtype=x.dtype).scatter_reduce(0, inverse, x, "amax")
    low = torch.full((groups,), torch.inf, dtype=x.dtype).scatter_reduce(0, inverse, x, "amin")
    return (high == low)[inverse]


def differing_groups(scores: Tensor, group_index: Tensor) -> int:
    """How many of the groups in ``group_index`` [B] hold ``scores`` [B] that are not all equal."""
    if not scores.numel():
        return 0
    return int(torch.unique(group_index[~_group_all_equal(scores, group_index)]).numel())


def dynamic_sampling_rows(scores: Tensor, group_index: Tensor, groups: int) -> tuple[Tensor, dict[str, int]]:
    """DAPO's dynamic sampling on one rank's rows: the whole groups it trains on.

    A group whose scores all tie (max == min) has no score signal for a group baseline: it is dropped. The
    first ``groups`` groups whose scores differ, in row order (collection order), are kept, later ones are
    surplus; when fewer differ (the rounds' bound was reached), the first tied groups fill the rest, so the
    batch stays full.

    Args: scores: [B] the scores the advantages read (penalties applied); group_index: [B] whole groups;
        groups: how many groups to keep. Returns: (keep [B] bool, {"tied", "filled", "surplus"}: group
        counts).
    """
    if scores.shape != group_index.shape or scores.dim() != 1:
        raise ValueError(f"scores {tuple(scores.shape)} and group_index {tuple(group_index.shape)} must "
                         "share one [B] shape")
    ids, inverse = torch.unique(group_index, return_inverse=True)
    if ids.numel() < groups:
        raise ValueError(f"dynamic sampling keeps {groups} groups but the rows hold {ids.numel()}")
    rows = torch.arange(group_index.numel())
    first_row = torch.full((ids.numel(),), group_index.numel(), dtype=torch.long).scatter_reduce(0, inverse,
                                                                                               rows, "amin")
    order = first_row.argsort()  # groups in collection order
    tied = torch.zeros(ids.numel(), dtype=torch.bool).scatter_(0, inverse,
                                                               _group_all_equal(scores, group_index))
    differing, tied_order = order[~tied[order]], order[tied[order]]
    kept = torch.cat([differing[:groups], tied_order[: max(groups - differing.numel(), 0)]])
    keep = torch.zeros(ids.numel(), dtype=torch.bool)
    keep[kept] = True
    counts = {"tied": int(tied.sum()), "filled": max(groups - differing.numel(), 0),
              "surplus": max(differing.numel() - groups, 0)}
    return keep[inverse], counts


def _check_group_sizes(count: Tensor, name: str) -> None:
    if bool((count < 2).any()):
        raise ValueError(f"{name} needs at least 2 samples per group (rollout.samples_per_prompt >= 2); "
                         f"a group has {int(count.min())}")


def grpo_sequence_advantages(returns: Tensor, group_index: Tensor, eps: float = GRPO_EPS) -> Tensor:
    """GRPO: ``A_i = (R_i - mean_group R) / (std_group R + eps)``, std unbiased (n - 1), eps 1e-6.

    A group whose returns are all equal gets advantage exactly 0 (no signal, not rounding noise / eps).
    Args: returns: [B] sequence returns; group_index: [B] group ids, every group of size >= 2.
    Returns: [B] advantages, in ``returns``' dtype.
    """
    count, total, squares = _group_moments(returns, group_index)
    _check_group_sizes(count, "GRPO")
    std = (squares / (count - 1)).sqrt()
    advantages = (returns.double() - total / count) / (std + eps)
    return advantages.masked_fill(_group_all_equal(returns, group_index), 0.0).to(returns.dtype)


def grpo_advantages(rewards: Tensor, mask: Tensor, group_index: Tensor, kl_rewards: Tensor | None = None,
                    normalize: str = "score") -> Tensor:
    """GRPO's [B, T] advantages with the KL in the reward (``ppo.grpo_normalize``).

    ``score`` (DeepSeekMath, OpenRLHF, TRL): the score is normalised in its group and the KL stays outside,
    ``A_t = (s - mean_group s) / (std_group s + eps) - beta * sum_{t' >= t} kl_t'``, the score ``s`` being the
    rewards' sum less the penalty's. ``return`` (verl's GRPO with use_kl_in_reward): the whole return
    ``R = s - beta * KL_b`` normalised, so in a group whose scores tie the KL's noise becomes advantages of
    unit size. Without ``kl_rewards`` (the KL in the loss) both are the normalised score.

    Args: rewards, mask: [B, T]; group_index: [B]; kl_rewards: [B, T] the penalty's share of ``rewards``
        (``-beta * kl_t``) or None. Returns: [B, T] advantages, 0 where ``mask`` is 0.
    """
    if normalize not in ("score", "return"):
        raise ValueError(f"unknown ppo.grpo_normalize {normalize!r}; expected 'score' or 'return'")
    if normalize == "return" or kl_rewards is None:
        return grpo_sequence_advantages(sequence_returns(rewards, mask), group_index).unsqueeze(-1) * mask
    if kl_rewards.shape != rewards.shape:
        raise ValueError(f"kl_rewards {tuple(kl_rewards.shape)} and rewards {tuple(rewards.shape)} must "
                         "share one [B, T] shape")
    scores = sequence_returns(rewards - kl_rewards, mask)
    return grpo_sequence_advantages(scores, group_index).unsqueeze(-1) * mask + reward_to_go(kl_rewards, mask)


def rloo_sequence_advantages(returns: Tensor, group_index: Tensor) -> Tensor:
    """RLOO: ``A_i = R_i - mean_{j != i} R_j``, the mean of the other samples of the prompt.

    Sums to 0 within each group. Args: returns: [B]; group_index: [B], groups of size >= 2.
    Returns: [B] advantages, in ``returns``' dtype.
    """
    count, total, _ = _group_moments(returns, group_index)
    _check_group_sizes(count, "RLOO")
    r = returns.double()
    return (r - (total - r) / (count - 1)).to(returns.dtype)


def reward_to_go(rewards: Tensor, mask: Tensor, gamma: float = 1.0) -> Tensor:
    """[B, T] ``G_t = sum_{s >= t} gamma^(n(t, s)) r_s`` over the action ``mask`` [B, T] of the per-token
    ``rewards`` [B, T], where n(t, s) counts the model's tokens from t to s: the environment's tokens of a
    trajectory are not discounted. 0 where the mask is 0."""
    rewards = rewards * mask
    out = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[1])):
        running = torch.where(mask[:, t] > 0, rewards[:, t] + gamma * running, running)
        out[:, t] = running * mask[:, t]
    return out


def reinforce_pp_advantages(rewards: Tensor, mask: Tensor, gamma: float = 1.0,
                            reducer: Reducer = LOCAL) -> Tensor:
    """REINFORCE++: the reward-to-go of the per-token rewards (score at the last token, ``-beta * kl_t``
    on every token) with discount ``gamma``, whitened (zero mean, unit variance over every response token)
    over the global batch: all ranks ``reducer`` sums over, so W ranks compute what one would
    (``learner.ppo.global_whiten``; every rank must call it).

    Args: rewards, mask: [B, T]. Returns: [B, T] advantages, 0 where ``mask`` is 0.
    """
    return global_whiten(reward_to_go(rewards, mask, gamma), mask, reducer)


def reinforce_pp_baseline_advantages(rewards: Tensor, mask: Tensor, group_index: Tensor, gamma: float = 1.0,
                                     reducer: Reducer = LOCAL) -> Tensor:
    """REINFORCE++-baseline: the group mean of the sequence return R is subtracted first (from the reward
    at the last token, so the return-to-go of every token is its own minus ``mean_group R``), then
    REINFORCE++'s reward-to-go and global whitening.

    Only at gamma 1 (as OpenRLHF forces it): discounted, the baseline subtracted at the last token reaches
    token t as ``-gamma^(L-1-t) * b``, which depends on the row's own length L (a length-shaping bias).
    Args: rewards, mask: [B, T]; group_index: [B], groups of size >= 2. Returns: [B, T] advantages.
    """
    if gamma != 1.0:
        raise ValueError(f"reinforce_pp_baseline needs ppo.gamma = 1, got {gamma}: the group baseline "
                         "subtracted at the last token and discounted would reach token t "
                         "as -gamma^(L-1-t) * baseline, a bias by the response's length L")
    returns = sequence_returns(rewards, mask)
    count, total, _ = _group_moments(returns, group_index)
    _check_group_sizes(count, "REINFORCE++-baseline")
    last = last_token_index(mask)
    rows = (last >= 0).nonzero().squeeze(-1)
    shifted = rewards.clone()
    shifted[rows, last[rows]] -= (total / count)[rows].to(rewards.dtype)
    return reinforce_pp_advantages(shifted, mask, gamma, reducer)


# ---------------------------------------------------------------- the registry


@dataclass(frozen=True)
class Settings:
    """What the estimators read besides the batch: ``ppo.gamma``, ``ppo.lam``, GAE's optional whitening
    (``ppo.whiten_advantages``, ``ppo.whiten_rewards``), what GRPO normalises (``ppo.grpo_normalize``) and the
    ranks the global whitening sums over (``reducer``)."""

    gamma: float = 1.0
    lam: float = 0.95
    whiten_advantages: bool = True
    whiten_rewards: bool = False
    reducer: Reducer = LOCAL
    grpo_normalize: str = "score"


# (rewards [B, T], mask [B, T], values [B, T] | None, group_index [B] | None, kl_rewards [B, T] | None,
# settings) -> (advantages, returns)
EstimatorFn = Callable[[Tensor, Tensor, "Tensor | None", "Tensor | None", "Tensor | None", Settings],
                       tuple[Tensor, "Tensor | None"]]


def _gae(rewards: Tensor, mask: Tensor, values: Tensor | None, _groups: Tensor | None, _kl: Tensor | None,
         s: Settings) -> tuple[Tensor, Tensor]:
    if values is None:
        raise ValueError("ppo.advantage='gae' needs the critic's values")
    # lm-human-preferences scales the rewards GAE sees, never the reported reward or the controller's KL
    if s.whiten_rewards:
        rewards = global_whiten(rewards, mask, s.reducer, shift_mean=False)
    advantages, returns = gae_advantages(rewards, values, mask, s.gamma, s.lam)
    if s.whiten_advantages:
        advantages = global_whiten(advantages, mask, s.reducer)
    return advantages, returns


def _per_sequence(fn: Callable[[Tensor, Tensor], Tensor]) -> EstimatorFn:
    """An estimator of [B] sequence advantages from [B] returns and groups, given to every response token."""
    def estimator(rewards: Tensor, mask: Tensor, _values, group_index: Tensor | None, _kl, _s: Settings):
        advantages = fn(sequence_returns(rewards, mask), _checked_groups(group_index, rewards))
        return advantages.unsqueeze(-1) * mask, None
    return estimator


def _grpo(rewards: Tensor, mask: Tensor, _values, group_index: Tensor | None, kl_rewards: Tensor | None,
          s: Settings) -> tuple[Tensor, None]:
    return grpo_advantages(rewards, mask, _checked_groups(group_index, rewards), kl_rewards,
                           s.grpo_normalize), None


def _reinforce_pp(rewards: Tensor, mask: Tensor, _values, _groups, _kl, s: Settings) -> tuple[Tensor, None]:
    return reinforce_pp_advantages(rewards, mask, s.gamma, s.reducer), None


def _reinforce_pp_baseline(rewards: Tensor, mask: Tensor, _values, group_index: Tensor | None, _kl,
                           s: Settings) -> tuple[Tensor, None]:
    groups = _checked_groups(group_index, rewards)
    return reinforce_pp_baseline_advantages(rewards, mask, groups, s.gamma, s.reducer), None


def _checked_groups(group_index: Tensor | None, rewards: Tensor) -> Tensor:
    if group_index is None:
        raise ValueError("a group estimator needs group_index [B]")
    if group_index.shape != rewards.shape[:1]:
        raise ValueError(f"group_index has shape {tuple(group_index.shape)}, expected "
                         f"[B] = [{rewards.shape[0]}]")
    return group_index


@dataclass(frozen=True, kw_only=True)
class AdvantageEstimator(Entry):
    """``function``: the advantages (and the critic's returns) of a batch (``EstimatorFn``); ``critic``: it
    reads a value head's values (and the value loss trains one); ``group``: its baseline is taken over the
    samples of one prompt, so a group never splits across chunks or ranks."""

    function: EstimatorFn
    objective: EstimatorFn
    critic: bool = False
    group: bool = False


ESTIMATORS: Registry[AdvantageEstimator] = Registry("ppo.advantage", "advantage estimator")


# ---- the documented advantages (``AdvantageEstimator.objective``), written again from the papers' formulas
# row by row and token by token in float64 without the functions above: the references the harness checks


def _tokens(mask_row: Tensor) -> list[int]:
    return [t for t in range(mask_row.numel()) if mask_row[t] > 0]


def _whitened(x: Tensor, mask: Tensor, keep_mean: bool = False) -> Tensor:
    """(x - mean) / sqrt(var + 1e-8) over the masked tokens, var unbiased; ``keep_mean``: the mean added
    back."""
    values = [float(x[b, t]) for b in range(x.shape[0]) for t in _tokens(mask[b])]
    mean = sum(values) / len(values)
    var = sum((v - mean) ** 2 for v in values) / max(len(values) - 1, 1)
    out = (x.double() - mean) / (var + 1e-8) ** 0.5 + (mean if keep_mean else 0.0)
    return out * mask


def _to_go(rewards: Tensor, mask: Tensor, gamma: float) -> Tensor:
    """G_t = sum over the row's later model tokens s of gamma^(model tokens from t to s) r_s."""
    out = torch.zeros_like(rewards, dtype=torch.float64)
    for b in range(rewards.shape[0]):
        running = 0.0
        for t in reversed(_tokens(mask[b])):
            running = float(rewards[b, t]) + gamma * running
            out[b, t] = running
    return out


def _group_baselines(returns: list[float], groups: Tensor) -> list[list[float]]:
    """Each row's group's returns, itself first."""
    members = {}
    for b, g in enumerate(groups.tolist()):
        members.setdefault(g, []).append(b)
    return [[returns[b]] + [returns[o] for o in members[g] if o != b] for b, g in enumerate(groups.tolist())]


def gae_objective(rewards, mask, values, groups, kl_rewards, s: Settings):
    """Schulman et al. 2016: A_t = delta_t + gamma lambda A_(t+1), delta_t = r_t + gamma V_(t+1) - V_t over
    the model's tokens (V after the last is 0); returns A + V; rewards and advantages whitened if asked."""
    r = _whitened(rewards, mask, keep_mean=True) if s.whiten_rewards else rewards.double()
    advantages = torch.zeros_like(r)
    for b in range(r.shape[0]):
        next_value, next_advantage = 0.0, 0.0
        for t in reversed(_tokens(mask[b])):
            delta = float(r[b, t]) + s.gamma * next_value - float(values[b, t])
            next_advantage = delta + s.gamma * s.lam * next_advantage
            advantages[b, t], next_value = next_advantage, float(values[b, t])
    returns = (advantages + values.double()) * mask
    return (_whitened(advantages, mask) if s.whiten_advantages else advantages), returns


def grpo_objective(rewards, mask, values, groups, kl_rewards, s: Settings):
    """DeepSeekMath's outcome GRPO: (s - mean_group s) / (std_group s + 1e-6), std over n - 1, 0 where a
    group's scores all tie; the KL penalty to go added per token (``score``), or normalised with the score
    (``return``, or no KL in the reward)."""
    apart = kl_rewards is not None and s.grpo_normalize == "score"
    scored = rewards - kl_rewards if apart else rewards
    totals = [sum(float(scored[b, t]) for t in _tokens(mask[b])) for b in range(rewards.shape[0])]
    advantages = torch.zeros_like(rewards, dtype=torch.float64)
    for b, group in enumerate(_group_baselines(totals, groups)):
        mean = sum(group) / len(group)
        std = (sum((x - mean) ** 2 for x in group) / (len(group) - 1)) ** 0.5
        a = 0.0 if max(group) == min(group) else (group[0] - mean) / (std + 1e-6)
        for t in _tokens(mask[b]):
            advantages[b, t] = a
    return advantages + (_to_go(kl_rewards, mask, 1.0) if apart else 0.0), None


def rloo_objective(rewards, mask, values, groups, kl_rewards, s: Settings):
    """Kool et al. 2019 (Ahmadian et al. 2024): R_i - mean of the other samples' R in the group."""
    totals = [sum(float(rewards[b, t]) for t in _tokens(mask[b])) for b in range(rewards.shape[0])]
    advantages = torch.zeros_like(rewards, dtype=torch.float64)
    for b, group in enumerate(_group_baselines(totals, groups)):
        for t in _tokens(mask[b]):
            advantages[b, t] = group[0] - sum(group[1:]) / (len(group) - 1)
    return advantages, None


def reinforce_pp_objective(rewards, mask, values, groups, kl_rewards, s: Settings):
    """REINFORCE++ (Hu 2025): the discounted reward to go, whitened over the batch's tokens."""
    return _whitened(_to_go(rewards, mask, s.gamma), mask), None


def reinforce_pp_baseline_objective(rewards, mask, values, groups, kl_rewards, s: Settings):
    """REINFORCE++-baseline: each token's reward to go less its group's mean return, whitened over the
    batch's tokens."""
    totals = [sum(float(rewards[b, t]) for t in _tokens(mask[b])) for b in range(rewards.shape[0])]
    baselines = [sum(group) / len(group) for group in _group_baselines(totals, groups)]
    to_go = _to_go(rewards, mask, 1.0) - torch.tensor(baselines, dtype=torch.float64).unsqueeze(-1)
    return _whitened(to_go * mask, mask), None


@entry_rule("ppo.advantage", "rollout.samples_per_prompt", example={"ppo": {"advantage": "grpo"}})
def group_estimator_needs_a_group(cfg: Any) -> str | None:
    n = cfg.rollout.samples_per_prompt
    if n < 2:
        return (f"ppo.advantage={cfg.ppo.advantage!r} takes its baseline over the samples of one prompt: it "
                f"needs rollout.samples_per_prompt >= 2 (got {n})")
    return None


@entry_rule("rollout.dynamic_sampling", "ppo.advantage", example={"rollout": {"dynamic_sampling": True}})
def dynamic_sampling_needs_a_group_estimator(cfg: Any) -> str | None:
    if cfg.rollout.dynamic_sampling:
        groups = ", ".join(name for name, entry in ESTIMATORS.entries.items() if entry.group)
        return ("rollout.dynamic_sampling drops prompt groups whose scores tie, which carry no signal only "
                f"for a group estimator ({groups}); ppo.advantage={cfg.ppo.advantage!r} learns from every "
                "row")
    return None


@entry_rule("learner.critic", "ppo.advantage",
            example={"learner": {"critic": "separate"}, "ppo": {"advantage": "grpo"},
                     "rollout": {"samples_per_prompt": 4}})
def separate_critic_needs_gae(cfg: Any) -> str | None:
    if cfg.learner.critic == "separate":
        critics = ", ".join(repr(name) for name, entry in ESTIMATORS.entries.items() if entry.critic)
        return (f"learner.critic='separate' builds a critic, but ppo.advantage={cfg.ppo.advantage!r} uses "
                f"none (those that do: {critics}); set learner.critic='value_head' (ignored without a "
                "critic)")
    return None


@entry_rule("ppo.advantage", "ppo.gamma",
            example={"ppo": {"advantage": "reinforce_pp_baseline", "gamma": 0.9},
                     "rollout": {"samples_per_prompt": 2}})
def reinforce_pp_baseline_needs_gamma_one(cfg: Any) -> str | None:
    if cfg.ppo.gamma == 1:
        return None
    return (f"ppo.advantage='reinforce_pp_baseline' needs ppo.gamma=1 (got {cfg.ppo.gamma}): the group "
            "baseline subtracted at the last token and discounted reaches token t as -gamma^(L-1-t) * "
            "baseline, a bias by the response's length L (OpenRLHF forces 1)")


GAMMA_READ = "the discount per model token"
CRITIC_FREE = (dynamic_sampling_needs_a_group_estimator, separate_critic_needs_gae)
ESTIMATORS.register(AdvantageEstimator(
    name="gae", doc="generalised advantage estimation with a critic (the value head, or learner.critic "
    "separate)",
    reads={"gamma": GAMMA_READ, "lam": "GAE's lambda",
           "whiten_rewards": "the whitening of the per-token rewards GAE sees",
           "whiten_advantages": "the whitening of GAE's advantages (the other estimators normalise theirs as "
                                "they define)",
           "vf_coef": "the weight of the critic's value loss",
           "clip_range_value": "the clip of the critic's values in its value loss"},
    rules=(dynamic_sampling_needs_a_group_estimator,), function=_gae, objective=gae_objective, critic=True))
ESTIMATORS.register(AdvantageEstimator(
    name="grpo", doc="GRPO: each response's score normalised in its prompt's group (mean and std)",
    reads={"grpo_normalize": "what GRPO normalises in its group, the score or the return"},
    rules=(group_estimator_needs_a_group, separate_critic_needs_gae), function=_grpo,
    objective=grpo_objective, group=True))
ESTIMATORS.register(AdvantageEstimator(
    name="rloo", doc="RLOO: each response's return less the mean of the others' in its group", reads={},
    rules=(group_estimator_needs_a_group, separate_critic_needs_gae),
    function=_per_sequence(rloo_sequence_advantages), objective=rloo_objective, group=True))
ESTIMATORS.register(AdvantageEstimator(
    name="reinforce_pp", doc="REINFORCE++: the discounted reward-to-go, whitened over the batch",
    reads={"gamma": GAMMA_READ}, rules=CRITIC_FREE, function=_reinforce_pp,
    objective=reinforce_pp_objective))
ESTIMATORS.register(AdvantageEstimator(
    name="reinforce_pp_baseline", doc="REINFORCE++-baseline: the reward-to-go less its group's mean score, "
    "whitened over the batch", reads={"gamma": GAMMA_READ},
    rules=(group_estimator_needs_a_group, separate_critic_needs_gae, reinforce_pp_baseline_needs_gamma_one),
    function=_reinforce_pp_baseline, objective=reinforce_pp_baseline_objective, group=True))


def compute_advantages(estimator: str, rewards: Tensor, mask: Tensor, *, values: Tensor | None = None,
                       group_index: Tensor | None = None, gamma: float = 1.0, lam: float = 0.95,
                       whiten_advantages: bool = True, whiten_rewards: bool = False,
                       reducer: Reducer = LOCAL, kl_rewards: Tensor | None = None,
                       grpo_normalize: str = "score", teacher: Tensor | None = None,
                       teacher_credit: str = "reward_to_go") -> tuple[Tensor, Tensor | None]:
    """Advantages of ``estimator`` (``ppo.advantage``) for a batch.

    Args:
        rewards: [B, T] per-token rewards (``kl_penalized_rewards``); mask: [B, T].
        values: [B, T] critic values (``gae`` only); group_index: [B] (group estimators only).
        gamma, lam: discount (GAE, REINFORCE++) and GAE lambda.
        whiten_advantages, whiten_rewards: GAE's optional global whitening (``ppo.whiten_*``); the other
            estimators normalise as their definitions say and ignore both.
        reducer: the ranks the global whitening sums its moments over (``learner.ppo.Reducer``).
        kl_rewards: [B, T] the KL penalty's share of ``rewards`` (``-beta * kl_t``), None when the KL is in
            the loss; read by ``grpo`` alone, which normalises the score without it (``grpo_normalize``).
        teacher: [B, T] on-policy distillation's per-token penalties (``learner.kl.teacher_penalties``) or
            None.
        teacher_credit: ``reward_to_go`` (``distill.credit``): the penalties join ``rewards`` as the KL
            penalty does, and GRPO keeps them outside its normalisation as it keeps the KL; ``token``: each
            token's advantage gets its own penalty, after the estimator (no critic learns it, no normalisation
            scales it).
    Returns:
        (advantages [B, T], returns [B, T] for the critic or None), 0 where ``mask`` is 0.
    """
    entry = ESTIMATORS.get(estimator)
    if rewards.shape != mask.shape:
        raise ValueError(f"rewards {tuple(rewards.shape)} and mask {tuple(mask.shape)} must share one "
                         "[B, T] shape")
    if teacher_credit not in ("token", "reward_to_go"):
        raise ValueError(f"unknown distill.credit {teacher_credit!r}; expected 'token' or 'reward_to_go'")
    if teacher is not None and teacher.shape != rewards.shape:
        raise ValueError(f"teacher {tuple(teacher.shape)} and rewards {tuple(rewards.shape)} must share one "
                         "[B, T] shape")
    settings = Settings(gamma, lam, whiten_advantages, whiten_rewards, reducer, grpo_normalize)
    if teacher is not None and teacher_credit == "reward_to_go":
        rewards = rewards + teacher * mask
        kl_rewards = teacher * mask if kl_rewards is None else kl_rewards + teacher * mask
    advantages, returns = entry.function(rewards, mask, values, group_index, kl_rewards, settings)
    if teacher is not None and teacher_credit == "token":
        advantages = advantages + teacher * mask
    return advantages, returns
