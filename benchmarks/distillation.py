"""Benchmark: on-policy distillation against RL from the same start, on randomwalks.

The teacher is a policy an earlier run trained: the default job (GAE, sync, 30 iterations) from the cached SFT
start, exported. The students start from the same SFT model and learn from the teacher's per-token reverse KL
alone (``--no-distill.task_reward``), with each credit (``distill.credit`` token and reward_to_go); RL is the
default job itself. Every run is evaluated every iteration. Reports, per variant and seed, the first iteration
whose sampled optimality came within 0.01 of the teacher's final one, and reached 0.95, the final optimality
and the reverse KL to the teacher at the end.

    .venv/bin/python benchmarks/distillation.py [--seeds 1 2 3] [--distill-iterations 15]

Writes benchmarks/results/distillation.json and distillation.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench import RESULTS, MeasuredJob, read_records, stamp, write_results

VARIANTS = {
    "rl (gae)": [],
    "distill, credit token": ["--no-distill.task_reward", "--distill.credit", "token"],
    "distill, credit reward_to_go": ["--no-distill.task_reward", "--distill.credit", "reward_to_go"],
    "distill, credit reward_to_go, async": ["--no-distill.task_reward", "--distill.credit", "reward_to_go",
                                            "--rollout.mode", "async"],
}


# "reached the teacher": within one evaluation's noise of its final optimality (20 prompts x 50 samples: the
# teacher's own evaluations after it converged moved by about 0.01)
TEACHER_TOLERANCE = 0.01


def first_reaching(evals: list[tuple[int, float]], level: float) -> int | None:
    return next((i for i, optimality in evals if optimality >= level), None)


def run(name: str, args: list[str], cache_dir: str, out: str) -> dict:
    job = MeasuredJob(["--model.cache_dir", cache_dir, "--run.output_dir", out, "--run.name", name,
                       "--run.eval_every", "1", *args]).run()
    records = read_records(Path(out) / name)
    summary = json.loads((Path(out) / name / "summary.json").read_text())
    return {"args": args, "wall_seconds": job.wall_seconds, "iterations": len(records),
            "evals": [(r["iteration"], r["eval"]["optimality"]) for r in records if "eval" in r],
            "eval_start": summary["eval_start"]["optimality"],
            "eval_final": summary["eval_final"]["optimality"],
            "teacher_kl": [r.get("teacher_kl_response_mean") for r in records],
            "kl_response_mean_final": summary["kl_response_mean_final"]}


def table(results: dict, seeds: list[int]) -> list[str]:
    teacher = results["teacher_optimality"]
    rows = [f"Teacher: the default job's export (seed {seeds[0]}), final optimality {teacher:.3f}.", "",
            (f"| variant | iterations | reached the teacher's optimality - {TEACHER_TOLERANCE} at, "
             "per seed | mean | reached 0.95 at, per seed | "
             "mean | final optimality (mean) | reverse KL to the teacher at the end (nats, mean) |"),
            "|---|---|---|---|---|---|---|---|"]

    def cells(values: list[int | None], runs: list[dict]) -> str:
        """Per seed, then the mean (a seed that never reached counts as its run's length + 1, marked >)."""
        counted = [v if v is not None else r["iterations"] + 1 for v, r in zip(values, runs, strict=True)]
        shown = ", ".join(str(v) if v is not None else "not reached" for v in values)
        return f"{shown} | {'>' if None in values else ''}{statistics.mean(counted):.1f}"

    for variant in VARIANTS:
        runs = [results[f"{variant}/{seed}"] for seed in seeds if f"{variant}/{seed}" in results]
        if not runs:
            continue
        kls = [r["teacher_kl"][-1] for r in runs if r["teacher_kl"][-1] is not None]
        rows.append(f"| {variant} | {runs[0]['iterations']} | "
                    f"{cells([first_reaching(r['evals'], teacher - TEACHER_TOLERANCE) for r in runs], runs)} "
                    f"| {cells([first_reaching(r['evals'], 0.95) for r in runs], runs)} "
                    f"| {statistics.mean(r['eval_final'] for r in runs):.3f} | "
                    + (f"{statistics.mean(kls):.2f}" if kls else "—") + " |")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cache-dir", default=str(Path("~/.cache/tether").expanduser()))
    parser.add_argument("--seeds", nargs="+", type=int, default=[1, 2, 3])
    parser.add_argument("--distill-iterations", type=int, default=15, help="run.iterations of the students")
    parser.add_argument("--only", nargs="+", choices=list(VARIANTS)[1:], default=list(VARIANTS)[1:],
                        help="these students only; the rows of the others stay (results/distillation.json)")
    args = parser.parse_args()
    earlier = RESULTS / "distillation.json"
    results = json.loads(earlier.read_text()) if earlier.is_file() else {}
    results |= stamp()
    with tempfile.TemporaryDirectory() as out:
        # RL: the default job; the first seed's export is the teacher (always run again)
        for seed in args.seeds:
            if seed == args.seeds[0] or f"rl (gae)/{seed}" not in results:
                results[f"rl (gae)/{seed}"] = run(f"rl-{seed}", ["--run.seed", str(seed)], args.cache_dir,
                                                  out)
        teacher = Path(out) / f"rl-{args.seeds[0]}" / "export"
        results["teacher_optimality"] = results[f"rl (gae)/{args.seeds[0]}"]["eval_final"]
        for variant, extra in VARIANTS.items():
            if variant not in args.only:
                continue
            for seed in args.seeds:
                name = f"{variant.replace(', ', '-').replace(' ', '-')}-{seed}"
                results[f"{variant}/{seed}"] = run(
                    name, ["--run.seed", str(seed), "--run.iterations", str(args.distill_iterations),
                           "--distill.teacher_path", str(teacher), *extra], args.cache_dir, out)
                write_results(RESULTS, "distillation", results, table(results, args.seeds))
    print("\n".join(table(results, args.seeds)))


if __name__ == "__main__":
    main()
