"""``learner.dtype: auto`` chosen on given timings (never a timed assertion), who gets it by default, and the
evaluation's cap and its line."""

from __future__ import annotations

import json

import pytest

from services.config import load_config
from services.dtype_choice import BF16_MIN_SPEEDUP, MIN_TIMED_FLOPS, DtypeTiming, choose, pass_flops

SMOLLM2_WIDTHS = (576, 1536, 49152)


def test_bf16_only_where_it_is_at_least_the_margin_faster():
    assert choose(DtypeTiming(1.0, 0.25, 1e9, 2)) == "bfloat16"  # AMX-like
    assert choose(DtypeTiming(1.0, 1 / BF16_MIN_SPEEDUP, 1e9, 2)) == "bfloat16"
    assert choose(DtypeTiming(1.0, 0.9, 1e9, 2)) == "float32"  # faster, not by enough to give up exactness
    assert choose(DtypeTiming(1.0, 1.19, 1e9, 2)) == "float32"  # slower: the Intel Xeon without AMX
    assert DtypeTiming(0.3, 0.1, 46e9, 2).describe().startswith(
        "float32 153 GFLOP/s, bfloat16 460 GFLOP/s (3.00x) on model-shaped matmuls")


def test_a_pretrained_policy_takes_auto_unless_set_and_the_default_job_keeps_float32():
    assert load_config(None, {}).learner.dtype == "float32"
    assert load_config(None, {"task": {"name": "smollm2-sentiment"}}).learner.dtype == "auto"
    assert load_config(None, {"model": {"path": "/models/x"}}).learner.dtype == "auto"
    assert load_config(None, {"task": {"name": "smollm2-sentiment"},
                              "learner": {"dtype": "float32"}}).learner.dtype == "float32"
    # unset stays unset (a resume takes the run's choice back)
    assert "dtype" not in load_config(None, {"task": {"name": "smollm2-sentiment"}}).learner.model_fields_set


def model_dir(tmp_path, widths=SMOLLM2_WIDTHS):
    hidden, inner, vocab = widths
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": hidden, "intermediate_size": inner,
                                                      "vocab_size": vocab}))
    return str(tmp_path)


@pytest.mark.parametrize("timing, chosen", [((0.3, 0.1), "bfloat16"), ((0.3, 0.35), "float32")])
def test_the_plan_resolves_auto_from_the_timing_and_says_the_figures(tmp_path, monkeypatch, timing, chosen):
    from learner import plan as plan_module
    from services import dtype_choice

    timed = []

    def given(widths, threads, rounds=3):
        timed.append((widths, threads))
        return DtypeTiming(*timing, pass_flops(widths), threads)

    monkeypatch.setattr(dtype_choice, "time_dtypes", given)
    cfg, lines = load_config(None, {"task": {"name": "smollm2-sentiment"}}), []
    plan_module.choose_learner_dtype(cfg, model_dir(tmp_path), 2, lines.append)
    assert cfg.learner.dtype == chosen and timed == [(SMOLLM2_WIDTHS, 2)]  # sync on 2 CPUs: both threads
    figures = DtypeTiming(*timing, pass_flops(SMOLLM2_WIDTHS), 2).describe()
    assert lines == [(f"learner.dtype auto: {chosen} ({figures} on the driver's node; bfloat16 only at "
                     ">= 1.2x)")]
    assert cfg.probe_tolerance == (1e-4 if chosen == "float32" else 1.0)


def test_auto_without_a_timing_on_a_gpu_a_tiny_model_and_merged_lora(tmp_path, monkeypatch):
    from learner import plan as plan_module
    from services import dtype_choice

    monkeypatch.setattr(dtype_choice, "time_dtypes", lambda *a, **k: pytest.fail("timed"))
    tiny = model_dir(tmp_path, (64, 256, 30))
    assert pass_flops((64, 256, 30)) < MIN_TIMED_FLOPS
    cases = [({"cluster": {"learner": {"num_gpus": 1}}}, tiny, "bfloat16", "the learner on a GPU"),
             ({}, tiny, "float32", "MFLOP, too small to time"),
             ({"learner": {"lora": {"rank": 8, "sync": "merged"}}}, tiny, "float32", "merged")]
    for overrides, where, chosen, why in cases:
        cfg, lines = load_config(None, {"model": {"path": where}, **overrides}), []
        plan_module.choose_learner_dtype(cfg, where, None, lines.append)
        assert cfg.learner.dtype == chosen and why in lines[0], (overrides, lines)


def test_a_role_s_spec_is_never_built_on_an_unchosen_dtype(tiny_model_dir):
    from learner.plan import RankSpec

    with pytest.raises(ValueError, match="learner.dtype 'auto' is chosen by the plan"):
        RankSpec.of(load_config(None, {"learner": {"dtype": "auto"}}), tiny_model_dir)


def test_an_environment_task_s_evaluation_is_capped_and_its_cost_said():
    from learner.plan import evaluation_rows

    rows = list(range(64))
    env = {"task": {"name": "environment", "environment": "tests.agent_envs:scripted"},
           "rollout": {"batch_size": 16, "samples_per_prompt": 4, "eval_samples_per_prompt": 1}}
    lines = []
    assert evaluation_rows(load_config(None, env), rows, 144, lines.append) == rows[:32]
    assert lines == [("evaluation: 32 episodes of up to 144 response tokens (32 rows x 1; the first 32 of "
                      "64 rows: run.eval_max_episodes=32), 2.0x a training iteration's 16, every 5 "
                      "iteration(s)")]
    capped = load_config(None, {**env, "run": {"eval_max_episodes": 10}})
    assert evaluation_rows(capped, rows, 144, lambda _: None) == rows[:10]
    # a prompt task keeps every row unless capped; the cap counts samples per row
    prompts = load_config(None, {})
    assert evaluation_rows(prompts, rows, 9, lambda _: None) == rows
    two_each = load_config(None, {"run": {"eval_max_episodes": 20},
                                  "rollout": {"eval_samples_per_prompt": 2}})
    assert evaluation_rows(two_each, rows, 9, lambda _: None) == rows[:10]


def test_a_resume_goes_on_in_the_dtype_its_run_chose_without_measuring():
    from learner.checkpoint import keep_followed_defaults

    for saved in ("bfloat16", "float32"):
        cfg = load_config(None, {"task": {"name": "smollm2-sentiment"}})
        keep_followed_defaults({"learner": {"dtype": saved}}, cfg)
        assert cfg.learner.dtype == saved
    chosen = load_config(None, {"task": {"name": "smollm2-sentiment"}, "learner": {"dtype": "float32"}})
    keep_followed_defaults({"learner": {"dtype": "bfloat16"}}, chosen)
    assert chosen.learner.dtype == "float32"  # set now: check_compatible then names the difference
