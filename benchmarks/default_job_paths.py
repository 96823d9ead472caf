"""Benchmark: where the default job ends on each path a user starts it from, over run seeds. Each run is the
default job (30 iterations) with an evaluation every 5 iterations:

- ``local``: ``python -m learner.main`` on the local Ray it starts itself;
- ``submit``: ``deploy/local-cluster.sh up``, then ``ray job submit --working-dir . -- python -m
  learner.main`` (the job joins the head: Ray's one thread per actor).

Reports per run the final and the best evaluation, the iteration of the best, and the response KL and beta at
the end; per path the range of the finals and how many reached 0.95.

    .venv/bin/python benchmarks/default_job_paths.py [--paths local submit] [--seeds 1 2 3 4 5]

Writes ``benchmarks/results/default_job_paths.json`` and ``default_job_paths.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench import RAY_ENV, RESULTS, ROOT, cpu_model, stamp, write_results
from trl_compare import cpu_flags

TARGET = 0.95
RAY_CLI = str(Path(sys.executable).parent / "ray")


def job_args(seed: int, out: Path, name: str) -> list[str]:
    return ["-m", "learner.main", "--run.seed", str(seed), "--run.eval_every", "5", "--run.output_dir",
            str(out), "--run.name", name]


def summary(run_dir: Path, seconds: float) -> dict:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = {r["iteration"]: r["eval"]["optimality"] for r in records if "eval" in r}
    best = max(evals, key=evals.get)
    last = records[-1]
    return {"final": evals[last["iteration"]], "best": evals[best], "best_iteration": best, "evals": evals,
            "kl_response_mean": last["kl_response_mean"], "kl_coef": last["kl_coef"], "seconds": seconds}


def run_local(seed: int, work: Path) -> dict:
    name, start = f"local-{seed}", time.perf_counter()
    with open(work / f"{name}.log", "w") as log:
        subprocess.run([sys.executable, *job_args(seed, work, name)], cwd=ROOT, stdout=log,
                       stderr=subprocess.STDOUT, check=True, env={**os.environ, **RAY_ENV})
    return summary(work / name, time.perf_counter() - start)


class LocalCluster:
    """``deploy/local-cluster.sh`` up on a state dir of its own, and down again."""

    def __init__(self, work: Path) -> None:
        self.env = {**os.environ, **RAY_ENV, "TETHER_CLUSTER_DIR": str(work / "cluster"),
                    "TETHER_UP_TIMEOUT": "180"}
        out = self.script("up").stdout
        self.dashboard = dict(line.split("=", 1) for line in out.splitlines() if "=" in line)["DASHBOARD"]

    def script(self, command: str) -> subprocess.CompletedProcess:
        return subprocess.run([str(ROOT / "deploy" / "local-cluster.sh"), command], cwd=ROOT, env=self.env,
                              capture_output=True, text=True, check=True, timeout=300)

    def submit(self, seed: int, work: Path) -> dict:
        name, start = f"submit-{seed}", time.perf_counter()
        with open(work / f"{name}.log", "w") as log:
            subprocess.run([RAY_CLI, "job", "submit", "--address", self.dashboard, "--working-dir", ".", "--",
                            "python", *job_args(seed, work, name)], cwd=ROOT, stdout=log,
                           stderr=subprocess.STDOUT, check=True, env=self.env)
        return summary(work / name, time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--paths", nargs="+", default=["local", "submit"], choices=["local", "submit"])
    parser.add_argument("--seeds", nargs="+", type=int, default=[1, 2, 3, 4, 5])
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="default-job-paths-"))
    runs: dict[str, dict[int, dict]] = {}
    for path in args.paths:
        cluster = LocalCluster(work) if path == "submit" else None
        try:
            for seed in args.seeds:
                result = cluster.submit(seed, work) if cluster else run_local(seed, work)
                runs.setdefault(path, {})[seed] = result
                print(f"[default_job_paths] {path} seed {seed}: {result}", flush=True)
        finally:
            if cluster:
                cluster.script("down")
    results = {**stamp(), "cpu_flags": cpu_flags(), "runs": runs}
    table = [
        (f"The default job (30 iterations, an evaluation every 5), per path and run seed; "
         f"{results['date']}, {results['machine']}, CPU flags: {results['cpu_flags']}; "
         f"`.venv/bin/python benchmarks/default_job_paths.py --paths {' '.join(args.paths)} --seeds "
         f"{' '.join(map(str, args.seeds))}`"),
        "",
        "| path | seed | final | best (iteration) | evaluations 5, 10, ... 30 | KL at the end | beta | s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for path, by_seed in runs.items():
        for seed, r in by_seed.items():
            evals = ", ".join(f"{v:.3f}" for _, v in sorted(r["evals"].items()))
            table.append(f"| {path} | {seed} | {r['final']:.3f} | {r['best']:.3f} ({r['best_iteration']}) | "
                         f"{evals} | {r['kl_response_mean']:.2f} | {r['kl_coef']:.4f} | {r['seconds']:.0f} |")
    table.append("")
    for path, by_seed in runs.items():
        finals = [r["final"] for r in by_seed.values()]
        table.append(f"- {path}: finals {min(finals):.3f} .. {max(finals):.3f}, "
                     f"{sum(f >= TARGET for f in finals)} of {len(finals)} at >= {TARGET}")
    json_path, md_path = write_results(args.out, "default_job_paths", results, table)
    print("\n".join(table), flush=True)
    print(f"[default_job_paths] {json_path} {md_path} (CPU {cpu_model()})", flush=True)


if __name__ == "__main__":
    main()
