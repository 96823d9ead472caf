"""How much CPU the job's processes get against what they ask for, read from Linux's per-thread scheduler
statistics (``/proc/<pid>/task/<tid>/schedstat``: nanoseconds run, nanoseconds runnable but waiting for a
core). A process whose threads wait longer than they run is starved: on a node shared with other busy
processes that is what a job which merely looks slow is.

- ``ThreadClock``: one process's run and wait seconds since the last reading (an actor's per-iteration share);
- ``StarvationWatch``: the driver's thread that says once, on the console, when the job's processes on its
  node wait more than they run while other processes take the CPUs, and names the busiest of them;
- ``describe_priorities``: the actors' niceness against the driver's, in the words of the start-up line.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Self

# the driver's niceness, the user's ordinary priority: the driver hands it to every actor (learner.cluster),
# and no actor goes below it (actors.base.take_cpu_priority)
NICENESS_ENV = "TETHER_NICENESS"
# a niceness step is a factor of about 1.25 in Linux's CPU weight (sched_prio_to_weight)
WEIGHT_PER_STEP = 1.25


def thread_schedstats(pid: int | str = "self") -> dict[int, tuple[int, int]]:
    """{thread id: (ns run, ns waiting to run)} of every live thread of ``pid`` (empty when it is gone)."""
    stats = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return stats
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                run, wait, _ = f.read().split()
        except (OSError, ValueError):
            continue  # ended meanwhile
        stats[int(tid)] = (int(run), int(wait))
    return stats


class ThreadClock:
    """Run and wait seconds of a set of processes' threads since the last ``take``. A thread that ended takes
    its time with it; a new one counts from its start."""

    def __init__(self) -> None:
        self.last: dict[tuple[int, int], tuple[int, int]] = {}

    def take(self, pids: list[int | str]) -> tuple[float, float]:
        """(seconds run, seconds runnable but waiting) of ``pids``' threads since the last call."""
        now = {(i, tid): v for i, pid in enumerate(pids) for tid, v in thread_schedstats(pid).items()}
        run = wait = 0
        for key, (r, w) in now.items():
            r0, w0 = self.last.get(key, (0, 0))
            if r >= r0 and w >= w0:  # a thread id taken again by a new thread starts over
                run, wait = run + r - r0, wait + w - w0
        self.last = now
        return run / 1e9, wait / 1e9


def cpu_share(run_s: float, wait_s: float) -> float | None:
    """The share of the time a process was ready to run that it ran (1: never waited); None if it never
    was."""
    return run_s / (run_s + wait_s) if run_s + wait_s > 0 else None


@dataclass(frozen=True)
class Window:
    """One watch interval on the driver's node."""

    seconds: float
    run_s: float  # the job's processes ran
    wait_s: float  # ... and waited, ready to run
    others_s: float  # CPU seconds every other process used
    cpus: int


def starved(w: Window) -> bool:
    """The job's processes waited longer than they ran, for at least a quarter of a CPU on average, while the
    node's other processes took at least half a CPU. Waiting on each other alone (a small machine's start-up)
    is not starvation: the job sized itself to the CPUs it was given."""
    return w.wait_s > w.run_s and w.wait_s >= 0.25 * w.seconds and w.others_s >= 0.5 * w.seconds


def describe_starvation(w: Window, busiest: list[tuple[str, int, int, float]], node: str) -> str:
    """The console's line. ``busiest``: (name, pid, niceness, CPU seconds in the window) of other
    processes."""
    others = ", ".join(f"{name} (pid {pid}, niceness {nice}, {s / w.seconds:.1f} CPU)"
                       for name, pid, nice, s in busiest)
    return (f"starved of CPU on {node}: over the last {w.seconds:.0f}s the job's processes ran "
            f"{w.run_s:.1f}s and waited {w.wait_s:.1f}s ready to run ({w.run_s / (w.run_s + w.wait_s):.0%} "
            f"of what they asked for), while other processes took {w.others_s / w.seconds:.1f} of "
            f"{w.cpus} CPUs; the busiest: {others}. The job goes on, slower (docs/troubleshooting.md)")


class StarvationWatch:
    """A daemon thread of the driver: every ``interval_s`` it reads the job's processes on this node (the
    driver, what it started: a local Ray's daemons and workers; and the processes whose environment names the
    run, ``TETHER_RUN``: a joined cluster's actors here) and every other process's CPU time, and says once
    when the job is ``starved``."""

    def __init__(self, run_name: str, log: Callable[[str], None], interval_s: float = 10.0) -> None:
        self.run_name, self.log, self.interval_s = run_name, log, interval_s
        self.clock = ThreadClock()
        self.theirs: dict[tuple[int, float], float] = {}  # (pid, start time) -> CPU seconds at the last look
        self.ours: dict[tuple[int, float], bool] = {}  # (pid, start time) -> of this job, decided once
        self.said = False
        self.stop_event = threading.Event()
        self.thread = threading.Thread(target=self._watch, name="starvation-watch", daemon=True)

    def __enter__(self) -> Self:
        if self.interval_s > 0:
            self.thread.start()
        return self

    def __exit__(self, *_) -> None:
        self.stop_event.set()

    def _of_the_job(self, proc, key, descendants: set[int]) -> bool:
        if proc.pid in descendants:
            return True
        if key not in self.ours:
            try:
                self.ours[key] = proc.environ().get("TETHER_RUN") == self.run_name
            except Exception:  # noqa: BLE001 (another user's process, or ended: not ours)
                self.ours[key] = False
        return self.ours[key]

    def look(self) -> tuple[list[int], list[tuple[str, int, int, float]]]:
        """This job's pids on the node, and (name, pid, niceness, CPU seconds since the last look) of every
        other process, busiest first."""
        import psutil

        me = psutil.Process()
        descendants = {me.pid} | {p.pid for p in me.children(recursive=True)}
        ours, others, seen = [], [], {}
        for proc in psutil.process_iter(["name", "cpu_times", "create_time", "nice"]):
            info = proc.info
            if info["cpu_times"] is None:
                continue
            key = (proc.pid, info["create_time"])
            if self._of_the_job(proc, key, descendants):
                ours.append(proc.pid)
                continue
            used = info["cpu_times"].user + info["cpu_times"].system
            seen[key] = used
            if key in self.theirs:
                others.append((info["name"], proc.pid, info["nice"], used - self.theirs[key]))
        self.theirs = seen
        self.ours = {k: v for k, v in self.ours.items() if k in seen or v}
        return ours, sorted(others, key=lambda o: -o[3])

    def _watch(self) -> None:
        import socket

        cpus = len(os.sched_getaffinity(0))
        ours, _ = self.look()
        self.clock.take(ours)
        last = time.monotonic()
        while not self.stop_event.wait(self.interval_s) and not self.said:
            ours, others = self.look()
            run_s, wait_s = self.clock.take(ours)
            now = time.monotonic()
            window = Window(now - last, run_s, wait_s, sum(o[3] for o in others), cpus)
            last = now
            if starved(window):
                self.said = True
                busiest = [o for o in others[:3] if o[3] >= 0.05 * window.seconds]
                self.log(describe_starvation(window, busiest, socket.gethostname()))


def describe_priorities(engines: list[int], others: list[int], ordinary: int) -> str:
    """The start-up line on a CPU node's priorities: the rollout engines' and the other roles' niceness
    against the driver's (``ordinary``), and what a lower priority means beside other busy processes."""
    def span(values: list[int]) -> str:
        return f"{min(values)}" if min(values) == max(values) else f"{min(values)}-{max(values)}"

    parts = ([f"rollout engines at niceness {span(engines)}"] if engines else []) + \
        ([f"the other roles at {span(others)}"] if others else [])
    line = f"cpu priority: {', '.join(parts)} (the driver's {ordinary})"
    lowest = max(engines + others)
    if lowest > ordinary:
        line += (f"; below yours: beside a busy process at niceness {ordinary} such a process gets about "
                 f"1/{WEIGHT_PER_STEP ** (lowest - ordinary):.0f} of its CPU share (raising it needs "
                 f"CAP_SYS_NICE or `ulimit -e`; docs/cluster.md)")
    elif engines and others and min(others) - max(engines) <= 0:
        line += "; the engines have no lead (raising their priority needs CAP_SYS_NICE or `ulimit -e`)"
    return line
