"""What the console shows: tether's own ``[tether]`` lines first. The engines' and libraries' logging (vLLM,
transformers, DeepSpeed, Ray, torch) is at ``metrics.log_level``, WARNING by default, in the driver and in
every actor, and the warnings tether causes and knows to be harmless are dropped; ``--log-level debug``
(or ``info``) brings back everything, progress bars included.

Libraries read their level at import (``VLLM_LOGGING_LEVEL``, ``TRANSFORMERS_VERBOSITY``, torch's C++
``TORCH_CPP_LOG_LEVEL``), so actors get ``library_env`` as environment variables in their runtime env
(``learner.cluster``); the driver calls ``quiet_libraries``, a vLLM engine ``quiet_vllm``.
"""

from __future__ import annotations

import logging
import os
import warnings

LEVEL_ENV = "TETHER_LOG_LEVEL"
LEVELS = ("debug", "info", "warning", "error")
LIBRARY_LOGGERS = ("vllm", "transformers", "deepspeed", "DeepSpeed", "ray", "torch", "accelerate", "datasets",
                   "huggingface_hub", "filelock", "urllib3", "httpx", "wandb", "mlflow", "alembic", "trackio")

# Warnings tether causes and knows to be harmless, by the start of their message. All come from running
# vLLM's CPU build the way tether does (one process per engine, eager, no triton, no tcmalloc/iomp preload).
HARMLESS_VLLM = {
    "vllm.v1.worker.cpu_worker": (
        # single-process mode: the CPU worker replaces torch.set_num_threads in the process it shares with
        # the LLM front end, whose warm-up then calls it four times; the engine's threads stay bound anyway
        "CPU backend doesn't allow to use `torch.set_num_threads`",
        # performance hints for large CPU deployments; the install does not preload these allocators
        "libtcmalloc is not found in LD_PRELOAD",
        "libiomp is not found in LD_PRELOAD",
    ),
    # the engine runs in the actor's own process (VLLM_ENABLE_V1_MULTIPROCESSING=0): the seed is ours; on CPU
    # tether prefills whole prompts (actors/engines.py: a seeded request prefilled in parts fails there),
    # which vLLM warns of for every model outside a short list; tests/test_agents.py checks the log-probs
    # against transformers with it
    "vllm.engine.arg_utils": ("The global random seed is set to",
                              "This model does not officially support disabling chunked prefill"),
    # rollout.enforce_eager (tether's default, for fast starts) and the CPU build without triton
    "vllm.config.vllm": ("Enforce eager set, disabling torch.compile",
                         "Inductor compilation was disabled by user settings",
                         "Model Runner V2 requires Triton"),
    "vllm.platforms.cpu": ("Triton is not installed", "Reset SSM cache type to float32"),
    # a layer with a buffer and no weights (the rotary embedding's cos/sin cache, computed at start) counts as
    # "not loaded" in vLLM's layerwise reload, which puts the buffer back; the engine checks at every sync
    # that each of its parameters was loaded (actors/vllm_extension.py), so a real miss fails the sync instead
    "vllm.model_executor.model_loader.reload.layerwise": ("RotaryEmbedding: Failed to load weights",),
    # learner.lora's adapter-only sync: each version's adapter carries no tokenizer, so the base model's is
    # the one
    "vllm.v1.engine.input_processor": ("vLLM has deprecated support for supporting different tokenizers",),
    # an engine in 16 bits (learner.dtype bfloat16, a judge at dtype auto) loading a float32 checkpoint or
    # sync: the cast tether asked for, which vLLM warns of once per weight (122 lines for SmolLM2)
    "vllm.model_executor.models.utils": ("Attempted to load weight",),
}
HARMLESS_PYTHON_WARNINGS = (
    # vLLM's triton dispatcher touches a deprecated torch alias at import
    (FutureWarning, r"`torch\.distributed\.reduce_op` is deprecated"),
)
# torch without triton (the install removes it: vLLM on CPU needs none) says so once per engine; a process
# without DS_ACCELERATOR that builds a transformers model (the driver training the SFT warm start) imports
# DeepSpeed through transformers and accelerate, which says it picked the CPU
HARMLESS_LOGGED = (("torch._library.triton", "Triton not available"),
                   ("DeepSpeed", "Setting accelerator to CPU"))


def level_now() -> str:
    return os.environ.get(LEVEL_ENV, "warning").lower()


def verbose(level: str | None = None) -> bool:
    """True at debug or info: every library line, progress bars and the known harmless warnings."""
    return (level or level_now()) in ("debug", "info")


def library_env(level: str) -> dict[str, str]:
    """Environment that sets each library's level before it is imported (tether's actors get it)."""
    env = {LEVEL_ENV: level, "VLLM_LOGGING_LEVEL": level.upper(), "TRANSFORMERS_VERBOSITY": level}
    if not verbose(level):
        env["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"  # transformers' "Loading weights" / "Writing model shards"
        # torch's C++ warnings: the one line is vLLM's NUMA memory binding on CPU, once per engine
        env["TORCH_CPP_LOG_LEVEL"] = "ERROR"
    return env


class DropHarmless(logging.Filter):
    """Drops records whose message starts with one of ``prefixes``."""

    def __init__(self, prefixes: tuple[str, ...]) -> None:
        super().__init__()
        self.prefixes = prefixes

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.prefixes)


def _add_filter(target: logging.Logger | logging.Handler, prefixes: tuple[str, ...]) -> None:
    if not any(isinstance(f, DropHarmless) for f in target.filters):
        target.addFilter(DropHarmless(prefixes))


def ignore_harmless_warnings() -> None:
    for category, message in HARMLESS_PYTHON_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category)
    for name, prefix in HARMLESS_LOGGED:
        _add_filter(logging.getLogger(name), (prefix,))


def quiet_libraries(level: str | None = None) -> str:
    """This process (the driver): the libraries' loggers at ``level`` (default ``TETHER_LOG_LEVEL``, else
    warning), and below info no progress bars and none of the known harmless warnings. Returns the level."""
    level = (level or level_now()).lower()
    numeric = getattr(logging, level.upper())
    for name in LIBRARY_LOGGERS:
        logging.getLogger(name).setLevel(numeric)
    try:  # transformers keeps its own verbosity and progress-bar switch beside the logger's level
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity(numeric)
        if not verbose(level):
            hf_logging.disable_progress_bar()
    except ImportError:
        pass
    if not verbose(level):
        ignore_harmless_warnings()
    return level


def quiet_vllm() -> None:
    """Before a vLLM engine starts in this process: drop the known harmless warnings from vLLM's log
    (its level comes from VLLM_LOGGING_LEVEL). Filters sit on the loggers that emit them, which vLLM's
    own logging set-up (a dictConfig at engine start) leaves alone. Nothing at debug or info."""
    if verbose():
        return
    ignore_harmless_warnings()
    for name, prefixes in HARMLESS_VLLM.items():
        _add_filter(logging.getLogger(name), prefixes)
