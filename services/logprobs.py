"""Log-probs of given tokens under a model's logits, in float32 and chunk by chunk: the learner's, the
reference's and the probe's. Pure torch (``pytest -m gpu`` imports it on a machine with torch alone)."""

from __future__ import annotations

import torch
from torch import Tensor


def token_logprobs(logits: Tensor, ids: Tensor, temperature: float = 1.0, chunk_rows: int = 128) -> Tensor:
    """[B, T] float32 log-prob of ``ids`` [B, T] under ``softmax(logits / temperature)``, ``logits`` [B, T, V]
    in any float dtype. The forward runs ``chunk_rows`` positions at a time and keeps only the logits for
    backward: no [B, T, V] log-softmax, upcast or scaled copy is built or kept. It runs in float32: in
    bfloat16 it would be off by about 1e-2."""
    return token_logprobs_and_entropy(logits, ids, temperature, chunk_rows, entropy=False)[0]


def token_logprobs_and_entropy(logits: Tensor, ids: Tensor, temperature: float = 1.0, chunk_rows: int = 128,
                               entropy: bool = True) -> tuple[Tensor, Tensor | None]:
    """``token_logprobs`` and, from the same pass over the logits, the [B, T] float32 entropy of
    ``softmax(logits / temperature)`` (no gradient; None without ``entropy``)."""
    flat, flat_ids = logits.reshape(-1, logits.shape[-1]), ids.reshape(-1)
    logprobs, entropies = _ChunkedTokenLogprobs.apply(flat, flat_ids, float(temperature), int(chunk_rows),
                                                      entropy)
    return logprobs.reshape(ids.shape), entropies.reshape(ids.shape) if entropy else None


class _ChunkedTokenLogprobs(torch.autograd.Function):
    """log_softmax(x / t)[id] per row of ``x`` [N, V], chunk by chunk (with the entropy where asked);
    backward (onehot(id) - softmax(x / t)) * g / t, chunk by chunk into a gradient of ``x``'s dtype."""

    @staticmethod
    def forward(ctx, flat: Tensor, ids: Tensor, temperature: float, chunk_rows: int, entropy: bool):
        out = torch.empty(flat.shape[0], dtype=torch.float32, device=flat.device)
        entropies = torch.empty(flat.shape[0] if entropy else 0, dtype=torch.float32, device=flat.device)
        for start in range(0, flat.shape[0], chunk_rows):
            rows = slice(start, start + chunk_rows)
            log_p = torch.log_softmax(_scaled(flat[rows], temperature), dim=-1)
            out[rows] = log_p.gather(-1, ids[rows, None]).squeeze(-1)
            if entropy:
                entropies[rows] = -(log_p.exp() * log_p).sum(dim=-1)
        ctx.save_for_backward(flat, ids)
        ctx.temperature, ctx.chunk_rows = temperature, chunk_rows
        ctx.mark_non_differentiable(entropies)
        return out, entropies

    @staticmethod
    def backward(ctx, grad_out: Tensor, _grad_entropy: Tensor):
        flat, ids = ctx.saved_tensors
        scale = grad_out.float()[:, None] / ctx.temperature
        grad = torch.empty_like(flat)
        for start in range(0, flat.shape[0], ctx.chunk_rows):
            rows = slice(start, start + ctx.chunk_rows)
            part = torch.softmax(_scaled(flat[rows], ctx.temperature), dim=-1).mul_(-scale[rows])
            grad[rows] = part.scatter_add_(-1, ids[rows, None], scale[rows])
        return grad, None, None, None, None


def _scaled(logits: Tensor, temperature: float) -> Tensor:
    """``logits`` in float32, divided by ``temperature`` (no copy when it is 1 and they are float32)."""
    return logits.float() if temperature == 1.0 else logits.float() / temperature
