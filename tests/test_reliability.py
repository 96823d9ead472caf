"""Reliability, as a user would meet it: resume with the same trajectory, refused checkpoints, actors
killed mid-run, a lost learner rank, and a graceful stop. Real jobs on a real local Ray head."""

from __future__ import annotations

import json
import re
import shutil
import signal
import time
from pathlib import Path

import pytest

from tests.conftest import SMALL, follow_job, run_job, start_job

pytestmark = pytest.mark.integration

def args(ray_head, cache_dir, out, name, *extra):
    return ["--cluster.address", ray_head.address, "--model.cache_dir", cache_dir,
            "--run.output_dir", str(out), "--run.name", name, *SMALL, *extra]


def metrics(run_dir: Path, name: str = "metrics.jsonl") -> list[dict]:
    return [json.loads(x) for x in (run_dir / name).read_text().splitlines()]


def test_resume_reproduces_the_straight_run_and_refuses_bad_checkpoints(ray_head, cache_dir,
                                                                        small_run, tmp_path):
    """The small run (4 iterations, a checkpoint every 2), moved to another directory, resumed from its
    iteration 2: iterations 3 and 4 again, the same to the bit. Before that, a changed config and damaged
    checkpoints are refused, naming the file, and touch nothing."""
    straight_dir, straight = small_run
    assert straight.returncode == 0, straight.stderr[-3000:]
    assert (straight_dir / "checkpoints" / "latest").read_text().strip() == "iter-000004"
    run_dir = tmp_path / "runs" / straight_dir.name  # a run directory moved elsewhere still resumes
    shutil.copytree(straight_dir, run_dir)
    checkpoint = run_dir / "checkpoints" / "iter-000002"
    assert json.loads((checkpoint / "driver.json").read_text())["kl_controller"]["kind"] == "adaptive"

    def resume(out, *extra, timeout_s=900):
        return run_job(args(ray_head, cache_dir, out, straight_dir.name, "--run.iterations", "4", *extra),
                       timeout_s=timeout_s)

    # a config that changes the run is refused, naming the checkpoint file
    bad = resume(run_dir.parent, "--run.resume", str(checkpoint), "--ppo.lr", "0.5", timeout_s=300)
    assert bad.returncode != 0
    assert f"{checkpoint / 'driver.json'}" in bad.stderr and "ppo.lr" in bad.stderr

    # a truncated file is named and nothing is touched; no silent fresh start
    corrupt_dir = tmp_path / "corrupt" / straight_dir.name
    shutil.copytree(run_dir, corrupt_dir)
    victim = max((p for p in (corrupt_dir / "checkpoints" / "iter-000004").rglob("*.pt")),
                 key=lambda p: p.stat().st_size)
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
    before = (corrupt_dir / "metrics.jsonl").read_text()
    refused = resume(corrupt_dir.parent, "--run.resume", "latest", timeout_s=300)
    assert refused.returncode != 0
    assert str(victim) in refused.stderr and "truncated" in refused.stderr
    assert (corrupt_dir / "metrics.jsonl").read_text() == before
    garbled = corrupt_dir / "checkpoints" / "iter-000004" / "manifest.json"
    garbled.write_text("{not json")
    refused = resume(corrupt_dir.parent, "--run.resume", "latest", timeout_s=300)
    assert refused.returncode != 0 and str(garbled) in refused.stderr

    resumed = resume(run_dir.parent, "--run.resume", str(checkpoint))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    a, b = metrics(straight_dir), metrics(run_dir)
    assert [r["iteration"] for r in b] == [1, 2, 3, 4]
    assert [r["iteration"] for r in metrics(run_dir, "metrics.discarded.jsonl")] == [3, 4]
    assert [r["kl_coef"] for r in a] == [r["kl_coef"] for r in b]  # the same beta sequence, bit for bit
    assert [r["prompt_rows"] for r in a] == [r["prompt_rows"] for r in b]
    for key in ("kl_response_mean", "score_mean", "reward_mean", "ppo_loss", "response_length_mean"):
        assert [r[key] for r in a] == pytest.approx([r[key] for r in b], rel=1e-6, abs=1e-9), key


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

        proc = start_job(args(ray_head, cache_dir, tmp_path, name, "--run.iterations", "30",
                              # a reference actor to kill
                              "--checkpoint.every", "1", "--reference.placement", "actor"))
        out = follow_job(proc, killer)
        assert proc.returncode != 0
        assert "learner rank 0 (actor learner-rank-0) died" in out, out[-3000:]
        records = metrics(run_dir)
        last = len(records)
        assert 3 <= last < 30 and [r["iteration"] for r in records] == list(range(1, last + 1))
        resynced = [s for r in records for s in r["resynced_actors"]]
        assert any(s["actor"] == "rollout-0" and s["to_version"] >= 1 and s["probe_max_abs_error"] < 1e-4
                   for s in resynced), resynced
        assert any(s["actor"] == "reference-0" for s in resynced), resynced
        # and the console says so (it said nothing when Ray's memory monitor killed an engine)
        assert re.search(r"\[tether\] rollout-0 came back at version 0 \(restarted[^\n]*\); re-synced to "
                         r"version \d+", out), out[-3000:]
        # the rank may die inside the checkpoint save that follows iteration `last`: then the previous one
        # stands
        saved = int((run_dir / "checkpoints" / "latest").read_text().strip().removeprefix("iter-"))
        assert saved in (last - 1, last)

        # the last checkpoint resumes; SIGTERM during the next iteration stops cleanly with a checkpoint
        proc = start_job(args(ray_head, cache_dir, tmp_path, name, "--run.iterations", "30",
                              "--checkpoint.every", "0", "--run.resume", "latest"))
        out = follow_job(proc, lambda line: line.startswith(f"[tether] iter {saved + 1}/")
                         and proc.send_signal(signal.SIGTERM))
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


@pytest.mark.integration
def test_a_signal_during_start_up_ends_the_job_in_one_line_and_its_local_ray_with_it(cache_dir, tmp_path):
    """Ctrl-C (SIGINT) while the job starts, on the local Ray it started itself, before the loop takes signals
    over: one line says so, exit 130, no traceback, and the Ray daemons the driver started are gone."""
    import psutil

    proc = start_job(["--config", "tests/configs/small.yaml", "--model.cache_dir", cache_dir,
                      "--run.output_dir", str(tmp_path), "--cluster.num_cpus", "2"])
    daemons: set[int] = set()

    def on_line(line: str) -> None:
        if line.startswith("[tether] run directory"):  # Ray is up; the actors are not started yet
            children = psutil.Process(proc.pid).children(recursive=True)
            daemons.update(p.pid for p in children if p.name() in ("raylet", "gcs_server"))
            proc.send_signal(signal.SIGINT)

    out = follow_job(proc, on_line, timeout_s=300)
    assert proc.returncode == 130, out[-3000:]
    last = out.splitlines()[-1]
    assert last == "[tether] stopped by a signal before the run's next checkpoint", out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    assert daemons, "the job started no local Ray"
    time.sleep(3)
    left = [p for p in daemons if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    assert not left, f"Ray daemons {left} outlived the job"


def test_a_job_starved_of_cpu_by_other_processes_says_so_once_naming_them(ray_head, cache_dir, tmp_path):
    """Three busy processes at the test's own priority beside a short job on two CPUs: the job's processes
    wait for a core longer than they run, and the console says so once, naming the busiest of the others
    (one of ours among them), instead of a job that only looks slow. The job still ends."""
    import subprocess
    import sys

    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(3)]
    try:
        proc = start_job(args(ray_head, cache_dir, tmp_path, "starved", "--run.iterations", "3",
                              "--metrics.cpu_watch_s", "2"))
        out = follow_job(proc, lambda line: None)
    finally:
        for p in busy:
            p.kill()
            p.wait()
    assert proc.returncode == 0, out[-3000:]
    lines = [line for line in out.splitlines() if line.startswith("[tether] starved of CPU on ")]
    assert len(lines) == 1, out[-3000:]
    assert re.search(r"the job's processes ran [\d.]+s and waited [\d.]+s ready to run \(\d+% of what they "
                     r"asked for\), while other processes took [\d.]+ of \d+ CPUs; the busiest: ", lines[0])
    named = {int(pid) for pid in re.findall(r"\(pid (\d+), niceness", lines[0])}
    assert named & {p.pid for p in busy}, (lines[0], [p.pid for p in busy])
