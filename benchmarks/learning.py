"""Benchmark: the default job end to end. Time to sampled optimality >= 0.95 (cached and cold SFT),
the iteration breakdown and its overhead ratio, and the peak RSS of all the job's processes.

    .venv/bin/python benchmarks/learning.py [--cold] [-- extra learner.main args]

Writes benchmarks/results/learning.json and learning.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}


def tree_rss(proc: psutil.Process) -> int:
    total = 0
    for p in [proc, *proc.children(recursive=True)]:
        try:
            total += p.memory_info().rss
        except psutil.Error:
            pass
    return total


def run_job(cache_dir: str, out_dir: str, extra: list[str], analyse: bool = True) -> dict:
    cmd = [sys.executable, "-m", "learner.main", "--model.cache_dir", cache_dir, "--run.output_dir", out_dir,
           "--run.name", "bench", *extra]
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, **ENV}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    peak, lines = [0], []
    watcher = psutil.Process(proc.pid)

    def sample():
        while proc.poll() is None:
            peak[0] = max(peak[0], tree_rss(watcher))
            time.sleep(0.5)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    first_iter_at = None
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("[tether] iter 1/") and first_iter_at is None:
            first_iter_at = time.perf_counter() - start
        if line.startswith("[tether]"):
            print(line, end="", flush=True)
    proc.wait()
    wall = time.perf_counter() - start
    thread.join()
    if proc.returncode != 0:
        sys.exit("job failed:\n" + "".join(lines[-40:]))
    if not analyse:
        return {"wall_seconds": wall}
    run_dir = Path(out_dir) / "bench"
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((run_dir / "summary.json").read_text())
    # seconds from launch until the end of the first iteration whose evaluation reached 0.95
    setup = (first_iter_at or 0) - records[0]["iteration_seconds"]
    elapsed, reached = setup, None
    for r in records:
        elapsed += r["iteration_seconds"]
        if r.get("eval", {}).get("optimality", 0) >= 0.95 and reached is None:
            reached = {"iteration": r["iteration"], "seconds": elapsed}
    steady = [r for r in records[2:] if "eval" not in r]
    parts = ("generate_seconds", "reference_seconds", "reward_seconds", "learner_forward_seconds",
             "learner_update_seconds", "sync_and_probe_seconds")
    breakdown = {k: statistics.median(r[k] for r in steady) for k in parts}
    iteration = statistics.median(r["iteration_seconds"] for r in steady)
    return {
        "wall_seconds": wall,
        "setup_seconds": setup,
        "reached_0.95": reached,
        "eval_start": summary["eval_start"],
        "eval_final": summary["eval_final"],
        "iterations": len(records),
        "steady_iteration_seconds": iteration,
        "breakdown_seconds": breakdown,
        "overhead_ratio": iteration / sum(breakdown.values()),
        "episodes_per_second": statistics.median(r["episodes"] / r["iteration_seconds"] for r in steady),
        "peak_rss_gib": peak[0] / 2**30,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cold", action="store_true", help="also run once from an empty SFT cache")
    parser.add_argument("--cache-dir", default=str(Path("~/.cache/tether").expanduser()))
    parser.add_argument("extra", nargs="*", help="extra learner.main arguments (after --)")
    args = parser.parse_args()
    results = {"date": time.strftime("%Y-%m-%d"), "machine": f"{os.cpu_count()} CPUs, "
               f"{psutil.virtual_memory().total / 2**30:.0f} GiB"}
    with tempfile.TemporaryDirectory() as out:
        if args.cold:
            with tempfile.TemporaryDirectory() as cold_cache:
                results["cold"] = run_job(cold_cache, str(Path(out) / "cold"), args.extra)
        run_job(args.cache_dir, str(Path(out) / "warmup"), ["--run.iterations", "1"], analyse=False)  # fill the cache
        results["cached"] = run_job(args.cache_dir, str(Path(out) / "cached"), args.extra)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "learning.json").write_text(json.dumps(results, indent=2) + "\n")
    rows = ["| run | reached 0.95 at (s) | final optimality | wall (s) | steady iter (s) | overhead ratio | "
            "episodes/s | peak RSS (GiB) |", "|---|---|---|---|---|---|---|---|"]
    for name in ("cached", "cold"):
        if name in results:
            r = results[name]
            reached = f"{r['reached_0.95']['seconds']:.0f} (iter {r['reached_0.95']['iteration']})" \
                if r["reached_0.95"] else "not reached"
            rows.append(f"| {name} SFT | {reached} | {r['eval_final']['optimality']:.3f} | {r['wall_seconds']:.0f} | "
                        f"{r['steady_iteration_seconds']:.2f} | {r['overhead_ratio']:.2f} | "
                        f"{r['episodes_per_second']:.0f} | {r['peak_rss_gib']:.2f} |")
    b = results["cached"]["breakdown_seconds"]
    rows += ["", "Steady-state iteration breakdown (median seconds): " +
             ", ".join(f"{k.removesuffix('_seconds')} {v:.3f}" for k, v in b.items())]
    (RESULTS / "learning.md").write_text(f"{results['date']}, {results['machine']}\n\n" + "\n".join(rows) + "\n")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
