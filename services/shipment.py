"""Data the driver reads once and actors on any node need (a dataset's rows): held by value until Ray is up,
then put in the object store once (``ship``), so that nothing before the connection starts Ray by side
effect."""

from __future__ import annotations

from typing import Any


class Shipment:
    """A value that travels to actors: by value until ``ship()`` (called once Ray is connected), as one object
    ref after it, which every actor built from it reads, a restarted one too."""

    def __init__(self, value: Any) -> None:
        self.value, self.ref = value, None

    def ship(self) -> None:
        import ray

        if self.ref is None:
            self.ref = ray.put(self.value)

    def get(self) -> Any:
        if self.value is None:
            import ray

            self.value = ray.get(self.ref)
        return self.value

    def __getstate__(self) -> dict:
        return ({"value": None, "ref": self.ref} if self.ref is not None
                else {"value": self.value, "ref": None})
