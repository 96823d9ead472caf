"""Benchmark: randomwalks episodes/s with 1 vs 2 rollout engines and 1 vs 2 learner ranks.

    .venv/bin/python benchmarks/scaling.py [--quick] [--iterations 8] [--out DIR] [-- extra learner.main args]

Runs ``python -m learner.main`` once per layout (engines x ranks: 1x1, 2x1, 1x2), each with its own
``--run.name`` under a temporary ``--run.output_dir`` and the shared SFT cache (``--cache-dir``), each
starting its own local Ray. From each run's metrics.jsonl: steady-state episodes/s = median over the
iterations after the first (warm-up) of episodes / (learner_seconds + sync_and_probe_seconds), i.e. the
iteration without its periodic evaluation (``iteration_seconds`` includes it). Scaling efficiency =
(episodes/s with 2) / (episodes/s with 1) / 2; 1.0 is linear scaling.

On a machine with few cores this measures contention, not scaling: every engine and rank is a
process that wants a core, and the table says so. ``--quick``: 2 iterations each, only 1 vs 2 engines,
and a smaller batch (32 episodes, 1 PPO epoch). Writes ``<out>/scaling.json`` and ``scaling.md``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench import RESULTS, MeasuredJob, read_records, stamp, write_results

QUICK_ARGS = ["--rollout.batch_size", "32", "--rollout.chunk_size", "16", "--ppo.minibatch_size", "16",
              "--ppo.epochs", "1", "--rollout.eval_samples_per_prompt", "1"]


def run_layout(engines: int, ranks: int, iterations: int, cache_dir: str, out_dir: Path, extra: list[str],
               log_dir: Path, timeout_s: float) -> dict:
    name = f"scale-e{engines}-r{ranks}"
    cmd = ["--model.cache_dir", cache_dir, "--run.output_dir", str(out_dir),
           "--run.name", name, "--run.iterations", str(iterations), "--rollout.num_engines", str(engines),
           "--learner.world_size", str(ranks), *extra]
    log_path = log_dir / f"scaling-{name}.log"
    wall = MeasuredJob(cmd, log_path).run(timeout_s).wall_seconds
    records = read_records(out_dir / name)
    steady = records[1:] or records  # the first iteration warms up
    rates = [r["episodes"] / (r["learner_seconds"] + r["sync_and_probe_seconds"]) for r in steady]
    parts = ("generate_seconds", "reference_seconds", "learner_forward_seconds", "learner_update_seconds",
             "sync_and_probe_seconds", "learner_seconds", "iteration_seconds")
    return {
        "name": name, "engines": engines, "ranks": ranks, "iterations": len(records), "wall_seconds": wall,
        "steady_iterations": [r["iteration"] for r in steady],
        "episodes_per_iteration": steady[0]["episodes"],
        "episodes_per_second": statistics.median(rates),
        "episodes_per_second_all": rates,
        "median_seconds": {k: statistics.median(r[k] for r in steady) for k in parts if k in steady[0]},
        "log": str(log_path),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smoke mode: 2 iterations, 1 vs 2 engines only")
    parser.add_argument("--iterations", type=int, default=None, help="iterations per run (default 8)")
    parser.add_argument("--cache-dir", default=str(Path("~/.cache/tether").expanduser()))
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per run")
    parser.add_argument("--out", default=str(RESULTS), help="results folder (default benchmarks/results)")
    parser.add_argument("extra", nargs="*", help="extra learner.main arguments (after --)")
    args = parser.parse_args()
    iterations = args.iterations or (2 if args.quick else 8)
    layouts = [(1, 1), (2, 1)] if args.quick else [(1, 1), (2, 1), (1, 2)]
    extra = (QUICK_ARGS if args.quick else []) + args.extra
    out = Path(args.out)
    cores = os.cpu_count() or 1
    results = {**stamp(), "cores": cores, "quick": args.quick, "iterations": iterations, "extra_args": extra,
               "loadavg_before": os.getloadavg()}
    runs = []
    with tempfile.TemporaryDirectory(prefix="bench-scaling-") as tmp:
        for engines, ranks in layouts:
            print(f"[scaling] {engines} engine(s), {ranks} rank(s), {iterations} iterations", flush=True)
            r = run_layout(engines, ranks, iterations, args.cache_dir, Path(tmp), extra, out / "logs",
                           args.timeout)
            runs.append(r)
            print(f"[scaling]   {r['episodes_per_second']:.1f} episodes/s steady "
                  f"(iterations {r['steady_iterations']}, wall {r['wall_seconds']:.0f}s)", flush=True)
    results["runs"] = runs
    results["loadavg_after"] = os.getloadavg()
    base = runs[0]["episodes_per_second"]
    for r in runs[1:]:
        r["throughput_ratio"] = r["episodes_per_second"] / base
        r["efficiency"] = r["throughput_ratio"] / 2

    note = (f"This machine has {cores} cores. "
            + (f"With {cores} cores, 2 engines or 2 learner ranks compete with each other and with the "
               "reference, reward and driver processes for the same cores: these figures show contention, "
               "not scaling."
               if cores <= 4
               else "Every process still shares the machine's cores; read the ratios with that in mind.")
            + f" Load average (1 min) before {results['loadavg_before'][0]:.1f}, after "
            f"{results['loadavg_after'][0]:.1f}.")
    rows = [f"randomwalks, {iterations} iterations per run, {runs[0]['episodes_per_iteration']:.0f} episodes "
            "per iteration; steady episodes/s = median over iterations after the first of episodes / "
            "(iteration time without evaluation)."
            + (" QUICK SMOKE RUN: 2 iterations, small batch; not representative." if args.quick else ""),
            "", f"**{note}**", "",
            ("| machine cores | engines | learner ranks | episodes/s | ratio vs 1x1 | "
             "efficiency (ratio / 2) | generate (s) | learner update (s) | iteration w/o eval (s) |"),
            "|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        m = r["median_seconds"]
        ratio = f"{r['throughput_ratio']:.2f}" if "throughput_ratio" in r else "1 (base)"
        eff = f"{r['efficiency']:.2f}" if "efficiency" in r else "-"
        rows.append(f"| {cores} (shared) | {r['engines']} | {r['ranks']} | {r['episodes_per_second']:.1f} | "
                    f"{ratio} | {eff} | {m.get('generate_seconds', float('nan')):.2f} | "
                    f"{m.get('learner_update_seconds', float('nan')):.2f} "
                    f"| {m['learner_seconds'] + m['sync_and_probe_seconds']:.2f} |")
    rows += ["", ("generate (s) is the rollout engines' busy time summed over engines (evaluation included), "
                  "so it does not shrink with more engines; the iteration time is what a second engine or "
                  "rank should shorten.")]
    json_path, md_path = write_results(out, "scaling", results, rows)
    print("\n".join(rows))
    print(f"[scaling] wrote {json_path} and {md_path}")


if __name__ == "__main__":
    main()
