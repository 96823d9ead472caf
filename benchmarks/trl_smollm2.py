"""Benchmark: trained response tokens per second on smollm2-sentiment, tether against TRL's GRPOTrainer on the
same machine, at the same batch (64 completions of at most 32 tokens: 8 prompts x 8), one gradient pass over
each batch for both, beta 0.05 with a reference model for both; and each against the FLOP bound.

    .venv/bin/python benchmarks/trl_smollm2.py [--steps 4] [--dtypes float32 bfloat16] [--lora-rank 16]
        [--fixed-length]

- TRL 1.16 in its own virtualenv (``trl_compare.trl_python``, with peft), its defaults otherwise (gradient
  checkpointing on, as TRL's GRPOConfig sets it), 2 threads, ``benchmarks/_trl_grpo.py``.
- tether: the ``smollm2-sentiment`` preset with the GRPO estimator at the same batch and group size
  (``--rollout.batch_size 64 --rollout.samples_per_prompt 8 --ppo.advantage grpo``), one epoch of one
  minibatch (one optimizer step on the batch, as TRL's), the preset's KL in the reward starting at beta 0.05,
  padded as by default, or packed by ``--pack-tokens N`` (``learner.max_tokens_per_microbatch``).
  Its own local Ray, as ``python -m learner.main`` starts it.
- ``--lora-rank R``: both sides train LoRA adapters of rank R, alpha 2R, on every linear layer, at lr
  ``LORA_LR`` (tether ``learner.lora``, TRL ``peft_config``), and both take the reference from the base model
  with the adapters disabled; ``--lora-sync`` sets tether's ``learner.lora.sync``. Results go to
  ``trl_smollm2-lora{R}-{sync}-sync`` (with ``-tether-only`` or ``-trl-only`` for one side).
- ``--fixed-length``: every response is exactly the cap on both sides (tether ``rollout.ignore_eos``: vLLM
  samples EOS as any other token and goes on; TRL ``min_new_tokens``: EOS is never sampled, since TRL masks
  what follows one) and no missing-EOS penalty on either, so the two sides train the same tokens a step and
  their seconds compare directly. Results go to ``trl_smollm2-fixed-length``.
- Trained response tokens/s: the batch's response tokens over the seconds of a step, both as medians over the
  steps (iterations) after the first; tether's iterations that evaluate are left out. Episodes/s flatters
  whichever side writes shorter responses, so the ratio is per token, at the same dtype.
- The FLOP bound: the best of a few SmolLM2-shaped matmuls at the dtype on 2 threads, timed here before
  the runs and after (the faster kept), against 5 forward passes' worth of FLOPs per episode (2 x parameters
  x tokens each: generation, the reference's forward and a training pass of forward and backward, 3), at the
  prompt and response lengths measured.
- Peak RSS: TRL's one process; tether's every process (driver, Ray, actors) and its learner rank alone.

Writes ``benchmarks/results/trl_smollm2[-lora{R}].json`` and ``.md`` (the docs site shows the .md).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from importlib.metadata import version
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench import ROOT, MeasuredJob, count_params, read_records, stamp, steady_state, write_results
from trl_compare import TRL_VERSION, cpu_flags, parse_args, timed, trl_python

PROMPTS, SAMPLES, NEW_TOKENS, BETA, LR, LORA_LR = 8, 8, 32, 0.05, 5e-5, 5e-4
PEFT_VERSION = version("peft")  # the project's, in TRL's virtualenv too
# tether's default layout, padded: packing (--pack-tokens N, learner.max_tokens_per_microbatch) pays where
# padding is large; here it is ~10% and SDPA on CPU runs a pack as one masked block (benchmarks/packing.py)
PACK_TOKENS = 0


def matmul_gflops(dtype: str, threads: int = 2) -> float:
    """The best GFLOP/s of SmolLM2-shaped matmuls (hidden 576, MLP 1536, vocabulary 49152) at ``dtype``."""
    import torch

    torch.set_num_threads(threads)
    best = 0.0
    for m, k, n in ((2048, 576, 1536), (2048, 1536, 576), (2048, 576, 49152 // 4)):
        a = torch.randn(m, k, dtype=getattr(torch, dtype))
        b = torch.randn(k, n, dtype=getattr(torch, dtype))
        for _ in range(3):
            a @ b
        reps, start = 10, time.perf_counter()
        for _ in range(reps):
            a @ b
        best = max(best, 2 * m * k * n * reps / (time.perf_counter() - start) / 1e9)
    return best


def smollm2_model() -> Path:
    from services.config import JobConfig
    from services.tasks import get_task

    return get_task("smollm2-sentiment").model_dir(JobConfig().model.cache_dir)


def prompt_tokens_mean(model: Path) -> float:
    """Mean chat-formatted prompt length of the task's prompts, in tokens."""
    from services.models import load_tokenizer
    from services.tasks import get_task

    task, tokenizer = get_task("smollm2-sentiment"), load_tokenizer(model)
    lengths = [len(tokenizer(task.format_prompt(t, tokenizer), add_special_tokens=False)["input_ids"])
               for t in task.prompts()]
    return sum(lengths) / len(lengths)


def run_trl(python: Path, model: Path, steps: int, dtype: str, lora_rank: int, work: Path,
            fixed_length: bool = False) -> dict:
    out = work / f"trl-{dtype}"
    lora = ["--lora-rank", str(lora_rank), "--lora-alpha", str(2 * lora_rank)] if lora_rank else []
    eos = ["--ignore-eos"] if fixed_length else ["--missing-eos-penalty", "-1"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "2"}
    seconds = timed([str(python), str(ROOT / "benchmarks" / "_trl_grpo.py"), "--task", "smollm2-sentiment",
                     "--model", str(model), "--steps", str(steps), "--prompts-per-step", str(PROMPTS),
                     "--samples-per-prompt", str(SAMPLES), "--beta", str(BETA),
                     "--lr", str(LORA_LR if lora_rank else LR), "--max-completion-length", str(NEW_TOKENS),
                     *eos, "--dtype", dtype, "--out", str(out), *lora],
                    work / f"trl-{dtype}.log", env=env)
    timings = json.loads((out / "timings.json").read_text())
    step = statistics.median(timings["step_seconds"][1:])
    length = statistics.mean(timings["completion_length_by_step"][1:])
    return {"side": "TRL GRPO", "dtype": dtype, "lora_rank": lora_rank, "whole_process_seconds": seconds,
            "step_seconds": timings["step_seconds"], "steady_step_seconds": step,
            "episodes_per_second": PROMPTS * SAMPLES / step, "response_length_mean": length,
            "tokens_per_second": PROMPTS * SAMPLES * length / step,
            "peak_rss_gib": timings["peak_rss_bytes"] / 2**30}


def run_tether(steps: int, dtype: str, lora_rank: int, pack_tokens: int, work: Path,
               lora_sync: str = "auto", fixed_length: bool = False, chunks: int = 2,
               engine_threads: int = 1) -> dict:
    # a warm-up, ``steps`` steady iterations, and the last, which runs the final evaluation and is left out
    args = ["--config", str(ROOT / "deploy" / "configs" / "smollm2-sentiment.yaml"),
            "--rollout.batch_size", str(PROMPTS * SAMPLES), "--rollout.samples_per_prompt", str(SAMPLES),
            "--rollout.chunk_size", str(PROMPTS * SAMPLES // chunks),
            "--rollout.max_new_tokens", str(NEW_TOKENS), "--rollout.engine_threads", str(engine_threads),
            "--ppo.advantage", "grpo", "--ppo.epochs", "1", "--ppo.minibatch_size", str(PROMPTS * SAMPLES),
            "--kl.init_kl_coef", str(BETA), "--learner.dtype", dtype, "--run.iterations", str(steps + 2),
            "--run.eval_every", str(100 * steps), "--run.output_dir", str(work),
            "--run.name", f"tether-{dtype}"]
    if pack_tokens:
        args += ["--learner.max_tokens_per_microbatch", str(pack_tokens)]
    if fixed_length:
        args += ["--rollout.ignore_eos", "--reward.missing_eos_penalty", "null"]
    if lora_rank:
        # the base model is the reference: no reference actor, so the preset's reference threads go
        # back to default
        args += ["--learner.lora.rank", str(lora_rank), "--learner.lora.alpha", str(2 * lora_rank),
                 "--ppo.lr", str(LORA_LR), "--reference.torch_threads", "null",
                 "--learner.lora.sync", lora_sync]
    job = MeasuredJob(args, log_path=work / f"tether-{dtype}.log").run()
    records = read_records(work / f"tether-{dtype}")
    steady = steady_state(records)
    synced = [r for r in records[1:] if "eval" not in r] or records[-1:]
    weight_sync = statistics.median(r["weight_sync_seconds"] for r in synced)
    probe = statistics.median(r["sync_and_probe_seconds"] - r["weight_sync_seconds"] for r in synced)
    return {"side": "tether", "dtype": dtype, "lora_rank": lora_rank,
            "whole_process_seconds": job.wall_seconds, "args": args,
            "iteration_seconds": [r["iteration_seconds"] for r in records],
            "steady_step_seconds": steady["steady_iteration_seconds"],
            "breakdown_seconds": steady["breakdown_seconds"],
            "episodes_per_second": steady["episodes_per_second"], "weight_sync_seconds": weight_sync,
            "probe_and_checks_seconds": probe, "probe_share": probe / steady["steady_iteration_seconds"],
            "response_length_mean": steady["response_length_mean"],
            "tokens_per_second": steady["tokens_per_second"],
            "weight_sync_bytes": records[-1].get("weight_sync_bytes"),
            "learner_padding_fraction": statistics.mean(r["learner_padding_fraction"] for r in records),
            "peak_rss_gib": job.peak_rss_total / 2**30,
            "peak_rss_gib_by_role": {k: v / 2**30 for k, v in job.peak_rss.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=4,
                        help="steady steps (iterations) per side, after one warm-up")
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"],
                        choices=["float32", "bfloat16"])
    parser.add_argument("--sides", nargs="+", default=["tether", "trl"], choices=["tether", "trl"])
    parser.add_argument("--lora-rank", type=int, default=0,
                        help="> 0: both sides train LoRA adapters of this rank")
    parser.add_argument("--lora-sync", choices=["auto", "adapter", "merged"], default="auto",
                        help="tether's learner.lora.sync (auto: merged weights on CPU)")
    parser.add_argument("--fixed-length", action="store_true",
                        help="every response exactly the cap on both sides (EOS ignored), no EOS penalty")
    parser.add_argument("--pack-tokens", type=int, default=PACK_TOKENS,
                        help="tether's learner.max_tokens_per_microbatch; 0: the padded layout")
    parser.add_argument("--chunks", type=int, default=2, choices=[1, 2, 4, 8],
                        help="tether streams each batch in this many chunks (rollout.chunk_size)")
    parser.add_argument("--engine-threads", type=int, default=1, help="tether's rollout.engine_threads")
    args, cache = parse_args(parser)
    python = (trl_python(cache, extra=("vadersentiment>=3.3", f"peft=={PEFT_VERSION}")) if "trl" in args.sides
              else None)
    model = smollm2_model()
    params, prompt_len = count_params(model), prompt_tokens_mean(model)
    runs = []
    # the bound is the best the machine gives: timed before the runs and after, the faster kept (a job's
    # processes still exiting slowed the one after to 348 GFLOP/s in bf16, against ~900 quiet)
    quiet = {dtype: matmul_gflops(dtype) for dtype in args.dtypes}
    with tempfile.TemporaryDirectory(prefix="trl-smollm2-", dir=cache) as tmp:
        for dtype in args.dtypes:
            for side in args.sides:
                run = (run_tether(args.steps, dtype, args.lora_rank, args.pack_tokens, Path(tmp),
                                  args.lora_sync, args.fixed_length, args.chunks, args.engine_threads)
                       if side == "tether"
                       else run_trl(python, model, args.steps + 1, dtype, args.lora_rank, Path(tmp),
                                    args.fixed_length))
                print(f"[trl_smollm2] {json.dumps({k: v for k, v in run.items() if k != 'args'})}",
                      flush=True)
                runs.append(run)
    bounds = {dtype: max(quiet[dtype], matmul_gflops(dtype)) for dtype in args.dtypes}
    for run in runs:
        episode_gflop = 5 * 2 * params * (prompt_len + run["response_length_mean"]) / 1e9
        run["episode_gflop"] = episode_gflop
        run["flop_bound_episodes_per_second"] = bounds[run["dtype"]] / episode_gflop
        run["times_the_bound"] = run["flop_bound_episodes_per_second"] / run["episodes_per_second"]
    trl = {r["dtype"]: r for r in runs if r["side"] == "TRL GRPO"}
    results = {**stamp(), "cpu_flags": cpu_flags(), "parameters": params, "prompt_tokens_mean": prompt_len,
               "matmul_gflops": bounds, "lora_rank": args.lora_rank, "pack_tokens": args.pack_tokens,
               "chunks": args.chunks, "engine_threads": args.engine_threads,
               "runs": runs}
    lora = (f"LoRA rank {args.lora_rank} (alpha {2 * args.lora_rank}, every linear layer, lr {LORA_LR}) on "
            f"both sides, reference = the base model, tether's learner.lora.sync {args.lora_sync}; TRL with "
            f"peft {PEFT_VERSION}" if args.lora_rank else
            f"full fine-tuning, lr {LR}")
    lengths = ("every response exactly" if args.fixed_length else "completions of <=")
    packing = (f"tether packed ({args.pack_tokens}-token micro-batches)" if args.pack_tokens
               else "tether padded") + (f", the batch in {args.chunks} chunk(s), vLLM on "
                                        f"{args.engine_threads} core(s)")
    table = [
        (f"smollm2-sentiment, {PROMPTS} prompts x {SAMPLES} completions a step, {lengths} {NEW_TOKENS} "
         "tokens, "
         f"one gradient pass, beta {BETA} with a reference model; {lora}; tether (GRPO estimator, its own "
         f"local Ray, {packing}) against TRL {TRL_VERSION} GRPOTrainer "
         "(its defaults: gradient checkpointing), 2 threads; median step after the first; FLOP bound: "
         f"{', '.join(f'{d} {g:.0f} GFLOP/s' for d, g in bounds.items())} "
         f"(best SmolLM2-shaped matmul, 2 threads) over 5 forward passes of {params / 1e6:.0f}M parameters "
         f"per episode; {results['date']}, {results['machine']}, CPU flags: {results['cpu_flags']}; "
         "`.venv/bin/python benchmarks/trl_smollm2.py"
         f"{f' --lora-rank {args.lora_rank}' if args.lora_rank else ''}"
         f"{' --fixed-length' if args.fixed_length else ''}"
         f"{f' --steps {args.steps}' if args.steps != 4 else ''}"
         f"{f' --pack-tokens {args.pack_tokens}' if args.pack_tokens else ''}"
         f"{f' --chunks {args.chunks}' if args.chunks != 2 else ''}"
         f"{f' --engine-threads {args.engine_threads}' if args.engine_threads != 1 else ''}`"),
        "",
        ("| side | dtype | steady step | response tokens | trained tokens/s | tether / TRL per token | "
         "episodes/s | times the FLOP bound | peak RSS | step: generate / reference / update / sync |"),
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for run in runs:
        base = trl.get(run["dtype"])
        against = f"{run['tokens_per_second'] / base['tokens_per_second']:.2f}x" if base else "n/a"
        parts = run.get("breakdown_seconds")
        split = (f"{parts['generate_seconds']:.1f} / {parts['reference_seconds']:.1f} / "
                 f"{parts['learner_update_seconds']:.1f} / {run['weight_sync_seconds']:.2f} s" if parts
                 else "one process")
        table.append(f"| {run['side']} | {run['dtype']} | {run['steady_step_seconds']:.1f} s | "
                     f"{run['response_length_mean']:.1f} | {run['tokens_per_second']:.1f} | {against} | "
                     f"{run['episodes_per_second']:.2f} | {run['times_the_bound']:.1f}x | "
                     f"{run['peak_rss_gib']:.1f} GiB | {split} |")
    name = f"trl_smollm2-lora{args.lora_rank}-{args.lora_sync}-sync" if args.lora_rank else "trl_smollm2"
    name += "-fixed-length" if args.fixed_length else ""
    name += "" if set(args.sides) == {"tether", "trl"} else f"-{args.sides[0]}-only"
    write_results(args.out, name, results, table)
    print("\n".join(table), flush=True)


if __name__ == "__main__":
    main()
