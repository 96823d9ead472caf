"""rollout.mode async: the next batch generates while the learner trains on this one. Staleness is bounded
by admission and a stale row is never trained on; the decoupled-PPO correction; staleness 0 reproduces
sync; a resume starts with an empty pipeline, with in-flight updates too."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
import torch

from learner.plan import RankSpec
from tests.conftest import SMALL, follow_job, run_job, start_job

ASYNC = ["--rollout.mode", "async"]


def job_args(ray_head, cache_dir, out, name, *extra) -> list[str]:
    return ["--cluster.address", ray_head.address, "--model.cache_dir", cache_dir,
            "--run.output_dir", str(out), "--run.name", name, *SMALL, *extra]


def metrics(run_dir: Path, name: str = "metrics.jsonl") -> list[dict]:
    return [json.loads(x) for x in (run_dir / name).read_text().splitlines()]


def stamped_batch(versions: list[int], kl_coef: float = 0.05, behaviour_logprob: float = 0.0):
    """One chunk of len(versions) rows, row i stamped with versions[i]."""
    from services.experience import make_batch

    g = torch.Generator().manual_seed(len(versions))
    n = len(versions)
    prompts = [[int(x)] for x in torch.randint(1, 21, (n,), generator=g)]
    responses = [torch.randint(0, 21, (4,), generator=g).tolist() for _ in range(n)]
    batch = make_batch(prompts, responses, [[behaviour_logprob] * 4] * n, [1] * n, list(range(n)),
                       22, 0, kl_coef, 6)
    batch.policy_version = torch.tensor(versions)
    return batch


def test_admission_takes_at_most_max_staleness_versions_behind():
    from learner.records import Admission

    batch = stamped_batch([0, 1, 2, 3, 4])

    def refused(admission):
        return admission.refuses(batch.policy_version, batch.kl_coef).tolist()

    # async: versions 2 and 3 are at most one behind a learner at 3; 4 is a version it does not have
    assert refused(Admission(3, None, max_staleness=1)) == [True, True, False, False, True]
    assert refused(Admission(3, None, max_staleness=0)) == [True, True, True, False, True]
    # sync: exactly the version, and the beta too
    assert refused(Admission(3, 0.05)) == [True, True, True, False, True]
    assert refused(Admission(3, 0.06)) == [True] * 5


def test_truncated_importance_weights_and_the_weighted_surrogate():
    from learner.correction import rollout_correction_weights
    from learner.policy_losses import policy_loss

    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    prox = torch.tensor([[-1.0, -1.0, -1.0, -1.0]])
    behaviour = torch.tensor([[-1.0, -2.0, -0.5, -9.0]])  # w = 1, e (capped to 2), e^-0.5; last is padding
    w, stats = rollout_correction_weights(prox, behaviour, mask, "tis", "token", cap=2.0)
    assert w.tolist()[0][:3] == pytest.approx([1.0, 2.0, float(torch.tensor(-0.5).exp())])
    assert w[0, 3] == 1.0  # outside the mask
    assert stats["is_capped_fraction"] == pytest.approx(1 / 3)
    assert stats["is_weight_mean"] == pytest.approx((1.0 + 2.0 + float(torch.tensor(-0.5).exp())) / 3)

    logprobs = torch.tensor([[-0.9, -1.1, -1.0, -1.0]], requires_grad=True)
    advantages = torch.tensor([[1.0, -0.5, 2.0, 0.0]])
    plain, _ = policy_loss(logprobs, prox, advantages, mask)
    ones, _ = policy_loss(logprobs, prox, advantages, mask, importance_weights=torch.ones_like(mask))
    assert float(ones.detach()) == pytest.approx(float(plain.detach()))
    weighted, _ = policy_loss(logprobs, prox, advantages, mask, importance_weights=w)
    ratio = (logprobs - prox).exp()
    per_token = torch.maximum(-advantages * ratio, -advantages * ratio.clamp(0.8, 1.2)) * w
    assert float(weighted.detach()) == pytest.approx(float((per_token * mask).sum().detach() / mask.sum()))


@pytest.mark.integration
def test_a_stale_row_is_never_trained_on(ray_client, tiny_model_dir):
    """A learner at version 3 with max_staleness 1: a chunk with a row of version 1 is reported for
    regeneration, chunks of versions 2 and 3 are trained on; the importance weights are logged."""
    import ray

    from learner.group import LearnerGroup
    from learner.records import Admission
    from services.config import load_config
    from tests.conftest import chunk_refs

    cfg = load_config(None, {
        "rollout": {"batch_size": 16, "chunk_size": 8, "max_new_tokens": 6, "mode": "async",
                    "max_staleness": 1},
        "ppo": {"minibatch_size": 16, "epochs": 1, "lr": 1e-3},
        "cluster": {"learner": {"num_cpus": 0.1}},
        "learner": {"collective_timeout_s": 300},
    })
    refs = {i: ray.put(torch.full((8, 6), -2.0)) for i in range(2)}
    scores = {i: ray.put(torch.linspace(0, 1, 8)) for i in range(2)}
    admitted = Admission(3, None, 1)
    group = LearnerGroup(RankSpec.of(cfg, tiny_model_dir), None, tag="async-stale")
    try:
        too_stale = stamped_batch([2, 2, 2, 1, 2, 2, 2, 2])
        assert group.collect(chunk_refs({0: too_stale, 1: stamped_batch([3] * 8)}, refs, scores),
                             admitted) == [0]
        # regenerated (version 2: within the bound), with behaviour log-probs far below the learner's
        regenerated = stamped_batch([2] * 8, behaviour_logprob=-20.0)
        assert group.collect(chunk_refs({0: regenerated}, {0: refs[0]}, {0: scores[0]}), admitted) == []
        result = group.update(kl_coef=0.05, iteration=1)
    finally:
        for rank in group.ranks:
            ray.kill(rank)
    assert result.trained_episodes == 16 and result.policy_versions == [2, 3]
    # slot 0's weights pi_prox / pi_behav are huge and capped; slot 1's are below 1
    assert result.ppo["is_capped_fraction"] == pytest.approx(0.5)
    assert 1.0 < result.ppo["is_weight_mean"] < 1.5
    # the penalty is the learner's own log-probs p (pi_prox, in (-20, 0)) against the reference (-2), not the
    # engine's: sum(p) + 2 * tokens. The mismatch |p - behaviour| is slot 0's sum(p) + 20 per token on the
    # stale rows (version 2, against the learner's 3) and slot 1's -sum(p) on the rows of its own version,
    # apart
    tokens, sums = result.sums["num_tokens"], result.sums
    assert sums["stale_tokens"] == tokens / 2
    stale_p = sums["stale_mismatch_abs_sum"] - 20.0 * tokens / 2
    fresh_p = -(sums["mismatch_abs_sum"] - sums["stale_mismatch_abs_sum"])
    # (the penalty's unweighted sums; the controller's statistic is prefix-weighted against the engine's
    # log-probs)
    assert sums["penalty_sum"] == pytest.approx(stale_p + fresh_p + 2.0 * tokens, rel=1e-5, abs=1e-3)
    assert sums["penalty_sum"] != pytest.approx((-18.0 + 2.0) * tokens / 2, rel=1e-2)  # the engine's, before


@pytest.mark.integration
def test_staleness_zero_reproduces_sync(ray_head, cache_dir, small_run, tmp_path):
    """async with max_staleness 0 never overlaps: the same prompts, the same trajectory as sync (the small
    run's 4 iterations: the rate anneals over the run), importance weights of 1 (within the probe's
    tolerance) and no stale row."""
    sync_dir, sync = small_run
    assert sync.returncode == 0, sync.stderr[-3000:]
    zero = run_job(job_args(ray_head, cache_dir, tmp_path, "zero", "--run.iterations", "4", *ASYNC,
                            "--rollout.max_staleness", "0"))
    assert zero.returncode == 0, zero.stderr[-3000:]
    a, b = metrics(sync_dir), metrics(tmp_path / "zero")
    assert [r["prompt_rows"] for r in a] == [r["prompt_rows"] for r in b]
    assert [r["batch_staleness_max"] for r in b] == [0, 0, 0, 0]
    assert all(r["ppo_is_capped_fraction"] == 0 for r in a + b)  # the rollout correction in both modes
    assert all(abs(r["ppo_is_weight_mean"] - 1) < 1e-4 for r in a + b), \
        [r["ppo_is_weight_mean"] for r in a + b]
    for key in ("kl_response_mean", "score_mean", "reward_mean", "kl_coef",
                "response_length_mean", "ppo_loss"):
        # both penalise the learner's log-probs; the importance weights here differ from 1 by the probe's 1e-4
        assert [r[key] for r in a] == pytest.approx([r[key] for r in b], rel=1e-3, abs=1e-3), key


@pytest.mark.integration
def test_async_overlaps_within_the_bound_and_resumes_with_an_empty_pipeline(ray_head, cache_dir, tmp_path):
    """Every batch after the first was generated one version behind (max_staleness 1), never more. A
    checkpoint taken while the next batch is in flight resumes with an empty pipeline: that batch's prompts
    are drawn again and generated by the current version; so does a job killed during that generation."""
    straight = run_job(job_args(ray_head, cache_dir, tmp_path, "async", "--run.iterations", "4",
                                "--checkpoint.every", "2", *ASYNC))
    assert straight.returncode == 0, straight.stderr[-3000:]
    run_dir = tmp_path / "async"
    first = metrics(run_dir)
    assert [r["batch_staleness_max"] for r in first] == [0, 1, 1, 1]
    assert [r["batch_policy_versions"] for r in first] == [[0], [0], [1], [2]]

    checkpoint = run_dir / "checkpoints" / "iter-000002"
    resumed = run_job(job_args(ray_head, cache_dir, tmp_path, "async", "--run.iterations", "4",
                               "--checkpoint.every", "2", *ASYNC, "--run.resume", str(checkpoint)))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    after = metrics(run_dir)
    assert [r["iteration"] for r in after] == [1, 2, 3, 4]
    for key in ("prompt_rows", "kl_coef", "kl_response_mean", "batch_policy_versions"):
        assert [r[key] for r in after[:2]] == [r[key] for r in first[:2]], key
    # the batch in flight at the checkpoint was not saved: its prompts again, by version 2 itself
    assert [r["prompt_rows"] for r in after] == [r["prompt_rows"] for r in first]
    assert [r["batch_policy_versions"] for r in after[2:]] == [[2], [2]]
    assert [r["batch_staleness_max"] for r in after[2:]] == [0, 1]
    assert [r["iteration"] for r in metrics(run_dir, "metrics.discarded.jsonl")] == [3, 4]

    # the same job with in-flight updates (a version loads into the batch being generated) killed outright
    # (SIGKILL: no clean-up, its actors and reservation left to Ray) the moment iteration 2's checkpoint is
    # sealed, with batch 3 generating since before update 2; the resume from the latest checkpoint, on the
    # same head, trains the straight run's prompts, each once, in its order
    in_flight = [*ASYNC, "--rollout.in_flight_updates", "keep_kv"]
    killed = start_job(job_args(ray_head, cache_dir, tmp_path, "killed", "--run.iterations", "4",
                                "--checkpoint.every", "2", *in_flight))
    out = follow_job(killed, lambda line: line.startswith("[tether] checkpoint") and "iter-000002" in line
                     and killed.kill())
    assert killed.returncode == -signal.SIGKILL, out[-3000:]
    assert "[tether] iter 3/" not in out
    resumed = run_job(job_args(ray_head, cache_dir, tmp_path, "killed", "--run.iterations", "4",
                               "--checkpoint.every", "2", *in_flight, "--run.resume", "latest"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout and "iter-000002" in resumed.stdout
    after_kill = metrics(tmp_path / "killed")
    assert [r["iteration"] for r in after_kill] == [1, 2, 3, 4]
    assert [r["prompt_rows"] for r in after_kill] == [r["prompt_rows"] for r in first]
    # batch 3, drawn again, is version 2's alone (collected before update 3); a row of any other batch is
    # stamped with its oldest token, of the version the batch started under or (loaded in flight) the next
    assert after_kill[2]["batch_policy_versions"] == [2]
    for r in after_kill:
        assert set(r["batch_policy_versions"]) <= {max(r["iteration"] - 2, 0), r["iteration"] - 1}, r
        assert r["in_flight_token_staleness_mean"] <= r["batch_staleness_max"] <= 1


def test_keep_kv_tokens_after_a_load_count_as_their_requests_version_in_the_mismatch():
    """A row whose request started under version 1 and went on after version 2 loaded: under keep_kv its
    later tokens came from version 1's cache mixed with version 2's weights, so for a learner at version 2
    the whole row is apart from the same-version mismatch; under partial (prefix prefilled again) the later
    tokens are version 2's. A row started under version 2 is the learner's either way."""
    import torch

    from services.experience import make_batch, stale_tokens

    batch = make_batch([[1], [1]], [[3, 3, 3], [3, 3]], [[0.0] * 3, [0.0] * 2], [0, 0], [0, 1], 0, 2, 0.1,
                       token_versions=[[1, 2, 2], [2, 2]])
    mask = batch.action_mask
    kept = stale_tokens(batch, mask, 2, cache_kept=True)
    assert kept.tolist() == [[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]
    assert stale_tokens(batch, mask, 2).tolist() == [[1.0, 0.0, 0.0], [0.0, 0.0, 0.0]]
    assert torch.equal(stale_tokens(batch, mask, None, cache_kept=True), torch.zeros_like(mask))
