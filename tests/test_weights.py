"""``HostWeights``: the policy's weights through Ray's object store, bit for bit, read in place."""

from __future__ import annotations

import pytest
import torch

from services.weights import HostWeights

ray = pytest.importorskip("ray")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weights_come_back_bit_for_bit_from_the_object_store_without_a_copy(ray_client, dtype):
    g = torch.Generator().manual_seed(0)
    embedding = torch.randn(7, 5, generator=g)
    state = {"wte.weight": embedding, "lm_head.weight": embedding,  # tied, as GPT-2's state_dict has them
             "ln.bias": torch.randn(5, generator=g), "scale": torch.tensor(0.5),  # a 0-dim tensor too
             "strided": torch.randn(5, 7, generator=g).t()}  # not contiguous
    sent = HostWeights(state, dtype)
    received = ray.get(ray.put(sent))
    got = received.tensors()
    assert list(got) == list(state) and len(sent) == len(state)
    for name, tensor in state.items():
        assert got[name].dtype == dtype and got[name].shape == tensor.shape, name
        assert torch.equal(got[name], tensor.to(dtype)), name
    for name, tensor in got.items():  # read in place: views of the store's (read-only) memory, not copies
        assert not received.buffers[name].flags.writeable, name
        assert tensor.data_ptr() == received.buffers[name].ctypes.data, name
