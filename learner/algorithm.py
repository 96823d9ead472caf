"""The algorithm as one layer over the batch: everything from a collected ``RolloutBatch`` to the loss.

Pure torch: no Ray, no DeepSpeed. ``learner.update`` runs the forwards and the optimizer steps through a
training engine and calls this layer between them, as a test calls it on any batch:

- ``Algorithm.final_scores``: the scores the advantages read (missing-EOS and overlong penalties);
- ``Algorithm.select``: DAPO's dynamic sampling, the whole groups a rank trains on;
- ``Algorithm.controller_sums``: the controller's statistic over every episode sampled (dropped groups too);
- ``Algorithm.prepare``: scores, KL penalties, distillation's penalties, advantages and returns of the trained
  rows;
- ``Algorithm.loss_counts`` and ``Algorithm.loss``: one minibatch's global counts, then its policy, value and
  KL losses with the rollout correction.

Its collectives (global whitening, the loss denominators) go through the ``Reducer`` the caller passes in
(``learner.ppo``): the rank passes torch.distributed's, a test the local one.

**The episode is the unit.** An agent's episode may give several rows (model calls that do not extend each
other); ``RolloutBatch.episode_index`` says which. ``EpisodeView`` lays an episode's rows end to end,
[E, K * T], and every per-response quantity is taken on that view: the controller's mean, scores, group
statistics, credit (the later rows' KL and rewards reach the earlier rows' tokens as if the rows had merged),
the sequence-level ratio, correction and mean. Where every episode is one row the view is the batch itself.

**The controller's statistic** is an unbiased estimate per episode of KL(pi || pi_ref), pi the policy being
optimised: the learner's log-probs of the rows at the start of the update. In sync mode the rows were sampled
by that version, and the statistic is the reward's own penalty, ``mean_e sum_t kl_t``. In async mode an older
version sampled them; k1 of pi on them has expectation KL(b || ref) - KL(b || pi), so each token's term is
weighted by its prefix likelihood ratio pi / b (``learner.kl.kl_sums``), exact for k1 and k3. The reward's
penalty stays unweighted (its gradient is the policy gradient of the KL through the PPO ratio and the rollout
correction); its mean over the trained episodes is logged as ``kl_penalty_mean`` and meets
``mean_e sum_t kl_t == -mean_e sum_t (reward_t - score_t) / beta``. Dynamic sampling's dropped groups stay in
the statistic (not a selection on scores) and leave the penalty's mean.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from learner.advantages import (
    ESTIMATORS,
    check_whole_groups,
    compute_advantages,
    differing_groups,
    dynamic_sampling_rows,
)
from learner.correction import CORRECTIONS, SEQUENCE_STATS, rollout_correction_weights
from learner.kl import (
    KL_ESTIMATORS,
    check_finite,
    episode_kl,
    grpo_token_k3_loss,
    kl_logprob_roles,
    kl_loss_aggregation,
    kl_penalized_rewards,
    kl_sums,
    response_kl_loss,
    teacher_penalties,
)
from learner.policy_losses import POLICY_LOSSES, PolicyLoss, policy_loss
from learner.ppo import (
    LOCAL,
    Reducer,
    global_loss_denominator,
    masked_mean,
    overlong_penalty,
    penalize_missing_eos,
    truncated_loss_mask,
    value_loss,
)
from services.config import DistillConfig, JobConfig, KLConfig, PPOConfig

# the registered entries a config chooses, checked in this order (``Algorithm.from_config``)
REGISTRIES = (ESTIMATORS, POLICY_LOSSES, CORRECTIONS, KL_ESTIMATORS)

if TYPE_CHECKING:  # the batch's module loads in the rank, not in the driver (services/experience.py)
    from services.experience import RolloutBatch


@dataclass(frozen=True)
class EpisodeView:
    """An episode's rows laid end to end: row j of episode e fills columns [j * T, (j + 1) * T) of view row e,
    [E, K * T] with K the most rows an episode has (empty slots are masked out). The estimators and losses
    skip masked tokens as if they were not there, so on the view an episode is one trajectory.

    ``episode``, ``slot``: [B] each row's view row and slot, episodes in order of their first row;
    ``trivial``: every episode is one row, in row order, and the view is the batch itself."""

    episode: Tensor
    slot: Tensor
    episodes: int
    slots: int
    width: int
    trivial: bool

    @classmethod
    def of(cls, episode_index: Tensor, width: int) -> EpisodeView:
        """The view of rows whose episodes ``episode_index`` [B] names (any ids; an episode's rows in
        order)."""
        b = episode_index.numel()
        ids, first = torch.unique(episode_index, return_inverse=True)
        if ids.numel() == b:  # one row per episode
            return cls(torch.arange(b), torch.zeros(b, dtype=torch.long), b, 1, width, True)
        first_row = torch.full((ids.numel(),), b, dtype=torch.long).scatter_reduce(0, first, torch.arange(b),
                                                                                   "amin")
        rank = torch.empty_like(first_row)
        rank[first_row.argsort()] = torch.arange(ids.numel())  # episodes in order of their first row
        episode = rank[first]
        # rows grouped by episode, each episode's in row order
        order = torch.sort(episode, stable=True).indices
        grouped = episode[order]
        slot = torch.empty_like(episode)
        slot[order] = torch.arange(b) - torch.searchsorted(grouped, grouped)
        return cls(episode, slot, int(ids.numel()), int(slot.max()) + 1, width, False)

    def merge(self, x: Tensor) -> Tensor:
        """[B, T] rows -> [E, K * T] (differentiable); 0 in empty slots."""
        if self.trivial:
            return x
        out = x.new_zeros(self.episodes, self.slots, *x.shape[1:])
        out = out.index_put((self.episode.to(x.device), self.slot.to(x.device)), x)
        return out.reshape(self.episodes, self.slots * x.shape[1], *x.shape[2:])

    def split(self, y: Tensor) -> Tensor:
        """[E, K * T] -> [B, T], ``merge``'s inverse on the rows."""
        if self.trivial:
            return y
        return y.reshape(self.episodes, self.slots, self.width, *y.shape[2:])[self.episode.to(y.device),
                                                                               self.slot.to(y.device)]

    def total(self, x: Tensor) -> Tensor:
        """[B] per row -> [E] summed over each episode's rows."""
        if self.trivial:
            return x
        return x.new_zeros(self.episodes).index_add(0, self.episode.to(x.device), x)

    def first(self, x: Tensor) -> Tensor:
        """[B] per row -> [E] the value of each episode's first row (a group id, shared by its rows)."""
        if self.trivial:
            return x
        keep = self.slot == 0
        out = x.new_empty(self.episodes)
        out[self.episode[keep]] = x[keep]
        return out


def episode_view(batch: RolloutBatch) -> EpisodeView:
    return EpisodeView.of(batch.episode_index, batch.response_ids.shape[1])


@dataclass(frozen=True)
class Algorithm:
    """The settings the layer reads, from one resolved ``JobConfig`` (``from_config``)."""

    ppo: PPOConfig
    kl: KLConfig
    distill: DistillConfig | None  # on-policy distillation (distill.teacher_path), or None
    off_policy: bool  # rollout.mode async: an older version may have sampled the rows
    samples_per_prompt: int
    dynamic_sampling: bool
    missing_eos_penalty: float | None = None
    # (rollout.max_new_tokens, reward.overlong_buffer, its penalty)
    overlong: tuple[int, int, float] | None = None

    @classmethod
    def from_config(cls, cfg: JobConfig) -> Algorithm:
        """The layer's settings of ``cfg``, after each registry's check of the entry it chooses (ValueError,
        naming the settings: ``learner.registry.Registry.check``)."""
        for registry in REGISTRIES:
            registry.check(cfg)
        reward = cfg.reward
        overlong = (None if reward.overlong_buffer is None
                    else (cfg.rollout.max_new_tokens, reward.overlong_buffer, reward.overlong_penalty))
        return cls(cfg.ppo, cfg.kl, cfg.distill if cfg.distill.teacher_path else None,
                   cfg.rollout.mode == "async", cfg.rollout.samples_per_prompt, cfg.rollout.dynamic_sampling,
                   reward.missing_eos_penalty, overlong)

    @property
    def policy(self) -> PolicyLoss:
        """The registered policy loss ``ppo.policy_loss`` names."""
        return POLICY_LOSSES.get(self.ppo.policy_loss)

    @property
    def has_critic(self) -> bool:
        return ESTIMATORS.get(self.ppo.advantage).critic

    # ------------------------------------------------------------------ scores and dynamic sampling

    def final_scores(self, batch: RolloutBatch) -> tuple[Tensor, Tensor, Tensor | None]:
        """The scores the advantages read: ``reward.missing_eos_penalty``'s replacement, or DAPO's soft
        overlong penalty added (``reward.overlong_buffer``). Returns (scores [B], missing-EOS rows [B] bool,
        the overlong penalties [B] or None)."""
        scores, missing_eos = penalize_missing_eos(batch.scores, batch.finish_reason,
                                                   self.missing_eos_penalty)
        if self.overlong is None:
            return scores, missing_eos, None
        penalty = overlong_penalty(batch.action_mask.sum(-1), *self.overlong)
        return scores + penalty.to(scores.dtype), missing_eos, penalty

    def differing_groups(self, batch: RolloutBatch) -> int:
        """How many whole groups of ``batch`` hold scores that differ (penalties applied)."""
        return differing_groups(self.final_scores(batch)[0], batch.group_index)

    def select(self, batch: RolloutBatch, groups: int) -> tuple[Tensor, dict[str, int]]:
        """DAPO's dynamic sampling: (keep [B] bool, group counts) of the ``groups`` whole groups to train
        on."""
        return dynamic_sampling_rows(self.final_scores(batch)[0], batch.group_index, groups)

    # ------------------------------------------------------------------ the controller's statistic

    def _controller_inputs(self, batch: RolloutBatch) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
        """(log-probs, reference log-probs, mask, the sampler's log-probs or None), [E, K * T] on the episode
        view: the learner's log-probs at the start of the update, and in async mode the engine's, which
        sampled."""
        view, mask = episode_view(batch), batch.action_mask
        behaviour = view.merge(batch.rollout_logprobs * mask) if self.off_policy else None
        return (view.merge(batch.old_logprobs * mask), view.merge(batch.ref_logprobs * mask),
                view.merge(mask), behaviour)

    def controller_values(self, batch: RolloutBatch) -> Tensor:
        """[E] each episode's term of the controller's statistic (``learner.kl.episode_kl``), episodes in
        order of their first row: async, weighted by the prefix ratio of the learner's log-probs to the
        engine's, so its expectation is the KL of the learner's policy (the module's docstring)."""
        logprobs, ref_logprobs, mask, behaviour = self._controller_inputs(batch)
        return episode_kl(logprobs, ref_logprobs, mask, self.kl.estimator, behaviour)

    @staticmethod
    def sampled(batch: RolloutBatch, dropped: RolloutBatch | None = None) -> RolloutBatch:
        """Every episode sampled, which the controller's statistic is taken over: the rows trained on and
        dynamic sampling's ``dropped`` ones (leaving them out would make the statistic a selection on
        scores)."""
        from services.experience import concat_batches

        if dropped is None or not dropped.shape[0]:
            return batch
        return concat_batches([batch, dropped])

    def controller_sums(self, batch: RolloutBatch, dropped: RolloutBatch | None = None) -> dict[str, float]:
        """``kl_sums`` over every episode sampled (``sampled``), with ``old_logprobs`` and
        ``ref_logprobs``."""
        logprobs, ref_logprobs, mask, behaviour = self._controller_inputs(self.sampled(batch, dropped))
        return kl_sums(logprobs, ref_logprobs, mask, self.kl.estimator, behaviour)

    # ------------------------------------------------------------------ rewards and advantages

    def prepare(self, batch: RolloutBatch, kl_coef: float, reducer: Reducer = LOCAL) -> dict[str, float]:
        """Scores, KL penalties (at ``kl_coef``, with the KL in the reward) and advantages of the rows to
        train on, on the episode view. Sets ``batch.advantages`` and ``batch.returns`` (and with
        ``ppo.mask_truncated`` the loss's ``batch.action_mask``); returns the additive sums of what the
        episodes were given."""
        from services.experience import FINISH_LENGTH

        view, mask = episode_view(batch), batch.action_mask
        old_logprobs, ref_logprobs = batch.old_logprobs * mask, batch.ref_logprobs * mask
        values = None
        if self.has_critic:
            values = batch.old_values * mask
            check_finite("values", values)
        scores, missing_eos, overlong = self.final_scores(batch)
        task_scores, turn_rewards = scores, batch.turn_rewards
        # the teacher alone: no task reward at all
        if self.distill is not None and not self.distill.task_reward:
            scores = torch.zeros_like(scores)
            turn_rewards = None if turn_rewards is None else torch.zeros_like(turn_rewards)
        m, logp = view.merge(mask), view.merge(old_logprobs)
        in_reward = self.kl.placement == "reward"
        rewards, kl = kl_penalized_rewards(view.total(scores), logp, view.merge(ref_logprobs), m,
                                           kl_coef if in_reward else 0.0, self.kl.estimator,
                                           None if turn_rewards is None else view.merge(turn_rewards))
        teacher = None
        # the student's log-probs are the learner's, as for the KL to the reference
        if self.distill is not None:
            teacher = teacher_penalties(logp, view.merge(batch.teacher_logprobs * mask), m, self.distill.coef)
        groups = view.first(batch.group_index)
        if ESTIMATORS.get(self.ppo.advantage).group:  # a chunk holds whole groups, and a rank whole chunks
            check_whole_groups(groups, self.samples_per_prompt)
        p = self.ppo
        advantages, returns = compute_advantages(
            p.advantage, rewards, m, values=None if values is None else view.merge(values),
            group_index=groups, gamma=p.gamma, lam=p.lam, whiten_advantages=p.whiten_advantages,
            whiten_rewards=p.whiten_rewards, reducer=reducer, kl_rewards=-kl_coef * kl if in_reward else None,
            grpo_normalize=p.grpo_normalize, teacher=teacher,
            teacher_credit=self.distill.credit if self.distill is not None else "reward_to_go")
        batch.advantages = view.split(advantages)
        batch.returns = None if returns is None else view.split(returns)
        if p.mask_truncated:  # DAPO's overlong filtering: out of the losses; the statistic keeps them
            batch.action_mask = truncated_loss_mask(mask, batch.finish_reason)
        episodes = view.episodes
        sums = {
            "trained_episodes": float(episodes),
            "score_sum": float(task_scores.sum()),
            "reward_sum": float((rewards * m).sum()),  # penalty plus score, per episode summed
            # the unweighted response KL the reward penalised
            "penalty_sum": float(kl.sum(dtype=torch.float64)),
            "penalty_episodes": float(episodes),
            # episodes
            "truncated": float((view.total((batch.finish_reason == FINISH_LENGTH).double()) > 0).sum()),
            "missing_eos_penalized": float(missing_eos.sum()),
        }
        # k1 of the reverse KL to the teacher, summed per response (the penalty / -coef)
        if teacher is not None:
            sums["teacher_kl_sum"] = float(teacher.sum(dtype=torch.float64)) / -self.distill.coef
        if overlong is not None:
            sums.update({"overlong_penalty_sum": float(overlong.sum()),
                         "overlong_penalized": float((overlong < 0).sum())})
        if p.mask_truncated:
            sums["truncated_masked"] = float(((mask - batch.action_mask).sum(-1) > 0).sum())
        return sums

    # ------------------------------------------------------------------ the loss of one minibatch

    def loss_counts(self, mb: RolloutBatch, reducer: Reducer = LOCAL) -> dict[str, Tensor]:
        """A minibatch's global counts over all ranks (each a collective through ``reducer``, so every rank
        calls this once per minibatch), on its episode view: the policy term's denominator, and with the KL in
        the loss the episodes and the KL's count. Taken before its micro-batches, each of which divides its
        sums by these: their losses add up to the minibatch's."""
        view = episode_view(mb)
        mask, width = view.merge(mb.action_mask), mb.response_ids.shape[1]
        counts = {"denominator": global_loss_denominator(mask, self.ppo.loss_aggregation, reducer, width)}
        if self.kl.placement == "loss" and self.kl.loss_form != "grpo_token_k3":
            # per episode over all ranks' episodes, empty ones too, as the controller's mean
            counts["responses"] = global_loss_denominator(torch.ones_like(mask[:, :1]), "sequence_mean",
                                                          reducer)
            # its gradient over the policy term's tokens: beta weighs it as in the reward
            counts["kl_count"] = global_loss_denominator(mask, kl_loss_aggregation(self.ppo.loss_aggregation),
                                                         reducer, width)
        return counts

    def correction(self, old_logprobs: Tensor, behaviour_logprobs: Tensor, mask: Tensor, logprobs: Tensor,
                   advantages: Tensor) -> tuple[Tensor | None, dict[str, Tensor]]:
        """``ppo.correction``'s factor on each token's policy term and its statistics
        (``learner.correction.rollout_correction_weights``): TIS or MIS at ``ppo.is_cap``, IcePop's band, or
        TIS with the geometric or the off-policy sequence mask, each mask's settings read only where it is on.
        All [B, T]: pi_old's and the engine's log-probs, the mask, the policy being trained (``logprobs``, for
        the off-policy mask) and the advantages."""
        p = self.ppo
        return rollout_correction_weights(old_logprobs, behaviour_logprobs, mask, p.correction,
                                          p.correction_level, p.is_cap, logprobs=logprobs,
                                          advantages=advantages,
                                          **CORRECTIONS.get(p.correction).arguments(p))

    def correction_sums(self, batch: RolloutBatch, stale: Tensor) -> dict[str, float]:
        """The rollout correction's sums over a rank's batch at the start of the update (``stale``: [B, T], 1
        on rows of an older version than the learner's): ``correction_mismatch_k3_sum``, the k3 estimate of
        KL(engine || learner) summed over the tokens of the learner's own version (where the two differ by
        numerics alone), and the tokens whose weight the correction truncated (TIS, also under a sequence
        mask) or set to 0 (MIS beyond the cap, IcePop outside its band, a sequence mask)."""
        view, mask = episode_view(batch), batch.action_mask
        old_logprobs, behaviour = (view.merge(batch.old_logprobs * mask),
                                   view.merge(batch.rollout_logprobs * mask))
        _, stats = self.correction(old_logprobs, behaviour, view.merge(mask), old_logprobs,
                                   view.merge(batch.advantages))
        tokens, cut = float(mask.sum()), CORRECTIONS.get(self.ppo.correction).beyond_cap
        # the fractions are of the tokens: back to counts (whole numbers; the float32 means are not exact)
        beyond = float(round(float(stats.get("is_capped_fraction", 0.0)) * tokens))
        r = (batch.rollout_logprobs - batch.old_logprobs).double() * mask  # log pi_behav - log pi_learner
        return {"correction_mismatch_k3_sum": float(((torch.expm1(-r) + r) * mask * (1 - stale)).sum()),
                "correction_truncated_tokens": beyond if cut == "truncated" else 0.0,
                "correction_masked_tokens": (beyond if cut == "masked" else 0.0)
                + float(round(float(stats.get("masked_token_fraction", 0.0)) * tokens))}

    def loss(self, mb: RolloutBatch, forward: tuple[Tensor, Tensor | None, Tensor | None],
             counts: dict[str, Tensor], kl_coef: float) -> tuple[Tensor, dict]:
        """The PPO loss of the rows ``mb`` (a minibatch, or a micro-batch of whole episodes), each term's sum
        over them divided by the minibatch's global ``counts``.

        Args: mb: rows with old_logprobs, old_values (gae), ref_logprobs, advantages, returns; forward: the
            current policy's (log-probs [b, T] with grad, values [b, T] or None, entropy [b, T]) of those
            rows.
        Returns (loss, {name: (value, count)}): the losses with count None (summed over the micro-batches, one
        count a step), token statistics with this micro-batch's tokens, and the rollout correction's sequence
        statistics (``learner.correction.SEQUENCE_STATS``: the masks' fraction of episodes) with its episodes
        that hold a token, so that the rank's sums over count give each over the whole update.

        The policy term is ``ppo.policy_loss``'s (``learner.policy_losses``): PPO's clip, GSPO's sequence
        ratio, CISPO's clipped detached weight or SAPO's soft gate, each on the ratio to pi_old (async:
        pi_prox) and times the rollout correction's factor against the engine's sampled log-probs
        (``ppo.correction``: TIS, MIS, IcePop's band, or TIS with the geometric or DeepSeek-V3.2's off-policy
        sequence mask); the masks weigh the policy term alone, never the KL term in the loss or the
        controller's statistic.
        """
        p, aggregation, denominator = self.ppo, self.ppo.loss_aggregation, counts["denominator"]
        logprobs, values, entropy = forward
        device = logprobs.device
        view = episode_view(mb)
        row_mask = mb.action_mask.to(device)
        mask, logp = view.merge(row_mask), view.merge(logprobs)
        old_logprobs = view.merge(mb.old_logprobs.to(device))
        behaviour = view.merge(mb.rollout_logprobs.to(device) * row_mask)
        advantages = view.merge(mb.advantages.to(device))
        # the rollout correction, both modes: the ratio against pi_old (async: pi_prox, decoupled PPO), each
        # token's term times pi_old / pi_behav (the off-policy mask against the policy being trained: this
        # step's)
        weights, is_stats = self.correction(old_logprobs, behaviour, mask, logp, advantages)
        pg_loss, pg_stats = policy_loss(logp, old_logprobs, advantages, mask, p, aggregation, denominator,
                                        weights)
        sequence_stats = {k: is_stats.pop(k) for k in SEQUENCE_STATS & is_stats.keys()}
        loss, losses, stats = pg_loss, {"policy_loss": pg_loss}, {**pg_stats, **is_stats}
        if self.has_critic:  # GAE's critic; the other estimators have none
            vf_loss, vf_stats = value_loss(view.merge(values), view.merge(mb.old_values.to(device)),
                                           view.merge(mb.returns.to(device)), mask, p.clip_range_value,
                                           aggregation, denominator)
            loss, losses["value_loss"] = loss + p.vf_coef * vf_loss, vf_loss
            stats |= vf_stats
        if self.kl.placement == "loss":
            ref = view.merge(mb.ref_logprobs.to(device) * row_mask)
            if self.kl.loss_form == "grpo_token_k3":
                kl_term = grpo_token_k3_loss(logp, ref, mask, aggregation, denominator)
            else:  # prefix importance weights against the policy that sampled the rows (async: the engine)
                _, sampler = kl_logprob_roles(old_logprobs, behaviour, self.off_policy)
                kl_term = response_kl_loss(logp, sampler, ref, mask, self.kl.loss_form, counts["responses"],
                                           counts["kl_count"])
            loss, losses["kl_loss"] = loss + kl_coef * kl_term, kl_term
        losses["loss"] = loss
        stats["entropy"] = masked_mean(entropy, row_mask)
        tokens = row_mask.sum().double()  # stays on the device: the stats reach the host once, at the end
        sequences = (mask.sum(-1) > 0).sum().double()  # episodes with a token: what the fractions count
        return loss, {**{k: (v, None) for k, v in losses.items()},
                      **{k: (v, tokens) for k, v in stats.items()},
                      **{k: (v, sequences) for k, v in sequence_stats.items()}}
