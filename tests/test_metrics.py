"""The Ray dashboard's metrics: scrape the head's Prometheus endpoint while a job runs and find every
tether series with the values the job recorded for that iteration."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.request

import pytest

from tests.conftest import METRICS_ENV, RAY_ENV, ROOT, RayHead

pytestmark = pytest.mark.integration

LINE = re.compile(r'^(ray_tether_\w+)\{([^}]*)\} (\S+)$')

# gauge on the endpoint -> key of the job's metrics.jsonl record
DRIVER_SERIES = {
    "ray_tether_kl_coef": "kl_coef",
    "ray_tether_kl_response_mean": "kl_response_mean",
    "ray_tether_kl_token_mean": "kl_token_mean",
    "ray_tether_kl_target": "kl_target",
    "ray_tether_reward_mean": "reward_mean",
    "ray_tether_score_mean": "score_mean",
    "ray_tether_response_length_mean": "response_length_mean",
    "ray_tether_learner_step_seconds": "learner_seconds",
    "ray_tether_weight_sync_seconds": "weight_sync_seconds",
    "ray_tether_rollout_learner_logprob_mismatch": "rollout_learner_logprob_mismatch",
    "ray_tether_policy_version": "policy_version",
}


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    series = {}
    for line in text.splitlines():
        match = LINE.match(line)
        if match:
            labels = tuple(sorted(re.findall(r'(\w+)="([^"]*)"', match.group(2))))
            series[(match.group(1), labels)] = float(match.group(3))
    return series


def by_name(snapshot, name, **labels):
    return [v for (n, lab), v in snapshot.items()
            if n == name and all((k, v2) in lab for k, v2 in labels.items())]


@pytest.fixture(scope="module")
def ray_head():
    """A head of this module's own, with its dashboard and Prometheus endpoint (the session's have none), its
    processes reporting every second."""
    head = RayHead(dashboard=True, env=METRICS_ENV)
    yield head
    head.stop()


def test_dashboard_metrics_match_the_job(ray_head, cache_dir, tmp_path):
    cmd = [sys.executable, "-m", "learner.main", "--cluster.address", ray_head.address, "--model.cache_dir",
           cache_dir, "--run.output_dir", str(tmp_path), "--run.name", "metrics", "--run.seed", "1",
           "--model.sft_steps", "60", "--model.sft_batch_size", "50", "--rollout.batch_size", "32",
           "--rollout.chunk_size", "16", "--ppo.minibatch_size", "16", "--run.iterations", "10",
           "--run.eval_every", "100", "--cluster.placement_timeout_s", "300"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, **RAY_ENV, **METRICS_ENV})
    snapshots, deadline = [], time.monotonic() + 600
    while proc.poll() is None and time.monotonic() < deadline:
        try:
            snapshots.append(scrape(ray_head.metrics_port))
        except OSError:
            pass
        time.sleep(0.5)
    out = proc.communicate(timeout=60)[0]
    assert proc.returncode == 0, out[-3000:]
    records = {r["iteration"]: r
               for r in map(json.loads, (tmp_path / "metrics" / "metrics.jsonl").read_text().splitlines())}

    matched, actors_seen, counted = 0, set(), 0.0
    for snap in snapshots:
        # the counter goes out on the driver's clock like its gauges, but not necessarily in the same batch
        for count in by_name(snap, "ray_tether_iterations_total", tether_run="metrics"):
            assert count <= len(records)
            counted = max(counted, count)
        # this job's series only: the head is shared, and another job's gauges outlive it by two report
        # intervals
        iteration = by_name(snap, "ray_tether_iteration", tether_run="metrics")
        if len(iteration) != 1 or int(iteration[0]) not in records:
            continue
        record = records[int(iteration[0])]
        values = {name: by_name(snap, name, tether_run="metrics") for name in DRIVER_SERIES}
        if any(len(v) != 1 for v in values.values()):
            continue
        # a scrape can land while the driver sets the next iteration's gauges, and Ray exports a process's
        # gauges in batches of its own, so when iterations take under a report interval one gauge can be two
        # iterations behind another (seen in CI: iteration 2 beside a 1.14 s learner step that was neither
        # iteration 1's, 2's nor 3's): each value is one of this job's iterations', never anything else
        for name, key in DRIVER_SERIES.items():
            assert values[name][0] in [pytest.approx(r[key], rel=1e-5, abs=1e-9) for r in records.values()], \
                (name, record["iteration"])
        if any(values[name][0] != pytest.approx(record[key], rel=1e-5, abs=1e-9)
               for name, key in DRIVER_SERIES.items()):
            continue
        # every series of this Ray job, the driver's and the actors', names its run in its own label; none in
        # `job`, which Prometheus renames to `exported_job`
        series = [(name, dict(labels)) for name, labels in snap]
        job_id = next(labels["ray_job"] for name, labels in series
                      if name == "ray_tether_iteration" and labels.get("tether_run") == "metrics")
        ours = [(name, labels) for name, labels in series if labels.get("ray_job") == job_id]
        assert {name for name, _ in ours} >= set(DRIVER_SERIES)
        for name, labels in ours:
            assert labels.get("tether_run") == "metrics" and "job" not in labels, (name, labels)
        # per-actor state; each process reports on its own 1 s clock, so allow one iteration of skew
        for actor in ("rollout-0",):  # on CPU the learner rank scores the reference and the reward: no actors
            version = by_name(snap, "ray_tether_actor_policy_version", tether_run="metrics", actor=actor)
            if version and abs(version[0] - record["policy_version"]) <= 1 \
                    and by_name(snap, "ray_tether_actor_kl_coef", tether_run="metrics", actor=actor):
                actors_seen.add(actor)
        throughput = by_name(snap, "ray_tether_rollout_tokens_per_second", tether_run="metrics",
                             actor="rollout-0")
        if throughput:
            assert throughput[0] > 0
            actors_seen.add("throughput")
        matched += 1
    assert actors_seen == {"rollout-0", "throughput"}, actors_seen
    assert counted >= 1, "the iterations counter never went out"
    assert matched >= 1, f"no scrape held every series ({len(snapshots)} scrapes)"
