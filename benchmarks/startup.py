"""Benchmark: start-up, from ``python -m learner.main`` starting to its first generation, with cached models,
against a running Ray head (as under ``ray job submit``); and the CPU seconds each process spent until then.

    .venv/bin/python benchmarks/startup.py [--runs 3] [--cache-dir ~/.cache/tether]
        [-- extra learner.main args]

Starts a head with ``deploy/local-cluster.sh up`` (stopped by its own PID at the end), runs one job to warm
the page cache, then ``--runs`` jobs of the default randomwalks config for one iteration. For each it
records when the driver printed "actors ready" and "eval before training": the evaluation before training
is the job's first generation, so the second time bounds it from above (by the evaluation's scoring, a
few milliseconds on randomwalks). At that line it reads the CPU time of every process under the driver and
the head, less what the head's processes had spent before the job, summed by role: rollout, reference,
reward, learner, driver, workers (Ray workers that ran tasks, such as the pre-flight checks, or stayed idle)
and ray (the head's own daemons). Writes ``benchmarks/results/startup.json`` and ``startup.md``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench import RAY_ENV, RESULTS, ROOT, processes_by_role, stamp, write_results

ROLES = ("rollout", "reference", "reward", "learner", "driver", "workers", "ray")


def cpu_by_process(root_pids: list[int]) -> dict[int, tuple[str, float]]:
    """(role, CPU seconds) of every process under ``root_pids``, by PID."""
    import psutil

    found = {}
    for proc, role in processes_by_role(root_pids, other_workers="workers"):
        try:
            times = proc.cpu_times()
        except psutil.Error:
            continue
        found[proc.pid] = (role, times.user + times.system)
    return found


def one_job(address: str, head_pid: int, cache_dir: str, out_dir: str, name: str, extra: list[str]) -> dict:
    before = cpu_by_process([head_pid])
    start = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-m", "learner.main", "--cluster.address", address, "--model.cache_dir", cache_dir,
         "--run.output_dir", out_dir, "--run.name", name, "--run.iterations", "1", "--run.eval_every", "1000",
         "--no-checkpoint.export_hf", "--checkpoint.every", "0", *extra],
        cwd=ROOT, env={**os.environ, **RAY_ENV}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    marks, cpu, lines = {}, {}, []
    for line in proc.stdout:
        lines.append(line)
        for key, prefix in (("actors_ready_seconds", "[tether] actors ready"),
                            ("first_generation_seconds", "[tether] eval before training")):
            if line.startswith(prefix) and key not in marks:
                marks[key] = time.perf_counter() - start
                if key == "first_generation_seconds":
                    for pid, (role, seconds) in cpu_by_process([proc.pid, head_pid]).items():
                        spent = seconds - (before[pid][1] if pid in before else 0.0)
                        cpu[role] = cpu.get(role, 0.0) + spent
    if proc.wait() != 0 or len(marks) < 2:
        sys.exit(f"job {name} failed (exit {proc.returncode}):\n" + "".join(lines[-40:]))
    return {**marks, "cpu_seconds": {role: round(cpu.get(role, 0.0), 2) for role in ROLES},
            "cpu_seconds_total": round(sum(cpu.values()), 2)}


def table(runs: list[dict]) -> list[str]:
    def med(key):
        return statistics.median(r[key] for r in runs)

    cpu = {role: statistics.median(r["cpu_seconds"][role] for r in runs) for role in ROLES}
    return [
        "| process start to actors ready (s) | to the first generation (s) | CPU s until then: "
        + " / ".join(ROLES) + " | CPU s, all |",
        "|---|---|---|---|",
        f"| {med('actors_ready_seconds'):.1f} | {med('first_generation_seconds'):.1f} | "
        + " / ".join(f"{cpu[r]:.1f}" for r in ROLES) + f" | {med('cpu_seconds_total'):.1f} |",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--cache-dir", default=str(Path("~/.cache/tether").expanduser()))
    parser.add_argument("extra", nargs="*", help="extra learner.main arguments (after --)")
    args = parser.parse_args()
    os.environ.update(RAY_ENV)
    state_dir = tempfile.mkdtemp(prefix="startup-cluster-")
    env = {**os.environ, "TETHER_CLUSTER_DIR": state_dir}
    up = subprocess.run(["bash", "deploy/local-cluster.sh", "up"], cwd=ROOT, env=env, capture_output=True,
                        text=True, check=False)
    if up.returncode != 0:
        sys.exit(up.stdout + up.stderr)
    address = next(line.split("=", 1)[1] for line in up.stdout.splitlines()
                   if line.startswith("RAY_ADDRESS="))
    state = dict(line.split("=", 1) for line in (Path(state_dir) / "state.env").read_text().splitlines()
                 if "=" in line)
    try:
        with tempfile.TemporaryDirectory() as out:
            one_job(address, int(state["PID"]), args.cache_dir, out, "warm-up", args.extra)
            runs = [one_job(address, int(state["PID"]), args.cache_dir, out, f"run-{i}", args.extra)
                    for i in range(args.runs)]
    finally:
        subprocess.run(["bash", "deploy/local-cluster.sh", "down"], cwd=ROOT, env=env, check=False)
    results = {**stamp(), "runs": runs, "args": args.extra}
    write_results(RESULTS, "startup", results, table(runs))
    print("\n".join(table(runs)))


if __name__ == "__main__":
    main()
