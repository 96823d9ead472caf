"""``learner.dtype: auto``: the learner's dtype chosen from a measurement on this CPU, not assumed.

CPUs of one kind differ: with AMX a bf16 matmul runs several times faster than fp32, with AVX-512 BF16 alone
some, and on some CPUs without either it is slower. So the driver times the matmuls of the model's own widths
(its MLP's two and the LM head's, forward and backward) in both dtypes, in turn, on the learner's threads, and
picks bf16 only where it is at least ``BF16_MIN_SPEEDUP`` faster: fp32 is exact, and the probe's tolerance,
the engines' numerics and the KL's rounding all follow the learner's dtype.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

BF16_MIN_SPEEDUP = 1.2
TOKENS = 256  # rows of the timed matmuls: a micro-batch's worth of tokens
# below this a pass is the kernels' overhead, not their arithmetic (the default job's model: 0.05 GFLOP), and
# its timing a coin toss between two near-equal figures: float32, untimed
MIN_TIMED_FLOPS = 1e9


@dataclass(frozen=True)
class DtypeTiming:
    """Seconds of one pass over the model-shaped matmuls, in each dtype (medians of ``rounds``)."""

    float32_s: float
    bfloat16_s: float
    flops: float  # of one pass
    threads: int

    @property
    def speedup(self) -> float:
        """bf16 over fp32: above 1 when bf16 is faster."""
        return self.float32_s / self.bfloat16_s

    def describe(self) -> str:
        return (f"float32 {self.flops / self.float32_s / 1e9:.0f} GFLOP/s, bfloat16 "
                f"{self.flops / self.bfloat16_s / 1e9:.0f} GFLOP/s ({self.speedup:.2f}x) on model-shaped "
                f"matmuls, forward and backward, {self.threads} thread(s)")


def choose(timing: DtypeTiming) -> str:
    """bfloat16 where it is at least ``BF16_MIN_SPEEDUP`` times faster than float32, else float32."""
    return "bfloat16" if timing.speedup >= BF16_MIN_SPEEDUP else "float32"


def model_widths(model_dir: str | Path) -> tuple[int, int, int]:
    """(hidden, MLP width, vocabulary) from a Hugging Face ``config.json`` (GPT-2's names too)."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    hidden = config.get("hidden_size") or config["n_embd"]
    inner = config.get("intermediate_size") or config.get("n_inner") or 4 * hidden
    return hidden, inner, config["vocab_size"]


def too_small_to_time(model_dir: str | Path) -> str | None:
    """Why the model's kernels are not worth timing (a pass of its matmuls under ``MIN_TIMED_FLOPS``), or
    None."""
    flops = pass_flops(model_widths(model_dir))
    return (f"a pass of the model's matmuls: {flops / 1e6:.0f} MFLOP, too small to time"
            if flops < MIN_TIMED_FLOPS else None)


def pass_flops(widths: tuple[int, int, int]) -> float:
    """FLOPs of one pass of ``time_dtypes``: each matmul forward and its two backward."""
    return sum(3 * 2 * TOKENS * k * n for k, n in matmul_shapes(widths))


def matmul_shapes(widths: tuple[int, int, int]) -> list[tuple[int, int]]:
    """(in, out) of the MLP's two matmuls and the LM head's."""
    hidden, inner, vocab = widths
    return [(hidden, inner), (inner, hidden), (hidden, vocab)]


def seconds_in_turn(passes: dict, threads: int, rounds: int) -> dict:
    """{name: median seconds of ``passes[name]()``} on ``threads`` torch threads: each pass once to warm up
    (the kernels' first call), then ``rounds`` rounds of every pass in turn, so that a machine's drift falls
    on all of them."""
    import torch

    def seconds(one_pass) -> float:
        start = time.perf_counter()
        one_pass()
        return time.perf_counter() - start

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for one_pass in passes.values():
            one_pass()
        timed = {name: [] for name in passes}
        for _ in range(rounds):
            for name, one_pass in passes.items():
                timed[name].append(seconds(one_pass))
    finally:
        torch.set_num_threads(before)
    return {name: statistics.median(values) for name, values in timed.items()}


def time_dtypes(widths: tuple[int, int, int], threads: int, rounds: int = 3) -> DtypeTiming:
    """Both dtypes timed in turn (fp32, bf16, fp32, ...), so that a machine's drift falls on both."""
    import torch

    generator = torch.Generator().manual_seed(0)
    data = {dtype: [(torch.randn(TOKENS, k, generator=generator).to(dtype),
                     torch.randn(k, n, generator=generator).to(dtype),
                     torch.randn(TOKENS, n, generator=generator).to(dtype)) for k, n in matmul_shapes(widths)]
            for dtype in (torch.float32, torch.bfloat16)}

    def one_pass(dtype):
        def run() -> None:
            for x, w, grad in data[dtype]:
                x @ w  # forward
                grad @ w.T  # backward: the input's gradient
                x.T @ grad  # ... and the weight's
        return run

    seconds = seconds_in_turn({dtype: one_pass(dtype) for dtype in data}, threads, rounds)
    return DtypeTiming(seconds[torch.float32], seconds[torch.bfloat16], pass_flops(widths), threads)
