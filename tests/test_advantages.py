"""Advantage estimators (learner/advantages.py, ``ppo.advantage``): golden values from the definitions,
the group properties, the global whitening over two gloo ranks, where the groups go, and the config's
checks. Pure torch except the two-process gloo test."""

from __future__ import annotations

import math
import os

import pytest
import torch
import torch.multiprocessing as mp

from learner.advantages import (
    ESTIMATORS,
    check_whole_groups,
    compute_advantages,
    grpo_sequence_advantages,
    reinforce_pp_advantages,
    reinforce_pp_baseline_advantages,
    reward_to_go,
    rloo_sequence_advantages,
    sequence_returns,
)
from learner.kl import kl_penalized_rewards
from learner.ppo import DistributedReducer, gae_advantages, masked_whiten

# two rows, lengths 3 and 2; gamma 1: reward-to-go [[0.7, 0.8, 1.0], [0.2, 0.5, 0]], returns R = [0.7, 0.2]
REWARDS = torch.tensor([[-0.1, -0.2, 1.0], [-0.3, 0.5, 9.0]], dtype=torch.float64)
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]], dtype=torch.float64)


def _whiten_by_hand(values: list[float]) -> torch.Tensor:
    """Zero mean, unit unbiased variance, as a list of the masked tokens in row order."""
    mean = sum(values) / len(values)
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))
    return torch.tensor([(v - mean) / std for v in values], dtype=torch.float64)


def _ragged(seed: int, groups: int, n: int, t: int = 7):
    """Per-token rewards, a ragged mask (one empty row) and shuffled group ids: ``groups`` groups of ``n``."""
    g = torch.Generator().manual_seed(seed)
    b = groups * n
    rewards = torch.randn(b, t, generator=g, dtype=torch.float64)
    lengths = torch.randint(1, t + 1, (b,), generator=g)
    lengths[1] = 0
    mask = (torch.arange(t) < lengths[:, None]).double()
    group_index = torch.arange(groups).repeat_interleave(n)[torch.randperm(b, generator=g)]
    return rewards, mask, group_index


# ---------------------------------------------------------------- golden values


def test_grpo_golden():
    returns = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 5.0, 5.0, 5.0])
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    std = math.sqrt((1.5**2 + 0.5**2 + 0.5**2 + 1.5**2) / 3)  # unbiased
    expected = torch.tensor([-1.5, -0.5, 0.5, 1.5, 0, 0, 0, 0]) / torch.tensor([std + 1e-6] * 4 + [1.0] * 4)
    assert torch.allclose(grpo_sequence_advantages(returns, groups), expected, atol=1e-6)


def test_grpo_all_equal_group_is_exactly_zero_not_rounding_over_eps():
    # mean of three 0.1 is not exactly 0.1 in floating point
    returns = torch.tensor([0.1, 0.1, 0.1, 0.7, 0.3])
    advantages = grpo_sequence_advantages(returns, torch.tensor([4, 4, 4, 9, 9]))
    assert advantages[:3].tolist() == [0.0, 0.0, 0.0]
    assert advantages[3] > 0 > advantages[4]


def test_rloo_golden():
    returns = torch.tensor([1.0, 2.0, 3.0, 4.0, -1.0, 1.0])
    groups = torch.tensor([0, 0, 0, 0, 1, 1])
    expected = torch.tensor([1 - 3.0, 2 - 8 / 3, 3 - 7 / 3, 4 - 2.0, -2.0, 2.0])  # R_i - mean of the others
    assert torch.allclose(rloo_sequence_advantages(returns, groups), expected, atol=1e-6)


def test_reward_to_go_golden():
    assert torch.allclose(reward_to_go(REWARDS, MASK, 1.0),
                          torch.tensor([[0.7, 0.8, 1.0], [0.2, 0.5, 0.0]], dtype=torch.float64))
    assert torch.allclose(reward_to_go(REWARDS, MASK, 0.5),
                          torch.tensor([[0.05, 0.3, 1.0], [-0.05, 0.5, 0.0]], dtype=torch.float64))


def test_reinforce_pp_golden():
    advantages = reinforce_pp_advantages(REWARDS, MASK, gamma=1.0)
    expected = _whiten_by_hand([0.7, 0.8, 1.0, 0.2, 0.5])
    assert torch.allclose(advantages[MASK.bool()], expected, atol=1e-6)
    assert advantages[1, 2] == 0.0


def test_reinforce_pp_baseline_golden():
    # one group of both rows: mean R = (0.7 + 0.2) / 2 = 0.45 comes off each last token before the
    # reward-to-go
    advantages = reinforce_pp_baseline_advantages(REWARDS, MASK, torch.tensor([3, 3]), gamma=1.0)
    expected = _whiten_by_hand([0.25, 0.35, 0.55, -0.25, 0.05])
    assert torch.allclose(advantages[MASK.bool()], expected, atol=1e-6)


def test_sequence_level_advantages_cover_every_response_token_and_no_padding():
    groups = torch.tensor([0, 0])
    for estimator, per_row in (("grpo", [0.25 / (math.sqrt(0.125) + 1e-6),
                                         -0.25 / (math.sqrt(0.125) + 1e-6)]),
                               ("rloo", [0.5, -0.5])):
        advantages, returns = compute_advantages(estimator, REWARDS, MASK, group_index=groups)
        assert returns is None, estimator
        assert torch.allclose(advantages,
                              torch.tensor(per_row, dtype=torch.float64)[:, None] * MASK), estimator


def test_gae_in_the_registry_is_the_old_path():
    rewards, mask, _ = _ragged(2, 3, 2)
    values = torch.randn(rewards.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    advantages, returns = compute_advantages("gae", rewards, mask, values=values, gamma=0.9, lam=0.8,
                                             whiten_advantages=True, whiten_rewards=True)
    old_adv, old_ret = gae_advantages(masked_whiten(rewards, mask, shift_mean=False), values, mask, 0.9, 0.8)
    assert torch.allclose(advantages, masked_whiten(old_adv, mask), atol=1e-6)
    assert torch.allclose(returns, old_ret, atol=1e-12)
    with pytest.raises(ValueError, match="needs the critic's values"):
        compute_advantages("gae", rewards, mask)


def test_the_return_is_the_score_minus_beta_times_the_response_kl():
    """R = score - beta * KL_b with the KL in the reward; with beta 0 (KL in the loss) R is the score."""
    g = torch.Generator().manual_seed(1)
    logprobs, ref = -torch.rand(4, 5, generator=g) * 2, -torch.rand(4, 5, generator=g) * 2
    mask = (torch.arange(5) < torch.tensor([5, 2, 4, 3])[:, None]).float()
    scores, beta = torch.tensor([1.0, 0.0, 0.5, 0.5]), 0.1
    kl_b = ((logprobs - ref) * mask).sum(-1)  # k1
    rewards, _ = kl_penalized_rewards(scores, logprobs, ref, mask, beta, "k1")
    assert torch.allclose(sequence_returns(rewards, mask), scores - beta * kl_b, atol=1e-6)
    in_loss, _ = kl_penalized_rewards(scores, logprobs, ref, mask, 0.0, "k1")
    groups = torch.tensor([0, 0, 1, 1])
    advantages, _ = compute_advantages("rloo", in_loss, mask, group_index=groups)
    assert torch.allclose(advantages[:, 0], torch.tensor([1.0, -1.0, 0.0, 0.0]))


def _grpo_groups_with_kl():
    """Two groups of four 2-token responses, beta 0.01, every token of row b with kl (b % 4 + 1) / 200, so
    KL_b = [.01, .02, .03, .04] in each group: group 0's scores tie at 1, group 1's are [0, 1, 0, 1]."""
    kl = torch.tensor([[(b % 4 + 1) / 200] * 2 for b in range(8)], dtype=torch.float64)
    mask = torch.ones(8, 2, dtype=torch.float64)
    scores = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 1.0], dtype=torch.float64)
    # logp - ref = kl (k1)
    rewards, kl_tokens = kl_penalized_rewards(scores, kl, torch.zeros_like(kl), mask, 0.01)
    return rewards, mask, torch.tensor([0] * 4 + [1] * 4), -0.01 * kl_tokens


def test_grpo_normalises_the_score_and_keeps_the_kl_outside():
    """Issue 23, bias 4 (DeepSeekMath, OpenRLHF, TRL):
    ``A_t = (s - mean s) / (std s + 1e-6) - beta * kl to go``. Group 0's scores tie: its advantages are the KL
    penalty to go alone, by hand -0.01 * [2, 1] * kl_token; group 1's normalised scores are +-0.5 /
    (sqrt(1/3) + 1e-6) (unbiased std of [0, 1, 0, 1])."""
    rewards, mask, groups, kl_rewards = _grpo_groups_with_kl()
    advantages, _ = compute_advantages("grpo", rewards, mask, group_index=groups, kl_rewards=kl_rewards)
    unit = 0.5 / (math.sqrt(1 / 3) + 1e-6)
    to_go = [[-0.01 * 2 * (b + 1) / 200, -0.01 * (b + 1) / 200] for b in range(4)]
    expected = torch.tensor([[0.0, 0.0]] * 4 + [[-unit] * 2, [unit] * 2, [-unit] * 2, [unit] * 2],
                            dtype=torch.float64) + torch.tensor(to_go * 2, dtype=torch.float64)
    assert torch.allclose(advantages, expected, rtol=0, atol=1e-12)
    assert float(advantages[:4].abs().max()) < 1e-3  # the tied group's KL noise stays the size of beta * KL


def test_grpo_normalize_return_keeps_the_present_form_to_reproduce_verl():
    """``ppo.grpo_normalize: return`` normalises ``R = s - beta * KL_b``: the tied group's R = 1 - 0.01 * KL_b
    = [.9999, .9998, .9997, .9996] become unit-size advantages (deviations +-1.5e-4, +-0.5e-4 over the
    unbiased std sqrt(5e-8 / 3) + 1e-6): about [1.15, 0.38, -0.38, -1.15]."""
    rewards, mask, groups, kl_rewards = _grpo_groups_with_kl()
    advantages, _ = compute_advantages("grpo", rewards, mask, group_index=groups, kl_rewards=kl_rewards,
                                       grpo_normalize="return")
    std = math.sqrt(5e-8 / 3) + 1e-6
    expected = torch.tensor([1.5e-4, 0.5e-4, -0.5e-4, -1.5e-4], dtype=torch.float64) / std
    assert torch.allclose(advantages[:4, 0], expected, rtol=1e-6)
    assert advantages[:4, 0].tolist() == pytest.approx([1.15, 0.38, -0.38, -1.15], abs=0.01)
    # the KL in the loss: no penalty in the rewards, both forms normalise the score alone
    in_loss, _ = kl_penalized_rewards(torch.tensor([1.0, 1.0, 0.0, 1.0]), torch.zeros(4, 2),
                                      torch.zeros(4, 2), torch.ones(4, 2), 0.0)
    for form in ("score", "return"):
        got, _ = compute_advantages("grpo", in_loss, torch.ones(4, 2),
                                    group_index=torch.zeros(4, dtype=torch.long), grpo_normalize=form)
        # (s - 0.75) / 0.5 (unbiased)
        assert got[:, 0].tolist() == pytest.approx([0.5, 0.5, -1.5, 0.5], abs=1e-5)
    with pytest.raises(ValueError, match="unknown ppo.grpo_normalize 'kl'"):
        compute_advantages("grpo", rewards, mask, group_index=groups, kl_rewards=kl_rewards,
                           grpo_normalize="kl")
    with pytest.raises(ValueError, match=r"kl_rewards \(8, 3\) and rewards \(8, 2\) must share"):
        compute_advantages("grpo", rewards, mask, group_index=groups, kl_rewards=torch.zeros(8, 3))


def test_reinforce_pp_baseline_refuses_a_discount():
    """Issue 23, bias 5: discounted, the baseline b subtracted at the last token reaches token t as
    ``-gamma^(L-1-t) * b``, by the row's own length (gamma 0.5, L = 3: -b/4 at the first token, L = 1: -b)."""
    with pytest.raises(ValueError, match=r"reinforce_pp_baseline needs ppo.gamma = 1, got 0.9"):
        reinforce_pp_baseline_advantages(REWARDS, MASK, torch.tensor([3, 3]), gamma=0.9)
    with pytest.raises(ValueError, match=r"ppo.gamma = 1, got 0.5"):
        compute_advantages("reinforce_pp_baseline", REWARDS, MASK, group_index=torch.tensor([3, 3]),
                           gamma=0.5)


# ---------------------------------------------------------------- group properties


@pytest.mark.parametrize("seed", range(4))
def test_rloo_advantages_sum_to_zero_within_each_group(seed):
    rewards, mask, groups = _ragged(seed, groups=5, n=4)
    advantages = rloo_sequence_advantages(sequence_returns(rewards, mask), groups)
    for group in range(5):
        assert abs(float(advantages[groups == group].sum())) < 1e-9


@pytest.mark.parametrize("seed", range(4))
def test_grpo_advantages_have_zero_mean_and_unit_std_within_each_group(seed):
    rewards, mask, groups = _ragged(seed, groups=5, n=8)
    advantages = grpo_sequence_advantages(sequence_returns(rewards, mask), groups)
    for group in range(5):
        a = advantages[groups == group]
        assert abs(float(a.mean())) < 1e-9
        assert float(a.std(unbiased=True)) == pytest.approx(1.0, abs=1e-5)  # eps 1e-6 in the denominator


def test_group_estimators_refuse_singleton_groups_and_split_groups():
    with pytest.raises(ValueError, match="at least 2 samples per group"):
        grpo_sequence_advantages(torch.tensor([1.0, 2.0, 3.0]), torch.tensor([0, 0, 1]))
    with pytest.raises(ValueError, match="at least 2 samples per group"):
        rloo_sequence_advantages(torch.tensor([1.0, 2.0, 3.0]), torch.tensor([0, 1, 2]))
    check_whole_groups(torch.tensor([2, 2, 5, 5]), 2)
    with pytest.raises(ValueError, match="rank 1: a prompt group is split or incomplete \\(group 5: 1 rows"):
        check_whole_groups(torch.tensor([2, 2, 5]), 2, "rank 1: ")
    with pytest.raises(ValueError, match="carry no group"):
        check_whole_groups(torch.tensor([-1, -1]), 2)
    with pytest.raises(ValueError, match="ppo.advantage='ppo' is not a registered advantage estimator"):
        compute_advantages("ppo", REWARDS, MASK)
    assert set(ESTIMATORS.names()) == {"gae", "grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline"}


# ---------------------------------------------------------------- REINFORCE++ whitening over two ranks


def _reinforce_pp_shard_in_gloo_group(rank: int, world_size: int, store_path: str, out_dir: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.FileStore(store_path, world_size), rank=rank,
                            world_size=world_size)
    try:
        rewards, mask, groups = _contiguous_groups()
        rows = slice(0, 4) if rank == 0 else slice(4, 12)  # unequal shards, whole groups of 2 on each
        reducer = DistributedReducer()  # the rank's: the whitening sums its moments over both processes
        out = {name: compute_advantages(name, rewards[rows], mask[rows], group_index=groups[rows],
                                        gamma=gamma, reducer=reducer)[0]
               for name, gamma in WHITENED_GAMMAS.items()}
        torch.save(out, os.path.join(out_dir, f"{rank}.pt"))
    finally:
        dist.destroy_process_group()


# the baseline estimator takes gamma 1 only (a discounted baseline would shape by length)
WHITENED_GAMMAS = {"reinforce_pp": 0.9, "reinforce_pp_baseline": 1.0}


def _contiguous_groups():
    rewards, mask, _ = _ragged(7, groups=6, n=2)
    return rewards, mask, torch.arange(6).repeat_interleave(2)


def test_reinforce_pp_whitening_over_two_gloo_ranks_equals_one_rank(tmp_path):
    mp.spawn(_reinforce_pp_shard_in_gloo_group, args=(2, str(tmp_path / "store"), str(tmp_path)), nprocs=2,
             join=True)
    rewards, mask, groups = _contiguous_groups()
    shards = [torch.load(tmp_path / "0.pt"), torch.load(tmp_path / "1.pt")]
    for name, gamma in WHITENED_GAMMAS.items():
        one_rank, _ = compute_advantages(name, rewards, mask, group_index=groups, gamma=gamma)
        two_ranks = torch.cat([shards[0][name], shards[1][name]])
        assert torch.allclose(two_ranks, one_rank, atol=1e-9), name
        # whitening each shard on its own would differ: the all-reduce is what makes them equal
        alone = torch.cat([compute_advantages(name, rewards[s], mask[s], group_index=groups[s],
                                              gamma=gamma)[0]
                           for s in (slice(0, 4), slice(4, 12))])
        assert not torch.allclose(alone, one_rank, atol=1e-3), name


# ---------------------------------------------------------------- where the groups go


@pytest.mark.parametrize("n, chunk, batch, world_size", [(4, 8, 32, 2), (8, 32, 128, 2), (2, 6, 24, 4),
                                                         (8, 16, 128, 8), (1, 32, 128, 1)])
def test_with_n_samples_per_prompt_each_group_lands_whole_on_one_rank(n, chunk, batch, world_size):
    """The fleet's chunk layout and the group's slot-to-rank rule, as the job uses them."""
    from learner.fleet import chunk_layout
    from learner.group import rank_slots
    from services.config import load_config

    cfg = load_config(None, {"rollout": {"batch_size": batch, "chunk_size": chunk, "samples_per_prompt": n},
                             "ppo": {"minibatch_size": batch // 2}, "learner": {"world_size": world_size}})
    prompts = [int(p) for p in torch.randperm(1000)[:batch // n]]
    layout = chunk_layout(prompts, n, cfg.rollout.chunk_size)
    assert sum(len(rows) for rows, _ in layout) == batch
    rank_of_group: dict[int, set[int]] = {}
    rows_of_group: dict[int, list[int]] = {}
    for rank, slots in enumerate(rank_slots(range(len(layout)), world_size)):
        for slot in slots:
            rows, groups = layout[slot]
            for prompt, group in zip(rows, groups, strict=True):
                rank_of_group.setdefault(group, set()).add(rank)
                rows_of_group.setdefault(group, []).append(prompt)
    assert len(rank_of_group) == batch // n
    assert all(len(ranks) == 1 for ranks in rank_of_group.values())
    # a group is n samples of one prompt, and each prompt of the draw is one group
    assert all(len(p) == n and len(set(p)) == 1 for p in rows_of_group.values())
    assert sorted(p[0] for p in rows_of_group.values()) == sorted(prompts)


# ---------------------------------------------------------------- config


@pytest.mark.parametrize("overrides, message", [
    ({"ppo": {"advantage": "grpo"}}, "needs rollout.samples_per_prompt >= 2 (got 1)"),
    ({"ppo": {"advantage": "reinforce_pp_baseline"}}, "ppo.advantage='reinforce_pp_baseline'"),
    ({"ppo": {"advantage": "rloo"}, "rollout": {"samples_per_prompt": 3}},
     "rollout.batch_size=128 counts episodes: it must be a multiple of rollout.samples_per_prompt=3"),
    ({"rollout": {"samples_per_prompt": 16, "chunk_size": 8, "batch_size": 128}},
     "rollout.chunk_size=8 is not a multiple of rollout.samples_per_prompt=16"),
    ({"ppo": {"advantage": "grpo"}, "rollout": {"samples_per_prompt": 4}, "learner": {"critic": "separate"}},
     "learner.critic='separate' builds a critic"),
    ({"ppo": {"advantage": "ppo"}}, "ppo.advantage"),
    ({"ppo": {"advantage": "reinforce_pp_baseline", "gamma": 0.9}, "rollout": {"samples_per_prompt": 8}},
     "ppo.advantage='reinforce_pp_baseline' needs ppo.gamma=1 (got 0.9)"),
    ({"ppo": {"advantage": "rloo", "grpo_normalize": "return"}, "rollout": {"samples_per_prompt": 8}},
     "ppo.grpo_normalize='return' is set but ppo.advantage='rloo' ignores it"),
    ({"ppo": {"advantage": "grpo", "grpo_normalize": "return"}, "rollout": {"samples_per_prompt": 8},
      "kl": {"placement": "loss", "loss_form": "kl_to_go"}},
     "but kl.placement='loss' puts no KL in the return"),
])
def test_config_refuses_what_the_estimators_cannot_use(overrides, message):
    """Refused by the config, or by the check of the estimator it chooses (before any actor)."""
    from learner.algorithm import Algorithm
    from services.config import load_config

    with pytest.raises(ValueError, match=message.replace("(", "\\(").replace(")", "\\)")):
        Algorithm.from_config(load_config(None, overrides))


def test_config_accepts_the_benchmark_settings():
    from services.config import load_config

    for estimator in ESTIMATORS.names():
        n = 8 if estimator in ("grpo", "rloo", "reinforce_pp_baseline") else 1
        cfg = load_config(None, {"ppo": {"advantage": estimator}, "rollout": {"samples_per_prompt": n}})
        assert cfg.rollout.batch_size == 128 and cfg.ppo.advantage == estimator
    assert cfg.ppo.grpo_normalize == "score" and cfg.ppo.gamma == 1.0
    cfg = load_config(None, {"ppo": {"advantage": "grpo", "grpo_normalize": "return"},
                             "rollout": {"samples_per_prompt": 8}})
    assert cfg.ppo.grpo_normalize == "return"
    assert load_config(None, {"ppo": {"advantage": "reinforce_pp", "gamma": 0.9}}).ppo.gamma == 0.9


def test_only_gae_builds_a_value_head():
    from transformers import GPT2Config, GPT2LMHeadModel

    from learner.policy_model import PolicyWithValueHead

    lm = GPT2LMHeadModel(GPT2Config(vocab_size=23, n_positions=16, n_embd=32, n_layer=1, n_head=2))
    ids = torch.randint(0, 23, (2, 5))
    ones = torch.ones_like(ids)
    for estimator in ESTIMATORS.names():
        model = PolicyWithValueHead(lm, value_head=ESTIMATORS.get(estimator).critic)
        logits, values = model(ids, ones, ones.cumsum(-1) - 1, prompt_width=2)
        assert logits.shape == (2, 3, 23)
        names = {name for name, _ in model.named_parameters()}
        if estimator == "gae":
            assert values.shape == (2, 3) and any(n.startswith("value_head.") for n in names)
        else:
            assert values is None and all(n.startswith("lm.") for n in names), estimator


# ---------------------------------------------------------------- Dr. GRPO's loss aggregation


def test_seq_mean_token_sum_norm_divides_each_token_sum_by_the_constant_width_and_adds_over_ranks():
    from learner.ppo import loss_denominator, masked_mean

    x = torch.tensor([[1.0, 2.0, 3.0], [10.0, 0.0, 0.0], [4.0, 4.0, 0.0], [7.0, 7.0, 7.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0], [1.0, 1.0, 0.0]])
    whole = masked_mean(x, mask, "seq_mean_token_sum_norm")
    assert float(whole) == pytest.approx((6 + 10 + 0 + 14) / 3 / 4)  # every row, empty ones too, over T = 3
    total = (loss_denominator(mask[:1], "seq_mean_token_sum_norm")
             + loss_denominator(mask[1:], "seq_mean_token_sum_norm"))
    shares = [masked_mean(x[s], mask[s], "seq_mean_token_sum_norm", total / 2)
              for s in (slice(0, 1), slice(1, 4))]
    assert torch.allclose(sum(shares) / 2, whole)


# ---------------------------------------------------------------- the job, end to end


@pytest.mark.integration
def test_grpo_job_with_groups_over_two_ranks_keeps_exact_kl_accounting_builds_no_critic_and_resumes(
        ray_head, cache_dir, tmp_path):
    """``ppo.advantage grpo`` with 4 samples per prompt, 2 learner ranks: each rank checks that every group
    it computes a baseline for is whole, the KL accounting is the GAE job's, no value head exists (not in the
    checkpoint, no value loss), and the critic-free checkpoint resumes and exports."""
    import json

    from tests.conftest import run_job

    def job(*extra):
        return run_job(["--cluster.address", ray_head.address, "--model.cache_dir", cache_dir,
                        "--run.output_dir", str(tmp_path), "--run.name", "grpo", "--run.seed", "1",
                        "--model.sft_steps", "60", "--model.sft_batch_size", "50", "--rollout.batch_size",
                        "32", "--rollout.chunk_size", "8", "--rollout.samples_per_prompt", "4",
                        "--ppo.advantage", "grpo", "--ppo.minibatch_size", "16", "--learner.world_size", "2",
                        "--kl.horizon", "1000", "--run.eval_every", "100", "--cluster.placement_timeout_s",
                        "600", *extra])  # 6 agents share 2 cores

    first = job("--run.iterations", "2")
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    run_dir = tmp_path / "grpo"
    states = list((run_dir / "checkpoints" / "iter-000002").rglob("*model_states.pt"))
    assert states
    for path in states:
        keys = list(torch.load(path, map_location="cpu", weights_only=False)["module"])
        assert keys and all(k.startswith("lm.") for k in keys), [k for k in keys if not k.startswith("lm.")]
    resumed = job("--run.iterations", "3", "--run.resume", "latest")
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert (run_dir / "export" / "model.safetensors").is_file()

    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in records] == [1, 2, 3]
    # the reference and the learner start from the same weights: the first batch has no KL at all
    assert records[0]["kl_response_mean"] == 0.0 and records[0]["kl_k3_response_mean"] == 0.0
    for r in records:
        assert r["episodes"] == 32 and len(r["prompt_rows"]) == 8  # 8 prompts, 4 samples each
        assert r["batch_policy_versions"] == [r["policy_version"] - 1]
        assert r["batch_kl_coefs"] == pytest.approx([r["kl_coef_used"]], rel=1e-6)
        # the controller was fed exactly the response KL of this batch, once
        e = min(max(r["kl_response_mean"] / 6.0 - 1, -0.2), 0.2)
        assert r["kl_coef"] == pytest.approx(r["kl_coef_used"] * (1 + e * r["episodes"] / 1000), rel=1e-9)
        # no critic: no value loss, no explained variance, no values
        assert "ppo_value_loss" not in r and "ppo_vf_clipfrac" not in r and "ppo_explained_variance" not in r
        assert math.isnan(r["value_mean"])
        assert math.isfinite(r["ppo_policy_loss"]) and r["ppo_optimizer_steps"] == 4 * 2
    assert records[1]["kl_response_mean"] > 0.0
