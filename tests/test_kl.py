"""Unit tests of learner/kl.py: golden values, unbiasedness, the reward/controller identity, controllers."""

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from learner.kl import (
    AdaptiveKLController,
    FixedKLController,
    check_response_mask,
    controller_statistic,
    kl_estimate,
    kl_penalized_rewards,
    kl_stats_from_sums,
    kl_sums,
)
from tests.batch_statistics import kl_stats, sequence_kl

LOGP = torch.tensor([[-1.0, -2.0, -0.5], [-0.2, -3.0, -1.0]])
REF = torch.tensor([[-1.5, -1.0, -0.5], [-0.7, -2.0, -4.0]])
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])  # row 1 has 2 tokens; its third is padding


# -------------------------------------------------------------- golden values


def test_estimators_golden():
    r = LOGP - REF  # [[0.5, -1, 0], [0.5, -1, 3]]
    assert torch.equal(kl_estimate(LOGP, REF, "k1"), r)
    assert torch.allclose(kl_estimate(LOGP, REF, "k2"), torch.tensor([[0.125, 0.5, 0.0], [0.125, 0.5, 4.5]]))
    k3 = torch.tensor([[math.exp(-0.5) - 1 + 0.5, math.e - 2, 0.0],
                       [math.exp(-0.5) - 0.5, math.e - 2, math.exp(-3) + 2]])
    assert torch.allclose(kl_estimate(LOGP, REF, "k3"), k3)


def test_sequence_kl_sums_masked_tokens_only():
    # row 0: 0.5 - 1 + 0 = -0.5; row 1: 0.5 - 1 (the 3.0 is padding)
    assert torch.allclose(sequence_kl(LOGP, REF, MASK), torch.tensor([-0.5, -0.5]))
    assert torch.allclose(sequence_kl(LOGP, REF, MASK.bool(), "k2"), torch.tensor([0.625, 0.625]))


def test_rewards_put_score_at_last_real_token():
    scores = torch.tensor([1.0, 2.0])
    rewards, kl = kl_penalized_rewards(scores, LOGP, REF, MASK, kl_coef=0.1)
    assert torch.allclose(kl, torch.tensor([[0.5, -1.0, 0.0], [0.5, -1.0, 0.0]]))
    expected = torch.tensor([[-0.05, 0.1, 1.0], [-0.05, 2.1, 0.0]])
    assert torch.allclose(rewards, expected)


def test_variable_lengths_and_empty_response():
    logp = torch.tensor([[-1.0, -1.0, -1.0], [-1.0, -1.0, -1.0], [-1.0, -1.0, -1.0]])
    ref = torch.full_like(logp, -2.0)  # r = 1 everywhere
    mask = torch.tensor([[1, 0, 0], [0, 0, 0], [1, 1, 1]])
    rewards, _ = kl_penalized_rewards(torch.tensor([5.0, 7.0, 9.0]), logp, ref, mask, kl_coef=0.5)
    assert torch.allclose(rewards, torch.tensor([[4.5, 0, 0], [0, 0, 0], [-0.5, -0.5, 8.5]]))
    stats = kl_stats(logp, ref, mask)
    assert stats["empty_responses"] == 1
    assert stats["response_mean"] == pytest.approx(4 / 3)  # (1 + 0 + 3) / 3 rows
    assert stats["token_mean"] == pytest.approx(1.0)  # 4 nats / 4 tokens
    assert stats["response_sqrt"] == pytest.approx(math.sqrt(4 / 3))
    assert stats["k1_response_mean"] == pytest.approx(4 / 3)
    assert stats["k3_response_mean"] == pytest.approx(4 / 3 * (math.exp(-1) - 1 + 1))


def test_kl_stats_estimator_and_token_mean_differ_by_length():
    # two responses of 1 and 9 tokens at 1 nat/token: response mean 5, token mean 1
    logp = torch.zeros(2, 9)
    ref = torch.full((2, 9), -1.0)
    mask = torch.tensor([[1] + [0] * 8, [1] * 9])
    stats = kl_stats(logp, ref, mask)
    assert stats["response_mean"] == pytest.approx(5.0)
    assert stats["token_mean"] == pytest.approx(1.0)
    assert controller_statistic(stats, "response_sum") == pytest.approx(5.0)
    with pytest.warns(UserWarning, match="token_mean"):
        assert controller_statistic(stats, "token_mean") == pytest.approx(1.0)


def test_sums_over_shards_equal_whole_batch():
    g = torch.Generator().manual_seed(0)
    logp, ref = -torch.rand(6, 5, generator=g) * 3, -torch.rand(6, 5, generator=g) * 3
    lengths = torch.tensor([5, 0, 2, 3, 1, 4])
    mask = (torch.arange(5) < lengths[:, None]).float()
    whole = kl_stats(logp, ref, mask, "k3")
    a, b = kl_sums(logp[:2], ref[:2], mask[:2], "k3"), kl_sums(logp[2:], ref[2:], mask[2:], "k3")
    merged = kl_stats_from_sums({k: a[k] + b[k] for k in a})
    for key, value in whole.items():
        assert merged[key] == pytest.approx(value, rel=1e-12, abs=1e-12), key


# -------------------------------------------------------------- unbiasedness, by Monte Carlo


def _categoricals(seed: int, vocab: int = 8):
    g = torch.Generator().manual_seed(seed)
    log_pi = torch.log_softmax(torch.randn(vocab, generator=g) * 1.5, dim=0)
    log_ref = torch.log_softmax(torch.randn(vocab, generator=g) * 1.5, dim=0)
    true_kl = float((log_pi.exp() * (log_pi - log_ref)).sum())
    samples = torch.multinomial(log_pi.exp(), 400_000, replacement=True, generator=g)
    return log_pi[samples][None], log_ref[samples][None], true_kl


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_k1_and_k3_are_unbiased_and_reversed_k3_is_not(seed):
    logp, ref, true_kl = _categoricals(seed)
    k1 = kl_estimate(logp, ref, "k1")
    k3 = kl_estimate(logp, ref, "k3")
    assert (k3 >= 0).all()
    for est in (k1, k3):
        stderr = float(est.std()) / math.sqrt(est.numel())
        assert abs(float(est.mean()) - true_kl) < 5 * stderr + 1e-3
    # trlX's reversed form exp(r) - 1 - r estimates chi^2 - KL, not KL: the regression tether exists to avoid.
    r = logp - ref
    reversed_k3 = torch.expm1(r) - r
    stderr = float(reversed_k3.std()) / math.sqrt(reversed_k3.numel())
    assert abs(float(reversed_k3.mean()) - true_kl) > 10 * stderr
    assert float(reversed_k3.mean()) > 1.2 * true_kl


# -------------------------------------------------------------- the identity the controller relies on


@st.composite
def batches(draw):
    b = draw(st.integers(1, 6))
    t = draw(st.integers(1, 7))
    seed = draw(st.integers(0, 2**31 - 1))
    lengths = torch.tensor(draw(st.lists(st.integers(0, t), min_size=b, max_size=b)))
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(b, t, generator=g, dtype=torch.float64) * 5
    ref = -torch.rand(b, t, generator=g, dtype=torch.float64) * 5
    scores = torch.randn(b, generator=g, dtype=torch.float64)
    mask = (torch.arange(t) < lengths[:, None]).to(torch.float64)
    return logp, ref, mask, scores


@settings(max_examples=200, deadline=None)
@given(batch=batches(), kl_coef=st.floats(1e-3, 10.0), estimator=st.sampled_from(["k1", "k2", "k3"]))
def test_response_mean_equals_penalty_in_rewards(batch, kl_coef, estimator):
    logp, ref, mask, scores = batch
    rewards, _ = kl_penalized_rewards(scores, logp, ref, mask, kl_coef, estimator)
    score_placement = torch.zeros_like(rewards)
    last = mask.sum(-1).long() - 1
    for b in range(rewards.shape[0]):
        if last[b] >= 0:
            score_placement[b, last[b]] = scores[b]
    penalised = -((rewards - score_placement).sum(-1) / kl_coef).mean()
    assert kl_stats(logp, ref, mask, estimator)["response_mean"] == pytest.approx(float(penalised), abs=1e-9)


# -------------------------------------------------------------- bad input: loud, located, and nothing changed


def test_nonfinite_logprobs_named_with_count_and_location():
    logp = LOGP.clone()
    logp[1, 2] = float("nan")
    logp[1, 1] = float("inf")
    before = logp.clone()
    with pytest.raises(ValueError, match=r"logprobs has 2 non-finite.*\(1, 1\)"):
        kl_penalized_rewards(torch.zeros(2), logp, REF, MASK, 0.1)
    assert torch.equal(logp.nan_to_num(), before.nan_to_num())
    ref = REF.clone()
    ref[0, 0] = float("-inf")
    with pytest.raises(ValueError, match=r"ref_logprobs has 1 non-finite.*\(0, 0\)"):
        kl_stats(LOGP, ref, MASK)


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: kl_estimate(LOGP, REF[:, :2]), "shape"),
        (lambda: kl_estimate(LOGP[0], REF[0]), r"\[B, T\]"),
        (lambda: sequence_kl(LOGP, REF, MASK[:, :2]), "mask has shape"),
        (lambda: check_response_mask(torch.tensor([[1, 0, 1], [1, 1, 0]]), (2, 3), prefix=True),
         "not a prefix in row 0"),
        (lambda: sequence_kl(LOGP, REF, torch.tensor([[1, 2, 0], [1, 1, 0]])), "only 0/1"),
        (lambda: kl_estimate(LOGP, REF, "k4"), "kl.estimator='k4' is not a registered KL estimator"),
        (lambda: kl_penalized_rewards(torch.zeros(2), LOGP, REF, MASK, -0.1), "kl_coef must be"),
        (lambda: kl_penalized_rewards(torch.zeros(3), LOGP, REF, MASK, 0.1), "scores has shape"),
        (lambda: AdaptiveKLController(0.1, target=0.0, horizon=100), "target must be"),
        (lambda: AdaptiveKLController(0.1, target=6.0, horizon=-5), "horizon must be"),
        (lambda: FixedKLController(-1.0), "kl_coef must be"),
    ],
)
def test_bad_input_fails_loudly(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_controller_rejects_bad_statistic_and_keeps_beta():
    ctl = AdaptiveKLController(0.2, 6.0, 100)
    for bad in (float("nan"), float("inf")):
        with pytest.raises(ValueError, match="non-finite"):
            ctl.update(bad, 10)
    with pytest.raises(ValueError, match="n_steps"):
        ctl.update(1.0, 0)
    assert ctl.value == 0.2


# -------------------------------------------------------------- controllers


def _lm_human_preferences_trajectory(beta, target, horizon, stats, n_steps):
    """The reference update, written as in openai/lm-human-preferences' AdaptiveKLController."""
    out = []
    for current in stats:
        proportional_error = float(np.clip(current / target - 1, -0.2, 0.2))
        beta *= 1 + proportional_error * n_steps / horizon
        out.append(beta)
    return out


def test_adaptive_controller_reproduces_reference_trajectory():
    stats = [0.0, 3.0, 5.9, 6.0, 6.5, 12.0, 100.0, 7.1, -2.0]
    ctl = AdaptiveKLController(init_kl_coef=0.15, target=6.0, horizon=10000)
    got = [ctl.update(s, n_steps=512) for s in stats]
    assert got == pytest.approx(_lm_human_preferences_trajectory(0.15, 6.0, 10000, stats, 512), rel=1e-12)


@given(current=st.floats(-50, 500), n_steps=st.integers(1, 1000), beta=st.floats(1e-4, 5.0))
def test_adaptive_controller_moves_at_most_20_percent_times_steps_over_horizon(current, n_steps, beta):
    ctl = AdaptiveKLController(beta, target=6.0, horizon=1000)
    new = ctl.update(current, n_steps)
    assert abs(new / beta - 1) <= 0.2 * n_steps / 1000 + 1e-12
    assert (new > beta) == (current > 6.0 * (1 + 1e-12)) or new == pytest.approx(beta)


def test_controllers_round_trip_state():
    ctl = AdaptiveKLController(0.15, 6.0, 10000)
    for s in (9.0, 9.0, 2.0):
        ctl.update(s, 128)
    restored = AdaptiveKLController(0.15, 6.0, 10000)
    restored.load_state_dict(ctl.state_dict())
    assert restored.value == ctl.value and restored.state_dict() == ctl.state_dict()
    assert restored.update(8.0, 64) == ctl.update(8.0, 64)

    fixed = FixedKLController(0.05)
    assert fixed.update(100.0, 10) == 0.05
    other = FixedKLController(0.0)
    other.load_state_dict(fixed.state_dict())
    assert other.value == 0.05


def test_controller_state_mismatch_is_refused():
    ctl = AdaptiveKLController(0.15, 6.0, 10000)
    with pytest.raises(ValueError, match="not a 'adaptive'"):
        ctl.load_state_dict(FixedKLController(0.1).state_dict())
    with pytest.raises(ValueError, match="target=3.0"):
        ctl.load_state_dict({**ctl.state_dict(), "target": 3.0})
    assert ctl.value == 0.15
