"""Benchmark: where the default job ends on each path a user starts it from, over run seeds. Each run is the
default job (30 iterations) with an evaluation every 5 iterations:

- ``local``: ``python -m learner.main`` on the local Ray it starts itself;
- ``submit``: ``deploy/local-cluster.sh up``, then ``ray job submit --working-dir . -- python -m
  learner.main`` (the job joins the head: Ray's one thread per actor);
- ``two_nodes``: the test suite's two-node cluster on this machine (``tests/test_two_nodes.py``: a head on
  127.0.0.2, a worker on 127.0.0.3 in its own mount namespace, blind to the driver's model cache), every role
  pinned to the worker by its resource.

Reports per run the final and the best evaluation, the iteration of the best, and the response KL and beta at
the end; per path the range of the finals and how many reached 0.95.

    .venv/bin/python benchmarks/default_job_paths.py [--paths local submit] [--seeds 1 2 3 4 5]

Writes ``benchmarks/results/default_job_paths.json`` and ``default_job_paths.md`` (``--name``: another name).
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


class TwoNodes:
    """The suite's ``TwoNodeCluster``, the driver's model cache (the SFT starts, copied) hidden from the
    worker, and a run directory both nodes see."""

    def __init__(self, work: Path) -> None:
        import shutil

        from tests.test_two_nodes import TwoNodeCluster

        (work / "driver-only").mkdir()
        shutil.copytree(Path("~/.cache/tether/sft").expanduser(), work / "driver-only" / "cache" / "sft")
        self.work, self.cluster = work, TwoNodeCluster(work / "driver-only")

    def run(self, seed: int) -> dict:
        from tests.test_two_nodes import CLUSTER_ENV

        name, start = f"two_nodes-{seed}", time.perf_counter()
        pinned = [arg for role in ("rollout", "reference", "reward", "learner")
                  for arg in (f"--cluster.{role}.num_cpus", "0.25", f"--cluster.{role}.resources",
                              '{"worker": 0.1}')]
        cache = self.work / "driver-only" / "cache"
        with open(self.work / f"{name}.log", "w") as log:
            subprocess.run([sys.executable, *job_args(seed, self.work, name), "--cluster.address",
                            self.cluster.address, "--model.cache_dir", str(cache), *pinned], cwd=ROOT,
                           stdout=log, stderr=subprocess.STDOUT, check=True,
                           env={**os.environ, **CLUSTER_ENV})
        return summary(self.work / name, time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--paths", nargs="+", default=["local", "submit", "two_nodes"],
                        choices=["local", "submit", "two_nodes"])
    parser.add_argument("--seeds", nargs="+", type=int, default=[1, 2, 3, 4, 5])
    parser.add_argument("--out", default=str(RESULTS))
    parser.add_argument("--name", default="default_job_paths", help="the results' file name")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="default-job-paths-"))
    runs: dict[str, dict[int, dict]] = {}
    for path in args.paths:
        cluster = {"submit": LocalCluster, "two_nodes": TwoNodes}.get(path, lambda _: None)(work)
        try:
            for seed in args.seeds:
                result = (cluster.submit(seed, work) if path == "submit" else cluster.run(seed)
                          if path == "two_nodes" else run_local(seed, work))
                runs.setdefault(path, {})[seed] = result
                print(f"[default_job_paths] {path} seed {seed}: {result}", flush=True)
        finally:
            if path == "submit":
                cluster.script("down")
            elif path == "two_nodes":
                cluster.cluster.stop()
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
    json_path, md_path = write_results(args.out, args.name, results, table)
    print("\n".join(table), flush=True)
    print(f"[default_job_paths] {json_path} {md_path} (CPU {cpu_model()})", flush=True)


if __name__ == "__main__":
    main()
