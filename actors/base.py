"""What every actor shares: a role name and the (policy_version, kl_coef) state the driver broadcasts."""

from __future__ import annotations


class VersionedActor:
    role = "actor"

    def __init__(self, index: int) -> None:
        import ray

        from services.metrics import ActorMetrics

        self.index = index
        # outside Ray (unit use of an actor class) there is no dashboard to export to
        self.metrics = ActorMetrics(ray.get_runtime_context().get_job_id(), self.role, index) \
            if ray.is_initialized() else None
        self.policy_version = 0
        self.kl_coef = 0.0
        self.busy_seconds = 0.0  # time spent on requests since the driver last asked

    def take_busy_seconds(self) -> float:
        busy, self.busy_seconds = self.busy_seconds, 0.0
        return busy

    def set_state(self, policy_version: int, kl_coef: float) -> dict:
        self.policy_version, self.kl_coef = int(policy_version), float(kl_coef)
        if self.metrics:
            self.metrics.record(self.policy_version, self.kl_coef, getattr(self, "last_tokens_per_second", None))
        return self.get_state()

    def get_state(self) -> dict:
        return {
            "name": f"{self.role}-{self.index}",
            "policy_version": self.policy_version,
            "kl_coef": self.kl_coef,
        }

    def ready(self) -> bool:
        return True
