"""What every actor shares: a role name and the (policy_version, kl_coef) state the driver broadcasts."""

from __future__ import annotations

import gc
import os
import time
from contextlib import contextmanager

import ray

from services.cpu_share import NICENESS_ENV, ThreadClock

# niceness steps the rollout engines run above tether's other roles on a CPU node (a factor of about 2.4 in
# CPU weight): generation is the head of the pipeline
ENGINE_LEAD = 4
_priority_taken = False


@contextmanager
def starting_up():
    """Automatic garbage collection off while a process starts, then one full collection and a freeze. As a
    decorator (``@starting_up()``) it wraps an actor's constructor or a rank's set-up.

    Starting imports torch, vLLM, transformers or DeepSpeed and loads a model: hundreds of thousands of new
    objects, which automatic full collections scan again and again (measured here: about 1 of 4.5 CPU s in
    a learner's imports and model load, 1.2 of 7.3 in a vLLM engine's build). The one collection at the end
    frees the start's garbage; frozen, what stays is not scanned again by the collections of the run."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.collect()
        gc.freeze()
        if enabled:
            gc.enable()


def take_cpu_priority(device: str, engine: bool = False) -> int:
    """On CPU, inside an actor: this process's threads, and those they start later, at the user's ordinary
    priority (the driver's niceness, ``NICENESS_ENV``), a rollout engine's ``ENGINE_LEAD`` steps above it.
    Returns the calling thread's niceness after (once per process).

    Generation is the head of the pipeline: while an engine's thread generates the next chunk, the
    reference, reward and learner work on the chunks before it, and on a machine with fewer cores than
    threads they would take its core part of the time. No tether process goes below the user's priority:
    beside an ordinary busy process a worker at Ray's default niceness of 15 gets about 1/28 of its share.
    Raising a priority needs CAP_SYS_NICE or RLIMIT_NICE (``ulimit -e``); where the node refuses, the
    process stays where Ray started it. A GPU process keeps its priority (its work is on the device), as
    does a role built as a plain object outside an actor (tests, tools): that is its caller."""
    global _priority_taken
    current = os.getpriority(os.PRIO_PROCESS, 0)
    if device != "cpu" or _priority_taken or not _in_an_actor():
        return current
    _priority_taken = True
    target = int(os.environ.get(NICENESS_ENV, current)) - (ENGINE_LEAD if engine else 0)
    try:
        threads = [int(t) for t in os.listdir("/proc/self/task")]  # Linux: niceness is per thread
    except FileNotFoundError:
        threads = [0]
    for thread in threads:
        try:
            os.setpriority(os.PRIO_PROCESS, thread, target)
        except (ProcessLookupError, PermissionError):
            pass  # a thread that ended meanwhile, or a raise the node refuses: it stays where it is
    return os.getpriority(os.PRIO_PROCESS, 0)


def lost_to_dead_actor(err: Exception) -> bool:
    """True when ``err`` means an actor died or restarted (retry the chunk), not that the work failed."""
    from ray.exceptions import ObjectLostError, RayActorError, RayTaskError

    if isinstance(err, RayActorError | ObjectLostError):
        return True
    return (isinstance(err, RayTaskError)
            and isinstance(getattr(err, "cause", None), RayActorError | ObjectLostError))


def _in_an_actor() -> bool:
    import ray

    return ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None


HEALTH = "health"  # the concurrency group of ``Answering.alive``: one thread of its own


class Answering:
    """An actor that answers ``alive`` on a thread of its own (Ray's concurrency group ``HEALTH``, given at
    its start) while its main thread is blocked, as a rollout engine's is in an NCCL receive: the driver
    tells an engine that died or restarted from one that is busy."""

    @ray.method(concurrency_group=HEALTH)
    def alive(self) -> int:
        """This process's id (a restarted actor answers with another)."""
        import os

        return os.getpid()


class VersionedActor:
    role = "actor"

    def __init__(self, index: int) -> None:
        import ray

        # the batch's module, while the actor starts: it imports tensordict and with it torch._dynamo (0.9 CPU
        # s), which the first batch to arrive would otherwise wait for (a reward actor's first evaluation
        # did, 0.65 s, at the end of start-up); the engines and the models import it anyway
        import services.experience  # noqa: F401
        from services.metrics import ActorMetrics

        self.index = index
        # outside Ray (unit use of an actor class) there is no dashboard to export to
        self.metrics = ActorMetrics(ray.get_runtime_context().get_job_id(), self.role, index) \
            if ray.is_initialized() else None
        self.policy_version = 0
        self.kl_coef = 0.0
        self.busy_seconds = 0.0  # time spent on requests since the driver last asked
        self.niceness = os.getpriority(os.PRIO_PROCESS, 0)  # after ``on_device``: the priority it took
        self.cpu_clock = ThreadClock()  # this process's CPU share since the driver last asked

    def on_device(self, device: str) -> str:
        """``device`` checked for this actor (a CUDA role on a node without CUDA is named); on CPU its threads
        then run at the user's priority (``take_cpu_priority``)."""
        from actors.engines import check_device

        self.niceness = take_cpu_priority(check_device(device, f"{self.role}-{self.index}"))
        return device

    @contextmanager
    def busy(self):
        """The time inside counts as this actor's busy seconds (``take_counts``)."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.busy_seconds += time.perf_counter() - start

    def take_counts(self) -> dict[str, float]:
        """What this actor counts since the driver last asked (then zero): its busy seconds, its threads'
        CPU seconds and their seconds ready to run but waiting for a core, and a role's own."""
        busy, self.busy_seconds = self.busy_seconds, 0.0
        cpu, waited = self.cpu_clock.take(["self"])
        return {"busy_seconds": busy, "cpu_seconds": cpu, "cpu_wait_seconds": waited}

    def set_state(self, policy_version: int, kl_coef: float) -> dict:
        self.policy_version, self.kl_coef = int(policy_version), float(kl_coef)
        if self.metrics:
            self.metrics.record(self.policy_version, self.kl_coef,
                                getattr(self, "last_tokens_per_second", None))
        return self.get_state()

    def get_state(self) -> dict:
        return {
            "name": f"{self.role}-{self.index}",
            "policy_version": self.policy_version,
            "kl_coef": self.kl_coef,
        }

    def ready(self) -> int:
        """Started: this process's niceness (the start-up line on CPU priorities)."""
        return self.niceness
