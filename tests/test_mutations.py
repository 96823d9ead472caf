"""Mutation testing of the settings-space harness: plausible bugs, each a small patch of one named function or
registered entry, applied one at a time; the harness's check of the entry the bug is in (its own axes) must
fail on each by an assertion on the numbers, and pass once the patch is gone."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from learner import advantages, correction, kl, policy_losses
from learner import algorithm as algorithm_module
from learner import update as update_module
from learner.algorithm import Algorithm
from learner.update import RankScoring
from services import experience
from tests import test_settings_space as harness


def entry_patch(registry, name, **fields):
    """A patch of the registered entry ``name``: its fields replaced."""
    def apply(monkeypatch):
        monkeypatch.setitem(registry.entries, name, dataclasses.replace(registry.entries[name], **fields))
    return apply


def function_patch(module, name, make):
    """A patch of ``module.name``: ``make(original)`` in its place."""
    def apply(monkeypatch):
        monkeypatch.setattr(module, name, make(getattr(module, name)))
    return apply


def _sapo_temperatures_swapped(log_ratio, a, mask, p):
    return policy_losses.sapo_terms(log_ratio, a, mask, p.model_copy(update={"sapo_tau_pos": p.sapo_tau_neg,
                                                                             "sapo_tau_neg": p.sapo_tau_pos}))


def _cispo_weight_not_detached(log_ratio, a, mask, p):
    return -a * log_ratio.exp().clamp(1.0 - p.cispo_clip_low, 1.0 + p.cispo_clip_high), {}


def _cispo_weight_unclipped(log_ratio, a, mask, p):
    return policy_losses.cispo_terms(log_ratio, a, mask, p.model_copy(update={"cispo_clip_high": 1e9}))


def _ppo_clip_on_the_wrong_side(log_ratio, a, mask, p):
    ratio, (low, high) = log_ratio.exp(), policy_losses.ppo_clip(p)
    return torch.minimum(-a * ratio, -a * ratio.clamp(1.0 - low, 1.0 + high)), {}


def _ppo_one_bound_for_both(log_ratio, a, mask, p):
    low = policy_losses.ppo_clip(p)[0]
    return policy_losses.clipped_terms(log_ratio, a, mask, (low, low))


def _icepop_keeps_tokens_outside_its_band(log_w, x):
    weights, beyond, _ = correction.icepop(log_w, x)
    return weights, beyond, None


def _geometric_band_on_the_product(log_k, mask, low, high):
    import math

    log_product = (log_k * mask).sum(-1, keepdim=True)
    return ((log_product < math.log(low)) | (log_product > math.log(high))) & (mask > 0)


def _off_policy_divergence_from_the_proximal_policy(log_w, x):
    weights, beyond, _ = correction.truncated(log_w, x)
    return weights, beyond, correction.off_policy_sequence_masked(x.old_logprobs, x.behaviour_logprobs,
                                                                  x.advantages, x.mask, x.delta)


def _controller_sums_per_row(self, batch, dropped=None):
    rows = self.sampled(batch, dropped)
    mask = rows.action_mask
    behaviour = rows.rollout_logprobs * mask if self.off_policy else None
    return kl.kl_sums(rows.old_logprobs * mask, rows.ref_logprobs * mask, mask, self.kl.estimator, behaviour)


def _stamped_by_the_newest_token(original):
    def newest(token_versions, default):
        return torch.tensor([max((v for v in row if v >= 0), default=default) for row in token_versions])
    return newest


def _reference_from_the_engine(original):
    def trained(self, chunk):
        logprobs, _, _ = self.engine.forward(chunk, grad=False)
        return logprobs * chunk.action_mask
    return trained


def _grpo_std_over_n(original):
    def biased(returns, group_index, eps=advantages.GRPO_EPS):
        count = torch.bincount(group_index)[group_index].double()
        return original(returns, group_index, eps) * ((count - 1) / count).sqrt()
    return biased


def _rloo_with_itself(returns, group_index):
    count = torch.bincount(group_index)[group_index].double()
    total = torch.zeros(int(group_index.max()) + 1, dtype=torch.float64).index_add(0, group_index,
                                                                                  returns.double())
    return returns - (total[group_index] / count).to(returns.dtype)


def _gae_lambda_one(original):
    def gae(rewards, values, mask, gamma=1.0, lam=0.95):
        return original(rewards, values, mask, gamma, 1.0)
    return gae


def _grpo_without_the_kl_to_go(rewards, mask, values, group_index, kl_rewards, s):
    return advantages._grpo(rewards, mask, values, group_index, None, s)


def _not_whitened(original):
    return lambda x, mask, reducer=None, shift_mean=True: x


def _epochs_without_the_kl(original):
    def epochs(engine, algorithm, settings, batch, kl_coef, iteration, step_forward=None):
        return original(engine, algorithm, settings, batch, 0.0, iteration, step_forward)
    return epochs


def _sequence_mean_over_the_width(original):
    def over_width(x, mask, aggregation="token_mean", denominator=None):
        if aggregation != "sequence_mean":
            return original(x, mask, aggregation, denominator)
        return ((x * mask).sum(-1) / mask.shape[-1]).sum() / denominator
    return over_width


def _controller_inputs_unweighted(original):
    def unweighted(self, batch):
        logprobs, ref_logprobs, mask, _ = original(self, batch)
        return logprobs, ref_logprobs, mask, None
    return unweighted


POLICY = "policy loss"
COLLECTION = "collection"  # the enumeration is collected again under the patch
UPDATE = "update"  # learner.update's plumbing around the layer
ADVANTAGE = "advantage estimator"
CORRECTION = "correction"
ESTIMATOR = "kl estimator"
AXIS = "combinations"  # the main harness's combinations that hold one axis's value
LOSSES, CORRECTIONS, KL_ESTIMATORS = policy_losses.POLICY_LOSSES, correction.CORRECTIONS, kl.KL_ESTIMATORS
ESTIMATORS = advantages.ESTIMATORS


def _gspo_ratio_a_sum(original):
    return lambda logprobs, old, mask: ((logprobs - old) * mask).sum(-1, keepdim=True)


def _off_policy_mask_sign_flipped(original):
    def flipped(logprobs, behaviour, advantages, mask, delta):
        return original(logprobs, behaviour, -advantages, mask, delta)
    return flipped


# name -> (the kind of entry, the entry whose check runs, the patch, the settings of the check)
MUTANTS = {
    "SAPO's temperatures swapped between positive and negative advantages":
        (POLICY, "sapo", entry_patch(LOSSES, "sapo", terms=_sapo_temperatures_swapped), {}),
    "CISPO's weight not detached":
        (POLICY, "cispo", entry_patch(LOSSES, "cispo", terms=_cispo_weight_not_detached), {}),
    "CISPO's weight unclipped":
        (POLICY, "cispo", entry_patch(LOSSES, "cispo", terms=_cispo_weight_unclipped), {}),
    "PPO's clip on the wrong side (min for max)":
        (POLICY, "ppo", entry_patch(LOSSES, "ppo", terms=_ppo_clip_on_the_wrong_side), {}),
    "PPO's clip-higher ignored":
        (POLICY, "ppo", entry_patch(LOSSES, "ppo", terms=_ppo_one_bound_for_both), {"clip_range_high": 0.28}),
    "GSPO's sequence ratio a sum, not a mean":
        (POLICY, "gspo", function_patch(policy_losses, "sequence_log_ratio", _gspo_ratio_a_sum), {}),
    "GSPO-token's ratio not detached (GSPO's sequence ratio on every token)":
        (POLICY, "gspo_token", entry_patch(LOSSES, "gspo_token", ratio_level="sequence"), {}),
    "IcePop keeping the tokens outside its band":
        (CORRECTION, "icepop",
         entry_patch(CORRECTIONS, "icepop", weights=_icepop_keeps_tokens_outside_its_band), {}),
    "the off-policy mask's sign flipped":
        (CORRECTION, "off_policy_mask",
         function_patch(correction, "off_policy_sequence_masked", _off_policy_mask_sign_flipped), {}),
    "the off-policy mask by each token's advantage, not the row's":
        (CORRECTION, "off_policy_mask",
         function_patch(correction, "sequence_advantage", lambda f: lambda advantages, mask: advantages), {}),
    "the off-policy mask's divergence from the proximal policy, not the one trained":
        (CORRECTION, "off_policy_mask",
         entry_patch(CORRECTIONS, "off_policy_mask", weights=_off_policy_divergence_from_the_proximal_policy),
         {}),
    "TIS masking instead of truncating":
        (CORRECTION, "tis", entry_patch(CORRECTIONS, "tis", weights=correction.masked_beyond_cap), {}),
    "MIS truncating instead of masking":
        (CORRECTION, "mis", entry_patch(CORRECTIONS, "mis", weights=correction.truncated), {}),
    "the geometric mask's band on the product, not the geometric mean":
        (CORRECTION, "geometric_mask",
         function_patch(correction, "geometric_mean_outside_band", lambda f: _geometric_band_on_the_product),
         {}),
    "k1 with its sign flipped":
        (ESTIMATOR, "k1", entry_patch(KL_ESTIMATORS, "k1", per_token=lambda r: -r), {}),
    "k2 without its half":
        (ESTIMATOR, "k2", entry_patch(KL_ESTIMATORS, "k2", per_token=lambda r: r.square()), {}),
    "k3 with exp(r) for exp(-r)":
        (ESTIMATOR, "k3", entry_patch(KL_ESTIMATORS, "k3", per_token=lambda r: torch.expm1(r) - r), {}),
    "the controller's sums counted per row instead of per episode":
        (ESTIMATOR, "k1", lambda mp: mp.setattr(Algorithm, "controller_sums", _controller_sums_per_row), {}),
    "in-flight rows stamped with their newest token instead of their oldest":
        (COLLECTION, "admission",
         function_patch(experience, "row_versions", _stamped_by_the_newest_token), {}),
    "the reference the rank scores with is the policy being trained, not its frozen copy":
        (COLLECTION, "k1", function_patch(RankScoring, "reference_logprobs", _reference_from_the_engine), {}),
    "GRPO's group std over n, not n - 1":
        (ADVANTAGE, "grpo", function_patch(advantages, "grpo_sequence_advantages", _grpo_std_over_n), {}),
    "GRPO's KL penalty to go left out of the advantages":
        (ADVANTAGE, "grpo", entry_patch(ESTIMATORS, "grpo", function=_grpo_without_the_kl_to_go), {}),
    "RLOO's baseline the group's mean with the sample itself":
        (ADVANTAGE, "rloo",
         entry_patch(ESTIMATORS, "rloo", function=advantages._per_sequence(_rloo_with_itself)), {}),
    "GAE's lambda taken as 1":
        (ADVANTAGE, "gae", function_patch(advantages, "gae_advantages", _gae_lambda_one), {}),
    "REINFORCE++'s reward to go not whitened":
        (ADVANTAGE, "reinforce_pp", function_patch(advantages, "global_whiten", _not_whitened), {}),
    "REINFORCE++-baseline without its group baseline":
        (ADVANTAGE, "reinforce_pp_baseline",
         entry_patch(ESTIMATORS, "reinforce_pp_baseline", function=advantages._reinforce_pp), {}),
    "the update's epochs without the KL coefficient (the loss-placed KL dropped)":
        (UPDATE, "update", function_patch(update_module, "ppo_epochs", _epochs_without_the_kl), {}),
    "sequence_mean's rows divided by the response width, not their own length":
        (AXIS, "aggregation", function_patch(policy_losses, "masked_mean", _sequence_mean_over_the_width),
         {"aggregation": "sequence_mean"}),
    "DAPO's overlong filtering left out (the rows cut at the cap trained on)":
        (AXIS, "mask_truncated", function_patch(algorithm_module, "truncated_loss_mask",
                                                lambda f: lambda mask, finish_reason: mask),
         {"mask_truncated": True}),
    "the async statistic unweighted (k3 of the learner's log-probs on the engine's rows)":
        (ESTIMATOR, "k3", function_patch(Algorithm, "_controller_inputs", _controller_inputs_unweighted), {}),
}


def check(kind: str, name: str, settings: dict, problems: dict) -> None:
    if kind == UPDATE:
        harness.check_update(problems, every=4)
    elif kind == AXIS:
        harness.check_combinations(problems, **settings)
    elif kind == ADVANTAGE:
        harness.check_advantage_estimator_entry(name)
    elif kind == COLLECTION:  # the rows as collected under the patch
        problems = harness.make_problems()
        if name == "admission":
            harness.check_admission(problems)
        else:
            harness.check_kl_estimator_entry(name, problems)
    elif kind == POLICY:
        harness.check_policy_loss_entry(name, **settings)
    elif kind == CORRECTION:
        reads_level = "correction_level" in CORRECTIONS.get(name).reads
        for level in ("token", "sequence") if reads_level else ("token",):
            harness.check_correction_entry(name, level, **settings)
    else:
        harness.check_kl_estimator_entry(name, problems)


@pytest.fixture(scope="module")
def problems():
    return harness.make_problems()


@pytest.mark.parametrize("mutant", MUTANTS)
def test_the_harness_fails_on_each_plausible_bug(mutant, problems):
    kind, name, patch, settings = MUTANTS[mutant]
    with pytest.MonkeyPatch.context() as mp:
        patch(mp)
        with pytest.raises(AssertionError):
            check(kind, name, settings, problems)
    check(kind, name, settings, problems)  # and passes on the tree itself


def test_the_list_covers_every_registered_entry():
    covered = {(kind, name) for kind, name, _, _ in MUTANTS.values()}
    assert {(POLICY, n) for n in LOSSES.names()} <= covered
    assert {(CORRECTION, n) for n in CORRECTIONS.names() if n != "none"} <= covered
    assert {(ESTIMATOR, n) for n in KL_ESTIMATORS.names()} <= covered
    assert {(ADVANTAGE, n) for n in ESTIMATORS.names()} <= covered
