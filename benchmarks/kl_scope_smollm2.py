"""Benchmark: does the adaptive controller hold a pretrained model's response KL at its target, fed the
response KL (``kl.scope: response_sum``, tether's default) or the per-token mean (``token_mean``, trlX's and
its heirs' choice)?

The ``smollm2-sentiment`` preset (SmolLM2-135M-Instruct, VADER's score of the response) with the controller
sized to bind within the run: 32 episodes a batch, ``kl.horizon`` 64 (``--horizon``: beta moves by up to
0.2 x 32/64 = 10% a batch, where the preset's 640 moves it 1%), so that over ``--iterations`` (45) beta can
move by up to e^(0.1 x 45), about 90x; the preset's own run at beta 0.05 overshot its 6 nats by 35% in 12
iterations with beta unmoved, and at horizon 128 (5% a batch) the policy's KL outran beta's return
(results/kl_scope_smollm2-horizon-128.md: 18.4% and 24.3% off the target). Beta starts at 0.15
(``--init-kl-coef``). ``--eos-penalty`` keeps the preset's missing-EOS penalty (a response cut at the cap
scores -1); by default it is off (``reward.missing_eos_penalty`` null): with it the policy learns to end its
responses early, an EOS the reference gives little probability, and measured at horizon 128
(results/kl_scope_smollm2-eos-penalty.md) the response KL then stayed at 7-8.5 nats while beta rose from
0.15 to 0.56, and from beta 0.05 at 9-10 nats (results/kl_scope_smollm2-init-0.05.md). Two runs a scope (run
seeds), one after the other:

- ``response_sum`` at the per-response target (6 nats, the preset's and lm-human-preferences');
- ``token_mean`` at that target over the mean response length the response-level runs settle at (their
  last third), so both aim at the same response KL.

Every ``--eval-every`` iterations the evaluation logs the KL of the current policy to the reference on its
own fresh samples (``eval_kl_response_mean``, nats per response): the KL the controller is meant to hold.
The figure: its mean absolute deviation from the per-response target over the run's last third (the aim for
``response_sum``: within 20%). Per iteration: the statistic the controller was fed, beta, the score and the
response length.

    .venv/bin/python benchmarks/kl_scope_smollm2.py [--scopes response_sum token_mean] [--seeds 1 2]
        [--iterations 45] [--eval-every 3] [--horizon 64] [-- extra learner.main args]

Writes benchmarks/results/kl_scope_smollm2-horizon-<H>.json, .md and .png (``--name`` another name); a
partial run keeps its rows, and a run already in the results is not run again (``--fresh`` runs them all).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench import RESULTS, ROOT, MeasuredJob, read_records, stamp, write_results

NAME = "kl_scope_smollm2"
PRESET = ROOT / "deploy" / "configs" / "smollm2-sentiment.yaml"
TARGET, HORIZON, INIT_KL_COEF = 6.0, 64, 0.15
FED = {"response_sum": "kl_response_mean", "token_mean": "kl_token_mean"}


def run(scope: str, target: float, init_kl_coef: float, horizon: int, eos_penalty: bool, seed: int,
        iterations: int, eval_every: int, out_dir: str, extra: list[str]) -> dict:
    name = f"{scope}-{seed}"
    args = ["--config", str(PRESET), *([] if eos_penalty else ["--reward.missing_eos_penalty", "null"]),
            "--kl.scope", scope, "--kl.target", f"{target:.6g}",
            "--kl.horizon", str(horizon), "--kl.init_kl_coef", str(init_kl_coef), "--run.seed", str(seed),
            "--run.iterations", str(iterations),
            "--run.eval_every", str(eval_every), *extra]
    job = MeasuredJob(["--run.output_dir", out_dir, "--run.name", name, "--checkpoint.every", "0",
                       *args]).run(timeout_s=3 * 3600)
    records = read_records(Path(out_dir) / name)
    evals = [(r["iteration"], r["eval_kl_response_mean"]) for r in records if "eval_kl_response_mean" in r]
    last = [kl for i, kl in evals if i > iterations * 2 / 3]
    tail = [r for r in records if r["iteration"] > iterations * 2 / 3]
    return {
        "args": args, "target": target, "init_kl_coef": init_kl_coef, "horizon": horizon,
        "wall_seconds": job.wall_seconds,
        "per_iteration": [{"iteration": r["iteration"], "fed": r[FED[scope]], "kl_coef": r["kl_coef"],
                           "kl_response_mean": r["kl_response_mean"], "kl_token_mean": r["kl_token_mean"],
                           "score_mean": r["score_mean"], "response_length_mean": r["response_length_mean"],
                           "eval_kl_response_mean": r.get("eval_kl_response_mean")} for r in records],
        "eval_kl": evals,
        "settled_eval_kl": sum(last) / len(last),
        "mean_abs_deviation": sum(abs(kl / TARGET - 1) for kl in last) / len(last),
        "settled_response_length": sum(r["response_length_mean"] for r in tail) / len(tail),
        "settled_score": sum(r["score_mean"] for r in tail) / len(tail),
        "kl_coef_final": records[-1]["kl_coef"],
    }


def token_target(results: dict) -> float | None:
    """The per-response target over the response length the response-level runs settle at."""
    lengths = [r["settled_response_length"] for k, r in results.items() if k.startswith("response_sum/")]
    return TARGET / (sum(lengths) / len(lengths)) if lengths else None


def table(results: dict, command: str, eos_penalty: bool, horizon: int) -> list[str]:
    rows = [(f"smollm2-sentiment preset ({'with' if eos_penalty else 'without'} its missing-EOS penalty), "
             f"kl.horizon {horizon} (32 episodes a batch: beta moves up to {0.2 * 32 / horizon:.0%} a "
             f"batch), per-response target {TARGET:g} nats; token_mean aims at the same target over the "
             "response length the response_sum runs settle at; the evaluation's on-policy response KL every "
             f"few iterations, its last third against the target; `{command}`"), "",
            ("| scope | seed | controller's target | eval response KL, last third (nats) | mean abs "
             "deviation from 6 nats | beta start -> end | score, last third | "
             "response tokens, last third |"),
            "|---|---|---|---|---|---|---|---|"]
    for key, r in sorted(results.items()):
        if "/" not in key:
            continue
        scope, seed = key.split("/")
        unit = "nats per response" if scope == "response_sum" else "nats per token"
        rows.append(f"| {scope} | {seed} | {r['target']:.4g} {unit} | {r['settled_eval_kl']:.2f} | "
                    f"{r['mean_abs_deviation']:.1%} | {r['init_kl_coef']:g} -> {r['kl_coef_final']:.4f} | "
                    f"{r['settled_score']:.3f} | "
                    f"{r['settled_response_length']:.1f} |")
    return rows


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for key, r in sorted(results.items()):
        if "/" not in key:
            continue
        style = "-" if key.startswith("response_sum") else "--"
        its = [p["iteration"] for p in r["per_iteration"]]
        axes[0].plot(*zip(*r["eval_kl"], strict=True), style, marker="o", markersize=3, label=key)
        axes[1].plot(its, [p["kl_coef"] for p in r["per_iteration"]], style, label=key)
        axes[2].plot(its, [p["score_mean"] for p in r["per_iteration"]], style, label=key)
    axes[0].axhline(TARGET, color="black", linewidth=0.8, label="target")
    axes[0].axhspan(TARGET * 0.8, TARGET * 1.2, color="grey", alpha=0.15, label="+-20%")
    axes[0].set_ylabel("evaluation's response KL, nats")
    axes[1].set_ylabel("beta")
    axes[1].set_yscale("log")
    axes[2].set_ylabel("score (VADER, training batch)")
    for ax in axes:
        ax.set_xlabel("iteration")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scopes", nargs="+", choices=sorted(FED), default=["response_sum", "token_mean"])
    parser.add_argument("--seeds", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--iterations", type=int, default=45)
    parser.add_argument("--eval-every", type=int, default=3)
    parser.add_argument("--init-kl-coef", type=float, default=INIT_KL_COEF)
    parser.add_argument("--horizon", type=int, default=HORIZON, help="kl.horizon")
    parser.add_argument("--eos-penalty", action="store_true", help="keep the preset's missing-EOS penalty")
    parser.add_argument("--name", help="the results' name (default: kl_scope_smollm2-horizon-<H>)")
    parser.add_argument("--fresh", action="store_true", help="run again what the results already hold")
    parser.add_argument("extra", nargs="*", help="extra learner.main arguments (after --)")
    args = parser.parse_args()
    name = args.name or f"{NAME}-horizon-{args.horizon}"
    earlier = RESULTS / f"{name}.json"
    results = ({k: v for k, v in json.loads(earlier.read_text()).items() if "/" in k}
               if earlier.is_file() and not args.fresh else {})
    command = "python benchmarks/kl_scope_smollm2.py" + "".join(
        f" --{k.replace('_', '-')} {v}" for k, v in (("iterations", args.iterations),
                                                      ("eval_every", args.eval_every),
                                                      ("init_kl_coef", args.init_kl_coef),
                                                      ("horizon", args.horizon))) + (
        " --eos-penalty" if args.eos_penalty else "")
    with tempfile.TemporaryDirectory() as out:
        for scope in sorted(args.scopes):  # response_sum first: token_mean's target is its settled length
            target = TARGET if scope == "response_sum" else token_target(results)
            if target is None:
                sys.exit("token_mean's target needs the response_sum runs' settled length: run them first")
            for seed in args.seeds:
                if f"{scope}/{seed}" in results:
                    continue
                results[f"{scope}/{seed}"] = run(scope, target, args.init_kl_coef, args.horizon,
                                                 args.eos_penalty, seed, args.iterations, args.eval_every,
                                                 out, args.extra)
                results |= stamp()
                rows = table(results, command, args.eos_penalty, args.horizon)
                write_results(RESULTS, name, results, rows)  # a partial run keeps its rows
                plot(results, RESULTS / f"{name}.png")
    print("\n".join(table(results, command, args.eos_penalty, args.horizon)))


if __name__ == "__main__":
    main()
