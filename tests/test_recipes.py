"""The recipes (docs/recipes.md): the adapters to textarena, reasoning-gym, gymnasium, GEM and SkyRL-Gym on
the real packages, then each command on the page run as a job of one iteration, on a tiny random Llama in
place of SmolLM2."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import math
import re
import shutil
import string
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import gymnasium
import pytest

from services.environments import load_environment_factory, make_environment
from services.environments.base import EVAL_SEEDS_START, check_reset_result, check_step_result
from services.environments.gem import gem_environment
from services.environments.gym import GymnasiumEnvironment, gymnasium_environment
from services.environments.reasoning_gym import reasoning_gym_environment
from services.environments.skyrl import skyrl_environment
from services.environments.textarena import textarena_environment
from tests.test_agents import read_run
from tests.test_docs import learner_main_commands

ROOT = Path(__file__).resolve().parents[1]
CLIFF = {"id": "CliffWalking-v1", "render_mode": "ansi", "action_names": ["up", "right", "down", "left"]}


# ---------------------------------------------------------------- textarena


def test_a_textarena_game_is_played_turn_by_turn_and_rewarded_at_its_end():
    env = textarena_environment("GuessTheNumber-v0", games=4, eval_games=2)
    assert env.rows() == [{"game": n} for n in range(4)]
    assert env.eval_rows() == [{"game": EVAL_SEEDS_START}, {"game": EVAL_SEEDS_START + 1}]
    (first,) = check_reset_result(env.reset({"game": 5}, seed=0), "ta")
    assert first["role"] == "user" and "Guess The Number" in first["content"]
    assert "[GAME]" not in first["content"]  # no observation wrapper's history or prefixes
    secret = env.env.env.state.game_state["game_number"]
    assert env.reset({"game": 5}, seed=1) == [first]  # a row is one game, whatever the episode's seed
    wrong = 1 if secret != 1 else 2
    turn = check_step_result(env.step(f"my guess is [{wrong}]"), "ta")
    assert not turn.done and turn.reward == 0
    # what the game said since the move, not the move itself (the trajectory has it)
    assert turn.observation == [{"role": "user", "content": "The target number is "
                                 + ("higher." if wrong < secret else "lower.")}]
    won = check_step_result(env.step(f"[{secret}]"), "ta")
    assert won.done and won.reward == 1.0 and won.observation is None
    env.reset({"game": 5}, seed=0)
    notice = env.step("no brackets")[0][0]["content"]
    assert "invalid move" in notice.lower()
    plain = textarena_environment("GuessTheNumber-v0", chat=False)
    assert isinstance(plain.reset({"game": 0}, seed=0), str)


def test_a_textarena_game_for_two_players_is_refused_by_name():
    with pytest.raises(ValueError, match="'TicTacToe-v0' cannot be played by one player"):
        textarena_environment("TicTacToe-v0")


# ---------------------------------------------------------------- reasoning-gym


def test_a_reasoning_gym_answer_is_scored_by_the_datasets_verifier():
    spec = "services.environments.reasoning_gym:reasoning_gym_environment"
    env = make_environment(load_environment_factory(spec), {"dataset": "leg_counting",
                                                            "size": 3, "eval_size": 2, "min_animals": 1,
                                                            "max_animals": 2}, spec)
    assert env.rows() == [{"index": i} for i in range(3)] and env.eval_rows() == [{"index": 3}, {"index": 4}]
    system, question = check_reset_result(env.reset({"index": 4}, seed=0), spec)
    assert system["role"] == "system" and "<answer>" in system["content"]
    assert "legs" in question["content"]
    answer = env.dataset[4]["answer"]
    assert check_step_result(env.step(f"I think <answer>{answer}</answer>"), spec).reward == 1.0
    env.reset({"index": 4}, seed=0)
    assert env.step(str(answer)) == (None, 1.0, True, {})  # no tags: the whole turn is the answer
    env.reset({"index": 4}, seed=0)
    assert env.step(f"<answer>{int(answer) + 1}</answer>")[1] < 1.0
    with pytest.raises(ValueError, match="system_prompt 'terse' is not one of reasoning-gym's"):
        reasoning_gym_environment("leg_counting", system_prompt="terse")


# ---------------------------------------------------------------- gymnasium


def test_a_gymnasium_env_is_read_from_its_rendering_and_its_discrete_actions_from_their_names():
    env = gymnasium_environment(**CLIFF, instructions="reach T", chat=True, episodes=2, eval_episodes=1)
    assert env.rows() == [{"seed": 0}, {"seed": 1}]
    system, grid = env.reset({"seed": 0}, seed=5)
    assert system == {"role": "system", "content": "reach T"}
    assert grid["content"].splitlines()[3].startswith("x  C")  # the player at the bottom left
    assert [env.parse_action(t) for t in ("UP!", "go right", "3", "upright", "9", "")] == \
        [0, 1, 3, None, None, None]
    step = check_step_result(env.step("I move up"), "cliff")
    assert step.reward == -1 and not step.done and \
        step.observation[0]["content"].splitlines()[2].startswith("x")
    invalid = check_step_result(env.step("jump"), "cliff")
    assert invalid == check_step_result((None, 0.0, True, {"invalid_action": True}), "cliff")
    plain = gymnasium_environment(**CLIFF, instructions="reach T", invalid_action_reward=-5)
    assert plain.reset({"seed": 0}, seed=0).startswith("reach T\no  o")
    assert plain.step("?")[:3] == (None, -5.0, True)


def test_a_gymnasium_env_that_cannot_be_text_is_refused_naming_its_spaces():
    with pytest.raises(ValueError,
                       match=r"observation space Discrete\(48\) and render_mode None.*render_mode: ansi"):
        gymnasium_environment("CliffWalking-v1")
    with pytest.raises(ValueError, match=r"action space Box\(-1.0, 1.0, \(1,\), float32\)"):
        GymnasiumEnvironment(_text_env_with(gymnasium.spaces.Box(-1, 1, (1,))))
    with pytest.raises(ValueError, match=r"needs 4 distinct names"):
        gymnasium_environment(**{**CLIFF, "action_names": ["up", "down"]})
    with pytest.raises(ValueError, match=r"action space Text.*is not Discrete"):
        GymnasiumEnvironment(_text_env_with(gymnasium.spaces.Text(8)), action_names=["a"])


def _text_env_with(action_space) -> gymnasium.Env:
    env = gymnasium.Env()
    env.observation_space, env.action_space = gymnasium.spaces.Text(8), action_space
    return env


# ---------------------------------------------------------------- GEM


def test_a_gem_game_is_played_turn_by_turn_framed_as_gems_own_wrapper_frames_it():
    env = gem_environment("game:GuessTheNumber-v0-easy", episodes=3, eval_episodes=2)
    assert env.rows() == [{"seed": n} for n in range(3)]
    assert env.eval_rows() == [{"seed": EVAL_SEEDS_START}, {"seed": EVAL_SEEDS_START + 1}]
    (rules,) = check_reset_result(env.reset({"seed": 4}, seed=0), "gem")
    assert rules["role"] == "user" and "Guess The Number" in rules["content"]
    assert rules["content"].endswith("Enter your next guess.")  # the info's suffix, as GEM's wrapper adds it
    number = env.env.game_number
    wrong = 1 if number != 1 else 2
    hint = check_step_result(env.step(f"\\boxed{{{wrong}}}"), "gem")
    assert (hint.reward, hint.done) == (0.0, False)
    assert hint.observation[0]["content"] == (f"At turn 1, you guessed {wrong}, and the target number is "
                                              f"higher than {wrong}.\nEnter your next guess.")
    assert env.step(f"It is \\boxed{{{number}}}")[1:3] == (1.0, True)
    env.reset({"seed": 4}, seed=0)
    assert env.env.game_number == number  # a row is one game
    assert env.step("no guess")[:3] == (None, -0.1, True)
    with pytest.raises(ValueError, match="GEM has no environment 'game:Nope-v0'.*game:Wordle-v0-easy"):
        gem_environment("game:Nope-v0")


class GlobalRandomGame:
    """A game that seeds Python's global random at reset and draws from it a moment later, as GEM's do: its
    first observation is the draw."""

    def reset(self, row: dict, seed: int) -> str:
        import random
        import time

        random.seed(row["seed"])
        time.sleep(0.02)
        return str(random.random())

    def step(self, action: str):
        return None, 0.0, True, {}


def test_the_episodes_of_a_group_reset_together_draw_the_game_their_seed_picks(printable_llama_dir):
    """The environment worker's contract: a blocking reset runs alone in its process, so one that seeds and
    then draws from process-global random state draws what it seeded while a group resets at once (without
    it, the threads' draws interleave)."""
    import random

    from actors.environment import EnvironmentWorker
    from actors.specs import EnvironmentSpec

    spec = EnvironmentSpec("tests.test_recipes:GlobalRandomGame", {}, printable_llama_dir)
    worker = EnvironmentWorker(0, spec)
    rows = [{"seed": 1}] * 4 + [{"seed": 2}] * 4
    outcomes = asyncio.run(worker.reset([f"e{i}" for i in range(8)], rows, list(range(8)), list(range(8))))
    drawn = [worker.tokenizer.decode(o.ids) for o in outcomes]
    assert not any(o.error for o in outcomes), outcomes
    assert drawn == [str(random.Random(r["seed"]).random()) for r in rows]


# ---------------------------------------------------------------- SkyRL-Gym

SKYRL_ROW = {"prompt": [{"role": "system", "content": "Solve."},
                        {"role": "user", "content": "Ana has 3 coins and gets 4 more. How many?"}],
             "env_class": "gsm8k_multi_turn", "reward_spec": {"method": "rule", "ground_truth": "7"},
             "extra_info": {"max_turns": 2}}


def test_a_skyrl_gym_env_is_built_from_its_row_and_rewards_each_turn(tmp_path):
    """The env of each row, from a Parquet file in SkyRL's layout read as the job reads ``task.path``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from services.tasks.dataset import read_rows

    pq.write_table(pa.Table.from_pylist([SKYRL_ROW]), tmp_path / "train.parquet")
    columns = read_rows(str(tmp_path / "train.parquet"), "train", None, "task.path")
    (row,) = [dict(zip(columns, values, strict=True)) for values in zip(*columns.values(), strict=True)]
    env = skyrl_environment()
    assert check_reset_result(env.reset(row, seed=0), "skyrl") == SKYRL_ROW["prompt"]
    first = check_step_result(env.step("It is 6. #### 6"), "skyrl")
    assert first.reward == pytest.approx(0.1) and not first.done  # the format's share of 0.2 over 2 turns
    assert first.observation[0]["role"] == "user" and "####" in first.observation[0]["content"]
    assert env.step("#### 7")[:3] == (None, 1.0, True)
    with pytest.raises(ValueError, match="SkyRL-Gym has no environment 'gsm9k'; it has: aime, gsm8k"):
        skyrl_environment("gsm9k")
    with pytest.raises(ValueError, match="the row names no env_class"):
        skyrl_environment().reset({k: v for k, v in SKYRL_ROW.items() if k != "env_class"}, seed=0)


# ---------------------------------------------------------------- the page's commands as jobs

RECIPES = ROOT / "docs" / "recipes.md"
# what the tiny model's character tokenizer needs (a character a token): the prompts and turns are longer
SIZES = {
    "textarena-guess-the-number": ["--task.max_prompt_tokens", "640", "--rollout.max_turns", "2",
                                   "--rollout.max_trajectory_tokens", "320"],
    "reasoning-gym-chain-sum": ["--task.max_prompt_tokens", "400", "--rollout.max_trajectory_tokens", "8"],
    "gymnasium-cliffwalking": ["--task.max_prompt_tokens", "400", "--rollout.max_turns", "2",
                               "--rollout.max_trajectory_tokens", "200"],
    "gem-guess-the-number": ["--task.max_prompt_tokens", "640", "--rollout.max_turns", "2",
                             "--rollout.max_trajectory_tokens", "160"],
    "skyrl-gsm8k-multi-turn": ["--task.max_prompt_tokens", "200", "--rollout.max_trajectory_tokens", "200"],
    # "<system>Answer with the number only.<user>What is 4 + 4?<assistant>": 67 characters
    "verifiers-sums": ["--task.max_prompt_tokens", "96", "--rollout.max_trajectory_tokens", "8",
                       "--rollout.samples_per_prompt", "2"],
}
# each recipe's (least, greatest) return; turns (model calls) per episode at most
# (GEM's -0.1 as the float32 scores hold it)
RETURNS = {"textarena-guess-the-number": (0, 1), "reasoning-gym-chain-sum": (0, 1),
           "gymnasium-cliffwalking": (-200, 0), "verifiers-sums": (0, 1),
           "gem-guess-the-number": (-0.1 - 1e-6, 1), "skyrl-gsm8k-multi-turn": (0, 1.1)}
TURNS = {"textarena-guess-the-number": 2, "reasoning-gym-chain-sum": 1, "gymnasium-cliffwalking": 2,
         "verifiers-sums": 1, "gem-guess-the-number": 2, "skyrl-gsm8k-multi-turn": 2}
# the recipes whose game goes on after the random model's first turn (GEM's and gymnasium's end at a turn
# that is not a move)
GOES_ON = ("textarena-guess-the-number", "skyrl-gsm8k-multi-turn")
# the verifiers recipe's episodes are processes that import verifiers (about 3 s of CPU each): it trains on
# one group of 2 episodes, and its evaluations take the first of its evaluation rows, not 16
EPISODES = {"verifiers-sums": 2}
EVAL_ROWS = {"verifiers-sums": 1}


def recipe_commands() -> dict[str, list[str]]:
    commands = {Path(args[args.index("--config") + 1]).stem: args for args in learner_main_commands(RECIPES)}
    assert sorted(commands) == sorted(SIZES), "a recipe on the page without its test sizes, or the reverse"
    return commands


def fewer_eval_rows(recipe: str, args: list[str], directory: Path) -> list[str]:
    """``--task.eval_path`` to a file of the recipe's first ``EVAL_ROWS[recipe]`` evaluation rows, where it
    has a limit."""
    if recipe not in EVAL_ROWS:
        return []
    import yaml

    config = yaml.safe_load((ROOT / args[args.index("--config") + 1]).read_text())
    rows = (ROOT / config["task"]["eval_path"]).read_text().splitlines()[:EVAL_ROWS[recipe]]
    path = directory / f"{recipe}-eval.jsonl"
    path.write_text("\n".join(rows) + "\n")
    return ["--task.eval_path", str(path)]


@pytest.fixture(scope="module")
def printable_llama_dir(tmp_path_factory) -> str:
    """A random-init Llama over printable characters, with a chat template whose assistant turns end in the
    tokenizer's EOS, as SmolLM2's end in <|im_end|>."""
    from services.models import build_char_tokenizer
    from tests.conftest import save_tiny_llama

    tokenizer = build_char_tokenizer(list(string.printable))
    tokenizer.chat_template = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}"
                               "{% if m['role'] == 'assistant' %}<|endoftext|>{% endif %}{% endfor %}"
                               "{% if add_generation_prompt %}<assistant>{% endif %}")
    return save_tiny_llama(tokenizer, tmp_path_factory.mktemp("printable") / "llama", 1024)


@pytest.mark.integration
@pytest.mark.parametrize("recipe", sorted(SIZES))
def test_each_recipe_command_runs_an_iteration(recipe, shared_runs, printable_llama_dir,
                                               monkeypatch, tmp_path):
    """The page's command, as written, with the tiny model and a batch of 8 episodes (2 rows of 4; the
    verifiers recipe 2, one row of 2) for one iteration: the episodes run without an environment's (or an
    agent's) failure, and the returns are the game's. The verifiers recipe's episodes are verifiers' own, each
    a process of .venv-verifiers."""
    monkeypatch.chdir(ROOT)
    command, episodes = recipe_commands()[recipe], EPISODES.get(recipe, 8)
    run_dir, proc = shared_runs.get(
        f"recipe-{recipe}", *command, "--model.path", printable_llama_dir, *SIZES[recipe],
        *fewer_eval_rows(recipe, command, tmp_path),
        "--rollout.batch_size", str(episodes), "--rollout.chunk_size", str(episodes), "--ppo.minibatch_size",
        str(episodes),
        "--rollout.max_new_tokens", "8", "--run.iterations", "1", "--run.eval_every", "100")
    records, summary = read_run(run_dir, proc)
    (record,) = records
    assert record["iteration"] == 1 and record["environment_failures"] == 0
    assert record["episodes"] == episodes
    assert 1 <= record["turns_mean"] <= TURNS[recipe]
    assert math.isfinite(record["kl_response_mean"]) and math.isfinite(record["score_mean"])
    low, high = RETURNS[recipe]
    assert low <= record["score_mean"] <= high
    for evaluation in (summary["eval_start"], summary["eval_final"]):
        assert low <= evaluation["return"] <= high
    if recipe in GOES_ON:  # the evaluation's samples show the turns as the chat template marks them
        samples = (run_dir / "samples" / "iteration-0000.md").read_text()
        assert "<|endoftext|><user>" in samples, samples[:2000]  # a model turn's end, the environment's turn
    if recipe.startswith("verifiers"):  # an agent's episodes: one model call each, one row, nothing between
        assert record["rows_per_episode"] == 1 and record["trajectory_environment_tokens_mean"] == 0


QUESTIONS = [("What is 2 + 3?", "5"), ("What is 4 + 4?", "8"), ("What is 3 * 3?", "9"),
             ("What is 7 - 5?", "2")]


@pytest.mark.integration
@pytest.mark.parametrize("library", ["trl", "verl"])
def test_a_dataset_job_is_rewarded_by_the_librarys_own_function(library, shared_runs, printable_llama_dir,
                                                                 tmp_path):
    """A one-iteration dataset job over chat prompts whose task.reward_function is the library's own, named
    as its users name it: TRL's ``trl.rewards:accuracy_reward`` (the solution column, conversational
    completions) over a JSONL file, verl's ``default_compute_score`` over a parquet in verl's layout (the
    ground truth under reward_model). Each saved evaluation sample's score is the library's own call's on
    that sample's response."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    if library == "trl":
        from trl.rewards import accuracy_reward as function

        data = tmp_path / "math.jsonl"
        data.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": q}], "solution": a}) + "\n"
                                for q, a in QUESTIONS))
        reward = ["--task.reward_function", "trl.rewards:accuracy_reward", "--task.reward_fields",
                  '["solution"]']

        def score(response: str, answer: str) -> float:
            return function([[{"role": "assistant", "content": response}]], [answer])[0]
    else:
        from verl.utils.reward_score import default_compute_score as function

        data = tmp_path / "gsm8k.parquet"
        pq.write_table(pa.Table.from_pylist([
            {"prompt": [{"role": "user", "content": q}], "data_source": "openai/gsm8k",
             "reward_model": {"style": "rule", "ground_truth": a}, "extra_info": {"index": i}}
            for i, (q, a) in enumerate(QUESTIONS)]), data)
        reward = ["--task.reward_function", "verl.utils.reward_score:default_compute_score",
                  "--task.reward_fields", '["data_source", "reward_model.ground_truth", "extra_info"]']

        def score(response: str, answer: str) -> float:
            return function("openai/gsm8k", response, answer)
    run_dir, proc = shared_runs.get(
        f"reward-{library}", "--model.path", printable_llama_dir, "--task.name", "dataset", "--task.path",
        str(data), *reward, "--rollout.max_new_tokens", "8", "--rollout.batch_size", "8",
        "--rollout.chunk_size", "8", "--rollout.samples_per_prompt", "2", "--ppo.advantage", "grpo",
        "--ppo.minibatch_size", "8", "--run.iterations", "1", "--run.eval_every", "100",
        "--metrics.eval_samples_saved", "4", "--no-checkpoint.export_hf")
    read_run(run_dir, proc)
    samples = (run_dir / "samples" / "iteration-0001.md").read_text().split("\n## ")[1:]
    assert len(samples) == 4, samples
    for sample in samples:
        saved = float(re.match(r"\d+\. score (\S+)", sample).group(1))
        (answer,) = [a for q, a in QUESTIONS if q in sample]
        response = sample.split("Response:\n\n", 1)[1].strip()
        response = "" if response == "> (empty)" else "\n".join(line[2:] for line in response.splitlines())
        assert saved == pytest.approx(score(response, answer), abs=1e-3), sample


def test_a_verifiers_episode_is_scored_by_the_environments_own_reward():
    """The recipe's agent, outside a job: a process of .venv-verifiers plays a task of tether-sums against an
    OpenAI-compatible endpoint (here one that answers the sum, or the sum plus one), and the task's @vf.reward
    scores the reply. The request leaves the sampling to the job: only the model's name and the messages."""
    from deploy.recipes.verifiers.agent import agent

    requests = []

    class Endpoint(BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["content-length"])))
            requests.append((self.path, body))
            a, b = map(int, re.findall(r"\d+", body["messages"][-1]["content"]))
            answer = a + b + ("/wrong/" in self.path)
            reply = json.dumps({"id": "c", "object": "chat.completion", "created": 0, "model": body["model"],
                                "choices": [{"index": 0, "finish_reason": "stop", "logprobs": None,
                                             "message": {"role": "assistant",
                                                         "content": f"{a} + {b} = {answer}"}}],
                                "usage": {"prompt_tokens": 9, "completion_tokens": 5,
                                          "total_tokens": 14}}).encode()
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(reply)))
            self.end_headers()
            self.wfile.write(reply)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Endpoint)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_port}/episodes/{{}}/v1"

    async def both():
        return await asyncio.gather(agent(url.format("right"), {"taskset": "tether-sums", "idx": 3}),
                                    agent(url.format("wrong"), {"taskset": "tether-sums", "idx": 3}))

    try:
        assert asyncio.run(both()) == [1.0, 0.0]
    finally:
        server.shutdown()
    assert sorted(path for path, _ in requests) == ["/episodes/right/v1/chat/completions",
                                                    "/episodes/wrong/v1/chat/completions"]
    for _, body in requests:
        assert sorted(body) == ["messages", "model"] and body["model"] == "tether"
        assert body["messages"][0] == {"role": "system", "content": "Answer with the number only."}
        assert re.fullmatch(r"What is \d \+ \d\?", body["messages"][1]["content"])


def test_the_verifiers_recipe_without_its_virtualenv_says_to_make_it(tmp_path):
    """A clone without .venv-verifiers: importing the recipe's agent, which the job does before any actor
    starts, fails saying what to run."""
    clone = tmp_path / "clone" / "deploy" / "recipes" / "verifiers"
    clone.mkdir(parents=True)
    shutil.copy(ROOT / "deploy" / "recipes" / "verifiers" / "agent.py", clone)
    spec = importlib.util.spec_from_file_location("clone_verifiers_agent", clone / "agent.py")
    with pytest.raises(FileNotFoundError, match=r"\.venv-verifiers/bin/python, which is not there .*run "
                                                r"`make verifiers` in .*clone"):
        spec.loader.exec_module(importlib.util.module_from_spec(spec))
