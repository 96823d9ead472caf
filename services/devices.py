"""Where an actor's devices are, and vLLM built for one: shared by the rollout, reference and reward actors,
the reward service and the learner ranks."""

from __future__ import annotations

import gc
import os


def gpu_location() -> tuple[str, list[str]]:
    """(node id, GPU ids Ray gave this actor): where the calling actor's GPUs are."""
    import ray

    context = ray.get_runtime_context()
    return context.get_node_id(), sorted(context.get_accelerator_ids().get("GPU", []))


def vllm_device_args(device: str, max_model_len: int, kv_cache_mib: int,
                     engine_args: dict | None = None) -> dict:
    """The ``LLM(...)`` arguments of an engine on ``device``, from the config's ``engine_args``
    (``RolloutConfig.vllm_engine_args``, ``JobConfig.reference_vllm_engine_args``)."""
    args = {"enforce_eager": True, **(engine_args or {})}
    if device == "cpu":  # the KV cache is sized in bytes here; vLLM's CPU build has no GPU share
        args.pop("gpu_memory_utilization", None)
        args["kv_cache_memory_bytes"] = kv_cache_mib << 20
        # a prompt prefilled in parts fails a seeded request on CPU ("CPU Generator does not use offset"):
        # a multi-turn chunk's trajectories pass the 4096 tokens of one step; whole prompts per step instead
        args.setdefault("enable_chunked_prefill", False)
        args.setdefault("max_num_batched_tokens", max(4096, max_model_len))
    elif "gpu_memory_utilization" not in args:
        # vLLM's default takes 0.92 of the GPU: more than a shared GPU has free, so the engine fails to start
        raise ValueError(f"a vLLM engine on {device} needs gpu_memory_utilization from the config (its share "
                         "of the GPU); vLLM's default of 0.92 does not fit a GPU shared with other actors")
    return args


def cpu_binding(engine: int, threads: int) -> str:
    """VLLM_CPU_OMP_THREADS_BIND for engine ``engine`` of a machine, each engine ``threads`` cores of its
    own: "2" or "2-3"."""
    first = engine * threads
    return str(first) if threads == 1 else f"{first}-{first + threads - 1}"


def build_llm(model_dir: str, seed: int, max_model_len: int, kv_cache_mib: int, dtype: str, device: str,
              engine_args: dict | None = None, cpu_core: int | None = None, cpu_threads: int = 1,
              **llm_args):
    """vLLM's ``LLM`` in this process (single-process mode: 2-5 s starts, tensors pass directly), on
    ``device`` with the config's ``engine_args`` (``vllm_device_args``) and any other ``LLM(...)``
    arguments. On CPU engine ``cpu_core`` binds ``cpu_threads`` cores from ``cpu_core x cpu_threads``."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    if device == "cpu":  # 'auto' pins every engine to core 0; each engine binds cores of its own instead
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", cpu_binding(cpu_core or 0, cpu_threads))
    from services.console import quiet_vllm, verbose

    quiet_vllm()  # before vLLM loads: the warnings tether knows to be harmless stay out of the console
    from vllm import LLM

    # vLLM's build runs five full collections of its own (model load, heap freeze): frozen first, the
    # modules just imported are not scanned by them (about 1 CPU s of a 7.5 s build here)
    gc.freeze()
    # the checkpoint-loading bar only at metrics.log_level debug or info
    args = {"use_tqdm_on_load": verbose(),
            **vllm_device_args(device, max_model_len, kv_cache_mib, engine_args), **llm_args}
    return LLM(model=model_dir, dtype=dtype, seed=seed, max_model_len=max_model_len, **args)


def assigned_gpus() -> list[str]:
    """The GPU ids Ray assigned this process's actor (none outside an actor)."""
    import ray

    if not ray.is_initialized() or ray.get_runtime_context().get_actor_id() is None:
        return []
    return [str(i) for i in ray.get_runtime_context().get_accelerator_ids().get("GPU", [])]


def visible_gpus(assigned: list[str], visible: str | None) -> str | None:
    """What CUDA_VISIBLE_DEVICES must become for an actor that was ``assigned`` these GPU ids, where it is now
    ``visible``: the assigned ids where Ray left it unset (every GPU visible), else None (leave it: Ray set it
    to the assigned ones, or the user chose)."""
    return ",".join(assigned) if assigned and visible is None else None
