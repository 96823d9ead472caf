"""Benchmark: LoRA against full fine-tuning on a real preset (default smollm2-sentiment), the same job
otherwise: whether it learns (evaluation, training score and KL by iteration), bytes and seconds per weight
sync, peak memory of each role's processes, and trained response tokens per second.

    .venv/bin/python benchmarks/lora.py [--preset smollm2-sentiment] [--iterations 8] [--rank 16]
        [--lora-lr 5e-4] [-- extra learner.main args, for both runs]

- full: the preset as it is (every weight trains, the reference actor holds a second copy, the full state dict
  travels to the engines at each sync).
- LoRA: ``--learner.lora.rank R --learner.lora.alpha 2R`` on every linear layer at ``--lora-lr`` (adapters
  take a higher learning rate than full weights: PEFT's and TRL's LoRA examples use 10x), the base model as
  the reference (no reference actor; the preset's ``reference.*`` settings go back to their defaults), and
  where vLLM supports LoRA for the model only the adapter travels at each sync.

Each its own local Ray, as ``python -m learner.main`` starts it. Peak RSS is sampled every 0.5 s per role
(every process under the role's actor). Tokens/s: the batch's response tokens over the median steady iteration
(those after the first that ran no evaluation).

Writes ``benchmarks/results/lora-<preset>.json``, ``.md`` and ``.png`` (the curves).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench import RESULTS, ROOT, MeasuredJob, read_records, stamp, steady_state, write_results

ROLES = ("rollout", "reference", "learner", "driver", "ray")


def run(preset: str, iterations: int, lora: list[str], extra: list[str], work: Path, name: str) -> dict:
    args = ["--config", str(ROOT / "deploy" / "configs" / f"{preset}.yaml"),
            "--run.iterations", str(iterations), "--run.output_dir", str(work), "--run.name", name,
            *lora, *extra]
    job = MeasuredJob(args, log_path=work / f"{name}.log").run()
    records = read_records(work / name)
    steady = steady_state(records)
    synced = [r for r in records if r.get("weight_sync_bytes")]
    return {
        "name": name, "args": args, "wall_seconds": job.wall_seconds,
        "eval": ({0: json.loads((work / name / "summary.json").read_text())["eval_start"]}
                 | {r["iteration"]: r["eval"] for r in records if "eval" in r}),
        "score_mean": [r["score_mean"] for r in records],
        "kl_response_mean": [r["kl_response_mean"] for r in records],
        "weight_sync_bytes": statistics.median(r["weight_sync_bytes"] for r in synced) if synced else None,
        "weight_sync_seconds": statistics.median(r["weight_sync_seconds"] for r in records[1:] or records),
        "peak_rss_gib": {role: job.peak_rss.get(role, 0) / 2**30 for role in ROLES},
        "peak_rss_gib_total": job.peak_rss_total / 2**30,
        "steady_iteration_seconds": steady["steady_iteration_seconds"],
        "breakdown_seconds": steady["breakdown_seconds"], "tokens_per_second": steady["tokens_per_second"],
        "response_length_mean": steady["response_length_mean"],
    }


def plot(runs: list[dict], metric: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    for r in runs:
        evals = {int(i): e[metric] for i, e in r["eval"].items() if e}
        axes[0].plot(list(evals), list(evals.values()), marker="o", label=r["name"])
        axes[1].plot(range(1, len(r["score_mean"]) + 1), r["score_mean"], label=r["name"])
        axes[2].plot(range(1, len(r["kl_response_mean"]) + 1), r["kl_response_mean"], label=r["name"])
    for ax, title in zip(axes, (f"eval {metric}", "training score", "response KL (nats)"), strict=True):
        ax.set_title(title)
        ax.set_xlabel("iteration")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="smollm2-sentiment")
    parser.add_argument("--iterations", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--lora-lr", type=float, default=5e-4)
    parser.add_argument("--out", default=str(RESULTS))
    parser.add_argument("--work-dir", default="~/.cache/tether/bench", help="where the run directories stay")
    parser.add_argument("extra", nargs="*", help="extra learner.main arguments (after --), for both runs")
    args = parser.parse_args()
    lora = ["--learner.lora.rank", str(args.rank), "--learner.lora.alpha", str(2 * args.rank), "--ppo.lr",
            str(args.lora_lr), "--reference.torch_threads", "null"]
    root = Path(args.work_dir).expanduser()
    root.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="lora-", dir=root))  # the run directories stay: metrics and logs
    print(f"[lora] run directories under {work}", flush=True)
    runs = [run(args.preset, args.iterations, [], args.extra, work, "full"),
            run(args.preset, args.iterations, lora, args.extra, work, f"lora-r{args.rank}")]
    metric = next(iter(next(e for e in runs[0]["eval"].values() if e)))
    results = {**stamp(), "preset": args.preset, "iterations": args.iterations, "rank": args.rank,
               "runs": runs}
    name = f"lora-{args.preset}"
    table = [
        (f"`{args.preset}` preset, {args.iterations} iterations, each its own local Ray: full fine-tuning as "
         f"the preset has it, against LoRA rank {args.rank} (alpha {2 * args.rank}, every linear layer, lr "
         f"{args.lora_lr}, the base model as the reference); extra arguments: "
         f"{' '.join(args.extra) or 'none'}; {results['date']}, {results['machine']}; "
         "`.venv/bin/python benchmarks/lora.py`"),
        "",
        (f"| run | eval {metric} by iteration | final score | final KL | bytes per sync | seconds per sync | "
        "peak RSS rollout / reference / learner / all | tokens/s | steady iteration |"),
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        evals = ", ".join(f"{i}: {e[metric]:.3f}" for i, e in r["eval"].items() if e)
        rss = r["peak_rss_gib"]
        sync = f"{r['weight_sync_bytes'] / 2**20:.1f} MiB" if r["weight_sync_bytes"] else "n/a"
        table.append(f"| {r['name']} | {evals} | {r['score_mean'][-1]:.3f} | "
                     f"{r['kl_response_mean'][-1]:.2f} | {sync} | {r['weight_sync_seconds']:.2f} | "
                     f"{rss['rollout']:.2f} / {rss['reference']:.2f} / "
                     f"{rss['learner']:.2f} / {r['peak_rss_gib_total']:.2f} GiB | "
                     f"{r['tokens_per_second']:.1f} | {r['steady_iteration_seconds']:.1f} s |")
    write_results(args.out, name, results, table)
    plot(runs, metric, Path(args.out) / f"{name}.png")
    print("\n".join(table), flush=True)


if __name__ == "__main__":
    main()
