"""Benchmark: rollout generation and reference scoring, vLLM (the service's VLLMEngine) against
transformers (HFEngine's generate, and the reference actor's batched forward), tokens/s.

    .venv/bin/python benchmarks/rollout.py [--quick] [--device cpu|cuda] [--model auto|smollm2|tiny]
                                           [--batches 1 8 32 64] [--max-new-tokens 32] [--out DIR]

Generation: the same prompts, temperature 1, top-p 1, exactly ``max_new_tokens`` new tokens per sequence
on both engines (vLLM ``ignore_eos=True``; transformers ``min_new_tokens=max_new_tokens``), sampled-token
log-probs returned by both, as the rollout actor needs them. Scoring: log-probs of B given sequences
(prompt + ``max_new_tokens`` tokens), vLLM ``prompt_logprobs`` (``VLLMEngine.score``) against one padded
transformers forward (``services.experience.response_forward``, what ``ReferenceActor`` runs); tokens/s
counts every token of every sequence. Each engine runs alone in its own subprocess, on the same cores:
by default one core, as in the service (each rollout engine is pinned to its own core, and a Ray actor
with a fractional CPU gets one OpenMP thread); ``--cores 0 1`` gives both engines two. On a loaded
machine, binding vLLM's OpenMP threads to cores that other processes also use slows it down by an order
of magnitude (spinning threads at every barrier), so the load average is recorded before and after.
Every batch size gets one untimed warm-up call, then the median of ``--repeats`` timed calls, with
vLLM's prefix cache reset before each.

The model is SmolLM2-135M-Instruct (``services.smollm2.smollm2_dir``, converted once into
``--cache-dir``) with its chat-formatted sentiment prompts, or, with ``--model tiny``, the randomwalks
GPT-2 (random init) with its one-letter prompts. ``--quick``: batches 1 and 4, 8 new tokens, 1 repeat,
and the tiny model unless SmolLM2 is already converted. Writes ``<out>/<name>.json`` and ``<name>.md``
(name ``rollout``, or ``rollout-cuda`` with ``--device cuda``; out ``benchmarks/results``).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench import (
    RESULTS,
    count_params,
    emit,
    gpt2_dir,
    median,
    read_spec,
    run_worker,
    smollm2_available,
    smollm2_cached,
    stamp,
    write_results,
)

# ------------------------------------------------------------------------------------------ workers


def _pin(spec: dict) -> None:
    cores = spec["cores"]
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, cores)
    if spec["device"] == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
        # the same cores for vLLM's OpenMP threads as for torch's
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(str(c) for c in cores)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import torch

    torch.set_num_threads(len(cores))
    if spec["device"] == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda, but torch sees no CUDA device")


def _sync(device: str) -> None:
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


def _time_calls(fn, batches: list[int], repeats: int, device: str) -> dict:
    """{batch: {seconds (median), tokens, tokens_per_s, all_seconds}} with one warm-up call per batch."""
    out = {}
    for b in batches:
        fn(b, -1)  # warm-up: first-call allocations and kernel choices are not throughput
        seconds, tokens = [], None
        for r in range(repeats):
            _sync(device)
            start = time.perf_counter()
            n = fn(b, r)
            _sync(device)
            seconds.append(time.perf_counter() - start)
            if tokens is not None and n != tokens:
                raise RuntimeError(f"batch {b}: token count changed between repeats ({tokens} -> {n})")
            tokens = n
        s = median(seconds)
        out[str(b)] = {"seconds": s, "tokens": tokens, "tokens_per_s": tokens / s, "all_seconds": seconds}
        print(f"  batch {b}: {tokens} tokens in {s:.3f}s -> {tokens / s:.1f} tokens/s", file=sys.stderr,
              flush=True)
    return out


def vllm_engine_spec(spec: dict):
    """``VLLMEngine``'s spec, as the service builds a rollout engine: on ``--device``, with the default
    rollout settings' engine arguments (``RolloutConfig.vllm_engine_args``), so on CUDA the engine takes its
    share of the GPU (0.9 of the whole one it has here), not the CPU build's ``--kv-cache-mib``."""
    from actors.specs import EngineSpec
    from services.config import RolloutConfig

    return EngineSpec("vllm", spec["seed"], spec["max_model_len"], spec["kv_cache_mib"], spec["dtype"],
                      device=spec["device"], engine_args=RolloutConfig().vllm_engine_args(
                          1.0 if spec["device"] == "cuda" else 0.0))


def worker_vllm(spec: dict) -> dict:
    _pin(spec)
    from vllm import SamplingParams, TokensPrompt

    from actors.engines import VLLMEngine

    start = time.perf_counter()
    engine = VLLMEngine(spec["model_dir"], vllm_engine_spec(spec))
    startup = time.perf_counter() - start
    prompts, n_new = spec["prompts"], spec["max_new_tokens"]

    def generate(b: int, r: int) -> int:
        engine.llm.reset_prefix_cache()
        params = [SamplingParams(temperature=spec["temperature"], top_p=spec["top_p"], max_tokens=n_new,
                                 logprobs=0, seed=spec["seed"] + 1000 * (r + 1) + i, ignore_eos=True)
                  for i in range(b)]
        outs = engine.llm.generate([TokensPrompt(prompt_token_ids=prompts[i % len(prompts)])
                                    for i in range(b)], params, use_tqdm=False)
        tokens = 0
        for out in outs:  # read the sampled-token log-probs, as VLLMEngine.generate does
            ids = list(out.outputs[0].token_ids)
            _ = [step[t].logprob for step, t in zip(out.outputs[0].logprobs, ids, strict=True)]
            tokens += len(ids)
        return tokens

    def score(b: int, r: int) -> int:
        engine.llm.reset_prefix_cache()
        seqs, plens = spec["score_sequences"][:b], spec["score_prompt_lengths"][:b]
        scored = engine.score(seqs, plens)
        assert all(len(s) == len(q) - p for s, q, p in zip(scored, seqs, plens, strict=True))
        return sum(len(s) for s in seqs)

    print("vLLM generate", file=sys.stderr, flush=True)
    gen = _time_calls(generate, spec["batches"], spec["repeats"], spec["device"])
    print("vLLM score (prompt_logprobs)", file=sys.stderr, flush=True)
    sc = _time_calls(score, spec["score_batches"], spec["repeats"], spec["device"])
    return {"startup_seconds": startup, "generate": gen, "score": sc, **_device_info(spec)}


def worker_hf(spec: dict) -> dict:
    _pin(spec)
    import torch

    from actors.engines import HFEngine
    from services.experience import make_batch, pad_left, response_forward

    start = time.perf_counter()
    engine = HFEngine(spec["model_dir"], spec["seed"], spec["dtype"], device=spec["device"])
    startup = time.perf_counter() - start
    prompts, n_new = spec["prompts"], spec["max_new_tokens"]

    @torch.no_grad()
    def generate(b: int, r: int) -> int:
        # HFEngine.generate, plus min_new_tokens so every sequence gets exactly n_new tokens
        torch.manual_seed(spec["seed"] + 1000 * (r + 1))
        rows = [prompts[i % len(prompts)] for i in range(b)]
        input_ids = pad_left(rows, engine.pad_id).to(engine.device)
        attention_mask = pad_left([[1] * len(p) for p in rows], 0).to(engine.device)
        out = engine.model.generate(
            input_ids=input_ids, attention_mask=attention_mask, do_sample=True,
            temperature=spec["temperature"], top_p=spec["top_p"], top_k=0, max_new_tokens=n_new,
            min_new_tokens=n_new, eos_token_id=engine.eos_id, pad_token_id=engine.pad_id, output_scores=True,
            return_dict_in_generate=True,
        )
        new_tokens = out.sequences[:, input_ids.shape[1]:]
        logprobs = torch.stack([torch.log_softmax(s.float(), -1) for s in out.scores], dim=1)
        _ = logprobs.gather(-1, new_tokens.unsqueeze(-1)).squeeze(-1).tolist()
        return int(new_tokens.numel())

    @torch.no_grad()
    def score(b: int, r: int) -> int:
        seqs, plens = spec["score_sequences"][:b], spec["score_prompt_lengths"][:b]
        ps = [s[:p] for s, p in zip(seqs, plens, strict=True)]
        rs = [s[p:] for s, p in zip(seqs, plens, strict=True)]
        batch = make_batch(ps, rs, [[0.0] * len(x) for x in rs], [0] * b, list(range(b)), engine.pad_id,
                           0, 0.0)
        logprobs, _, _ = response_forward(engine.model, batch.to(engine.device))
        _ = (logprobs * batch.response_mask.to(engine.device)).cpu()
        return sum(len(s) for s in seqs)

    print("transformers generate", file=sys.stderr, flush=True)
    gen = _time_calls(generate, spec["batches"], spec["repeats"], spec["device"])
    print("transformers forward (response_forward)", file=sys.stderr, flush=True)
    sc = _time_calls(score, spec["score_batches"], spec["repeats"], spec["device"])
    return {"startup_seconds": startup, "generate": gen, "score": sc, **_device_info(spec)}


def _device_info(spec: dict) -> dict:
    import torch

    info = {"torch": torch.__version__, "threads": torch.get_num_threads()}
    if spec["device"] == "cuda":
        info["gpu"] = torch.cuda.get_device_name(0)
    try:
        import vllm

        info["vllm"] = vllm.__version__
    except ImportError:
        pass
    return info


# ------------------------------------------------------------------------------------------- driver


def resolve_model(args, work: Path) -> tuple[str, Path]:
    choice = args.model
    if choice == "auto":
        if args.quick:
            cached = smollm2_cached(args.cache_dir)
            choice = "smollm2" if cached else "tiny"
        else:
            choice = "smollm2" if smollm2_available() else "tiny"
    if choice == "smollm2":
        from services.smollm2 import smollm2_dir

        return "SmolLM2-135M-Instruct", smollm2_dir(args.cache_dir, log=lambda m: print(m, file=sys.stderr))
    return "randomwalks GPT-2 (random init)", gpt2_dir(work / "tiny-gpt2")


def build_prompts(model_name: str, model_dir: Path) -> list[list[int]]:
    from services.models import load_tokenizer
    from services.prompts import encode_prompts
    from services.tasks import get_task

    task = get_task("smollm2-sentiment" if model_name.startswith("SmolLM2") else "randomwalks")
    tokenizer = load_tokenizer(model_dir)
    texts = [task.format_prompt(t, tokenizer) for t in task.prompts()]
    return encode_prompts(texts, tokenizer, 64, "truncate", log=lambda m: None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="smoke mode: batches 1 and 4, 8 tokens, 1 repeat")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--model", choices=("auto", "smollm2", "tiny"), default="auto")
    parser.add_argument("--cache-dir", default=str(Path("~/.cache/tether").expanduser()))
    parser.add_argument("--batches", type=int, nargs="+", default=None, help="default 1 8 32 64")
    parser.add_argument("--max-new-tokens", type=int, default=None, help="default 32")
    parser.add_argument("--repeats", type=int, default=None, help="timed calls per batch size (default 3)")
    parser.add_argument("--dtype", default="float32",
                        help="both engines (the service's rollouts run float32)")
    parser.add_argument("--kv-cache-mib", type=int, default=512, help="vLLM's KV cache on CPU (on CUDA: "
                        "rollout.gpu_memory_utilization's default share of the GPU)")
    parser.add_argument("--cores", type=int, nargs="+", default=None,
                        help="CPU cores for both engines (default: the first core this process may use)")
    parser.add_argument("--engines", nargs="+", choices=("vllm", "hf"), default=["vllm", "hf"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(RESULTS), help="results folder (default benchmarks/results)")
    parser.add_argument("--name", default=None, help="result file name (default rollout / rollout-cuda)")
    parser.add_argument("--worker", choices=("vllm", "hf"), help=argparse.SUPPRESS)
    parser.add_argument("--spec", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        spec = read_spec(args.spec)
        emit(worker_vllm(spec) if args.worker == "vllm" else worker_hf(spec))
        return

    batches = args.batches or ([1, 4] if args.quick else [1, 8, 32, 64])
    max_new = args.max_new_tokens or (8 if args.quick else 32)
    repeats = args.repeats or (1 if args.quick else 3)
    allowed = (sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
               else list(range(os.cpu_count() or 1)))
    cores = args.cores or allowed[:1]
    name = args.name or ("rollout-cuda" if args.device == "cuda" else "rollout")
    out = Path(args.out)
    results = {**stamp(), "device": args.device, "loadavg_before": os.getloadavg()}
    with tempfile.TemporaryDirectory(prefix="bench-rollout-") as tmp:
        model_name, model_dir = resolve_model(args, Path(tmp))
        prompts = build_prompts(model_name, model_dir)
        from services.models import load_tokenizer

        vocab = len(load_tokenizer(model_dir))
        import torch

        gen = torch.Generator().manual_seed(args.seed)
        score_batches = batches
        seqs, plens = [], []
        for i in range(max(score_batches)):
            p = prompts[i % len(prompts)]
            seqs.append(p + torch.randint(0, vocab, (max_new,), generator=gen).tolist())
            plens.append(len(p))
        max_prompt = max(len(p) for p in prompts)
        spec = {
            "model_dir": str(model_dir), "prompts": prompts, "batches": batches,
            "score_batches": score_batches, "max_new_tokens": max_new, "repeats": repeats,
            "dtype": args.dtype, "device": args.device, "cores": cores, "kv_cache_mib": args.kv_cache_mib,
            "seed": args.seed, "temperature": 1.0, "top_p": 1.0, "max_model_len": max_prompt + max_new + 1,
            "score_sequences": seqs, "score_prompt_lengths": plens,
        }
        results.update({
            "model": model_name, "model_dir": str(model_dir), "params": count_params(model_dir),
            "dtype": args.dtype, "max_new_tokens": max_new, "repeats": repeats, "cores": cores,
            "batches": batches, "prompt_tokens_mean": sum(len(p) for p in prompts) / len(prompts),
            "prompt_tokens_max": max_prompt,
            "sampling": {"temperature": 1.0, "top_p": 1.0, "fixed_length": True},
            "quick": args.quick,
        })
        print(f"[rollout] {model_name} ({results['params'] / 1e6:.1f}M params, {args.dtype}) on "
              f"{args.device}, cores {cores}, batches {batches}, {max_new} new tokens, {repeats} repeat(s)",
              flush=True)
        engines = {}
        for kind in args.engines:
            print(f"[rollout] {kind} worker (log: {out / 'logs' / f'{name}-{kind}.log'})", flush=True)
            engines[kind] = run_worker(Path(__file__), ["--worker", kind], spec,
                                       out / "logs" / f"{name}-{kind}.log")
            print(f"[rollout] {kind}: " + ", ".join(
                f"b{b} {v['tokens_per_s']:.0f}" for b, v in engines[kind]["generate"].items())
                + " gen tokens/s", flush=True)
    results["engines"] = engines
    results["loadavg_after"] = os.getloadavg()
    ratios = {"generate": {}, "score": {}}
    if "vllm" in engines and "hf" in engines:
        for part, by_batch in ratios.items():
            for b in engines["vllm"][part]:
                by_batch[b] = (engines["vllm"][part][b]["tokens_per_s"]
                               / engines["hf"][part][b]["tokens_per_s"])
    results["speedup_vllm_over_hf"] = ratios

    def cell(kind: str, part: str, b: str) -> str:
        return f"{engines[kind][part][b]['tokens_per_s']:.1f}" if kind in engines else "-"

    rows = [f"Model {model_name}, {results['params'] / 1e6:.1f}M params, {args.dtype}, device {args.device}, "
            f"cores {cores}; {max_new} new tokens per sequence (EOS ignored), temperature 1, top-p 1; "
            f"prompts {results['prompt_tokens_mean']:.0f} tokens on average; median of {repeats} timed "
            "call(s) after a warm-up."
            + (" QUICK SMOKE RUN: sizes shrunk, numbers are not representative." if args.quick else ""),
            "",
            ("| batch | vLLM generate tok/s | transformers generate tok/s | speedup | vLLM score tok/s "
            "(prompt_logprobs) | transformers forward tok/s | speedup |"),
            "|---|---|---|---|---|---|---|"]
    for b in map(str, batches):
        g, s = ratios["generate"].get(b), ratios["score"].get(b)
        rows.append(f"| {b} | {cell('vllm', 'generate', b)} | {cell('hf', 'generate', b)} | "
                    f"{f'{g:.2f}x' if g else '-'} | {cell('vllm', 'score', b)} | {cell('hf', 'score', b)} | "
                    f"{f'{s:.2f}x' if s else '-'} |")
    rows += ["", "Engine start (s): " + ", ".join(f"{k} {v['startup_seconds']:.1f}"
                                                  for k, v in engines.items()),
             (f"Load average (1 min) before {results['loadavg_before'][0]:.1f}, after "
             f"{results['loadavg_after'][0]:.1f}, on {os.cpu_count()} CPUs."),
             ("Generate tokens/s counts new tokens; score tokens/s counts every token of every scored "
              f"sequence (prompt + {max_new}).")]
    json_path, md_path = write_results(out, name, results, rows)
    print("\n".join(rows))
    print(f"[rollout] wrote {json_path} and {md_path}")


if __name__ == "__main__":
    main()
