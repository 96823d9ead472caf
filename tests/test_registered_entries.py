"""A policy loss registered here, inside the test, runs through the config, the rules, the update and the
settings-space harness without a change to any other file; with a wrong declared objective the harness fails
(plausible bugs in the registered entries: tests/test_mutations.py)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from learner.algorithm import Algorithm
from learner.policy_losses import (
    POLICY_LOSSES,
    PolicyLoss,
    clipped_objective,
)
from learner.registry import entry_rule
from services.config import load_config
from tests import test_settings_space as harness


@entry_rule("ppo.policy_loss", "ppo.clip_range",
            example={"ppo": {"policy_loss": "soft_clip", "clip_range": 0.9}})
def soft_clip_scale_at_most_half(cfg) -> str | None:
    if cfg.ppo.clip_range <= 0.5:
        return None
    return f"ppo.clip_range={cfg.ppo.clip_range} is the soft clip's scale s, which must be at most 0.5"


def soft_clip_terms(log_ratio, a, mask, p):
    """``-A * s * tanh((r - 1) / s)`` written as ``2 sigmoid(2x) - 1``: the gradient of the policy gradient at
    r = 1, fading smoothly away from it."""
    s = p.clip_range
    return -a * s * (2.0 * torch.sigmoid(2.0 * (log_ratio.exp() - 1.0) / s) - 1.0), {}


def soft_clip_objective(log_r, a, mask, p):
    s = p.clip_range
    return -a * s * torch.tanh((log_r.exp() - 1.0) / s)


SOFT_CLIP = PolicyLoss(name="soft_clip", doc="a tanh soft clip of the token ratio, scale ppo.clip_range",
                       reads={"clip_range": "the soft clip's scale s"}, rules=(soft_clip_scale_at_most_half,),
                       terms=soft_clip_terms, objective=soft_clip_objective)


def test_a_policy_loss_registered_here_is_refused_before_and_after_and_checked_while_registered():
    with pytest.raises(ValueError, match=r"ppo.policy_loss='soft_clip' is not a registered policy loss"):
        Algorithm.from_config(load_config(None, {"ppo": {"policy_loss": "soft_clip"}}))
    with POLICY_LOSSES.registered(SOFT_CLIP):
        cfg = load_config(None, {"ppo": {"policy_loss": "soft_clip", "clip_range": 0.3}})
        assert Algorithm.from_config(cfg).policy is SOFT_CLIP
        # its rule, by name, and a setting another entry reads while it does not
        with pytest.raises(ValueError, match=r"^\[soft_clip_scale_at_most_half\] ppo.clip_range=0.9"):
            Algorithm.from_config(load_config(None, soft_clip_scale_at_most_half.example))
        unread = {"ppo": {"policy_loss": "soft_clip", "sapo_tau_pos": 2.0}}
        with pytest.raises(ValueError, match=r"ppo.sapo_tau_pos=2.0 is set but ppo.policy_loss='soft_clip' "
                                             r"ignores it \(.*read by sapo\)"):
            Algorithm.from_config(load_config(None, unread))
        # and the other entries refuse the setting it reads, naming it as a reader
        with pytest.raises(ValueError, match=r"ppo.clip_range=0.3 is set but ppo.policy_loss='sapo' .*read "
                                             r"by ppo, soft_clip"):
            Algorithm.from_config(load_config(None, {"ppo": {"policy_loss": "sapo", "clip_range": 0.3}}))
    assert "soft_clip" not in POLICY_LOSSES.names()


def test_a_policy_loss_registered_here_runs_through_the_update(tiny_model_dir):
    from learner.engine import TorchEngine
    from learner.plan import RankSpec
    from learner.update import update
    from tests.test_update import better_and_worse, config, sampled_batch

    with POLICY_LOSSES.registered(SOFT_CLIP):
        cfg = config(policy_loss="soft_clip", clip_range=0.3)
        spec = RankSpec.of(cfg, tiny_model_dir)
        engine = TorchEngine.build(tiny_model_dir, spec)
        batch = sampled_batch(engine)
        before = batch.old_logprobs.sum(-1)
        result = update(engine, spec.algorithm, spec.update, batch, 0.05, 1)
    assert result.ppo["optimizer_steps"] == 4 and math.isfinite(result.ppo["policy_loss"])
    moved, better, worse = better_and_worse(engine, batch, before)
    assert moved[better].mean() - moved[worse].mean() > 1.0, (moved, batch.scores)


@pytest.fixture(scope="module")
def problems():
    return harness.make_problems()


def test_a_policy_loss_registered_here_passes_the_harness_and_fails_it_with_a_wrong_objective(problems):
    with POLICY_LOSSES.registered(SOFT_CLIP):
        harness.check_policy_loss_entry("soft_clip", clip_range=0.3)
        # the accepted combinations' checks, classed as every policy loss that is the policy gradient at r = 1
        rows, _ = harness.covering_array({**harness.AXES, "policy_loss": ("soft_clip",)}, tries=4)
        for c in rows[:12]:
            cfg, refusal = harness.resolve(c)
            assert cfg is not None, refusal
            expected = harness.expected_classes(c, bool(harness.mask_binds(c, cfg, problems)))
            bound = harness.stated_bound(c, problems)
            for check, error in harness.check_combination(c, cfg, problems).items():
                assert harness.meets(expected[check], error, bound), (check, expected[check], error, c)
    # declared as PPO's clipped surrogate, which it is not
    wrong = dataclasses.replace(SOFT_CLIP, objective=lambda log_r, a, mask, p: clipped_objective(
        log_r.exp(), a, (p.clip_range, p.clip_range)))
    with POLICY_LOSSES.registered(wrong), pytest.raises(AssertionError, match="soft_clip"):
        harness.check_policy_loss_entry("soft_clip", clip_range=0.3)
