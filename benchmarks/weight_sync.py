"""Benchmark: the cost of one weight broadcast (learner -> vLLM engine) on the object-store path, per
stage, against what copying the same bytes once costs on this machine.

    .venv/bin/python benchmarks/weight_sync.py [--quick] [--models tiny mid smollm2] [--stages 0 3]
        [--out DIR]

Models: the randomwalks GPT-2 (``services.tasks.get_task("randomwalks").model_config``, char tokenizer),
a ~16M-parameter GPT-2 (8 layers, n_embd 384, 6 heads of 64, vocab 8192) and SmolLM2-135M-Instruct
(``services.smollm2.smollm2_dir``); the GPT-2s are random init. For each model and ZeRO stage a fresh
subprocess builds a 1-rank ``learner.rank.LearnerRank`` (DeepSpeed on gloo, no launcher, exactly as the
job's ranks) and times, ``--repeats`` times each (median):

- gather: ``LearnerRank.policy_state_dict`` without its ``ray.put``: the full fp32 state dict (HF names)
  as ``services.weights.HostWeights`` (raw bytes, no copy of host fp32 tensors), inside
  ``deepspeed.zero.GatheredParameters`` under ZeRO-3 (a no-op context otherwise);
- put: ``ray.put`` of that dict into the object store of a local Ray this script starts;
- get: ``ray.get(ref).tensors()`` inside another Ray process (an actor), as a rollout engine reads it;
- policy_state_dict: the real method end to end (gather + put), as a cross-check;
- vLLM load: ``collective_rpc("load_policy_weights")`` + ``reset_prefix_cache`` on a ``VLLMEngine`` built
  from the same model dir (what ``VLLMEngine.load_weights`` does), split into its two calls.

Each is compared with bound = state-dict bytes / memcpy bandwidth, the bandwidth measured in the same run
as the best of 5 ``torch.Tensor.copy_`` of a 512 MiB tensor (payload bytes per second). ``--quick``: the
tiny model, ZeRO-0, 2 repeats and a 128 MiB memcpy. Writes ``<out>/weight_sync.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench import RAY_ENV, RESULTS, emit, gpt2_dir, median, read_spec, run_worker, stamp, write_results

MID_GPT2 = {"n_layer": 8, "n_embd": 384, "n_head": 6, "n_positions": 128, "resid_pdrop": 0.0,
            "embd_pdrop": 0.0, "attn_pdrop": 0.0}
MID_VOCAB = 8192


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------------------------------- worker


def worker(spec: dict) -> dict:
    os.environ.update(RAY_ENV)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import ray
    import torch

    from learner.plan import RankSpec
    from learner.rank import LearnerRank
    from services.config import load_config

    stage, repeats = spec["stage"], spec["repeats"]
    ray.init(address=spec["ray_address"], namespace="bench-weight-sync", log_to_driver=False)

    cfg = load_config(None, {"learner": {"zero_stage": stage, "world_size": 1}})
    rank = LearnerRank(0, 1)
    start = time.perf_counter()
    rank.setup("127.0.0.1", spec["master_port"], RankSpec.of(cfg, spec["model_dir"]))
    setup_s = time.perf_counter() - start
    lm = rank.engine.lm
    params = list(lm.parameters())
    partitioned = all(hasattr(p, "ds_numel") and p.numel() == 0 for p in params)
    if stage == 3 and not partitioned:
        raise RuntimeError("ZeRO-3 engine whose parameters are not partitioned")
    import deepspeed

    from services.weights import HostWeights

    def gather() -> HostWeights:
        # LearnerRank.policy_state_dict without the ray.put
        with deepspeed.zero.GatheredParameters(params, modifier_rank=None, enabled=stage == 3):
            return HostWeights(lm.state_dict(), torch.float32)

    def timed(fn):
        t0 = time.perf_counter()
        out = fn()
        return time.perf_counter() - t0, out

    print(f"gather x{repeats}", file=sys.stderr, flush=True)
    gather_s, weights = [], None
    for _ in range(repeats):
        weights = None
        seconds, weights = timed(gather)
        gather_s.append(seconds)
    nbytes = sum(t.numel() * t.element_size() for t in weights.tensors().values())
    n_params = sum(getattr(p, "ds_numel", p.numel()) for p in params)

    @ray.remote(num_cpus=0)
    class Fetcher:
        """Stands in for a rollout engine actor: reads the weights ref from the object store."""

        def fetch(self, refs: list) -> tuple[float, int]:
            t0 = time.perf_counter()
            got = ray.get(refs[0]).tensors()
            seconds = time.perf_counter() - t0
            return seconds, sum(v.numel() * v.element_size() for v in got.values())

    fetcher = Fetcher.remote()
    ray.get(fetcher.fetch.remote([ray.put(HostWeights({"warm": torch.zeros(4)}, torch.float32))]))  # warm
    print(f"put/get x{repeats}", file=sys.stderr, flush=True)
    put_s, get_s = [], []
    for _ in range(repeats):
        seconds, ref = timed(lambda: ray.put(weights))
        put_s.append(seconds)
        seconds, got_bytes = ray.get(fetcher.fetch.remote([ref]))
        if got_bytes != nbytes:
            raise RuntimeError(f"fetched {got_bytes} bytes, put {nbytes}")
        get_s.append(seconds)
        del ref
    print(f"policy_state_dict x{repeats}", file=sys.stderr, flush=True)
    psd_s = []
    for _ in range(repeats):
        seconds, refs = timed(rank.policy_state_dict)
        psd_s.append(seconds)
        del refs
    ray.kill(fetcher)

    result = {
        "params": n_params, "state_dict_bytes": nbytes, "tensors": len(weights),
        "zero3_partitioned": partitioned,
        "setup_seconds": setup_s, "gather_seconds": gather_s, "put_seconds": put_s, "get_seconds": get_s,
        "policy_state_dict_seconds": psd_s,
    }
    if spec["vllm"]:
        # after everything else: the engine binds this process's OpenMP threads to its core
        from actors.engines import VLLMEngine
        from actors.specs import EngineSpec

        t0 = time.perf_counter()
        engine = VLLMEngine(spec["model_dir"], EngineSpec(max_model_len=spec["max_model_len"],
                                                          kv_cache_mib=spec["kv_cache_mib"]))
        result["vllm_start_seconds"] = time.perf_counter() - t0
        # over the object store's bytes, as the engine reads them
        weights = ray.get(ray.put(weights)).tensors()
        engine.load_weights(weights)  # warm-up (first reload builds the loader's bookkeeping)
        rpc_s, reset_s = [], []
        print(f"vLLM load x{repeats}", file=sys.stderr, flush=True)
        for _ in range(repeats):
            seconds, loaded = timed(lambda: engine.llm.collective_rpc("load_policy_weights", args=(weights,)))
            if loaded != [len(weights)]:
                raise RuntimeError(f"load_policy_weights loaded {loaded}, expected [{len(weights)}]")
            rpc_s.append(seconds)
            seconds, _ = timed(engine.llm.reset_prefix_cache)
            reset_s.append(seconds)
        result.update({"vllm_rpc_seconds": rpc_s, "vllm_reset_seconds": reset_s,
                       "vllm_load_seconds": [a + b for a, b in zip(rpc_s, reset_s, strict=True)]})
    ray.shutdown()
    return result


# ------------------------------------------------------------------------------------------- driver


def memcpy_bandwidth(mib: int, tries: int) -> dict:
    """Best of ``tries`` copies of a ``mib`` MiB fp32 tensor into a preallocated one (pages touched first)."""
    import torch

    n = (mib << 20) // 4
    src = torch.rand(n)
    dst = torch.empty_like(src)
    dst.copy_(src)
    seconds = []
    for _ in range(tries):
        t0 = time.perf_counter()
        dst.copy_(src)
        seconds.append(time.perf_counter() - t0)
    best = min(seconds)
    return {"mib": mib, "tries": tries, "best_seconds": best, "bytes_per_second": (mib << 20) / best,
            "threads": torch.get_num_threads(), "all_seconds": seconds}


def model_dirs(names: list[str], work: Path, cache_dir: str) -> dict[str, tuple[str, Path]]:
    from services.tasks import get_task

    out = {}
    for name in names:
        if name == "tiny":
            out[name] = ("randomwalks GPT-2", gpt2_dir(work / "tiny", get_task("randomwalks").model_config))
        elif name == "mid":
            out[name] = ("GPT-2 8x384, vocab 8192", gpt2_dir(work / "mid", MID_GPT2, vocab_size=MID_VOCAB))
        elif name == "smollm2":
            from services.smollm2 import smollm2_dir

            out[name] = ("SmolLM2-135M-Instruct",
                         smollm2_dir(cache_dir, log=lambda m: print(m, file=sys.stderr)))
        else:
            raise ValueError(f"unknown model {name!r}")
    return out


def max_positions(model_dir: Path) -> int:
    config = json.loads((model_dir / "config.json").read_text())
    return int(config.get("n_positions") or config.get("max_position_embeddings") or 64)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smoke mode: tiny model, ZeRO-0, 2 repeats")
    parser.add_argument("--models", nargs="+", choices=("tiny", "mid", "smollm2"), default=None)
    parser.add_argument("--stages", type=int, nargs="+", choices=(0, 3), default=None)
    parser.add_argument("--repeats", type=int, default=None, help="timed repeats per measurement (default 5)")
    parser.add_argument("--memcpy-mib", type=int, default=None, help="memcpy probe size (default 512)")
    parser.add_argument("--no-vllm", action="store_true", help="skip the vLLM load")
    parser.add_argument("--kv-cache-mib", type=int, default=128)
    parser.add_argument("--object-store-mib", type=int, default=None,
                        help="default 4x the largest state dict")
    parser.add_argument("--cache-dir", default=str(Path("~/.cache/tether").expanduser()))
    parser.add_argument("--out", default=str(RESULTS), help="results folder (default benchmarks/results)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--spec", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        emit(worker(read_spec(args.spec)))
        return

    models = args.models or (["tiny"] if args.quick else ["tiny", "mid", "smollm2"])
    stages = args.stages or ([0] if args.quick else [0, 3])
    repeats = args.repeats or (2 if args.quick else 5)
    out = Path(args.out)
    results = {**stamp(), "quick": args.quick, "repeats": repeats, "dtype": "float32", "world_size": 1,
               "backend": "gloo (CPU)", "loadavg_before": os.getloadavg()}
    os.environ.update(RAY_ENV)
    import ray

    memcpy = memcpy_bandwidth(args.memcpy_mib or (128 if args.quick else 512), 3 if args.quick else 5)
    results["memcpy"] = memcpy
    bw = memcpy["bytes_per_second"]
    print(f"[weight_sync] memcpy {memcpy['mib']} MiB: best {memcpy['best_seconds'] * 1e3:.1f} ms -> "
          f"{bw / 2**30:.2f} GiB/s", flush=True)

    rows_out = []
    with tempfile.TemporaryDirectory(prefix="bench-wsync-") as work:
        dirs = model_dirs(models, Path(work), args.cache_dir)
        largest = max(sum(f.stat().st_size for f in d.glob("*.safetensors")) for _, d in dirs.values())
        store_mib = args.object_store_mib or max(256, 4 * largest >> 20)
        temp_dir = tempfile.mkdtemp(prefix="rws-", dir="/tmp")  # short: socket paths stay < 108 chars
        ray.init(num_cpus=2, object_store_memory=store_mib << 20, include_dashboard=False,
                 _node_ip_address="127.0.0.1", _temp_dir=temp_dir, namespace="bench-weight-sync")
        try:
            address = ray.get_runtime_context().gcs_address
            for key in models:
                label, model_dir = dirs[key]
                for stage in stages:
                    print(f"[weight_sync] {label}, ZeRO-{stage} (log: {out / 'logs'})", flush=True)
                    spec = {"model_dir": str(model_dir), "stage": stage, "repeats": repeats,
                            "ray_address": address, "master_port": free_port(), "vllm": not args.no_vllm,
                            "kv_cache_mib": args.kv_cache_mib,
                            "max_model_len": min(max_positions(model_dir), 64)}
                    r = run_worker(Path(__file__), ["--worker"], spec,
                                   out / "logs" / f"weight_sync-{key}-zero{stage}.log",
                                   env={"DS_ACCELERATOR": os.environ.get("DS_ACCELERATOR", "cpu")})
                    r.update({"model": label, "key": key, "stage": stage})
                    bound = r["state_dict_bytes"] / bw
                    r["bound_seconds"] = bound
                    for part in ("gather", "put", "get", "policy_state_dict", "vllm_load", "vllm_rpc"):
                        if f"{part}_seconds" in r:
                            r[f"{part}_median_seconds"] = median(r[f"{part}_seconds"])
                            r[f"{part}_over_bound"] = r[f"{part}_median_seconds"] / bound
                    r["total_median_seconds"] = sum(r.get(f"{p}_median_seconds", 0.0)
                                                    for p in ("gather", "put", "get", "vllm_load"))
                    r["total_over_bound"] = r["total_median_seconds"] / bound
                    rows_out.append(r)
                    print(f"[weight_sync]   {r['state_dict_bytes'] / 2**20:.1f} MiB: gather "
                          f"{r['gather_median_seconds']:.4f}s put {r['put_median_seconds']:.4f}s get "
                          f"{r['get_median_seconds']:.4f}s vLLM load "
                          f"{r.get('vllm_load_median_seconds', float('nan')):.4f}s"
                          f" | bound {bound:.4f}s", flush=True)
        finally:
            ray.shutdown()
            shutil.rmtree(temp_dir, ignore_errors=True)
    results["runs"] = rows_out
    results["loadavg_after"] = os.getloadavg()

    def s_and_x(r: dict, part: str) -> str:
        if f"{part}_median_seconds" not in r:
            return "-"
        return f"{r[f'{part}_median_seconds']:.4f} ({r[f'{part}_over_bound']:.0f}x)"

    rows = [f"One broadcast on the object-store path, fp32, 1 DeepSpeed rank on gloo; median of {repeats}. "
            f"Bound = state-dict bytes / memcpy bandwidth ({bw / 2**30:.2f} GiB/s: best of {memcpy['tries']} "
            f"torch copy_ of {memcpy['mib']} MiB, {memcpy['threads']} threads, this run); "
            "(Nx) = seconds / bound."
            + (" QUICK SMOKE RUN: not representative." if args.quick else ""),
            "",
            ("| model | params | MiB | ZeRO | bound (s) | gather (s) | ray.put (s) | ray.get in actor (s) | "
            "policy_state_dict (s) | vLLM load: rpc + reset (s) | total gather+put+get+load (s) |"),
            "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows_out:
        rows.append(f"| {r['model']} | {r['params'] / 1e6:.1f}M | {r['state_dict_bytes'] / 2**20:.1f} | "
                    f"{r['stage']} | {r['bound_seconds']:.4f} | {s_and_x(r, 'gather')} | "
                    f"{s_and_x(r, 'put')} | {s_and_x(r, 'get')} | "
                    f"{s_and_x(r, 'policy_state_dict')} | {s_and_x(r, 'vllm_load')} | "
                    f"{r['total_median_seconds']:.4f} ({r['total_over_bound']:.0f}x) |")
    rows += ["", (f"Load average (1 min) before {results['loadavg_before'][0]:.1f}, after "
             f"{results['loadavg_after'][0]:.1f}, on {os.cpu_count()} CPUs. The engine's vLLM load runs on "
             "the one core the engine is pinned to (VLLM_CPU_OMP_THREADS_BIND, as in the service).")]
    json_path, md_path = write_results(out, "weight_sync", results, rows)
    print("\n".join(rows))
    print(f"[weight_sync] wrote {json_path} and {md_path}")


if __name__ == "__main__":
    main()
