"""Benchmark: the default job end to end. Time to sampled optimality >= 0.95 (cached and cold SFT),
the iteration breakdown and its overhead ratio, and the peak RSS of all the job's processes.

    .venv/bin/python benchmarks/learning.py [--cold] [-- extra learner.main args]

Writes benchmarks/results/learning.json and learning.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench import RESULTS, MeasuredJob, read_records, stamp, steady_state, write_results


def run_job(cache_dir: str, out_dir: str, extra: list[str], analyse: bool = True) -> dict:
    job = MeasuredJob(["--model.cache_dir", cache_dir, "--run.output_dir", out_dir, "--run.name", "bench",
                       *extra]).run()
    if not analyse:
        return {"wall_seconds": job.wall_seconds}
    run_dir = Path(out_dir) / "bench"
    records = read_records(run_dir)
    summary = json.loads((run_dir / "summary.json").read_text())
    # seconds from launch until the end of the first iteration whose evaluation reached 0.95
    setup = (job.first_iteration_at or 0) - records[0]["iteration_seconds"]
    elapsed, reached = setup, None
    for r in records:
        elapsed += r["iteration_seconds"]
        if r.get("eval", {}).get("optimality", 0) >= 0.95 and reached is None:
            reached = {"iteration": r["iteration"], "seconds": elapsed}
    return {
        "wall_seconds": job.wall_seconds,
        "setup_seconds": setup,
        "reached_0.95": reached,
        "eval_start": summary["eval_start"],
        "eval_final": summary["eval_final"],
        "iterations": len(records),
        **steady_state(records, warmup=2),
        "peak_rss_gib": job.peak_rss_total / 2**30,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cold", action="store_true", help="also run once from an empty SFT cache")
    parser.add_argument("--cache-dir", default=str(Path("~/.cache/tether").expanduser()))
    parser.add_argument("extra", nargs="*", help="extra learner.main arguments (after --)")
    args = parser.parse_args()
    results = stamp()
    with tempfile.TemporaryDirectory() as out:
        if args.cold:
            with tempfile.TemporaryDirectory() as cold_cache:
                results["cold"] = run_job(cold_cache, str(Path(out) / "cold"), args.extra)
        # fill the cache
        run_job(args.cache_dir, str(Path(out) / "warmup"), ["--run.iterations", "1"], analyse=False)
        results["cached"] = run_job(args.cache_dir, str(Path(out) / "cached"), args.extra)
    rows = [("| run | reached 0.95 at (s) | final optimality | wall (s) | steady iter (s) | overhead ratio | "
             "episodes/s | peak RSS (GiB) |"), "|---|---|---|---|---|---|---|---|"]
    for name in ("cached", "cold"):
        if name in results:
            r = results[name]
            reached = f"{r['reached_0.95']['seconds']:.0f} (iter {r['reached_0.95']['iteration']})" \
                if r["reached_0.95"] else "not reached"
            rows.append(f"| {name} SFT | {reached} | {r['eval_final']['optimality']:.3f} | "
                        f"{r['wall_seconds']:.0f} | {r['steady_iteration_seconds']:.2f} | "
                        f"{r['overhead_ratio']:.2f} | {r['episodes_per_second']:.0f} | "
                        f"{r['peak_rss_gib']:.2f} |")
    b = results["cached"]["breakdown_seconds"]
    rows += ["", "Steady-state iteration breakdown (median seconds): " +
             ", ".join(f"{k.removesuffix('_seconds')} {v:.3f}" for k, v in b.items())]
    write_results(RESULTS, "learning", results, rows)
    print("\n".join(rows))


if __name__ == "__main__":
    main()
