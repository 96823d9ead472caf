"""Sampled-token log-probs and entropy at a SmolLM2-sized vocabulary: ``learner.ppo.token_logprobs`` (chunked,
no [B, T, V] log-softmax) and ``entropy_from_logits`` against the full ``log_softmax`` + ``gather``, forward
and backward, in one process, alternating. Reports median CPU seconds and their ratio.

    .venv/bin/python benchmarks/logprob.py [--rows 512] [--vocab 49152] [--threads 2] [--reps 7]
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
    parser.add_argument("--rows", type=int, default=512, help="B x T positions")
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--reps", type=int, default=7)
    args = parser.parse_args()
    import torch

    from learner.ppo import entropy_from_logits, token_logprobs

    torch.set_num_threads(args.threads)

    def full_logprobs(logits, ids):
        return torch.log_softmax(logits.float(), -1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)

    def full_entropy(logits):
        log_p = torch.log_softmax(logits.float(), -1)
        return -(log_p.exp() * log_p).sum(-1)

    g = torch.Generator().manual_seed(0)
    base = torch.randn(1, args.rows, args.vocab, generator=g)
    ids = torch.randint(0, args.vocab, (1, args.rows), generator=g)
    cpu = {name: [] for name in ("full fwd+bwd", "chunked fwd+bwd", "full entropy", "chunked entropy")}
    for _ in range(args.reps):
        for name, f in (("full fwd+bwd", full_logprobs), ("chunked fwd+bwd", token_logprobs)):
            x = base.clone().requires_grad_(True)
            start = time.process_time()
            f(x, ids).sum().backward()
            cpu[name].append(time.process_time() - start)
        for name, f in (("full entropy", full_entropy), ("chunked entropy", entropy_from_logits)):
            start = time.process_time()
            f(base)
            cpu[name].append(time.process_time() - start)
    m = {k: median(v[1:]) for k, v in cpu.items()}
    print(f"{machine()}, {args.threads} threads, {args.rows} x {args.vocab} fp32 logits, "
          f"median of {args.reps - 1}")
    print(f"log-probs forward+backward CPU s: full {m['full fwd+bwd']:.3f}, "
          f"chunked {m['chunked fwd+bwd']:.3f} ({m['full fwd+bwd'] / m['chunked fwd+bwd']:.2f}x)")
    print(f"entropy (no grad) CPU s: full {m['full entropy']:.3f}, chunked {m['chunked entropy']:.3f} "
          f"({m['full entropy'] / m['chunked entropy']:.2f}x)")


if __name__ == "__main__":
    main()
