"""Sampled-token log-probs and entropy at a SmolLM2-sized vocabulary: ``services.logprobs``' fused pass
(``token_logprobs_and_entropy``: chunked, at the temperature, no [B, T, V] log-softmax, upcast or scaled copy,
the gradient written in the logits' dtype) against the plain form (the logits upcast and scaled whole, then
``log_softmax`` + ``gather`` and the entropy), forward and backward, in one process, alternating. Reports
median CPU seconds and their ratio for float32 and bfloat16 logits.

    .venv/bin/python benchmarks/logprob.py [--rows 2048] [--vocab 49152] [--threads 2] [--reps 7]
"""

from __future__ import annotations

import argparse
import time

from _bench import machine


def median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=2048, help="B x T positions")
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--temperature", type=float, default=0.9)
    args = parser.parse_args()
    import torch

    from services.logprobs import token_logprobs_and_entropy

    torch.set_num_threads(args.threads)
    t = args.temperature

    def plain(logits, ids):
        log_p = torch.log_softmax(logits.float() / t, -1)
        with torch.no_grad():
            entropy = -(log_p.exp() * log_p).sum(-1)
        return log_p.gather(-1, ids.unsqueeze(-1)).squeeze(-1), entropy

    def fused(logits, ids):
        return token_logprobs_and_entropy(logits, ids, t)

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, args.vocab, (1, args.rows), generator=g)
    print(f"{machine()}, {args.threads} threads, {args.rows} x {args.vocab} logits, temperature {t}, "
          f"median of {args.reps - 1}")
    for dtype in (torch.float32, torch.bfloat16):
        base = torch.randn(1, args.rows, args.vocab, generator=g).to(dtype)
        cpu = {"plain": [], "fused": []}
        for _ in range(args.reps):
            for name, f in (("plain", plain), ("fused", fused)):
                x = base.clone().requires_grad_(True)
                start = time.process_time()
                f(x, ids)[0].sum().backward()
                cpu[name].append(time.process_time() - start)
        m = {k: median(v[1:]) for k, v in cpu.items()}
        print(f"{str(dtype).removeprefix('torch.')} log-probs + entropy, forward+backward CPU s: plain "
              f"{m['plain']:.3f}, fused {m['fused']:.3f} ({m['plain'] / m['fused']:.2f}x)")


if __name__ == "__main__":
    main()
