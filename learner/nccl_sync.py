"""Learner rank 0 -> vLLM workers weight sync over NCCL, in packed buckets.

Both sides plan the same buckets from the same metadata: ``plan_buckets`` groups the
``(name, dtype, shape)`` entries in order, ``bucket_layout`` gives every tensor a byte offset in its
bucket, ``pack_bucket`` / ``unpack_bucket`` copy tensors into and view them out of one flat ``uint8``
buffer. The sender (``WeightBroadcaster``, NCCL rank 0) broadcasts one buffer per bucket; each worker
(``receive_buckets`` inside ``actors.vllm_extension.WeightSyncExtension``) allocates the same buffer,
receives it, and unpacks it. The packing is pure torch and runs on CPU; only the communicator needs CUDA,
and everything from vLLM is imported inside the functions that need it.

The group is a vLLM ``StatelessProcessGroup`` (a TCP store for the NCCL unique id) plus a
``PyNcclCommunicator``, so it never touches the default ``torch.distributed`` group DeepSpeed uses.
Rank 0 is the learner; the workers of an engine take ranks ``rank_offset + their rank in the engine``.
Creating the group is collective: rank 0 and every worker must be inside it at the same time, and so
must every ``broadcast`` / ``receive_policy_weights`` pair.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

# Every tensor starts at a multiple of this many bytes, so a slice of the uint8 buffer can be viewed
# as any dtype (the largest element, complex128, is 16 bytes) and kernels see aligned pointers.
ALIGN = 16

Metadata = list[tuple[str, str, list[int]]]


@dataclass(frozen=True)
class Slot:
    """Where one tensor lives in its bucket's flat buffer."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


def to_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"unknown torch dtype {name!r}")
    return dtype


def _nbytes(dtype: str, shape: Sequence[int]) -> int:
    numel = 1
    for size in shape:
        numel *= int(size)
    return numel * to_dtype(dtype).itemsize


def _aligned(offset: int) -> int:
    return -(-offset // ALIGN) * ALIGN


def weight_metadata(named_tensors: Iterable[tuple[str, Tensor]]) -> Metadata:
    """``[(name, dtype name, shape)]`` in order: all a receiver needs to plan the same buckets."""
    return [(name, dtype_name(t.dtype), list(t.shape)) for name, t in named_tensors]


def plan_buckets(metadata: Iterable[Sequence], bucket_bytes: int) -> list[Metadata]:
    """Group metadata entries, in order, into buckets whose laid-out size is at most ``bucket_bytes``.

    A tensor larger than the bound gets a bucket of its own. Entries may arrive as lists (after
    serialisation) or tuples; they come back as tuples.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    buckets: list[Metadata] = []
    current: Metadata = []
    end = 0
    for name, dtype, shape in metadata:
        entry = (str(name), str(dtype), [int(s) for s in shape])
        nbytes = _nbytes(entry[1], entry[2])
        start = _aligned(end)
        if current and start + nbytes > bucket_bytes:
            buckets.append(current)
            current, start = [], 0
        current.append(entry)
        end = start + nbytes
    if current:
        buckets.append(current)
    return buckets


def bucket_layout(bucket: Iterable[Sequence]) -> tuple[int, list[Slot]]:
    """(total bytes, slots) of one bucket; the same function on both sides keeps the offsets equal."""
    slots: list[Slot] = []
    end = 0
    for name, dtype, shape in bucket:
        shape = tuple(int(s) for s in shape)
        offset = _aligned(end)
        nbytes = _nbytes(str(dtype), shape)
        slots.append(Slot(str(name), str(dtype), shape, offset, nbytes))
        end = offset + nbytes
    return end, slots


def bucketize(named_tensors: Sequence[tuple[str, Tensor]],
              bucket_bytes: int) -> list[list[tuple[str, Tensor]]]:
    """Split ``named_tensors``, in order, into the buckets ``plan_buckets`` plans for their metadata."""
    buckets, i = [], 0
    for planned in plan_buckets(weight_metadata(named_tensors), bucket_bytes):
        buckets.append(list(named_tensors[i:i + len(planned)]))
        i += len(planned)
    return buckets


def pack_bucket(named: Sequence[tuple[str, Tensor]],
                device: torch.device | str | None = None) -> tuple[Tensor, list[Slot]]:
    """Copy ``named`` tensors into one flat ``uint8`` buffer (on ``device``, else the first tensor's)."""
    total, layout = bucket_layout(weight_metadata(named))
    if device is None:
        device = named[0][1].device if named else "cpu"
    flat = torch.zeros(total, dtype=torch.uint8, device=device)  # zeroed: padding bytes are deterministic
    for (_, tensor), slot in zip(named, layout, strict=True):
        _view(flat, slot).copy_(tensor.detach())
    return flat, layout


def unpack_bucket(flat: Tensor, layout: Sequence[Slot]) -> list[tuple[str, Tensor]]:
    """Named views into ``flat`` (no copies): valid while ``flat`` is, and not to be written through."""
    return [(slot.name, _view(flat, slot)) for slot in layout]


def _view(flat: Tensor, slot: Slot) -> Tensor:
    return flat[slot.offset:slot.offset + slot.nbytes].view(to_dtype(slot.dtype)).view(slot.shape)


def receive_buckets(comm, metadata: Iterable[Sequence], bucket_bytes: int, src: int = 0,
                    device: torch.device | str | None = None) -> Iterator[tuple[str, Tensor]]:
    """Receive the buckets ``src`` broadcasts, lazily: bucket k+1 is received only once the consumer
    has taken every tensor of bucket k. Yields views into each bucket's buffer, in metadata order.

    ``comm`` needs ``broadcast(tensor, src)`` and ``device`` (a ``PyNcclCommunicator`` has both).
    """
    device = comm.device if device is None else device
    for planned in plan_buckets(metadata, bucket_bytes):
        total, layout = bucket_layout(planned)
        flat = torch.empty(total, dtype=torch.uint8, device=device)
        comm.broadcast(flat, src=src)
        yield from unpack_bucket(flat, layout)


# ---------------------------------------------------------------------------------- NCCL (CUDA only)


def _nccl_env():
    """vLLM pins some NCCL_* variables for its own communicators; groups shared with another process
    are built without those pins (where this vLLM has the helper), the same way on both sides."""
    try:
        from vllm.utils.nccl import unpinned_nccl_env
    except ImportError:
        return contextlib.nullcontext()
    return unpinned_nccl_env()


def join_weight_sync_group(master_address: str, master_port: int, rank: int, world_size: int,
                           device: torch.device | int | str):
    """Join the weight-sync group as ``rank``; rank 0 serves the TCP store on master_address:master_port.

    Collective: returns only once all ``world_size`` ranks have joined. Returns the PyNcclCommunicator.
    """
    from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
    from vllm.distributed.utils import StatelessProcessGroup

    device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"NCCL weight sync needs a CUDA device, got {device}")
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if world_size < 2:
        raise ValueError(f"a weight-sync group needs the learner and a worker, got world_size={world_size}")
    group = StatelessProcessGroup.create(host=master_address, port=master_port, rank=rank,
                                         world_size=world_size)
    with torch.cuda.device(device), _nccl_env():
        comm = PyNcclCommunicator(group, device=device)
    if comm.disabled:  # its broadcast would silently do nothing
        raise RuntimeError("vLLM's PyNcclCommunicator is disabled: no NCCL library or VLLM_DISABLE_PYNCCL")
    return comm


class WeightBroadcaster:
    """The learner end (NCCL rank 0) of the weight-sync group.

    Build it while the workers run ``init_weight_sync_group`` (the rendezvous is collective), and call
    ``broadcast`` while they run ``receive_policy_weights`` with ``weight_metadata`` of the same tensors
    and the same ``bucket_bytes``.
    """

    def __init__(self, master_address: str, master_port: int, world_size: int,
                 device: torch.device | int | str) -> None:
        self.comm = join_weight_sync_group(master_address, master_port, 0, world_size, device)
        self.device = self.comm.device

    def broadcast(self, named_tensors: Sequence[tuple[str, Tensor]], bucket_bytes: int) -> int:
        """Send every bucket in order; returns the number of buckets. Tensors may live on any device."""
        buckets = bucketize(list(named_tensors), bucket_bytes)
        with torch.cuda.device(self.device):
            stream = torch.cuda.current_stream()
            for bucket in buckets:
                # pack and send on the same stream: the allocator may reuse a sent buffer for the next
                # bucket only after the broadcast that reads it
                flat, _ = pack_bucket(bucket, device=self.device)
                self.comm.broadcast(flat, src=0, stream=stream)
            stream.synchronize()  # surface NCCL errors here, and the caller may free its tensors
        return len(buckets)

    def close(self) -> None:
        self.comm.destroy()
