"""Unit tests of learner/ppo.py and learner/policy_losses.py against hand-computed values and naive loops."""

import pytest
import torch

from learner.policy_losses import cispo_weight, policy_loss, sapo_gate
from learner.ppo import (
    gae_advantages,
    masked_mean,
    masked_whiten,
    value_loss,
)
from services.config import PPOConfig
from tests.batch_statistics import explained_variance


def _naive_gae(rewards, values, lengths, gamma, lam):
    """Per-sequence Python loop over the real tokens only."""
    adv = torch.zeros_like(rewards)
    for b, n in enumerate(lengths):
        last = 0.0
        for t in reversed(range(n)):
            next_v = float(values[b, t + 1]) if t + 1 < n else 0.0
            delta = float(rewards[b, t]) + gamma * next_v - float(values[b, t])
            last = delta + gamma * lam * last
            adv[b, t] = last
    return adv


@pytest.mark.parametrize("gamma, lam", [(1.0, 0.95), (0.99, 0.9), (1.0, 1.0), (0.5, 0.0)])
def test_gae_matches_naive_loop(gamma, lam):
    g = torch.Generator().manual_seed(3)
    b, t = 7, 9
    lengths = [9, 0, 1, 4, 9, 2, 6]
    mask = (torch.arange(t) < torch.tensor(lengths)[:, None]).double()
    rewards = torch.randn(b, t, generator=g, dtype=torch.float64)
    values = torch.randn(b, t, generator=g, dtype=torch.float64)
    adv, ret = gae_advantages(rewards, values, mask, gamma, lam)
    expected = _naive_gae(rewards, values, lengths, gamma, lam)
    assert torch.allclose(adv, expected, atol=1e-12)
    assert torch.allclose(ret, (expected + values) * mask, atol=1e-12)


def test_gae_golden():
    # one sequence of 2 real tokens and a pad; gamma=1, lam=1: A_t = sum of future rewards - V_t
    rewards = torch.tensor([[0.5, 1.0, 9.0]])
    values = torch.tensor([[0.2, 0.3, 7.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    adv, ret = gae_advantages(rewards, values, mask, 1.0, 1.0)
    assert torch.allclose(adv, torch.tensor([[1.3, 0.7, 0.0]]))
    assert torch.allclose(ret, torch.tensor([[1.5, 1.0, 0.0]]))


def test_gae_rejects_shape_mismatch():
    with pytest.raises(ValueError, match="one \\[B, T\\] shape"):
        gae_advantages(torch.zeros(2, 3), torch.zeros(2, 4), torch.ones(2, 3))


def test_masked_mean_token_and_sequence():
    x = torch.tensor([[1.0, 2.0, 3.0], [10.0, 0.0, 0.0], [5.0, 5.0, 5.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    assert masked_mean(x, mask) == pytest.approx(16 / 4)
    assert masked_mean(x, mask, "sequence_mean") == pytest.approx((2.0 + 10.0) / 2)
    assert masked_mean(x, torch.zeros_like(mask)) == 0.0
    with pytest.raises(ValueError, match="aggregation"):
        masked_mean(x, mask, "batch")


def test_masked_whiten():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 6, generator=g, dtype=torch.float64) * 3 + 2
    mask = (torch.arange(6) < torch.tensor([6, 3, 0, 1, 5])[:, None]).double()
    w = masked_whiten(x, mask)
    real = w[mask.bool()]
    assert float(real.mean()) == pytest.approx(0.0, abs=1e-12)
    assert float(real.var()) == pytest.approx(1.0, rel=1e-6)
    assert (w[~mask.bool()] == 0).all()
    kept = masked_whiten(x, mask, shift_mean=False)[mask.bool()]
    assert float(kept.mean()) == pytest.approx(float(x[mask.bool()].mean()), rel=1e-9)


def test_policy_loss_golden():
    old = torch.zeros(1, 3)
    new = torch.log(torch.tensor([[1.5, 0.5, 1.1]]))  # ratios 1.5, 0.5, 1.1
    adv = torch.tensor([[1.0, 1.0, -2.0]])
    mask = torch.ones(1, 3)
    loss, stats = policy_loss(new, old, adv, mask, PPOConfig(clip_range=0.2))
    # per token max(-A r, -A clip(r)): max(-1.5, -1.2) = -1.2; max(-0.5, -0.8) = -0.5; max(2.2, 2.2) = 2.2
    assert float(loss) == pytest.approx((-1.2 - 0.5 + 2.2) / 3)
    assert float(stats["clipfrac"]) == pytest.approx(2 / 3)
    r = torch.tensor([1.5, 0.5, 1.1])
    assert float(stats["approx_kl"]) == pytest.approx(float(((r - 1) - r.log()).mean()))


def test_policy_loss_gradient_vanishes_when_clipped():
    old = torch.zeros(1, 2)
    new = torch.log(torch.tensor([[1.5, 1.0]])).requires_grad_()
    loss, _ = policy_loss(new, old, torch.ones(1, 2), torch.ones(1, 2))
    loss.backward()
    assert new.grad[0, 0] == 0 and new.grad[0, 1] != 0


def test_clip_higher_golden():
    """DAPO's asymmetric clip: ratio 1.25 with A > 0 and 0.75 with A < 0, by hand; eps_high defaults to
    eps_low."""
    old = torch.zeros(1, 2)
    new = torch.log(torch.tensor([[1.25, 0.75]])).requires_grad_()
    adv, mask = torch.tensor([[1.0, -1.0]]), torch.ones(1, 2)
    symmetric, stats = policy_loss(new, old, adv, mask, PPOConfig(clip_range=0.2))
    # max(-1.25, -1.2) = -1.2 (clipped at 1.2); max(0.75, 0.8) = 0.8 (clipped at 0.8)
    assert float(symmetric.detach()) == pytest.approx((-1.2 + 0.8) / 2)
    assert float(stats["clipfrac"]) == 1.0
    higher, stats = policy_loss(new, old, adv, mask, PPOConfig(clip_range=0.2, clip_range_high=0.28))
    # 1.25 < 1.28: unclipped, -1.25; 0.75 is still below the floor 0.8
    assert float(higher.detach()) == pytest.approx((-1.25 + 0.8) / 2)
    assert float(stats["clipfrac"]) == 0.5
    higher.backward()
    # d/dlogp of -A * r = -A * r over 2 tokens; the clipped token has none
    assert new.grad.tolist() == [pytest.approx([-1.25 / 2, 0.0])]


@pytest.mark.parametrize("flip", [False, True])
def test_gspo_golden_two_rows(flip):
    """GSPO by hand: s_b = exp(mean_t log(pi / pi_old)), clipped per row to [1 - 3e-4, 1 + 4e-4], sequence
    mean. Row 0: 2 tokens, log-ratios (0.1, -0.3): s_0 = e^-0.1 = 0.904837. Row 1: 3 tokens, (0.2, 0.1, 0):
    s_1 = e^0.1 = 1.105171 (the last position is padding: its huge log-ratio must not count). A = (1, -2):
    both rows are outside the range on the side the min keeps unclipped; flipped, A = (-1, 2), both are
    clipped."""
    old = torch.zeros(2, 4)
    new = torch.tensor([[0.1, -0.3, 0.0, 0.0], [0.2, 0.1, 0.0, 9.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 0.0]])
    sign = -1.0 if flip else 1.0
    adv = sign * torch.tensor([[1.0] * 4, [-2.0] * 4])
    gspo = PPOConfig(policy_loss="gspo", gspo_clip_low=3e-4, gspo_clip_high=4e-4)
    loss, stats = policy_loss(new, old, adv, mask, gspo, "sequence_mean")
    s0, s1 = 0.9048374180359595, 1.1051709180756477
    if not flip:
        # max(-1 * s0, -1 * 0.9997) = -s0; max(2 * s1, 2 * 1.0004) = 2 * s1
        assert float(loss.detach()) == pytest.approx((-s0 + 2 * s1) / 2, rel=1e-6)
        assert float(stats["clipfrac"]) == 1.0  # every token's ratio lies outside, though none is cut
        loss.backward()
        # d/dlogp_t (-A s_b) = -A s_b / |y_b|, over the 2 rows
        expected = [[-s0 / 2 / 2] * 2 + [0.0, 0.0], [2 * s1 / 3 / 2] * 3 + [0.0]]
    else:
        # max(s0, 0.9997) = 0.9997; max(-2 * s1, -2 * 1.0004) = -2.0008: both clipped, no gradient
        assert float(loss.detach()) == pytest.approx((0.9997 - 2.0008) / 2, rel=1e-6)
        loss.backward()
        expected = [[0.0] * 4, [0.0] * 4]
    assert new.grad.tolist() == [pytest.approx(row, rel=1e-6, abs=1e-12) for row in expected]


@pytest.mark.parametrize("aggregation", ["token_mean", "sequence_mean", "seq_mean_token_sum_norm"])
def test_gspo_token_gradient_equals_gspo_with_a_constant_advantage_per_row(aggregation):
    """GSPO-token (s_bt = sg[s_b] pi_t / sg[pi_t]) has GSPO's value and, when each row's advantage is one
    number, GSPO's gradient (Zheng et al. 2025, section 4.3); with advantages that vary along a row they
    differ."""
    g = torch.Generator().manual_seed(5)
    b, t = 6, 5
    mask = (torch.arange(t) < torch.tensor([5, 3, 1, 4, 0, 2])[:, None]).double()
    old = -torch.rand(b, t, generator=g, dtype=torch.float64) * 3
    new = old + torch.randn(b, t, generator=g, dtype=torch.float64) * 4e-4  # some rows inside the clip range
    row_adv = torch.randn(b, 1, generator=g, dtype=torch.float64).expand(b, t)

    def grad(loss_name, advantages):
        logprobs = new.clone().requires_grad_()
        settings = PPOConfig(policy_loss=loss_name, gspo_clip_low=3e-4, gspo_clip_high=4e-4)
        loss, _ = policy_loss(logprobs, old, advantages, mask, settings, aggregation)
        loss.backward()
        return float(loss.detach()), logprobs.grad

    (gspo_loss, gspo), (token_loss, token) = grad("gspo", row_adv), grad("gspo_token", row_adv)
    assert token_loss == pytest.approx(gspo_loss, rel=1e-12)
    assert torch.allclose(token, gspo, rtol=1e-10, atol=1e-15)
    assert gspo.abs().sum() > 0 and (gspo == 0).any()  # some rows clipped, some not
    varying = row_adv + torch.randn(b, t, generator=g, dtype=torch.float64)
    assert not torch.allclose(grad("gspo_token", varying)[1], grad("gspo", varying)[1])


def test_cispo_golden():
    """CISPO by hand: ratios (1.5, 0.5, 7.0), A = (1, -1, 2). Each term is -A * sg(clip(r)) * grad log pi,
    valued -A * clip(r). Defaults (floor 0, ceiling 5): weights (1.5, 0.5, 5.0), only the 7.0 clipped;
    DAPO-like bounds (0.2, 0.2): weights (1.2, 0.8, 1.2). PPO's clip would drop token 0's gradient (r = 1.5 >
    1.2 with A > 0) and token 2's; CISPO keeps every token's, scaled by its clipped weight."""
    old = torch.zeros(1, 3)
    adv, mask = torch.tensor([[1.0, -1.0, 2.0]]), torch.ones(1, 3)
    for (low, high), weights, clipfrac in (((1.0, 4.0), (1.5, 0.5, 5.0), 1 / 3),
                                           ((0.2, 0.2), (1.2, 0.8, 1.2), 1.0)):
        new = torch.log(torch.tensor([[1.5, 0.5, 7.0]])).requires_grad_()
        cispo = PPOConfig(policy_loss="cispo", cispo_clip_low=low, cispo_clip_high=high)
        loss, stats = policy_loss(new, old, adv, mask, cispo)
        a = (1.0, -1.0, 2.0)
        assert float(loss.detach()) == pytest.approx(sum(-ai * w for ai, w in zip(a, weights)) / 3)
        assert float(stats["clipfrac"]) == pytest.approx(clipfrac)
        loss.backward()
        # d/dlogp_t of the token mean: -A_t * w_t / 3, never 0 where A_t is not
        assert new.grad.tolist() == [pytest.approx([-ai * w / 3 for ai, w in zip(a, weights)])]
    assert cispo_weight(torch.tensor([[-800.0, 800.0]]), 1.0, 4.0).tolist() == [[0.0, 5.0]]  # no overflow


def test_cispo_unclipped_gradient_is_ppos_unclipped_surrogate_gradient():
    """sg(r) * grad log pi = grad r: with no clip binding, CISPO's gradient is PPO's unclipped surrogate's,
    the importance-weighted policy gradient, on any aggregation and with importance weights."""
    g = torch.Generator().manual_seed(2)
    b, t = 5, 4
    mask = (torch.arange(t) < torch.tensor([4, 2, 1, 3, 0])[:, None]).double()
    old = -torch.rand(b, t, generator=g, dtype=torch.float64) * 2
    new = old + 0.3 * torch.randn(b, t, generator=g, dtype=torch.float64)
    adv = torch.randn(b, t, generator=g, dtype=torch.float64)
    weights = torch.rand(b, t, generator=g, dtype=torch.float64) * 2
    for aggregation in ("token_mean", "sequence_mean", "seq_mean_token_sum_norm"):
        grads = []
        for settings in (PPOConfig(policy_loss="cispo", cispo_clip_low=1.0, cispo_clip_high=4.0),
                         PPOConfig(clip_range=0.999, clip_range_high=1e6)):
            logprobs = new.clone().requires_grad_()
            loss, _ = policy_loss(logprobs, old, adv, mask, settings, aggregation, importance_weights=weights)
            loss.backward()
            grads.append(logprobs.grad)
        assert torch.allclose(grads[0], grads[1], rtol=1e-12, atol=1e-15), aggregation


def test_sapo_golden():
    """SAPO by hand: ratios (1, 2, 0.5), A = (1, 1, -1), tau_pos 1, tau_neg 1.05. f(r) = 4 / tau * sigmoid(tau
    * (r - 1)): f = (2, 4 sigmoid(1), 4 / 1.05 * sigmoid(-0.525)) = (2, 2.924234, 1.415938); terms -A f. The
    gradient in log pi is -A * 4 s (1 - s) * r, s = sigmoid(tau (r - 1)): 1 at r = 1 (the policy gradient),
    1.572895 at r = 2, 0.467070 at r = 0.5, over 3 tokens."""
    old = torch.zeros(1, 3)
    new = torch.log(torch.tensor([[1.0, 2.0, 0.5]], dtype=torch.float64)).requires_grad_()
    adv, mask = torch.tensor([[1.0, 1.0, -1.0]], dtype=torch.float64), torch.ones(1, 3, dtype=torch.float64)
    sapo = PPOConfig(policy_loss="sapo", sapo_tau_pos=1.0, sapo_tau_neg=1.05)
    loss, stats = policy_loss(new, old.double(), adv, mask, sapo)
    f_two, f_half = 2.9242343145200196, 1.4159383303033666  # 4 sigmoid(1), 4 / 1.05 sigmoid(-0.525)
    w_two, w_half = 1.5728954659318548, 0.4670699116426963  # 4 s (1 - s) r at r = 2 and 0.5
    assert float(loss.detach()) == pytest.approx((-2.0 - f_two + f_half) / 3, rel=1e-12)
    assert "clipfrac" not in stats  # no clip
    assert float(stats["gate_weight_mean"]) == pytest.approx((1.0 + w_two + w_half) / 3)
    loss.backward()
    assert new.grad.tolist() == [pytest.approx([-1 / 3, -w_two / 3, w_half / 3], rel=1e-12)]
    # the temperature follows the advantage's sign: tau_neg where A <= 0
    gate, _ = sapo_gate(torch.zeros(1, 2), torch.tensor([[1.0, -1.0]]), 2.0, 4.0)
    assert gate.tolist() == [pytest.approx([4 / 2 * 0.5, 4 / 4 * 0.5])]
    # far off-policy the gate is flat: a finite value, no gradient, never nan
    far = torch.tensor([[-900.0, 900.0]], requires_grad=True)
    loss, _ = policy_loss(far, torch.zeros(1, 2), torch.ones(1, 2), torch.ones(1, 2),
                          PPOConfig(policy_loss="sapo"))
    loss.backward()
    assert torch.isfinite(loss) and far.grad.tolist() == [[0.0, 0.0]]


def test_value_loss_golden():
    values = torch.tensor([[1.0, 0.0]])
    old_values = torch.tensor([[0.0, 0.0]])
    returns = torch.tensor([[0.0, 1.0]])
    loss, stats = value_loss(values, old_values, returns, torch.ones(1, 2), clip_range_value=0.2)
    # token 0: unclipped (1-0)^2=1, clipped (0.2-0)^2=0.04 -> 1; token 1: both (0-1)^2 = 1
    assert float(loss) == pytest.approx(0.5 * (1 + 1) / 2)
    assert float(stats["vf_clipfrac"]) == 0.0


def test_entropy_and_explained_variance():
    from services.logprobs import token_logprobs_and_entropy

    _, entropy = token_logprobs_and_entropy(torch.zeros(2, 3, 4), torch.zeros(2, 3, dtype=torch.long))
    assert torch.allclose(entropy, torch.full((2, 3), torch.log(torch.tensor(4.0))))
    returns = torch.tensor([[1.0, 2.0, 3.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    assert explained_variance(returns, returns, mask) == pytest.approx(1.0)
    assert explained_variance(torch.zeros_like(returns), returns, mask) == pytest.approx(0.0)


def test_shares_of_a_global_denominator_add_up_to_the_one_batch_mean():
    """W shards, each divided by (global count / W) and averaged over W as DeepSpeed does, give the mean
    of the whole batch: tokens (or rows) weigh the same whichever shard holds them."""
    from learner.ppo import loss_denominator

    g = torch.Generator().manual_seed(5)
    x = torch.randn(8, 6, generator=g, dtype=torch.float64)
    lengths = torch.tensor([6, 5, 6, 6, 1, 0, 2, 1])
    mask = (torch.arange(6) < lengths[:, None]).double()
    shards = [slice(0, 4), slice(4, 8)]
    for aggregation in ("token_mean", "sequence_mean"):
        whole = masked_mean(x, mask, aggregation)
        total = sum(loss_denominator(mask[s], aggregation) for s in shards)
        shares = [masked_mean(x[s], mask[s], aggregation, total / len(shards)) for s in shards]
        assert torch.allclose(sum(shares) / len(shards), whole, atol=1e-12), aggregation
        # the per-shard means the old code averaged differ when the shards' lengths differ
        naive = sum(masked_mean(x[s], mask[s], aggregation) for s in shards) / len(shards)
        assert not torch.allclose(naive, whole, atol=1e-6), aggregation


def test_global_whiten_without_a_group_is_masked_whiten_and_moments_add_over_shards():
    from learner.ppo import global_whiten, whiten_from_moments, whiten_moments

    g = torch.Generator().manual_seed(6)
    x = torch.randn(6, 5, generator=g)
    mask = (torch.arange(5) < torch.tensor([5, 3, 0, 1, 5, 2])[:, None]).float()
    assert torch.allclose(global_whiten(x, mask), masked_whiten(x, mask), atol=1e-5)
    moments = whiten_moments(x[:3], mask[:3]) + whiten_moments(x[3:], mask[3:])
    assert moments.dtype == torch.float64
    assert torch.allclose(torch.cat([whiten_from_moments(x[:3], mask[:3], moments),
                                     whiten_from_moments(x[3:], mask[3:], moments)]),
                          masked_whiten(x, mask), atol=1e-5)


@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.3])
@pytest.mark.parametrize("chunk_rows", [1, 5, 256])
def test_token_logprobs_and_entropy_match_a_full_log_softmax(temperature, chunk_rows):
    """The chunked logsumexp form gives log_softmax(logits / temperature) at the ids, and its gradient,
    within float32 tolerance; the entropy of softmax(logits / temperature) too, from the same pass. 3 x 7
    rows do not divide into chunks of 5: a partial last one."""
    from services.logprobs import token_logprobs, token_logprobs_and_entropy

    g = torch.Generator().manual_seed(3)
    logits = (torch.randn(3, 7, 50, generator=g) * 4).requires_grad_(True)
    ids = torch.randint(0, 50, (3, 7), generator=g)
    weights = torch.randn(3, 7, generator=g)
    full = torch.log_softmax(logits / temperature, dim=-1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    (full_grad,) = torch.autograd.grad((full * weights).sum(), logits)
    got = token_logprobs(logits, ids, temperature, chunk_rows=chunk_rows)
    (got_grad,) = torch.autograd.grad((got * weights).sum(), logits)
    assert got.dtype == torch.float32 and got.shape == (3, 7)
    torch.testing.assert_close(got, full, rtol=0, atol=1e-5)
    torch.testing.assert_close(got_grad, full_grad, rtol=1e-5, atol=1e-6)
    both, entropy = token_logprobs_and_entropy(logits, ids, temperature, chunk_rows=chunk_rows)
    torch.testing.assert_close(both, got, rtol=0, atol=0)
    log_p = torch.log_softmax(logits.detach().double() / temperature, dim=-1)
    assert not entropy.requires_grad
    torch.testing.assert_close(entropy.double(), -(log_p.exp() * log_p).sum(-1), rtol=0, atol=1e-5)


def test_token_logprobs_of_bfloat16_logits_run_in_float32_and_take_an_empty_batch():
    """bf16 logits, as a bf16 policy's LM head gives them: the log-probs in float32 (at a temperature too),
    and the gradient, in the logits' dtype, the float64 reference's within one bf16 rounding."""
    from services.logprobs import token_logprobs, token_logprobs_and_entropy

    g = torch.Generator().manual_seed(4)
    logits = (torch.randn(2, 4, 1000, generator=g) * 3).to(torch.bfloat16).requires_grad_(True)
    ids = torch.randint(0, 1000, (2, 4), generator=g)
    weights = torch.randn(2, 4, generator=g)
    for temperature in (1.0, 0.7):
        exact = logits.detach().double().requires_grad_(True)
        reference = torch.log_softmax(exact / temperature, -1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
        (want,) = torch.autograd.grad((reference * weights).sum(), exact)
        got = token_logprobs(logits, ids, temperature, chunk_rows=3)
        (grad,) = torch.autograd.grad((got * weights).sum(), logits)
        assert got.dtype == torch.float32 and grad.dtype == torch.bfloat16
        assert float((got.double() - reference.detach()).abs().max()) < 1e-5
        # within one bf16 rounding of the exact gradient
        torch.testing.assert_close(grad.double(), want, rtol=2**-7, atol=1e-6)
    assert token_logprobs(torch.zeros(0, 4, 10), torch.zeros(0, 4, dtype=torch.long)).shape == (0, 4)
    _, entropy = token_logprobs_and_entropy(torch.zeros(2, 0, 10), torch.zeros(2, 0, dtype=torch.long))
    assert entropy.shape == (2, 0)
