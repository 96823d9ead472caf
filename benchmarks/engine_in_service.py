"""Benchmark (issue 13, target 3): the rollout engine's generation speed inside a real iteration, against
plain ``vllm.LLM.generate`` alone on the same model, prompts, batch, dtype and thread count.

    .venv/bin/python benchmarks/engine_in_service.py [--iterations 8] [-- extra learner.main args]

In the service: a job (``python -m learner.main``, its own local Ray, evaluation only at the end) logs, per
iteration, the seconds its engine spent in ``generate`` (``generate_seconds``: the rollout actor's busy time,
while the reference, reward and learner work on the chunks before) and the tokens it generated (episodes x
mean response length); tokens/s is their ratio, the median over the iterations after the first (but the
last, which evaluates). The policy is held at the job's start (``--ppo.lr 1e-12`` unless the extra arguments
set one; every other part of an iteration runs as in training): tokens/s depends on the responses' length
(vLLM's cost per call and per step is fixed), and a policy that learns changes it, so both sides must
generate with the same weights. (Against the start while the service trained, the ratio read 0.62-0.86;
the same engine alone on the trained policy generated 26% fewer tokens/s than on the start.) From the same
iterations: the weight sync's seconds, and the probe's (with the
check that every actor holds the new version) as a share of the iteration.

Alone: a fresh process with one OpenMP thread (what Ray gives an actor with less than one CPU) builds the
engine on the job's policy directory with ``actors.engines.VLLMEngine`` (same device, dtype, seed,
``max_model_len``, engine arguments and KV cache or GPU share, processed log-probs), and calls its
``vllm.LLM.generate`` directly, as many times as the job did, on ``rollout.chunk_size`` training prompts each
with tether's ``SamplingParams`` (a seed per request, ``logprobs=0``), the prefix cache reset before each call
as the service must after a sync. Tokens/s is the generated tokens over the summed call times, after one
untimed warm-up call.

Writes ``benchmarks/results/engine_in_service.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench import RAY_ENV, RESULTS, ROOT, stamp, write_results


def in_service(extra: list[str], iterations: int, out: Path) -> tuple[list[float], dict, Path]:
    """Tokens/s of each iteration after the first, the medians of the weight sync and the probe over the same
    iterations (seconds, and the probe's share of an iteration: issue 13's target 5), and the run
    directory."""
    cmd = [sys.executable, "-m", "learner.main", *extra, "--run.iterations", str(iterations),
           "--run.eval_every", str(10 * iterations), "--run.output_dir", str(out), "--run.name", "engine"]
    subprocess.run(cmd, cwd=ROOT, env={**os.environ, **RAY_ENV}, check=True)
    records = [json.loads(line) for line in (out / "engine" / "metrics.jsonl").read_text().splitlines()]
    # an iteration with an evaluation counts its generation time too, not its tokens: left out
    steady = [r for r in records[1:] if "eval" not in r]
    rates = [r["episodes"] * r["response_length_mean"] / r["generate_seconds"] for r in steady]
    # sync_and_probe: the weights' load, every actor's state checked, and the probe (learner and engines)
    probe = [r["sync_and_probe_seconds"] - r["weight_sync_seconds"] for r in steady]
    sync = {"weight_sync_seconds": statistics.median(r["weight_sync_seconds"] for r in steady),
            "probe_and_checks_seconds": statistics.median(probe),
            "iteration_seconds": statistics.median(r["iteration_seconds"] for r in steady),
            "probe_share": statistics.median(p / r["iteration_seconds"]
                                             for p, r in zip(probe, steady, strict=True)),
            "response_length_mean": statistics.mean(r["response_length_mean"] for r in steady)}
    return rates, sync, out / "engine"


def alone_engine_spec(cfg, model_dir: str, max_new_tokens: int):
    """The ``EngineSpec`` of the engine alone: the one the job's plan gives its rollout engine 0
    (``learner.plan.fleet_spec``), device and engine arguments included, so that on CUDA both sides take the
    config's GPU share, not the CPU build's KV cache."""
    from actors.engines import SamplingSettings
    from learner.plan import Models, fleet_spec

    max_model_len = cfg.task.max_prompt_tokens + max_new_tokens + 1
    return fleet_spec(cfg, Models(model_dir), SamplingSettings(), 0, max_model_len).rollouts[0].engine


def alone(run_dir: Path, calls: int) -> dict:
    """Plain vLLM on the job's policy, prompts and settings (runs in its own process: one thread)."""
    import torch
    from vllm import SamplingParams, TokensPrompt

    from actors.engines import VLLMEngine
    from services.config import JobConfig
    from services.models import load_tokenizer, policy_dir
    from services.prompts import encode_prompts
    from services.tasks import get_task

    cfg = JobConfig.model_validate(yaml.safe_load((run_dir / "config.yaml").read_text()))
    task = get_task(cfg.task.name, **cfg.task.options())
    model = policy_dir(task, cfg.model.path, cfg.model.cache_dir, cfg.run.seed, cfg.model.sft_steps,
                       cfg.model.sft_batch_size, cfg.model.sft_lr, log=lambda _: None)
    tokenizer = load_tokenizer(model)
    prompts = encode_prompts([task.format_prompt(t, tokenizer) for t in task.prompts()], tokenizer,
                             cfg.task.max_prompt_tokens, cfg.task.long_prompts, log=lambda _: None)
    max_new = cfg.rollout.max_new_tokens or task.max_new_tokens
    # built as the rollout actor builds it; only the generate call below is plain vLLM
    llm = VLLMEngine(str(model), alone_engine_spec(cfg, str(model), max_new)).llm
    n = cfg.rollout.chunk_size
    seconds, tokens = 0.0, 0
    for call in range(calls + 1):  # call 0: warm-up, untimed
        rows = [prompts[(call * n + i) % len(prompts)] for i in range(n)]
        params = [SamplingParams(temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p,
                                 max_tokens=max_new, logprobs=0, seed=cfg.run.seed + call * n + i)
                  for i in range(n)]
        llm.reset_prefix_cache()
        start = time.perf_counter()
        outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in rows], params, use_tqdm=False)
        if call:
            seconds += time.perf_counter() - start
            tokens += sum(len(o.outputs[0].token_ids) for o in outputs)
    return {"tokens_per_second": tokens / seconds, "response_length_mean": tokens / (calls * n),
            "calls": calls, "batch": n, "threads": torch.get_num_threads(), "dtype": cfg.learner.dtype,
            "model": str(model)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iterations", type=int, default=8)
    # internal: the run directory, in the child process
    parser.add_argument("--alone", help=argparse.SUPPRESS)
    parser.add_argument("--calls", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=str(RESULTS))
    args, extra = parser.parse_known_args()
    extra = [a for a in extra if a != "--"]
    if args.alone:
        print(json.dumps(alone(Path(args.alone), args.calls)))
        return
    if not any(a.startswith("--ppo.lr") and not a.startswith("--ppo.lr_") for a in extra):
        extra = ["--ppo.lr", "1e-12", *extra]  # the start's weights throughout: see the module's docstring
    with tempfile.TemporaryDirectory(prefix="engine-bench-") as tmp:
        rates, sync, run_dir = in_service(extra, args.iterations, Path(tmp))
        cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
        chunks = cfg["rollout"]["batch_size"] // cfg["rollout"]["chunk_size"]
        child = subprocess.run([sys.executable, __file__, "--alone", str(run_dir), "--calls",
                                str(chunks * len(rates))], cwd=ROOT, capture_output=True, text=True,
                               env={**os.environ, **RAY_ENV, "OMP_NUM_THREADS": "1"}, check=True)
        plain = json.loads(child.stdout.strip().splitlines()[-1])
    service = statistics.median(rates)
    results = {**stamp(), "args": extra, "iterations": args.iterations, "in_service_tokens_per_second": rates,
               "in_service_median": service, "alone": plain, "ratio": service / plain["tokens_per_second"],
               "sync": sync}
    table = [f"`.venv/bin/python benchmarks/engine_in_service.py --iterations {args.iterations}"
             + (f" -- {' '.join(extra)}`" if extra else "`"), "",
             "| engine | tokens/s | response tokens | batch | dtype | threads |", "|---|---|---|---|---|---|",
             (f"| inside the service (median of {len(rates)} iterations; range "
              f"{min(rates):.0f}-{max(rates):.0f}) | {service:.0f} | {sync['response_length_mean']:.2f} | "
              f"{plain['batch']} | {plain['dtype']} | 1 |"),
             (f"| `vllm.LLM.generate` alone ({plain['calls']} calls) | {plain['tokens_per_second']:.0f} | "
              f"{plain['response_length_mean']:.2f} | {plain['batch']} | {plain['dtype']} | "
              f"{plain['threads']} |"),
             f"| in service / alone | {results['ratio']:.2f} (target >= 0.90) | | | | |", "",
             (f"Same iterations (medians): iteration {sync['iteration_seconds']:.2f} s, weight sync "
              f"{sync['weight_sync_seconds']:.3f} s, probe and state checks "
              f"{sync['probe_and_checks_seconds']:.3f} s "
              f"= {100 * sync['probe_share']:.1f}% of an iteration (target <= 5%).")]
    write_results(args.out, "engine_in_service", results, table)
    print("\n".join(table))


if __name__ == "__main__":
    main()
