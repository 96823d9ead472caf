"""The job as an operator runs it: `deploy/local-cluster.sh up`, then `ray job submit` to the head's
dashboard, then `deploy/local-cluster.sh down`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import RAY_ENV, free_port

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "deploy" / "local-cluster.sh"
RAY_CLI = str(Path(sys.executable).parent / "ray")
TERMINAL = {"SUCCEEDED", "FAILED", "STOPPED"}
JOB_TIMEOUT_S = 480


@dataclass
class Cluster:
    state_dir: Path
    env: dict[str, str]
    ray_address: str
    dashboard: str
    metrics: str

    def state(self) -> dict[str, str]:
        return parse_lines((self.state_dir / "state.env").read_text())


def parse_lines(text: str) -> dict[str, str]:
    """KEY=value lines (the script's addresses on stdout, or its state file)."""
    return dict(line.split("=", 1) for line in text.splitlines() if "=" in line and not line.startswith(" "))


def script(command: str, env: dict[str, str], timeout_s: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([str(SCRIPT), command], check=False, cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout_s)


def cluster_env(state_dir: Path, ports: tuple[int, int, int]) -> dict[str, str]:
    ray_port, dashboard_port, metrics_port = ports
    return {**os.environ, **RAY_ENV, "TETHER_CLUSTER_DIR": str(state_dir), "TETHER_UP_TIMEOUT": "180",
            "TETHER_RAY_PORT": str(ray_port), "TETHER_DASHBOARD_PORT": str(dashboard_port),
            "TETHER_METRICS_PORT": str(metrics_port)}


def env_ports() -> tuple[int, int, int]:
    """Ports from TETHER_RAY_PORT / TETHER_DASHBOARD_PORT / TETHER_METRICS_PORT where set, else free ones."""
    names = ("TETHER_RAY_PORT", "TETHER_DASHBOARD_PORT", "TETHER_METRICS_PORT")
    return tuple(int(os.environ[n]) if os.environ.get(n) else free_port()
                 for n in names)  # type: ignore[return-value]


# Ray picks the ports of its other components at random and refuses to start when it picks one of ours
PORT_TAKEN = "that is used by other components"


def up(state_dir: Path, ports: tuple[int, int, int], fresh_ports=None) -> Cluster:
    """`local-cluster.sh up` on ``ports``; once more on ``fresh_ports()`` (if given) after a port
    collision."""
    env = cluster_env(state_dir, ports)
    proc = script("up", env)
    if proc.returncode != 0 and PORT_TAKEN in proc.stderr and fresh_ports is not None:
        script("down", env)
        return up(state_dir, fresh_ports())
    if proc.returncode != 0:
        script("down", env)
        pytest.fail(f"local-cluster.sh up exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}")
    out = parse_lines(proc.stdout)
    return Cluster(state_dir, env, out["RAY_ADDRESS"], out["DASHBOARD"], out["METRICS"])


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """The module's cluster, on its own state dir and ports. Its `down` is checked as a test would: it leaves
    no process of the head's group, removes the temp dir and the state, and `down` again is a no-op (a failure
    here is reported as the last test's teardown error)."""
    state_dir = tmp_path_factory.mktemp("cluster-state")
    started = None
    try:
        started = up(state_dir, env_ports(), fresh_ports=env_ports)
        yield started
    finally:
        env = started.env if started else cluster_env(state_dir, env_ports())
        state = started.state() if started else {}
        proc = script("down", env)
        assert proc.returncode == 0, proc.stdout + proc.stderr
    pid, pgid, temp_dir = int(state["PID"]), int(state["PGID"]), Path(state["TEMP_DIR"])
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    with pytest.raises(ProcessLookupError):
        os.killpg(pgid, 0)
    assert not temp_dir.exists()
    assert not (state_dir / "state.env").exists()
    noop = script("down", env)
    assert noop.returncode == 0 and "not up" in noop.stderr, noop.stdout + noop.stderr
    status = script("status", env)
    assert status.returncode == 0 and "status: down" in status.stdout


@pytest.fixture(scope="module")
def client(cluster):
    from ray.job_submission import JobSubmissionClient

    return JobSubmissionClient(cluster.dashboard)


def wait_terminal(client, job_id: str, timeout_s: float = JOB_TIMEOUT_S) -> str:
    deadline = time.monotonic() + timeout_s
    while True:
        status = str(client.get_job_status(job_id).value)
        if status in TERMINAL:
            return status
        if time.monotonic() > deadline:
            client.stop_job(job_id)
            logs = client.get_job_logs(job_id)
            pytest.fail(f"job {job_id} still {status} after {timeout_s:.0f}s; log tail:\n{logs[-4000:]}")
        time.sleep(2)


def test_invalid_config_fails_with_message(cluster, client, tmp_path):
    """A config the validator rejects ends the job FAILED, and its log names the bad field."""
    job_id = client.submit_job(
        entrypoint="python -m learner.main --config tests/configs/small.yaml --kl.target -1 "
                   f"--run.output_dir {tmp_path / 'runs'}",
        runtime_env={"working_dir": str(ROOT)},
        submission_id=f"tether-invalid-{uuid.uuid4().hex[:8]}",
    )
    status = wait_terminal(client, job_id, timeout_s=180)
    logs = client.get_job_logs(job_id)
    assert status == "FAILED", f"job ended {status}; log tail:\n{logs[-4000:]}"
    assert "[tether] invalid config" in logs and "kl.target" in logs, logs[-4000:]
    assert "greater than 0" in logs, logs[-4000:]
    assert not (tmp_path / "runs").exists()  # rejected before anything was written


def test_up_again_is_a_no_op_on_the_same_head(cluster):
    """The addresses `up` printed are the ports asked for; the head is its own process group with a short temp
    dir; `up` again gives the same head; `status` says up. (`down`: the ``cluster`` fixture's teardown.)"""
    ports = tuple(int(cluster.env[n])
                  for n in ("TETHER_RAY_PORT", "TETHER_DASHBOARD_PORT", "TETHER_METRICS_PORT"))
    assert cluster.ray_address == f"127.0.0.1:{ports[0]}"
    assert cluster.dashboard == f"http://127.0.0.1:{ports[1]}"
    assert cluster.metrics == f"http://127.0.0.1:{ports[2]}/metrics"
    state = cluster.state()
    pid, pgid, temp_dir = int(state["PID"]), int(state["PGID"]), Path(state["TEMP_DIR"])
    assert pid == pgid and os.getpgid(pid) == pgid
    assert temp_dir.is_dir() and len(str(temp_dir)) < 20

    with urllib.request.urlopen(cluster.metrics, timeout=10) as response:
        assert response.status == 200

    again = script("up", cluster.env)
    assert again.returncode == 0, again.stdout + again.stderr
    assert parse_lines(again.stdout)["RAY_ADDRESS"] == cluster.ray_address
    assert "already up" in again.stderr
    assert int(cluster.state()["PID"]) == pid

    status = script("status", cluster.env)
    assert status.returncode == 0 and "status: up" in status.stdout, status.stdout + status.stderr


def test_submitted_job_succeeds_and_its_runtime_env_reaches_the_actors(cluster, client, cache_dir, tmp_path):
    """`ray job submit --working-dir . --runtime-env-json '{"env_vars": ...}'` runs the small config to the
    end and the driver logs its summary (one submitted job serves both checks). The driver keeps the job's
    runtime env (Ray refuses a second one from ray.init), the job succeeds, and its reward actors see both the
    job's variables and tether's per-actor ones (the task's reward raises otherwise)."""
    from tests.env_task import JOB_ENV, RUN_NAME

    job_id = f"tether-env-{uuid.uuid4().hex[:8]}"
    out = tmp_path / "runs"
    cmd = [RAY_CLI, "job", "submit", "--address", cluster.dashboard, "--submission-id", job_id,
           "--working-dir", ".", "--runtime-env-json", json.dumps({"env_vars": JOB_ENV}), "--no-wait", "--",
           "python", "-m", "learner.main", "--config", "tests/configs/small.yaml", "--task.name",
           "tests.env_task:JobEnvTask", "--run.name", RUN_NAME, "--run.iterations", "1",
           "--cluster.placement_timeout_s", "300",
           "--model.cache_dir", os.path.abspath(cache_dir), "--run.output_dir", str(out)]
    proc = subprocess.run(cmd, check=False, cwd=ROOT, env=cluster.env, capture_output=True,
                          text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr

    status = wait_terminal(client, job_id)
    logs = client.get_job_logs(job_id)
    assert status == "SUCCEEDED", f"job ended {status}; log tail:\n{logs[-4000:]}"
    assert "Failed to merge the Job's runtime env" not in logs
    # what `ray job logs` shows a person: the run directory, the progress lines and the summary
    assert f"[tether] run directory {out / RUN_NAME}" in logs, logs[-4000:]
    assert "[tether] iter 1/1 | reward" in logs and "[tether] summary:" in logs, logs[-4000:]
    assert client.get_job_info(job_id).runtime_env["env_vars"] == JOB_ENV
    assert (out / RUN_NAME / "summary.json").is_file()
