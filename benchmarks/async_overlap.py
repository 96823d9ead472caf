"""Benchmark: ``rollout.mode async`` against ``sync`` in one run, same job and seed. Reports the steady
iteration time of each, the sync run's ``max(generate, learner update)`` (what a perfect overlap would
take) and the overlap ratios.

    .venv/bin/python benchmarks/async_overlap.py [--iterations 12] [-- extra learner.main args]

The default is randomwalks from the cached SFT start; pass ``-- --config deploy/configs/<preset>.yaml``
for another job. Writes benchmarks/results/async_overlap.json and async_overlap.md, or
async_overlap-<preset>.json and .md for a preset.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench import RESULTS, MeasuredJob, read_records, stamp, steady_state, write_results

MODES = ("sync", "async")


def run_mode(mode: str, iterations: int, cache_dir: str, out_dir: str, extra: list[str]) -> dict:
    MeasuredJob(["--model.cache_dir", cache_dir, "--run.output_dir", out_dir, "--run.name", mode,
                 "--rollout.mode", mode, "--run.iterations", str(iterations), "--run.eval_every", "1000",
                 "--no-checkpoint.export_hf", *extra]).run()
    records = read_records(Path(out_dir) / mode)
    return {"iterations": len(records), "staleness_max": max(r["batch_staleness_max"] for r in records),
            **steady_state(records, warmup=2)}


def table(results: dict) -> list[str]:
    sync, run_async = results["sync"], results["async"]
    parts = sync["breakdown_seconds"]
    bound = max(parts["generate_seconds"], parts["learner_update_seconds"])
    return [
        ("| sync iteration (s) | async iteration (s) | sync generate (s) | sync update (s) "
         "| max(generate, update) (s) | async / sync | async / max(generate, update) |"),
        "|---|---|---|---|---|---|---|",
        (f"| {sync['steady_iteration_seconds']:.2f} | {run_async['steady_iteration_seconds']:.2f} | "
        f"{parts['generate_seconds']:.2f} | {parts['learner_update_seconds']:.2f} | {bound:.2f} | "
        f"{run_async['steady_iteration_seconds'] / sync['steady_iteration_seconds']:.2f} | "
        f"{run_async['steady_iteration_seconds'] / bound:.2f} |"),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iterations", type=int, default=12)
    parser.add_argument("--cache-dir", default=str(Path("~/.cache/tether").expanduser()))
    parser.add_argument("extra", nargs="*", help="extra learner.main arguments (after --)")
    args = parser.parse_args()
    results = stamp()
    with tempfile.TemporaryDirectory() as out:
        for mode in MODES:
            results[mode] = run_mode(mode, args.iterations, args.cache_dir, out, args.extra)
    results["args"] = args.extra
    preset = next((Path(a).stem for a, prev in zip(args.extra, ["", *args.extra]) if prev == "--config"),
                  None)
    write_results(RESULTS, f"async_overlap-{preset}" if preset else "async_overlap", results, table(results))
    print("\n".join(table(results)))


if __name__ == "__main__":
    main()
