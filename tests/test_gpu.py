"""GPU checks that need only torch with CUDA (no vLLM, Ray or DeepSpeed): the learner's collectives in a
one-rank NCCL group, where a CPU tensor is refused, and the bfloat16 log-prob path.

They skip with the reason where CUDA is absent. Without pytest (a bare torch machine), run them with
``python tests/test_gpu.py``: each prints PASS, SKIP (reason) or FAIL, and the exit status is 1 on a
failure or when nothing ran. The gloo versions of the same checks with several ranks are in
tests/test_collectives.py.
"""

from __future__ import annotations

import os
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository, also without pytest
from learner.ppo import (
    DistributedReducer,
    global_loss_denominator,
    global_whiten,
    loss_denominator,
    masked_whiten,
)
from services.logprobs import token_logprobs

try:
    import pytest
except ImportError:  # a bare torch machine: the __main__ runner below stands in
    pytest = None


class Skipped(Exception):
    pass


def skip(reason: str):
    if pytest is not None:
        pytest.skip(reason)
    raise Skipped(reason)


def gpu(fn):
    return pytest.mark.gpu(fn) if pytest is not None else fn


def require_cuda() -> None:
    if not torch.cuda.is_available():
        skip(f"needs a CUDA device (torch {torch.__version__}, CUDA build {torch.version.cuda})")


@contextmanager
def one_rank_nccl_group():
    """torch.distributed over NCCL with a single rank (a FileStore rendezvous, nothing listens)."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_nccl_available():
        skip("this torch has no NCCL backend")
    torch.cuda.set_device(0)
    with tempfile.TemporaryDirectory() as tmp:
        store = dist.FileStore(os.path.join(tmp, "store"), 1)
        dist.init_process_group("nccl", store=store, rank=0, world_size=1, device_id=torch.device("cuda", 0))
        try:
            yield
        finally:
            dist.destroy_process_group()


def ragged_batch(device: str):
    g = torch.Generator().manual_seed(11)
    x = torch.randn(6, 9, generator=g)
    mask = (torch.arange(9) < torch.tensor([9, 4, 0, 1, 7, 9])[:, None]).float()
    return x.to(device), mask.to(device)


@gpu
def test_whitening_and_loss_counts_all_reduce_on_cuda_in_an_nccl_group():
    """An NCCL all-reduce refuses CPU tensors: the moments and counts must live on the rank's device."""
    require_cuda()
    x, mask = ragged_batch("cuda")
    with one_rank_nccl_group():
        reducer = DistributedReducer(x.device)
        whitened = global_whiten(x, mask, reducer)
        counts = {a: global_loss_denominator(mask, a, reducer) for a in ("token_mean", "sequence_mean")}
    expected = masked_whiten(x.double().cpu(), mask.double().cpu()).float()
    assert whitened.device.type == "cuda"
    assert torch.allclose(whitened.cpu(), expected, atol=1e-5), float((whitened.cpu() - expected).abs().max())
    for aggregation, count in counts.items():
        assert count.device.type == "cuda"
        assert float(count) == float(loss_denominator(mask.cpu(), aggregation)), aggregation


@gpu
def test_bfloat16_logits_give_float32_logprobs_on_cuda():
    """A bf16 policy's logits: the log-probs are taken in float32 and match a float64 reference of the
    same bf16 values; taken in bf16 they would be off by about 1e-2."""
    require_cuda()
    g = torch.Generator().manual_seed(12)
    hidden = torch.randn(4, 7, 64, generator=g)
    head = torch.randn(64, 1000, generator=g) / 8
    ids = torch.randint(0, 1000, (4, 7), generator=g)
    logits = (hidden.to("cuda", torch.bfloat16) @ head.to("cuda", torch.bfloat16))  # a bf16 LM head on CUDA
    got = token_logprobs(logits, ids.cuda())
    reference = torch.log_softmax(logits.double().cpu(), -1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    assert got.dtype == torch.float32 and got.device.type == "cuda"
    error = float((got.double().cpu() - reference).abs().max())
    assert error < 1e-4, error
    in_bf16 = torch.log_softmax(logits, -1).gather(-1, ids.cuda().unsqueeze(-1)).squeeze(-1)
    assert float((in_bf16.double().cpu() - reference).abs().max()) > 10 * error


if __name__ == "__main__":
    pytest = None  # skip() raises Skipped, which the runner reports, even where pytest is installed
    results = {}
    for name, fn in list(globals().items()):
        if not (name.startswith("test_") and callable(fn)):
            continue
        try:
            fn()
            results[name] = "PASS"
        except Skipped as why:
            results[name] = f"SKIP ({why})"
        except Exception as err:  # noqa: BLE001 - reported, and the exit status says it failed
            results[name] = f"FAIL ({type(err).__name__}: {err})"
        print(f"{name}: {results[name]}", flush=True)
    passed = sum(r == "PASS" for r in results.values())
    failed = sum(r.startswith("FAIL") for r in results.values())
    print(f"{passed} passed, {failed} failed, {len(results) - passed - failed} skipped")
    sys.exit(1 if failed or not passed else 0)
