"""Soak: run the default job for a while and kill a random non-learner actor every 2-3 minutes.

    .venv/bin/python benchmarks/soak.py [--minutes 25] [-- extra learner.main args]

Starts its own Ray head (deploy/local-cluster.sh), runs `python -m learner.main` against it, kills
rollout/reference/reward actors by name with ``ray.kill(actor, no_restart=False)``, samples the memory of
every process of the cluster and the job, and at the end stops the job with SIGTERM (graceful stop).
Writes benchmarks/results/soak.json, soak.md and soak.png: iterations, batches lost (must be 0), probe
failures (must be 0), beta continuity, and memory over time (must not grow).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench import RAY_ENV, RESULTS, ROOT, rss_by_role

VICTIMS = ("rollout-0", "reference-0", "reward-0")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=25.0)
    parser.add_argument("--kill-every", type=float, nargs=2, default=(120.0, 180.0), help="seconds, min max")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("extra", nargs="*")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    os.environ.update(RAY_ENV)
    state_dir = tempfile.mkdtemp(prefix="soak-cluster-")
    env = {**os.environ, "TETHER_CLUSTER_DIR": state_dir}
    up = subprocess.run(["bash", "deploy/local-cluster.sh", "up"], cwd=ROOT, env=env, capture_output=True,
                        text=True, check=False)
    if up.returncode != 0:
        sys.exit(up.stdout + up.stderr)
    address = next(line.split("=", 1)[1] for line in up.stdout.splitlines()
                   if line.startswith("RAY_ADDRESS="))
    state = dict(line.split("=", 1) for line in (Path(state_dir) / "state.env").read_text().splitlines()
                 if "=" in line)
    head_pid = int(state["PID"])
    out_dir = tempfile.mkdtemp(prefix="soak-run-")
    import ray

    job = None
    try:
        ray.init(address=address, namespace="tether-soak", log_to_driver=False)
        job = subprocess.Popen(
            [sys.executable, "-m", "learner.main", "--cluster.address", address, "--run.output_dir", out_dir,
             "--run.name", "soak", "--run.iterations", "1000000", "--checkpoint.every", "25",
             "--run.eval_every", "25", *args.extra],
            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        log_lines: list[str] = []
        threading.Thread(target=lambda: log_lines.extend(job.stdout), daemon=True).start()
        start = time.monotonic()
        memory, kills = [], []
        next_kill = start + rng.uniform(*args.kill_every)
        while time.monotonic() - start < args.minutes * 60 and job.poll() is None:
            now = time.monotonic()
            memory.append({"t": now - start,
                           "rss_gib": sum(rss_by_role([job.pid, head_pid]).values()) / 2**30})
            if now >= next_kill:
                victim = rng.choice(VICTIMS)
                try:
                    ray.kill(ray.get_actor(victim), no_restart=False)
                    kills.append({"t": now - start, "actor": victim})
                    print(f"soak: killed {victim} at {now - start:.0f}s", flush=True)
                except ValueError as err:  # not created yet
                    print(f"soak: {victim} not found: {err}", flush=True)
                next_kill = now + rng.uniform(*args.kill_every)
            time.sleep(10)
        if job.poll() is None:
            job.send_signal(signal.SIGTERM)
            job.wait(timeout=600)
    finally:
        if job is not None and job.poll() is None:
            job.kill()
        ray.shutdown()
        subprocess.run(["bash", "deploy/local-cluster.sh", "down"], cwd=ROOT, env=env, check=False)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "soak.log").write_text("".join(line for line in log_lines if line.startswith("[tether]")
                                              or "Error" in line or "error" in line))
    records = [json.loads(x) for x in (Path(out_dir) / "soak" / "metrics.jsonl").read_text().splitlines()]
    batch = records[0]["episodes"]
    lost = sum(1 for r in records if r["episodes"] != batch)
    continuity = all(r1["kl_coef_used"] == r0["kl_coef"] for r0, r1 in itertools.pairwise(records))
    resyncs = [s for r in records for s in r["resynced_actors"]]
    probe_failures = sum(1 for s in resyncs if s.get("probe_max_abs_error", 0) > 1e-4) + \
        sum(1 for r in records if r["probe_max_abs_error"] == r["probe_max_abs_error"]
            and r["probe_max_abs_error"] > 1e-4)
    fifth = max(len(memory) // 5, 1)
    result = {
        "date": time.strftime("%Y-%m-%d"),
        "minutes": args.minutes,
        "job_exit_code": job.returncode,
        "stopped_gracefully": any("stopped by SIGTERM" in line for line in log_lines),
        "iterations": len(records),
        "kills": kills,
        "actor_resyncs": len(resyncs),
        "batches_lost": lost,
        "probe_failures": probe_failures,
        "beta_continuous": continuity,
        "beta_first_last": [records[0]["kl_coef_used"], records[-1]["kl_coef"]],
        "rss_gib_first_fifth_median": statistics.median(m["rss_gib"] for m in memory[:fifth]),
        "rss_gib_last_fifth_median": statistics.median(m["rss_gib"] for m in memory[-fifth:]),
        "rss_gib_peak": max(m["rss_gib"] for m in memory),
        "final_eval": next((r["eval"] for r in reversed(records) if "eval" in r), None),
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "soak.json").write_text(json.dumps({**result, "memory": memory}, indent=1) + "\n")
    rows = [f"| {k} | {v} |" for k, v in result.items() if k not in ("kills",)]
    rows.insert(0, f"# soak\n\n`.venv/bin/python benchmarks/soak.py --minutes {args.minutes:g}`\n\n"
                   "| figure | value |\n|---|---|")
    rows.append(f"| kills | {len(kills)}: " + ", ".join(f"{k['actor']}@{k['t']:.0f}s" for k in kills) + " |")
    (RESULTS / "soak.md").write_text("\n".join(rows) + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3))
    ax.plot([m["t"] / 60 for m in memory], [m["rss_gib"] for m in memory])
    for k in kills:
        ax.axvline(k["t"] / 60, color="r", alpha=0.3)
    ax.set_xlabel("minutes (red: an actor killed)")
    ax.set_ylabel("RSS of all processes (GiB)")
    fig.tight_layout()
    fig.savefig(RESULTS / "soak.png", dpi=100)
    print("\n".join(rows))


if __name__ == "__main__":
    main()
