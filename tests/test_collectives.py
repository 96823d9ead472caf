"""Collectives of W DeepSpeed ranks on gloo (real Ray, real DeepSpeed): what W ranks compute equals what
one rank would, a lost chunk under ZeRO-3 never deadlocks, and the weight-transfer announcement of a
ZeRO-3 group carries the full HF shapes. The same checks on CUDA are in tests/test_gpu.py."""

from __future__ import annotations

import pytest
import torch

from learner.plan import RankSpec
from tests.conftest import chunk_refs, train

pytestmark = pytest.mark.integration

ray = pytest.importorskip("ray")


def group_config(world_size: int, zero_stage: int, **overrides):
    from services.config import load_config

    learner = {"world_size": world_size, "zero_stage": zero_stage, "collective_timeout_s": 300}
    base = {
        "rollout": {"batch_size": 16, "chunk_size": 8, "max_new_tokens": 6},
        "ppo": {"minibatch_size": 16, "epochs": 1, "lr": 1e-3},
        "cluster": {"learner": {"num_cpus": 0.1}},
    }
    learner.update(overrides.pop("learner", {}))
    return load_config(None, {**base, "learner": learner, **overrides})


def uneven_chunks(seed: int = 0):
    """Slot 0 (rank 0 of two) holds long responses, slot 1 (rank 1) short ones, two of them empty: 8 rows
    each."""
    from services.experience import make_batch

    g = torch.Generator().manual_seed(seed)
    chunks = []
    for lengths in ([6, 6, 5, 6, 6, 4, 6, 6], [1, 2, 0, 1, 3, 1, 2, 0]):
        prompts = [[int(x)] for x in torch.randint(1, 21, (8,), generator=g)]
        responses = [torch.randint(0, 21, (n,), generator=g).tolist() for n in lengths]
        chunks.append(make_batch(prompts, responses, [[0.0] * n for n in lengths], [1] * 8,
                                 list(range(8)), 22, 0, 0.05, 6))
    return chunks


def train_once(rank_pool, cfg, model_dir: str, chunks):
    """One collect + update on fixed chunks; the full policy weights after it and the group's UpdateResult."""
    refs = [ray.put(torch.linspace(-3.0, -1.0, 6).repeat(8, 1) * (i + 1)) for i in range(len(chunks))]
    scores = [ray.put(torch.linspace(0, 1, 8)), ray.put(torch.linspace(1, -1, 8))]
    group = rank_pool.group(cfg, model_dir, tag="collectives")
    results = train(group, [ray.put(c) for c in chunks], refs, scores, kl_coef=0.05, iteration=1)
    return ray.get(group.policy_weights()).tensors(), results


@pytest.mark.parametrize("aggregation, placement, loss_form", [("token_mean", "reward", None),
                                                               ("sequence_mean", "loss", "kl_to_go")])
def test_zero3_two_ranks_with_unequal_lengths_end_at_the_one_rank_weights(rank_pool, tiny_model_dir,
                                                                          aggregation, placement,
                                                                          loss_form):
    """Losses are normalised by the minibatch's global token (or row) count, not averaged per rank; every
    ppo_* statistic the driver logs is the one rank's too (sums and counts, not per-rank means)."""
    from learner.ppo import ppo_stats_from_sums

    chunks = uneven_chunks()
    assert chunks[0].response_mask.sum() > 3 * chunks[1].response_mask.sum()
    weights, stats, per_rank_means = {}, {}, {}
    for world_size, stage in ((1, 0), (2, 3)):
        cfg = group_config(world_size, stage, ppo={"minibatch_size": 16, "epochs": 1, "lr": 1e-3,
                                                   "loss_aggregation": aggregation},
                           kl={"placement": placement, "loss_form": loss_form, "init_kl_coef": 0.05})
        weights[world_size], result = train_once(rank_pool, cfg, tiny_model_dir, chunks)
        stats[world_size] = ppo_stats_from_sums([r.ppo_sums for r in result.ranks])
        assert stats[world_size] == result.ppo
        per_rank_means[world_size] = {k: sum(r.ppo[k] for r in result.ranks) / len(result.ranks)
                                      for k in result.ranks[0].ppo}
    assert set(stats[1]) == set(stats[2]) >= {"loss", "policy_loss", "value_loss", "entropy", "clipfrac",
                                              "approx_kl", "vf_clipfrac", "explained_variance",
                                              "optimizer_steps"}
    for key in stats[1]:
        assert stats[2][key] == pytest.approx(stats[1][key], rel=1e-4, abs=1e-6), key
    # the old average of per-rank means is off where the ranks hold unequal tokens: the test can tell
    assert abs(per_rank_means[2]["entropy"] - stats[1]["entropy"]) > 1e-3
    from services.models import load_causal_lm

    initial = load_causal_lm(tiny_model_dir, "float32").state_dict()
    assert weights[1].keys() == weights[2].keys()
    moved = max(float((weights[1][k] - initial[k]).abs().max()) for k in initial)
    assert moved > 5e-4  # the update did something the comparison can see
    diff = {k: float((weights[1][k] - weights[2][k]).abs().max()) for k in weights[1]}
    worst = max(diff, key=diff.get)
    assert diff[worst] < 1e-5, f"{worst} differs by {diff[worst]:.2e}"


@ray.remote(num_cpus=0.05)
class ChunkProducer:
    """Stands where a rollout actor does: its chunk is lost when it is killed before it returns."""

    def produce(self, chunk, seconds: float):
        import time

        time.sleep(seconds)
        return chunk


def test_zero3_lost_chunk_finishes_within_the_timeout_and_the_retry_trains(ray_client, tiny_model_dir):
    from learner.group import LearnerGroup
    from learner.records import Admission

    chunks = uneven_chunks(seed=1)
    # two epochs: collect runs the no-grad forwards (one optimizer step would leave them to the update)
    cfg = group_config(2, 3, learner={"collective_timeout_s": 120}, ppo={"minibatch_size": 16, "epochs": 2})
    group = LearnerGroup(RankSpec.of(cfg, tiny_model_dir), None, tag="lost-chunk")
    producer = ChunkProducer.remote()
    try:
        doomed = producer.produce.remote(chunks[1], 600.0)
        ray.kill(producer)  # slot 1's actor dies before its chunk is fetched
        refs = {i: ray.put(torch.full((8, 6), -3.0)) for i in range(2)}
        scores = {i: ray.put(torch.linspace(0, 1, 8)) for i in range(2)}
        # rank 1 loses its only chunk and must still join rank 0's ZeRO-3 forward, or both hang
        assert group.collect(chunk_refs({0: chunks[0], 1: doomed}, refs, scores)) == [1]
        # slot 1 regenerated by an engine that restarted after the version check (version 0, beta 0): lost
        # too, and the ranks still run their forwards in step
        restarted = chunks[1].clone()
        restarted.kl_coef.zero_()
        assert group.collect(chunk_refs({1: restarted}, {1: refs[1]}, {1: scores[1]}),
                             Admission(0, 0.05)) == [1]
        # the retry holds slot 1 only: rank 0 has no chunk and still joins rank 1's forward
        assert group.collect(chunk_refs({1: chunks[1]}, {1: refs[1]}, {1: scores[1]}),
                             Admission(0, 0.05)) == []
        result = group.update(kl_coef=0.05, iteration=1)
    finally:
        for rank in group.ranks:
            ray.kill(rank)
    assert sorted(r.rank for r in result.ranks) == [0, 1]
    assert result.trained_episodes == 16
    assert all(r.ppo["optimizer_steps"] == 2 for r in result.ranks)


def test_one_optimizer_step_takes_the_old_logprobs_from_its_own_forward(rank_pool, tiny_model_dir):
    """One epoch of one minibatch: collect runs no forward, and the step's forward, before the step, gives
    the old log-probs: the KL penalised and the mismatch are those of the policy before the update (its
    log-probs measured apart, by the probe), and the PPO ratio is exactly 1."""
    chunks = uneven_chunks(seed=2)
    group = rank_pool.group(group_config(1, 0), tiny_model_dir, tag="collectives")
    rows = [([int(c.prompt_ids[i, 0])], c.response_ids[i, :int(c.response_mask[i].sum())].tolist())
            for c in chunks for i in range(8)]  # one-token prompts
    before = group.probe([prompt + response for prompt, response in rows], [1] * len(rows))
    ref = [torch.linspace(-3.0, -1.0, 6) * (i + 1) for i in range(len(chunks))]
    expected_kl = sum(lp - float(ref[k // 8][t]) for k, row in enumerate(before) for t, lp in enumerate(row))
    _, result = train_once(rank_pool, group_config(1, 0), tiny_model_dir, chunks)
    assert result.sums["k1_response_sum"] == pytest.approx(expected_kl, rel=1e-5)
    # rollout logprobs 0
    assert result.sums["mismatch_abs_sum"] == pytest.approx(-sum(map(sum, before)), rel=1e-5)
    assert result.ppo["optimizer_steps"] == 1
    assert result.ppo["approx_kl"] == 0.0 and result.ppo["clipfrac"] == 0.0


def test_zero3_weight_announcement_has_the_full_hf_shapes_without_a_collective(rank_pool, tiny_model_dir):
    from services.models import load_causal_lm

    group = rank_pool.group(group_config(2, 3), tiny_model_dir, tag="collectives")
    # rank 0 alone: a gather here would wait for rank 1 forever (the group's timeout would say so)
    announced = group._get([group.ranks[0].weight_metadata.remote()], "weight metadata")[0]
    hf = load_causal_lm(tiny_model_dir, "float32")
    state = hf.state_dict()
    assert [name for name, _, _ in announced] == [name for name, _ in hf.named_parameters()]
    for name, dtype, shape in announced:
        assert shape == list(state[name].shape), name
        assert dtype == "float32", name
    # every state_dict entry left out is a tied alias of one announced (GPT-2's lm_head.weight)
    by_storage = {state[name].data_ptr() for name, _, _ in announced}
    left_out = set(state) - {name for name, _, _ in announced}
    assert left_out and all(state[name].data_ptr() in by_storage for name in left_out), left_out


def test_ranks_set_up_again_keep_their_process_group_and_its_timeout(rank_pool, tiny_model_dir):
    """A group set up again on live ranks (``LearnerGroup(ranks=...)``) needs as many as its world size, and
    the collective timeout their process group was made with: anything else is refused, naming it."""
    from learner.group import LearnerGroup

    group = rank_pool.group(group_config(2, 3), tiny_model_dir, tag="collectives")
    with pytest.raises(ValueError, match="2 ranks given for learner.world_size=1"):
        LearnerGroup(RankSpec.of(group_config(1, 0), tiny_model_dir), None, ranks=group.ranks)
    with pytest.raises(ValueError, match=r"collective_timeout_s=300, which its process group keeps; got 120"):
        rank_pool.group(group_config(2, 3, learner={"collective_timeout_s": 120}), tiny_model_dir)
    again = rank_pool.group(group_config(2, 0), tiny_model_dir)  # the refusal left the ranks as they were
    assert again.ranks == group.ranks
    assert len(again.probe([[1, 2, 3]], [1])[0]) == 2  # and they work
