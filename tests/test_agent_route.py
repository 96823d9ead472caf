"""rollout.agent: any agent program trained through the rollout engine's OpenAI-compatible endpoint, as a
job on the real stack. The program (tests/agent_programs.py) walks randomwalks with the ``openai`` client in
two calls; for half the rows the second extends the first token for token, so the episode is one trajectory of
two calls, and for the other half it starts again from the walk's last node, so the episode gives two rows. An
agent past its failure limit is tested on an engine actor (tests/test_agents.py): the driver reports the
error it raises as it does an environment's."""

from __future__ import annotations

import json

import pytest

from tests.conftest import SMALL, run_cli

ROWS = [{"start": s} for s in "bcdefghi"]
# the tests' randomwalks GPT-2 has 32 positions: prompt 8 + trajectory 16 + 1
SIZES = ["--task.max_prompt_tokens", "8", "--rollout.max_trajectory_tokens", "16",
         "--rollout.max_new_tokens", "9"]


def agent_args(root, tiny_model_dir, agent: str) -> list[str]:
    rows = root / "agent-rows.jsonl"
    if not rows.exists():
        rows.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return [*SMALL, *SIZES, "--task.name", "agent", "--task.path", str(rows), "--rollout.agent", agent,
            "--model.path", tiny_model_dir]


@pytest.fixture(scope="module")
def agent_run(shared_runs, tiny_model_dir):
    return shared_runs.get("agent-two-calls",
                           *agent_args(shared_runs.root, tiny_model_dir,
                                       "tests.agent_programs:walk_in_two_calls_or_two_rows"),
                           "--run.iterations", "2", "--run.eval_every", "2")


def test_an_agent_program_trains_through_the_endpoint(agent_run):
    run_dir, proc = agent_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 2
    for r in records:
        # two calls per episode, merged into one trajectory or two rows, or one call when the walk ended
        # within the first: the episode is the unit, whatever its rows
        assert r["episodes"] == 32 and 1.0 <= r["turns_mean"] <= 2.0 and 1.0 <= r["rows_per_episode"] <= 2.0
        assert r["trajectory_environment_tokens_mean"] == 0.0  # nothing between the calls
        # the KL the reward penalised is the controller's statistic, on these trajectories too, per episode
        assert r["kl_response_mean"] == pytest.approx(r["kl_penalty_mean"], rel=1e-9)
        assert r["reward_mean"] == pytest.approx(r["score_mean"] - r["kl_coef_used"] * r["kl_response_mean"],
                                                 rel=1e-5, abs=1e-6)
        assert 0.0 <= r["score_mean"] <= 1.0  # an optimality per episode, counted once however many rows
        # the learner's log-probs of the recorded tokens are the engine's: nothing was re-tokenised
        assert r["rollout_learner_logprob_mismatch_max"] < 1e-3
        assert r["probe_max_abs_error"] < 1e-4 or r["probe_max_abs_error"] != r["probe_max_abs_error"]
    assert any(r["turns_mean"] > 1.0 for r in records)  # some episodes did make two calls
    assert any(r["rows_per_episode"] > 1.0 for r in records)  # and some of those gave two rows
    summary = json.loads((run_dir / "summary.json").read_text())
    assert set(summary["eval_final"]) == {"return", "turns", "tool_calls"}


@pytest.mark.parametrize("agent, message", [
    ("tests.agent_programs:nowhere", "has no attribute 'nowhere'"),
    ("tests.agent_programs:graph", "must be an async function"),
])
def test_an_agent_that_cannot_be_loaded_fails_before_any_actor(tmp_path, tiny_model_dir, agent, message):
    proc = run_cli(["--run.output_dir", str(tmp_path), "--cluster.address", "127.0.0.1:1",
                    *agent_args(tmp_path, tiny_model_dir, agent)])
    assert proc.returncode != 0 and message in proc.stderr
    assert "actors ready" not in proc.stdout


ENV = {"name": "environment", "environment": "services.environments.randomwalks:interactive_randomwalks"}


@pytest.mark.parametrize("config, message", [
    ({"task": {"environment": "my_env:Env"}},
     "task.environment is set but task.name='randomwalks' does not read it"),
    ({"task": {"name": "environment"}}, "task.name='environment' needs task.environment"),
    ({"task": {"name": "environment", "environment": "my_env"}}, "package.module:factory"),
    ({"task": {"name": "dataset", "path": "x.jsonl", "environment_workers": 4}, "model": {"path": "/m"}},
     "task.environment_workers is set but task.name='dataset'"),
    ({"task": ENV, "reward": {"kind": "model", "model_path": "/r"}}, "rewarded by its episodes"),
    ({"task": {**ENV, "seed": 7}}, "task.seed=7 is set but task.name='environment' does not read it"),
    ({"task": ENV, "reward": {"missing_eos_penalty": -1.0}}, "reward.missing_eos_penalty is set"),
    ({"task": ENV, "rollout": {"max_new_tokens": 64, "max_trajectory_tokens": 32}},
     "rollout.max_new_tokens=64 .* exceeds rollout.max_trajectory_tokens=32"),
    ({"rollout": {"agent": "my_agent:solve"}},
     "rollout.agent='my_agent:solve' is set but task.name='randomwalks'"),
    ({"task": {"name": "agent", "path": "rows.jsonl"}}, "task.name='agent' and rollout.agent go together"),
    ({"task": {"name": "agent"}, "rollout": {"agent": "a:b"}}, "task.name='agent' needs task.path"),
    ({"task": {"name": "agent", "path": "rows.jsonl"}, "rollout": {"agent": "a:b"}}, "needs model.path"),
])
def test_episode_settings_are_refused_where_they_mean_nothing(config, message):
    from pydantic import ValidationError

    from services.config import JobConfig

    with pytest.raises(ValidationError, match=message):
        JobConfig.model_validate(config)


def test_a_trajectory_longer_than_the_models_positions_fails_before_any_actor(tmp_path, tiny_model_dir):
    args = agent_args(tmp_path, tiny_model_dir, "tests.agent_programs:walk")
    proc = run_cli(["--run.output_dir", str(tmp_path), "--cluster.address", "127.0.0.1:1", *args,
                    "--rollout.max_trajectory_tokens", "64"])
    assert proc.returncode == 1 and "actors ready" not in proc.stdout
    assert ("task.max_prompt_tokens=8 + rollout.max_trajectory_tokens=64 + 1 = 73 tokens do not fit the "
            "model's 32 positions") in proc.stderr
