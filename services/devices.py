"""Where an actor's devices are: shared by the rollout actors and the learner ranks."""

from __future__ import annotations


def gpu_location() -> tuple[str, list[str]]:
    """(node id, GPU ids Ray gave this actor): where the calling actor's GPUs are."""
    import ray

    context = ray.get_runtime_context()
    return context.get_node_id(), sorted(context.get_accelerator_ids().get("GPU", []))
