"""Reliability, as a user would meet it: resume with the same trajectory, refused checkpoints, actors
killed mid-run, a lost learner rank, and a graceful stop. Real jobs on a real local Ray head."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import RAY_ENV, ROOT, run_job

pytestmark = pytest.mark.integration

SMALL = ["--run.seed", "1", "--model.sft_steps", "60", "--model.sft_batch_size", "50",
         "--rollout.batch_size", "32", "--rollout.chunk_size", "16", "--ppo.minibatch_size", "16",
         "--run.eval_every", "100"]


def args(ray_head, cache_dir, out, name, *extra):
    return ["--cluster.address", ray_head.address, "--model.cache_dir", cache_dir, "--run.output_dir", str(out),
            "--run.name", name, *SMALL, *extra]


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_resume_reproduces_the_straight_run_and_refuses_bad_checkpoints(ray_head, cache_dir, tmp_path):
    straight = run_job(args(ray_head, cache_dir, tmp_path, "straight", "--run.iterations", "4"))
    assert straight.returncode == 0, straight.stderr[-3000:]
    first = run_job(args(ray_head, cache_dir, tmp_path, "resumed", "--run.iterations", "2"))
    assert first.returncode == 0, first.stderr[-3000:]
    run_dir = tmp_path / "resumed"
    checkpoint = run_dir / "checkpoints" / "iter-000002"
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == checkpoint.name
    assert json.loads((checkpoint / "driver.json").read_text())["kl_controller"]["kind"] == "adaptive"

    # a config that changes the run is refused, naming the checkpoint file
    bad = run_job(args(ray_head, cache_dir, tmp_path, "resumed", "--run.iterations", "4", "--run.resume", "latest",
                       "--ppo.lr", "0.5"), timeout_s=300)
    assert bad.returncode != 0
    assert f"{checkpoint / 'driver.json'}" in bad.stderr and "ppo.lr" in bad.stderr

    # a truncated file is named and nothing is touched; no silent fresh start
    corrupt_dir = tmp_path / "corrupt"
    shutil.copytree(run_dir, corrupt_dir)
    victim = max((p for p in (corrupt_dir / "checkpoints" / "iter-000002").rglob("*.pt")), key=lambda p: p.stat().st_size)
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
    before = (corrupt_dir / "metrics.jsonl").read_text()
    refused = run_job(args(ray_head, cache_dir, tmp_path, "corrupt", "--run.iterations", "4", "--run.resume",
                           "latest"), timeout_s=300)
    assert refused.returncode != 0
    assert str(victim) in refused.stderr and "truncated" in refused.stderr
    assert (corrupt_dir / "metrics.jsonl").read_text() == before
    garbled = corrupt_dir / "checkpoints" / "iter-000002" / "manifest.json"
    garbled.write_text("{not json")
    refused = run_job(args(ray_head, cache_dir, tmp_path, "corrupt", "--run.resume", "latest"), timeout_s=300)
    assert refused.returncode != 0 and str(garbled) in refused.stderr

    resumed = run_job(args(ray_head, cache_dir, tmp_path, "resumed", "--run.iterations", "4", "--run.resume",
                           "latest"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    a, b = metrics(tmp_path / "straight"), metrics(run_dir)
    assert [r["iteration"] for r in b] == [1, 2, 3, 4]
    assert [r["kl_coef"] for r in a] == [r["kl_coef"] for r in b]  # the same beta sequence, bit for bit
    assert [r["prompt_rows"] for r in a] == [r["prompt_rows"] for r in b]
    for key in ("kl_response_mean", "score_mean", "reward_mean", "ppo_loss", "response_length_mean"):
        assert [r[key] for r in a] == pytest.approx([r[key] for r in b], rel=1e-6, abs=1e-9), key


def _start(cmd_args):
    return subprocess.Popen([sys.executable, "-m", "learner.main", *cmd_args], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env={**os.environ, **RAY_ENV})


def _follow(proc, on_line, timeout_s=600):
    """Feed each output line to ``on_line`` until the process ends; return the whole output."""
    out, deadline = [], time.monotonic() + timeout_s
    for line in proc.stdout:
        out.append(line)
        on_line(line)
        assert time.monotonic() < deadline, "job took too long:\n" + "".join(out[-50:])
    proc.wait(timeout=60)
    return "".join(out)


def test_actor_deaths_lost_rank_and_graceful_stop(ray_head, cache_dir, tmp_path):
    import ray

    name = "chaos"
    run_dir = tmp_path / name
    ray.init(address=ray_head.address, namespace=f"tether-{name}", log_to_driver=False)
    try:
        # kill a rollout engine, then a reference, then a learner rank; ray.kill acts after a few seconds,
        # so each kill waits for an iteration line at least 8 s after the previous one
        to_kill, last_kill = ["rollout-0", "reference-0", "learner-rank-0"], [0.0]

        def killer(line):
            if line.startswith("[tether] iter ") and to_kill and time.monotonic() - last_kill[0] > 8:
                ray.kill(ray.get_actor(to_kill.pop(0)), no_restart=False)
                last_kill[0] = time.monotonic()

        proc = _start(args(ray_head, cache_dir, tmp_path, name, "--run.iterations", "30", "--checkpoint.every", "1"))
        out = _follow(proc, killer)
        assert proc.returncode != 0
        assert "learner rank 0 (actor learner-rank-0) died" in out, out[-3000:]
        records = metrics(run_dir)
        last = len(records)
        assert 3 <= last < 30 and [r["iteration"] for r in records] == list(range(1, last + 1))
        resynced = [s for r in records for s in r["resynced_actors"]]
        assert any(s["actor"] == "rollout-0" and s["to_version"] >= 1 and s["probe_max_abs_error"] < 1e-4
                   for s in resynced), resynced
        assert any(s["actor"] == "reference-0" for s in resynced), resynced
        # the rank may die inside the checkpoint save that follows iteration `last`: then the previous one stands
        saved = int((run_dir / "checkpoints" / "latest").read_text().strip().removeprefix("iter-"))
        assert saved in (last - 1, last)

        # the last checkpoint resumes; SIGTERM during the next iteration stops cleanly with a checkpoint
        proc = _start(args(ray_head, cache_dir, tmp_path, name, "--run.iterations", "30", "--checkpoint.every", "0",
                           "--run.resume", "latest"))
        out = _follow(proc, lambda line: line.startswith(f"[tether] iter {saved + 1}/") and proc.send_signal(signal.SIGTERM))
        assert proc.returncode == 143, out[-3000:]
        stopped_at = metrics(run_dir)[-1]["iteration"]
        assert f"stopped by SIGTERM after iteration {stopped_at}" in out
        assert (run_dir / "checkpoints" / "latest").read_text().strip() == f"iter-{stopped_at:06d}"

        done = run_job(args(ray_head, cache_dir, tmp_path, name, "--run.iterations", str(stopped_at + 2),
                            "--run.resume", "latest"))
        assert done.returncode == 0, done.stderr[-3000:]
    finally:
        ray.shutdown()
    records = metrics(run_dir)
    assert [r["iteration"] for r in records] == list(range(1, stopped_at + 3))
    for r in records:  # every iteration trained on a full, on-policy batch
        assert r["episodes"] == 32
        assert r["batch_policy_versions"] == [r["policy_version"] - 1]
    betas = [r["kl_coef_used"] for r in records]
    assert all(b1 == r["kl_coef"] for b1, r in zip(betas[1:], records))  # beta continues across resumes
