"""Benchmark: tether's default job and TRL's GRPOTrainer on a machine that does other work. Each side runs a
fixed number of steps (the default job's iterations, TRL's optimizer steps; as in ``trl_compare.py``, same
SFT start, no evaluation before training) quiet and then beside each neighbour in turn:

- ``busy1``, ``busy2``: one or two ordinary busy processes (``python3 -c "while True: pass"``) at the
  priority of the user who started the benchmark;
- ``tether``: a second default tether job on its own local Ray, running throughout (a pytest worker's
  neighbour in the suite).

Reports each run's whole-process seconds and its ratio to the same side's quiet run (the slowdown), the
default job's seconds to "actors ready" and its ratio to quiet, whether tether's console said it was starved
of CPU, and tether's slowdown over TRL's. Sides alternate within each condition; ``--repeats`` takes the
median.

    .venv/bin/python benchmarks/shared_machine.py [--steps 10] [--repeats 2]

Writes ``benchmarks/results/shared_machine.json`` and ``shared_machine.md``.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench import RAY_ENV, ROOT, cpu_model, stamp, write_results
from trl_compare import TRL_VERSION, cpu_flags, parse_args, sft_start, trl_python

NEIGHBOURS = ("quiet", "busy1", "busy2", "tether")
READY = re.compile(r"actors ready: .*\((\d+\.\d+)s\)")


def start_neighbour(kind: str, work: Path) -> list[subprocess.Popen]:
    """The processes of neighbour ``kind``, started (each in a session of its own, ended by its group)."""
    if kind.startswith("busy"):
        return [subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True)
                for _ in range(int(kind[4:]))]
    if kind == "tether":
        log = open(work / "neighbour.log", "w")  # noqa: SIM115 (closed with the process)
        return [subprocess.Popen([sys.executable, "-m", "learner.main", "--run.iterations", "100000",
                                  "--run.eval_every", "100000", "--no-run.eval_before_training",
                                  "--run.output_dir", str(work), "--run.name", f"neighbour-{time.time_ns()}",
                                  "--checkpoint.every", "0"],
                                 cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                 env={**os.environ, **RAY_ENV, "PYTHONPATH": str(ROOT)})]
    return []


def stop_neighbour(procs: list[subprocess.Popen]) -> None:
    """SIGINT to a tether job (it stops its local Ray with it), SIGTERM to a busy loop; then the group
    killed if it lingers."""
    for proc in procs:
        proc.send_signal(signal.SIGINT if "learner.main" in proc.args else signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def timed(cmd: list[str], log: Path, env: dict) -> float:
    start = time.perf_counter()
    with open(log, "w") as out:
        code = subprocess.run(cmd, check=False, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT,
                              env=env).returncode
    if code != 0:
        raise RuntimeError(f"{cmd[:4]}... exited {code}; see {log}")
    return time.perf_counter() - start


def run_tether(steps: int, work: Path, name: str) -> dict:
    log = work / f"{name}.log"
    seconds = timed([sys.executable, "-m", "learner.main", "--run.iterations", str(steps),
                     "--run.eval_every", str(steps), "--no-run.eval_before_training", "--run.output_dir",
                     str(work), "--run.name", name], log, {**os.environ, **RAY_ENV, "PYTHONPATH": str(ROOT)})
    text = log.read_text()
    ready = READY.search(text)
    return {"seconds": seconds, "actors_ready_seconds": float(ready.group(1)) if ready else None,
            "said_starved": "starved of CPU" in text}


def run_trl(python: Path, sft: Path, steps: int, work: Path, name: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "2"}
    seconds = timed([str(python), str(ROOT / "benchmarks" / "_trl_grpo.py"), "--model", str(sft),
                     "--steps", str(steps), "--seed", "1", "--out", str(work / name)],
                    work / f"{name}.log", env)
    return {"seconds": seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10, help="iterations (tether) and optimizer steps (TRL)")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each side per condition (median)")
    parser.add_argument("--neighbours", nargs="+", default=list(NEIGHBOURS), choices=NEIGHBOURS)
    args, cache = parse_args(parser)
    python, sft = trl_python(cache), sft_start(1)
    work = Path(tempfile.mkdtemp(prefix="shared-machine-", dir=cache))
    runs: dict[str, dict[str, list[dict]]] = {}
    for kind in args.neighbours:
        procs = start_neighbour(kind, work)
        try:
            time.sleep(20 if kind == "tether" else 2)  # the neighbour job past its own start
            for r in range(args.repeats):
                for side in ("tether", "trl"):
                    name = f"{side}-{kind}-{r}"
                    result = (run_tether(args.steps, work, name) if side == "tether"
                              else run_trl(python, sft, args.steps, work, name))
                    runs.setdefault(kind, {}).setdefault(side, []).append(result)
                    print(f"[shared_machine] {name}: {result}", flush=True)
        finally:
            stop_neighbour(procs)

    def med(kind: str, side: str, key: str = "seconds") -> float | None:
        values = [r[key] for r in runs.get(kind, {}).get(side, []) if r.get(key) is not None]
        return statistics.median(values) if values else None

    rows = {}
    for kind in args.neighbours:
        t, q, ready = med(kind, "tether"), med(kind, "trl"), med(kind, "tether", "actors_ready_seconds")
        rows[kind] = {"tether_seconds": t, "trl_seconds": q, "tether_actors_ready_seconds": ready,
                      "tether_said_starved": [r["said_starved"] for r in runs[kind]["tether"]]}
        if "quiet" in runs:
            row = rows[kind]
            row |= {"tether_slowdown": t / med("quiet", "tether"), "trl_slowdown": q / med("quiet", "trl"),
                    "actors_ready_slowdown": ready / med("quiet", "tether", "actors_ready_seconds")}
            row["slowdown_tether_over_trl"] = row["tether_slowdown"] / row["trl_slowdown"]
    results = {**stamp(), "cpu_flags": cpu_flags(), "steps": args.steps, "repeats": args.repeats,
               "rows": rows, "runs": runs}
    table = [
        (f"tether's default job ({args.steps} iterations, no evaluation before training) and TRL "
         f"{TRL_VERSION} GRPO ({args.steps} steps, 16 prompts x 8, 2 threads), whole process, median of "
         f"{args.repeats}, "
         f"beside each neighbour; slowdown = seconds / the same side's quiet seconds; {results['date']}, "
         f"{results['machine']}, CPU flags: {results['cpu_flags']}; "
         f"`.venv/bin/python benchmarks/shared_machine.py --steps {args.steps} --repeats {args.repeats}`"),
        "",
        ("| neighbour | tether s | tether slowdown | actors ready s (slowdown) | said starved | TRL s | "
         "TRL slowdown | tether slowdown / TRL's |"),
        "|---|---|---|---|---|---|---|---|",
    ]
    for kind, row in rows.items():
        table.append(
            f"| {kind} | {row['tether_seconds']:.1f} | {row.get('tether_slowdown', 0):.2f}x | "
            f"{row['tether_actors_ready_seconds']:.1f} ({row.get('actors_ready_slowdown', 0):.2f}x) | "
            f"{sum(row['tether_said_starved'])} of {len(row['tether_said_starved'])} | "
            f"{row['trl_seconds']:.1f} | {row.get('trl_slowdown', 0):.2f}x | "
            f"{row.get('slowdown_tether_over_trl', 0):.2f} |")
    json_path, md_path = write_results(args.out, "shared_machine", results, table)
    print("\n".join(table), flush=True)
    print(f"[shared_machine] {json_path} {md_path} (CPU {cpu_model()})", flush=True)


if __name__ == "__main__":
    main()
