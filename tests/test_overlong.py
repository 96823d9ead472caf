"""DAPO's overlong handling, each off by default: the soft overlong punishment added to the score
(``reward.overlong_buffer``, ``reward.overlong_penalty``; the DAPO paper's eq. 13) and overlong filtering, the
responses cut at ``rollout.max_new_tokens`` left out of the policy and value losses (``ppo.mask_truncated``)
while their KL still counts in the controller's statistic. Pure torch and the config, plus (integration) one
learner rank whose reported loss and sums are checked against values worked out by hand."""

from __future__ import annotations

import math

import pytest
import torch

from learner.ppo import overlong_penalty, truncated_loss_mask
from services.experience import FINISH_LENGTH, FINISH_STOP
from tests.conftest import train

# =================================================================== reward.overlong_buffer, overlong_penalty


def test_overlong_penalty_is_dapo_eq_13_by_hand():
    # Lmax 20, buffer 4: free up to 16 tokens, then a quarter of the penalty per token, the whole of it from
    # 20 on
    lengths = torch.tensor([0, 10, 16, 17, 18, 19, 20, 24])
    assert overlong_penalty(lengths, 20, 4, 1.0).tolist() == [0.0, 0.0, 0.0, -0.25, -0.5, -0.75, -1.0, -1.0]
    assert overlong_penalty(lengths, 20, 4, 0.5).tolist() == \
        [0.0, 0.0, 0.0, -0.125, -0.25, -0.375, -0.5, -0.5]
    # a buffer of 3 in 9 (the randomwalks cap): 7 tokens pay 1/3, 8 pay 2/3, 9 pay it all
    third = overlong_penalty(torch.tensor([6, 7, 8, 9]), 9, 3, 0.6)
    assert torch.allclose(third, torch.tensor([0.0, -0.2, -0.4, -0.6]), atol=1e-7)


@pytest.mark.parametrize("buffer, penalty, message", [
    (0, 1.0, r"overlong buffer 0 must be in \(0, 9\)"),
    (9, 1.0, r"overlong buffer 9 must be in \(0, 9\)"),
    (3, 0.0, "overlong penalty 0.0 must be > 0"),
    (3, -1.0, "overlong penalty -1.0 must be > 0"),
])
def test_overlong_penalty_refuses_a_buffer_or_penalty_that_means_nothing(buffer, penalty, message):
    with pytest.raises(ValueError, match=message):
        overlong_penalty(torch.tensor([5]), 9, buffer, penalty)


# =================================================================== ppo.mask_truncated


def test_truncated_loss_mask_drops_exactly_the_rows_cut_at_the_cap():
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [1.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    finish = torch.tensor([FINISH_STOP, FINISH_LENGTH, FINISH_STOP, FINISH_STOP])
    expected = torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0], [1.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    assert torch.equal(truncated_loss_mask(mask, finish), expected)
    with pytest.raises(ValueError, match=r"finish_reason \(3,\) must be \[B\] of mask \(4, 3\)"):
        truncated_loss_mask(mask, finish[:3])


# =================================================================== the config

GROUPS = {"ppo": {"advantage": "grpo"}, "rollout": {"samples_per_prompt": 4}}
ENV = {"name": "environment", "environment": "services.environments.randomwalks:interactive_randomwalks"}


@pytest.mark.parametrize("overrides, message", [
    ({"reward": {"overlong_buffer": 3}}, "reward.overlong_buffer and reward.overlong_penalty go together"),
    ({"reward": {"overlong_penalty": 1.0}}, "reward.overlong_buffer and reward.overlong_penalty go together"),
    ({"reward": {"overlong_buffer": 3, "overlong_penalty": -1.0}},
     "reward.overlong_penalty=-1.0 must be > 0"),
    ({"reward": {"overlong_buffer": 3, "overlong_penalty": 0.0}}, "reward.overlong_penalty=0.0 must be > 0"),
    ({"reward": {"overlong_buffer": 3, "overlong_penalty": 1.0}},
     "reward.overlong_buffer needs rollout.max_new_tokens"),
    ({"reward": {"overlong_buffer": 9, "overlong_penalty": 1.0}, "rollout": {"max_new_tokens": 9}},
     "reward.overlong_buffer=9 must be less than rollout.max_new_tokens=9"),
    ({"reward": {"overlong_buffer": 3, "overlong_penalty": 1.0, "missing_eos_penalty": -1.0},
      "rollout": {"max_new_tokens": 9}},
     "reward.overlong_buffer and reward.missing_eos_penalty both penalise"),
    ({"ppo": {"mask_truncated": True}, "reward": {"missing_eos_penalty": -1.0}},
     "would reach only their group's baseline"),
    ({"ppo": {"mask_truncated": True}, "kl": {"placement": "loss", "loss_form": "kl_to_go"}},
     "ppo.mask_truncated with kl.placement='loss' is refused"),
    ({"task": ENV, "reward": {"overlong_buffer": 3, "overlong_penalty": 1.0},
      "rollout": {"max_new_tokens": 9}},
     "reward.overlong_buffer is set but task.name='environment'"),
    ({"task": ENV, "ppo": {"mask_truncated": True}}, "ppo.mask_truncated is for single responses"),
])
def test_overlong_settings_that_make_no_sense_are_refused_naming_the_fields(overrides, message):
    from pydantic import ValidationError

    from services.config import load_config

    with pytest.raises(ValidationError, match=message.replace("(", "\\(").replace(")", "\\)")):
        load_config(None, overrides)


def test_overlong_handling_is_off_by_default_and_accepted_with_groups():
    from services.config import load_config

    default = load_config(None, {})
    assert (default.ppo.mask_truncated, default.reward.overlong_buffer, default.reward.overlong_penalty) == (
        False, None, None)
    cfg = load_config(None, {**GROUPS, "ppo": {"advantage": "grpo", "mask_truncated": True},
                             "reward": {"overlong_buffer": 3, "overlong_penalty": 1.0},
                             "rollout": {"samples_per_prompt": 4, "max_new_tokens": 9}})
    assert (cfg.ppo.mask_truncated, cfg.reward.overlong_buffer, cfg.reward.overlong_penalty) == (True, 3, 1.0)


# =================================================================== on a learner rank

# two groups of 4; lengths against a cap of 6 (the 6-token ones were cut there, without EOS)
LENGTHS = [3, 5, 6, 6, 2, 4, 5, 6]
SCORES = [1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.5]


def _grpo_loss_by_hand(scores: list[float], lengths: list[int], trained: list[bool]) -> float:
    """-sum A_i L_i / sum L_i over the trained rows: the first step's clipped surrogate at ratio 1 with the
    token mean, A_i = (s_i - mean) / (unbiased std + 1e-6) within each group of 4, beta 0."""
    advantages = []
    for g in (0, 4):
        group = scores[g:g + 4]
        mean = sum(group) / 4
        std = math.sqrt(sum((s - mean) ** 2 for s in group) / 3)
        advantages += [(s - mean) / (std + 1e-6) for s in group]
    rows = [i for i in range(8) if trained[i]]
    return -sum(advantages[i] * lengths[i] for i in rows) / sum(lengths[i] for i in rows)


@pytest.mark.integration
def test_rank_adds_the_overlong_penalty_masks_the_truncated_rows_from_the_loss_and_keeps_their_kl(
        rank_pool, tiny_model_dir):
    """One GRPO step (one epoch, one minibatch, beta 0) on two groups with cut responses, twice from the same
    weights: plain, then with the soft penalty (buffer 2 of 6, penalty 0.5) and ``ppo.mask_truncated``. The
    reported policy loss is the one worked out by hand over the rows each trains on; the KL statistics (what
    the controller is fed) cover every row in both, the cut ones included, and are the same in both."""
    import ray

    from services.config import load_config
    from services.experience import make_batch

    g = torch.Generator().manual_seed(5)
    finish = [FINISH_LENGTH if n == 6 else FINISH_STOP for n in LENGTHS]
    prompts = [[int(x)] for x in torch.randint(1, 21, (8,), generator=g)]
    responses = [torch.randint(1, 21, (n,), generator=g).tolist() for n in LENGTHS]
    chunk = make_batch(prompts, responses, [[0.0] * n for n in LENGTHS], finish,
                       list(range(8)), 22, 0, 0.0, 6, group_index=[0] * 4 + [1] * 4)
    refs = [ray.put(torch.linspace(-3.0, -1.0, 6).repeat(8, 1))]
    scores = [ray.put(torch.tensor(SCORES))]
    base = {"rollout": {"batch_size": 8, "chunk_size": 8, "samples_per_prompt": 4, "max_new_tokens": 6},
            "ppo": {"advantage": "grpo", "minibatch_size": 8, "epochs": 1, "correction": "none"},
            "cluster": {"learner": {"num_cpus": 0.1}}}
    dapo = {**base, "ppo": {**base["ppo"], "mask_truncated": True},
            "reward": {"overlong_buffer": 2, "overlong_penalty": 0.5}}
    results = {}
    for name, overrides in (("plain", base), ("dapo", dapo)):
        group = rank_pool.group(load_config(None, overrides), tiny_model_dir, tag=f"overlong-{name}")
        results[name] = train(group, [ray.put(chunk)], refs, scores, kl_coef=0.0, iteration=1)
    plain, dapo_result = results["plain"], results["dapo"]

    # by hand: past 6 - 2 = 4 tokens, half the penalty of 0.5 per token: 5 tokens pay 0.25, 6 pay 0.5
    penalties = [0.0, -0.25, -0.5, -0.5, 0.0, 0.0, -0.25, -0.5]
    shaped = [s + p for s, p in zip(SCORES, penalties, strict=True)]
    cut = [n == 6 for n in LENGTHS]
    assert plain.ppo["policy_loss"] == \
        pytest.approx(_grpo_loss_by_hand(SCORES, LENGTHS, [True] * 8), abs=1e-5)
    assert dapo_result.ppo["policy_loss"] == pytest.approx(
        _grpo_loss_by_hand(shaped, LENGTHS, [not c for c in cut]), abs=1e-5)
    sums = dapo_result.sums
    assert sums["score_sum"] == pytest.approx(sum(shaped), abs=1e-6)
    assert sums["overlong_penalty_sum"] == pytest.approx(sum(penalties), abs=1e-6)
    assert sums["overlong_penalized"] == 5 and sums["truncated_masked"] == sum(cut) == sums["truncated"] == 3
    assert "overlong_penalty_sum" not in plain.sums and "truncated_masked" not in plain.sums
    # the controller's statistic: every row's KL, the cut ones' too, whatever the loss trained on
    assert sums["num_responses"] == plain.sums["num_responses"] == 8
    assert sums["num_tokens"] == plain.sums["num_tokens"] == sum(LENGTHS)
    for key in ("response_sum", "k1_response_sum", "k3_response_sum"):
        assert sums[key] == pytest.approx(plain.sums[key], rel=1e-6, abs=1e-6), key
