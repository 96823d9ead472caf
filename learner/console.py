"""What the console shows: tether's own ``[tether]`` lines first. The engines' and libraries' logging (vLLM,
transformers, DeepSpeed, Ray, torch) is at ``metrics.log_level``, WARNING by default, in the driver and in
every actor; ``--log-level debug`` brings it all back, with the warnings tether knows to be harmless.

Libraries read some of this at import (``VLLM_LOGGING_LEVEL``, ``TRANSFORMERS_VERBOSITY``), so actors get
it as environment variables (``learner.cluster`` puts ``library_env`` in every actor's runtime env) and
call ``quiet_libraries`` when they start.
"""

from __future__ import annotations

import logging
import os
import warnings

LEVEL_ENV = "TETHER_LOG_LEVEL"
LIBRARY_LOGGERS = ("vllm", "transformers", "deepspeed", "DeepSpeed", "ray", "torch", "accelerate", "datasets",
                   "huggingface_hub", "filelock", "urllib3", "httpx", "wandb")

# Warnings tether causes and knows to be harmless: (logger or None for the warnings module, message start)
HARMLESS = (
    # vLLM's CPU worker replaces torch.set_num_threads and warns at each later call; its own startup
    # calls it again (the engine runs in the actor's process), and the actor keeps Ray's thread count
    ("vllm", "CPU backend doesn't allow to use `torch.set_num_threads`"),
)


def library_env(level: str) -> dict[str, str]:
    """Environment that sets each library's level before it is imported (per actor, and in the driver)."""
    return {LEVEL_ENV: level, "VLLM_LOGGING_LEVEL": level.upper(), "TRANSFORMERS_VERBOSITY": level,
            # Ray's own INFO lines in workers ("Task ... started") stay in Ray's log files
            "RAY_LOG_TO_STDERR": os.environ.get("RAY_LOG_TO_STDERR", "0")}


class _DropHarmless(logging.Filter):
    def __init__(self, prefixes: tuple[str, ...]) -> None:
        super().__init__()
        self.prefixes = prefixes

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.prefixes)


def quiet_libraries(level: str | None = None) -> str:
    """Set the libraries' loggers in this process to ``level`` (default: ``TETHER_LOG_LEVEL``, else
    warning) and, below debug, drop the known harmless warnings. Returns the level used."""
    level = (level or os.environ.get(LEVEL_ENV) or "warning").lower()
    numeric = getattr(logging, level.upper())
    for name in LIBRARY_LOGGERS:
        logging.getLogger(name).setLevel(numeric)
    try:  # transformers keeps its own verbosity beside the logger's level
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity(numeric)
    except ImportError:
        pass
    if level != "debug":
        for logger_name, prefix in HARMLESS:
            logger = logging.getLogger(logger_name)
            if not any(isinstance(f, _DropHarmless) for f in logger.filters):
                logger.addFilter(_DropHarmless(tuple(p for n, p in HARMLESS if n == logger_name)))
        warnings.filterwarnings("ignore", category=FutureWarning, module="transformers")
    return level
