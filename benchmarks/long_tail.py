"""Benchmark: sync, async and in-flight updates (``rollout.in_flight_updates`` keep_kv and partial) on a task
whose answers need from 2 to 64 tokens, most of them short (``benchmarks/long_tail_task.py``: twelve prompts,
six of them asking for at most 4 tokens, one for 64; the cap is 64), over seeds. A GPT-2 of 2 layers from
random init, so the sampled lengths start spread over the whole range; GRPO, 8 samples a prompt, 128 episodes
an iteration.

Reports per mode (mean over seeds): episodes and sampled tokens per second in the steady iterations, the first
evaluation whose sampled score reached ``--target`` (every ``--eval-every`` iterations) and the training
seconds to it (the iterations' own, start-up apart: it is the same in every mode), the final score, and for
in-flight updates the share of trained rows whose tokens span two versions and the mean versions a trained
token lagged.

    .venv/bin/python benchmarks/long_tail.py [--seeds 1 2 3] [--iterations 40]
        [--modes sync async keep_kv partial] [--results-name long_tail] [-- extra learner.main args]

Writes benchmarks/results/<results-name>.json and .md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench import RESULTS, MeasuredJob, read_records, stamp, steady_state, write_results
from _bench import ROLLOUT_MODES as MODES

# 64 answer tokens after a 1-token prompt
MODEL = {"n_layer": 2, "n_embd": 64, "n_head": 2, "n_positions": 96}
# a random-init model: GRPO's default 5e-5 moves the score 0.25 -> 0.53 in 40 iterations, this 0.25 -> 0.85
LR = "5e-4"


def prepare(root: Path) -> tuple[Path, Path]:
    """The task's rows (prompt, length) and the random-init policy, with a tokenizer of the prompts'
    letters."""
    from long_tail_task import TARGETS

    from services.models import build_char_tokenizer, build_gpt2, save_model_dir

    rows = root / "rows.jsonl"
    rows.write_text("".join(json.dumps({"prompt": letter, "length": n}) + "\n"
                            for letter, n in TARGETS.items()))
    tokenizer = build_char_tokenizer(list(TARGETS))
    policy = save_model_dir(build_gpt2(tokenizer, MODEL, 0), tokenizer, root / "policy")
    return rows, policy


def run(mode: str, seed: int, args, rows: Path, policy: Path, out: str) -> dict:
    from long_tail_task import MAX_NEW_TOKENS

    name = f"{mode}-{seed}"
    MeasuredJob(["--task.name", "dataset", "--task.path", str(rows), "--task.reward_function",
                 "benchmarks.long_tail_task:length_score", "--task.reward_fields", '["length"]',
                 "--model.path", str(policy), "--rollout.max_new_tokens", str(MAX_NEW_TOKENS),
                 "--ppo.advantage", "grpo", "--rollout.samples_per_prompt", "8", "--ppo.lr", LR,
                 "--run.iterations", str(args.iterations), "--run.eval_every", str(args.eval_every),
                 "--run.seed", str(seed), "--run.output_dir", out, "--run.name", name,
                 "--no-checkpoint.export_hf", *MODES[mode], *args.extra]).run()
    records = read_records(Path(out) / name)
    reached = next((r for r in records if "eval" in r and r["eval"]["score"] >= args.target), None)
    result = {"final_score": [r for r in records if "eval" in r][-1]["eval"]["score"],
              "iterations_to_target": reached["iteration"] if reached else None,
              "seconds_to_target": (sum(r["iteration_seconds"] for r in records[:reached["iteration"]])
                                    if reached else None),
              **steady_state(records, warmup=2)}
    if "in_flight_mixed_row_fraction" in records[0]:
        result["mixed_row_fraction"] = statistics.mean(r["in_flight_mixed_row_fraction"] for r in records)
        result["token_staleness_mean"] = statistics.mean(r["in_flight_token_staleness_mean"] for r in records)
    return result


def mean_of(runs: list[dict], key: str) -> float | None:
    values = [r[key] for r in runs if r.get(key) is not None]
    return statistics.mean(values) if values else None


def table(results: dict, seeds: list[int], target: float) -> list[str]:
    def show(value, fmt):
        return "-" if value is None else format(value, fmt)

    lines = [(f"GRPO, 128 episodes an iteration, {len(seeds)} seeds ({' '.join(map(str, seeds))}); target: "
              f"sampled score >= {target} at an evaluation; a run that never reached it counts apart "
              f"(reached n/{len(seeds)})"),
             "",
             ("| mode | episodes/s | tokens/s | iteration s | reached | iterations to target "
              "| training s to target | final score | mixed-version rows | token staleness |"),
             "|---|---|---|---|---|---|---|---|---|---|"]
    for mode, runs in results["modes"].items():
        reached = [r for r in runs if r["iterations_to_target"] is not None]
        lines.append(
            f"| {mode} | {mean_of(runs, 'episodes_per_second'):.1f} | "
            f"{mean_of(runs, 'tokens_per_second'):.0f} | "
            f"{mean_of(runs, 'steady_iteration_seconds'):.2f} | {len(reached)}/{len(runs)} | "
            f"{show(mean_of(reached, 'iterations_to_target'), '.1f')} | "
            f"{show(mean_of(reached, 'seconds_to_target'), '.1f')} | {mean_of(runs, 'final_score'):.3f} | "
            f"{show(mean_of(runs, 'mixed_row_fraction'), '.3f')} | "
            f"{show(mean_of(runs, 'token_staleness_mean'), '.2f')} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--iterations", type=int, default=40)
    parser.add_argument("--eval-every", type=int, default=2)
    parser.add_argument("--target", type=float, default=0.8)
    parser.add_argument("--results-name", default="long_tail")
    parser.add_argument("extra", nargs="*", help="extra learner.main arguments (after --)")
    args = parser.parse_args()
    results = stamp() | {"seeds": args.seeds, "target": args.target, "iterations": args.iterations,
                         "args": args.extra, "modes": {}}
    with tempfile.TemporaryDirectory() as root:
        rows, policy = prepare(Path(root))
        for mode in args.modes:
            results["modes"][mode] = [run(mode, seed, args, rows, policy, root) for seed in args.seeds]
            print("\n".join(table(results, args.seeds, args.target)), flush=True)
    command = f"`.venv/bin/python benchmarks/long_tail.py {' '.join(sys.argv[1:])}`"
    write_results(RESULTS, args.results_name, results,
                  [command, "", *table(results, args.seeds, args.target)])


if __name__ == "__main__":
    main()
