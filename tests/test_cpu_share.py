"""The CPU share of the job's processes and the starvation line (``services.cpu_share``), on given numbers and
on this process's own threads; the priorities' start-up line."""

from __future__ import annotations

import os
import threading
import time

from services.cpu_share import (
    ThreadClock,
    Window,
    cpu_share,
    describe_priorities,
    describe_starvation,
    starved,
)


def test_starved_only_when_other_processes_take_the_cpus_the_job_waits_for():
    assert starved(Window(seconds=10, run_s=3, wait_s=8, others_s=9, cpus=2))
    # the job's processes waiting on each other (a small machine's start-up): nobody else is busy
    assert not starved(Window(seconds=10, run_s=8, wait_s=11, others_s=0.3, cpus=2))
    # waiting less than it runs: slower, not starved
    assert not starved(Window(seconds=10, run_s=10, wait_s=6, others_s=10, cpus=2))
    # hardly asking for the CPU at all (an idle driver between iterations)
    assert not starved(Window(seconds=10, run_s=0.5, wait_s=1.5, others_s=20, cpus=2))


def test_the_starvation_line_names_the_share_and_the_busiest_processes():
    line = describe_starvation(Window(10, 2.0, 8.0, 18.0, 2), [("python3", 42, 0, 9.5), ("yes", 7, 5, 8.5)],
                               "node-a")
    assert line.startswith("starved of CPU on node-a: over the last 10s the job's processes ran 2.0s and "
                           "waited 8.0s ready to run (20% of what they asked for), while other processes "
                           "took 1.8 of 2 CPUs; the busiest: python3 (pid 42, niceness 0, 0.9 CPU), yes (pid "
                           "7, niceness 5, 0.8 CPU)")


def test_the_thread_clock_counts_a_busy_thread_and_then_nothing_while_idle():
    clock = ThreadClock()
    clock.take(["self"])

    def spin(seconds: float) -> None:
        end = time.thread_time() + seconds
        while time.thread_time() < end:
            pass

    thread = threading.Thread(target=spin, args=(0.3,))
    thread.start()
    thread.join()  # ended: its time went with it, so spin on a live thread too
    spin(0.3)
    run, wait = clock.take(["self"])
    assert 0.25 < run < 5 and wait >= 0
    time.sleep(0.2)
    run, _ = clock.take([os.getpid()])
    assert run < 0.15
    assert cpu_share(3.0, 1.0) == 0.75 and cpu_share(0.0, 0.0) is None


def test_the_priority_line_says_the_engines_lead_and_what_a_lower_priority_costs():
    assert describe_priorities([-4], [0, 0], 0) == \
        "cpu priority: rollout engines at niceness -4, the other roles at 0 (the driver's 0)"
    lagging = describe_priorities([15, 15], [15], 0)
    assert lagging.startswith("cpu priority: rollout engines at niceness 15, the other roles at 15 (the "
                              "driver's 0); below yours: beside a busy process at niceness 0 such a process "
                              "gets about 1/28 of its CPU share")
    assert describe_priorities([0], [0], 0).endswith("; the engines have no lead (raising their priority "
                                                     "needs CAP_SYS_NICE or `ulimit -e`)")
