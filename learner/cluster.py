"""Scaffolding: connect to Ray, check that each role's resources exist, place and start the actors."""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass, field
from urllib.parse import urlparse

from services.config import JobConfig, RoleResources
from services.cpu_share import NICENESS_ENV
from services.errors import TetherError
from services.private_api import RAY_JOB_CONFIG_ENV_VAR, raylet_wait_by_polling, stop_local_autoscaler_monitor

# Defaults for every Ray process of tether: stay on loopback and send nothing home. Only
# where the environment does not set them: a cluster with token auth or several nodes sets its own.
RAY_ENV = {
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "RAY_AUTH_MODE": "disabled",
    "RAY_USAGE_STATS_ENABLED": "0",
}
RAY_ENV_DEFAULTED = {key: value for key, value in RAY_ENV.items() if key not in os.environ}
os.environ.update(RAY_ENV_DEFAULTED)

# OpenMP (torch's CPU threads) lets an idle worker thread spin up to 300k rounds before it sleeps. Where roles
# share cores, a spinning thread holds the core that its sibling or another role needs: a 2-thread loop of
# tiny ops ran 6-95 s under load instead of 1.3 s here (docs/benchmarks.md). 10k rounds keeps the spin
# between back-to-back ops (the same 1.3-2.0 s unloaded) and yields the core soon after (2.7-4.3 s loaded).
# For the driver (its SFT warm start) and every actor, unless the environment sets it; read when torch loads.
THREAD_ENV = {"GOMP_SPINCOUNT": "10000"}
for _key, _value in THREAD_ENV.items():
    os.environ.setdefault(_key, _value)

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy


class ClusterError(TetherError, RuntimeError):
    pass


def _check_reachable(address: str, timeout_s: float) -> None:
    """Fail fast on an address nothing listens on, instead of Ray's long retry loop."""
    if address in ("local",):
        return
    parsed = urlparse(address if "://" in address else f"ray://{address}")
    host, port = parsed.hostname, parsed.port
    if not host or not port:
        return
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((host, port), timeout=min(2.0, timeout_s)):
                return
        except OSError as err:
            if time.monotonic() >= deadline:
                raise ClusterError(f"cannot reach the Ray cluster at {address!r} within {timeout_s:.0f}s: "
                                   f"{err}") from err
            time.sleep(0.5)


def role_counts(cfg: JobConfig) -> dict[str, int]:
    """Actors per role, in bundle order; each role's resources are ``cfg.cluster.<role>``."""
    # LoRA with the base model as the reference, or reference.placement learner: the learner ranks score it
    references = (0 if cfg.learner.reference_in_learner or cfg.reference_copy_in_learner
                  else cfg.reference.num_actors)
    return {"rollout": cfg.rollout.num_engines, "reference": references,
            "reward": 0 if cfg.reward_in_learner else cfg.reward.num_actors,  # reward.placement learner: none
            "teacher": cfg.distill.num_actors if cfg.distill.teacher_path else 0,
            "learner": cfg.learner.world_size}


@dataclass(frozen=True)
class ClusterSpec:
    """What joining the cluster, reserving a bundle per actor and the pre-flight read (``ClusterSpec.of``,
    from the job's settings)."""

    run_name: str  # run.name: the namespace and the placement group are named for it
    counts: dict[str, int]  # actors per role, in bundle order (``role_counts``)
    resources: dict[str, RoleResources]  # cluster.<role>: each actor's bundle
    address: str | None = None  # cluster.address
    connect_timeout_s: float = 30.0
    placement_timeout_s: float = 30.0
    num_cpus: int | None = None  # a local Ray's
    object_store_mib: int = 512  # a local Ray's
    log_level: str = "info"  # metrics.log_level: Ray's own and the libraries' in the actors
    weight_transfer: bool = False  # learner.weight_sync 'nccl': every engine reaches learner rank 0's node

    @classmethod
    def of(cls, cfg: JobConfig) -> ClusterSpec:
        """From the settings alone, before the plan: the driver starts Ray while the plan checks the input."""
        c = cfg.cluster
        counts = role_counts(cfg)
        return cls(cfg.run.name, counts, {role: getattr(c, role) for role in counts}, c.address,
                   c.connect_timeout_s, c.placement_timeout_s, c.num_cpus, c.object_store_mib,
                   cfg.metrics.log_level, cfg.learner.weight_sync == "nccl")

    @property
    def local_cpus(self) -> int:
        """The CPUs of a local Ray the job starts: cluster.num_cpus, else the machine's."""
        return self.num_cpus or os.cpu_count() or 1

    @property
    def namespace(self) -> str:
        """Actors live in ``tether-<run name>``, so the dashboard and operators find them by role."""
        return f"tether-{self.run_name}"

    @property
    def roles(self) -> list[tuple[str, int]]:
        """(role, index) of every actor the job starts, in bundle order."""
        return [(role, i) for role, n in self.counts.items() for i in range(n)]


# tether's variables for every actor, set by connect(): what the actors need, never what the job set
ACTOR_ENV: dict[str, str] = {}
_joined = False  # connect() joined or started the Ray that disconnect() leaves
_started_here = False  # connect() started a local Ray: one node, this machine


def in_submitted_job() -> bool:
    """True inside `ray job submit`: the job's runtime env (env_vars, working_dir, ...) is already the
    driver's, and ray.init must not bring one of its own (Ray refuses to merge the two)."""
    return RAY_JOB_CONFIG_ENV_VAR in os.environ


def actor_env(run_name: str, log_level: str) -> dict[str, str]:
    """tether's environment variables for its actors: the libraries' log level (``services.console``), the
    run's name, and settings every actor needs. A value the driver's environment has wins: inside a job
    that is the job's runtime env, which actors inherit, so the variable is left out here."""
    from services.console import library_env

    defaults = {"TOKENIZERS_PARALLELISM": "false", **THREAD_ENV, **library_env(log_level)}
    if in_submitted_job():
        env = {k: v for k, v in defaults.items() if k not in os.environ}
    else:
        env = {k: os.environ.get(k, v) for k, v in defaults.items()}
    return {**RAY_ENV_DEFAULTED, **env, "TETHER_RUN": run_name,
            NICENESS_ENV: str(os.getpriority(os.PRIO_PROCESS, 0))}


def starts_local_ray(spec: ClusterSpec) -> bool:
    """``connect`` will start a local Ray: none is connected, and neither cluster.address nor RAY_ADDRESS
    names one."""
    return not (ray.is_initialized() or spec.address or os.environ.get("RAY_ADDRESS"))


def connect(spec: ClusterSpec, log=print) -> None:
    """Join the configured cluster, the one `ray job submit` runs us in, or start a local Ray. tether's
    environment variables go to each actor (``_options``), so a job's own runtime env stays as it is."""
    global _joined, _started_here
    ACTOR_ENV.clear()
    ACTOR_ENV.update(actor_env(spec.run_name, spec.log_level))
    os.environ["TETHER_RUN"] = spec.run_name  # the driver's metrics carry the run, like the actors'
    if ray.is_initialized():
        log("ray: already connected")
        return
    address = spec.address or os.environ.get("RAY_ADDRESS")
    quiet = {"logging_level": "WARNING" if spec.log_level != "debug" else "DEBUG"}
    if address:
        _check_reachable(address, spec.connect_timeout_s)
        # outside a job the driver's runtime env reaches every worker; inside one the job's stays as it is
        runtime_env = None if in_submitted_job() else {"env_vars": ACTOR_ENV}
        ray.init(address=address, runtime_env=runtime_env, log_to_driver=True, namespace=spec.namespace,
                 **quiet)
        _joined = True
        log(f"ray: joined {address}")
    else:
        with raylet_wait_by_polling():
            ray.init(
                num_cpus=spec.local_cpus,
                object_store_memory=spec.object_store_mib << 20,
                include_dashboard=False,
                runtime_env={"env_vars": ACTOR_ENV},
                _node_ip_address="127.0.0.1",
                namespace=spec.namespace,
                # workers at the driver's niceness (Ray's default puts them 15 steps below it, where any
                # busy process at the user's priority starves them), and no idle workers started ahead:
                # every actor brings its own environment variables (``_options``), so none would take one,
                # and on a small machine their start (about 1.3 CPU s each) delays Ray's own
                _system_config={"worker_niceness": 0, "enable_worker_prestart": False,
                                "prestart_worker_first_driver": False},
                **quiet,
            )
        _joined = _started_here = True
        log("ray: started a local Ray (no cluster.address and no RAY_ADDRESS)")


def disconnect() -> None:
    """Leave the Ray that ``connect`` joined or started (a local one stops with it) now, at the end of the
    job: at the interpreter's exit Ray first sleeps 0.5 s for the actors' last log lines. A connection the job
    found already open is left as it was."""
    global _joined, _started_here
    if _joined:
        if _started_here:  # its monitor first: ray.shutdown would wait a second on it (services.private_api)
            stop_local_autoscaler_monitor()
        _joined = _started_here = False
        ray.shutdown()


def check_role_resources(spec: ClusterSpec) -> None:
    """Each role's request must fit what the cluster has at all; otherwise Ray would wait forever."""
    available = ray.cluster_resources()
    for role in spec.counts:
        res = spec.resources[role]
        wanted = {"CPU": res.num_cpus, "GPU": res.num_gpus, **res.resources}
        for name, amount in wanted.items():
            if amount and available.get(name, 0) < amount:
                raise ClusterError(
                    f"role {role!r} requests {name}={amount} per actor, but the cluster has "
                    f"{available.get(name, 0)} {name} in total"
                    + (" (a CPU-only cluster: set cluster.<role>.num_gpus=0)" if name == "GPU" else "")
                )


def _options(res: RoleResources) -> dict:
    options = {"num_cpus": res.num_cpus, "num_gpus": res.num_gpus, "resources": dict(res.resources)}
    env_vars = dict(ACTOR_ENV)  # set per actor, merged by Ray with the job's own env_vars
    if not res.num_gpus:
        # Ray 2.60 no longer hides GPUs from actors with num_gpus=0: a role without GPUs must see none
        env_vars["CUDA_VISIBLE_DEVICES"] = ""
    # DeepSpeed's accelerator by the role's own devices, never the driver's (a driver started from the CPU
    # image has 'cpu', which would put GPU ranks on DeepSpeed's CPU accelerator); a submitted job's own
    # choice reaches its actors as it is (Ray refuses an actor's env var the job's runtime env also sets)
    if not (in_submitted_job() and "DS_ACCELERATOR" in os.environ):
        env_vars["DS_ACCELERATOR"] = "cuda" if res.num_gpus else "cpu"
    if env_vars:
        options["runtime_env"] = {"env_vars": env_vars}
    return options


@dataclass
class Placement:
    """One placement group with a bundle per actor, grouped by role."""

    group: object
    bundles: dict[str, list[int]] = field(default_factory=dict)

    def strategy(self, role: str, i: int) -> PlacementGroupSchedulingStrategy:
        return PlacementGroupSchedulingStrategy(placement_group=self.group,
                                                placement_group_bundle_index=self.bundles[role][i])

    def bundle_nodes(self) -> dict[int, str]:
        """The node id of each bundle (the group is placed)."""
        from ray.util.placement_group import placement_group_table

        return {int(i): node for i, node in placement_group_table(self.group)["bundles_to_node_id"].items()}

    def remove(self) -> None:
        remove_placement_group(self.group)


def role_bundle(res: RoleResources) -> dict[str, float]:
    """One actor's bundle: all its CPUs and GPUs together. A tensor-parallel engine's actor holds its
    tensor_parallel_size GPUs in it and runs vLLM's workers itself (executor 'mp'), one process per GPU."""
    bundle = {"CPU": res.num_cpus, **({"GPU": res.num_gpus} if res.num_gpus else {}), **res.resources}
    return {k: v for k, v in bundle.items() if v} or {"CPU": 0.01}


def reserve(spec: ClusterSpec) -> Placement:
    """Reserve a bundle for every actor of every role, or fail naming the wait."""
    check_role_resources(spec)
    bundles, index = [], {}
    for role, count in spec.counts.items():
        index[role] = list(range(len(bundles), len(bundles) + count))
        bundles += [role_bundle(spec.resources[role])] * count
    group = placement_group(bundles, strategy="PACK", name=spec.namespace)
    try:
        ray.get(group.ready(), timeout=spec.placement_timeout_s)
    except ray.exceptions.GetTimeoutError as err:
        remove_placement_group(group)
        raise ClusterError(
            f"the cluster could not place all roles within {spec.placement_timeout_s:.0f}s "
            f"(bundles: {bundles}); free resources: {ray.available_resources()}"
        ) from err
    return Placement(group, index)


def start_actor(cls, role: str, i: int, res: RoleResources, placement: Placement | None, *args,
                max_restarts: int = 0, tag: str = "", max_concurrency: int = 1, **kwargs):
    """Start ``cls`` as a Ray actor named ``{role}-{i}`` (``learner-rank-{i}`` for ranks), plus ``-{tag}``;
    ``max_concurrency`` > 1 runs its calls on that many threads; an ``Answering`` actor answers ``alive`` on
    a thread of its own."""
    from actors.base import HEALTH, Answering

    name = (f"learner-rank-{i}" if role == "learner" else f"{role}-{i}") + (f"-{tag}" if tag else "")
    options = _options(res) | {"name": name, "max_restarts": max_restarts, "max_task_retries": 0,
                               "max_concurrency": max_concurrency}
    if placement is not None:
        options["scheduling_strategy"] = placement.strategy(role, i)
    # Ray takes concurrency groups in ray.remote, not in .options()
    groups = {"concurrency_groups": {HEALTH: 1}} if issubclass(cls, Answering) else {}
    remote = ray.remote(**groups)(cls) if groups else ray.remote(cls)
    return remote.options(**options).remote(*args, **kwargs)


# ---------------------------------------------------------------------------------------------- pre-flight

# a connection that takes longer than this is blocked (dropped by a firewall); one refused fails at once
PREFLIGHT_CONNECT_TIMEOUT_S = 10.0


class RendezvousStandIn:
    """Listens on learner rank 0's node, where rank 0 will serve the ranks' rendezvous and
    (learner.weight_sync nccl) vLLM's weight-transfer store, each on a free port it picks then; pre-flight
    tries to reach this one."""

    def __init__(self) -> None:
        import threading

        self.sock = socket.socket()
        self.sock.bind(("", 0))
        self.sock.listen(64)
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            connection, _ = self.sock.accept()
            connection.close()

    def address(self) -> tuple[str, int]:
        return ray.util.get_node_ip_address(), self.sock.getsockname()[1]


def _check_node(models: list, storage, probe: str, rendezvous: tuple[str, int] | None = None,
                weight_transfer: tuple[str, int] | None = None) -> dict:
    """Runs on the node of one role's bundle (in the driver, on the local Ray it started): do the models
    resolve here, is the run storage the driver's (the probe file the driver wrote is visible) and writable
    from here, and can it reach rank 0's node: for the ranks' rendezvous (a learner rank) and for vLLM's
    weight transfer (a rollout engine)?"""
    from services.model_source import ModelNotFoundError, node_name
    from services.storage import StorageError

    found = {"node": node_name(), "ship": False, "problems": []}
    transfer = "vLLM's weight transfer (learner.weight_sync='nccl'), whose store waits 300 s for an engine"
    for address, purpose in ((rendezvous, "the ranks' rendezvous"), (weight_transfer, transfer)):
        if address is None:
            continue
        try:
            socket.create_connection(address, timeout=PREFLIGHT_CONNECT_TIMEOUT_S).close()
        except OSError as err:
            found["problems"].append(f"cannot reach learner rank 0's node at {address[0]} port {address[1]} "
                                     f"(opened by pre-flight) for {purpose}: {err}")
    for model in models:
        try:
            found["ship"] |= model.check() == "ship"
        except ModelNotFoundError as err:
            found["problems"].append(str(err))
    try:
        storage.read_probe(probe)
        storage.check_writable()
    except StorageError as err:
        found["problems"].append(f"{err}. Every node must see one storage: a shared volume mounted at the "
                                 "same path, or an s3:// or gs:// URI (run.output_dir)")
    return found


def rank0_reach(weight_transfer: bool, actors_on: dict[str, list[tuple[str, int]]],
                rank0_node: str) -> dict[str, set[str]]:
    """What each node (``actors_on``: node -> its (role, index)) must reach on learner rank 0's node:
    'rendezvous' where learner ranks run away from it (ranks on its node meet it on loopback), and
    'weight_transfer' where rollout engines run with learner.weight_sync nccl (``weight_transfer``): every
    engine worker joins vLLM's store at rank 0's node address, from rank 0's node too (ipc stays within a GPU;
    the object store is Ray's)."""
    return {node: {purpose for purpose, needed in (
                ("rendezvous", node != rank0_node and any(role == "learner" for role, _ in actors)),
                ("weight_transfer", weight_transfer and any(role == "rollout" for role, _ in actors)))
                   if needed}
            for node, actors in actors_on.items()}


def preflight(spec: ClusterSpec, placement: Placement, models: list, storage, log=print) -> None:
    """Before any model loads, check every node that holds a role: the models resolve there, the run storage
    (a ``RunStorage``) is shared and writable from there, and a node reaches learner rank 0's node where it
    must (``rank0_reach``). One check per node, not per actor: what is checked belongs to the node (its files,
    its mounts, its network), and each check costs a fresh worker process; on the local Ray this driver
    started, whose one node is this machine, the driver checks it itself. Driver-made model files go to the
    object store only when some node lacks them. Raises ClusterError naming each actor, node and what is
    missing."""
    node_of = placement.bundle_nodes()
    actors_on: dict[str, list[tuple[str, int]]] = {}
    for role, i in spec.roles:
        actors_on.setdefault(node_of[placement.bundles[role][i]], []).append((role, i))
    names = {node: ", ".join(f"{role}-{i}" for role, i in actors) for node, actors in actors_on.items()}
    probe = storage.write_probe()
    try:
        if _started_here:
            found = {node: _check_node(models, storage, probe) for node in actors_on}
        else:
            reach = rank0_reach(spec.weight_transfer, actors_on, node_of[placement.bundles["learner"][0]])
            found = _check_on_nodes(spec, placement, actors_on, names, reach, models, storage, probe)
    finally:
        storage.remove(probe)  # a leftover would make the run directory look like it holds a run
    problems = [f"{names[node]} on {f['node']}: {p}" for node, f in found.items() for p in f["problems"]]
    if problems:
        raise ClusterError("pre-flight failed:\n  " + "\n  ".join(problems))
    shipped = sorted({f["node"] for f in found.values() if f["ship"]})
    if shipped:
        for model in models:
            model.ship()
        log(f"pre-flight: the driver's model files go through the object store to {', '.join(shipped)}")
    log("pre-flight: models and run storage ok on " + "; ".join(f"{found[node]['node']}: {names[node]}"
                                                                 for node in found))


def _check_on_nodes(spec: ClusterSpec, placement: Placement, actors_on: dict, names: dict[str, str],
                    reach: dict[str, set[str]], models: list, storage, probe: str) -> dict[str, dict]:
    """``_check_node`` as a task on each node (on the bundle of its first actor), with a stand-in for rank 0's
    rendezvous where some node must reach it."""
    check = ray.remote(num_cpus=0, max_retries=0)(_check_node)
    stand_in = None
    if any(reach.values()):
        stand_in = ray.remote(RendezvousStandIn).options(
            num_cpus=0, scheduling_strategy=placement.strategy("learner", 0)).remote()
    try:
        rendezvous = (ray.get(stand_in.address.remote(), timeout=spec.placement_timeout_s)
                      if stand_in else None)
        calls = {node: check.options(scheduling_strategy=placement.strategy(*actors[0])).remote(
                     models, storage, probe, rendezvous if "rendezvous" in reach[node] else None,
                     rendezvous if "weight_transfer" in reach[node] else None)
                 for node, actors in actors_on.items()}
        try:
            return dict(zip(calls, ray.get(list(calls.values()), timeout=spec.placement_timeout_s),
                            strict=True))
        except ray.exceptions.GetTimeoutError as err:
            late = [names[node] for node, ref in calls.items() if not ray.wait([ref], timeout=0)[0]]
            raise ClusterError("pre-flight: node checks did not answer within "
                               f"{spec.placement_timeout_s:.0f}s for the nodes of {late}") from err
    finally:
        if stand_in is not None:
            ray.kill(stand_in)
