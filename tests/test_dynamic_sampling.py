"""DAPO's dynamic sampling (``rollout.dynamic_sampling``, group estimators): prompt groups whose scores all
tie are dropped and more prompts generated, a batch's worth a round, until every learner rank holds its share
of groups whose scores differ; at most ``rollout.dynamic_sampling_max_rounds`` extra rounds, after which tied
groups fill the share. The selection by hand (pure torch), the config, and one job on the real stack."""

from __future__ import annotations

import pytest
import torch

from learner.advantages import differing_groups, dynamic_sampling_rows

# ====================================================================== the selection on one rank


def test_dynamic_sampling_keeps_the_first_groups_whose_scores_differ_in_collection_order():
    # six groups of 2 in collection order 5, 0, 3, 1, 4, 2 (ids are not the order): tied are 0, 1 and 4
    groups = torch.tensor([5, 5, 0, 0, 3, 3, 1, 1, 4, 4, 2, 2])
    scores = torch.tensor([0.0, 1.0, 1.0, 1.0, 0.5, 0.25, 0.0, 0.0, 0.7, 0.7, 1.0, 0.0])
    assert differing_groups(scores, groups) == 3  # 5, 3 and 2
    keep, counts = dynamic_sampling_rows(scores, groups, 2)
    # 5 and 3 come first among those that differ; 2 is surplus
    assert keep.tolist() == [True, True, False, False, True, True, False, False, False, False, False, False]
    assert counts == {"tied": 3, "filled": 0, "surplus": 1}
    keep, counts = dynamic_sampling_rows(scores, groups, 3)
    assert keep.tolist() == [True, True, False, False, True, True, False, False, False, False, True, True]
    assert counts == {"tied": 3, "filled": 0, "surplus": 0}


def test_dynamic_sampling_fills_a_short_share_with_the_first_tied_groups():
    """The rounds' bound reached: every group that differs, then tied groups in collection order, so the rank
    still trains on its whole share."""
    groups = torch.tensor([5, 5, 0, 0, 3, 3, 1, 1, 4, 4, 2, 2])
    scores = torch.tensor([0.0, 1.0, 1.0, 1.0, 0.5, 0.25, 0.0, 0.0, 0.7, 0.7, 1.0, 0.0])
    keep, counts = dynamic_sampling_rows(scores, groups, 5)
    # 5, 3, 2 differ; tied 0 and 1 (collected before 4) fill
    assert keep.tolist() == [True, True, True, True, True, True, True, True, False, False, True, True]
    assert counts == {"tied": 3, "filled": 2, "surplus": 0}
    every_group_ties = torch.tensor([1.0, 1.0, 0.0, 0.0])
    keep, counts = dynamic_sampling_rows(every_group_ties, torch.tensor([0, 0, 1, 1]), 1)
    assert keep.tolist() == [True, True, False, False] and counts == {"tied": 2, "filled": 1, "surplus": 0}
    assert differing_groups(every_group_ties, torch.tensor([0, 0, 1, 1])) == 0


def test_dynamic_sampling_refuses_rows_that_cannot_fill_the_share():
    with pytest.raises(ValueError, match="keeps 3 groups but the rows hold 2"):
        dynamic_sampling_rows(torch.tensor([1.0, 0.0, 1.0, 0.0]), torch.tensor([0, 0, 1, 1]), 3)
    with pytest.raises(ValueError, match=r"scores \(3,\) and group_index \(4,\) must share one \[B\] shape"):
        dynamic_sampling_rows(torch.tensor([1.0, 0.0, 1.0]), torch.tensor([0, 0, 1, 1]), 1)


# ====================================================================== the config

ENV = {"name": "environment", "environment": "services.environments.randomwalks:interactive_randomwalks"}


@pytest.mark.parametrize("overrides, message", [
    ({"rollout": {"dynamic_sampling": True}},
     "only for a group estimator (grpo, rloo, reinforce_pp_baseline); ppo.advantage='gae'"),
    ({"rollout": {"dynamic_sampling": True}, "ppo": {"advantage": "reinforce_pp"}},
     "ppo.advantage='reinforce_pp'"),
    ({"rollout": {"samples_per_prompt": 4, "dynamic_sampling_max_rounds": 2}, "ppo": {"advantage": "grpo"}},
     "rollout.dynamic_sampling_max_rounds=2 is set but rollout.dynamic_sampling is false"),
    ({"rollout": {"samples_per_prompt": 4, "dynamic_sampling_max_rounds": 0, "dynamic_sampling": True},
      "ppo": {"advantage": "grpo"}}, "dynamic_sampling_max_rounds"),
    ({"task": ENV, "rollout": {"samples_per_prompt": 4, "dynamic_sampling": True},
      "ppo": {"advantage": "grpo"}},
     "rollout.dynamic_sampling is for single responses"),
])
def test_dynamic_sampling_settings_that_make_no_sense_are_refused(overrides, message):
    """Refused by the config, or by the check of the estimator it chooses (before any actor)."""
    from learner.algorithm import Algorithm
    from services.config import load_config

    with pytest.raises(ValueError, match=message.replace("(", "\\(").replace(")", "\\)")):
        Algorithm.from_config(load_config(None, overrides))


def test_dynamic_sampling_is_off_by_default_and_accepted_with_every_group_estimator():
    from learner.advantages import ESTIMATORS
    from services.config import load_config

    assert load_config(None, {}).rollout.dynamic_sampling is False
    for estimator in (name for name, entry in ESTIMATORS.entries.items() if entry.group):
        cfg = load_config(None, {"ppo": {"advantage": estimator},
                                 "rollout": {"samples_per_prompt": 4, "dynamic_sampling": True}})
        assert cfg.rollout.dynamic_sampling and cfg.rollout.dynamic_sampling_max_rounds == 3
    # a dumped config (a run's config.yaml, --print-config) holds every field, and loads again
    dumped = load_config(None, {}).model_dump(mode="json")
    assert load_config(None, dumped).rollout == load_config(None, {}).rollout


# ====================================================================== the job


@pytest.mark.integration
def test_grpo_job_with_dynamic_sampling_drops_tied_groups_and_trains_on_full_whole_batches(
        ray_head, cache_dir, tmp_path):
    """randomwalks GRPO, 4 samples per prompt, 2 learner ranks, async: most groups of the short warm start
    tie. Each iteration trains on exactly 32 episodes (the loop checks it), every rank on whole groups (the
    ranks check it); the groups generated are the 8 trained on plus those dropped for tying plus the surplus;
    the prompts of every round are the sampler's next ones, the next batch's after this one's extra rounds, so
    the cursor a checkpoint saves neither skips nor repeats a prompt."""
    import json

    from services.prompts import PromptSampler
    from services.tasks import get_task
    from tests.conftest import run_job

    proc = run_job(["--cluster.address", ray_head.address, "--model.cache_dir", cache_dir, "--run.output_dir",
                    str(tmp_path), "--run.name", "dynamic", "--run.seed", "1", "--model.sft_steps", "60",
                    "--model.sft_batch_size", "50", "--rollout.batch_size", "32", "--rollout.chunk_size", "8",
                    "--rollout.samples_per_prompt", "4", "--ppo.advantage", "grpo", "--ppo.minibatch_size",
                    "16", "--learner.world_size", "2", "--kl.horizon", "1000", "--run.eval_every", "100",
                    "--cluster.placement_timeout_s", "600", "--rollout.mode", "async",
                    "--rollout.dynamic_sampling", "--run.iterations", "2"])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "dynamic" / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in records] == [1, 2]
    drawn = []
    for r in records:
        extra = r["dynamic_sampling_extra_rounds"]
        assert 0 <= extra <= 3 and r["episodes"] == 32
        assert len(r["prompt_rows"]) == 8 * (1 + extra)  # a batch's worth of prompts a round
        generated = 8 * (1 + extra)
        assert generated == 8 + r["dynamic_sampling_dropped_groups"] + r["dynamic_sampling_surplus_groups"], r
        assert r["dynamic_sampling_dropped_groups"] == r["dynamic_sampling_tied_groups"] - r[
            "dynamic_sampling_filled_groups"]
        if r["dynamic_sampling_filled_groups"]:  # only once the bound is reached, and said in the log
            assert extra == 3 and \
                f"iteration {r['iteration']}: dynamic sampling: after 3 extra rounds" in proc.stdout
        drawn += r["prompt_rows"]
    assert sum(r["dynamic_sampling_dropped_groups"] for r in records) > 0, records
    prompts = get_task("randomwalks").prompts()
    assert drawn == PromptSampler(len(prompts), 1).next(len(drawn))
