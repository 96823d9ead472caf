"""One regression test per fidelity defect that ``learner/algorithm.py`` fixed, each on the layer the learner
rank calls (``Algorithm.from_config(JobConfig)``, then ``select``, ``controller_sums``, ``prepare``), with
numbers that the old behaviour breaks; each docstring says what the old code gave. Pure torch, no Ray, no
model.

A. Distillation without the task reward on multi-turn tasks drops the turn rewards too.
B. An agent episode split into several rows is one episode (``RolloutBatch.episode_index``, ``EpisodeView``).
C. Dynamic sampling's dropped groups stay in the controller's statistic.
D. Async mode feeds the controller an unbiased estimate of KL(pi_prox || ref); the penalty identity still
   holds.
And the statistic's standard error (``kl_stats_from_sums``).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import warnings

import pytest
import torch
from torch import Tensor

from learner.advantages import grpo_advantages
from learner.algorithm import Algorithm, EpisodeView, episode_view
from learner.kl import kl_stats_from_sums
from services.config import DistillConfig, JobConfig, load_config, merge_settings
from services.experience import FINISH_LENGTH, FINISH_STOP, Episodes, RolloutBatch, concat_batches, make_batch

BETA = 0.25  # a power of two: beta * kl is exact where kl is dyadic
ENVIRONMENT = {"task": {"name": "environment", "environment": "m:f"}}
AGENT = {"task": {"name": "agent", "path": "rows.jsonl"}, "rollout": {"agent": "m:agent"},
         "model": {"path": "p"}}
NO_TASK_REWARD = {"distill": {"teacher_path": "t", "task_reward": False}}
GRPO = {"ppo": {"advantage": "grpo"}, "rollout": {"samples_per_prompt": 2}}
PLAIN_GAE = {"ppo": {"gamma": 1.0, "lam": 1.0, "whiten_advantages": False}}


def merged(*parts: dict) -> dict:
    return functools.reduce(merge_settings, parts, {})


def config(*parts: dict) -> JobConfig:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return load_config(None, merged(*parts))


def layer(*parts: dict) -> Algorithm:
    return Algorithm.from_config(config(*parts))


def rows(masks: list[list[int]], width: int, *, old: Tensor, ref: Tensor, behaviour: Tensor | None = None,
         teacher: Tensor | None = None, values: Tensor | None = None, scores: list[float] | None = None,
         turn_rewards: Tensor | None = None, group_index: list[int] | None = None,
         episode_index: list[int] | None = None, finish: list[int] | None = None) -> RolloutBatch:
    """A float64 batch of rows with these action masks ([B, width] tensors for the per-token fields, masked
    here; ``behaviour`` None: the engine's log-probs are the learner's, as in sync mode)."""
    b = len(masks)
    mask = torch.tensor([m + [0] * (width - len(m)) for m in masks], dtype=torch.float64)
    batch = make_batch([[5]] * b, [[1] * len(m) for m in masks], [[0.0] * len(m) for m in masks],
                       finish or [FINISH_STOP] * b, list(range(b)), 0, 0, BETA, response_width=width,
                       group_index=group_index, action_masks=masks, episode_index=episode_index,
                       episodes=None if turn_rewards is None else Episodes([[0.0]] * b, [2] * b,
                                                                           [0] * b, [0.0] * b, [0] * b))
    batch.action_mask = mask
    batch.response_mask = (torch.arange(width) < torch.tensor([len(m) for m in masks]).unsqueeze(-1)).double()
    batch.old_logprobs = old.double() * mask
    batch.ref_logprobs = ref.double() * mask
    batch.rollout_logprobs = (old if behaviour is None else behaviour).double() * mask
    batch.teacher_logprobs = (old if teacher is None else teacher).double() * mask
    batch.old_values = (torch.zeros(b, width) if values is None else values).double() * mask
    if turn_rewards is not None:
        batch.turn_rewards = turn_rewards.double()
        batch.scores = batch.turn_rewards.sum(-1)
    else:
        batch.scores = torch.tensor(scores if scores is not None else [0.0] * b, dtype=torch.float64)
    return batch


def dyadic(g: torch.Generator, *shape: int, low: int = -12, high: int = 1) -> Tensor:
    """Multiples of 1/8: their sums and products by BETA are exact in float64, so sums compare with ==."""
    return torch.randint(low, high, shape, generator=g).double() / 8


# ==================================================================== A. distillation without the task reward


def trajectories() -> RolloutBatch:
    """Four two-turn trajectories (an environment token between the turns), each turn's reward on its last
    model token: 2.5 in row 0 (1.0 + 1.5), 0.5, 1.0 and -0.5; two groups of 2."""
    g = torch.Generator().manual_seed(11)
    masks = [[1, 1, 0, 0, 1, 1], [1, 0, 1, 1], [1, 1, 1, 0, 1], [1, 0, 0, 1, 1, 1]]
    turn_rewards = torch.zeros(4, 6, dtype=torch.float64)
    for row, col, reward in [(0, 1, 1.0), (0, 5, 1.5), (1, 0, -0.5), (1, 3, 1.0), (2, 2, 0.25), (2, 4, 0.75),
                             (3, 0, -1.0), (3, 5, 0.5)]:
        turn_rewards[row, col] = reward
    old = -torch.rand(4, 6, generator=g, dtype=torch.float64)
    return rows(masks, 6, old=old, ref=old + 0.4 * torch.randn(4, 6, generator=g, dtype=torch.float64),
                teacher=old + 0.4 * torch.randn(4, 6, generator=g, dtype=torch.float64),
                values=torch.randn(4, 6, generator=g, dtype=torch.float64), turn_rewards=turn_rewards,
                group_index=[0, 0, 1, 1])


def without_task(batch: RolloutBatch) -> RolloutBatch:
    out = batch.clone()
    out.scores = torch.zeros_like(out.scores)
    out.turn_rewards = torch.zeros_like(out.turn_rewards)
    return out


@pytest.mark.parametrize("estimator", ["gae", "grpo"])
def test_distillation_without_the_task_reward_trains_on_no_turn_reward(estimator):
    """``distill.task_reward: false`` on an environment's task: the advantages are exactly those of the same
    batch with its scores and turn rewards zeroed; the reward is the KL penalty alone, while the task's scores
    are still logged.

    Old code: it zeroed ``scores`` only, and the turn rewards (which replace the scores' placement) went on
    into the per-token rewards: ``reward_sum`` held the batch's 3.5 of task reward (2.5 in row 0 alone), and
    the advantages moved by up to 1.12 (GAE, whitened) and 0.71 (GRPO) from the teacher-only ones."""
    algorithm = layer(ENVIRONMENT, NO_TASK_REWARD, GRPO if estimator == "grpo" else {})
    batch = trajectories()
    zeroed = without_task(batch)
    sums = algorithm.prepare(batch, BETA)
    algorithm.prepare(zeroed, BETA)
    assert torch.equal(batch.advantages, zeroed.advantages)
    assert (batch.returns is None) == (estimator == "grpo")
    if batch.returns is not None:
        assert torch.equal(batch.returns, zeroed.returns)
    assert sums["reward_sum"] == pytest.approx(-BETA * sums["penalty_sum"], abs=1e-12)  # no task reward in it
    assert sums["score_sum"] == 3.5  # still logged

    # the old path: the scores zeroed, the turn rewards kept (the layer with the task reward, on zeroed
    # scores)
    old = dataclasses.replace(algorithm, distill=DistillConfig(teacher_path="t", task_reward=True))
    stale = batch.clone()
    stale.scores = torch.zeros_like(stale.scores)
    row0 = stale[:1].clone()
    old_sums = old.prepare(stale, BETA)
    assert old_sums["reward_sum"] - sums["reward_sum"] == pytest.approx(3.5, abs=1e-12)
    row0_sums = old.prepare(row0, BETA) if estimator == "gae" else None
    if row0_sums is not None:
        assert row0_sums["reward_sum"] + BETA * row0_sums["penalty_sum"] == pytest.approx(2.5, abs=1e-12)
    moved = float((stale.advantages - batch.advantages).abs().max())
    assert moved > 0.5, moved


# ==================================================================== B. an agent episode split into rows

WIDTH = 4


def agent_rows(episode_index: list[int], masks: list[list[int]], rewarded: dict[int, tuple[int, float]],
               group_index: list[int] | None = None, seed: int = 3, async_mode: bool = False) -> RolloutBatch:
    """Rows of agent episodes (width 4): ``rewarded`` {row: (column, reward)}, an episode's reward on its last
    row's last model token only."""
    g = torch.Generator().manual_seed(seed)
    b = len(masks)
    old = -torch.rand(b, WIDTH, generator=g, dtype=torch.float64)
    turn_rewards = torch.zeros(b, WIDTH, dtype=torch.float64)
    for row, (col, reward) in rewarded.items():
        turn_rewards[row, col] = reward
    behaviour = old + 0.5 * torch.randn(b, WIDTH, generator=g, dtype=torch.float64) if async_mode else None
    return rows(masks, WIDTH, old=old,
                ref=old + 0.5 * torch.randn(b, WIDTH, generator=g, dtype=torch.float64), behaviour=behaviour,
                turn_rewards=turn_rewards, group_index=group_index, episode_index=episode_index)


def laid_in_one_row(split: RolloutBatch) -> RolloutBatch:
    """The same episodes, each as one row of width 2 * WIDTH (its rows end to end, as ``EpisodeView`` lays
    them)."""
    view = episode_view(split)
    out = split[(view.slot == 0).nonzero().squeeze(-1)].clone()  # an episode's first row, in episode order
    for name in ("response_ids", "response_mask", "action_mask", "rollout_logprobs",
                 "old_logprobs", "ref_logprobs", "teacher_logprobs", "old_values", "turn_rewards"):
        setattr(out, name, view.merge(getattr(split, name)))
    out.scores = view.total(split.scores)
    out.episode_index = torch.arange(view.episodes)
    return out


def split_episode() -> RolloutBatch:
    """Episode 0 is two rows (the environment's token opens the second), episode 1 one row; rewards 1.0 and
    0.75 on each episode's last model token."""
    return agent_rows([0, 0, 1], [[1, 1], [0, 1, 1], [1, 1, 1]], {1: (2, 1.0), 2: (2, 0.75)})


def test_a_split_agent_episode_counts_once_in_the_controller_and_the_sums():
    """The controller's statistic counts episodes (2), over all rows' tokens; ``prepare`` gives 2 trained
    episodes and the two episodes' rewards as ``score_sum``.

    Old code: one row, one response: ``num_responses`` 3 and ``trained_episodes`` 3, so the controller's mean
    KL was the per-row mean (here 2/3 of the per-episode one) and the adaptive controller's step counted
    rows."""
    algorithm = layer(AGENT, PLAIN_GAE)
    split = split_episode()
    sums = algorithm.controller_sums(split)
    assert sums["num_responses"] == 2
    assert sums["response_sum"] == pytest.approx(float(((split.old_logprobs - split.ref_logprobs)
                                                        * split.action_mask).sum()), abs=1e-12)
    assert sums == algorithm.controller_sums(laid_in_one_row(split))
    rowwise = algorithm.controller_sums(agent_rows([0, 1, 2], [[1, 1], [0, 1, 1], [1, 1, 1]],
                                                   {1: (2, 1.0), 2: (2, 0.75)}))
    assert rowwise["num_responses"] == 3  # what the old code counted
    prepared = algorithm.prepare(split, BETA)
    assert prepared["trained_episodes"] == 2 and prepared["penalty_episodes"] == 2
    assert prepared["score_sum"] == 1.75


def test_a_split_agent_episode_gets_the_credit_of_one_trajectory_gae():
    """GAE at gamma = lambda = 1, values 0, unwhitened: the first row's advantages hold the second row's KL
    penalties and the episode's reward, exactly as the same tokens laid in one row.

    Old code: each row its own trajectory: row 0's first advantage was its own penalty alone (-0.07 here)
    instead of the episode's return (1.09), so the first model call never saw the episode's reward."""
    algorithm = layer(AGENT, PLAIN_GAE)
    split, one_row = split_episode(), laid_in_one_row(split_episode())
    algorithm.prepare(split, BETA)
    algorithm.prepare(one_row, BETA)
    assert torch.equal(split.advantages, episode_view(split).split(one_row.advantages))
    assert torch.equal(split.returns, episode_view(split).split(one_row.returns))
    kl = (split.old_logprobs - split.ref_logprobs) * split.action_mask
    episode_return = 1.0 - BETA * float(kl[:2].sum())
    assert float(split.advantages[0, 0]) == pytest.approx(episode_return, abs=1e-12)
    rowwise = agent_rows([0, 1, 2], [[1, 1], [0, 1, 1], [1, 1, 1]], {1: (2, 1.0), 2: (2, 0.75)})
    algorithm.prepare(rowwise, BETA)
    assert float(rowwise.advantages[0, 0]) == pytest.approx(-BETA * float(kl[0].sum()), abs=1e-12)
    assert abs(float(rowwise.advantages[0, 0]) - episode_return) > 0.5


def test_a_split_agent_episode_is_one_member_of_its_grpo_group():
    """GRPO, two groups of two episodes, episode 0 split in two rows: the advantages are those of the batch
    with each episode in one row (the group's mean and std over episodes; the split episode's rows share its
    one).

    Old code: rows as episodes, group 0 held three "episodes" (its mean and std took the reward-less first
    row), and that first row got a negative advantage (-0.78 here) while its episode's is positive (+0.56)."""
    episode_index, groups = [0, 0, 1, 2, 3], [0, 0, 0, 1, 1]
    masks = [[1, 1], [0, 1, 1], [1, 1, 1], [1, 1], [1, 1, 1, 1]]
    rewarded = {1: (2, 1.0), 2: (2, 0.0), 3: (1, 0.5), 4: (3, -0.5)}
    algorithm = layer(AGENT, GRPO)
    split = agent_rows(episode_index, masks, rewarded, groups)
    one_row = laid_in_one_row(split)
    assert one_row.group_index.tolist() == [0, 0, 1, 1]
    algorithm.prepare(split, BETA)
    algorithm.prepare(one_row, BETA)
    assert torch.equal(split.advantages, episode_view(split).split(one_row.advantages))
    assert float(split.advantages[0, 0]) > 0.5
    # the rows as episodes, as the old code took them
    mask = split.action_mask
    kl = (split.old_logprobs - split.ref_logprobs) * mask
    rowwise = grpo_advantages(split.turn_rewards - BETA * kl, mask, split.group_index, -BETA * kl)
    assert float(rowwise[0, 0]) < -0.5


def test_episode_view_on_unordered_ids_and_its_merge_split_round_trip():
    """Any ids, an episode's rows in row order: episodes numbered by their first row, slots by row order
    within."""
    view = EpisodeView.of(torch.tensor([7, 3, 7, 5, 3, 9]), 2)
    assert not view.trivial and (view.episodes, view.slots) == (4, 2)
    assert view.episode.tolist() == [0, 1, 0, 2, 1, 3] and view.slot.tolist() == [0, 0, 1, 0, 1, 0]
    x = torch.arange(1.0, 13.0).reshape(6, 2)
    laid = view.merge(x)
    assert laid.tolist() == [[1, 2, 5, 6], [3, 4, 9, 10], [7, 8, 0, 0], [11, 12, 0, 0]]
    assert torch.equal(view.split(laid), x)
    assert view.total(torch.tensor([1.0, 2, 4, 8, 16, 32])).tolist() == [5, 18, 8, 32]
    assert view.first(torch.tensor([10, 20, 30, 40, 50, 60])).tolist() == [10, 20, 40, 60]
    x.requires_grad_(True)
    (view.merge(x) * torch.arange(16.0).reshape(4, 4)).sum().backward()  # differentiable: each row its slot
    assert x.grad.tolist() == [[0, 1], [4, 5], [2, 3], [8, 9], [6, 7], [12, 13]]
    trivial = EpisodeView.of(torch.tensor([4, 1, 2]), 2)
    assert trivial.trivial and trivial.merge(x) is x and trivial.split(x) is x


def test_concatenated_chunks_keep_their_episodes_apart():
    """Each chunk numbers its episodes from 0 (an engine's chunk): concatenated, the ids stay distinct.

    Old code: the ids were concatenated as they were, so chunk 1's episode 0 and chunk 2's episode 0 were one
    episode of four rows (2 episodes counted instead of 4)."""
    first = split_episode()
    second = agent_rows([4, 4, 6], [[1, 1], [0, 1, 1], [1, 1, 1]], {1: (2, 0.5), 2: (2, 0.25)}, seed=4)
    third = agent_rows([0, 0, 1], [[1, 1], [0, 1, 1], [1, 1, 1]], {1: (2, 0.5), 2: (2, 0.25)}, seed=5)
    batch = concat_batches([first, second, third])
    ids = batch.episode_index.tolist()
    assert ids[:3] == [0, 0, 1] and len(set(ids[:3]) & set(ids[3:6])) == 0 and \
        len(set(ids[3:6]) & set(ids[6:])) == 0
    assert ids[3] == ids[4] != ids[5] and ids[6] == ids[7] != ids[8]
    assert episode_view(batch).episodes == 6
    assert layer(AGENT).controller_sums(batch)["num_responses"] == 6
    collided = torch.cat([first, third])  # what the old concatenation kept
    assert episode_view(collided).episodes == 2


# ==================================================================== C. dynamic sampling's dropped groups


def four_groups() -> RolloutBatch:
    """4 groups of 2: groups 1 and 3 tie (equal scores) and hold a large KL (1 nat a token), groups 0 and 2
    differ with a small one; dyadic log-probs, so every sum is exact."""
    g = torch.Generator().manual_seed(5)
    masks = [[1, 1, 1], [1, 1], [1, 1, 1, 1], [1], [1, 1], [1, 1, 1], [1, 1, 1, 1], [1, 1]]
    old = dyadic(g, 8, 4)
    gap = torch.where(torch.tensor([0, 0, 1, 1, 0, 0, 1, 1]).bool().unsqueeze(-1), 1.0,
                      dyadic(g, 8, 4, low=-1, high=2))
    return rows(masks, 4, old=old, ref=old - gap, scores=[1.0, 0.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.0],
                group_index=[0, 0, 1, 1, 2, 2, 3, 3])


@pytest.mark.parametrize("estimator", ["grpo", "rloo"])
def test_dynamic_sampling_keeps_the_dropped_groups_in_the_controller_statistic(estimator):
    """``select`` keeps the two groups whose scores differ; ``controller_sums(kept, dropped)`` is the whole
    batch's, exactly (the tied groups are not a selection on the KL).

    Old code: the statistic of the kept rows alone: 4 episodes of KL 0.125 on average instead of 8 of 1.4375,
    so a controller fed it saw a twelfth of the KL the policy had (the tied groups are where it had moved)."""
    algorithm = layer({"ppo": {"advantage": estimator},
                       "rollout": {"samples_per_prompt": 2, "dynamic_sampling": True}})
    batch = four_groups()
    assert algorithm.differing_groups(batch) == 2
    keep, counts = algorithm.select(batch, 2)
    assert keep.tolist() == [True, True, False, False, True, True, False, False]
    assert counts == {"tied": 2, "filled": 0, "surplus": 0}
    kept, dropped = batch[keep.nonzero().squeeze(-1)], batch[(~keep).nonzero().squeeze(-1)]
    whole = algorithm.controller_sums(batch)
    both = algorithm.controller_sums(kept, dropped)
    assert both.keys() == whole.keys()
    for key in whole:
        if key.startswith("k3"):  # expm1 is not dyadic: the sum's association may differ in its last bit
            assert both[key] == pytest.approx(whole[key], rel=1e-14), key
        else:
            assert both[key] == whole[key], key
    old = kl_stats_from_sums(algorithm.controller_sums(kept))
    new = kl_stats_from_sums(both)
    assert (old["num_responses"], new["num_responses"]) == (4, 8)
    assert new["response_mean"] == 1.4375 and old["response_mean"] == 0.125


# ==================================================================== D. async: the statistic of pi_prox

EOS = 2
PREFIXES = {prefix: i for i, prefix in enumerate([(), (0,), (1,), (0, 0), (0, 1), (1, 0), (1, 1)])}


def responses() -> list[tuple[int, ...]]:
    """Every response of up to 3 tokens over {0, 1, EOS}: EOS ends it, 3 tokens without EOS are cut (15)."""
    out = [(EOS,)]
    for n in (1, 2):
        for prefix in itertools.product((0, 1), repeat=n):
            out += [(*prefix, EOS)] + ([(*prefix, t) for t in (0, 1)] if n == 2 else [])
    return out


def token_logprobs(table: Tensor, y: tuple[int, ...]) -> Tensor:
    logp = torch.log_softmax(table, -1)
    return torch.stack([logp[PREFIXES[y[:t]], y[t]] for t in range(len(y))])


def exact_kl(p: Tensor, q: Tensor) -> float:
    """KL(p || q) of whole responses, by enumeration."""
    total = 0.0
    for y in responses():
        lp, lq = float(token_logprobs(p, y).sum()), float(token_logprobs(q, y).sum())
        total += math.exp(lp) * (lp - lq)
    return total


def enumeration(behaviour: Tensor, proximal: Tensor, reference: Tensor) -> tuple[RolloutBatch, Tensor]:
    """Every response as a row, sampled by ``behaviour``, scored 1 where it ends with EOS: (batch, each row's
    probability under the behaviour policy)."""
    ys = responses()

    def stack(table: Tensor) -> Tensor:
        return torch.stack([torch.nn.functional.pad(token_logprobs(table, y), (0, 3 - len(y))) for y in ys])

    batch = rows([[1] * len(y) for y in ys], 3, old=stack(proximal), ref=stack(reference),
                 behaviour=stack(behaviour), scores=[float(y[-1] == EOS) for y in ys],
                 finish=[FINISH_STOP if y[-1] == EOS else FINISH_LENGTH for y in ys])
    weight = torch.stack([token_logprobs(behaviour, y).sum() for y in ys]).exp()
    return batch, weight


def tables(seed: int) -> tuple[Tensor, Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    proximal = torch.randn(7, 3, generator=g, dtype=torch.float64)
    return proximal + torch.randn(7, 3, generator=g, dtype=torch.float64), proximal, \
        torch.randn(7, 3, generator=g, dtype=torch.float64)


ASYNC = {"rollout": {"mode": "async"}}


@pytest.mark.parametrize("estimator", ["k1", "k3"])
def test_async_controller_statistic_is_unbiased_for_the_proximal_policy(estimator):
    """Exact expectation under the behaviour policy b (the engine's older version) of ``controller_values``:
    KL(p || ref), p the proximal policy the learner optimises (1e-9).

    Old code: k1 of p's log-probs on b's samples, unweighted, whose expectation is KL(b || ref) - KL(b || p):
    here 0.68 against the true 1.34."""
    behaviour, proximal, reference = tables(7)
    algorithm = layer(ASYNC, {"kl": {"estimator": estimator}})
    batch, weight = enumeration(behaviour, proximal, reference)
    assert float(weight.sum()) == pytest.approx(1.0, abs=1e-12)
    truth = exact_kl(proximal, reference)
    assert float((weight * algorithm.controller_values(batch)).sum()) == pytest.approx(truth, abs=1e-9)
    old = float((weight * ((batch.old_logprobs - batch.ref_logprobs) * batch.action_mask).sum(-1)).sum())
    assert old == pytest.approx(exact_kl(behaviour, reference) - exact_kl(behaviour, proximal), abs=1e-9)
    assert abs(old - truth) > 0.05, (old, truth)


def test_async_old_statistic_can_be_negative_near_the_reference():
    """p near ref (KL(p || ref) = 0.0016 > 0), b far from both toward the tokens p likes less than ref: the
    old statistic's expectation was negative (-0.085), which no KL is; the weighted one is the true KL."""
    g = torch.Generator().manual_seed(1)
    reference = torch.randn(7, 3, generator=g, dtype=torch.float64)
    direction = torch.randn(7, 3, generator=g, dtype=torch.float64)
    proximal = reference + 0.1 * direction
    behaviour = proximal - 3.0 * direction
    batch, weight = enumeration(behaviour, proximal, reference)
    truth = exact_kl(proximal, reference)
    old = float((weight * ((batch.old_logprobs - batch.ref_logprobs) * batch.action_mask).sum(-1)).sum())
    assert truth > 0 and old < -0.05, (truth, old)
    assert float((weight * layer(ASYNC).controller_values(batch)).sum()) == pytest.approx(truth, abs=1e-9)


def test_async_penalty_identity_holds():
    """Async mode: the reward the layer builds is the score minus beta times the KL it logs as penalised,
    ``reward_sum == score_sum - beta * penalty_sum``: the penalty is the unweighted k1 of p (which the PPO
    ratio and the rollout correction turn into the KL's policy gradient), not the controller's weighted
    statistic (which would break the identity by 0.96 here)."""
    behaviour, proximal, reference = tables(7)
    algorithm = layer(ASYNC)
    batch, _ = enumeration(behaviour, proximal, reference)
    weighted = algorithm.controller_sums(batch)["response_sum"]
    sums = algorithm.prepare(batch, BETA)
    assert sums["reward_sum"] == \
        pytest.approx(sums["score_sum"] - BETA * sums["penalty_sum"], rel=1e-14, abs=1e-14)
    assert sums["penalty_sum"] == pytest.approx(float(((batch.old_logprobs - batch.ref_logprobs)
                                                        * batch.action_mask).sum()), rel=1e-14)
    assert abs(BETA * (weighted - sums["penalty_sum"])) > 0.1
    # exactly, on dyadic log-probs
    g = torch.Generator().manual_seed(2)
    old = dyadic(g, 6, 4)
    exact = rows([[1] * n for n in (4, 3, 2, 4, 1, 2)], 4, old=old, ref=old - dyadic(g, 6, 4, low=-8, high=9),
                 behaviour=old + dyadic(g, 6, 4, low=-4, high=5), scores=[1.0, 0.5, -0.25, 0.0, 2.0, 1.0])
    sums = algorithm.prepare(exact, BETA)
    assert sums["reward_sum"] == sums["score_sum"] - BETA * sums["penalty_sum"]


# ==================================================================== the statistic's standard error


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_response_stderr_is_the_standard_error_of_the_episode_values(mode):
    """``kl_stats_from_sums``' ``response_stderr`` is std / sqrt(n) of the per-episode values the controller
    averages (unbiased std; episodes, the split agent episode as one). The old code reported no standard
    error."""
    algorithm = layer(AGENT, {"rollout": {"mode": mode}})
    batch = agent_rows([0, 0, 1, 2, 3, 3, 4],
                       [[1, 1], [0, 1, 1], [1, 1, 1], [1], [1, 1, 0, 1], [0, 1], [1, 1, 1, 1]], {},
                       async_mode=mode == "async", seed=9)
    values = algorithm.controller_values(batch)
    assert values.shape == (5,)
    stats = kl_stats_from_sums(algorithm.controller_sums(batch))
    assert stats["num_responses"] == 5
    assert stats["response_mean"] == pytest.approx(float(values.mean()), rel=1e-12)
    assert stats["response_stderr"] == pytest.approx(float(values.std() / math.sqrt(5)), rel=1e-9)
    assert stats["response_stderr"] > 0.01
