"""The job as a user runs it: `python -m learner.main ...` against a real local Ray head."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.conftest import SMALL, may_raise_priority, run_cli, run_job

pytestmark = pytest.mark.integration


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def job_args(ray_head, cache_dir, out, name, *extra) -> list[str]:
    return ["--cluster.address", ray_head.address, "--model.cache_dir", cache_dir,
            "--run.output_dir", str(out), "--run.name", name, *extra]


def test_default_job_learns(default_run):
    """The embedded default (randomwalks, SFT warm start, adaptive KL) lifts optimality well above the
    start."""
    run_dir, proc = default_run
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    start, final = summary["eval_start"]["optimality"], summary["eval_final"]["optimality"]
    assert final >= 0.7 and final > start + 0.25, (start, final)
    assert "[tether] summary:" in proc.stdout
    for name in ("config.yaml", "metrics.jsonl", "curves.png", "summary.json"):
        assert (run_dir / name).is_file()
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    assert len((run_dir / "metrics.jsonl").read_text().splitlines()) == 10
    # every trained episode, a line each, in one pandas call; its scores average to the iteration's
    import pandas as pd

    episodes, records = pd.read_json(run_dir / "episodes.jsonl", lines=True), read_metrics(run_dir)
    assert len(episodes) == sum(r["episodes"] for r in records)
    assert episodes.groupby("iteration")["score"].mean().tolist() == pytest.approx(
        [r["score_mean"] for r in records], rel=1e-6)
    # samples before (iteration 0) and after training, as text with their scores, for a person to read
    samples = sorted(p.name for p in (run_dir / "samples").iterdir())
    assert samples == ["iteration-0000.md", "iteration-0005.md", "iteration-0010.md"]
    after = (run_dir / "samples" / "iteration-0010.md").read_text()
    assert after.count("## ") == 8 and "Prompt:" in after and "Response:" in after


def test_bfloat16_job_starts_at_zero_kl_passes_its_probes_and_learns(ray_head, cache_dir, tmp_path):
    """learner.dtype bfloat16 end to end: DeepSpeed bf16 (fp32 master weights), engines and reference in
    bf16, weights synced in bf16, the probe's tolerance set by the dtype."""
    from services.config import PROBE_TOLERANCE

    proc = run_job(job_args(ray_head, cache_dir, tmp_path, "bf16", "--run.seed", "1",
                            "--model.sft_steps", "60", "--model.sft_batch_size", "50", "--learner.dtype",
                            "bfloat16", "--run.iterations", "4", "--run.eval_every", "4"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "ZeRO-0, bfloat16" in proc.stdout
    # the engines' cast of the float32 checkpoint to bfloat16, asked for, is not a warning on the console
    warnings = [line for line in (proc.stdout + proc.stderr).splitlines() if "warning" in line.lower()]
    assert not warnings, "\n".join(warnings[:20])
    records = read_metrics(tmp_path / "bf16")
    # the reference and the learner share the dtype and the weights: the first batch has no KL at all
    assert records[0]["kl_response_mean"] == 0.0 and records[0]["kl_k3_response_mean"] == 0.0
    probes = [r["probe_max_abs_error"] for r in records]
    assert all(0 <= p < PROBE_TOLERANCE["bfloat16"] for p in probes), probes
    summary = json.loads((tmp_path / "bf16" / "summary.json").read_text())
    start, final = summary["eval_start"]["optimality"], summary["eval_final"]["optimality"]
    assert final > start + 0.15, (start, final)


def test_broadcast_and_beta_rise_when_the_kl_is_above_the_target(ray_head, cache_dir, tmp_path):
    """With a reference and a reward actor of their own (placement actor): the broadcast reaches them too."""
    proc = run_job(job_args(ray_head, cache_dir, tmp_path, "ctl", *SMALL, "--run.iterations", "4",
                            "--ppo.lr", "2e-3", "--kl.target", "0.001", "--kl.horizon", "1000",
                            "--reference.placement", "actor", "--reward.placement", "actor"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "actors ready: 1 rollout, 1 reference, 1 reward, 1 learner rank(s), ZeRO" in proc.stdout
    check_broadcast_and_controller(read_metrics(tmp_path / "ctl"), target=0.001, horizon=1000,
                                   direction="rises", actors={"rollout-0", "reference-0", "reward-0"})


def test_broadcast_and_beta_fall_when_the_kl_is_below_the_target(small_run):
    """The small job's KL stays below the default target of 6 nats. On CPU its learner rank scores the
    reference and the reward itself (reference.placement and reward.placement auto): the engine is the one
    actor. On the test's Ray head (workers at Ray's niceness 15) the engine and the rank took the driver's
    priority, the engine ``ENGINE_LEAD`` steps above it, where the node lets a process raise its own; each
    record has both roles' CPU share."""
    from actors.base import ENGINE_LEAD

    run_dir, proc = small_run
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "actors ready: 1 rollout, 1 learner rank(s) scoring the reference and reward, ZeRO" in proc.stdout
    records = read_metrics(run_dir)
    check_broadcast_and_controller(records, target=6.0, horizon=10000, direction="falls",
                                   actors={"rollout-0"})
    ours = os.getpriority(os.PRIO_PROCESS, 0)  # the driver's: it runs at the test's priority
    if may_raise_priority():
        assert (f"cpu priority: rollout engines at niceness {ours - ENGINE_LEAD}, the other roles at {ours} "
                f"(the driver's {ours})\n") in proc.stdout
    else:
        assert "cpu priority: rollout engines at niceness 15, the other roles at 15" in proc.stdout
    for r in records:
        assert 0 < r["rollout_cpu_share"] <= 1 and 0 < r["learner_cpu_share"] <= 1, r



def check_broadcast_and_controller(records: list[dict], target: float, horizon: int, direction: str,
                                   actors: set[str]) -> None:
    """Every actor reports the driver's version and beta after each iteration, every batch carries
    them, and beta moves toward the target: up when the KL is above it, down when below."""
    assert [r["iteration"] for r in records] == [1, 2, 3, 4]
    # the first broadcast reached the engines too: nothing needed re-syncing before iteration 1
    assert all(r["resynced_actors"] == [] for r in records), [r["resynced_actors"] for r in records]
    for r in records:
        assert r["batch_policy_versions"] == [r["policy_version"] - 1]
        assert r["batch_kl_coefs"] == pytest.approx([r["kl_coef_used"]], rel=1e-6)
        names = {s["name"] for s in r["actor_states"]}
        assert names == actors
        for state in r["actor_states"]:
            assert state["policy_version"] == r["policy_version"]
            assert state["kl_coef"] == r["kl_coef"]
        # the controller was fed exactly the response KL of this batch
        e = min(max(r["kl_response_mean"] / target - 1, -0.2), 0.2)
        assert r["kl_coef"] == pytest.approx(r["kl_coef_used"] * (1 + e * r["episodes"] / horizon), rel=1e-9)
    betas = [r["kl_coef"] for r in records[1:]]
    if direction == "rises":
        assert all(b1 > b0 for b0, b1 in zip([records[0]["kl_coef"]] + betas, betas))
    else:
        assert all(b1 < b0 for b0, b1 in zip([records[0]["kl_coef"]] + betas, betas))


@pytest.mark.parametrize(
    "args, message",
    [
        (["--kl.target", "-1"], "kl.target"),
        (["--kl.controller", "fixed"], "kl.target is set but kl.controller='fixed'"),
        (["--learner.world_size", "3", "--learner.zero_stage", "3"],
         "cannot be split over learner.world_size=3"),
        (["--rollout.batch_size", "0"], "rollout.batch_size"),
        (["--rollout.top_p", "0.9"], "rollout.top_p=0.9 is refused"),
        (["--learner.world_size", "2", "--cluster.learner.num_gpus", "0.5"],
         "cluster.learner.num_gpus=0.5 with learner.world_size=2: a fraction of a GPU per rank"),
        (["--kl.horizon", "100"], "rollout.batch_size=128 exceeds kl.horizon=100"),
        (["--task.name", "nope"], "unknown task 'nope'"),
        (["--model.path", "/nonexistent/model"],
         "model.path '/nonexistent/model' is not a directory on this node"),
        (["--config", "/nonexistent.yaml"], "config file /nonexistent.yaml does not exist"),
    ],
)
def test_bad_input_fails_before_any_actor(tmp_path, args, message):
    proc = run_cli(["--run.output_dir", str(tmp_path), "--cluster.address", "127.0.0.1:1", *args])
    assert proc.returncode != 0
    assert message in proc.stderr + proc.stdout
    assert "actors ready" not in proc.stdout


def test_existing_run_directory_is_not_overwritten(tmp_path):
    run_dir = tmp_path / "randomwalks"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text("precious\n")
    proc = run_cli(["--run.output_dir", str(tmp_path), "--cluster.address", "127.0.0.1:1"])
    assert proc.returncode != 0
    assert "already holds a run" in proc.stderr + proc.stdout
    assert (run_dir / "metrics.jsonl").read_text() == "precious\n"


def test_gpus_on_cpu_cluster_fail_fast_naming_role(ray_head, cache_dir, tmp_path):
    proc = run_job(job_args(ray_head, cache_dir, tmp_path, "gpu", "--run.seed", "1",
                            "--model.sft_steps", "60", "--model.sft_batch_size", "50",
                            "--cluster.rollout.num_gpus", "1"), timeout_s=120)
    assert proc.returncode != 0
    assert "role 'rollout' requests GPU=1.0" in proc.stderr + proc.stdout


def test_unreachable_cluster_fails_within_bound(cache_dir, tmp_path):
    proc = run_job(["--run.output_dir", str(tmp_path), "--model.cache_dir", cache_dir, "--run.seed", "1",
                    "--model.sft_steps", "60", "--model.sft_batch_size", "50",
                    "--cluster.address", "127.0.0.1:1", "--cluster.connect_timeout_s", "3"], timeout_s=120)
    assert proc.returncode != 0
    assert "cannot reach the Ray cluster at '127.0.0.1:1'" in proc.stderr + proc.stdout


def test_help_lists_every_field_with_default_and_help():
    proc = run_job(["--help"], timeout_s=120)
    assert proc.returncode == 0
    text_out = " ".join(proc.stdout.split())  # argparse wraps lines
    for flag, text in [("--kl.target", "(default: 6.0)"), ("--kl.estimator", "per-token KL estimator"),
                       ("--learner.zero_stage", "ZeRO stage 0-3"),
                       ("--run.resume", "continue from a checkpoint")]:
        assert f"{flag} " in text_out and text in text_out, flag


def test_print_config_prints_resolved_yaml(tmp_path):
    import yaml

    from services.config import JobConfig

    config = tmp_path / "job.yaml"
    config.write_text("kl:\n  target: 3.0\nrun:\n  iterations: 7\n")
    proc = run_job(["--config", str(config), "--kl.horizon", "500", "--print-config"], timeout_s=120)
    assert proc.returncode == 0, proc.stderr
    resolved = JobConfig.model_validate(yaml.safe_load(proc.stdout))
    assert (resolved.kl.target, resolved.kl.horizon, resolved.run.iterations) == (3.0, 500, 7)
    assert resolved.kl.estimator == "k1"  # untouched fields keep their defaults
