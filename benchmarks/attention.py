"""The learner's attention on CPU, sdpa against eager (``learner.attention``), in one process, in turn:

- what ``learner.attention: auto`` times (``services.attention_choice.time_attention``: one layer's
  attention of SmolLM2-135M's shape, forward and backward, 2048 tokens) over padded rows of 64 to 2048 tokens
  and packed micro-batches of 512, float32 and bfloat16;
- the whole policy's forward and backward (SmolLM2-135M, 64 rows x 77 tokens, the sampled tokens' log-probs),
  both ways, at ``--dtype``.

    .venv/bin/python benchmarks/attention.py [--threads 2] [--dtype bfloat16]

Writes ``benchmarks/results/attention.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench import RESULTS, stamp, write_results

LENGTHS = (64, 96, 128, 256, 512, 1024, 2048)


def whole_policy(model_dir: str, dtype: str, reps: int = 3) -> dict[str, float]:
    """Median seconds of the policy's forward and backward over 64 x 77 tokens (45 prompt, 32 response), the
    loss the sampled tokens' log-probs, with each attention in turn."""
    import torch

    from learner.policy_model import PolicyWithValueHead
    from services.logprobs import token_logprobs
    from services.models import load_causal_lm

    policies = {attention: PolicyWithValueHead(load_causal_lm(model_dir, "float32", attention), None,
                                               value_head=False).to(getattr(torch, dtype))
                for attention in ("sdpa", "eager")}
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 49152, (64, 77), generator=g)
    mask = torch.ones(64, 77, dtype=torch.long)
    mask[:8, :5] = 0  # some left padding, as prompts of different lengths give
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    seconds = {name: [] for name in policies}
    for rep in range(reps + 1):
        for name, policy in policies.items():
            start = time.perf_counter()
            logits, _ = policy(ids, mask, positions, 45)
            (-token_logprobs(logits, ids[:, 45:]).mean()).backward()
            policy.zero_grad(set_to_none=True)
            if rep:  # the first: warm-up
                seconds[name].append(time.perf_counter() - start)
    return {name: statistics.median(s) for name, s in seconds.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", default="bfloat16", help="the whole policy's dtype")
    args = parser.parse_args()
    import torch
    from trl_smollm2 import smollm2_model

    from services.attention_choice import attention_shape, choose, time_attention

    torch.set_num_threads(args.threads)
    model_dir = str(smollm2_model())
    shape = attention_shape(model_dir)
    layer = []
    for dtype in ("float32", "bfloat16"):
        for length, packed in [(n, False) for n in LENGTHS] + [(512, True)]:
            t = time_attention(shape, dtype, length, args.threads, packed)
            layer.append({"dtype": dtype, "length": length, "packed": packed, "sdpa_s": t.sdpa_s,
                          "eager_s": t.eager_s, "speedup": t.speedup, "auto": choose(t)})
            print(layer[-1], flush=True)
    policy = whole_policy(model_dir, args.dtype)
    results = {**stamp(), "threads": args.threads, "shape": shape, "layer": layer,
               "whole_policy": {"dtype": args.dtype, **policy}}
    rows = [(f"SmolLM2-135M's attention ({shape[0]} heads, {shape[1]} key/value heads, width {shape[2]}), "
             f"{args.threads} threads, {results['date']}, {results['machine']}; "
             "`.venv/bin/python benchmarks/attention.py`"), "",
            "| dtype | tokens a row | layout | sdpa ms | eager ms | eager's speedup | auto takes |",
            "|---|---|---|---|---|---|---|"]
    rows += [f"| {r['dtype']} | {r['length']} | {'packed' if r['packed'] else 'padded'} | "
             f"{r['sdpa_s'] * 1e3:.1f} | {r['eager_s'] * 1e3:.1f} | {r['speedup']:.2f}x | {r['auto']} |"
             for r in layer]
    rows += ["", (f"The whole policy's forward and backward, 64 x 77 tokens, {args.dtype}: sdpa "
                  f"{policy['sdpa']:.2f} s, eager {policy['eager']:.2f} s "
                  f"({policy['sdpa'] / policy['eager']:.2f}x)")]
    write_results(RESULTS, "attention", results, rows)
    print("\n".join(rows))


if __name__ == "__main__":
    main()
