"""The one place tether touches a private name of Ray, DeepSpeed or CPython (``atexit``).

Each use is a small function here, guarded twice: the installed version must lie in the range the use was
verified on (``PRIVATE_APIS``), and the private name must still exist (``lookup``). Otherwise the function
takes the public path: Ray's own wait for its raylet in ``ray.init``, a plain ``ray.shutdown``, a normal
``sys.exit``, DeepSpeed's own ``init_distributed`` (which then builds its shared-memory op).
tests/test_private_apis.py fails when a name disappears or behaves differently on the installed versions;
pyproject.toml caps Ray and DeepSpeed at the versions verified here. To take a newer release: run those tests
on it, measure the saving again (the numbers are in each function's docstring), then widen the range.

Nothing here imports Ray or DeepSpeed at module level: ``learner.main`` calls ``exit_skipping_teardown``.
"""

from __future__ import annotations

import importlib
import logging
import os
import platform
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from typing import NoReturn

logger = logging.getLogger(__name__)

# ``ray job submit`` hands the job's config (runtime env, metadata) to its driver in this environment
# variable. Ray names it in ``ray._private.runtime_env.constants.RAY_JOB_CONFIG_JSON_ENV_VAR`` alone (no
# public constant), so tether spells the value; tests/test_private_apis.py checks that Ray's still equals it.
RAY_JOB_CONFIG_ENV_VAR = "RAY_JOB_CONFIG_JSON_ENV_VAR"
PUBLIC_SPELLINGS = {"ray._private.runtime_env.constants.RAY_JOB_CONFIG_JSON_ENV_VAR": RAY_JOB_CONFIG_ENV_VAR}

RAY_VERIFIED = ">=2.60,<2.61"
DEEPSPEED_VERIFIED = ">=0.19.8,<0.19.9"
# atexit._run_exitfuncs runs the handlers once and clears them on 3.10.13, 3.11.7, 3.12.1 and 3.13.0
PYTHON_VERIFIED = ">=3.11,<3.14"


@dataclass(frozen=True)
class PrivateUse:
    package: str  # whose version guards the use: "ray", "deepspeed" or "python"
    verified: str  # the versions it was verified on, a PEP 440 specifier set
    saves: str  # what it saves, as measured (2 CPU cores, no GPU; how: the function's docstring)
    used_by: str  # the function of this module that uses it


PRIVATE_APIS: dict[str, PrivateUse] = {
    "ray._private.services.get_node": PrivateUse(
        "ray", RAY_VERIFIED, "~1.0 s of a local ray.init (median 1.61 s against 2.65 s)",
        "raylet_wait_by_polling"),
    "ray._raylet.GcsClient": PrivateUse(
        "ray", RAY_VERIFIED, "the poll of raylet_wait_by_polling", "raylet_wait_by_polling"),
    "ray._private.worker._global_node": PrivateUse(
        "ray", RAY_VERIFIED, "~0.8 s of a local Ray's ray.shutdown (median 0.34 s against 1.15 s)",
        "stop_local_autoscaler_monitor"),
    "ray._private.ray_constants.PROCESS_TYPE_MONITOR": PrivateUse(
        "ray", RAY_VERIFIED, "the monitor's key in _global_node.all_processes",
        "stop_local_autoscaler_monitor"),
    "deepspeed.ops.__compatible_ops__": PrivateUse(
        "deepspeed", DEEPSPEED_VERIFIED, "a JIT build of deepspeed_shm_comm in a CPU rank's init_distributed "
        "(41.9 s against 0.01 s, once per torch extensions cache)", "skip_unused_deepspeed_ops"),
    "atexit._run_exitfuncs": PrivateUse(
        "python", PYTHON_VERIFIED, "~0.24 s of the driver's exit (the teardown of ~5600 modules)",
        "exit_skipping_teardown"),
}

MISSING = object()  # what ``lookup`` returns for a name that does not exist


def lookup(dotted: str) -> object:
    """The object a dotted name names (its longest importable module, then attributes), or ``MISSING``."""
    parts = dotted.split(".")
    for split in range(len(parts), 0, -1):
        try:
            found = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        for attribute in parts[split:]:
            found = getattr(found, attribute, MISSING)
            if found is MISSING:
                return MISSING
        return found
    return MISSING


def installed_version(package: str) -> str:
    """The running Python's version for "python", else the package's ``__version__``, read at each call."""
    if package == "python":
        return platform.python_version()
    return str(getattr(importlib.import_module(package), "__version__", ""))


_fallbacks_logged: set[str] = set()


def verified(name: str) -> bool:
    """The installed version of the package behind ``PRIVATE_APIS[name]`` is in the use's verified range, and
    the name exists. Where not, the function that uses it takes the public path, logged once per name."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version

    use = PRIVATE_APIS[name]
    version = installed_version(use.package)
    try:
        in_range = SpecifierSet(use.verified).contains(Version(version), prereleases=True)
    except InvalidVersion:
        in_range = False
    if not in_range:
        why = f"{use.package} {version or '?'} is outside {use.verified}"
    elif lookup(name) is MISSING:
        why = f"{name} does not exist in {use.package} {version}"
    else:
        return True
    if name not in _fallbacks_logged:
        _fallbacks_logged.add(name)
        logger.info("%s takes the public path: %s (it would save %s)", use.used_by, why, use.saves)
    return False


# ------------------------------------------------------------------------------------------------------ Ray


class RayletWait:
    """What ``raylet_wait_by_polling`` did: ``patched`` Ray's wait, and its poll ``found`` the raylet."""

    def __init__(self) -> None:
        self.patched = False
        self.found = False


@contextmanager
def raylet_wait_by_polling() -> Iterator[RayletWait]:
    """Around a ``ray.init`` that starts a local Ray: the wait for the raylet it starts, checked every 50 ms.
    Ray waits in C++ (``GlobalStateAccessor::GetNode``), which asks the GCS once a second; the raylet
    registers 0.6-1.6 s after it starts, so Ray's start ends up to a second after it was up. Ray's own call
    follows the poll and returns at once. Measured: 8 fresh processes each, alternating, 2 cores,
    ``ray.init(num_cpus=2, include_dashboard=False)``: 1.51-3.20 s, median 1.61 s polled; 1.94-3.27 s,
    median 2.65 s not.

    Replaces Ray's private ``services.get_node`` inside the block alone (restored after it, on an error too).
    Public path, Ray's own wait: Ray outside ``RAY_VERIFIED``, or ``get_node`` or ``GcsClient`` missing. A
    poll that fails (the GCS does not answer, the client changed) ends in Ray's own wait too."""
    wait = RayletWait()
    if not (verified("ray._private.services.get_node") and verified("ray._raylet.GcsClient")):
        yield wait
        return
    from ray._private import services
    from ray._raylet import GcsClient

    ray_get_node = services.get_node

    def get_node(gcs_address: str, node_id: str):
        with suppress(Exception):  # Ray's own wait below reports what is wrong
            gcs, deadline = GcsClient(address=gcs_address), time.monotonic() + 30
            while time.monotonic() < deadline:
                if any(found.hex() == node_id for found in gcs.get_all_node_info(timeout=5)):
                    wait.found = True
                    break
                time.sleep(0.05)
        return ray_get_node(gcs_address, node_id)

    services.get_node = get_node
    wait.patched = True
    try:
        yield wait
    finally:
        services.get_node = ray_get_node


def stop_local_autoscaler_monitor() -> int:
    """Just before ``ray.shutdown`` of a Ray this process started: ends its autoscaler monitor at once, and
    returns how many monitor processes it ended. ``ray.shutdown`` stops the GCS before the monitor, whose
    SIGTERM handler then blocks on its report to that GCS until Ray kills it a second later. On one node the
    monitor holds nothing the job needs. Measured (the same runs as ``raylet_wait_by_polling``): ray.shutdown
    0.09-0.69 s, median 0.34 s after it; 1.10-1.59 s, median 1.15 s without.

    Public path (returns 0; ``ray.shutdown`` stops the monitor itself): Ray outside ``RAY_VERIFIED``, or
    ``ray._private.worker._global_node`` or ``ray_constants.PROCESS_TYPE_MONITOR`` missing."""
    if not (verified("ray._private.worker._global_node")
            and verified("ray._private.ray_constants.PROCESS_TYPE_MONITOR")):
        return 0
    from ray._private import ray_constants, worker

    processes = getattr(worker._global_node, "all_processes", None) or {}
    stopped = 0
    for info in processes.get(ray_constants.PROCESS_TYPE_MONITOR, []):
        info.process.kill()
        info.process.wait()
        stopped += 1
    return stopped


# ------------------------------------------------------------------------------------------------ DeepSpeed

SHM_COMM_OP = "deepspeed_shm_comm"  # deepspeed.ops.op_builder.cpu.ShareMemCommBuilder.NAME


def skip_unused_deepspeed_ops() -> bool:
    """On CPU, before ``deepspeed.init_distributed``: marks DeepSpeed's shared-memory allreduce op
    (``deepspeed_shm_comm``) incompatible, so that ``init_distributed`` does not JIT-build it; gloo, which
    tether's CPU ranks use, never calls it. Returns whether it did. Measured (DeepSpeed 0.19.8, 2 cores, an
    empty torch extensions cache, world size 1, gloo): ``init_distributed`` took 41.9 s with the build, 0.01 s
    after this.

    DeepSpeed 0.19.8 has no public switch for it: ``deepspeed.comm.torch.build_shm_op`` builds the op wherever
    the accelerator has a ``ShareMemCommBuilder`` (the CPU accelerator, on Linux) that
    ``deepspeed.ops.__compatible_ops__`` marks compatible; ``DS_BUILD_SHM_COMM`` acts at install time only,
    and ``init_distributed``'s config sets up the comms logger alone. Public path (returns False; the op is
    built, once per torch extensions cache): DeepSpeed outside ``DEEPSPEED_VERIFIED``, or no
    ``__compatible_ops__`` entry for the op."""
    if not verified("deepspeed.ops.__compatible_ops__"):
        return False
    import deepspeed.ops

    compatible = deepspeed.ops.__compatible_ops__
    if not isinstance(compatible, dict) or SHM_COMM_OP not in compatible:
        return False
    compatible[SHM_COMM_OP] = False
    return True


# -------------------------------------------------------------------------------------------------- CPython


def exit_skipping_teardown(code: int) -> NoReturn:
    """Ends the process with ``code`` once all it keeps is written and closed: the atexit handlers run
    (logging's flush among them), then the process ends without Python's teardown of every module it loaded.
    Measured: from the exit call to the process's end, after a driver's imports (vLLM included, ~5600
    modules) and a local Ray's start and stop, 5 processes each, 2 cores: 0.054-0.060 s, median 0.056 s,
    against 0.278-0.333 s, median 0.296 s with ``sys.exit``.

    Public path, ``sys.exit(code)``: Python outside ``PYTHON_VERIFIED``, or no ``atexit._run_exitfuncs``."""
    if not verified("atexit._run_exitfuncs"):
        sys.exit(code)
    import atexit

    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
