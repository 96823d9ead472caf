"""Benchmark: dataset jobs started one after another beside a loaded machine, each on a local Ray of its own
(``python -m learner.main`` without ``cluster.address``: the order in which a plan that touches Ray and the
driver's own ``ray.init`` once raced). Each is a dataset job on a tiny model, taken to "actors ready" and then
stopped with SIGINT; beside them run ``--load`` busy processes at the ordinary priority. Reports, per start,
whether its actors came up, the seconds to "actors ready", its exit code, and which of the Ray daemons
(``raylet``, ``gcs_server``) its driver had started are left behind once it exited.

    .venv/bin/python benchmarks/dataset_starts.py [--starts 20] [--load 2]

Writes ``benchmarks/results/dataset_starts.json`` and ``dataset_starts.md``.
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench import RAY_ENV, RESULTS, ROOT, stamp, write_results

RAY_DAEMONS = ("raylet", "gcs_server")


def own_daemons(driver: int) -> set[int]:
    """The Ray daemons the job's driver started (its local Ray), while it runs."""
    import psutil

    try:
        children = psutil.Process(driver).children(recursive=True)
    except psutil.NoSuchProcess:
        return set()
    return {p.pid for p in children if p.name() in RAY_DAEMONS}


def still_running(pids: set[int]) -> list[int]:
    import psutil

    return sorted(p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie")


def tiny_model(cache_dir: Path) -> str:
    """The randomwalks GPT-2 with a short SFT warm start (the dataset tests' model)."""
    sys.path.insert(0, str(ROOT))
    from services.models import policy_dir
    from services.tasks import get_task

    return str(policy_dir(get_task("randomwalks"), None, cache_dir, seed=1, steps=60, batch_size=50, lr=1e-3,
                          log=lambda _: None))


def start(model: str, cache_dir: Path, data: Path, out: Path, n: int) -> dict:
    """One job started, taken to "actors ready" (past the start-up where the plan and ``ray.init`` once
    raced), then stopped with SIGINT as a user's Ctrl-C stops it."""
    import os
    import signal

    args = [sys.executable, "-m", "learner.main", "--model.path", model, "--model.cache_dir", str(cache_dir),
            "--run.output_dir", str(out), "--run.name", f"start-{n}", "--task.name", "dataset",
            "--task.path", str(data), "--task.reward_function", "tests.dataset_rewards:letter_distance",
            "--task.reward_fields", '["answer"]', "--rollout.max_new_tokens", "9", "--run.iterations", "1",
            "--no-run.eval_before_training", "--rollout.batch_size", "16", "--rollout.chunk_size", "8",
            "--ppo.minibatch_size", "16", "--no-checkpoint.export_hf"]
    began = time.perf_counter()
    proc = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, **RAY_ENV})
    lines, ready, daemons = [], None, set()
    for line in proc.stdout:
        lines.append(line.rstrip())
        if "actors ready" in line:
            ready = time.perf_counter() - began
            daemons = own_daemons(proc.pid)
            proc.send_signal(signal.SIGINT)
            break
    rest, _ = proc.communicate(timeout=600)
    lines += rest.splitlines()
    time.sleep(2)  # Ray's daemons end shortly after the driver
    return {"start": n, "ready": ready is not None, "ready_seconds": round(ready or 0.0, 1),
            "exit_code": proc.returncode, "daemons": len(daemons), "left_behind": still_running(daemons),
            "failure": None if ready is not None else lines[-1:], "last_lines": lines[-3:]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--starts", type=int, default=20)
    parser.add_argument("--load", type=int, default=2, help="busy processes beside the jobs")
    parser.add_argument("--cache-dir", default=str(Path.home() / ".cache" / "tether"))
    args = parser.parse_args()
    cache_dir = Path(args.cache_dir)
    model = tiny_model(cache_dir)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the busy processes end with this script
    load = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.load)]
    try:
        with tempfile.TemporaryDirectory(prefix="tether-starts-") as tmp:
            data = Path(tmp) / "train.jsonl"
            data.write_text("".join(json.dumps({"prompt": p, "answer": a}) + "\n"
                                    for p, a in zip("bcdefghijk", "cdefghijkl", strict=True)))
            runs = []
            for n in range(args.starts):
                runs.append(start(model, cache_dir, data, Path(tmp) / "runs", n))
                print(json.dumps(runs[-1]), flush=True)
    finally:
        for proc in load:  # only the processes this script started, by their handles
            proc.kill()
            proc.wait()
    started = sum(r["ready"] for r in runs)
    left = sum(len(r["left_behind"]) for r in runs)
    results = {**stamp(), "starts": args.starts, "load": args.load, "started": started,
               "daemons_left_behind": left, "runs": runs}
    seconds = sorted(r["ready_seconds"] for r in runs if r["ready"]) or [0.0]
    head = (f"{args.starts} dataset jobs started in a row, each on a local Ray of its own, beside "
            f"{args.load} busy processes, each taken to 'actors ready' and stopped with SIGINT: "
            f"**{started} of {args.starts} started**, Ray daemons left behind: {left}; seconds to "
            f"'actors ready' {seconds[0]:.0f} .. {seconds[-1]:.0f}, median {seconds[len(seconds) // 2]:.0f}.")
    table = [head, "", "| start | actors ready | seconds | exit code | left behind | failure |",
             "|---|---|---|---|---|---|",
             *(f"| {r['start']} | {'yes' if r['ready'] else 'no'} | {r['ready_seconds']} | "
               f"{r['exit_code']} | {len(r['left_behind'])} | {r['failure'] or ''} |" for r in runs)]
    print(write_results(RESULTS, "dataset_starts", results, table)[1].read_text())


if __name__ == "__main__":
    main()
