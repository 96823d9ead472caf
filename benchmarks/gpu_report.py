"""Throughput figures of one finished tether run (used by benchmarks/gpu.sh; works on any run directory).

    .venv/bin/python benchmarks/gpu_report.py --run-dir RUNS/NAME [--rollout-json OUT/rollout-cuda.json]
                                              [--peak-flops 989e12] [--out DIR]

From the run's config.yaml and metrics.jsonl:

- rollout tokens/s in the job: episodes x mean response length / the engines' generate busy seconds, over
  the iterations without an evaluation (an evaluation's generation is counted in generate_seconds); set
  against vLLM alone on the same prompts at the job's chunk size (``--rollout-json``, written by
  ``benchmarks/rollout.py``; it generates a fixed number of tokens, the job stops at EOS);
- learner tokens/s: tokens the PPO epochs train on (epochs x episodes x (mean prompt tokens + mean
  response tokens)) / learner_update_seconds, and the same for the no-grad forward
  (learner_forward_seconds, one pass);
- MFU estimate: 6 x params x trained tokens/s (2 x params for the forward) / peak FLOP/s of one GPU in the
  learner's dtype, the peak from ``--peak-flops``, else ``$TETHER_PEAK_FLOPS``, else ``PEAK_FLOPS`` below for
  this machine's GPU (dense tensor-core bf16; plain fp32, since torch leaves TF32 off). Attention FLOPs,
  padding and the value head are left out: an estimate. With W learner ranks the peak is W GPUs';
- the weight transfer (``learner.weight_sync``) with its median seconds, and the probe's largest error.

Writes ``<out>/gpu_report.json`` and ``gpu_report.md`` (out defaults to the run directory).

    .venv/bin/python benchmarks/gpu_report.py --pytest-junit REPORT.xml --pytest-exit CODE

prints gpu.sh's status of its ``pytest -m gpu`` step (``pytest_step_status``) on the first line, then one line
per skipped or failed test with its reason.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path
from xml.etree import ElementTree

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench import count_params, stamp, write_results

# dense peak FLOP/s of one GPU by (name fragment, dtype), from NVIDIA's data sheets (SXM parts)
PEAK_FLOPS = {
    ("H200", "bfloat16"): 989e12, ("H200", "float32"): 67e12,
    ("H100", "bfloat16"): 989e12, ("H100", "float32"): 67e12,
    ("A100", "bfloat16"): 312e12, ("A100", "float32"): 19.5e12,
    ("L40S", "bfloat16"): 362e12, ("L40S", "float32"): 91.6e12,
}


def peak_flops(gpu_name: str | None, dtype: str) -> tuple[float, str]:
    """(peak FLOP/s, where it came from) for one ``gpu_name`` GPU in ``dtype``; nan when unknown."""
    for (fragment, table_dtype), value in PEAK_FLOPS.items():
        if gpu_name and fragment in gpu_name and table_dtype == dtype:
            return value, f"{fragment} {dtype} dense, data sheet"
    return float("nan"), f"unknown for GPU {gpu_name!r} in {dtype}: pass --peak-flops or TETHER_PEAK_FLOPS"


def pytest_step_status(junit_xml: Path, exit_code: int) -> tuple[str, list[str]]:
    """(status, one line per test that did not pass) of a pytest run from its JUnit XML report and exit code.

    The status is ``ok (...)`` only when a test ran and passed and none failed; ``skipped (...)`` when nothing
    ran (every selected test skipped, or none was selected: pytest exits 0 or 5 then); else ``FAILED (...)``.
    A skip's line carries the reason pytest gave."""
    if exit_code not in (0, 1, 5):  # 2 interrupted, 3 internal error, 4 usage error: the report says little
        return f"FAILED (pytest exit {exit_code}: interrupted, internal or usage error; see its log)", []
    try:
        root = ElementTree.parse(junit_xml).getroot()
    except (OSError, ElementTree.ParseError) as err:
        return f"FAILED (pytest exit {exit_code}, no readable report {junit_xml}: {err})", []
    counts = {"passed": 0, "failed": 0, "error": 0, "skipped": 0}
    lines = []
    for case in root.iter("testcase"):
        name = "::".join(part for part in (case.get("classname", ""), case.get("name", "")) if part)
        outcome = next((child for child in case if child.tag in ("failure", "error", "skipped")), None)
        tag = outcome.tag if outcome is not None else None
        kind = {None: "passed", "failure": "failed", "error": "error", "skipped": "skipped"}[tag]
        counts[kind] += 1
        if outcome is not None:
            reason = (outcome.get("message") or (outcome.text or "").strip()
                      or "no reason given").splitlines()[0]
            lines.append(f"{kind.upper()} {name}: {reason}")
    tally = ", ".join(f"{n} {kind}" for kind, n in counts.items() if n)
    if counts["failed"] or counts["error"] or exit_code == 1:
        return f"FAILED (pytest exit {exit_code}: {tally or 'no test in the report'})", lines
    if not counts["passed"]:
        return f"skipped (nothing ran: {tally or 'no test selected'})", lines
    return f"ok ({tally})", lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run-dir", default=None,
                        help="the run to report on (required unless --pytest-junit)")
    parser.add_argument("--pytest-junit", default=None, help="instead: the status of gpu.sh's pytest step")
    parser.add_argument("--pytest-exit", type=int, default=None,
                        help="with --pytest-junit: pytest's exit code")
    parser.add_argument("--rollout-json", default=None)
    parser.add_argument("--peak-flops", type=float, default=None, help="one GPU, in the learner's dtype")
    parser.add_argument("--gpu-name", default=None, help="default: torch.cuda.get_device_name(0)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.pytest_junit is not None:
        if args.pytest_exit is None:
            parser.error("--pytest-junit needs --pytest-exit (pytest's exit code)")
        status, lines = pytest_step_status(Path(args.pytest_junit), args.pytest_exit)
        print("\n".join([status, *lines]))
        return
    if args.run_dir is None:
        parser.error("--run-dir is required (or --pytest-junit with --pytest-exit)")
    run_dir = Path(args.run_dir)

    import yaml

    from services.config import JobConfig
    from services.models import load_tokenizer, policy_dir
    from services.prompts import encode_prompts
    from services.tasks import get_task

    cfg = JobConfig.model_validate(yaml.safe_load((run_dir / "config.yaml").read_text()))
    gpu_name = args.gpu_name
    if gpu_name is None:
        import torch

        gpu_name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    if args.peak_flops or os.environ.get("TETHER_PEAK_FLOPS"):
        peak, peak_source = args.peak_flops or float(os.environ["TETHER_PEAK_FLOPS"]), "given"
    else:
        peak, peak_source = peak_flops(gpu_name, cfg.learner.dtype)
    peak_all = peak * cfg.learner.world_size  # the learner's ranks, one GPU each
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    if not records:
        sys.exit(f"{run_dir}/metrics.jsonl has no iterations")
    task = get_task(cfg.task.name, seed=cfg.task.seed)
    model_dir = policy_dir(task, cfg.model.path, cfg.model.cache_dir, cfg.run.seed, cfg.model.sft_steps,
                           cfg.model.sft_batch_size, cfg.model.sft_lr, log=lambda m: None)
    params = count_params(model_dir)
    tokenizer = load_tokenizer(model_dir)
    prompts = encode_prompts([task.format_prompt(t, tokenizer) for t in task.prompts()], tokenizer,
                             cfg.task.max_prompt_tokens, cfg.task.long_prompts, log=lambda m: None)
    prompt_mean = sum(map(len, prompts)) / len(prompts)

    no_eval = [r for r in records if "eval" not in r] or records
    rollout_rates = [r["episodes"] * r["response_length_mean"] / r["generate_seconds"] for r in no_eval
                     if r.get("generate_seconds")]
    job_rollout = statistics.median(rollout_rates) if rollout_rates else float("nan")
    epochs = cfg.ppo.epochs
    train_rates, forward_rates = [], []
    for r in records:
        tokens = r["episodes"] * (prompt_mean + r["response_length_mean"])
        train_rates.append(epochs * tokens / r["learner_update_seconds"])
        forward_rates.append(tokens / r["learner_forward_seconds"])
    train_tps, forward_tps = statistics.median(train_rates), statistics.median(forward_rates)
    update_s = statistics.median(r["learner_update_seconds"] for r in records)
    forward_s = statistics.median(r["learner_forward_seconds"] for r in records)
    tokens_iter = statistics.median(r["episodes"] * (prompt_mean + r["response_length_mean"])
                                    for r in records)
    combined_flops = (6 * params * epochs * tokens_iter + 2 * params * tokens_iter) / (update_s + forward_s)

    report = {
        **stamp(), "run_dir": str(run_dir), "task": cfg.task.name, "model_dir": str(model_dir),
        "params": params, "learner_dtype": cfg.learner.dtype, "learner_world_size": cfg.learner.world_size,
        "zero_stage": cfg.learner.zero_stage, "ppo_epochs": epochs, "iterations": len(records),
        "prompt_tokens_mean": prompt_mean,
        "response_tokens_mean": statistics.median(r["response_length_mean"] for r in records),
        "gpu": gpu_name, "peak_flops_per_gpu": peak, "peak_flops_source": peak_source,
        "weight_sync": cfg.learner.weight_sync,
        "probe_max_abs_error": max((r["probe_max_abs_error"] for r in records
                                    if r.get("probe_max_abs_error") is not None), default=float("nan")),
        "rollout_tokens_per_s_job": job_rollout,
        "rollout_tokens_per_s_job_iterations": [r["iteration"] for r in no_eval],
        "learner_train_tokens_per_s": train_tps, "learner_forward_tokens_per_s": forward_tps,
        "mfu_update": 6 * params * train_tps / peak_all, "mfu_forward": 2 * params * forward_tps / peak_all,
        "mfu_learner": combined_flops / peak_all,
        "iteration_seconds_median": statistics.median(r["iteration_seconds"] for r in records),
        "weight_sync_seconds_median": statistics.median(r["weight_sync_seconds"] for r in records),
    }
    alone = None
    if args.rollout_json and Path(args.rollout_json).is_file():
        bench = json.loads(Path(args.rollout_json).read_text())
        gen = bench.get("engines", {}).get("vllm", {}).get("generate", {})
        if gen:
            batch = min(gen, key=lambda b: abs(int(b) - cfg.rollout.chunk_size))
            alone = {"batch": int(batch), "tokens_per_s": gen[batch]["tokens_per_s"],
                     "max_new_tokens": bench.get("max_new_tokens"), "model": bench.get("model")}
            report["rollout_vllm_alone"] = alone
            report["rollout_job_over_alone"] = job_rollout / alone["tokens_per_s"]

    rows = [(f"Run {run_dir} ({cfg.task.name}, {params / 1e6:.1f}M params, learner {cfg.learner.dtype}, "
            f"{cfg.learner.world_size} rank(s), ZeRO-{cfg.learner.zero_stage}, {len(records)} iterations). "
            f"GPU {gpu_name}; peak {peak:.3g} FLOP/s per GPU in {cfg.learner.dtype} ({peak_source})."), "",
            "| figure | value |", "|---|---|",
            (f"| rollout tokens/s in the job (iterations {report['rollout_tokens_per_s_job_iterations']}) | "
            f"{job_rollout:.0f} |")]
    if alone:
        rows += [(f"| vLLM alone, batch {alone['batch']}, {alone['max_new_tokens']} tokens fixed | "
                 f"{alone['tokens_per_s']:.0f} |"),
                 f"| job / alone | {report['rollout_job_over_alone']:.2f} |"]
    rows += [(f"| learner PPO tokens/s ({epochs} epochs; {prompt_mean:.0f} prompt + "
             f"{report['response_tokens_mean']:.0f} response tokens per episode) | {train_tps:.0f} |"),
             f"| learner no-grad forward tokens/s | {forward_tps:.0f} |",
             f"| MFU, PPO update (6 N tokens/s / peak) | {report['mfu_update'] * 100:.3g}% |",
             f"| MFU, forward (2 N tokens/s / peak) | {report['mfu_forward'] * 100:.3g}% |",
             f"| MFU, learner forward + update | {report['mfu_learner'] * 100:.3g}% |",
             f"| median iteration (s) | {report['iteration_seconds_median']:.2f} |",
             (f"| median weight sync, {cfg.learner.weight_sync} (s) | "
              f"{report['weight_sync_seconds_median']:.3f} |"),
             f"| largest probe error after a sync | {report['probe_max_abs_error']:.3g} |",
             "", "MFU leaves out attention FLOPs, padding and the value head."]
    json_path, md_path = write_results(args.out or run_dir, "gpu_report", report, rows)
    print("\n".join(rows))
    print(f"[gpu_report] wrote {json_path} and {md_path}")


if __name__ == "__main__":
    main()
