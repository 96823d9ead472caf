"""Benchmark: the learning rate each critic-free estimator takes when ``ppo.lr`` is unset (``ADVANTAGE_LR`` in
services/settings_training.py), on randomwalks graphs other than the default one (``task.seed`` 1000), in
sync and async mode, over run seeds. The default job's 30 iterations at 128 episodes, 8 samples a prompt, from
each graph's own cached SFT start; no ``--ppo.lr`` is passed, so each run trains at its estimator's default.
The aim: final sampled optimality >= 0.95 in every cell (the default job's GAE reaches 0.98 on the default
graph).

    .venv/bin/python benchmarks/advantage_lr.py [--estimators grpo rloo] [--graphs 1001 1002 1003]
        [--mode sync async] [--seeds 1 2 3] [--name NAME] [-- extra learner.main args]

Writes benchmarks/results/advantage_lr.json and .md (advantage_lr-NAME with --name, a sweep's own table); a
partial run keeps its rows, and the rows of earlier runs stay (a cell run again replaces its own).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench import RESULTS, MeasuredJob, read_records, stamp, write_results

NAME = "advantage_lr"


def run(estimator: str, graph: int, mode: str, seed: int, cache_dir: str, out_dir: str,
        extra: list[str]) -> dict:
    name = f"{estimator}-{graph}-{mode}-{seed}"
    args = ["--ppo.advantage", estimator, "--rollout.samples_per_prompt", "8", "--task.seed", str(graph),
            "--rollout.mode", mode, "--run.seed", str(seed), "--run.eval_every", "5", *extra]
    job = MeasuredJob(["--model.cache_dir", cache_dir, "--run.output_dir", out_dir, "--run.name", name,
                       "--checkpoint.every", "0", *args]).run()
    run_dir = Path(out_dir) / name
    summary = json.loads((run_dir / "summary.json").read_text())
    # the rate and schedule the run resolved
    ppo = yaml.safe_load((run_dir / "config.yaml").read_text())["ppo"]
    return {"args": args, "lr": ppo["lr"], "lr_schedule": ppo["lr_schedule"],
            "wall_seconds": job.wall_seconds, "eval_final": summary["eval_final"],
            "evals": [(r["iteration"], r["eval"]["optimality"]) for r in read_records(run_dir)
                      if "eval" in r]}


def table(results: dict) -> list[str]:
    rows = [("| estimator | ppo.lr, ppo.lr_schedule (its defaults) | mode | graph (task.seed) | "
             "final optimality per seed | mean | >= 0.95 |"), "|---|---|---|---|---|---|---|"]
    cells: dict[tuple, list] = {}
    for key, r in results.items():
        if key.count("/") == 4:
            estimator, graph, mode, seed, _ = key.split("/")
            cells.setdefault((estimator, mode, graph), []).append((int(seed), r))
    for (estimator, mode, graph), runs in sorted(cells.items()):
        finals = [r["eval_final"]["optimality"] for _, r in sorted(runs, key=lambda x: x[0])]
        mean = sum(finals) / len(finals)
        rows.append(f"| {estimator} | {runs[0][1]['lr']}, {runs[0][1].get('lr_schedule', 'constant')} | "
                    f"{mode} | {graph} | {', '.join(f'{f:.3f}' for f in finals)} | {mean:.3f} | "
                    f"{'yes' if mean >= 0.95 else 'no'} |")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--estimators", nargs="+", default=["grpo", "rloo"],
                        choices=("grpo", "rloo", "reinforce_pp_baseline"))
    parser.add_argument("--graphs", nargs="+", type=int, default=[1001, 1002, 1003],
                        help="task.seed of each graph")
    parser.add_argument("--mode", nargs="+", choices=("sync", "async"), default=["sync", "async"])
    parser.add_argument("--seeds", nargs="+", type=int, default=[1, 2, 3], help="run.seed of each run")
    parser.add_argument("--cache-dir", default=str(Path("~/.cache/tether").expanduser()))
    parser.add_argument("--name",
                        help="results/advantage_lr-NAME instead of advantage_lr (a sweep's own table)")
    parser.add_argument("extra", nargs="*", help="extra learner.main arguments (after --)")
    args = parser.parse_args()
    name = f"{NAME}-{args.name}" if args.name else NAME
    earlier = RESULTS / f"{name}.json"
    results = ({k: v for k, v in json.loads(earlier.read_text()).items() if "/" in k} if earlier.is_file()
               else {})
    results |= stamp()
    with tempfile.TemporaryDirectory() as out:
        for seed in args.seeds:  # a seed over every cell first: a partial run covers the whole table
            for graph in args.graphs:
                for estimator in args.estimators:
                    for mode in args.mode:
                        results[f"{estimator}/{graph}/{mode}/{seed}/run"] = run(
                            estimator, graph, mode, seed, args.cache_dir, out, args.extra)
                        write_results(RESULTS, name, results, table(results))
    print("\n".join(table(results)))


if __name__ == "__main__":
    main()
