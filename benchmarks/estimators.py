"""Benchmark: each advantage estimator (``ppo.advantage``) from the cached SFT start on randomwalks, the
default 30 iterations at 128 episodes per iteration (``rollout.samples_per_prompt`` 8 for the group
estimators, so 16 prompts per iteration; 1 otherwise). Reports the first evaluation whose sampled
optimality reached 0.95, the final one, and the wall and steady iteration time.

    .venv/bin/python benchmarks/estimators.py [--only grpo rloo ...] [--mode async] [-- extra learner.main args]

Writes benchmarks/results/estimators.json and estimators.md (estimators-async.* with ``--mode async``).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench import RESULTS, MeasuredJob, read_records, stamp, steady_state, write_results

ESTIMATORS = ("gae", "grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline")
GROUP_ESTIMATORS = ("grpo", "rloo", "reinforce_pp_baseline")
SAMPLES_PER_PROMPT = 8  # for the group estimators, as issue 12 sets the benchmark


def estimator_args(estimator: str) -> list[str]:
    n = SAMPLES_PER_PROMPT if estimator in GROUP_ESTIMATORS else 1
    return ["--ppo.advantage", estimator, "--rollout.samples_per_prompt", str(n)]


def run_estimator(estimator: str, cache_dir: str, out_dir: str, extra: list[str]) -> dict:
    job = MeasuredJob(["--model.cache_dir", cache_dir, "--run.output_dir", out_dir, "--run.name", estimator,
                       *estimator_args(estimator), *extra]).run()
    run_dir = Path(out_dir) / estimator
    records = read_records(run_dir)
    summary = json.loads((run_dir / "summary.json").read_text())
    evals = [(r["iteration"], r["eval"]["optimality"]) for r in records if "eval" in r]
    reached = next((i for i, optimality in evals if optimality >= 0.95), None)
    return {
        "args": estimator_args(estimator) + extra,
        "wall_seconds": job.wall_seconds,
        "reached_0.95_iteration": reached,
        "eval_start": summary["eval_start"],
        "eval_final": summary["eval_final"],
        "evals": evals,
        "kl_response_mean_final": summary["kl_response_mean_final"],
        "iterations": len(records),
        **steady_state(records, warmup=2),
    }


def table(results: dict, estimators: list[str]) -> list[str]:
    rows = [("| ppo.advantage | samples per prompt | optimality >= 0.95 at iteration | optimality start -> final "
             "| KL final (nats) | wall (s) | steady iteration (s) |"), "|---|---|---|---|---|---|---|"]
    for estimator in estimators:
        r = results[estimator]
        n = SAMPLES_PER_PROMPT if estimator in GROUP_ESTIMATORS else 1
        reached = r["reached_0.95_iteration"] if r["reached_0.95_iteration"] is not None else "not reached"
        rows.append(f"| {estimator} | {n} | {reached} | {r['eval_start']['optimality']:.3f} -> "
                    f"{r['eval_final']['optimality']:.3f} | {r['kl_response_mean_final']:.2f} | "
                    f"{r['wall_seconds']:.0f} | {r['steady_iteration_seconds']:.2f} |")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="+", choices=ESTIMATORS, default=list(ESTIMATORS))
    parser.add_argument("--cache-dir", default=str(Path("~/.cache/tether").expanduser()))
    parser.add_argument("--mode", choices=("sync", "async"), default="sync", help="rollout.mode of every run")
    parser.add_argument("extra", nargs="*", help="extra learner.main arguments (after --)")
    args = parser.parse_args()
    results, done = stamp(), []
    name = "estimators" if args.mode == "sync" else f"estimators-{args.mode}"
    with tempfile.TemporaryDirectory() as out:
        MeasuredJob(["--model.cache_dir", args.cache_dir, "--run.output_dir", str(Path(out) / "warmup"),
                     "--run.name", "warmup", "--run.iterations", "1"]).run()  # fill the SFT cache
        for estimator in args.only:
            results[estimator] = run_estimator(estimator, args.cache_dir, out, ["--rollout.mode", args.mode, *args.extra])
            done.append(estimator)
            write_results(RESULTS, name, results, table(results, done))  # a partial run keeps its rows
    print("\n".join(table(results, done)))


if __name__ == "__main__":
    main()
