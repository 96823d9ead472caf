"""Log-probs of given tokens under a model's logits, in float32 and chunk by chunk: the learner's, the
reference's and the probe's. Pure torch (``pytest -m gpu`` imports it on a machine with torch alone)."""

from __future__ import annotations

import torch
from torch import Tensor


def token_logprobs(logits: Tensor, ids: Tensor, temperature: float = 1.0, chunk_rows: int = 128) -> Tensor:
    """[B, T] float32 log-prob of ``ids`` [B, T] under ``softmax(logits / temperature)``, ``logits`` [B, T, V]
    in any float dtype. The forward runs ``chunk_rows`` positions at a time and keeps only the logits for
    backward: no [B, T, V] log-softmax is built or kept. It runs in float32: in bfloat16 it would be
    off by about 1e-2."""
    flat, flat_ids = logits.reshape(-1, logits.shape[-1]), ids.reshape(-1)
    return _ChunkedTokenLogprobs.apply(flat, flat_ids, float(temperature), int(chunk_rows)).reshape(ids.shape)


class _ChunkedTokenLogprobs(torch.autograd.Function):
    """log_softmax(x / t)[id] per row of ``x`` [N, V], chunk by chunk; backward (onehot(id) - softmax(x / t))
    * g / t straight into the [N, V] gradient."""

    @staticmethod
    def forward(ctx, flat: Tensor, ids: Tensor, temperature: float, chunk_rows: int) -> Tensor:
        out = torch.empty(flat.shape[0], dtype=torch.float32, device=flat.device)
        for start in range(0, flat.shape[0], chunk_rows):
            rows = slice(start, start + chunk_rows)
            log_p = torch.log_softmax(_scaled(flat[rows], temperature), dim=-1)
            out[rows] = log_p.gather(-1, ids[rows, None]).squeeze(-1)
        ctx.save_for_backward(flat, ids)
        ctx.temperature, ctx.chunk_rows = temperature, chunk_rows
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        flat, ids = ctx.saved_tensors
        scale = grad_out.float()[:, None] / ctx.temperature
        # the softmax is the [N, V] gradient's own buffer: nothing else of that size is allocated
        grad = torch.softmax(_scaled(flat, ctx.temperature), dim=-1).mul_(-scale)
        grad.scatter_add_(-1, ids[:, None], scale)
        return grad.to(flat.dtype), None, None, None


def _scaled(logits: Tensor, temperature: float) -> Tensor:
    """``logits`` in float32, divided by ``temperature`` (no copy when it is 1 and they are float32)."""
    return logits.float() if temperature == 1.0 else logits.float() / temperature
