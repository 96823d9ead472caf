"""lm-human-preferences' choices as options, each off by default: rewards whitened before GAE with their
mean kept (``ppo.whiten_rewards``), the learning rate annealed linearly to 0 (``ppo.lr_schedule``), and a
fixed score for responses cut without EOS (``reward.missing_eos_penalty``). Pure torch, plus a two-process
gloo group for the whitening and (integration) a learner rank that trains, checkpoints and resumes."""

from __future__ import annotations

import math
import os

import pytest
import torch
import torch.multiprocessing as mp

from learner.plan import RankSpec
from learner.ppo import (
    DistributedReducer,
    global_whiten,
    masked_whiten,
    penalize_missing_eos,
    scheduled_lr,
    whiten_from_moments,
    whiten_moments,
)
from services.experience import FINISH_LENGTH, FINISH_STOP
from tests.conftest import train

# ====================================================================== ppo.whiten_rewards


def test_whiten_rewards_golden_keeps_the_mean_and_scales_to_unit_variance():
    # real tokens 1, 2, 3, 4: mean 2.5, unbiased variance 5/3; the pads stay 0
    rewards = torch.tensor([[1.0, 2.0, 3.0], [4.0, 9.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    std = math.sqrt(5 / 3)
    expected = torch.tensor([[2.5 - 1.5 / std, 2.5 - 0.5 / std, 2.5 + 0.5 / std],
                             [2.5 + 1.5 / std, 0.0, 0.0]])
    whitened = global_whiten(rewards, mask, shift_mean=False)
    assert torch.allclose(whitened, expected, atol=1e-6), whitened
    assert torch.allclose(whitened, masked_whiten(rewards, mask, shift_mean=False), atol=1e-6)
    real = whitened[mask.bool()].double()
    assert float(real.mean()) == pytest.approx(2.5, abs=1e-6)
    assert float(real.var()) == pytest.approx(1.0, rel=1e-6)
    # shift_mean=True (the advantages' whitening) is the same minus the mean
    assert torch.allclose(global_whiten(rewards, mask), (expected - 2.5) * mask, atol=1e-6)


def test_whiten_rewards_over_two_shards_equals_the_whole_batch():
    """Moments add up: each of W ranks whitening its shard with the summed moments gives exactly what
    one rank whitening the whole batch gives, however the tokens are split."""
    g = torch.Generator().manual_seed(4)
    rewards = torch.randn(8, 6, generator=g) * 0.3 - 0.1
    mask = (torch.arange(6) < torch.tensor([6, 1, 0, 4, 6, 6, 2, 5])[:, None]).float()
    whole = global_whiten(rewards, mask, shift_mean=False)
    for shards in ([slice(0, 4), slice(4, 8)], [slice(0, 1), slice(1, 8)]):
        moments = sum(whiten_moments(rewards[s], mask[s]) for s in shards)
        parts = [whiten_from_moments(rewards[s], mask[s], moments, shift_mean=False) for s in shards]
        assert torch.allclose(torch.cat(parts), whole, atol=1e-6)
        # whitening each shard on its own (lm-human-preferences' per-minibatch choice) differs
        alone = torch.cat([global_whiten(rewards[s], mask[s], shift_mean=False) for s in shards])
        assert not torch.allclose(alone, whole, atol=1e-3)


def _whiten_shard_in_gloo_group(rank: int, world_size: int, store_path: str, out_dir: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.FileStore(store_path, world_size), rank=rank,
                            world_size=world_size)
    try:
        rewards, mask = _ragged_rewards()
        rows = slice(0, 3) if rank == 0 else slice(3, 8)
        whitened = global_whiten(rewards[rows], mask[rows], DistributedReducer(), shift_mean=False)
        torch.save(whitened, os.path.join(out_dir, f"{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _ragged_rewards() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(9)
    rewards = torch.randn(8, 7, generator=g) - 0.4
    mask = (torch.arange(7) < torch.tensor([7, 7, 6, 1, 0, 3, 7, 2])[:, None]).float()
    return rewards, mask


def test_whiten_rewards_in_a_two_rank_gloo_group_equals_one_rank(tmp_path):
    """The all-reduce path itself: two processes, unequal shards, the result of one process on the batch."""
    mp.spawn(_whiten_shard_in_gloo_group, args=(2, str(tmp_path / "store"), str(tmp_path)),
             nprocs=2, join=True)
    rewards, mask = _ragged_rewards()
    two_ranks = torch.cat([torch.load(tmp_path / "0.pt"), torch.load(tmp_path / "1.pt")])
    assert torch.allclose(two_ranks, global_whiten(rewards, mask, shift_mean=False), atol=1e-6)


# ====================================================================== ppo.lr_schedule


def test_linear_lr_after_k_of_n_iterations_is_lr_times_one_minus_k_over_n():
    lr, n = 3e-4, 12
    for k in range(n):  # iteration k + 1 runs after k finished ones
        assert scheduled_lr(lr, "linear", k + 1, n) == pytest.approx(lr * (1 - k / n), rel=1e-12)
    assert scheduled_lr(lr, "linear", n, n) == pytest.approx(lr / n)  # lm-h-p's last step: lr / nupdates
    assert all(scheduled_lr(lr, "constant", i, n) == lr for i in range(1, n + 1))


def test_linear_lr_refuses_an_iteration_outside_the_run():
    for iteration in (0, 13):
        with pytest.raises(ValueError, match=f"iteration {iteration} is outside 1..12"):
            scheduled_lr(1e-3, "linear", iteration, 12)
    with pytest.raises(ValueError, match="lr_schedule"):
        scheduled_lr(1e-3, "cosine", 1, 12)  # type: ignore[arg-type]


# ====================================================================== reward.missing_eos_penalty


def test_missing_eos_penalty_replaces_the_scores_of_responses_cut_at_the_cap():
    scores = torch.tensor([0.9, -0.2, 0.4, 0.0])
    finish = torch.tensor([FINISH_STOP, FINISH_LENGTH, FINISH_LENGTH, FINISH_STOP])
    penalized_scores, penalized = penalize_missing_eos(scores, finish, -1.0)
    assert penalized_scores.tolist() == pytest.approx([0.9, -1.0, -1.0, 0.0])  # replaced, not added
    assert penalized.tolist() == [False, True, True, False]
    kept, none = penalize_missing_eos(scores, finish, None)
    assert torch.equal(kept, scores) and not none.any()
    with pytest.raises(ValueError, match="one \\[B\\] shape"):
        penalize_missing_eos(scores, finish[:3], -1.0)


# ====================================================================== config


def test_options_default_to_tethers_behaviour_and_validate():
    from pydantic import ValidationError

    from services.config import JobConfig, load_config

    cfg = JobConfig()  # GAE's rate anneals (its followed default); a rate the user sets stays constant
    assert (cfg.ppo.whiten_rewards, cfg.ppo.lr_schedule, cfg.reward.missing_eos_penalty) == \
        (False, "linear", None)
    assert load_config(None, {"ppo": {"lr": 1e-4}}).ppo.lr_schedule == "constant"
    cfg = load_config(None, {"ppo": {"whiten_rewards": True, "lr_schedule": "linear"},
                             "reward": {"missing_eos_penalty": -1}})
    assert (cfg.ppo.whiten_rewards, cfg.ppo.lr_schedule, cfg.reward.missing_eos_penalty) == \
        (True, "linear", -1.0)
    with pytest.raises(ValidationError, match="lr_schedule"):
        load_config(None, {"ppo": {"lr_schedule": "cosine"}})


# ====================================================================== a learner rank (integration)


@pytest.fixture(scope="module")
def ray_client(ray_head):
    ray = pytest.importorskip("ray")
    ray.init(address=ray_head.address, log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.mark.integration
def test_rank_penalises_whitens_and_anneals_the_lr_across_a_resume(ray_client, tiny_model_dir, tmp_path):
    """One rank with all three options: the scores of responses cut at the cap become the penalty in
    score_sum and the KL books still close; the optimizer steps at lr * (1 - k/N) at iteration k + 1, and
    a rank resumed from a checkpoint of iteration 2 steps at the same lr as the one that kept going."""
    from learner import checkpoint
    from learner.group import LearnerGroup
    from services.config import load_config
    from services.experience import make_batch
    from services.storage import RunStorage

    ray = ray_client
    lr, iterations, penalty, beta = 1e-3, 4, -1.0, 0.05
    cfg = load_config(None, {
        "rollout": {"batch_size": 16, "chunk_size": 8, "max_new_tokens": 6},
        "ppo": {"minibatch_size": 8, "epochs": 1, "lr": lr, "lr_schedule": "linear", "whiten_rewards": True},
        "reward": {"missing_eos_penalty": penalty},
        "run": {"iterations": iterations},
        "cluster": {"learner": {"num_cpus": 0.1}},
    })
    g = torch.Generator().manual_seed(3)
    lengths = [6, 2, 6, 5, 6, 1, 6, 3]
    finish = [FINISH_LENGTH if n == 6 else FINISH_STOP for n in lengths]  # the 6-token ones hit the cap
    chunks, refs, scores = [], [], []
    for c in range(2):
        prompts = [[int(x)] for x in torch.randint(1, 21, (8,), generator=g)]
        responses = [torch.randint(0, 21, (n,), generator=g).tolist() for n in lengths]
        chunks.append(ray.put(make_batch(prompts, responses, [[0.0] * n for n in lengths],
                                         finish, list(range(8)), 22, 0, beta, 6)))
        refs.append(ray.put(torch.linspace(-3.0, -1.0, 6).repeat(8, 1)))
        scores.append(ray.put(torch.linspace(0.1, 0.8, 8) * (1 - 2 * c)))
    raw = torch.cat([ray.get(s) for s in scores])
    cut = torch.tensor(finish * 2) == FINISH_LENGTH
    expected_score_sum = float(torch.where(cut, torch.full_like(raw, penalty), raw).sum())

    run = RunStorage(str(tmp_path)).child("run")
    group = LearnerGroup(RankSpec.of(cfg, tiny_model_dir), None, tag="lmhp-options")
    try:
        used = {}
        for iteration in (1, 2):
            result = train(group, chunks, refs, scores, kl_coef=beta, iteration=iteration)
            used[iteration] = result.lr
        sums = result.sums
        assert sums["score_sum"] == pytest.approx(expected_score_sum, abs=1e-5)
        assert sums["missing_eos_penalized"] == float(cut.sum()) == sums["truncated"]
        # the reported reward is the unwhitened KL-penalised one: mean_kl == -(reward - score) / beta
        assert sums["response_sum"] == \
            pytest.approx(-(sums["reward_sum"] - sums["score_sum"]) / beta, rel=1e-4)
        ckpt = checkpoint.begin(run, 2)
        checkpoint.commit(run, ckpt, group.save(ckpt.url), {"iteration": 2, "config": {}}, keep=2)
        result = train(group, chunks, refs, scores, kl_coef=beta, iteration=3)
        used[3] = result.lr
        kept_going = ray.get(group.policy_weights()).tensors()
    finally:
        for rank in group.ranks:
            ray.kill(rank)
    for iteration, value in used.items():
        assert value == pytest.approx(lr * (1 - (iteration - 1) / iterations), rel=1e-9), iteration

    resumed = LearnerGroup(RankSpec.of(cfg, tiny_model_dir), None, tag="lmhp-options-resumed")
    try:
        ckpt = checkpoint.resolve(run, "latest")
        resumed.load(ckpt.url, checkpoint.read_manifest(ckpt), saved_world_size=1)
        result = train(resumed, chunks, refs, scores, kl_coef=beta, iteration=3)
        after = ray.get(resumed.policy_weights()).tensors()
    finally:
        for rank in resumed.ranks:
            ray.kill(rank)
    # the checkpoint's optimizer holds iteration 2's lr; the schedule, not the checkpoint, sets iteration 3's
    assert result.lr == pytest.approx(used[3], rel=1e-12)
    for name, tensor in kept_going.items():
        torch.testing.assert_close(after[name], tensor, rtol=1e-5, atol=1e-6, msg=name)
