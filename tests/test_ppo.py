"""Unit tests of learner/ppo.py against hand-computed values and naive loops."""

import pytest
import torch

from learner.ppo import (
    entropy_from_logits,
    explained_variance,
    gae_advantages,
    masked_mean,
    masked_whiten,
    policy_loss,
    value_loss,
)


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
    loss, stats = policy_loss(new, old, adv, mask, clip_range=0.2)
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


def test_value_loss_golden():
    values = torch.tensor([[1.0, 0.0]])
    old_values = torch.tensor([[0.0, 0.0]])
    returns = torch.tensor([[0.0, 1.0]])
    loss, stats = value_loss(values, old_values, returns, torch.ones(1, 2), clip_range_value=0.2)
    # token 0: unclipped (1-0)^2=1, clipped (0.2-0)^2=0.04 -> 1; token 1: both (0-1)^2 = 1
    assert float(loss) == pytest.approx(0.5 * (1 + 1) / 2)
    assert float(stats["vf_clipfrac"]) == 0.0


def test_entropy_and_explained_variance():
    logits = torch.zeros(2, 3, 4)
    assert torch.allclose(entropy_from_logits(logits), torch.full((2, 3), torch.log(torch.tensor(4.0))))
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
    within float32 tolerance; entropy too. 3 x 7 rows do not divide into chunks of 5: a partial last one."""
    from services.logprobs import token_logprobs

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
    log_p = torch.log_softmax(logits.detach().double(), dim=-1)
    entropy = -(log_p.exp() * log_p).sum(-1)
    torch.testing.assert_close(entropy_from_logits(logits.detach(), chunk_rows=chunk_rows).double(), entropy,
                               rtol=0, atol=1e-5)


def test_token_logprobs_of_bfloat16_logits_run_in_float32_and_take_an_empty_batch():
    from services.logprobs import token_logprobs

    g = torch.Generator().manual_seed(4)
    logits = torch.randn(2, 4, 1000, generator=g).to(torch.bfloat16)
    ids = torch.randint(0, 1000, (2, 4), generator=g)
    reference = torch.log_softmax(logits.double(), -1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    got = token_logprobs(logits, ids, chunk_rows=3)
    assert got.dtype == torch.float32
    assert float((got.double() - reference).abs().max()) < 1e-5
    assert token_logprobs(torch.zeros(0, 4, 10), torch.zeros(0, 4, dtype=torch.long)).shape == (0, 4)
    assert entropy_from_logits(torch.zeros(2, 0, 10)).shape == (2, 0)
