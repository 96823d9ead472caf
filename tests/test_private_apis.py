"""The private names of Ray, DeepSpeed and CPython that tether uses, all in ``services.private_api``: each
still exists and behaves as the guarded function expects on the installed versions, and each function takes
the public path, and still works, when the version is outside the range it was verified on or the name is
gone. No test starts a Ray cluster in this process; the one that needs one starts it in a subprocess."""

from __future__ import annotations

import inspect
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from services import private_api
from services.private_api import MISSING, PRIVATE_APIS, lookup, verified

ROOT = Path(__file__).resolve().parents[1]
RAY_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled",
           "RAY_USAGE_STATS_ENABLED": "0"}


def outside(range_: str) -> str:
    """A version just above a verified range's upper bound ("<2.61" -> "2.61.0")."""
    upper = re.search(r"<\s*([0-9.]+)", range_)
    assert upper, f"{range_!r} has no upper bound"
    return upper.group(1) + ".0"


# ================================================================================== the table and the names


@pytest.mark.parametrize("name", sorted(PRIVATE_APIS))
def test_each_private_name_exists_on_the_installed_version_which_is_the_verified_one(name):
    use = PRIVATE_APIS[name]
    installed = f"{use.package} {private_api.installed_version(use.package)}"
    assert lookup(name) is not MISSING, \
        f"{name} is gone from {installed}: {use.used_by} takes the public path and loses {use.saves}"
    assert verified(name), f"{installed} is outside {use.verified}"
    assert callable(getattr(private_api, use.used_by))


def test_lookup_names_missing_modules_and_attributes():
    assert lookup("ray._private.services.get_node") is not MISSING
    assert lookup("ray._private.services.no_such_function") is MISSING
    assert lookup("no_such_package.anything") is MISSING


def test_pyproject_caps_ray_and_deepspeed_at_the_versions_verified():
    import tomllib

    from packaging.requirements import Requirement
    from packaging.specifiers import SpecifierSet

    lines = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    requirements = {Requirement(line).name: Requirement(line).specifier for line in lines}
    for package, range_ in (("ray", private_api.RAY_VERIFIED), ("deepspeed", private_api.DEEPSPEED_VERIFIED)):
        uppers = {spec for spec in SpecifierSet(range_) if spec.operator == "<"}
        assert uppers and uppers <= set(requirements[package]), (package, requirements[package], range_)


def test_no_module_of_tether_touches_a_private_name_but_private_api():
    """learner/, actors/ and services/: Ray's ``_private`` and ``_raylet``, DeepSpeed's ``__compatible_ops__``
    and CPython's ``atexit._run_exitfuncs`` appear in services/private_api.py alone."""
    private = re.compile(r"\bray\._private\b|\bray\._raylet\b|\b_raylet\b|__compatible_ops__|_run_exitfuncs"
                         r"|\b_global_node\b")
    found = [f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
             for top in ("learner", "actors", "services") for path in sorted((ROOT / top).rglob("*.py"))
             if path != ROOT / "services" / "private_api.py"
             for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
             if private.search(line)]
    assert not found, "private names outside services/private_api.py:\n" + "\n".join(found)


# ============================================================================= Ray: the job config's variable


def test_the_job_config_variable_is_the_one_ray_sets_and_reads(monkeypatch):
    """Where Ray still has its private constant, it equals tether's spelling; either way Ray's job supervisor,
    which sets the variable for a submitted job's driver, still names it."""
    from importlib.util import find_spec

    for name, spelled in private_api.PUBLIC_SPELLINGS.items():
        ray_s = lookup(name)
        assert ray_s is MISSING or ray_s == spelled, (name, ray_s, spelled)
    supervisor = Path(find_spec("ray.dashboard.modules.job.job_supervisor").origin)
    assert "RAY_JOB_CONFIG_JSON_ENV_VAR" in supervisor.read_text(encoding="utf-8")

    from learner.cluster import in_submitted_job

    monkeypatch.delenv(private_api.RAY_JOB_CONFIG_ENV_VAR, raising=False)
    assert not in_submitted_job()
    monkeypatch.setenv(private_api.RAY_JOB_CONFIG_ENV_VAR, "{}")
    assert in_submitted_job()


# ================================================================================= Ray: the raylet's wait


def test_ray_waits_for_its_raylet_through_services_get_node_with_the_signature_the_poll_takes():
    """The poll replaces ``services.get_node``: Ray's start must still call it by that name, and the GCS
    client must still list nodes by id with a timeout."""
    from ray._private import node, services
    from ray._raylet import GcsClient, InnerGcsClient

    assert list(inspect.signature(services.get_node).parameters) == ["gcs_address", "node_id"]
    assert "ray._private.services.get_node(" in inspect.getsource(node.Node.__init__)
    assert "timeout" in inspect.signature(InnerGcsClient.get_all_node_info).parameters
    assert hasattr(GcsClient, "__getattr__")  # the client forwards get_all_node_info to its inner client


def test_the_poll_replaces_ray_s_wait_inside_the_block_alone():
    from ray._private import services

    ray_get_node = services.get_node
    with pytest.raises(RuntimeError, match="inside"), private_api.raylet_wait_by_polling() as wait:
        assert wait.patched and services.get_node is not ray_get_node
        raise RuntimeError("inside")
    assert services.get_node is ray_get_node


@pytest.mark.parametrize("why", ["version", "name"])
def test_outside_its_range_or_without_get_node_ray_waits_as_it_would(monkeypatch, why):
    import ray
    from ray._private import services

    if why == "version":
        monkeypatch.setattr(ray, "__version__", outside(private_api.RAY_VERIFIED))
        ray_get_node = services.get_node
    else:
        monkeypatch.delattr(services, "get_node")
        ray_get_node = None
    with private_api.raylet_wait_by_polling() as wait:
        assert not wait.patched
        assert getattr(services, "get_node", None) is ray_get_node
    assert getattr(services, "get_node", None) is ray_get_node


# ============================================================================= Ray: the autoscaler monitor


class FakeProcess:
    def __init__(self) -> None:
        self.calls: list[str] = []

    def kill(self) -> None:
        self.calls.append("kill")

    def wait(self) -> int:
        self.calls.append("wait")
        return -9


class FakeInfo:
    def __init__(self) -> None:
        self.process = FakeProcess()


def test_ray_s_node_keeps_its_monitor_process_where_the_stop_looks():
    from ray._private import node, ray_constants, worker

    assert isinstance(ray_constants.PROCESS_TYPE_MONITOR, str)
    assert "ray_constants.PROCESS_TYPE_MONITOR" in inspect.getsource(node.Node.start_monitor)
    assert "self.all_processes" in inspect.getsource(node.Node.__init__)
    assert hasattr(worker, "_global_node")


@pytest.mark.parametrize("version", ["installed", "outside"])
def test_the_monitor_is_ended_in_range_and_left_to_ray_shutdown_outside(monkeypatch, version):
    import ray
    from ray._private import ray_constants, worker

    if version == "outside":
        monkeypatch.setattr(ray, "__version__", outside(private_api.RAY_VERIFIED))
    monitor, raylet = FakeInfo(), FakeInfo()
    fake_node = type("FakeNode", (), {})()
    fake_node.all_processes = {ray_constants.PROCESS_TYPE_MONITOR: [monitor],
                               ray_constants.PROCESS_TYPE_RAYLET: [raylet]}
    monkeypatch.setattr(worker, "_global_node", fake_node)
    stopped = private_api.stop_local_autoscaler_monitor()
    assert (stopped, monitor.process.calls) == ((1, ["kill", "wait"]) if version == "installed" else (0, []))
    assert raylet.process.calls == []
    monkeypatch.setattr(worker, "_global_node", None)  # not connected: nothing to end
    assert private_api.stop_local_autoscaler_monitor() == 0


def test_without_ray_s_global_node_the_stop_leaves_the_monitor_to_ray_shutdown(monkeypatch):
    from ray._private import worker

    monkeypatch.delattr(worker, "_global_node")
    assert private_api.stop_local_autoscaler_monitor() == 0


LOCAL_RAY = """
import json, ray
from ray._private import ray_constants, worker
from services import private_api

with private_api.raylet_wait_by_polling() as wait:
    ray.init(address="local", num_cpus=1, object_store_memory=80 << 20, include_dashboard=False,
             _node_ip_address="127.0.0.1", logging_level="WARNING",
             _system_config={"enable_worker_prestart": False, "prestart_worker_first_driver": False})
monitors = [info.process for info in worker._global_node.all_processes[ray_constants.PROCESS_TYPE_MONITOR]]
alive_nodes = sum(node["Alive"] for node in ray.nodes())
out = {"patched": wait.patched, "found": wait.found, "alive_nodes": alive_nodes,
       "monitor_running": [p.poll() is None for p in monitors]}
out["stopped"] = private_api.stop_local_autoscaler_monitor()
out["monitor_running_after_stop"] = [p.poll() is None for p in monitors]
ray.shutdown()
out["initialized_after_shutdown"] = ray.is_initialized()
print(json.dumps(out))
"""


def test_a_local_ray_starts_through_the_poll_and_stops_after_its_monitor_is_ended():
    """The one Ray start of this module, in a subprocess: the poll finds the raylet (a poll that failed
    would end in Ray's own wait without a word), and the monitor Ray started is ended before ray.shutdown.
    Outside the range both leave Ray to its own code (the tests above), which needs no start here."""
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(LOCAL_RAY)], cwd=ROOT,  # noqa: PLW1510
                          capture_output=True, text=True, timeout=180,
                          env={**os.environ, **RAY_ENV, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {
        "patched": True, "found": True, "alive_nodes": 1, "monitor_running": [True], "stopped": 1,
        "monitor_running_after_stop": [False], "initialized_after_shutdown": False}


# ================================================================================= DeepSpeed: shm_comm


class Building(Exception):
    pass


def deepspeed_comm_torch():
    """The module ``deepspeed.comm.torch`` (``import deepspeed.comm.torch as m`` gives torch: the package's
    attribute ``torch`` is torch itself)."""
    import importlib

    return importlib.import_module("deepspeed.comm.torch")


@pytest.fixture
def shm_comm_on_cpu(monkeypatch):
    """``deepspeed.comm.torch.build_shm_op`` as a CPU rank runs it (the CPU accelerator), with the op marked
    compatible as DeepSpeed's probe marks it on Linux; a build raises ``Building`` instead of taking ~40 s.
    The op's entry is restored afterwards."""
    import deepspeed.ops
    from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator
    from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder

    ds_torch = deepspeed_comm_torch()

    def load(self, verbose=False):
        raise Building(self.name)

    assert ShareMemCommBuilder.NAME == private_api.SHM_COMM_OP
    monkeypatch.setattr(ds_torch, "get_accelerator", CPU_Accelerator)
    monkeypatch.setattr(ShareMemCommBuilder, "load", load)
    monkeypatch.setitem(deepspeed.ops.__compatible_ops__, private_api.SHM_COMM_OP, True)
    return ds_torch.build_shm_op


def test_without_the_skip_deepspeed_builds_shm_comm_and_with_it_not(shm_comm_on_cpu):
    with pytest.raises(Building, match=private_api.SHM_COMM_OP):
        shm_comm_on_cpu()
    assert private_api.skip_unused_deepspeed_ops() is True
    assert shm_comm_on_cpu() is None


def test_deepspeed_s_init_distributed_builds_shm_comm_through_build_shm_op():
    ds_torch = deepspeed_comm_torch()

    assert "build_shm_op()" in inspect.getsource(ds_torch.TorchBackend.__init__)
    assert "__compatible_ops__" in inspect.getsource(ds_torch.build_shm_op)


@pytest.mark.parametrize("why", ["version", "entry"])
def test_outside_its_range_or_without_the_entry_deepspeed_builds_as_it_would(shm_comm_on_cpu, monkeypatch,
                                                                              why):
    import deepspeed
    import deepspeed.ops

    if why == "version":
        monkeypatch.setattr(deepspeed, "__version__", outside(private_api.DEEPSPEED_VERIFIED))
        assert private_api.skip_unused_deepspeed_ops() is False
        assert deepspeed.ops.__compatible_ops__[private_api.SHM_COMM_OP] is True
        with pytest.raises(Building):  # the public path: DeepSpeed's own init_distributed builds the op
            shm_comm_on_cpu()
    else:
        monkeypatch.delitem(deepspeed.ops.__compatible_ops__, private_api.SHM_COMM_OP)
        assert private_api.skip_unused_deepspeed_ops() is False
        assert private_api.SHM_COMM_OP not in deepspeed.ops.__compatible_ops__


# ================================================================================= CPython: the exit

EXIT = """
import atexit, platform, sys
from services import private_api

class Teardown:
    def __del__(self):
        sys.stdout.write("teardown\\n")
        sys.stdout.flush()

marker = Teardown()  # its __del__ runs in Python's teardown of __main__
atexit.register(print, "atexit handler", flush=True)
if WHY == "version":
    platform.python_version = lambda: OUTSIDE
elif WHY == "name":
    del atexit._run_exitfuncs
print("exiting", flush=True)
private_api.exit_skipping_teardown(CODE)
print("after the exit", flush=True)
"""


@pytest.mark.parametrize("why", ["installed", "version", "name"])
def test_the_exit_runs_the_atexit_handlers_and_skips_the_teardown_only_where_verified(why):
    python = outside(private_api.PYTHON_VERIFIED)
    script = f"WHY, OUTSIDE, CODE = {why!r}, {python!r}, 3\n" + textwrap.dedent(EXIT)
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True,  # noqa: PLW1510
                          text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 3, done.stderr
    teardown = [] if why == "installed" else ["teardown"]
    assert done.stdout.splitlines() == ["exiting", "atexit handler", *teardown], done.stderr


def test_atexit_run_exitfuncs_runs_each_handler_once_and_clears_them():
    """In a subprocess: the handlers of this process (pytest's, Ray's) must not run here."""
    code = ("import atexit; ran = []; atexit.register(ran.append, 1); atexit._run_exitfuncs(); "
            "atexit._run_exitfuncs(); print(ran, atexit._ncallbacks())")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          check=True)
    assert done.stdout.split() == ["[1]", "0"], done.stdout
