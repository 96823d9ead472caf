"""WeightSync: the policy version and beta every actor must hold, and how the learner's weights reach the
engines.

- ``object_store`` (CPU, or GPU without vLLM's transfer): learner rank 0 puts the full weights once per
  version; every engine loads that ref. The ref of the version in force is kept, so an engine that
  restarted (it comes back at version 0 with its initial weights) is re-synced from it.
- ``nccl`` | ``ipc``: vLLM's weight transfer (``learner/weight_transfer.py``), set up once. An NCCL group
  cannot take back a restarted member, so there engines do not restart (``Fleet``); a re-sync, if one is
  ever needed, gathers the weights into the object store.

Between two syncs the learner holds exactly the published version's weights: the driver publishes right
after every update, so a re-sync never labels newer weights with an older version.
"""

from __future__ import annotations

import time

import ray

from learner.cluster import ClusterError
from learner.plan import SyncSpec
from services.errors import ANSI


class WeightSync:
    def __init__(self, spec: SyncSpec, learner, fleet, probe_set: tuple[list[list[int]], list[int]],
                 kl_coef: float, log=print) -> None:
        self.learner, self.fleet, self.probe_set, self.log = learner, fleet, probe_set, log
        self.probe_every, self.max_retries, self.transfer = spec.probe_every, spec.max_retries, spec.transfer
        self.policy_version, self.kl_coef = 0, kl_coef
        # object store: the weights of ``policy_version``, once put
        self._weights: ray.ObjectRef | None = None
        # learner.lora: the adapter alone when every engine takes adapters, else the merged weights
        self.adapter = False
        if spec.lora:
            self.adapter = all(ray.get([engine.takes_adapters.remote() for engine in fleet.rollouts]))
            if self.adapter:
                log("LoRA: adapter-only sync, the engines generate with each version's adapter")
            elif spec.adapter_sync:
                log("LoRA: the engines' model takes no adapters in vLLM (or rollout.engine is 'hf'): the "
                    "merged weights travel at each sync")
            else:
                why = " (float32 engines on CPU, where vLLM generates with an adapter 3-7x slower)"
                log(f"LoRA: learner.lora.sync {spec.lora_sync!r}: the merged weights travel at each sync"
                    + (why if spec.lora_sync == "auto" else ""))
        if self.transfer is not None:
            from learner.weight_transfer import largest_parameter, packed_buffer_bytes

            announced = learner.weight_metadata()
            bucket_bytes = spec.bucket_mib << 20
            buffer_bytes = packed_buffer_bytes(announced, bucket_bytes)
            if buffer_bytes > bucket_bytes:
                name, _ = largest_parameter(announced)
                log(f"weight transfer: packed buffer {buffer_bytes / 2**20:.1f} MiB, above "
                    f"learner.sync_bucket_mib={spec.bucket_mib}, to hold the largest parameter, {name}")
            learner.connect_engines(fleet.rollouts, self.transfer, buffer_bytes,
                                    workers_per_engine=spec.workers_per_engine)

    def start(self, policy_version: int, kl_coef: float) -> None:
        """Every actor to (``policy_version``, ``kl_coef``); the weights too when they are not the initial
        ones (a resume), then the probe."""
        self.policy_version, self.kl_coef = policy_version, kl_coef
        if policy_version:
            self._send()
            self.fleet.probe(self.learner, *self.probe_set)
        else:
            self.fleet.broadcast(None, policy_version, kl_coef)

    def publish(self, kl_coef: float) -> float:
        """The learner's weights, just updated, as the next version, with ``kl_coef``, to every actor.
        Returns the seconds the weights took to load (object store: the slowest engine's load)."""
        self.policy_version, self.kl_coef = self.policy_version + 1, kl_coef
        return self._send()

    def _send(self) -> float:
        start = time.perf_counter()
        if self.transfer is not None:
            self._weights = None
            self.learner.send_weights(self.fleet.rollouts, self.policy_version, self.kl_coef)
            self.fleet.broadcast(None, self.policy_version, self.kl_coef)
            return time.perf_counter() - start
        self._weights = self.learner.policy_weights(self.adapter)
        return self.fleet.broadcast(self._weights, self.policy_version, self.kl_coef)

    def weights(self) -> ray.ObjectRef:
        """The current version's weights in the object store (gathered now if not yet put)."""
        if self._weights is None:
            self._weights = self.learner.policy_weights(self.adapter)
        return self._weights

    def probe(self) -> float:
        """Max |engine - learner| log-prob on the probe batch, every ``run.probe_every`` versions (else
        NaN)."""
        if self.policy_version % self.probe_every:
            return float("nan")
        return self.fleet.probe(self.learner, *self.probe_set)

    def bring_up_to_date(self, timeout_s: float = 300.0) -> list[dict]:
        """Re-sync every actor whose reported version or beta differs from the driver's (a restarted
        one comes back at version 0); engines must pass the probe before they generate again."""
        deadline = time.monotonic() + timeout_s
        resynced = []
        for actor in self.fleet.all:
            cause = None  # what Ray said while the actor was away, when it was asked then
            while True:
                try:
                    state = ray.get(actor.get_state.remote(), timeout=max(deadline - time.monotonic(), 1))
                    break
                except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as err:
                    if time.monotonic() > deadline:
                        raise ClusterError(f"actor did not come back within {timeout_s:.0f}s: {err}") from err
                    cause = cause or " ".join(ANSI.sub("", str(err)).split())[:300]
                    time.sleep(1.0)
            if state["policy_version"] == self.policy_version and state["kl_coef"] == self.kl_coef:
                continue
            # a restarted actor (Ray's memory monitor, a lost node): said on the console, not only in metrics
            self.log(f"{state['name']} came back at version {state['policy_version']} (restarted"
                     f"{': ' + cause if cause else ''}); re-synced to version {self.policy_version}")
            if actor in self.fleet.rollouts and state["policy_version"] != self.policy_version:
                ray.get(actor.update_weights.remote(self.weights(), self.policy_version, self.kl_coef))
                probe_error = self.fleet.probe(self.learner, *self.probe_set, engines=[actor])
                resynced.append({"actor": state["name"], "from_version": state["policy_version"],
                                 "to_version": self.policy_version, "probe_max_abs_error": probe_error})
            else:
                ray.get(actor.set_state.remote(self.policy_version, self.kl_coef))
                resynced.append({"actor": state["name"], "from_version": state["policy_version"],
                                 "to_version": self.policy_version})
        return resynced

    def states(self) -> list[dict]:
        """Every actor's (name, version, beta); an actor that died meanwhile is brought up to date first."""
        for attempt in range(self.max_retries + 1):
            try:
                return ray.get([a.get_state.remote() for a in self.fleet.all])
            except ray.exceptions.RayActorError:
                if attempt == self.max_retries:
                    raise
                self.bring_up_to_date()
        raise AssertionError("unreachable")

    def behind(self, states: list[dict]) -> list[dict]:
        """The actors in ``states`` that do not hold the driver's version and beta."""
        return [s for s in states
                if s["policy_version"] != self.policy_version or s["kl_coef"] != self.kl_coef]
