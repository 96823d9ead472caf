"""The rollout correction (ppo.correction, ppo.correction_level, ppo.is_cap): weights pi_old / pi_behav between
the learner's policy at the start of the update and the engine that sampled, truncated (tis) or masked (mis);
exact by enumeration, small enough in fp32 to leave the default job as it was, and its config checks."""

from __future__ import annotations

import math

import pytest
import torch

from learner.ppo import importance_log_weights, policy_loss, rollout_correction_weights

E = math.e


def test_token_and_sequence_weights_by_hand():
    """Row 0: log(pi_old / pi_behav) = (0, 1, -0.5) and padding; row 1: (0.3, 0.4) and padding. cap 2."""
    old = torch.tensor([[-1.0, -1.0, -1.0, -1.0], [-0.2, -0.1, 0.0, 0.0]])
    behaviour = torch.tensor([[-1.0, -2.0, -0.5, -9.0], [-0.5, -0.5, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]])
    w, stats = rollout_correction_weights(old, behaviour, mask, "tis", "token", 2.0)
    assert w.tolist() == [pytest.approx([1.0, 2.0, E**-0.5, 1.0]), pytest.approx([E**0.3, E**0.4, 1.0, 1.0])]
    assert float(stats["is_capped_fraction"]) == pytest.approx(1 / 5)  # e > 2: the one token cut
    assert float(stats["is_weight_mean"]) == pytest.approx((1 + 2 + E**-0.5 + E**0.3 + E**0.4) / 5)
    w, stats = rollout_correction_weights(old, behaviour, mask, "mis", "token", 2.0)
    assert w.tolist() == [pytest.approx([1.0, 0.0, E**-0.5, 1.0]), pytest.approx([E**0.3, E**0.4, 1.0, 1.0])]
    assert float(stats["is_capped_fraction"]) == pytest.approx(1 / 5)
    # sequence: row 0's likelihood ratio e^0.5 = 1.65 and row 1's e^0.7 = 2.01 on each of their tokens
    w, stats = rollout_correction_weights(old, behaviour, mask, "tis", "sequence", 2.0)
    assert w.tolist() == [pytest.approx([E**0.5] * 3 + [1.0]), pytest.approx([2.0, 2.0, 1.0, 1.0])]
    assert float(stats["is_capped_fraction"]) == pytest.approx(2 / 5)
    w, _ = rollout_correction_weights(old, behaviour, mask, "mis", "sequence", 2.0)
    assert w.tolist() == [pytest.approx([E**0.5] * 3 + [1.0]), pytest.approx([0.0, 0.0, 1.0, 1.0])]
    assert rollout_correction_weights(old, behaviour, mask, "none", "token", 2.0) == (None, {})
    # a long row's ratio is taken in log space: e^1000 never overflows to inf (or to nan under mis)
    w, _ = rollout_correction_weights(torch.zeros(1, 2), torch.full((1, 2), -500.0), torch.ones(1, 2), "mis",
                                      "sequence", 2.0)
    assert w.tolist() == [[0.0, 0.0]]
    with pytest.raises(ValueError, match="correction level"):
        importance_log_weights(old, behaviour, mask, "row")
    with pytest.raises(ValueError, match="rollout correction"):
        rollout_correction_weights(old, behaviour, mask, "clip", "token", 2.0)


# ---------------------------------------------------------------- exact enumeration on a tiny language
# vocab {0, 1, EOS=2}, at most 2 tokens: the first token, then (unless it was EOS) a second. 7 responses.
EOS = 2
RESPONSES = [(EOS,)] + [(a, b) for a in (0, 1) for b in (0, 1, EOS)]


def tabular_logprobs(first: torch.Tensor, second: torch.Tensor,
                     responses=RESPONSES) -> tuple[torch.Tensor, torch.Tensor]:
    """([N, 2] token log-probs of each response under the tabular policy: ``first`` [3] logits of token 0,
    ``second`` [2, 3] logits of token 1 after token 0 = 0 or 1; [N, 2] mask)."""
    lp1, lp2 = torch.log_softmax(first, -1), torch.log_softmax(second, -1)
    rows, masks = [], []
    for y in responses:
        row = [lp1[y[0]]] + ([lp2[y[0], y[1]]] if len(y) > 1 else [torch.zeros((), dtype=first.dtype)])
        rows.append(torch.stack(row))
        masks.append([1.0, float(len(y) > 1)])
    return torch.stack(rows), torch.tensor(masks, dtype=first.dtype)


def policies(seed: int, gap: float, move: float):
    """(theta, old, behaviour): tabular logits; the engine's differ from pi_old by ``gap``, the current policy
    has moved ``move`` from it."""
    g = torch.Generator().manual_seed(seed)
    old = (torch.randn(3, generator=g, dtype=torch.float64), torch.randn(2, 3, generator=g, dtype=torch.float64))
    behaviour = tuple(x + gap * torch.randn(x.shape, generator=g, dtype=torch.float64) for x in old)
    theta = tuple((x + move * torch.randn(x.shape, generator=g, dtype=torch.float64)).requires_grad_() for x in old)
    return theta, old, behaviour


def expected_gradient(theta, sampler_logits, old_logits, advantages, ratio_level, clip, correction=None,
                      level="token", behaviour_logits=None, responses=RESPONSES):
    """d/dtheta of sum_y p_sampler(y) * loss(y): the exact expectation of one response's loss (``policy_loss`` of
    that row alone, sequence mean over one row) under the sampler, with the rollout correction's weights of
    ``correction`` (pi_old against ``behaviour_logits``) when given."""
    logprobs, mask = tabular_logprobs(*theta, responses)
    old, _ = tabular_logprobs(*old_logits, responses)
    sampler, _ = tabular_logprobs(*sampler_logits, responses)
    p_sampler = (sampler * mask).sum(-1).exp()
    assert float(p_sampler.sum()) == pytest.approx(1.0, abs=1e-12)  # every response enumerated
    weights = None
    if correction is not None:
        behaviour, _ = tabular_logprobs(*behaviour_logits, responses)
        weights, stats = rollout_correction_weights(old, behaviour, mask, correction, level, cap=1e6)
        assert float(stats["is_capped_fraction"]) == 0  # every weight under the cap
    total = 0.0
    for i in range(len(responses)):
        row = slice(i, i + 1)
        loss, _ = policy_loss(logprobs[row], old[row], advantages[row], mask[row], clip[0], "sequence_mean", 1.0,
                              None if weights is None else weights[row], clip_range_high=clip[1],
                              ratio_level=ratio_level)
        total = total + p_sampler[i].detach() * loss
    grads = torch.autograd.grad(total, theta, allow_unused=True)  # one-token responses leave ``second`` unused
    return torch.cat([(torch.zeros_like(x) if d is None else d).reshape(-1) for x, d in zip(theta, grads)])


@pytest.mark.parametrize("ratio_level, clip, move", [("token", (0.2, 0.28), 0.3), ("sequence", (3e-4, 4e-4), 1e-3),
                                                     ("sequence_token", (3e-4, 4e-4), 1e-3)])
@pytest.mark.parametrize("correction", ["tis", "mis"])
def test_sequence_correction_gives_the_learner_policys_gradient_when_the_engine_differs(ratio_level, clip, move,
                                                                                        correction):
    """PPO, GSPO and GSPO-token, sampled by an engine whose logits differ from pi_old's by 0.5: with the sequence
    weight pi_old(y) / pi_behav(y) under its bound, the expected gradient under the engine is exactly the one
    under pi_old (the learner's policy: pi_prox in async mode); without it, it is not."""
    theta, old, behaviour = policies(seed=7, gap=0.5, move=move)
    g = torch.Generator().manual_seed(11)
    advantages = torch.randn(len(RESPONSES), 1, generator=g, dtype=torch.float64).expand(-1, 2)
    if ratio_level == "token":  # PPO's advantages may vary along a response
        advantages = advantages + torch.randn(len(RESPONSES), 2, generator=g, dtype=torch.float64)
    learner = expected_gradient(theta, old, old, advantages, ratio_level, clip)
    corrected = expected_gradient(theta, behaviour, old, advantages, ratio_level, clip, correction, "sequence",
                                  behaviour)
    uncorrected = expected_gradient(theta, behaviour, old, advantages, ratio_level, clip)
    assert learner.abs().max() > 1e-3
    assert torch.allclose(corrected, learner, rtol=1e-10, atol=1e-14)
    assert (uncorrected - learner).norm() / learner.norm() > 0.05


def test_token_correction_is_exact_for_one_token_and_approximate_over_a_response():
    """Token weights pi_old_t / pi_behav_t correct each token given its prefix: exact for one-token responses;
    over longer ones the prefix's own mismatch (and the suffix's, through the advantage) is dropped, the
    approximation TRL's token_truncate and verl's rollout_is=token make. Measured here, at a logit gap of 0.5."""
    theta, old, behaviour = policies(seed=3, gap=0.5, move=0.3)
    g = torch.Generator().manual_seed(4)
    one_token = [(EOS,), (0,), (1,)]  # the second position is padding
    advantages = torch.randn(3, 2, generator=g, dtype=torch.float64)
    learner = expected_gradient(theta, old, old, advantages, "token", (0.2, 0.2), responses=one_token)
    corrected = expected_gradient(theta, behaviour, old, advantages, "token", (0.2, 0.2), "tis", "token", behaviour,
                                  responses=one_token)
    assert torch.allclose(corrected, learner, rtol=1e-10, atol=1e-14)
    advantages = torch.randn(len(RESPONSES), 2, generator=g, dtype=torch.float64)
    learner = expected_gradient(theta, old, old, advantages, "token", (0.2, 0.2))
    corrected = expected_gradient(theta, behaviour, old, advantages, "token", (0.2, 0.2), "tis", "token", behaviour)
    uncorrected = expected_gradient(theta, behaviour, old, advantages, "token", (0.2, 0.2))
    token_error = float((corrected - learner).norm() / learner.norm())
    assert 1e-3 < token_error < float((uncorrected - learner).norm() / learner.norm())


def test_the_default_correction_changes_an_fp32_update_by_less_than_1e_4():
    """The default job (sync, tis, token, cap 2) in fp32 on CPU: engine and learner log-probs differ by a mean
    of 2.7e-7 and at most 1.1e-5 per sampled token (rollout_learner_logprob_mismatch(_max) of randomwalks runs).
    With such differences each weight is within 1.2e-5 of 1, none is cut, and the policy loss and its gradient
    move by less than 1e-4 relative: the default job trains as it did before the correction."""
    g = torch.Generator().manual_seed(0)
    b, t = 128, 10
    mask = (torch.arange(t) < torch.randint(1, t + 1, (b, 1), generator=g)).float()
    old = torch.log_softmax(torch.randn(b, t, 8, generator=g), -1)[..., 0] * mask
    noise = torch.randn(b, t, generator=g) * 3.4e-7  # mean |noise| 2.7e-7
    noise[torch.rand(b, t, generator=g) < 0.01] = 1.1e-5
    behaviour = (old + noise) * mask
    new = old + torch.randn(b, t, generator=g) * 0.1  # a few epochs in: some ratios clipped
    advantages = torch.randn(b, t, generator=g) * mask

    def loss_and_grad(weights):
        logprobs = new.clone().requires_grad_()
        loss, _ = policy_loss(logprobs, old, advantages, mask, importance_weights=weights)
        loss.backward()
        return loss.detach(), logprobs.grad

    weights, stats = rollout_correction_weights(old, behaviour, mask, "tis", "token", 2.0)
    assert float(stats["is_capped_fraction"]) == 0
    assert float((weights - 1).abs().max()) < 1.2e-5
    (corrected, corrected_grad), (plain, plain_grad) = loss_and_grad(weights), loss_and_grad(None)
    assert abs(float(corrected - plain)) / abs(float(plain)) < 1e-4
    assert float((corrected_grad - plain_grad).norm() / plain_grad.norm()) < 1e-4


def test_rank_sums_the_mismatch_k3_on_fresh_rows_and_counts_cut_tokens():
    """``LearnerRank._correction_sums`` by hand: r = log pi_behav - log pi_old = (0.1, -0.2) on a row of the
    learner's version and 2.0 on a stale one: the k3 sum e^-r - 1 + r takes the fresh row only. Tokens cut: those
    whose weight pi_old / pi_behav = e^-r (sequence level: the row's product) exceeds ppo.is_cap."""
    from learner.rank import LearnerRank
    from services.config import PPOConfig

    old = torch.tensor([[-1.0, -1.0], [-1.0, 0.0]])
    behaviour = torch.tensor([[-0.9, -1.2], [1.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    stale = torch.tensor([[0.0, 0.0], [1.0, 1.0]])
    rank = LearnerRank(0, 1)
    rank.ppo = PPOConfig(is_cap=1.5)
    sums = rank._correction_sums(old, behaviour, mask, stale)
    k3 = (math.exp(-0.1) - 1 + 0.1) + (math.exp(0.2) - 1 - 0.2)
    assert sums["correction_mismatch_k3_sum"] == pytest.approx(k3, rel=1e-6)
    # weights pi_old / pi_behav: e^-0.1, e^0.2, e^-2: none above 1.5
    assert sums["correction_truncated_tokens"] == 0 and sums["correction_masked_tokens"] == 0
    rank.ppo = PPOConfig(is_cap=1.1, correction="mis", correction_level="sequence")
    # rows' likelihood ratios: e^(-0.1 + 0.2) = 1.105 > 1.1 on both tokens of row 0; e^-2 on row 1
    sums = rank._correction_sums(old, behaviour, mask, stale)
    assert (sums["correction_truncated_tokens"], sums["correction_masked_tokens"]) == (0.0, 2.0)


@pytest.mark.parametrize("ppo, match", [
    ({"is_cap": 1.0}, "is_cap=1.0 must be > 1 with ppo.correction='tis'"),
    ({"correction": "mis", "is_cap": 0.8}, "is_cap=0.8 must be > 1 with ppo.correction='mis'"),
    ({"correction": "none", "correction_level": "sequence"}, "ppo.correction='none' ignores them"),
    ({"correction": "none", "is_cap": 3.0}, "ppo.correction='none' ignores them"),
    ({"policy_loss": "gspo", "advantage": "grpo"}, "correction_level='sequence'"),
    ({"policy_loss": "gspo"}, "gspo_token"),  # gae's per-token advantages
    ({"policy_loss": "gspo_token", "clip_range_high": 0.28}, "clip_range_high is set but"),
    ({"gspo_clip_high": 1e-3}, "gspo_clip_high=0.001 is set but ppo.policy_loss='ppo' ignores it"),
    ({"clip_range_low": 1.0}, "clip_range_low=1.0 puts the ratio's floor"),
    ({"clip_range": 1.2, "clip_range_high": 0.3}, "clip_range=1.2 puts the ratio's floor"),
    ({"policy_loss": "gspo_token", "gspo_clip_low": 1.5}, "gspo_clip_low=1.5 puts the ratio's floor"),
])
def test_settings_that_make_no_sense_are_refused(ppo, match):
    from pydantic import ValidationError

    from services.config import PPOConfig

    with pytest.raises(ValidationError, match=match.replace("(", r"\(").replace(")", r"\)")):
        PPOConfig(**ppo)


def test_async_without_a_correction_is_refused_and_the_defaults_correct_in_both_modes():
    from pydantic import ValidationError

    from services.config import PPOConfig, load_config

    with pytest.raises(ValidationError, match="async mode needs the weight pi_prox / pi_behav"):
        load_config(None, {"rollout": {"mode": "async"}, "ppo": {"correction": "none"}})
    default = PPOConfig()
    assert (default.correction, default.correction_level, default.is_cap) == ("tis", "token", 2.0)
    assert default.ratio_clip_range() == (0.2, 0.2)
    assert PPOConfig(clip_range_high=0.28).ratio_clip_range() == (0.2, 0.28)
    gspo = PPOConfig(policy_loss="gspo", advantage="rloo", correction_level="sequence")
    assert gspo.ratio_clip_range() == (3e-4, 4e-4)
    assert load_config(None, {"ppo": {"correction": "none"}}).ppo.correction == "none"  # sync may turn it off
