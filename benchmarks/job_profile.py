"""Benchmark: where the seconds of a whole job go, from ``python -m learner.main`` starting to its exit, in
every process it starts (the driver, the Ray it starts, the engines, the reference, the reward, the learner
ranks, idle Ray workers), phase by phase.

    .venv/bin/python benchmarks/job_profile.py [--cold] [--runs 1] [--name NAME] [-- extra learner.main args]

Warm (default): the models are cached (one job first warms the cache and the page cache) and no Ray head is
up, so the job starts its own local Ray, as ``make run`` does. ``--cold``: each run gets an empty model cache
and empty compile caches (``TORCH_EXTENSIONS_DIR``, Triton's, vLLM's), as the first run of a fresh clone; the
SFT warm start it then trains is timed on its own and reported apart (the goal leaves it apart).

Every ``--interval`` seconds a thread reads the CPU time of each process under the driver (Ray's daemons and
workers are its descendants here), by role from the process title (``ray::RolloutActor`` ...). The phases are
cut at the driver's own lines (``PHASES``): config and imports until it logs its first line, Ray started, the
rest of the plan (cold: the SFT warm start), pre-flight, actors ready, the evaluation before training, the
iterations, the final evaluation and summary, and the exit. Each phase's wall seconds and CPU seconds by role
go into ``benchmarks/results/job_profile-<name>.md`` and ``.json`` (name: ``warm`` or ``cold`` by default).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench import RAY_ENV, RESULTS, ROOT, processes_by_role, stamp, write_results

ROLES = ("driver", "ray", "workers", "rollout", "reference", "reward", "learner")
ACTOR_ROLES = ("rollout", "reference", "reward", "learner")
# (phase, the driver's line that ends it). The driver starts Ray on its main thread while a second one imports
# the loop and runs the plan (with the SFT warm start, cold): the first phases overlap Ray's start. A line
# that comes before the one its phase waits for ends that phase and folds the phases between into it.
PHASES = (
    ("config and imports (Ray starting beside them)", "[tether] KL accounting"),
    ("Ray started (the plan beside it)", "[tether] ray:"),
    ("the plan's rest (cold: the SFT warm start)", "[tether] run directory"),
    ("pre-flight", "[tether] pre-flight: models"),
    ("actors ready", "[tether] actors ready"),
    ("evaluation before training", "[tether] eval before training"),
    ("first iteration", "[tether] iter 1/"),
    ("other iterations", "[tether] summary"),
    ("summary to exit", None),
)


class CpuPoll(threading.Thread):
    """The CPU seconds of every process under ``pid``, by PID (the last reading of one that has exited)."""

    def __init__(self, pid: int, interval: float) -> None:
        super().__init__(daemon=True)
        self.pid, self.interval = pid, interval
        self.seen: dict[int, tuple[str, float]] = {}
        self.stopped = threading.Event()
        self.lock = threading.Lock()

    def run(self) -> None:
        while not self.stopped.is_set():
            self.read()
            self.stopped.wait(self.interval)

    def read(self) -> None:
        import psutil

        for proc, role in processes_by_role([self.pid], other_workers="workers"):
            try:
                times = proc.cpu_times()
                spent = times.user + times.system  # not its children's: they are read themselves
            except psutil.Error:
                continue
            with self.lock:  # an actor's process keeps its role: at the exit, orphans are reparented
                before = self.seen.get(proc.pid, (role,))[0]
                self.seen[proc.pid] = (before if before in ACTOR_ROLES else role, spent)

    def by_role(self) -> dict[str, float]:
        self.read()
        with self.lock:
            totals = dict.fromkeys(ROLES, 0.0)
            for role, spent in self.seen.values():
                totals[role] = totals.get(role, 0.0) + spent
        return totals


def one_job(args: list[str], env: dict, interval: float) -> dict:
    """Runs the job; returns each phase's wall and CPU seconds by role, and the job's own figures."""
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "learner.main", *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    poll = CpuPoll(proc.pid, interval)
    poll.start()
    marks: list[tuple[str, float, dict]] = []  # (phase, wall at its end, CPU by role at its end)
    pending = list(PHASES)
    lines = []
    # the SFT warm start's training, cold: its start and end (the goal leaves it apart)
    sft: dict[str, float] = {}
    for line in proc.stdout:
        lines.append(line)
        for event, prefix in (("start", "[tether] SFT warm start: training"),
                              ("end", "[tether] SFT warm start: saved")):
            if line.startswith(prefix):
                sft[event] = time.perf_counter() - start
        for i, (phase, prefix) in enumerate(pending):
            if prefix is not None and line.startswith(prefix):
                cpu = poll.by_role()
                marks += [(name, time.perf_counter() - start, cpu) for name, _ in pending[:i + 1]]
                pending = pending[i + 1:]
                break
    returncode = proc.wait()
    marks.append(("summary to exit", time.perf_counter() - start, poll.by_role()))
    poll.stopped.set()
    if returncode != 0:
        sys.exit(f"job failed (exit {returncode}):\n" + "".join(lines[-40:]))
    phases, before_wall, before_cpu = [], 0.0, dict.fromkeys(ROLES, 0.0)
    for name, wall, cpu in marks:
        phases.append({"phase": name, "wall_seconds": round(wall - before_wall, 2),
                       "cpu_seconds": {r: round(cpu.get(r, 0.0) - before_cpu.get(r, 0.0), 2) for r in ROLES}})
        before_wall, before_cpu = wall, cpu
    return {"phases": phases, "wall_seconds": round(before_wall, 2),
            "actors_ready_seconds": next(round(w, 2) for n, w, _ in marks if n == "actors ready"),
            "sft_seconds": round(sft["end"] - sft["start"], 2) if len(sft) == 2 else 0.0,
            "iterations": sum(1 for line in lines if line.startswith("[tether] iter ")),
            "summary": next((line.strip() for line in lines if line.startswith("[tether] summary")), "")}


def table(runs: list[dict]) -> list[str]:
    """Medians over the runs, phase by phase."""
    def med(values):
        return statistics.median(values)

    rows = ["| phase | wall (s) | CPU s: " + " / ".join(ROLES) + " | CPU s, all |", "|---|---|---|---|"]
    for i, phase in enumerate(runs[0]["phases"]):
        wall = med([r["phases"][i]["wall_seconds"] for r in runs])
        cpu = {role: med([r["phases"][i]["cpu_seconds"][role] for r in runs]) for role in ROLES}
        rows.append(f"| {phase['phase']} | {wall:.2f} | " + " / ".join(f"{cpu[r]:.1f}" for r in ROLES)
                    + f" | {sum(cpu.values()):.1f} |")
    total = {role: med([sum(p["cpu_seconds"][role] for p in r["phases"]) for r in runs]) for role in ROLES}
    rows.append(f"| **whole process** | {med([r['wall_seconds'] for r in runs]):.2f} | "
                + " / ".join(f"{total[r]:.1f}" for r in ROLES) + f" | {sum(total.values()):.1f} |")
    rows.append("")
    sft = med([r.get("sft_seconds", 0.0) for r in runs])
    apart = (f", {med([r['actors_ready_seconds'] - r.get('sft_seconds', 0.0) for r in runs]):.1f} s with "
             f"the SFT warm start's training ({sft:.1f} s) apart" if sft else "")
    rows.append(f"Actors ready after {med([r['actors_ready_seconds'] for r in runs]):.1f} s{apart} "
                f"(median of {len(runs)}); {runs[0]['iterations']} iterations; {runs[-1]['summary']}")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cold", action="store_true", help="empty model and compile caches for each run")
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--name", help="results/job_profile-NAME (default: warm or cold)")
    parser.add_argument("--interval", type=float, default=0.2, help="seconds between CPU readings")
    parser.add_argument("--cache-dir", default=str(Path("~/.cache/tether").expanduser()),
                        help="warm runs' cache")
    parser.add_argument("extra", nargs="*", help="extra learner.main arguments (after --)")
    args = parser.parse_args()
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"} | RAY_ENV
    runs = []
    with tempfile.TemporaryDirectory(prefix="profile-") as out:
        base = ["--run.output_dir", out, "--checkpoint.every", "0", *args.extra]
        if not args.cold:  # the cache and the page cache warm
            one_job([*base, "--model.cache_dir", args.cache_dir, "--run.name", "warm-up",
                     "--run.iterations", "1"], env, args.interval)
        for i in range(args.runs):
            run_env, cache = dict(env), args.cache_dir
            if args.cold:
                fresh = Path(out) / f"caches-{i}"
                cache = str(fresh / "tether")
                run_env |= {"TORCH_EXTENSIONS_DIR": str(fresh / "torch_extensions"),
                            "TRITON_CACHE_DIR": str(fresh / "triton"), "VLLM_CACHE_ROOT": str(fresh / "vllm")}
            runs.append(one_job([*base, "--model.cache_dir", cache, "--run.name", f"run-{i}"], run_env,
                                args.interval))
            print("\n".join(table(runs[-1:])), flush=True)
    name = args.name or ("cold" if args.cold else "warm")
    results = {**stamp(), "cold": args.cold, "args": args.extra, "runs": runs}
    command = (f"`.venv/bin/python benchmarks/job_profile.py{' --cold' if args.cold else ''} "
               f"--runs {args.runs}{' --name ' + args.name if args.name else ''}"
               f"{' -- ' + ' '.join(args.extra) if args.extra else ''}`")
    write_results(RESULTS, f"job_profile-{name}", results, [command, "", *table(runs)])
    print("\n".join(table(runs)))


if __name__ == "__main__":
    main()
