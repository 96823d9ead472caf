"""Benchmark: packing by token budget (``learner.max_tokens_per_microbatch``) against the padded layout, on
real presets: the fraction of the learner's forward tokens that are padding, and the seconds of the learner's
and the reference's passes, each preset run twice from the same seed, padded and packed.

    .venv/bin/python benchmarks/packing.py [--presets smollm2-sentiment calculator-smollm2] [--iterations 4]
        [--max-tokens 512] [-- extra learner.main args]

- smollm2-sentiment: one-turn chat answers of 3 to 32 tokens after prompts of 20-45.
- calculator-smollm2: multi-turn tool use; a trajectory's turns, tool results and final answer are one
  sequence, of very different lengths from episode to episode.

Each run is the preset with ``--run.iterations N``, its own local Ray, as ``python -m learner.main`` starts
it. The padding fraction is the mean over the iterations of ``learner_padding_fraction`` (of the tokens the
padded [rows, prompt + response] forwards run, the share that is padding; 0 packed). The seconds are medians
over the iterations after the first that ran no evaluation: the learner's update (forwards and backwards of
the PPO epochs), the reference's scoring and the learner's collect forward, each as the iteration waits for
it.

Writes ``benchmarks/results/packing.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench import RESULTS, ROOT, MeasuredJob, read_records, stamp, steady_state, write_results

PARTS = ("learner_update_seconds", "reference_seconds", "learner_forward_seconds")


def run(preset: str, iterations: int, max_tokens: int | None, extra: list[str], work: Path) -> dict:
    name = f"{preset}-{'packed' if max_tokens else 'padded'}"
    args = ["--config", str(ROOT / "deploy" / "configs" / f"{preset}.yaml"),
            "--run.iterations", str(iterations), "--run.eval_every", str(100 * iterations),
            "--run.output_dir", str(work), "--run.name", name, *extra]
    if max_tokens:
        args += ["--learner.max_tokens_per_microbatch", str(max_tokens)]
    job = MeasuredJob(args, log_path=work / f"{name}.log").run()
    records = read_records(work / name)
    steady = steady_state(records)
    return {"preset": preset, "max_tokens_per_microbatch": max_tokens, "args": args,
            "padding_fraction": statistics.mean(r["learner_padding_fraction"] for r in records),
            "padding_fraction_by_iteration": [r["learner_padding_fraction"] for r in records],
            "response_length_mean": statistics.mean(r["response_length_mean"] for r in records),
            "steady_iterations": steady["steady_iterations"],
            "seconds": {k: steady["breakdown_seconds"][k] for k in PARTS},
            "steady_iteration_seconds": steady["steady_iteration_seconds"],
            "peak_rss_gib_learner": job.peak_rss.get("learner", 0) / 2**30, "wall_seconds": job.wall_seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", nargs="+", default=["smollm2-sentiment", "calculator-smollm2"])
    parser.add_argument("--iterations", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=512, help="the packed runs' token budget")
    parser.add_argument("--out", default=str(RESULTS))
    parser.add_argument("extra", nargs="*", help="extra learner.main arguments (after --), for every run")
    args = parser.parse_args()
    runs = []
    with tempfile.TemporaryDirectory(prefix="packing-") as tmp:
        for preset in args.presets:
            for max_tokens in (None, args.max_tokens):
                runs.append(run(preset, args.iterations, max_tokens, args.extra, Path(tmp)))
                print(f"[packing] {runs[-1]['preset']} {max_tokens}: padding "
                      f"{runs[-1]['padding_fraction']:.3f}, {runs[-1]['seconds']}", flush=True)
    results = {**stamp(), "iterations": args.iterations, "runs": runs}
    table = [
        (f"Each preset run twice from the same seed, {args.iterations} iterations, its own local Ray: padded "
         f"[rows, prompt + response] blocks, then packed into micro-batches of <= {args.max_tokens} real "
         "tokens; padding: the share of the forward tokens that are padding (mean over the iterations); "
         f"seconds: median over the steady iterations; extra arguments: {' '.join(args.extra) or 'none'}; "
         f"{results['date']}, {results['machine']}; "
         f"`.venv/bin/python benchmarks/packing.py --iterations {args.iterations} "
         f"--max-tokens {args.max_tokens}{' -- ' + ' '.join(args.extra) if args.extra else ''}`"),
        "",
        ("| preset | layout | padding | learner update | reference | learner forward (waited) | "
         "steady iteration | learner peak RSS |"),
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        s = r["seconds"]
        layout = f"packed ({r['max_tokens_per_microbatch']})" if r["max_tokens_per_microbatch"] else "padded"
        table.append(f"| {r['preset']} | {layout} | {r['padding_fraction']:.1%} | "
                     f"{s['learner_update_seconds']:.1f} s | {s['reference_seconds']:.1f} s | "
                     f"{s['learner_forward_seconds']:.2f} s | "
                     f"{r['steady_iteration_seconds']:.1f} s | {r['peak_rss_gib_learner']:.2f} GiB |")
    write_results(args.out, "packing", results, table)
    print("\n".join(table), flush=True)


if __name__ == "__main__":
    main()
