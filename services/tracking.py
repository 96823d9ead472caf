"""Experiment tracking: the run in Weights & Biases when ``metrics.wandb.enabled``.

The driver calls four things: ``Tracker.start`` once the run directory exists, ``log`` with every
metrics.jsonl record, ``log_samples`` with every evaluation's samples, and ``finish`` with the summary.
wandb honours its own environment (``WANDB_MODE=offline`` writes only to disk, ``WANDB_API_KEY``,
``WANDB_DIR``). The wandb run id lives in the run directory (``wandb-run.json``), so ``--run.resume``
continues the same wandb run instead of starting a new one.
"""

from __future__ import annotations

import json
import os
import tempfile

from services.settings_training import WandbConfig
from services.storage import RunStorage

RUN_ID_FILE = "wandb-run.json"
SAMPLE_COLUMNS = ["iteration", "prompt", "response", "score"]


def flat_metrics(record: dict, prefix: str = "") -> dict[str, float]:
    """The numbers of a metrics.jsonl record; nested sections (``eval``) as ``eval/<key>``. Lists (the
    actors' states, the batch's versions) are bookkeeping, not curves, and stay in metrics.jsonl only."""
    flat = {}
    for key, value in record.items():
        if isinstance(value, dict):
            flat.update(flat_metrics(value, f"{prefix}{key}/"))
        elif isinstance(value, bool | int | float):
            flat[f"{prefix}{key}"] = value
    return flat


class Tracker:
    """One wandb run per tether run; every method is a no-op when ``metrics.wandb.enabled`` is false."""

    def __init__(self, settings: WandbConfig, run_path: RunStorage, run_name: str, resuming: bool,
                 config: dict, log=print) -> None:
        """``config``: the job's settings as JSON, the run's config in wandb; ``resuming``: run.resume is
        set."""
        self.settings, self.run_path, self.run_name, self.resuming = settings, run_path, run_name, resuming
        self.config, self.say = config, log
        self.run = None

    def start(self) -> None:
        settings = self.settings
        if not settings.enabled:
            return
        import wandb

        run_id = None
        if self.resuming and self.run_path.exists(RUN_ID_FILE):
            run_id = json.loads(self.run_path.read_text(RUN_ID_FILE))["id"]
        # wandb's files go to WANDB_DIR where set, else into a local run directory (a job's working dir is
        # deleted when the job ends, and an offline run must survive until `wandb sync`)
        wandb_dir = None
        if not os.environ.get("WANDB_DIR") and self.run_path.is_local:
            wandb_dir = self.run_path.display()
        try:
            self.run = wandb.init(
                project=settings.project, entity=settings.entity, name=settings.name or self.run_name,
                tags=settings.tags or None, config=self.config, id=run_id,
                resume="allow" if run_id else None, dir=wandb_dir,
                settings=wandb.Settings(silent=True),  # tether prints its own one line about the run
            )
        except wandb.errors.Error as err:  # the driver reports a ValueError as a bad setting, without a trace
            raise ValueError(f"metrics.wandb: wandb could not start the run: {err} (set WANDB_API_KEY, run "
                             "`wandb login`, or set WANDB_MODE=offline)") from err
        # the x axis is the iteration: a resumed run logs iterations after its checkpoint again, which
        # wandb's own step counter would drop
        self.run.define_metric("*", step_metric="iteration")
        self.run_path.write_text(json.dumps({"id": self.run.id, "project": settings.project,
                                             "entity": settings.entity}) + "\n", RUN_ID_FILE)
        where = (f"offline, in {self.run.dir.removesuffix('/files')}" if self.run.settings.mode == "offline"
                 else self.run.url)
        self.say(f"wandb: run {self.run.name} (id {self.run.id}{', resumed' if run_id else ''}): {where}")

    def log(self, record: dict) -> None:
        """One metrics.jsonl record."""
        if self.run is not None:
            self.run.log(flat_metrics(record))

    def log_samples(self, iteration: int, samples: list[dict]) -> None:
        """One evaluation's samples as a table (iteration 0 is before training)."""
        if self.run is None or not samples:
            return
        import wandb

        table = wandb.Table(columns=SAMPLE_COLUMNS,
                            data=[[iteration, s["prompt"], s["response"], s["score"]] for s in samples])
        self.run.log({"iteration": iteration, "eval_samples": table})

    def finish(self, summary: dict | None) -> None:
        """curves.png and the summary, then close the run."""
        if self.run is None:
            return
        import wandb

        if summary:
            self.run.summary.update({f"summary/{k}": v for k, v in flat_metrics(summary).items()})
        if self.run_path.exists("curves.png"):
            with tempfile.TemporaryDirectory(prefix="tether-wandb-") as tmp:
                local = os.path.join(tmp, "curves.png")
                self.run_path.download(local, "curves.png")
                self.run.log({"iteration": summary.get("iterations", 0) if summary else 0,
                              "curves": wandb.Image(local, caption="reward, response KL and beta")})
        offline = self.run.settings.mode == "offline"
        run_dir = self.run.dir.removesuffix("/files")
        self.run.finish()
        self.run = None
        if offline:
            self.say(f"wandb: offline run written to {run_dir}; upload it with `wandb sync {run_dir}`")
