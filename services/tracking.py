"""Experiment tracking: the run in each tracker ``metrics.report_to`` names (wandb, TensorBoard, MLflow,
trackio), as TRL's ``report_to`` and verl's ``trainer.logger`` choose them.

The driver calls four things on ``Tracker``: ``start`` once the run directory exists, ``log`` with every
metrics.jsonl record, ``log_samples`` with every evaluation's samples, and ``finish`` with the summary. Each
tracker gets the same numbers: a record's numbers flat, nested sections (``eval``) as ``eval/<key>``, against
the iteration. Each honours its own environment (``WANDB_MODE=offline``, ``MLFLOW_TRACKING_URI``,
``TRACKIO_DIR``); the id of a run that can be continued lives in the run directory, so ``--run.resume``
continues the same run instead of starting a new one.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import tempfile
import time

from services.settings_training import MetricsConfig
from services.storage import RunStorage

SAMPLE_COLUMNS = ["iteration", "prompt", "response", "score"]
MLFLOW_BATCH = 100  # MLflow's most params or metrics in one log_batch call


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


def summary_metrics(summary: dict) -> tuple[dict[str, float], int]:
    """The summary's numbers as ``summary/...`` metrics, at the run's last iteration."""
    return {f"summary/{k}": v for k, v in flat_metrics(summary).items()}, summary.get("iterations", 0)


def flat_config(config: dict, prefix: str = "") -> dict[str, str]:
    """The resolved settings as dotted keys (``ppo.lr``), each value as text: MLflow's params."""
    out = {}
    for key, value in config.items():
        if isinstance(value, dict):
            out.update(flat_config(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = json.dumps(value) if not isinstance(value, str) else value
    return out


def samples_table(iteration: int, samples: list[dict]) -> list[list]:
    """An evaluation's samples as rows of ``SAMPLE_COLUMNS``."""
    return [[iteration, s["prompt"], s["response"], s["score"]] for s in samples]


class Run:
    """One tracker's run; the four calls of ``Tracker``."""

    def __init__(self, settings: MetricsConfig, run_path: RunStorage, run_name: str, resuming: bool,
                 config: dict, say) -> None:
        self.settings, self.run_path, self.run_name, self.resuming = settings, run_path, run_name, resuming
        self.config, self.say = config, say

    def saved_id(self, file: str) -> str | None:
        """The id a resumed run continues, from the run directory."""
        if self.resuming and self.run_path.exists(file):
            return json.loads(self.run_path.read_text(file))["id"]
        return None

    def curves(self, upload) -> None:
        """``upload(local path)`` with curves.png, where the run directory has it."""
        if self.run_path.exists("curves.png"):
            with tempfile.TemporaryDirectory(prefix="tether-curves-") as tmp:
                local = os.path.join(tmp, "curves.png")
                self.run_path.download(local, "curves.png")
                upload(local)

    def start(self) -> None: ...

    def log(self, metrics: dict[str, float], iteration: int) -> None: ...

    def log_samples(self, iteration: int, samples: list[dict]) -> None: ...

    def finish(self, summary: dict | None) -> None: ...


class WandbRun(Run):
    """Weights & Biases: the numbers, the resolved config, the samples as a table, curves.png, the summary."""

    ID_FILE = "wandb-run.json"

    def start(self) -> None:
        import wandb

        settings, run_id = self.settings.wandb, self.saved_id(self.ID_FILE)
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
                                             "entity": settings.entity}) + "\n", self.ID_FILE)
        where = (f"offline, in {self.run.dir.removesuffix('/files')}" if self.run.settings.mode == "offline"
                 else self.run.url)
        self.say(f"wandb: run {self.run.name} (id {self.run.id}{', resumed' if run_id else ''}): {where}")

    def log(self, metrics: dict[str, float], iteration: int) -> None:
        self.run.log(metrics)

    def log_samples(self, iteration: int, samples: list[dict]) -> None:
        import wandb

        table = wandb.Table(columns=SAMPLE_COLUMNS, data=samples_table(iteration, samples))
        self.run.log({"iteration": iteration, "eval_samples": table})

    def finish(self, summary: dict | None) -> None:
        import wandb

        if summary:
            self.run.summary.update(summary_metrics(summary)[0])
        self.curves(lambda local: self.run.log({
            "iteration": summary.get("iterations", 0) if summary else 0,
            "curves": wandb.Image(local, caption="reward, response KL and beta")}))
        offline = self.run.settings.mode == "offline"
        run_dir = self.run.dir.removesuffix("/files")
        self.run.finish()
        if offline:
            self.say(f"wandb: offline run written to {run_dir}; upload it with `wandb sync {run_dir}`")


class TensorBoardRun(Run):
    """TensorBoard event files in <run directory>/tensorboard: every number against the iteration, the
    samples as text."""

    def start(self) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(self.run_path.display("tensorboard"))
        self.say(f"tensorboard: {self.run_path.display('tensorboard')} (`tensorboard --logdir` it)")

    def log(self, metrics: dict[str, float], iteration: int) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, iteration)

    def log_samples(self, iteration: int, samples: list[dict]) -> None:
        text = "\n\n".join(f"**score {s['score']}**\n\nPrompt: {s['prompt']}\n\nResponse: {s['response']}"
                           for s in samples)
        self.writer.add_text("eval_samples", text, iteration)

    def finish(self, summary: dict | None) -> None:
        self.writer.close()


class MLflowRun(Run):
    """MLflow, through its client (no process-global active run): the resolved settings as params, every
    number as a metric at step = the iteration, the samples as a table artifact, curves.png and the config as
    artifacts, the summary as ``summary/...`` metrics."""

    ID_FILE = "mlflow-run.json"

    def start(self) -> None:
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        settings = self.settings.mlflow
        self.name = settings.name or self.run_name
        uri = settings.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
        artifacts = None
        if uri is None:
            if not self.run_path.is_local:
                raise ValueError("metrics.report_to has mlflow but the run directory is not local: set "
                                 "metrics.mlflow.tracking_uri (or MLFLOW_TRACKING_URI) to the MLflow server")
            uri = f"sqlite:///{self.run_path.display('mlflow.db')}"
            artifacts = self.run_path.display("mlflow-artifacts")
        self.client = MlflowClient(uri)
        run_id = self.saved_id(self.ID_FILE)
        resumed = run_id is not None
        if not resumed:
            experiment = self.client.get_experiment_by_name(settings.experiment)
            experiment_id = (experiment.experiment_id if experiment is not None else
                             self.client.create_experiment(settings.experiment, artifact_location=artifacts))
            run_id = self.client.create_run(experiment_id, run_name=self.name).info.run_id
            params = [Param(k, v[:6000]) for k, v in flat_config(self.config).items()]
            for i in range(0, len(params), MLFLOW_BATCH):
                self.client.log_batch(run_id, params=params[i:i + MLFLOW_BATCH])
            self.client.log_dict(run_id, self.config, "config.json")
        else:
            self.client.update_run(run_id, status="RUNNING")
        self.run_id = run_id
        self.run_path.write_text(json.dumps({"id": run_id, "tracking_uri": uri}) + "\n", self.ID_FILE)
        self.say(f"mlflow: run {self.name} (id {run_id}{', resumed' if resumed else ''}) at {uri}")

    def log(self, metrics: dict[str, float], iteration: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        rows = [Metric(k, float(v), now, iteration) for k, v in metrics.items()]
        for i in range(0, len(rows), MLFLOW_BATCH):
            self.client.log_batch(self.run_id, metrics=rows[i:i + MLFLOW_BATCH])

    def log_samples(self, iteration: int, samples: list[dict]) -> None:
        rows = samples_table(iteration, samples)
        self.client.log_table(self.run_id, {c: [r[i] for r in rows] for i, c in enumerate(SAMPLE_COLUMNS)},
                              f"eval_samples/iteration-{iteration:04d}.json")

    def finish(self, summary: dict | None) -> None:
        if summary:
            self.log(*summary_metrics(summary))
        self.curves(lambda local: self.client.log_artifact(self.run_id, local))
        self.client.set_terminated(self.run_id)


class TrackioRun(Run):
    """trackio: the numbers against the iteration, the resolved config, the samples as a table; the run
    continued by name on resume. Its own console lines are kept off tether's console."""

    def start(self) -> None:
        import trackio

        settings = self.settings.trackio
        name = settings.name or self.run_name
        with contextlib.redirect_stdout(io.StringIO()):
            self.run = trackio.init(project=settings.project, name=name, space_id=settings.space_id,
                                    config=self.config, resume="allow" if self.resuming else "never",
                                    embed=False, auto_log_cpu=False, auto_log_gpu=False)
        from trackio.utils import TRACKIO_DIR

        where = settings.space_id or f"{TRACKIO_DIR} (`trackio show --project {settings.project}`)"
        self.say(f"trackio: run {name} in project {settings.project}: {where}")

    def log(self, metrics: dict[str, float], iteration: int) -> None:
        self.run.log(metrics, step=iteration)

    def log_samples(self, iteration: int, samples: list[dict]) -> None:
        import trackio

        table = trackio.Table(columns=SAMPLE_COLUMNS, data=samples_table(iteration, samples))
        self.run.log({"eval_samples": table}, step=iteration)

    def finish(self, summary: dict | None) -> None:
        import trackio

        if summary:
            self.log(*summary_metrics(summary))
        with contextlib.redirect_stdout(io.StringIO()):
            trackio.finish()  # the module's: it forgets the run too, which trackio would finish at exit


RUNS = {"wandb": WandbRun, "tensorboard": TensorBoardRun, "mlflow": MLflowRun, "trackio": TrackioRun}


class Tracker:
    """The run in every tracker of ``metrics.report_to``, in its order; no tracker, no calls."""

    def __init__(self, settings: MetricsConfig, run_path: RunStorage, run_name: str, resuming: bool,
                 config: dict, log=print) -> None:
        """``config``: the job's settings as JSON, the run's config in each tracker; ``resuming``: run.resume
        is set."""
        self.runs = [RUNS[name](settings, run_path, run_name, resuming, config, log)
                     for name in settings.report_to]

    def start(self) -> None:
        for run in self.runs:
            run.start()

    def log(self, record: dict) -> None:
        """One metrics.jsonl record."""
        metrics = flat_metrics(record)
        for run in self.runs:
            run.log(metrics, record["iteration"])

    def log_samples(self, iteration: int, samples: list[dict]) -> None:
        """One evaluation's samples (iteration 0 is before training)."""
        if samples:
            for run in self.runs:
                run.log_samples(iteration, samples)

    def finish(self, summary: dict | None) -> None:
        """curves.png and the summary, then close each run."""
        for run in self.runs:
            run.finish(summary)
        self.runs = []
