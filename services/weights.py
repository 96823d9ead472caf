"""The policy's full weights as they travel through Ray's object store to the engines (the CPU sync path).

Ray pickles a ``torch.Tensor`` in band: ``ray.put`` serialises every tensor's bytes into the pickle and
copies that into the object store, and every ``ray.get`` unpickles a private copy (measured on SmolLM2's
621 MiB: 1.5 s to put, 1.3 s to get, 19x and 16x a memcpy). A numpy array goes out of band instead: one copy
into the store on ``put``, and a reader on the same node maps the stored bytes in place. So each tensor
travels as its raw bytes in a ``uint8`` array, with its dtype and shape beside it (bfloat16 has no numpy
dtype), and ``tensors()`` views those bytes as torch tensors again, without a copy.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping

import torch


class HostWeights:
    """{HF parameter name: tensor} in ``dtype`` on the host, kept as raw bytes for the object store."""

    def __init__(self, state: Mapping[str, torch.Tensor], dtype: torch.dtype,
                 adapter_config: dict | None = None) -> None:
        """``adapter_config``: the weights are a LoRA adapter (PEFT's names and its adapter_config.json), not
        the policy's parameters (``learner.lora``, adapter-only sync)."""
        self.dtype = str(dtype).removeprefix("torch.")
        self.adapter_config = adapter_config
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.buffers = {}
        for name, tensor in state.items():
            # no copy for a contiguous host tensor already in ``dtype``: ``ray.put`` makes the one copy
            host = tensor.detach().to("cpu", dtype).contiguous()
            self.shapes[name] = tuple(host.shape)
            self.buffers[name] = host.reshape(-1).view(torch.uint8).numpy()

    def __len__(self) -> int:
        return len(self.buffers)

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buffers.values())

    def tensors(self) -> dict[str, torch.Tensor]:
        """The weights as tensors over the stored bytes (read-only when they come from the object store:
        load them into a model, never write them)."""
        dtype = getattr(torch, self.dtype)
        with warnings.catch_warnings():  # torch warns that a read-only array gives a read-only tensor
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            return {name: torch.from_numpy(self.buffers[name]).view(dtype).reshape(shape)
                    for name, shape in self.shapes.items()}
