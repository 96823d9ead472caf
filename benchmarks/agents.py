"""Benchmark: the multi-turn presets end to end, as a user runs them:

    python -m learner.main --config deploy/configs/randomwalks-interactive.yaml   (--preset randomwalks)
    python -m learner.main --config deploy/configs/calculator-smollm2.yaml         (--preset calculator)

each through the local Ray the job starts itself. It reads the run's metrics.jsonl and summary.json and
reports, per iteration, the evaluation's metric (randomwalks: sampled optimality; calculator: accuracy), the
training score, the response KL, the model's turns and tool calls per episode, the environment's seconds and
the iteration's seconds; the final metric (randomwalks: against the 0.9 bar of its requirement); the wall
time, split into the setup (SFT warm start or model conversion, Ray, actors) and the iterations.

    .venv/bin/python benchmarks/agents.py [--preset randomwalks|calculator] [--cache-dir DIR] [-- extra args]

randomwalks trains its SFT warm start in a fresh cache by default (what a first run costs); calculator uses
the default model cache (~/.cache/tether: its SmolLM2 conversion is made once, whatever the job). Writes
benchmarks/results/agents.{json,md,png} (randomwalks) or calculator.{json,md,png} (the learning curve).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench import RESULTS, ROOT, MeasuredJob, read_records, stamp, write_results

PRESETS = {
    # the requirement: sampled optimality >= 0.9 within the preset's iterations, on 2 cores
    "randomwalks": {"config": "deploy/configs/randomwalks-interactive.yaml", "results": "agents",
                    "metric": "optimality", "bar": 0.9, "fresh_cache": True,
                    "title": "Interactive randomwalks"},
    "calculator": {"config": "deploy/configs/calculator-smollm2.yaml", "results": "calculator",
                   "metric": "accuracy", "bar": None, "fresh_cache": False,
                   "title": "Calculator, SmolLM2-135M-Instruct"},
}
SFT_LINE = re.compile(r"\[tether\] sft step (\d+)/(\d+) loss ([0-9.]+) \((\d+)s\)")


def run(preset: dict, cache_dir: str, out_dir: str, extra: list[str]) -> dict:
    metric, bar = preset["metric"], preset["bar"]
    load_before = os.getloadavg()
    job = MeasuredJob(["--config", str(ROOT / preset["config"]), "--model.cache_dir", cache_dir,
                       "--run.output_dir", out_dir, "--run.name", "bench", "--run.overwrite", *extra]).run(
        timeout_s=3 * 3600)
    run_dir = Path(out_dir) / "bench"
    records = read_records(run_dir)
    summary = json.loads((run_dir / "summary.json").read_text())
    sft = [m for m in map(SFT_LINE.match, job.lines) if m]
    iterations = [{
        "iteration": r["iteration"],
        f"eval_{metric}": r.get("eval", {}).get(metric),
        "eval_turns": r.get("eval", {}).get("turns"),
        "score_mean": r["score_mean"],
        "kl_response_mean": r["kl_response_mean"],
        "kl_coef": r["kl_coef"],
        "turns_mean": r["turns_mean"],
        "tool_calls_mean": r["tool_calls_mean"],
        "trajectory_model_tokens_mean": r["trajectory_model_tokens_mean"],
        "trajectory_environment_tokens_mean": r["trajectory_environment_tokens_mean"],
        "truncated_fraction": r["truncated_fraction"],
        "environment_failures": r["environment_failures"],
        "environment_seconds": r["environment_seconds"],
        "generate_seconds": r["generate_seconds"],
        "learner_update_seconds": r["learner_update_seconds"],
        "iteration_seconds": r["iteration_seconds"],
    } for r in records]
    setup = (job.first_iteration_at or 0) - records[0]["iteration_seconds"]
    elapsed, reached = setup, None
    for r in records:
        elapsed += r["iteration_seconds"]
        if bar is not None and reached is None and r.get("eval", {}).get(metric, 0) >= bar:
            reached = {"iteration": r["iteration"], "seconds": elapsed}
    final = summary["eval_final"][metric]
    return {
        "preset": preset["config"],
        "config": (run_dir / "config.yaml").read_text(),
        "metric": metric,
        "sft": {"steps": int(sft[-1].group(2)), "seconds": int(sft[-1].group(4)),
                "final_loss": float(sft[-1].group(3))} if sft else None,  # None: cached, or no warm start
        "wall_seconds": job.wall_seconds,
        "setup_seconds": setup,
        "iterations_seconds": sum(r["iteration_seconds"] for r in records),
        "eval_start": summary["eval_start"],
        "eval_final": summary["eval_final"],
        "final": final,
        "bar": bar,
        "passed": None if bar is None else final >= bar,
        "reached_bar": reached,
        "kl_response_mean_final": summary["kl_response_mean_final"],
        "peak_rss_gib": job.peak_rss_total / 2**30,
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        "iterations": iterations,
    }


def table(results: dict) -> list[str]:
    r = results["run"]
    metric, bar, sft = r["metric"], r["bar"], r["sft"]
    its = r["iterations"]
    tools = any(it["tool_calls_mean"] for it in its)  # a column only for an environment with tools
    head = (f"**Final eval {metric} {r['final']:.3f}**"
            + (f" (bar {bar}: {'passed' if r['passed'] else 'NOT passed'})" if bar is not None else "")
            + f", from {r['eval_start'][metric]:.3f} before training")
    if bar is not None:
        reached = r["reached_bar"]
        head += (f"; first evaluation at or above {bar}: iteration {reached['iteration']} "
                 f"({reached['seconds']:.0f} s after launch)." if reached
                 else f"; no evaluation reached {bar}.")
    else:
        head += (f". Tool calls per episode {its[0]['tool_calls_mean']:.2f} in iteration 1 "
                 f"(the starting policy's episodes), {its[-1]['tool_calls_mean']:.2f} in iteration "
                 f"{its[-1]['iteration']}.")
    lines = [
        f"`python -m learner.main --config {r['preset']}` (local Ray started by the job), one run.",
        "",
        head,
        f"Wall time {r['wall_seconds']:.0f} s: setup {r['setup_seconds']:.0f} s ("
        + (f"SFT warm start {sft['steps']} steps in {sft['seconds']} s, final loss {sft['final_loss']:.3f}; "
           if sft else "no SFT trained; ")
        + f"Ray and actors), {len(its)} iterations {r['iterations_seconds']:.0f} s. "
        f"Peak RSS {r['peak_rss_gib']:.2f} GiB. "
        f"Load average (1 min) {r['load_average_before'][0]:.1f} before, "
        f"{r['load_average_after'][0]:.1f} after (the machine's 2 cores were shared with other work).",
        "",
        f"| iteration | eval {metric} | train score | KL (nats) | turns / episode | "
        + ("tool calls / episode | " if tools else "") + "environment s | iteration s |",
        "|---|---|---|---|---|---|---|" + ("---|" if tools else ""),
        f"| 0 (before training) | {r['eval_start'][metric]:.3f} | | | "
        f"{r['eval_start']['turns']:.2f} (eval) | "
        + ("| " if tools else "") + "| |",
    ]
    for it in its:
        evaluated = "" if it[f"eval_{metric}"] is None else f"{it[f'eval_{metric}']:.3f}"
        lines.append(f"| {it['iteration']} | {evaluated} | {it['score_mean']:.3f} | "
                     f"{it['kl_response_mean']:.2f} | {it['turns_mean']:.2f} | "
                     + (f"{it['tool_calls_mean']:.2f} | " if tools else "")
                     + f"{it['environment_seconds']:.2f} | {it['iteration_seconds']:.1f} |")
    lines += ["", (f"Train score: the mean return of the iteration's episodes ({metric}, sampled as "
                   f"trained); eval {metric}: the evaluation's, on its own rows. Environment seconds: "
                   "resets and steps, summed over the iteration's episodes. Learning curve: "
                   f"{results['name']}.png.")]
    return lines


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    r = results["run"]
    metric, its = r["metric"], r["iterations"]
    x = [it["iteration"] for it in its]
    evals = [(0, r["eval_start"][metric])] + [(it["iteration"], it[f"eval_{metric}"]) for it in its
                                              if it[f"eval_{metric}"] is not None]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6), sharex=True, height_ratios=(2, 1))
    top.plot(x, [it["score_mean"] for it in its], label=f"train score ({metric} of the episodes)",
             color="tab:blue")
    top.plot(*zip(*evals, strict=True), "o-", label=f"eval {metric}", color="tab:green")
    if r["bar"] is not None:
        top.axhline(r["bar"], ls="--", color="grey", lw=1, label=f"bar {r['bar']}")
    top.set_ylim(0, 1.02)
    top.set_ylabel(metric)
    top.legend(loc="best", fontsize=8)
    top.set_title(f"{results['title']} ({r['preset']})", fontsize=10)
    bottom.plot(x, [it["kl_response_mean"] for it in its], label="KL (nats)", color="tab:red")
    bottom.plot(x, [it["turns_mean"] for it in its], label="turns / episode", color="tab:purple")
    if any(it["tool_calls_mean"] for it in its):
        bottom.plot(x, [it["tool_calls_mean"] for it in its], label="tool calls / episode",
                    color="tab:orange")
    bottom.set_xlabel("iteration")
    bottom.legend(loc="best", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="randomwalks")
    parser.add_argument("--cache-dir", default=None, help="model cache (default: randomwalks a fresh one, so "
                        "the SFT warm start is trained and timed; calculator ~/.cache/tether)")
    parser.add_argument("--out", default=str(RESULTS), help="where the json, md and png go")
    parser.add_argument("--redraw", action="store_true", help="rewrite the md and png from the json already "
                        "in --out, running nothing")
    parser.add_argument("extra", nargs="*", help="extra learner.main arguments (after --)")
    args = parser.parse_args()
    preset = PRESETS[args.preset]
    if args.redraw:
        results = json.loads((Path(args.out) / f"{preset['results']}.json").read_text())
        write_results(args.out, preset["results"], results, table(results))
        plot(results, Path(args.out) / f"{preset['results']}.png")
        return
    results = {**stamp(), "name": preset["results"], "title": preset["title"]}
    with tempfile.TemporaryDirectory() as tmp:
        cache = args.cache_dir or (str(Path(tmp) / "cache") if preset["fresh_cache"] else "~/.cache/tether")
        results["run"] = run(preset, cache, str(Path(tmp) / "runs"), args.extra)
    results["extra_args"] = args.extra
    lines = table(results)
    write_results(args.out, preset["results"], results, lines)
    plot(results, Path(args.out) / f"{preset['results']}.png")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
