"""The rollout correction (ppo.correction, ppo.correction_level, ppo.is_cap): weights pi_old / pi_behav
between the learner's policy at the start of the update and the engine that sampled, truncated (tis) or masked
(mis); exact by enumeration, small enough in fp32 to leave the default job as it was, and its config
checks."""

from __future__ import annotations

import math

import pytest
import torch

from learner.correction import (
    icepop_outside_band,
    importance_log_weights,
    off_policy_sequence_masked,
    rollout_correction_weights,
)
from learner.policy_losses import POLICY_LOSSES, policy_loss
from services.config import PPOConfig

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
    with pytest.raises(ValueError, match="ppo.correction='clip' is not a registered rollout correction"):
        rollout_correction_weights(old, behaviour, mask, "clip", "token", 2.0)


def test_icepop_keeps_the_ratio_inside_its_band_and_masks_both_sides_by_hand():
    """IcePop: per token k = pi_old / pi_behav, band [0.5, 5]. Row 0: log k = (0, 1, -0.5, -1): k = (1, e,
    e^-0.5, e^-1 = 0.368 < 0.5: masked). Row 1: log k = (2, 0.3): e^2 = 7.39 > 5, masked; e^0.3 kept. Row 2:
    padding only."""
    old = torch.tensor([[-1.0, -1.0, -1.0, -1.0], [-0.5, -0.2, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    behaviour = torch.tensor([[-1.0, -2.0, -0.5, 0.0], [-2.5, -0.5, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    w, stats = rollout_correction_weights(old, behaviour, mask, "icepop", "token", band=(0.5, 5.0))
    assert w.tolist() == [pytest.approx([1.0, E, E**-0.5, 0.0]), pytest.approx([0.0, E**0.3, 1.0, 1.0]),
                          [1.0] * 4]
    assert float(stats["masked_token_fraction"]) == pytest.approx(2 / 6)
    assert float(stats["masked_sequence_fraction"]) == pytest.approx(2 / 2)  # both rows with a token lost one
    assert float(stats["is_weight_mean"]) == pytest.approx((1 + E + E**-0.5 + E**0.3) / 6)
    assert "is_capped_fraction" not in stats  # no cap
    log_k = importance_log_weights(old, behaviour, mask)
    assert icepop_outside_band(log_k, mask, 0.5, 5.0).tolist() == [[False, False, False, True],
                                                                   [True, False, False, False], [False] * 4]
    # a ratio of e^-800 or e^800 is compared in log space: masked, never nan
    w, _ = rollout_correction_weights(torch.tensor([[0.0, 0.0]]), torch.tensor([[800.0, -800.0]]),
                                      torch.ones(1, 2), "icepop", band=(0.5, 5.0))
    assert w.tolist() == [[0.0, 0.0]]
    with pytest.raises(ValueError, match="one by one"):
        rollout_correction_weights(old, behaviour, mask, "icepop", "sequence", band=(0.5, 5.0))


def test_geometric_mask_drops_whole_rows_by_their_mean_log_ratio_by_hand():
    """Band [0.999, 1.001] on exp(mean_t log k_t): row 0 log k = (0.001, -0.0005), mean 0.00025: kept
    (1.00025); row 1 (0.003, 0), mean 0.0015: 1.0015 > 1.001, masked whole, though its second token's k is 1;
    row 2 (-0.004, 0.001, 0.001), mean -0.000667: kept (0.99933), though its first token's k is 0.996 (a token
    band would cut it). The kept tokens keep TIS's weight min(k, cap); the sequence level puts the row's
    likelihood ratio there."""
    old = torch.tensor([[0.001, -0.0005, 0.0], [0.003, 0.0, 0.0], [-0.004, 0.001, 0.001]],
                       dtype=torch.float64)
    behaviour = torch.zeros(3, 3, dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0], [1.0, 1.0, 1.0]], dtype=torch.float64)
    band = (0.999, 1.001)
    w, stats = rollout_correction_weights(old, behaviour, mask, "geometric_mask", "token", 2.0, band=band)
    assert w.tolist() == [pytest.approx([math.exp(0.001), math.exp(-0.0005), 1.0]), [0.0, 0.0, 1.0],
                          pytest.approx([math.exp(-0.004), math.exp(0.001), math.exp(0.001)])]
    assert float(stats["masked_token_fraction"]) == pytest.approx(2 / 7)
    assert float(stats["masked_sequence_fraction"]) == pytest.approx(1 / 3)
    assert float(stats["is_capped_fraction"]) == 0.0
    w, _ = rollout_correction_weights(old, behaviour, mask, "geometric_mask", "sequence", 2.0, band=band)
    assert w.tolist() == [pytest.approx([math.exp(0.0005)] * 2 + [1.0]), [0.0, 0.0, 1.0],
                          pytest.approx([math.exp(-0.002)] * 3)]


def test_off_policy_sequence_mask_drops_the_negative_rows_that_diverge_by_hand():
    """DeepSeek-V3.2's mask, delta 1e-4: D_b = mean_t (log pi_behav - log pi). Row 0: D = (0.3 + 0.1) / 2 =
    0.2 > delta, A = (-1, 0.5): the row's advantage (its first token's) is negative, the whole row masked,
    its positive token too (the paper masks sequences). Row 1: D = -0.1 (the learner's policy
    favours the row more than the sampler did): nothing masked, A < 0 or not. Row 2: D = 0.2 but A > 0: kept.
    The kept tokens keep TIS's weight (here pi_old = pi_behav: 1)."""
    behaviour = torch.tensor([[-1.0, -1.0], [-1.0, -1.0], [-1.0, -1.0]])
    logprobs = torch.tensor([[-1.3, -1.1], [-0.9, -0.9], [-1.2, -1.2]])
    advantages = torch.tensor([[-1.0, 0.5], [-1.0, -2.0], [1.0, 0.1]])
    mask = torch.ones(3, 2)
    masked = off_policy_sequence_masked(logprobs, behaviour, advantages, mask, 1e-4)
    assert masked.tolist() == [[True, True], [False, False], [False, False]]
    w, stats = rollout_correction_weights(behaviour, behaviour, mask, "off_policy_mask", "token", 2.0,
                                          delta=1e-4, logprobs=logprobs, advantages=advantages)
    assert w.tolist() == [[0.0, 0.0], [1.0, 1.0], [1.0, 1.0]]
    assert float(stats["masked_token_fraction"]) == pytest.approx(2 / 6)
    assert float(stats["masked_sequence_fraction"]) == pytest.approx(1 / 3)
    # a threshold above row 0's divergence keeps it; the logprobs' gradient never flows through the mask
    assert not off_policy_sequence_masked(logprobs, behaviour, advantages, mask, 0.25).any()
    with pytest.raises(ValueError, match="off_policy_mask needs"):
        rollout_correction_weights(behaviour, behaviour, mask, "off_policy_mask", delta=1e-4)


def test_the_layer_counts_mask_fractions_of_sequences_by_episodes():
    """``Algorithm.loss`` returns the masks' sequence fraction with the micro-batch's episodes as its count
    (the token statistics with its tokens), so the rank's sums over counts give the fraction of the update's
    episodes."""
    from learner.algorithm import Algorithm
    from services.config import load_config
    from services.experience import FINISH_STOP, make_batch

    batch = make_batch([[1]] * 3, [[3, 3], [3], [3, 3]], [[-1.0, -1.0], [-1.0], [-1.0, -1.0]],
                       [FINISH_STOP] * 3, [0, 1, 2], 0, 0, 0.1, response_width=2)
    batch.old_logprobs = torch.tensor([[-1.0, -1.0], [-1.0, 0.0], [-1.0, -1.0]])
    batch.ref_logprobs = batch.old_logprobs.clone()
    batch.old_values = torch.zeros(3, 2)
    batch.scores = torch.tensor([1.0, 0.0, -1.0])
    algorithm = Algorithm.from_config(load_config(None, {"ppo": {"correction": "off_policy_mask"}}))
    algorithm.prepare(batch, 0.1)
    batch.advantages = torch.tensor([[-1.0, -1.0], [1.0, 0.0], [1.0, 1.0]])
    current = torch.tensor([[-1.5, -1.5], [-1.0, 0.0], [-1.0, -1.0]], requires_grad=True)  # row 0 moved away
    counts = algorithm.loss_counts(batch)
    _, stats = algorithm.loss(batch, (current, torch.zeros(3, 2), torch.zeros(3, 2)), counts, 0.1)
    fraction, episodes = stats["masked_sequence_fraction"]
    assert float(fraction) == pytest.approx(1 / 3) and float(episodes) == 3
    fraction, tokens = stats["masked_token_fraction"]
    assert float(fraction) == pytest.approx(2 / 5) and float(tokens) == 5


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
    old = (torch.randn(3, generator=g, dtype=torch.float64),
           torch.randn(2, 3, generator=g, dtype=torch.float64))
    behaviour = tuple(x + gap * torch.randn(x.shape, generator=g, dtype=torch.float64) for x in old)
    theta = tuple((x + move * torch.randn(x.shape, generator=g, dtype=torch.float64)).requires_grad_()
                  for x in old)
    return theta, old, behaviour


def loss_settings(loss: str, clip: tuple[float, float]) -> PPOConfig:
    """The settings of policy loss ``loss`` (ppo, gspo or gspo_token) with its clip epsilons (low, high)."""
    if loss == "ppo":
        return PPOConfig(clip_range=clip[0], clip_range_high=clip[1])
    return PPOConfig(policy_loss=loss, gspo_clip_low=clip[0], gspo_clip_high=clip[1])


def expected_gradient(theta, sampler_logits, old_logits, advantages, loss_name, clip, correction=None,
                      level="token", behaviour_logits=None, responses=RESPONSES):
    """d/dtheta of sum_y p_sampler(y) * loss(y): the exact expectation of one response's loss (``policy_loss``
    ``loss_name`` with ``clip``, of that row alone, sequence mean over one row) under the sampler, with the
    rollout correction's weights of ``correction`` (pi_old against ``behaviour_logits``) when given."""
    settings = loss_settings(loss_name, clip)
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
        loss, _ = policy_loss(logprobs[row], old[row], advantages[row], mask[row], settings, "sequence_mean",
                              1.0, None if weights is None else weights[row])
        total = total + p_sampler[i].detach() * loss
    # one-token responses leave ``second`` unused
    grads = torch.autograd.grad(total, theta, allow_unused=True)
    return torch.cat([(torch.zeros_like(x) if d is None else d).reshape(-1) for x, d in zip(theta, grads)])


@pytest.mark.parametrize("loss_name, clip, move", [("ppo", (0.2, 0.28), 0.3),
                                                   ("gspo", (3e-4, 4e-4), 1e-3),
                                                   ("gspo_token", (3e-4, 4e-4), 1e-3)])
@pytest.mark.parametrize("correction", ["tis", "mis"])
def test_sequence_correction_gives_the_learner_policys_gradient_when_the_engine_differs(loss_name, clip,
                                                                                        move, correction):
    """PPO, GSPO and GSPO-token, sampled by an engine whose logits differ from pi_old's by 0.5: with the
    sequence weight pi_old(y) / pi_behav(y) under its bound, the expected gradient under the engine is exactly
    the one under pi_old (the learner's policy: pi_prox in async mode); without it, it is not."""
    theta, old, behaviour = policies(seed=7, gap=0.5, move=move)
    g = torch.Generator().manual_seed(11)
    advantages = torch.randn(len(RESPONSES), 1, generator=g, dtype=torch.float64).expand(-1, 2)
    if loss_name == "ppo":  # PPO's advantages may vary along a response
        advantages = advantages + torch.randn(len(RESPONSES), 2, generator=g, dtype=torch.float64)
    learner = expected_gradient(theta, old, old, advantages, loss_name, clip)
    corrected = expected_gradient(theta, behaviour, old, advantages, loss_name, clip, correction,
                                  "sequence", behaviour)
    uncorrected = expected_gradient(theta, behaviour, old, advantages, loss_name, clip)
    assert learner.abs().max() > 1e-3
    assert torch.allclose(corrected, learner, rtol=1e-10, atol=1e-14)
    assert (uncorrected - learner).norm() / learner.norm() > 0.05


def test_token_correction_is_exact_for_one_token_and_approximate_over_a_response():
    """Token weights pi_old_t / pi_behav_t correct each token given its prefix: exact for one-token responses;
    over longer ones the prefix's own mismatch (and the suffix's, through the advantage) is dropped, the
    approximation TRL's token_truncate and verl's rollout_is=token make. Measured here, at a logit gap of
    0.5."""
    theta, old, behaviour = policies(seed=3, gap=0.5, move=0.3)
    g = torch.Generator().manual_seed(4)
    one_token = [(EOS,), (0,), (1,)]  # the second position is padding
    advantages = torch.randn(3, 2, generator=g, dtype=torch.float64)
    learner = expected_gradient(theta, old, old, advantages, "ppo", (0.2, 0.2), responses=one_token)
    corrected = expected_gradient(theta, behaviour, old, advantages, "ppo", (0.2, 0.2), "tis", "token",
                                  behaviour, responses=one_token)
    assert torch.allclose(corrected, learner, rtol=1e-10, atol=1e-14)
    advantages = torch.randn(len(RESPONSES), 2, generator=g, dtype=torch.float64)
    learner = expected_gradient(theta, old, old, advantages, "ppo", (0.2, 0.2))
    corrected = expected_gradient(theta, behaviour, old, advantages, "ppo", (0.2, 0.2), "tis", "token",
                                  behaviour)
    uncorrected = expected_gradient(theta, behaviour, old, advantages, "ppo", (0.2, 0.2))
    token_error = float((corrected - learner).norm() / learner.norm())
    assert 1e-3 < token_error < float((uncorrected - learner).norm() / learner.norm())


def test_the_default_correction_changes_an_fp32_update_by_less_than_1e_4():
    """The default job (sync, tis, token, cap 2) in fp32 on CPU: engine and learner log-probs differ by a mean
    of 2.7e-7 and at most 1.1e-5 per sampled token (rollout_learner_logprob_mismatch(_max) of randomwalks
    runs). With such differences each weight is within 1.2e-5 of 1, none is cut, and the policy loss and its
    gradient move by less than 1e-4 relative: the default job trains as it did before the correction."""
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
    """``Algorithm.correction_sums`` (what a rank reports of its batch) by hand:
    r = log pi_behav - log pi_old = (0.1, -0.2) on a row of the learner's version and 2.0 on a stale one: the
    k3 sum e^-r - 1 + r takes the fresh row only. Tokens cut: those whose weight pi_old / pi_behav = e^-r
    (sequence level: the row's product) exceeds ppo.is_cap, and those a mask sets to 0 (IcePop's band, the
    geometric mean's band)."""
    from learner.algorithm import Algorithm
    from services.config import load_config
    from services.experience import FINISH_STOP, make_batch

    batch = make_batch([[5], [5]], [[1, 1], [1]], [[-0.9, -1.2], [1.0]], [FINISH_STOP, FINISH_STOP], [0, 1],
                       0, 0, 0.0, 2)
    batch.old_logprobs = torch.tensor([[-1.0, -1.0], [-1.0, 0.0]])
    batch.advantages = torch.tensor([[1.0, 1.0], [-1.0, 0.0]])
    stale = torch.tensor([[0.0, 0.0], [1.0, 1.0]])

    def sums(**ppo):
        return Algorithm.from_config(load_config(None, {"ppo": ppo})).correction_sums(batch, stale)

    found = sums(is_cap=1.5)
    k3 = (math.exp(-0.1) - 1 + 0.1) + (math.exp(0.2) - 1 - 0.2)
    assert found["correction_mismatch_k3_sum"] == pytest.approx(k3, rel=1e-6)
    # weights pi_old / pi_behav: e^-0.1, e^0.2, e^-2: none above 1.5
    assert found["correction_truncated_tokens"] == 0 and found["correction_masked_tokens"] == 0
    # rows' likelihood ratios: e^(-0.1 + 0.2) = 1.105 > 1.1 on both tokens of row 0; e^-2 on row 1
    found = sums(is_cap=1.1, correction="mis", correction_level="sequence")
    assert (found["correction_truncated_tokens"], found["correction_masked_tokens"]) == (0.0, 2.0)
    # IcePop's default band [0.5, 5]: e^-2 = 0.135 is outside, the others inside
    found = sums(correction="icepop")
    assert (found["correction_truncated_tokens"], found["correction_masked_tokens"]) == (0.0, 1.0)
    # the geometric mean of row 0, e^0.05, is inside [0.9, 1.1]; row 1's e^-2 is not
    found = sums(correction="geometric_mask", geometric_mask_low=0.9, geometric_mask_high=1.1, is_cap=1.1)
    assert (found["correction_truncated_tokens"], found["correction_masked_tokens"]) == (1.0, 1.0)


@pytest.mark.parametrize("ppo, match", [
    ({"is_cap": 1.0}, "is_cap=1.0 must be > 1 with ppo.correction='tis'"),
    ({"correction": "mis", "is_cap": 0.8}, "is_cap=0.8 must be > 1 with ppo.correction='mis'"),
    ({"correction": "none", "correction_level": "sequence"},
     "ppo.correction_level='sequence' is set but ppo.correction='none' ignores it"),
    ({"correction": "none", "is_cap": 3.0}, "ppo.is_cap=3.0 is set but ppo.correction='none' ignores it"),
    ({"policy_loss": "gspo", "advantage": "grpo"}, "correction_level='sequence'"),
    ({"policy_loss": "gspo"}, "gspo_token"),  # gae's per-token advantages
    ({"policy_loss": "gspo_token", "clip_range_high": 0.28},
     "ppo.clip_range_high=0.28 is set but ppo.policy_loss='gspo_token' ignores it"),
    ({"gspo_clip_high": 1e-3}, "gspo_clip_high=0.001 is set but ppo.policy_loss='ppo' ignores it"),
    ({"clip_range_low": 1.0}, "clip_range_low=1.0 puts the ratio's floor"),
    ({"clip_range": 1.2, "clip_range_high": 0.3}, "clip_range=1.2 puts the ratio's floor"),
    ({"policy_loss": "gspo_token", "gspo_clip_low": 1.5}, "gspo_clip_low=1.5 puts the ratio's floor"),
    ({"correction": "icepop", "correction_level": "sequence"},
     "ppo.correction_level='sequence' is set but ppo.correction='icepop' ignores it"),
    ({"correction": "icepop", "is_cap": 3.0}, "ppo.is_cap=3.0 is set but ppo.correction='icepop' ignores it"),
    ({"correction": "icepop", "policy_loss": "gspo", "advantage": "grpo"}, "ppo.correction='icepop' weighs"),
    ({"icepop_low": 0.3}, "ppo.icepop_low=0.3 is set but ppo.correction='tis' ignores it"),
    ({"correction": "mis", "icepop_high": 3.0},
     "ppo.icepop_high=3.0 is set but ppo.correction='mis' ignores it"),
    ({"correction": "icepop", "geometric_mask_low": 0.99},
     "ppo.geometric_mask_low=0.99 is set but ppo.correction='icepop' ignores it"),
    ({"correction": "geometric_mask", "off_policy_mask_delta": 0.01},
     "ppo.off_policy_mask_delta=0.01 is set but ppo.correction='geometric_mask' ignores it"),
    ({"correction": "off_policy_mask", "is_cap": 0.9},
     "is_cap=0.9 must be > 1 with ppo.correction='off_policy_mask'"),
    ({"correction": "none", "off_policy_mask_delta": 0.01},
     "ppo.off_policy_mask_delta=0.01 is set but ppo.correction='none'"),
    ({"correction": "geometric_mask", "policy_loss": "gspo", "advantage": "grpo"},
     "ppo.correction_level='sequence'"),
    ({"correction": "icepop", "icepop_low": 1.2}, "icepop_low"),  # the band must hold 1
    ({"correction": "geometric_mask", "geometric_mask_high": 0.99}, "geometric_mask_high"),
    ({"policy_loss": "cispo", "clip_range_high": 0.28},
     "ppo.clip_range_high=0.28 is set but ppo.policy_loss='cispo' ignores it"),
    ({"policy_loss": "sapo", "clip_range": 0.3},
     "ppo.clip_range=0.3 is set but ppo.policy_loss='sapo' ignores it"),
    ({"policy_loss": "sapo", "cispo_clip_high": 1.0},
     "ppo.cispo_clip_high=1.0 is set but ppo.policy_loss='sapo' ignores it"),
    ({"sapo_tau_neg": 2.0}, "ppo.sapo_tau_neg=2.0 is set but ppo.policy_loss='ppo' ignores it"),
    ({"policy_loss": "cispo", "gspo_clip_low": 1e-3},
     "ppo.gspo_clip_low=0.001 is set but ppo.policy_loss='cispo'"),
    ({"policy_loss": "cispo", "cispo_clip_low": 1.5}, "cispo_clip_low"),  # a floor below 0
])
def test_settings_that_make_no_sense_are_refused(ppo, match):
    """Refused when the layer resolves the config (``Algorithm.from_config``: each registry's check of the
    entry it chooses), or already by a field's own bounds in ``load_config``; the message names the field."""
    from learner.algorithm import Algorithm
    from services.config import load_config

    # the group estimators need a group: two samples of each prompt
    overrides = {"ppo": ppo, **({"rollout": {"samples_per_prompt": 2}} if ppo.get("advantage") == "grpo"
                                else {})}
    with pytest.raises(ValueError, match=match.replace("(", r"\(").replace(")", r"\)")):
        Algorithm.from_config(load_config(None, overrides))


def test_async_without_a_correction_is_refused_and_the_defaults_correct_in_both_modes():
    from learner.algorithm import Algorithm
    from services.config import load_config

    def resolved(overrides):
        """The config of ``overrides`` after the layer's check of its entries (``Algorithm.from_config``)."""
        cfg = load_config(None, overrides)
        Algorithm.from_config(cfg)
        return cfg

    with pytest.raises(ValueError, match="async mode needs the weight pi_prox / pi_behav"):
        resolved({"rollout": {"mode": "async"}, "ppo": {"correction": "none"}})
    default = PPOConfig()
    assert (default.correction, default.correction_level, default.is_cap) == ("tis", "token", 2.0)

    def clip(p):
        return POLICY_LOSSES.get(p.policy_loss).clip(p)

    assert clip(default) == (0.2, 0.2)
    assert clip(PPOConfig(clip_range_high=0.28)) == (0.2, 0.28)
    gspo = PPOConfig(policy_loss="gspo", advantage="rloo", correction_level="sequence")
    assert clip(gspo) == (3e-4, 4e-4)
    assert resolved({"ppo": {"correction": "none"}}).ppo.correction == "none"  # sync may turn it off
    for correction in ("icepop", "off_policy_mask"):  # corrections: async mode takes them
        cfg = resolved({"rollout": {"mode": "async"}, "ppo": {"correction": correction}})
        assert cfg.ppo.correction == correction
    # the geometric mask too, with a band set for a stale row's drift: its default is the numerics' alone
    with pytest.raises(ValueError, match=r"\[geometric_band_set_for_async\].*default band "
                                         r"\[0.999, 1.001\]"):
        resolved({"rollout": {"mode": "async"}, "ppo": {"correction": "geometric_mask"}})
    band = {"correction": "geometric_mask", "geometric_mask_low": 0.8, "geometric_mask_high": 1.25}
    assert resolved({"rollout": {"mode": "async"}, "ppo": band}).ppo.geometric_mask_high == 1.25
    cispo = PPOConfig(policy_loss="cispo", cispo_clip_low=0.2, cispo_clip_high=0.28)
    assert clip(cispo) == (0.2, 0.28)
    assert clip(PPOConfig(policy_loss="cispo")) == (1.0, 4.0)
    sapo = PPOConfig(policy_loss="sapo", sapo_tau_pos=2.0, correction="icepop", icepop_low=0.4,
                     icepop_high=3.0)
    assert (sapo.sapo_tau_pos, sapo.sapo_tau_neg, sapo.icepop_low, sapo.icepop_high) == (2.0, 1.05, 0.4, 3.0)
    assert POLICY_LOSSES.get("sapo").clip is None  # a soft gate, no clip
