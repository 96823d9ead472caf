"""Multi-turn trajectories in the learner's math: the action mask has gaps at the
environment's tokens, and every quantity over it equals the same quantity over the model's tokens alone,
as if the environment's tokens were not there."""

from __future__ import annotations

import pytest
import torch

from learner.advantages import compute_advantages, reward_to_go
from learner.kl import kl_penalized_rewards, last_token_index, response_kl_loss
from learner.policy_losses import policy_loss
from learner.ppo import gae_advantages
from services.config import PPOConfig
from tests.batch_statistics import kl_stats, sequence_kl

# Three trajectories of width 10: model turns (1) and environment tokens (0) between them, then padding.
ACTION = torch.tensor([
    [1, 1, 0, 0, 1, 1, 1, 0, 1, 0],  # three turns, then padding
    [1, 0, 0, 0, 1, 0, 0, 0, 0, 0],  # two one-token turns
    [1, 1, 1, 1, 0, 0, 0, 0, 0, 0],  # one turn: a single response
], dtype=torch.float32)
TURN_ENDS = [[1, 6, 8], [0, 4], [3]]  # each turn's last model token


def compact(x: torch.Tensor, mask: torch.Tensor = ACTION) -> torch.Tensor:
    """The model's tokens of each row, moved left: the trajectory without the environment's tokens."""
    out = torch.zeros_like(x)
    for b in range(x.shape[0]):
        kept = x[b][mask[b] > 0]
        out[b, : kept.numel()] = kept
    return out


def compact_mask(mask: torch.Tensor = ACTION) -> torch.Tensor:
    return compact(mask, mask)


def expand(x: torch.Tensor, mask: torch.Tensor = ACTION) -> torch.Tensor:
    """Inverse of ``compact``: the compacted rows back at the model's positions, 0 elsewhere."""
    out = torch.zeros_like(x)
    for b in range(x.shape[0]):
        positions = (mask[b] > 0).nonzero().squeeze(-1)
        out[b, positions] = x[b, : positions.numel()]
    return out


def turn_rewards(per_turn: list[list[float]]) -> torch.Tensor:
    out = torch.zeros_like(ACTION)
    for b, (ends, rewards) in enumerate(zip(TURN_ENDS, per_turn, strict=True)):
        for t, r in zip(ends, rewards, strict=True):
            out[b, t] = r
    return out


TURN_REWARDS = turn_rewards([[0.5, -0.25, 1.0], [0.0, 2.0], [0.75]])


def test_last_token_index_with_gaps():
    assert last_token_index(ACTION).tolist() == [8, 4, 3]
    assert last_token_index(torch.zeros(2, 4)).tolist() == [-1, -1]
    assert last_token_index(torch.tensor([[0.0, 0.0, 1.0]])).tolist() == [2]


def test_kl_identity_on_multi_turn_trajectories():
    """KL_b sums the model's tokens of every turn; the controller's mean equals the penalty the rewards
    hold: mean_kl == -mean_b sum_t (reward_t - score_t) / beta, score_t each turn's reward."""
    g = torch.Generator().manual_seed(0)
    logp = -torch.rand(ACTION.shape, generator=g) * 3
    ref = -torch.rand(ACTION.shape, generator=g) * 3
    beta = 0.37
    for estimator in ("k1", "k2", "k3"):
        rewards, kl = kl_penalized_rewards(TURN_REWARDS.sum(-1), logp, ref, ACTION, beta,
                                           estimator, TURN_REWARDS)
        assert torch.all(kl[ACTION == 0] == 0)  # the environment's tokens carry no KL
        stats = kl_stats(logp, ref, ACTION, estimator)
        penalty = -((rewards - TURN_REWARDS) * ACTION).sum(-1).mean() / beta
        assert stats["response_mean"] == pytest.approx(float(penalty), rel=1e-5, abs=1e-6)
        # the same nats as the trajectory without its environment tokens
        torch.testing.assert_close(sequence_kl(logp, ref, ACTION, estimator),
                                   sequence_kl(compact(logp), compact(ref), compact_mask(), estimator))
        assert stats["num_tokens"] == ACTION.sum()


def test_turn_rewards_land_only_on_model_tokens():
    logp = torch.zeros(ACTION.shape)
    bad = TURN_REWARDS.clone()
    bad[0, 2] = 1.0  # an environment token
    with pytest.raises(ValueError, match=r"did not sample.*\(0, 2\)"):
        kl_penalized_rewards(bad.sum(-1), logp, logp, ACTION, 0.1, "k1", bad)
    rewards, _ = kl_penalized_rewards(TURN_REWARDS.sum(-1), logp, logp, ACTION, 0.1, "k1", TURN_REWARDS)
    assert torch.equal(rewards, TURN_REWARDS)


def test_gae_skips_the_environment_tokens():
    """A turn's last model token bootstraps from the value at the next turn's first model token; the
    environment's tokens are not discounted and get no advantage."""
    g = torch.Generator().manual_seed(1)
    rewards = torch.randn(ACTION.shape, generator=g) * ACTION
    values = torch.randn(ACTION.shape, generator=g) * ACTION
    for gamma, lam in ((1.0, 1.0), (0.9, 0.95), (0.5, 0.0)):
        advantages, returns = gae_advantages(rewards, values, ACTION, gamma, lam)
        compact_adv, compact_ret = gae_advantages(compact(rewards), compact(values),
                                                  compact_mask(), gamma, lam)
        torch.testing.assert_close(advantages, expand(compact_adv))
        torch.testing.assert_close(returns, expand(compact_ret))
    # by hand, row 1 (turns at 0 and 4), gamma 0.9, lam 1: A_4 = r_4 - V_4,
    # A_0 = r_0 + 0.9 V_4 - V_0 + 0.9 A_4
    advantages, _ = gae_advantages(rewards, values, ACTION, 0.9, 1.0)
    a4 = rewards[1, 4] - values[1, 4]
    torch.testing.assert_close(advantages[1, 4], a4)
    torch.testing.assert_close(advantages[1, 0], rewards[1, 0] + 0.9 * values[1, 4] - values[1, 0] + 0.9 * a4)


def test_reward_to_go_skips_the_environment_tokens():
    g = torch.Generator().manual_seed(2)
    rewards = torch.randn(ACTION.shape, generator=g) * ACTION
    for gamma in (1.0, 0.8):
        torch.testing.assert_close(reward_to_go(rewards, ACTION, gamma),
                                   expand(reward_to_go(compact(rewards), compact_mask(), gamma)))


@pytest.mark.parametrize("estimator", ["gae", "grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline"])
def test_every_estimator_on_trajectories_equals_the_compacted_batch(estimator):
    """Two groups of three trajectories (rows repeated with other rewards): each estimator's advantages
    are those of the same batch without the environment's tokens, and 0 on the environment's tokens."""
    mask = torch.cat([ACTION, ACTION])
    g = torch.Generator().manual_seed(3)
    ends = torch.cat([turn_rewards([[1, 1, 1], [1, 1], [1]])] * 2) > 0
    rewards = torch.randn(mask.shape, generator=g) * 0.1 * mask + torch.randn(mask.shape, generator=g) * ends
    values = torch.randn(mask.shape, generator=g) * mask
    groups = torch.tensor([0, 0, 0, 1, 1, 1])
    # reinforce_pp_baseline takes no discount (its baseline would shape lengths)
    kwargs = {"values": values, "group_index": groups,
              "gamma": 1.0 if estimator == "reinforce_pp_baseline" else 0.95, "lam": 0.9}
    advantages, returns = compute_advantages(estimator, rewards, mask, **kwargs)
    compact_kwargs = {**kwargs, "values": compact(values, mask)}
    compact_adv, compact_ret = compute_advantages(estimator, compact(rewards, mask), compact_mask(mask),
                                                  **compact_kwargs)
    torch.testing.assert_close(advantages, expand(compact_adv, mask))
    assert torch.all(advantages[mask == 0] == 0)
    if returns is not None:
        torch.testing.assert_close(returns, expand(compact_ret, mask))


def test_losses_on_trajectories_equal_the_compacted_batch():
    """The policy loss and the KL term in the loss, values and gradients, see the model's tokens only."""
    g = torch.Generator().manual_seed(4)
    base = -torch.rand(ACTION.shape, generator=g) * 2
    old = base + 0.1 * torch.randn(ACTION.shape, generator=g)
    ref = base + 0.3 * torch.randn(ACTION.shape, generator=g)
    adv = torch.randn(ACTION.shape, generator=g) * ACTION

    def both(fn):
        full = base.clone().requires_grad_(True)
        small = compact(base).clone().requires_grad_(True)
        value_full, value_small = fn(full, ACTION, lambda x: x), fn(small, compact_mask(), compact)
        value_full.backward()
        value_small.backward()
        torch.testing.assert_close(value_full, value_small)
        torch.testing.assert_close(full.grad, expand(small.grad))

    for aggregation in ("token_mean", "sequence_mean"):
        both(lambda lp, m, c, a=aggregation: policy_loss(lp, c(old), c(adv), m, PPOConfig(clip_range=0.2),
                                                        a)[0])
    for form in ("kl_to_go", "response_k2"):
        both(lambda lp, m, c, f=form: response_kl_loss(lp, c(old), c(ref), m, f))
