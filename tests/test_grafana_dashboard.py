"""deploy/grafana/tether-dashboard.json: valid JSON, a Prometheus datasource variable, a job filter, and a
panel for each metric the job exports."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

DASHBOARD = Path(__file__).resolve().parents[1] / "deploy" / "grafana" / "tether-dashboard.json"
METRICS = [
    "ray_tether_reward_mean",
    "ray_tether_score_mean",
    "ray_tether_kl_response_mean",
    "ray_tether_kl_target",
    "ray_tether_kl_token_mean",
    "ray_tether_kl_coef",
    "ray_tether_rollout_tokens_per_second",
    "ray_tether_weight_sync_seconds",
    "ray_tether_learner_step_seconds",
    "ray_tether_policy_version",
    "ray_tether_rollout_learner_logprob_mismatch",
    # multi-turn episodes (task.name environment or agent)
    "ray_tether_turns_per_episode",
    "ray_tether_tool_calls_per_episode",
    "ray_tether_environment_seconds",
    "ray_tether_trajectory_model_tokens_mean",
    "ray_tether_trajectory_environment_tokens_mean",
    "ray_tether_environment_failures",
    "ray_tether_truncated_fraction",
]


def all_panels(panels: list[dict]) -> list[dict]:
    out = []
    for panel in panels:
        out.append(panel)
        out.extend(all_panels(panel.get("panels", [])))  # rows may nest panels
    return out


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


@pytest.fixture(scope="module")
def exprs(dashboard) -> list[str]:
    return [t["expr"] for p in all_panels(dashboard["panels"]) for t in p.get("targets", []) if "expr" in t]


@pytest.mark.parametrize("metric", METRICS)
def test_metric_has_a_panel(exprs, metric):
    # a whole-word match: ray_tether_kl_coef must not be satisfied by ray_tether_actor_kl_coef alone
    pattern = re.compile(rf"(?<![A-Za-z0-9_]){re.escape(metric)}(?![A-Za-z0-9_])")
    assert any(pattern.search(e) for e in exprs), f"no panel queries {metric}"


def test_kl_and_target_share_a_panel(dashboard):
    panels = [p for p in all_panels(dashboard["panels"]) if p.get("type") != "row"]
    assert any({"ray_tether_kl_response_mean", "ray_tether_kl_target"}
               <= {m for t in p.get("targets", []) for m in METRICS if m in t.get("expr", "")}
               for p in panels)


def test_templating_and_filters(dashboard):
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and \
        variables["datasource"]["query"] == "prometheus"
    # the run's own label: Prometheus renames a `job` label to `exported_job`, and a board on it merges all
    # runs
    assert "job" not in variables
    assert variables["tether_run"]["type"] == "query" and \
        "tether_run" in variables["tether_run"]["definition"]
    assert 36 <= dashboard["schemaVersion"] <= 41
    ids = [p["id"] for p in all_panels(dashboard["panels"])]
    assert len(ids) == len(set(ids))
    for panel in all_panels(dashboard["panels"]):
        if panel.get("type") == "row":
            continue
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        for target in panel["targets"]:
            assert 'tether_run=~"$tether_run"' in target["expr"], (panel["title"], target["expr"])
            assert not re.search(r"\bjob\b", target["expr"] + target.get("legendFormat", "")), target
