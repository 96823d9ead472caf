"""Experiment tracking: a job with ``metrics.wandb.enabled`` in wandb's offline mode, read back from what
wandb wrote to disk (its run log, the run's config and summary, the tables and images it saved); a resumed run
continues the same wandb run."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import yaml

from services.tracking import flat_metrics
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


@pytest.mark.integration
def test_job_logs_to_wandb_and_resume_continues_the_run(ray_head, cache_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb-dir"))
    (tmp_path / "wandb-dir").mkdir()
    args = ["--config", "tests/configs/small.yaml", "--cluster.address", ray_head.address,
            "--model.cache_dir", cache_dir, "--run.output_dir", str(tmp_path / "runs"),
            "--cluster.placement_timeout_s", "300", "--metrics.wandb.enabled", "--metrics.wandb.project",
            "tether-test", "--metrics.wandb.tags", '["ci", "small"]']
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
