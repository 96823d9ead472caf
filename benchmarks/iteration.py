"""Benchmark: where an iteration's time and memory go, on randomwalks and on smollm2-sentiment.

    .venv/bin/python benchmarks/iteration.py [--tasks randomwalks smollm2-sentiment] [--iterations 6]
                                             [--eval-every N] [--runs-dir DIR] [--out DIR]
                                             [-- extra learner.main args]

Runs ``python -m learner.main`` once per task (randomwalks: the embedded default; smollm2-sentiment:
``deploy/configs/smollm2-sentiment.yaml``) for ``--iterations`` iterations with evaluation only at the end
(or every ``--eval-every``), each job starting its own local Ray as its children; ``--runs-dir`` keeps
the run directories (curves.png, samples/, metrics.jsonl), which otherwise go to a temporary folder. From
metrics.jsonl, medians over the iterations after the first (warm-up) without an evaluation:

- the breakdown of an iteration into generate (rollout engines' busy time), score (reference), reward,
  learner forward, PPO update and sync (weight broadcast, state check and probe);
- the overhead ratio: iteration wall time over the sum of those parts (below 1 where reference, reward
  and the learner's forward overlap generation; above 1 is time no part accounts for);
- samples (episodes) per second.

Peak RSS per role (rollout, reference, reward, learner, driver, ray's own processes) is sampled every
0.5 s over the process tree of the job. Writes ``<out>/iteration.json`` and ``iteration.md``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench import RESULTS, ROOT, MeasuredJob, read_records, stamp, steady_state, write_results

TASK_ARGS = {
    "randomwalks": [],
    "smollm2-sentiment": ["--config", str(ROOT / "deploy" / "configs" / "smollm2-sentiment.yaml")],
}
ROLES = ("rollout", "reference", "reward", "learner", "driver", "ray")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", nargs="+", default=list(TASK_ARGS), choices=list(TASK_ARGS))
    parser.add_argument("--iterations", type=int, default=6)
    parser.add_argument("--cache-dir", default=str(Path("~/.cache/tether").expanduser()))
    parser.add_argument("--eval-every", type=int, default=None, help="default: only after the last iteration")
    parser.add_argument("--runs-dir", default=None,
                        help="keep the run directories here (default: a temp dir)")
    parser.add_argument("--out", default=str(RESULTS))
    parser.add_argument("extra", nargs="*", help="extra learner.main arguments (after --)")
    args = parser.parse_args()
    if args.iterations < 3:
        parser.error("--iterations must be at least 3 (a warm-up, a steady one, and the evaluating last one)")
    results = {**stamp(), "iterations": args.iterations, "eval_every": args.eval_every, "extra": args.extra,
               "tasks": {}}
    with tempfile.TemporaryDirectory() as tmp:
        out = args.runs_dir or tmp
        for task in args.tasks:
            job = MeasuredJob([*TASK_ARGS[task], "--model.cache_dir", args.cache_dir, "--run.output_dir", out,
                               "--run.name", task, "--run.iterations", str(args.iterations),
                               "--run.eval_every", str(args.eval_every or args.iterations),
                               *args.extra]).run()
            results["tasks"][task] = {
                "wall_seconds": job.wall_seconds,
                **steady_state(read_records(Path(out) / task)),
                "peak_rss_gib": {r: job.peak_rss.get(r, 0) / 2**30 for r in ROLES},
                "peak_rss_total_gib": job.peak_rss_total / 2**30,
            }
    rows = [("| task | episodes/iter | iteration (s) | generate | score | reward | learner fwd | "
             "PPO update | sync | overhead ratio | samples/s |"),
            "|---|---|---|---|---|---|---|---|---|---|---|"]
    for task, r in results["tasks"].items():
        b = r["breakdown_seconds"]
        rows.append(f"| {task} | {r['episodes_per_iteration']:.0f} | {r['steady_iteration_seconds']:.2f} | "
                    + " | ".join(f"{v:.2f}" for v in b.values())
                    + f" | {r['overhead_ratio']:.2f} | {r['episodes_per_second']:.1f} |")
    rows += ["", "Peak RSS by role (GiB; a role's processes summed, sampled every 0.5 s):", "",
             "| task | " + " | ".join(ROLES) + " | all (peak of the sum) |", "|---" * (len(ROLES) + 2) + "|"]
    for task, r in results["tasks"].items():
        rows.append(f"| {task} | " + " | ".join(f"{r['peak_rss_gib'][k]:.2f}" for k in ROLES)
                    + f" | {r['peak_rss_total_gib']:.2f} |")
    rows += ["", (f"Medians over iterations 2..{args.iterations} without an evaluation (the first warms up). "
             "Times in seconds; generate, score and reward are the actors' busy time, which overlaps the "
             "learner's forward as chunks stream, so the overhead ratio (iteration over the sum of the "
             "parts) can fall below 1.")]
    json_path, md_path = write_results(args.out, "iteration", results, rows)
    print("\n".join(rows))
    print(f"wrote {json_path} and {md_path}")


if __name__ == "__main__":
    main()
