"""A real two-node Ray cluster on this machine: the job runs on a worker node that cannot see the
driver's private directories, as a KubeRay pod would not.

The head listens on 127.0.0.2, the worker on 127.0.0.3 (two Ray nodes on one machine).
The worker runs in its own mount namespace with a tmpfs over ``driver-only/``: the driver's model cache
(which holds the SFT warm start) and a run directory only the driver sees. Every role is placed on
the worker through a custom resource, so every model file an actor opens must reach it through the
object store, and the run storage must be one both nodes share.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import yaml

from tests.conftest import ROOT, free_port

pytestmark = pytest.mark.integration

HEAD_IP, WORKER_IP = "127.0.0.2", "127.0.0.3"
# Ray rewrites 127.0.0.1 to the NIC address once multi-node is allowed, so this cluster lives on 127.0.0.2/3
CLUSTER_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "1", "RAY_AUTH_MODE": "disabled",
               "RAY_USAGE_STATS_ENABLED": "0"}
SMALL = {
    "model": {"sft_steps": 60, "sft_batch_size": 50},
    "rollout": {"batch_size": 32, "chunk_size": 16},
    "ppo": {"minibatch_size": 16},
    "run": {"seed": 1, "eval_every": 100},
    "cluster": {role: {"num_cpus": 0.25, "resources": {"worker": 0.1}}
                for role in ("rollout", "reference", "reward", "learner")},
}


def _node_ports() -> list[str]:
    names = ("node-manager", "object-manager", "runtime-env-agent", "dashboard-agent-grpc",
             "dashboard-agent-listen", "metrics-export")
    named = {name: free_port() for name in names}
    # the workers' range apart from the named ports: Ray refuses a node whose range holds one of them (the OS
    # hands out free ports close together, so a range next to one often did)
    low = free_port() + 100
    while any(low <= port <= low + 60 for port in named.values()):
        low = free_port() + 100
    return [*(f"--{name}-port={port}" for name, port in named.items()),
            f"--min-worker-port={low}", f"--max-worker-port={low + 60}"]


def _can_unshare() -> str | None:
    """None when this machine lets us start a node in its own mount namespace, else the reason."""
    if shutil.which("unshare") is None:
        return "unshare is not installed"
    probe = subprocess.run(["unshare", "--mount", "--propagation", "private", "true"], capture_output=True,
                           text=True, check=False)
    return None if probe.returncode == 0 else f"unshare --mount is not allowed here: {probe.stderr.strip()}"


class TwoNodeCluster:
    """A head (no job resources) and a worker (``worker`` resource) that sees a tmpfs over ``hidden``."""

    def __init__(self, hidden: Path) -> None:
        ray_bin = str(Path(sys.executable).parent / "ray")
        self.temp_dir = tempfile.mkdtemp(prefix="tn-", dir="/tmp")  # short: socket paths stay < 108 chars
        env = {**os.environ, **CLUSTER_ENV}
        self.logs = [open(Path(self.temp_dir) / name, "w")  # noqa: SIM115
                     for name in ("head.log", "worker.log")]
        self.procs: list[subprocess.Popen] = []
        try:
            # a port free_port saw free can be taken by the other pytest worker's Ray before the head binds
            # it; the head then exits, and a second try with fresh ports is the fix
            for attempt in range(3):
                self.port = free_port()
                head = [ray_bin, "start", "--head", "--block", f"--node-ip-address={HEAD_IP}",
                        f"--port={self.port}", "--include-dashboard=false",
                        f"--ray-client-server-port={free_port()}", "--num-cpus=1",
                        f"--object-store-memory={256 << 20}", f"--temp-dir={self.temp_dir}",
                        "--disable-usage-stats", *_node_ports()]
                self.procs = [subprocess.Popen(head, stdout=self.logs[0], stderr=subprocess.STDOUT,
                                               start_new_session=True, env=env)]
                if self._wait_for_head(120):
                    break
                self.logs[0].write(f"\n--- the head exited (try {attempt + 1}); again with fresh ports ---\n")
                self.logs[0].flush()
            else:
                raise RuntimeError("the head node exited three times:\n"
                                   + (Path(self.temp_dir) / "head.log").read_text()[-3000:])
            worker = " ".join([ray_bin, "start", "--block", f"--address={HEAD_IP}:{self.port}",
                               f"--node-ip-address={WORKER_IP}", "--num-cpus=4",
                               "--resources='{\"worker\": 4}'", f"--object-store-memory={512 << 20}",
                               *_node_ports()])
            self.procs.append(subprocess.Popen(
                ["unshare", "--mount", "--propagation", "private", "bash", "-c",
                 f"mount -t tmpfs none {hidden} && exec {worker}"],
                stdout=self.logs[1], stderr=subprocess.STDOUT, start_new_session=True, env=env))
            self._wait_for_worker(90)
        except BaseException:
            self.stop()
            raise

    def _wait_for_head(self, timeout_s: float) -> bool:
        """True once the head's GCS port answers, False if the head exited first; raises on a timeout.

        On a loaded machine `ray start --head` can take a minute.
        """
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if port_answers(HEAD_IP, self.port):
                return True
            if self.procs[0].poll() is not None:
                return False
            time.sleep(0.5)
        self.logs[0].flush()
        raise RuntimeError(f"the head node did not listen on {HEAD_IP}:{self.port} within {timeout_s}s "
                           f"(exit code {self.procs[0].poll()}):\n"
                           + (Path(self.temp_dir) / "head.log").read_text()[-3000:])

    def _wait_for_worker(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            status = subprocess.run([str(Path(sys.executable).parent / "ray"), "status",
                                     f"--address={HEAD_IP}:{self.port}"], capture_output=True, text=True,
                                    env={**os.environ, **CLUSTER_ENV}, check=False)
            if "worker" in status.stdout and status.stdout.count("node_") >= 2:
                return
            if self.procs[1].poll() is not None:
                break
            time.sleep(2)
        raise RuntimeError("the worker node did not join:\n"
                           + (Path(self.temp_dir) / "worker.log").read_text()[-3000:])

    @property
    def address(self) -> str:
        return f"{HEAD_IP}:{self.port}"

    def stop(self) -> None:
        # each node stops by its own process group: ray start and its children
        for proc in reversed(self.procs):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(timeout=5)  # `ray start --block` can take 30 s to exit; its group is ours
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait(timeout=10)
        for log in self.logs:
            log.close()
        shutil.rmtree(self.temp_dir, ignore_errors=True)


def port_answers(host: str, port: int) -> bool:
    import socket

    try:
        with socket.create_connection((host, port), timeout=1):
            return True
    except OSError:
        return False


@pytest.fixture(scope="module")
def two_nodes(tiny_model_dir):
    reason = _can_unshare()
    if reason:
        pytest.skip(reason)
    base = Path(tempfile.mkdtemp(prefix="tether-2n-", dir="/tmp"))
    (base / "driver-only").mkdir()
    # the driver's cache holds the SFT warm start of SMALL's recipe (the session's, copied): the job finds it
    # there, as a driver that trained it before would, and the worker can only get it through the object store
    shutil.copytree(tiny_model_dir, base / "driver-only" / "cache" / "sft" / Path(tiny_model_dir).name)
    (base / "shared").mkdir()
    cluster = TwoNodeCluster(base / "driver-only")
    yield cluster, base
    cluster.stop()
    shutil.rmtree(base, ignore_errors=True)


def run_on(cluster: TwoNodeCluster, base: Path, settings: dict, *args: str, timeout_s: float = 600):
    """``python -m learner.main`` on the two-node cluster, as a user on the head node runs it."""
    config = base / f"job-{time.monotonic_ns()}.yaml"
    merged = json.loads(json.dumps(SMALL))
    for section, values in settings.items():
        merged.setdefault(section, {}).update(values)
    config.write_text(yaml.safe_dump(merged))
    return subprocess.run([sys.executable, "-m", "learner.main", "--config", str(config), "--cluster.address",
                           cluster.address, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout_s, env={**os.environ, **CLUSTER_ENV}, check=False)


def _metrics(run_dir: Path, name: str = "metrics.jsonl") -> list[dict]:
    return [json.loads(line) for line in (run_dir / name).read_text().splitlines()]


def test_default_job_runs_on_the_worker_node_and_resumes_the_same_trajectory(two_nodes):
    cluster, base = two_nodes
    runs = base / "shared" / "runs"
    settings = {"model": {"cache_dir": str(base / "driver-only" / "cache")},
                "run": {"output_dir": str(runs), "name": "two-nodes"}, "checkpoint": {"every": 2}}
    # the libraries' debug lines come with Ray's (ActorClass pid=..., ip=...) prefix: where each actor ran
    first = run_on(cluster, base, settings, "--run.iterations", "3", "--metrics.log_level", "debug")
    out = first.stdout + first.stderr
    assert first.returncode == 0, out[-4000:]
    # every role ran on the worker, which got the driver's SFT model through the object store (cluster.<role>
    # pins each role there, so the reference and the reward keep actors of their own)
    preflight = next(line for line in out.splitlines() if line.startswith("[tether] pre-flight: models"))
    assert preflight.endswith(f"({WORKER_IP}): rollout-0, reference-0, reward-0, learner-0"), preflight
    assert "LearnerRank pid=" in out and f"ip={WORKER_IP}" in out
    assert "object store to node" in out and f"({WORKER_IP})" in out, out[-3000:]
    run_dir = runs / "two-nodes"
    straight = _metrics(run_dir)
    assert [r["iteration"] for r in straight] == [1, 2, 3]
    assert all(r["probe_max_abs_error"] < 1e-4 for r in straight)

    # resume from the iteration-2 checkpoint: iteration 3 again, on the same trajectory
    checkpoint = run_dir / "checkpoints" / "iter-000002"
    resumed = run_on(cluster, base, settings, "--run.iterations", "3", "--run.resume", str(checkpoint))
    assert resumed.returncode == 0, (resumed.stdout + resumed.stderr)[-4000:]
    again = _metrics(run_dir)
    assert [r["iteration"] for r in again] == [1, 2, 3]
    assert _metrics(run_dir, "metrics.discarded.jsonl")[-1]["iteration"] == 3
    for key in ("kl_coef", "prompt_rows", "kl_response_mean", "score_mean", "ppo_loss"):
        assert again[2][key] == pytest.approx(straight[2][key], rel=1e-6, abs=1e-9), key


def test_paths_only_the_driver_sees_fail_at_preflight_naming_node_and_path(two_nodes):
    cluster, base = two_nodes
    hidden = base / "driver-only"
    runs = hidden / "runs"
    private_run = run_on(cluster, base, {"model": {"cache_dir": str(hidden / "cache")},
                                         "run": {"output_dir": str(runs), "name": "private"}},
                         "--run.iterations", "2", timeout_s=300)
    assert private_run.returncode != 0
    assert "pre-flight failed" in private_run.stderr and f"({WORKER_IP})" in private_run.stderr
    assert str(runs / "private") in private_run.stderr, private_run.stderr[-3000:]
    assert not (runs / "private" / "checkpoints").exists()  # nothing sealed, nothing half-written

    # a model.path the worker does not have
    model_dir = next((hidden / "cache" / "sft").iterdir())
    missing_model = run_on(cluster, base, {"model": {"path": str(model_dir)},
                                           "run": {"output_dir": str(base / "shared" / "runs"),
                                                   "name": "nomodel"}},
                           "--run.iterations", "1", timeout_s=300)
    assert missing_model.returncode != 0
    assert "pre-flight failed" in missing_model.stderr and f"({WORKER_IP})" in missing_model.stderr
    assert f"model.path {str(model_dir)!r} is not a directory on this node" in missing_model.stderr, \
        missing_model.stderr[-3000:]
