"""``learner.attention: auto``: the learner's attention kernel chosen from a measurement on this CPU, not
assumed.

On CPU, torch's fused attention (SDPA's flash kernel) pays a fixed cost per block of queries and keys: on
short sequences in bfloat16 its backward is several times slower than the plain form (two batched matmuls
and a softmax, transformers' ``eager``), while on long ones, or in float32, SDPA wins. So the driver times one
layer's attention of the policy's shape (heads, key/value heads, head width), forward and backward, at the
learner's dtype and the job's sequence shape, each way in turn, and takes ``eager`` only where it is at least
``EAGER_MIN_SPEEDUP`` faster. Both compute the same attention: the choice moves only the rounding.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

EAGER_MIN_SPEEDUP = 1.2
TOKENS = 2048  # tokens of the timed batch


@dataclass(frozen=True)
class AttentionTiming:
    """Seconds of one decoder layer's forward and backward with each implementation (medians)."""

    sdpa_s: float
    eager_s: float
    rows: int
    length: int

    @property
    def speedup(self) -> float:
        """eager over sdpa: above 1 when eager is faster."""
        return self.sdpa_s / self.eager_s

    def describe(self) -> str:
        return (f"one layer's attention over {self.rows} x {self.length} tokens, forward and backward: sdpa "
                f"{self.sdpa_s * 1e3:.0f} ms, eager {self.eager_s * 1e3:.0f} ms ({self.speedup:.2f}x)")


def choose(timing: AttentionTiming) -> str:
    """eager where it is at least ``EAGER_MIN_SPEEDUP`` times faster than sdpa, else sdpa."""
    return "eager" if timing.speedup >= EAGER_MIN_SPEEDUP else "sdpa"


def attention_shape(model_dir: str | Path) -> tuple[int, int, int]:
    """(query heads, key/value heads, head width) from a Hugging Face ``config.json`` (GPT-2's names too)."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    heads = config.get("num_attention_heads") or config["n_head"]
    hidden = config.get("hidden_size") or config["n_embd"]
    return heads, config.get("num_key_value_heads") or heads, config.get("head_dim") or hidden // heads


def attention_ways(shape: tuple[int, int, int], dtype: str, length: int, packed: bool, rows: int = 1):
    """({"sdpa": f, "eager": f}, (q, k, v)): one layer's attention of ``shape`` (heads, key/value heads,
    head width) over ``rows`` rows of ``length`` tokens in ``dtype`` (random queries, keys and values that
    take gradients), each ``f()`` its output [batch, heads, tokens, width]: SDPA with the boolean mask
    transformers gives it, and the eager form (keys and values repeated to the query heads, two batched
    matmuls, a float32 softmax over the additive mask). ``packed``: the rows as one sequence of packed ones,
    the mask block-diagonal (``learner.max_tokens_per_microbatch``), else padded rows, the first a quarter
    padding."""
    import torch
    import torch.nn.functional as F

    heads, kv_heads, width = shape
    torch_dtype = getattr(torch, dtype)
    generator = torch.Generator().manual_seed(0)
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    if packed:  # [1, 1, N, N]: each sequence sees itself alone
        batch, n, mask = 1, rows * length, torch.block_diag(*[causal] * rows)[None, None]
    else:  # [rows, 1, T, T]: causal, the first row's first quarter padding (a padding query sees itself)
        keys = torch.ones(rows, length, dtype=torch.bool)
        keys[0, : length // 4] = False
        itself = torch.eye(length, dtype=torch.bool)
        batch, n, mask = rows, length, causal[None, None] & (keys[:, None, None, :] | itself)
    q, k, v = (torch.randn(batch, h, n, width, generator=generator).to(torch_dtype).requires_grad_(True)
               for h in (heads, kv_heads, kv_heads))
    additive = torch.zeros(mask.shape, dtype=torch_dtype).masked_fill(~mask, torch.finfo(torch_dtype).min)

    def sdpa():
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=heads != kv_heads)

    def eager():
        k_all, v_all = (x.repeat_interleave(heads // kv_heads, dim=1) for x in (k, v))
        scores = q @ k_all.transpose(-1, -2) * width ** -0.5 + additive
        return torch.softmax(scores, dim=-1, dtype=torch.float32).to(torch_dtype) @ v_all

    return {"sdpa": sdpa, "eager": eager}, (q, k, v)


def time_attention(shape: tuple[int, int, int], dtype: str, length: int, threads: int, packed: bool,
                   rounds: int = 5) -> AttentionTiming:
    """``attention_ways`` over ``TOKENS // length`` rows, forward and backward, each way in turn, on
    ``threads`` threads (medians of ``rounds``)."""
    from services.dtype_choice import seconds_in_turn

    rows = max(1, TOKENS // length)
    ways, _ = attention_ways(shape, dtype, length, packed, rows)
    seconds = seconds_in_turn({name: lambda f=f: f().float().sum().backward() for name, f in ways.items()},
                              threads, rounds)
    return AttentionTiming(seconds["sdpa"], seconds["eager"], rows, length)
