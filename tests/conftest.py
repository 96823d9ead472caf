"""Shared fixtures: a real single-node Ray head on loopback (stopped by its own process group), and a
tiny SFT-trained randomwalks policy built locally."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

# One OpenMP thread for every process of the suite (the tests, the jobs' drivers, the test heads and their
# actors), unless the environment sets it: two pytest workers share two cores, and a second thread that
# waits on a busy core costs CPU (the SFT warm start under load: 13.8 CPU s at one thread, 20.7 at two).
# Actors with less than one CPU get one thread from Ray anyway; a test that wants more sets torch_threads.
os.environ.setdefault("OMP_NUM_THREADS", "1")

try:
    import learner.cluster  # noqa: F401  its THREAD_ENV (OpenMP) for these processes and the test heads' workers
except ModuleNotFoundError as missing:  # a GPU machine with torch alone: `pytest -m gpu` needs none of it
    CLUSTER_MISSING: str | None = (f"learner.cluster is not importable ({missing}): "
                                   "the tests that need Ray fail")
else:
    CLUSTER_MISSING = None

ROOT = Path(__file__).resolve().parents[1]
RAY_ENV = {
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "RAY_AUTH_MODE": "disabled",
    "RAY_USAGE_STATS_ENABLED": "0",
}
# what test_metrics's head and job add: each process reports its metrics every second, not every ten (in every
# process of the suite it cost about 2.5% of a core for a head and four idle actors)
METRICS_ENV = {"RAY_metrics_report_interval_ms": "1000"}
os.environ.update(RAY_ENV)


def pytest_report_header(config) -> str | None:
    return CLUSTER_MISSING


def pytest_ignore_collect(collection_path: Path, config) -> bool | None:
    """Under ``-m gpu`` exactly, a test module without a GPU mark (no ``mark.gpu`` in its text) is not
    imported: none of its tests would be selected, and on a GPU machine with torch alone (no Ray, vLLM or
    DeepSpeed) most of them cannot even be imported. The GPU modules import with torch alone, and each GPU
    test skips with its reason where something it needs is missing."""
    if config.getoption("markexpr", "").strip() != "gpu" or collection_path.suffix != ".py":
        return None
    if not collection_path.name.startswith("test_"):
        return None
    return "mark.gpu" not in collection_path.read_text(encoding="utf-8", errors="replace") or None


# The slowest modules' seconds on one of two pytest-xdist workers (`make test` on 2 cores, 2026-12-05, sums of
# `--durations=0`), the order `pytest_collection_modifyitems` sends them in: longest first, so that no long
# module starts last while the other worker has nothing left (xdist's own order, most tests first, sent the
# modules of one or two long job tests last). A module not listed counts as quick; the list need not be exact
# to help.
MODULE_SECONDS: dict[str, float] = {
    "test_job.py": 220, "test_agents.py": 180, "test_recipes.py": 150, "test_reliability.py": 120,
    "test_two_nodes.py": 90, "test_job_submit.py": 90, "test_storage.py": 80, "test_pipeline.py": 77,
    "test_async.py": 75, "test_dataset_task.py": 70, "test_cluster_path.py": 60, "test_settings_space.py": 60,
    "test_agent_route.py": 60, "test_advantages.py": 58, "test_accepted_settings.py": 55,
    "test_tracking.py": 55, "test_lora.py": 53, "test_sentiment_task.py": 50, "test_bad_input.py": 40,
    "test_collectives.py": 40, "test_remote_reward.py": 38, "test_dynamic_sampling.py": 38,
    "test_agent_endpoint.py": 28, "test_gpu_tooling.py": 26, "test_metrics.py": 26,
    "test_lm_human_preferences_options.py": 25,
}


def pytest_collection_modifyitems(session, config, items) -> None:
    """Longest modules first (``MODULE_SECONDS``); `make test` keeps this order
    (``--no-loadscope-reorder``)."""
    def seconds(item) -> float:
        return MODULE_SECONDS.get(Path(str(item.fspath)).name, 0.0)

    items.sort(key=seconds, reverse=True)  # stable: a module's tests stay in their order


def may_raise_priority() -> bool:
    """Whether this process may raise its priority (CAP_SYS_NICE or RLIMIT_NICE): one step up, then back."""
    now = os.getpriority(os.PRIO_PROCESS, 0)
    try:
        os.setpriority(os.PRIO_PROCESS, 0, now - 1)
    except PermissionError:
        return False
    os.setpriority(os.PRIO_PROCESS, 0, now)
    return True


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return
        except OSError:
            time.sleep(0.3)
    raise TimeoutError(f"nothing listened on 127.0.0.1:{port} within {timeout_s}s")


class RayHead:
    """`ray start --head --block` as our own child in its own session: stopping it stops only what it started.

    ``dashboard``: the dashboard and the Prometheus endpoint (``metrics_port``), for the tests that read them.
    The session's heads go without: idle, a head with its dashboard took 5.8% of a core, without it 3.1%."""

    def __init__(self, num_cpus: int = 4, object_store_mib: int = 512, dashboard: bool = False,
                 env: dict[str, str] | None = None) -> None:
        self.temp_dir = tempfile.mkdtemp(prefix="tr-", dir="/tmp")  # short: socket paths stay < 108 chars
        self.port, self.dashboard_port, self.metrics_port = free_port(), free_port(), free_port()
        self.dashboard = dashboard
        shown = (["--dashboard-host=127.0.0.1", f"--dashboard-port={self.dashboard_port}",
                  f"--metrics-export-port={self.metrics_port}"] if dashboard
                 else ["--include-dashboard=false"])
        cmd = [
            str(Path(sys.executable).parent / "ray"), "start", "--head", "--block",
            "--node-ip-address=127.0.0.1", f"--port={self.port}", *shown,
            f"--num-cpus={num_cpus}", f"--object-store-memory={object_store_mib << 20}",
            f"--temp-dir={self.temp_dir}", "--disable-usage-stats",
        ]
        self.log = open(Path(self.temp_dir) / "head.log", "w")  # noqa: SIM115 - open while the head runs
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True,
                                     env={**os.environ, **RAY_ENV, **(env or {})})
        try:
            wait_port(self.port, 60)
            if dashboard:
                wait_port(self.dashboard_port, 60)
        except TimeoutError:
            self.stop()
            raise

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def dashboard_url(self) -> str:
        return f"http://127.0.0.1:{self.dashboard_port}"

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)  # the session we created: ray start and its children
            try:
                self.proc.wait(timeout=5)  # `ray start --block` can take 30 s to exit; its group is ours
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
        self.log.close()
        shutil.rmtree(self.temp_dir, ignore_errors=True)


@pytest.fixture(scope="session")
def ray_head():
    head = RayHead()
    yield head
    head.stop()


@pytest.fixture(scope="module")
def ray_client(ray_head):
    """This module's driver connection to the session's head (its actors go when the module ends)."""
    import ray

    ray.init(address=ray_head.address, log_to_driver=False)
    yield ray
    ray.shutdown()


def shared_root(tmp_path_factory) -> Path:
    """A directory every parallel worker of this session sees (pytest-xdist: their base temp dirs share a
    parent)."""
    root = tmp_path_factory.getbasetemp()
    return root.parent if os.environ.get("PYTEST_XDIST_WORKER") else root


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> str:
    """SFT cache shared by the whole session and its parallel workers (``shared_root``), and across sessions
    when TETHER_TEST_CACHE is set. Each model in it is built once, under a file lock
    (``services.models.policy_dir``)."""
    if os.environ.get("TETHER_TEST_CACHE"):
        return os.environ["TETHER_TEST_CACHE"]
    shared = shared_root(tmp_path_factory) / "tether-cache"
    shared.mkdir(exist_ok=True)
    return str(shared)


@pytest.fixture(scope="session")
def tiny_model_dir(cache_dir) -> str:
    """A randomwalks GPT-2 with a short SFT warm start (enough for non-trivial log-probs)."""
    from services.models import policy_dir
    from services.tasks import get_task

    return str(policy_dir(get_task("randomwalks"), None, cache_dir, seed=1, steps=60, batch_size=50, lr=1e-3,
                          log=lambda _: None))


def run_job(args: list[str], timeout_s: float = 900, env: dict | None = None) -> subprocess.CompletedProcess:
    """`python -m learner.main ARGS` as a user runs it (in ``env``, else this process's); returns the finished
    process."""
    return subprocess.run([sys.executable, "-m", "learner.main", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout_s,
                          env={**(os.environ if env is None else env), **RAY_ENV}, check=False)


def start_job(args: list[str]) -> subprocess.Popen:
    """`python -m learner.main ARGS` started, its stdout and stderr one text stream (``follow_job``)."""
    return subprocess.Popen([sys.executable, "-m", "learner.main", *args], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env={**os.environ, **RAY_ENV})


def follow_job(proc: subprocess.Popen, on_line, timeout_s: float = 600) -> str:
    """Feed each output line of a ``start_job`` process to ``on_line`` until it ends; return the whole
    output."""
    out, deadline = [], time.monotonic() + timeout_s
    for line in proc.stdout:
        out.append(line)
        on_line(line)
        assert time.monotonic() < deadline, "job took too long:\n" + "".join(out[-50:])
    proc.wait(timeout=60)
    return "".join(out)


def chunk_refs(rollouts, references=None, scores=None, teachers=None) -> dict:
    """{slot: ``ChunkRefs``} of fixed chunks: each argument a list (slot = position) or a dict by slot of refs
    (a batch or a tensor is put in the object store first); None: the ranks score it, or no teacher."""
    import ray

    from learner.records import ChunkRefs

    def by_slot(refs):
        refs = dict(enumerate(refs)) if isinstance(refs, list | tuple) else refs
        return {slot: ref if isinstance(ref, ray.ObjectRef) else ray.put(ref) for slot, ref in refs.items()}

    rollouts = by_slot(rollouts)
    parts = {name: by_slot(refs) for name, refs in (("reference", references), ("score", scores),
                                                      ("teacher", teachers)) if refs is not None}
    return {slot: ChunkRefs(rollout, **{name: refs[slot] for name, refs in parts.items()})
            for slot, rollout in rollouts.items()}


def train(group, rollouts, references, scores, kl_coef: float, iteration: int, teachers=None):
    """``collect`` then ``update`` of a ``LearnerGroup`` on fixed chunks (``chunk_refs``' arguments); no chunk
    may be lost."""
    lost = group.collect(chunk_refs(rollouts, references, scores, teachers))
    assert not lost, f"chunks {lost} were lost"
    return group.update(kl_coef, iteration)


def run_cli(args: list[str]) -> subprocess.CompletedProcess:
    """``python -m learner.main ARGS`` for a job that must fail before any actor starts: the same ``main()``,
    in this process (a new interpreter would import torch, transformers and Ray again, about 3 CPU s), with
    its output captured; returns what ``run_job`` does. Give such a job an address nothing listens on
    (``--cluster.address 127.0.0.1:1``) where it could get past the plan: it must never start a Ray here."""
    import contextlib
    import io

    from learner.main import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(args))
    return subprocess.CompletedProcess(["learner.main", *args], code, out.getvalue(), err.getvalue())


# The tests' small job: the short SFT warm start, 32 episodes an iteration in chunks of 16
SMALL = ["--run.seed", "1", "--model.sft_steps", "60", "--model.sft_batch_size", "50",
         "--rollout.batch_size", "32", "--rollout.chunk_size", "16", "--ppo.minibatch_size", "16",
         "--run.eval_every", "100"]


class SharedRuns:
    """Jobs that several tests read and none writes: each runs once per session, also across parallel
    workers (a file lock; the first worker runs it, the others wait and read it). A test that resumes or
    changes a shared run copies its directory first."""

    def __init__(self, root: Path, address: str, cache_dir: str) -> None:
        self.root, self.address, self.cache_dir = root, address, cache_dir
        root.mkdir(exist_ok=True)

    def get(self, name: str, *args: str) -> tuple[Path, subprocess.CompletedProcess]:
        """(run directory, the finished process) of ``python -m learner.main ARGS`` as run ``name``."""
        from filelock import FileLock

        record = self.root / f"{name}.json"
        with FileLock(self.root / f".{name}.lock"):
            if not record.exists():
                proc = run_job(["--cluster.address", self.address, "--model.cache_dir", self.cache_dir,
                                "--run.output_dir", str(self.root), "--run.name", name, *args])
                record.write_text(json.dumps({"args": proc.args, "returncode": proc.returncode,
                                              "stdout": proc.stdout, "stderr": proc.stderr}))
        done = json.loads(record.read_text())
        return self.root / name, subprocess.CompletedProcess(**done)


@pytest.fixture(scope="session")
def shared_runs(tmp_path_factory, ray_head, cache_dir) -> SharedRuns:
    return SharedRuns(shared_root(tmp_path_factory) / "shared-runs", ray_head.address, cache_dir)


@pytest.fixture(scope="session")
def default_run(shared_runs):
    """The embedded default job (randomwalks, the default SFT warm start, adaptive KL), 10 iterations with
    an evaluation every 5 and TensorBoard: what `make run` does, shorter."""
    return shared_runs.get("randomwalks", "--run.iterations", "10", "--run.eval_every", "5",
                           "--metrics.report_to", "tensorboard")


@pytest.fixture(scope="session")
def small_run(shared_runs):
    """The small job, 4 iterations, a checkpoint every 2."""
    return shared_runs.get("small", *SMALL, "--run.iterations", "4", "--checkpoint.every", "2")


class RankPool:
    """Learner ranks that a test module's groups share, one set per world size: each group sets them up
    again (``LearnerGroup(ranks=...)``) instead of starting new ones. A rank's start (its process, torch,
    DeepSpeed, transformers) costs several times its set-up."""

    def __init__(self) -> None:
        self.ranks: dict[int, list] = {}

    def group(self, cfg, model, tag: str = ""):
        from learner.group import LearnerGroup
        from learner.plan import RankSpec

        world_size = cfg.learner.world_size
        group = LearnerGroup(RankSpec.of(cfg, model), None, tag=f"{tag}-w{world_size}",
                             ranks=self.ranks.get(world_size))
        self.ranks[world_size] = group.ranks
        return group

    def close(self) -> None:
        import ray

        for ranks in self.ranks.values():
            for rank in ranks:
                ray.kill(rank)


@pytest.fixture(scope="module")
def rank_pool(ray_client):
    pool = RankPool()
    yield pool
    pool.close()


def save_tiny_llama(tokenizer, directory: Path, positions: int) -> str:
    """A random-init two-layer Llama over ``tokenizer`` (seed 0), saved with it at ``directory``: head_dim 32,
    a size vLLM's CPU attention takes; EOS doubles as BOS."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from services.models import save_model_dir

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, head_dim=32,
                         max_position_embeddings=positions, bos_token_id=tokenizer.eos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    return str(save_model_dir(LlamaForCausalLM(config), tokenizer, directory))


@pytest.fixture(scope="session")
def tiny_llama_dir(tiny_model_dir, tmp_path_factory) -> str:
    """A random-init Llama with the randomwalks tokenizer (vLLM's Llama takes LoRA adapters; its GPT-2 does
    not)."""
    from services.models import load_tokenizer

    return save_tiny_llama(load_tokenizer(tiny_model_dir), tmp_path_factory.mktemp("llama") / "random", 64)
