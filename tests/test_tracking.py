"""Experiment tracking: a job that reports to every tracker ``metrics.report_to`` takes (wandb in its offline
mode, TensorBoard, MLflow on a local database, trackio on a local directory), each read back from what its
package wrote to disk (wandb's run log, TensorBoard's event files, MLflow's database and artifacts, trackio's
database): every number of metrics.jsonl, the config, the samples and the summary; a resumed run continues the
same run in each."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import yaml

from services.tracking import flat_config, flat_metrics
from tests.conftest import run_job

BLOCK = 32768  # wandb's run log (run-<id>.wandb): LevelDB-style records in 32 KiB blocks


def wandb_records(path: Path):
    """The protobuf records of a run-<id>.wandb file, as wandb wrote them."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a wandb run log"
    pos, pending = 7, b""
    while pos + 7 <= len(data):
        left = BLOCK - pos % BLOCK
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0 and length == 0:
            pos += left
            continue
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a full record, or the last piece of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def read_run(run_dir: Path) -> dict:
    """A wandb offline run directory: its id, config, final summary and logged history rows."""
    (log_file,) = run_dir.glob("run-*.wandb")
    run, config, summary, history = None, {}, {}, []
    for record in wandb_records(log_file):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run = record.run
            config.update({item.key: json.loads(item.value_json) for item in record.run.config.update})
        elif kind == "config":
            config.update({item.key: json.loads(item.value_json) for item in record.config.update})
        elif kind == "summary":
            for item in record.summary.update:
                summary["/".join(item.nested_key) if item.nested_key else item.key] = \
                    json.loads(item.value_json)
        elif kind == "history":
            history.append({("/".join(i.nested_key) if i.nested_key else i.key): json.loads(i.value_json)
                            for i in record.history.item})
    return {"id": run.run_id, "name": run.display_name, "project": run.project, "tags": list(run.tags),
            "config": config, "summary": summary, "history": history}


def test_flat_metrics_keeps_numbers_and_nests_sections():
    record = {"iteration": 3, "kl_coef": 0.05, "eval": {"optimality": 0.5}, "actor_states": [{"name": "x"}],
              "batch_policy_versions": [2], "run": "name", "stopped_early": False}
    assert flat_metrics(record) == \
        {"iteration": 3, "kl_coef": 0.05, "eval/optimality": 0.5, "stopped_early": False}


def test_the_trackers_are_chosen_as_trl_and_verl_users_write_them():
    from services.config import load_config

    for written, chosen in (("wandb", ["wandb"]), ("wandb,mlflow", ["wandb", "mlflow"]), ("none", []),
                            (["trackio", "tensorboard"], ["trackio", "tensorboard"])):
        assert load_config(None, {"metrics": {"report_to": written}}).metrics.report_to == chosen
    for settings, named in (({"report_to": ["comet"]}, "report_to"),
                            ({"report_to": "wandb,wandb"}, "more than once"),
                            ({"tensorboard": True}, r"report_to=\[tensorboard\]"),
                            ({"wandb": {"enabled": True}}, r"report_to=\[wandb\]")):
        with pytest.raises(ValueError, match=named):
            load_config(None, {"metrics": settings})


def tensorboard_scalars(run_dir: Path) -> dict[tuple[str, int], float]:
    """Every scalar of the run's TensorBoard event files: (tag, iteration) -> value."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = {}
    for events in sorted((run_dir / "tensorboard").glob("events.out.tfevents.*")):
        accumulator = EventAccumulator(str(events))
        accumulator.Reload()
        for tag in accumulator.Tags()["scalars"]:
            out.update({(tag, e.step): e.value for e in accumulator.Scalars(tag)})
    return out


def trackio_rows(trackio_dir: Path, project: str, run: str) -> list[dict]:
    """The rows trackio's local database holds for ``run`` (each logged dict with its step)."""
    import sqlite3

    with sqlite3.connect(trackio_dir / f"{project}.db") as db:
        return [{**json.loads(metrics), "step": step} for step, metrics in db.execute(
            "select step, metrics from metrics where run_name = ? order by id", (run,))]


@pytest.mark.integration
def test_job_logs_to_every_tracker_and_resume_continues_each_run(ray_head, cache_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb-dir"))
    monkeypatch.setenv("TRACKIO_DIR", str(tmp_path / "trackio"))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    (tmp_path / "wandb-dir").mkdir()
    args = ["--config", "tests/configs/small.yaml", "--cluster.address", ray_head.address,
            "--model.cache_dir", cache_dir, "--run.output_dir", str(tmp_path / "runs"),
            "--cluster.placement_timeout_s", "300", "--metrics.report_to", "wandb,tensorboard,mlflow,trackio",
            "--metrics.wandb.project", "tether-test", "--metrics.wandb.tags", '["ci", "small"]',
            "--metrics.trackio.project", "tether-test"]
    first = run_job([*args, "--run.iterations", "1"])
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    run_dir = tmp_path / "runs" / "small"
    wandb_id = json.loads((run_dir / "wandb-run.json").read_text())["id"]
    assert f"[tether] wandb: run small (id {wandb_id})" in first.stdout

    (first_dir,) = (tmp_path / "wandb-dir" / "wandb").glob(f"offline-run-*-{wandb_id}")
    logged = read_run(first_dir)
    assert (logged["id"], logged["name"], logged["project"]) == (wandb_id, "small", "tether-test")
    assert logged["tags"] == ["ci", "small"]
    # the resolved config, as config.yaml holds it
    resolved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert {k: v for k, v in logged["config"].items() if k != "_wandb"} == resolved
    # every number of metrics.jsonl, in the history and (the last record) in the summary
    record = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])
    metrics = flat_metrics(record)
    assert "eval/optimality" in metrics and "kl_response_mean" in metrics
    rows = [row for row in logged["history"] if "kl_coef" in row]
    assert len(rows) == 1
    for key, value in metrics.items():
        assert rows[0][key] == pytest.approx(value, rel=1e-9, nan_ok=True), key
        assert logged["summary"][key] == pytest.approx(value, rel=1e-9, nan_ok=True), key
    summary = json.loads((run_dir / "summary.json").read_text())
    assert logged["summary"]["summary/eval_final/optimality"] == \
        pytest.approx(summary["eval_final"]["optimality"])
    # the evaluation samples as tables (before training and at iteration 1), curves.png as an image
    tables = sorted((first_dir / "files" / "media" / "table").glob("eval_samples_*.table.json"))
    assert len(tables) == 2
    table = json.loads(tables[-1].read_text())
    assert table["columns"] == ["iteration", "prompt", "response", "score"] and len(table["data"]) == 8
    assert {row[0] for row in table["data"]} == {1}
    assert list((first_dir / "files" / "media" / "images").glob("curves_*.png"))

    resumed = run_job([*args, "--run.iterations", "2", "--run.resume", "latest"])
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert f"[tether] wandb: run small (id {wandb_id}, resumed)" in resumed.stdout
    later = [d for d in (tmp_path / "wandb-dir" / "wandb").glob(f"offline-run-*-{wandb_id}")
             if d != first_dir]
    assert len(later) == 1, "the resumed job must continue the same wandb run id"
    continued = read_run(later[0])
    assert continued["id"] == wandb_id
    assert [row["iteration"] for row in continued["history"] if "kl_coef" in row] == [2]

    # TensorBoard, MLflow and trackio: each iteration's numbers as metrics.jsonl has them, the resumed
    # iteration in the same run
    from mlflow.tracking import MlflowClient

    records = [flat_metrics(json.loads(line)) for line in
               (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in records] == [1, 2]
    assert "[tether] tensorboard:" in first.stdout and "[tether] mlflow: run small" in first.stdout
    assert "[tether] trackio: run small in project tether-test" in first.stdout
    scalars = tensorboard_scalars(run_dir)
    mlflow_id = json.loads((run_dir / "mlflow-run.json").read_text())["id"]
    assert f"[tether] mlflow: run small (id {mlflow_id}, resumed)" in resumed.stdout
    client = MlflowClient(f"sqlite:///{run_dir / 'mlflow.db'}")
    mlflow_run = client.get_run(mlflow_id)
    assert mlflow_run.info.run_name == "small" and mlflow_run.info.status == "FINISHED"
    assert mlflow_run.data.params == flat_config(resolved)
    tracked = {row["step"]: row for row in trackio_rows(tmp_path / "trackio", "tether-test", "small")
               if "kl_coef" in row}
    assert sorted(tracked) == [1, 2]
    for record in records:
        iteration = record["iteration"]
        for key, value in record.items():
            assert scalars[(key, iteration)] == pytest.approx(value, rel=1e-6, nan_ok=True), key
            history = {m.step: m.value for m in client.get_metric_history(mlflow_id, key)}
            assert history[iteration] == pytest.approx(value, rel=1e-12, nan_ok=True), key
            assert tracked[iteration][key] == pytest.approx(value, rel=1e-12, nan_ok=True), key
    assert mlflow_run.data.metrics["summary/eval_final/optimality"] == \
        pytest.approx(json.loads((run_dir / "summary.json").read_text())["eval_final"]["optimality"])
    artifacts = {a.path for a in client.list_artifacts(mlflow_id)}
    assert {"config.json", "curves.png", "eval_samples"} <= artifacts
    samples = {a.path for a in client.list_artifacts(mlflow_id, "eval_samples")}
    assert samples == {f"eval_samples/iteration-{i:04d}.json" for i in (0, 1, 2)}
    tables = [row for row in trackio_rows(tmp_path / "trackio", "tether-test", "small")
              if "eval_samples" in row]
    assert [row["step"] for row in tables] == [0, 1, 2]
    assert len(tables[-1]["eval_samples"]["_value"]) == 8
