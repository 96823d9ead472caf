"""Multi-turn agents on the real stack: environment workers (Ray actors) and a vLLM (CPU)
rollout engine on the shared Ray head, and whole jobs with DeepSpeed learners. No mocks: the environments are
real ones (tests/agent_envs.py records, attempt by attempt, what each episode was given and returned, so every
token of a batch is checked against it), and the faults are real (raises, a step that hangs past its deadline,
malformed results, a worker process that exits).

The actor-level tests share one engine and two environment workers (an engine counts its failed episodes
over its life, as in a job, so the failure-limit test sets its limit above the count it finds). The jobs run
once per session (``shared_runs``); the policy of the actor tests is the jobs' SFT warm start (the same
recipe and cache), trained once.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from actors.specs import EngineSpec, EnvironmentSpec, RolloutSpec
from tests.agent_envs import attempts, row
from tests.conftest import run_cli

pytestmark = pytest.mark.integration

ray = pytest.importorskip("ray")

RANDOMWALKS = "services.environments.randomwalks:interactive_randomwalks"
SCRIPTED = "tests.agent_envs:scripted"
# the jobs' SFT warm start (their run seed, steps, batch size and the default lr), built once for all. More,
# smaller steps than SMALL's 60 x 50 for about the same cost: 200 x 10 makes legal moves (a job's first eval
# optimality 0.14 at seed 1, 0.30 at seed 2, 4-5 turns an episode), 60 x 50 hardly any (0.01 and 0.00, 1.6
# turns), and a job learned nothing from it at seed 2
SFT = {"seed": 1, "steps": 200, "batch_size": 10, "lr": 1e-3}
STEP_TIMEOUT_S = 5.0  # a step of the scripted environment takes milliseconds, also on a loaded machine
MAX_PROMPT_TOKENS = 8
MAX_TRAJECTORY_TOKENS = 40
MAX_TURNS = 5
MAX_NEW_TOKENS = 3  # tokens of one model turn at most
STRICT_MAX_FAILURES = 2
LOGPROB_TOLERANCE = 1e-4
HANG_S = 30.0  # a hung step's sleep, far past the step deadline


@dataclass
class Agents:
    engine: object  # RolloutActor
    workers: list
    root: Path  # the Scripted environments' attempt files
    policy: str
    tokenizer: object


def limits(max_failures: int):
    from actors.episodes import EpisodeLimits

    return EpisodeLimits(MAX_TURNS, MAX_TRAJECTORY_TOKENS, MAX_PROMPT_TOKENS, STEP_TIMEOUT_S,
                         max_failures, SCRIPTED)


@pytest.fixture(scope="module")
def policy(cache_dir) -> str:
    """The interactive randomwalks GPT-2 (letters, ':' and '>'; 128 positions) with the jobs' short SFT."""
    from services.models import policy_dir
    from services.tasks import get_task

    return str(policy_dir(get_task("environment", environment=RANDOMWALKS), None, cache_dir, **SFT,
                          log=lambda _: None))


@pytest.fixture(scope="module")
def agents(ray_client, policy, tmp_path_factory):
    """Two environment workers as learner/fleet.py starts them (restartable), one vLLM engine."""
    from actors.environment import EnvironmentWorker
    from actors.rollout import RolloutActor
    from learner.cluster import start_actor
    from services.config import RoleResources
    from services.models import load_tokenizer

    root = tmp_path_factory.mktemp("episodes")
    light = RoleResources(num_cpus=0.05)
    environment = EnvironmentSpec(SCRIPTED, {"root": str(root)}, policy, STEP_TIMEOUT_S)
    workers = [start_actor(EnvironmentWorker, "environment", i, light, None, i, environment, max_restarts=2,
                           tag="agents") for i in range(2)]
    max_model_len = MAX_PROMPT_TOKENS + MAX_TRAJECTORY_TOKENS + 1
    engine = start_actor(RolloutActor, "rollout", 0, light, None, 0,
                         RolloutSpec(policy, EngineSpec("vllm", 0, max_model_len, 64, "float32", 0)),
                         tag="agents")
    actors = [*workers, engine]
    try:
        ray.get([a.ready.remote() for a in actors])
        yield Agents(engine, workers, root, policy, load_tokenizer(policy))
    finally:
        for actor in actors:
            ray.kill(actor)


def run_episodes(agents: Agents, rows: list[dict], first_row: int = 100, max_failures: int = 1_000):
    """The rows' episodes in one chunk, row i as prompt row ``first_row + i``, from worker i % 2."""
    from actors.engines import SamplingSettings

    index = list(range(first_row, first_row + len(rows)))
    return agents.engine.run_episodes.remote(rows, index, [7 * i + 3 for i in index],
                                             SamplingSettings(1.0, 1.0, MAX_NEW_TOKENS),
                                             agents.tokenizer.pad_token_id, None, agents.workers,
                                             limits(max_failures), first_worker=0)


# ---------------------------------------------------------------------------------------------- checks


@dataclass
class Segment:
    sampled: bool  # the model's tokens, or the environment's
    ids: list[int]
    start: int  # column in the response


def segments(batch, b: int) -> list[Segment]:
    """Row ``b``'s trajectory as runs of the model's and the environment's tokens, in order."""
    n = int(batch.response_mask[b].sum())
    out: list[Segment] = []
    for t, (token, sampled) in enumerate(zip(batch.response_ids[b, :n].tolist(),
                                             batch.action_mask[b, :n].tolist(), strict=True)):
        if out and out[-1].sampled == bool(sampled):
            out[-1].ids.append(token)
        else:
            out.append(Segment(bool(sampled), [token], t))
    return out


def check_masks(batch) -> None:
    """response_mask a prefix, action_mask inside it, nothing of the model's (log-probs, rewards) on the
    environment's tokens or the padding."""
    width = batch.response_mask.shape[1]
    for b, n in enumerate(batch.response_lengths.tolist()):
        assert batch.response_mask[b].tolist() == [1.0] * n + [0.0] * (width - n), b
    assert ((batch.action_mask == 0) | (batch.action_mask == 1)).all()
    assert (batch.action_mask <= batch.response_mask).all()
    off = batch.action_mask == 0
    assert (batch.rollout_logprobs[off] == 0).all()
    assert (batch.turn_rewards[off] == 0).all()


def check_token_in_token_out(batch, policy: str) -> float:
    """The learner's forward (fp32, transformers) over the trajectories: its log-probs of the model's tokens
    equal the engine's sampled-token log-probs, so the batch holds the ids the engine sampled, after the
    context it sampled them in. Returns the largest difference."""
    from services.experience import response_forward
    from services.models import load_causal_lm

    with torch.no_grad():
        learner, _, _ = response_forward(load_causal_lm(policy, "float32").eval(), batch)
    model = batch.action_mask > 0
    assert model.sum() > 0
    error = float((learner - batch.rollout_logprobs)[model].abs().max())
    assert error < LOGPROB_TOLERANCE, error
    # not a fill value
    assert (batch.rollout_logprobs[model] <= 0).all() and batch.rollout_logprobs[model].sum() < 0
    return error


def check_episode(batch, b: int, log: dict, tokenizer, failed_attempts: int) -> None:
    """Row ``b`` of ``batch`` is the episode that ``log`` (its environment's record) describes, token for
    token: the prompt is the reset observation encoded once; then model turns and the observations that
    followed them (encoded once, appended as ids), each turn's reward on its last model token."""
    from services.environments import encode_observation
    from services.experience import FINISH_LENGTH, FINISH_STOP

    eos = tokenizer.eos_token_id
    prompt = batch.prompt_ids[b][batch.prompt_mask[b] > 0].tolist()
    assert prompt == encode_observation(log["reset"], tokenizer, first=True), b
    assert len(prompt) <= MAX_PROMPT_TOKENS
    runs, steps, turns = segments(batch, b), log["steps"], int(batch.num_turns[b])
    assert [s.sampled for s in runs] == [k % 2 == 0 for k in range(len(runs))], b  # model first, alternating
    model, env = runs[0::2], runs[1::2]
    length = int(batch.response_mask[b].sum())
    truncated = int(batch.finish_reason[b]) == FINISH_LENGTH
    assert len(model) == turns >= 1
    # the environment took every turn, but one that the token budget cut inside the model's turn
    assert len(steps) == turns or \
        (truncated and length == MAX_TRAJECTORY_TOKENS and len(steps) == turns - 1), b
    for k, segment in enumerate(model):
        cut = truncated and k == len(model) - 1 and len(steps) < turns
        assert eos not in segment.ids[:-1], b  # a turn ends at its EOS
        assert segment.ids[-1] == eos or len(segment.ids) == MAX_NEW_TOKENS or cut, b
        rewards = batch.turn_rewards[b, segment.start:segment.start + len(segment.ids)].tolist()
        if k < len(steps):
            # the environment got the turn as text and its reward sits on the turn's last token
            assert tokenizer.decode(segment.ids, skip_special_tokens=True) == steps[k]["action"], b
            assert rewards[:-1] == [0.0] * (len(rewards) - 1) and \
                rewards[-1] == pytest.approx(steps[k]["reward"])
        else:
            assert rewards == [0.0] * len(rewards)
    # each step that went on was followed by its observation (none after the last turn); the budget may cut
    # the last one
    observations = [s["observation"] for s in steps[:MAX_TURNS - 1] if s["observation"] is not None]
    assert len(env) == len(observations) if not truncated else \
        len(env) in (len(observations), len(observations) - 1)
    for k, segment in enumerate(env):
        expected = encode_observation(observations[k], tokenizer, first=False)
        if truncated and k == len(env) - 1 and segment.start + len(segment.ids) == MAX_TRAJECTORY_TOKENS:
            expected = expected[:len(segment.ids)]
        assert segment.ids == expected, (b, k)
    assert length <= MAX_TRAJECTORY_TOKENS
    assert float(batch.turn_rewards[b].sum()) == pytest.approx(sum(s["reward"] for s in steps), abs=1e-5)
    assert int(batch.tool_calls[b]) == sum(s["tool_calls"] for s in steps)
    assert int(batch.environment_failures[b]) == failed_attempts
    assert float(batch.environment_seconds[b]) > 0
    if not truncated:
        assert int(batch.finish_reason[b]) == FINISH_STOP and log["done"] and turns == log["row"]["turns"], b
    else:
        assert not log["done"], b


def check_batch(agents: Agents, batch, rows: list[dict], failed: list[int] | None = None) -> list[list[dict]]:
    """Every row of ``batch`` against its environment's attempts: it holds the last attempt (the one that
    ended), and ``environment_failures`` counts the others. Returns each row's attempts."""
    failed = failed or [0] * len(rows)
    assert batch.batch_size[0] == len(rows)
    check_masks(batch)
    check_token_in_token_out(batch, agents.policy)
    logs = [attempts(agents.root, r["key"]) for r in rows]
    for b, (r, tried, fails) in enumerate(zip(rows, logs, failed, strict=True)):
        assert len(tried) == fails + 1, (r["key"], tried)
        assert not any(t["done"] for t in tried[:-1]), r["key"]  # each attempt before it failed midway
        assert tried[-1]["fault"] is None
        check_episode(batch, b, tried[-1], agents.tokenizer, fails)
    return logs


# ---------------------------------------------------------------------------------------------- actor level


def test_trajectories_are_the_engines_tokens_and_the_environments_observations(agents):
    """Episodes of 1 to 4 turns, observations as text and as token ids (one of them the EOS id, which text
    would lose): every token, mask and reward of the batch is what the engine sampled or the environment
    returned, and the learner's forward over the trajectories gives the engine's log-probs (the probe on
    multi-turn trajectories)."""
    from learner.kl import kl_penalized_rewards
    from services.experience import response_forward
    from services.models import load_causal_lm

    rows = [row(f"tito-{i}", turns=1 + i % 4, id=i, kind="ids" if i % 2 else "text") for i in range(8)]
    batch = ray.get(run_episodes(agents, rows))
    check_batch(agents, batch, rows)
    assert batch.num_turns.tolist() == [1, 2, 3, 4, 1, 2, 3, 4]  # each ends at its own turn
    assert batch.prompt_index.tolist() == list(range(100, 108))
    assert (batch.action_mask.sum(-1) < batch.response_mask.sum(-1))[batch.num_turns > 1].all()
    observed = (batch.action_mask == 0) & (batch.response_mask > 0)
    # an observation's, kept as is
    assert agents.tokenizer.eos_token_id in batch.response_ids[observed].tolist()

    # the learner's per-token rewards on these trajectories: the KL penalty and the turns' rewards on the
    # model's tokens only
    with torch.no_grad():
        logprobs, _, _ = response_forward(load_causal_lm(agents.policy, "float32"), batch)
    ref = logprobs - 0.3 * batch.response_mask  # a reference 0.3 nats below on every real token
    rewards, kl = kl_penalized_rewards(batch.turn_rewards.sum(-1), logprobs * batch.action_mask,
                                       ref * batch.action_mask, batch.action_mask, 0.1, "k1",
                                       batch.turn_rewards)
    env = batch.action_mask == 0
    assert (rewards[env] == 0).all() and (kl[env] == 0).all()
    model = batch.action_mask > 0
    assert torch.allclose(kl[model], torch.full_like(kl[model], 0.3), atol=1e-5)
    assert torch.allclose(rewards[model], batch.turn_rewards[model] - 0.03, atol=1e-5)


def test_the_token_budget_and_the_turn_limit_cut_trajectories(agents):
    """rollout.max_trajectory_tokens: long observations run out of tokens before the turn limit, and the
    trajectory is cut at the bound (finish reason length). rollout.max_turns: an episode that never ends stops
    after the last turn's step (its reward counted, no observation after it); one that ends on that turn
    ends."""
    from services.experience import FINISH_LENGTH, FINISH_STOP

    rows = [row("limit-endless", turns=99, id=0, obs_len=1),
            row("limit-last", turns=MAX_TURNS, id=3, obs_len=1),
            *(row(f"limit-long-{n}", turns=99, id=n, obs_len=n) for n in range(9, 15))]
    batch = ray.get(run_episodes(agents, rows, first_row=200))
    logs = check_batch(agents, batch, rows)
    assert batch.num_turns[:2].tolist() == [MAX_TURNS, MAX_TURNS]
    assert batch.finish_reason[:2].tolist() == [FINISH_LENGTH, FINISH_STOP]
    assert len(logs[0][-1]["steps"]) == MAX_TURNS and not logs[0][-1]["done"]
    assert segments(batch, 0)[-1].sampled  # the last turn's observation is not appended
    long = slice(2, len(rows))
    assert (batch.finish_reason[long] == FINISH_LENGTH).all()
    assert (batch.num_turns[long] < MAX_TURNS).all()
    assert batch.response_lengths[long].tolist() == [MAX_TRAJECTORY_TOKENS] * (len(rows) - 2)
    assert batch.response_ids.shape[1] == MAX_TRAJECTORY_TOKENS


FAULTY_ROWS = [  # (fault, failed attempts before the episode that ends)
    (None, 0),
    ({"at": "step", "turn": 2, "kind": "raise"}, 1),
    ({"at": "reset", "kind": "raise"}, 1),
    ({"at": "step", "turn": 1, "kind": "malformed"}, 1),  # three values
    (None, 0),
    ({"at": "step", "turn": 1, "kind": "hang", "seconds": HANG_S}, 1),
    ({"at": "reset", "kind": "malformed"}, 1),  # a dict
    ({"at": "step", "turn": 2, "kind": "no_observation"}, 1),  # None, not done
    ({"at": "step", "turn": 1, "kind": "nan"}, 1),  # a NaN reward
    ({"at": "reset", "kind": "no_observation"}, 1),  # an empty prompt
    ({"at": "step", "turn": 1, "kind": "raise", "attempts": 2}, 2),  # fails again once regenerated
    (None, 0),
]


def test_failed_episodes_are_regenerated_and_counted_never_trained_on(agents):
    """An environment that raises, hangs past the step deadline or returns something malformed (at reset or at
    a step) fails its episode only: it is generated again from its reset, the batch comes back whole, each row
    holds its attempt that ended (never a failed one) and counts the failed ones. The rows beside them, on the
    same workers, fail nothing: the hung step costs its own episode only."""
    rows = [row(f"fault-{i}", turns=3, id=i, **({"fault": fault} if fault else {}))
            for i, (fault, _) in enumerate(FAULTY_ROWS)]
    start = time.monotonic()
    batch = ray.get(run_episodes(agents, rows, first_row=300))
    seconds = time.monotonic() - start
    failed = [n for _, n in FAULTY_ROWS]
    logs = check_batch(agents, batch, rows, failed)
    assert batch.environment_failures.tolist() == failed
    for r, tried in zip(rows, logs, strict=True):
        for t in tried[:-1]:  # each failed where its row asked
            fault = r["fault"]
            assert t["fault"] == {"kind": fault["kind"], "turn": fault.get("turn", 0)}, r["key"]
    # the prompt carries its attempt (tests/agent_envs.py): the batch holds the regenerated one
    for b, tried in enumerate(logs):
        assert batch.prompt_ids[b][batch.prompt_mask[b] > 0].tolist()[0] == \
            agents.tokenizer.convert_tokens_to_ids(tried[-1]["reset"][0])
    assert seconds < HANG_S / 2  # the hung step was given up at its deadline, not waited for


def test_a_worker_that_dies_is_restarted_and_its_episodes_regenerated(agents):
    """A step that kills its worker's process (os._exit) fails every episode that worker held in that call;
    they are generated again on the other worker and counted, and Ray restarts the worker (max_restarts),
    which then runs episodes again."""
    # row i starts on worker i % 2: rows 1, 3, 5 on worker 1; row 3 kills it at turn 2, when rows 3 and 5 are
    # still running there (row 1 ended at turn 1)
    turns = [2, 1, 3, 3, 2, 3]
    rows = [row(f"die-{i}", turns=t, id=i) for i, t in enumerate(turns)]
    rows[3]["fault"] = {"at": "step", "turn": 2, "kind": "die"}
    counted = ray.get(agents.engine.stats.remote())["episode_failures"]
    batch = ray.get(run_episodes(agents, rows, first_row=400))
    logs = check_batch(agents, batch, rows, failed=[0, 0, 0, 1, 0, 1])
    # both rows are generated again, but the loss of the worker counts once against the failure limit
    assert ray.get(agents.engine.stats.remote())["episode_failures"] == counted + 1
    assert logs[3][0]["fault"] == {"kind": "die", "turn": 2}
    dead = logs[3][0]["pid"]
    assert logs[5][0]["pid"] == dead  # the bystander died with it
    assert {logs[i][-1]["pid"] for i in (0, 2, 3, 4, 5)} == {logs[0][-1]["pid"]}  # all ended on worker 0

    # worker 1 comes back, a new process, and takes its episodes again
    deadline = time.monotonic() + 120
    while True:
        try:
            assert ray.get(agents.workers[1].ready.remote(), timeout=60)
            break
        except ray.exceptions.ActorUnavailableError:  # restarting: a call now fails at once
            assert time.monotonic() < deadline, "environment worker 1 did not come back within 120s"
            time.sleep(0.5)
    again = [row(f"die-after-{i}", turns=2, id=i) for i in range(4)]
    batch = ray.get(run_episodes(agents, again, first_row=410))
    logs = check_batch(agents, batch, again)
    pids = {logs[i][0]["pid"] for i in (1, 3)}
    assert len(pids) == 1 and dead not in pids


def test_the_job_fails_past_max_failures_naming_the_environment_row_and_turn(agents):
    """task.environment_max_failures failed episodes are regenerated; the next failure on that engine fails
    the chunk with an error naming the environment, the row and the turn. The engine has counted the failures
    of the tests before this one: the limit is set STRICT_MAX_FAILURES above them."""
    from services.environments import EnvironmentFailure

    limit = ray.get(agents.engine.stats.remote())["episode_failures"] + STRICT_MAX_FAILURES
    fault = {"at": "step", "turn": 1, "kind": "raise"}
    rows = [row(f"strict-{i}", turns=2, id=i, **({"fault": fault} if i < STRICT_MAX_FAILURES else {}))
            for i in range(4)]
    batch = ray.get(run_episodes(agents, rows, first_row=500, max_failures=limit))
    check_batch(agents, batch, rows, failed=[1] * STRICT_MAX_FAILURES + [0] * (4 - STRICT_MAX_FAILURES))

    late = {"at": "step", "turn": 2, "kind": "raise"}
    rows = [row("strict-last-0", turns=3, id=0), row("strict-last-1", turns=3, id=1, fault=late)]
    with pytest.raises(EnvironmentFailure) as failure:
        ray.get(run_episodes(agents, rows, first_row=510, max_failures=limit))
    message = str(failure.value)
    assert f"environment {SCRIPTED!r} failed at row 511, turn 2" in message
    assert "RuntimeError: injected fault at turn 2" in message
    assert f"({limit + 1} failed episodes on this engine, more than task.environment_max_failures={limit})" \
        in message


def test_an_agent_past_its_failure_limit_fails_the_chunk_naming_it(agents):
    """rollout.agent on the same engine: an agent program that raises on every row is retried up to
    rollout.agent_max_failures times, then fails the chunk naming the agent, the row and the cause."""
    from actors.agents import AgentFailure, AgentSettings
    from actors.engines import SamplingSettings

    agent = "tests.agent_programs:never_answers"
    rows = [{"start": s} for s in "bcd"]
    with pytest.raises(AgentFailure) as failure:
        ray.get(agents.engine.run_agents.remote(rows, [0, 1, 2], [1, 2, 3], SamplingSettings(1.0, 1.0, 4),
                                                agents.tokenizer.pad_token_id, None,
                                                AgentSettings(agent, 30.0, 2, MAX_TRAJECTORY_TOKENS)))
    message = str(failure.value)
    assert f"agent {agent!r} failed at row" in message
    assert "RuntimeError: no answer for" in message and "rollout.agent_max_failures=2" in message


def test_a_turn_whose_contexts_pass_one_engine_step_still_generates(agents):
    """One engine call of a turn prefills every episode's trajectory so far: 96 episodes of about 45 tokens
    pass the 4096 tokens vLLM prefills in one step. A seeded request whose prompt vLLM's CPU build prefilled
    in parts failed ("CPU Generator does not use offset"), so the engine prefills whole prompts."""
    rows = [row(f"wide-{i}", turns=2, id=i, prompt_len=MAX_PROMPT_TOKENS, obs_len=32) for i in range(96)]
    batch = ray.get(run_episodes(agents, rows, first_row=700))
    check_batch(agents, batch, rows)
    assert int((batch.prompt_mask.sum(-1) + batch.response_mask.sum(-1)).sum()) > 4096


def test_a_first_observation_longer_than_max_prompt_tokens_is_refused_naming_the_row(agents):
    from services.environments import EnvironmentFailure

    rows = [row("prompt-ok", turns=1, id=0),
            row("prompt-long", turns=1, id=1, prompt_len=MAX_PROMPT_TOKENS + 4)]
    with pytest.raises(EnvironmentFailure) as failure:
        ray.get(run_episodes(agents, rows, first_row=600))
    message = str(failure.value)
    assert f"environment {SCRIPTED!r} failed at row 601, turn 0" in message
    assert f"{MAX_PROMPT_TOKENS + 4} tokens, more than task.max_prompt_tokens={MAX_PROMPT_TOKENS}" in message


# ---------------------------------------------------------------------------------------------- job level

# SMALL's sizes with the SFT above
ENVIRONMENT_JOB = ("--run.seed", str(SFT["seed"]), "--model.sft_steps", str(SFT["steps"]),
                   "--model.sft_batch_size", str(SFT["batch_size"]), "--rollout.batch_size", "32",
                   "--rollout.chunk_size", "16", "--ppo.minibatch_size", "16", "--run.eval_every", "100",
                   "--task.name", "environment", "--task.environment", RANDOMWALKS,
                   "--rollout.max_trajectory_tokens", "96", "--rollout.max_turns", "9")
EPISODE_METRICS = ("turns_mean", "tool_calls_mean", "environment_seconds", "trajectory_model_tokens_mean",
                   "trajectory_environment_tokens_mean", "environment_failures", "truncated_fraction")


def read_run(run_dir: Path, proc) -> tuple[list[dict], dict]:
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return records, json.loads((run_dir / "summary.json").read_text())


def check_trajectory_records(records: list[dict]) -> None:
    """What every iteration of a randomwalks environment job reports, and the KL identity on trajectories."""
    for r in records:
        for key in EPISODE_METRICS:
            assert math.isfinite(r[key]), (key, r)
        assert 1 <= r["turns_mean"] <= 9
        assert r["tool_calls_mean"] == 0 and r["environment_failures"] == 0
        assert r["environment_seconds"] > 0
        assert r["trajectory_model_tokens_mean"] >= r["turns_mean"]  # at least a token a turn
        assert 0 <= r["truncated_fraction"] <= 1
        assert r["response_length_mean"] == r["trajectory_model_tokens_mean"]
        # sum_t reward_t = score - beta * KL over the model's tokens of the whole trajectory: the penalty's KL
        # (in sync mode the controller's statistic itself; async: the statistic is prefix-weighted, the
        # penalty not)
        assert r["reward_mean"] == pytest.approx(r["score_mean"] - r["kl_coef_used"] * r["kl_penalty_mean"],
                                                 rel=1e-5, abs=1e-7)
    # the environment's tokens were there: observations after the first turn
    assert sum(r["trajectory_environment_tokens_mean"] for r in records) > 0
    # the identity is not 0 == 0 - 0 (async: the learner's log-probs of rows an older version sampled, whose
    # k1 mean may be below 0 while the policy is near the reference)
    assert any(r["kl_response_mean"] != 0 for r in records)


@pytest.fixture(scope="module")
def randomwalks_run(shared_runs):
    return shared_runs.get("agents-randomwalks", *ENVIRONMENT_JOB, "--run.iterations", "6")


def test_interactive_randomwalks_job_learns_and_keeps_exact_books(randomwalks_run):
    """The interactive randomwalks job: evaluation optimality rises over its start; every iteration carries
    the episode metrics, the KL identity on multi-turn trajectories, and (fp32) the learner's log-probs of the
    trajectories equal the engine's."""
    records, summary = read_run(*randomwalks_run)
    assert [r["iteration"] for r in records] == list(range(1, 7))
    check_trajectory_records(records)
    for r in records:
        assert r["probe_max_abs_error"] < 1e-4
        assert r["rollout_learner_logprob_mismatch_max"] < 1e-3
        assert r["batch_staleness_max"] == 0
        assert r["kl_response_mean"] == pytest.approx(r["kl_penalty_mean"], rel=1e-9)  # sync: the same KL
    start, final = summary["eval_start"]["optimality"], summary["eval_final"]["optimality"]
    # seen after 6 iterations: 0.14 -> 0.41 (seed 1), 0.30 -> 0.68 (seed 2) on an Intel Xeon; 0.16 -> 0.25 on
    # an AMD EPYC (the same code, other kernels' rounding: the 6 iterations end elsewhere), whose training
    # score rose 0.24 -> 0.59. So the evaluation must rise, and the score on the policy's own episodes by 0.15
    assert final > start + 0.05, (start, final)
    scores = [r["score_mean"] for r in records]
    assert sum(scores[-2:]) / 2 > scores[0] + 0.15, scores
    assert 1 <= summary["eval_final"]["turns"] <= 9


def test_async_in_flight_group_estimator_job_on_trajectories(shared_runs):
    """rollout.mode async with in-flight updates (partial) and a group estimator (GRPO, 4 episodes a prompt)
    on the same environment: the versions load while episodes run (an episode's turns may span versions, each
    token stamped with its own); it completes with the same books, 8 prompts of 4 episodes a batch, every
    trained token at most one version behind the learner, a row stamped with its oldest, and a clean probe."""
    run_dir, proc = shared_runs.get("agents-in-flight", *ENVIRONMENT_JOB, "--run.iterations", "3",
                                    "--rollout.mode", "async", "--rollout.in_flight_updates", "partial",
                                    "--ppo.advantage", "grpo", "--rollout.samples_per_prompt", "4")
    records, summary = read_run(run_dir, proc)
    assert [r["iteration"] for r in records] == [1, 2, 3]
    check_trajectory_records(records)
    for r in records:
        assert r["episodes"] == 32 and len(r["prompt_rows"]) == 8 and r["batch_staleness_max"] <= 1
        # 0: KL 0 at first
        assert math.isfinite(r["kl_response_mean_stderr"]) and r["kl_response_mean_stderr"] >= 0
        assert 0 <= r["in_flight_token_staleness_mean"] <= r["batch_staleness_max"]
        assert 0 <= r["in_flight_mixed_row_fraction"] <= 1
        assert r["probe_max_abs_error"] < 1e-4  # the probe's scores are one version's, never a mix
    assert records[0]["batch_policy_versions"] == [0] and records[0]["in_flight_token_staleness_mean"] == 0
    assert math.isfinite(summary["eval_final"]["optimality"])


def test_the_readme_environment_runs_a_job(shared_runs, tiny_model_dir):
    """The README's NextLetter, named as tests.readme_environment:NextLetter, with a model of the user's
    (model.path; the randomwalks GPT-2, whose 32 positions take a short prompt and trajectory, one letter a
    turn): the job runs, and its evaluation reports the episodes' return, which the steps' rewards make."""
    run_dir, proc = shared_runs.get(
        "agents-readme", "--task.name", "environment", "--task.environment",
        "tests.readme_environment:NextLetter", "--model.path", tiny_model_dir, "--rollout.max_turns", "3",
        "--task.max_prompt_tokens", "4", "--rollout.max_new_tokens", "1", "--rollout.max_trajectory_tokens",
        "16", "--rollout.batch_size", "32", "--rollout.chunk_size", "16", "--ppo.minibatch_size", "16",
        "--run.iterations", "2", "--run.eval_every", "100", "--run.seed", "1")
    records, summary = read_run(run_dir, proc)
    assert [r["iteration"] for r in records] == [1, 2]
    for r in records:  # three rounds, each one letter and the next letter shown (none after the last)
        assert r["turns_mean"] == 3 and r["environment_failures"] == 0 and r["truncated_fraction"] == 0
        assert r["trajectory_model_tokens_mean"] == 3 and r["trajectory_environment_tokens_mean"] == 2
        assert 0 <= r["score_mean"] <= 3
    for evaluation in (summary["eval_start"], summary["eval_final"]):
        assert 0 <= evaluation["return"] <= 3 and evaluation["turns"] == 3
    # some answers were right (one letter in a few dozen): the steps' rewards reached the scores and the
    # evaluation
    assert summary["eval_start"]["return"] + summary["eval_final"]["return"] > 0
    assert sum(r["score_mean"] for r in records) > 0
    assert f"eval return {summary['eval_final']['return']:.3f}" in proc.stdout


UNIMPORTABLE = {
    "tests.agent_envs:nowhere": "module 'tests.agent_envs' has no attribute 'nowhere'",
    "no_such_module:f": "module 'no_such_module' cannot be imported",
}


def test_an_environment_that_cannot_be_imported_fails_before_any_actor(tmp_path):
    """Named, and before the driver reaches a cluster (the address is one nothing listens on) or writes a
    run."""
    def job(spec: str):
        out = tmp_path / spec.replace(":", "-")
        out.mkdir()
        return out, run_cli(["--run.output_dir", str(out), "--cluster.address", "127.0.0.1:1", "--task.name",
                             "environment", "--task.environment", spec])

    for spec, why in UNIMPORTABLE.items():
        out, proc = job(spec)
        output = proc.stdout + proc.stderr
        assert proc.returncode in (1, 2), output[-3000:]
        assert f"task.environment={spec!r}" in proc.stderr and why in proc.stderr, output[-3000:]
        assert "actors ready" not in output and "cannot reach the Ray cluster" not in output
        assert list(out.iterdir()) == []  # no run directory
