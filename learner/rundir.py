"""The run directory: config.yaml, metrics.jsonl, summary.json, curves.png and samples/.

It lives in the run's storage (``services.storage.RunStorage``): ``run.output_dir`` is a local directory
or a URI (file://, s3://, gs://), and the run directory is ``output_dir/name`` there.
"""

from __future__ import annotations

import importlib
import json
import os
import tempfile

from services.config import RunConfig
from services.errors import TetherError
from services.storage import RunStorage


class RunDirectoryError(TetherError, RuntimeError):
    pass


def check_free(settings: RunConfig) -> RunStorage:
    """The run directory ``output_dir/name``, refused if it already holds a run and ``run.overwrite`` is not
    set."""
    run = RunStorage(settings.output_dir).child(settings.name)
    if settings.resume:
        if not run.isdir():
            raise RunDirectoryError(f"--run.resume: run directory {run} does not exist")
        return run
    if run.isdir() and run.listdir() and not settings.overwrite:
        raise RunDirectoryError(
            f"run directory {run} already holds a run; pick another run.name or pass --run.overwrite"
        )
    return run


def prepare(settings: RunConfig, config_yaml: str) -> RunStorage:
    """Create ``output_dir/name`` (replacing an old run only with ``run.overwrite``) with the job's resolved
    settings as config.yaml."""
    run = check_free(settings)
    if settings.overwrite and not settings.resume:
        run.remove()
    if settings.resume and run.exists("config.yaml"):
        run.write_bytes(run.read_bytes("config.yaml"), "config.before-resume.yaml")
    run.makedirs()
    run.write_text(config_yaml, "config.yaml")
    return run


def append_metrics(run: RunStorage, record: dict) -> None:
    run.append_text(json.dumps(record) + "\n", "metrics.jsonl")


def append_episodes(run: RunStorage, iteration: int, episodes: list[dict]) -> None:
    """The iteration's trained episodes, one JSON line each: ``pandas.read_json(path, lines=True)`` loads
    the run's in one call."""
    lines = "".join(json.dumps({"iteration": iteration, **episode}) + "\n" for episode in episodes)
    run.append_text(lines, "episodes.jsonl")


def read_metrics(run: RunStorage, up_to_iteration: int) -> list[dict]:
    """Records of iterations <= ``up_to_iteration``; later ones (written after the checkpoint a run
    resumes from) move to metrics.discarded.jsonl rather than being lost."""
    if not run.exists("metrics.jsonl"):
        return []
    records = [json.loads(line) for line in run.read_text("metrics.jsonl").splitlines() if line.strip()]
    kept = [r for r in records if r["iteration"] <= up_to_iteration]
    dropped = [r for r in records if r["iteration"] > up_to_iteration]
    if dropped:
        run.append_text("".join(json.dumps(r) + "\n" for r in dropped), "metrics.discarded.jsonl")
    run.write_text("".join(json.dumps(r) + "\n" for r in kept), "metrics.jsonl")
    if run.exists("episodes.jsonl"):  # the same cut for the episodes
        lines = [line for line in run.read_text("episodes.jsonl").splitlines() if line.strip()]
        run.write_text("".join(line + "\n" for line in lines
                               if json.loads(line)["iteration"] <= up_to_iteration), "episodes.jsonl")
    return kept


def write_samples(run: RunStorage, iteration: int, samples: list[dict]) -> None:
    """Evaluation samples as Markdown, one file per evaluation: iteration 0 is before training."""
    if not samples:
        return
    lines = [f"# Evaluation samples at iteration {iteration}"
             + (" (before training)" if iteration == 0 else ""), ""]
    for i, s in enumerate(samples, 1):
        lines += [f"## {i}. score {s['score']:.3f}", "", "Prompt:", "",
                  *(f"> {x}" for x in s["prompt"].splitlines()),
                  "", "Response:", "", *(f"> {x}" for x in (s["response"] or "(empty)").splitlines()), ""]
    run.write_text("\n".join(lines), "samples", f"iteration-{iteration:04d}.md")


def write_summary(run: RunStorage, summary: dict) -> None:
    run.write_text(json.dumps(summary, indent=2) + "\n", "summary.json")


def plot_curves(run: RunStorage, records: list[dict], target: float | None,
                eval_start: dict | None = None) -> None:
    """reward, response KL (with its target) and beta against iteration; evaluations (the one before
    training at iteration 0) on the reward panel. Matplotlib's object API, without pyplot's global state: it
    draws on the ``Curves`` thread."""
    from matplotlib.figure import Figure

    it = [r["iteration"] for r in records]
    fig = Figure(figsize=(13, 3.6))
    axes = fig.subplots(1, 3)
    axes[0].plot(it, [r["reward_mean"] for r in records], label="reward (score - beta*KL)")
    axes[0].plot(it, [r["score_mean"] for r in records], label="score")
    evals = (([{"iteration": 0, "eval": eval_start}] if eval_start else [])
             + [r for r in records if "eval" in r])
    for key in sorted({k for r in evals for k in r["eval"]}):
        axes[0].plot([r["iteration"] for r in evals], [r["eval"][key] for r in evals], "o-",
                     label=f"eval {key}")
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
    # drawn locally, then written whole: object stores take no partial writes
    with tempfile.TemporaryDirectory(prefix="tether-plot-") as tmp:
        fig.savefig(os.path.join(tmp, "curves.png"), dpi=100)
        run.upload(os.path.join(tmp, "curves.png"), "curves.png")


class Curves:
    """curves.png, drawn on a thread of its own (``plot_curves``, 0.3-0.7 s): the loop does not wait for a
    drawing, and the last one draws while Ray stops. Drawings run one after another; asking again for the
    records already drawn draws nothing."""

    def __init__(self, run: RunStorage, target: float | None, eval_start: dict | None) -> None:
        from concurrent.futures import ThreadPoolExecutor

        self.run, self.target, self.eval_start = run, target, eval_start
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="curves")
        # matplotlib's import (0.3 s) now, beside the job, not at the first drawing: in a job shorter than
        # metrics.plot_every that is the last one, which the exit waits for
        # (a failed import fails that drawing)
        self.pool.submit(importlib.import_module, "matplotlib.figure")
        self.drawings: list = []
        self.drawn_records = 0

    def draw(self, records: list[dict]) -> None:
        if records and len(records) != self.drawn_records:
            self.drawn_records = len(records)
            self.drawings.append(self.pool.submit(plot_curves, self.run, list(records), self.target,
                                                  self.eval_start))

    def wait(self) -> None:
        """Until every drawing asked for is written; raises the first one's error."""
        self.pool.shutdown(wait=True)
        for drawing in self.drawings:
            drawing.result()
