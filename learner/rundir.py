"""The run directory: config.yaml, metrics.jsonl, summary.json, curves.png and samples/."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from learner.config import JobConfig, config_to_yaml


class RunDirectoryError(RuntimeError):
    pass


def check_free(cfg: JobConfig) -> Path:
    """The run directory, refused if it already holds a run and ``run.overwrite`` is not set."""
    path = Path(cfg.run.output_dir) / cfg.run.name
    if cfg.run.resume:
        if not path.is_dir():
            raise RunDirectoryError(f"--run.resume: run directory {path} does not exist")
        return path
    if path.exists() and any(path.iterdir()) and not cfg.run.overwrite:
        raise RunDirectoryError(
            f"run directory {path} already holds a run; pick another run.name or pass --run.overwrite"
        )
    return path


def prepare(cfg: JobConfig) -> Path:
    """Create ``output_dir/name`` (replacing an old run only with ``run.overwrite``) with config.yaml."""
    path = check_free(cfg)
    if path.exists() and cfg.run.overwrite:
        shutil.rmtree(path)
    if cfg.run.resume and (path / "config.yaml").exists():
        os.replace(path / "config.yaml", path / "config.before-resume.yaml")
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.yaml").write_text(config_to_yaml(cfg))
    return path


def append_metrics(path: Path, record: dict) -> None:
    with open(path / "metrics.jsonl", "a") as f:
        f.write(json.dumps(record) + "\n")


def read_metrics(path: Path, up_to_iteration: int) -> list[dict]:
    """Records of iterations <= ``up_to_iteration``; later ones (written after the checkpoint a run
    resumes from) move to metrics.discarded.jsonl rather than being lost."""
    file = path / "metrics.jsonl"
    if not file.exists():
        return []
    records = [json.loads(line) for line in file.read_text().splitlines() if line.strip()]
    kept = [r for r in records if r["iteration"] <= up_to_iteration]
    dropped = [r for r in records if r["iteration"] > up_to_iteration]
    if dropped:
        with open(path / "metrics.discarded.jsonl", "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in dropped)
    file.write_text("".join(json.dumps(r) + "\n" for r in kept))
    return kept


def write_samples(path: Path, iteration: int, samples: list[dict]) -> None:
    """Evaluation samples as Markdown, one file per evaluation: iteration 0 is before training."""
    if not samples:
        return
    lines = [f"# Evaluation samples at iteration {iteration}" + (" (before training)" if iteration == 0 else ""),
             ""]
    for i, s in enumerate(samples, 1):
        lines += [f"## {i}. score {s['score']:.3f}", "", "Prompt:", "", *(f"> {x}" for x in s["prompt"].splitlines()),
                  "", "Response:", "", *(f"> {x}" for x in (s["response"] or "(empty)").splitlines()), ""]
    (path / "samples").mkdir(exist_ok=True)
    (path / "samples" / f"iteration-{iteration:04d}.md").write_text("\n".join(lines))


def write_summary(path: Path, summary: dict) -> None:
    (path / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")


def plot_curves(path: Path, records: list[dict], target: float | None, eval_start: dict | None = None) -> None:
    """reward, response KL (with its target) and beta against iteration; evaluations (the one before
    training at iteration 0) on the reward panel."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    it = [r["iteration"] for r in records]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    axes[0].plot(it, [r["reward_mean"] for r in records], label="reward (score - beta*KL)")
    axes[0].plot(it, [r["score_mean"] for r in records], label="score")
    evals = ([{"iteration": 0, "eval": eval_start}] if eval_start else []) + [r for r in records if "eval" in r]
    for key in sorted({k for r in evals for k in r["eval"]}):
        axes[0].plot([r["iteration"] for r in evals], [r["eval"][key] for r in evals], "o-", label=f"eval {key}")
    axes[0].set_title("reward")
    axes[1].plot(it, [r["kl_response_mean"] for r in records], label="response KL (nats)")
    if target is not None:
        axes[1].axhline(target, color="k", ls="--", label="target")
    axes[1].set_title("response KL")
    axes[2].plot(it, [r["kl_coef"] for r in records])
    axes[2].set_title("beta (kl_coef)")
    for ax in axes:
        ax.set_xlabel("iteration")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path / "curves.png", dpi=100)
    plt.close(fig)
