"""Unit tests of services/environments: the interface and its checks, observation encoding (text, ids, chat
messages), the gymnasium adapter, interactive randomwalks and the calculator. No Ray, no vLLM."""

from __future__ import annotations

import asyncio
import pickle
import string
import threading
import time

import gymnasium
import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from services.environments import (
    Environment,
    EnvironmentFailure,
    InteractiveRandomWalks,
    StepResult,
    calculator,
    call_maybe_async,
    check_reset_result,
    check_step_result,
    encode_observation,
    interactive_randomwalks,
    load_environment_factory,
    make_environment,
)
from services.environments.calculator import MAX_CALLS, CalculatorEnvironment, evaluate, problem
from services.environments.gym import GymnasiumEnvironment, gymnasium_environment
from services.models import EOS, build_char_tokenizer
from services.tasks.randomwalks import LETTERS, MAX_LENGTH, RandomWalksTask

ENV = "tests.test_environments:SyncCounter"
NOT_CALLABLE = 3  # load_environment_factory refuses it


class SyncCounter(Environment):
    """Ends on its second step; records the thread each call ran on."""

    def reset(self, row, seed):
        self.steps, self.threads = 0, [threading.get_ident()]
        return f"start {row['x']} {seed}"

    def step(self, action):
        self.steps += 1
        self.threads.append(threading.get_ident())
        return f"got {action}", 0.5, self.steps >= 2, {"tool_calls": 1}


class AsyncCounter:
    """The same, async and duck-typed (no Environment base class)."""

    async def reset(self, row, seed):
        self.steps = 0
        return [1, 2, 3]

    async def step(self, action):
        self.steps += 1
        await asyncio.sleep(0)
        return StepResult(None if self.steps >= 2 else [4], 1.0, self.steps >= 2, {})


class Hangs(Environment):
    async def reset(self, row, seed):
        await asyncio.sleep(30)


# ---------------------------------------------------------------- the interface


def test_sync_and_async_environments_run_through_call_maybe_async():
    async def episode(env):
        observations = [await call_maybe_async(env.reset, {"x": 1}, 7)]
        done = False
        while not done:
            result = check_step_result(await call_maybe_async(env.step, "go"), "test-env")
            observations.append(result.observation)
            done = result.done
        return observations

    sync_env = SyncCounter()
    assert asyncio.run(episode(sync_env)) == ["start 1 7", "got go", "got go"]
    # a blocking environment runs in a worker thread, never on the event loop's thread
    assert threading.get_ident() not in sync_env.threads
    assert asyncio.run(episode(AsyncCounter())) == [[1, 2, 3], [4], None]


def test_a_deadline_stops_a_hung_environment():
    async def reset_with_deadline():
        return await asyncio.wait_for(call_maybe_async(Hangs().reset, {}, 0), timeout=0.05)

    start = time.perf_counter()
    with pytest.raises(TimeoutError):
        asyncio.run(reset_with_deadline())
    assert time.perf_counter() - start < 5


def test_check_step_result_accepts_every_observation_kind():
    assert check_step_result(("text", 1, False, {}), ENV) == StepResult("text", 1.0, False, {})
    result = check_step_result([[np.int64(3), 4], np.float32(0.5), np.bool_(True), {"tool_calls": 2}], ENV)
    assert result == StepResult([3, 4], 0.5, True, {"tool_calls": 2})
    assert type(result.done) is bool and type(result.reward) is float and type(result.observation[0]) is int
    messages = [{"role": "user", "content": "<result>3</result>"}]
    assert check_step_result((messages, 0.0, False, {}), ENV).observation == messages
    assert check_step_result(StepResult(None, -1.0, True), ENV) == StepResult(None, -1.0, True, {})
    assert check_step_result(("", 0.0, True, {}), ENV).observation == ""


@pytest.mark.parametrize(
    ("result", "what"),
    [
        ("text", "a str, expected"),
        (("text", 0.0, False), "a 3-tuple"),
        (("text", 0.0, False, {}, 1), "a 5-tuple"),
        (("text", "1", False, {}), "reward '1'"),
        (("text", float("nan"), False, {}), "reward nan"),
        (("text", float("inf"), False, {}), "reward inf"),
        (("text", True, 0.0, {}), "reward True"),
        (("text", None, False, {}), "reward None"),
        (("text", 0.0, 1, {}), "done 1"),
        (("text", 0.0, "yes", {}), "done 'yes'"),
        (("text", 0.0, False, None), "info of type NoneType"),
        (("text", 0.0, False, [("tool_calls", 1)]), "info of type list"),
        ((3, 0.0, False, {}), "observation of type int"),
        (({"role": "user", "content": "x"}, 0.0, False, {}), "observation of type dict"),
        (([{"role": "user"}], 0.0, False, {}), "observation\\[0\\] has no str 'content'"),
        (([{"role": "user", "content": 3}], 0.0, False, {}), "has no str 'content'"),
        (([{"content": "x"}], 0.0, False, {}), "has no str 'role'"),
        (([1, "a"], 0.0, False, {}), "observation\\[0\\] of type int"),
        (([True], 0.0, False, {}), "observation\\[0\\] of type bool"),
        ((None, 0.0, False, {}), "observation None with done False"),
    ],
)
def test_check_step_result_names_the_environment_and_what_is_malformed(result, what):
    with pytest.raises(EnvironmentFailure, match=what) as caught:
        check_step_result(result, ENV, row=3, turn=2)
    assert str(caught.value).startswith(f"environment {ENV!r} failed at row 3, turn 2: step returned ")


def test_check_reset_result():
    assert check_reset_result([np.int32(5)], ENV) == [5]
    for bad in (None, "", [], 3):
        with pytest.raises(EnvironmentFailure, match=r"failed at row 1, turn 0: reset returned"):
            check_reset_result(bad, ENV, row=1)


def test_environment_failure_names_everything_and_survives_pickling():
    failure = EnvironmentFailure("pkg.mod:factory", "step raised ValueError: boom", row=3, turn=2)
    assert str(failure) == ("environment 'pkg.mod:factory' failed at row 3, turn 2: "
                            "step raised ValueError: boom")
    assert (failure.environment, failure.row, failure.turn, failure.reason) == (
        "pkg.mod:factory", 3, 2, "step raised ValueError: boom")
    assert isinstance(failure, RuntimeError)
    copy = pickle.loads(pickle.dumps(failure))  # it crosses Ray
    assert (str(copy), copy.row, copy.turn) == (str(failure), 3, 2)
    assert str(EnvironmentFailure("e", "worker died")) == "environment 'e' failed: worker died"
    assert str(EnvironmentFailure("e", "hung", row=0)) == "environment 'e' failed at row 0: hung"


def test_load_environment_factory_and_make_environment():
    factory = load_environment_factory("services.environments.randomwalks:interactive_randomwalks")
    assert factory is interactive_randomwalks
    env = make_environment(factory, {"seed": 1000}, "rw")
    assert isinstance(env, InteractiveRandomWalks)
    duck = make_environment(load_environment_factory("tests.test_environments:AsyncCounter"), {}, "duck")
    assert isinstance(duck, AsyncCounter)


@pytest.mark.parametrize(
    ("spec", "what"),
    [
        ("services.environments.randomwalks", "must be given as 'package.module:factory'"),
        (":interactive_randomwalks", "must be given as"),
        ("no_such_package.envs:factory",
         "module 'no_such_package.envs' cannot be imported: ModuleNotFoundError: No module named"),
        ("services.environments.randomwalks:no_such_factory", "has no attribute 'no_such_factory'"),
        ("tests.test_environments:NOT_CALLABLE", "is of type int, not a class or function"),
    ],
)
def test_load_environment_factory_errors_name_the_spec(spec, what):
    with pytest.raises(ValueError, match=what) as caught:
        load_environment_factory(spec)
    assert repr(spec) in str(caught.value)


def test_make_environment_errors_name_the_spec():
    with pytest.raises(ValueError, match=r"'my:env' returned a str without callable reset and step"):
        make_environment(lambda: "not an env", {}, "my:env")
    with pytest.raises(ValueError, match=r"'my:env' returned a Thing without callable step"):
        make_environment(type("Thing", (), {"reset": lambda self, row, seed: "x"}), {}, "my:env")
    with pytest.raises(ValueError, match=r"'my:env' with kwargs \{'colour': 1\} raised TypeError"):
        make_environment(interactive_randomwalks, {"colour": 1}, "my:env")


class GemLike:
    """GEM's shape: ``reset(seed=None)`` (no row) and ``step(action)``, returning its own tuples."""

    def reset(self, seed=None):
        return "observation", {}

    def step(self, action):
        return "observation", 0.0, True, False, {}


def test_an_environment_whose_reset_or_step_the_workers_cannot_call_is_named_at_once():
    """Checked where the driver builds its example environment (the plan, before any actor): GEM's
    reset(seed) would fail on the workers after every actor started, as one buried line of a Ray
    traceback."""
    with pytest.raises(ValueError, match=r"environment 'gem:env': GemLike.reset\(seed=None\) cannot be "
                                         r"called as reset\(row, seed\), as the environment workers call it"):
        make_environment(GemLike, {}, "gem:env")
    stepless = type("NoAction", (), {"reset": lambda self, row, seed: "x", "step": lambda self: None})
    with pytest.raises(ValueError, match=r"NoAction.step\(\) cannot be called as step\(action\)"):
        make_environment(stepless, {}, "my:env")
    # keyword defaults and *args are fine, as are async methods
    flexible = type("Flexible", (), {"reset": lambda self, *args, **kwargs: "x",
                                     "step": lambda self, action, extra=None: ("x", 0.0, True, {})})
    assert isinstance(make_environment(flexible, {}, "my:env"), flexible)


# ---------------------------------------------------------------- observation encoding

CHATML = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful AI assistant<|im_end|>\\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def chatml_tokenizer(chat_template: str | None = CHATML) -> PreTrainedTokenizerFast:
    """Byte-level, one token per byte, with ChatML's turn markers as special tokens; built here."""
    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|im_end|>", pad_token="<|im_end|>")
    tokenizer.chat_template = chat_template
    return tokenizer


def test_encode_text_and_token_ids():
    tokenizer = build_char_tokenizer(InteractiveRandomWalks().vocabulary)
    assert encode_observation("b:dju>", tokenizer, first=True) == [LETTERS.index(c) if c in LETTERS else
                                                                   tokenizer.convert_tokens_to_ids(c)
                                                                   for c in "b:dju>"]
    last = len(tokenizer) - 1
    assert encode_observation([3, 0, last], tokenizer, first=False) == [3, 0, last]
    assert encode_observation(None, tokenizer, first=False) == []
    assert encode_observation("", tokenizer, first=False) == []
    for bad in ([len(tokenizer)], [-1]):
        with pytest.raises(ValueError, match="outside the vocabulary"):
            encode_observation(bad, tokenizer, first=False)
    for empty in ("", []):
        with pytest.raises(ValueError, match="first observation"):
            encode_observation(empty, tokenizer, first=True)
    with pytest.raises(ValueError, match="no chat template"):
        encode_observation([{"role": "user", "content": "hi"}], tokenizer, first=True)
    with pytest.raises(ValueError, match="observation of type int"):
        encode_observation(3, tokenizer, first=True)


def rendered(tokenizer, messages, add_generation_prompt=True) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True)
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)


@pytest.mark.parametrize("system", [True, False])
def test_encode_chat_messages_later_turns_match_the_whole_conversation(system):
    """Prompt, then the model's turns as sampled (ending with <|im_end|>) and the observations' tokens: token
    for token the chat template's rendering of the whole conversation."""
    tokenizer = chatml_tokenizer()
    env = CalculatorEnvironment()
    prompt = env.reset({"index": 0}, seed=0)
    if not system:
        prompt = prompt[1:]  # the template adds its default system prompt
    conversation = list(prompt)
    ids = encode_observation(prompt, tokenizer, first=True)
    assert ids == rendered(tokenizer, prompt)
    for turn in ("<calc>2 + 3 * 4</calc>", "<calc>(1 +</calc>"):
        sampled = tokenizer(turn, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        observation, _, done, _ = env.step(turn)
        assert not done
        ids += sampled + encode_observation(observation, tokenizer, first=False)
        conversation += [{"role": "assistant", "content": turn}, *observation]
        assert ids == rendered(tokenizer, conversation)
    assert tokenizer.decode(ids).endswith("<|im_start|>user\n<error>cannot parse '(1 +'</error><|im_end|>\n"
                                          "<|im_start|>assistant\n")


def test_encode_chat_messages_after_the_model_turn_start_after_its_end_token():
    tokenizer = chatml_tokenizer()
    ids = encode_observation([{"role": "user", "content": "<result>14</result>"}], tokenizer, first=False)
    assert tokenizer.decode(ids) == ("\n<|im_start|>user\n<result>14</result><|im_end|>\n"
                                     "<|im_start|>assistant\n")


def test_a_turn_cut_at_its_token_cap_is_closed_by_the_observation():
    """A model turn that stopped at rollout.max_new_tokens has no <|im_end|>: the observation brings it, so
    the conversation is still the template's, token for token."""
    tokenizer = chatml_tokenizer()
    closed = encode_observation([{"role": "user", "content": "<result>14</result>"}], tokenizer, first=False)
    cut = encode_observation([{"role": "user", "content": "<result>14</result>"}], tokenizer, first=False,
                             turn_closed=False)
    assert cut == [tokenizer.eos_token_id, *closed]


def test_the_calculator_few_shot_conversation_shows_worked_problems_as_chat_turns():
    env = CalculatorEnvironment(examples=2)
    messages = env.reset({"index": 3}, seed=0)
    roles = [m["role"] for m in messages]
    assert roles == ["system", "user", "assistant", "user", "assistant"] * 1 + ["user", "assistant", "user",
                                                                                  "assistant", "user"]
    assert messages[-1]["content"] == \
        CalculatorEnvironment(examples=0).reset({"index": 3}, seed=0)[-1]["content"]
    assert messages[2]["content"].startswith("<calc>") and messages[4]["content"].startswith("<answer>")


# ---------------------------------------------------------------- gymnasium

GUESS_ID = "tether-test/Guess-v0"


class GuessingGame(gymnasium.Env):
    """Guess the secret number from 1 to 10; told higher or lower."""

    def __init__(self):
        self.observation_space = gymnasium.spaces.Text(64, charset=string.ascii_lowercase + " 0123456789")
        self.action_space = gymnasium.spaces.Text(max_length=4, charset=string.digits)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.secret = (options or {}).get("secret") or int(self.np_random.integers(1, 11))
        return "guess a number from 1 to 10", {}

    def step(self, action):
        guess = int(action) if action.strip().isdigit() else 0
        if guess == self.secret:
            return "correct", 1.0, True, False, {"guesses": 1}
        return ("higher" if guess < self.secret else "lower"), np.float64(-0.1), False, False, {}


class CountingGame(GuessingGame):
    def __init__(self):
        super().__init__()
        self.observation_space = gymnasium.spaces.Discrete(3)


if GUESS_ID not in gymnasium.registry:
    gymnasium.register(id=GUESS_ID, entry_point=GuessingGame, max_episode_steps=3)


def test_gymnasium_text_env_through_the_adapter():
    spec = "services.environments.gym:gymnasium_environment"
    env = make_environment(load_environment_factory(spec), {"id": GUESS_ID}, spec)
    assert isinstance(env, GymnasiumEnvironment)
    assert env.reset({"secret": 7}, seed=0) == "guess a number from 1 to 10"
    assert check_step_result(env.step("3"), spec) == StepResult("higher", -0.1, False, {})
    assert check_step_result(env.step(" 7"), spec) == StepResult("correct", 1.0, True, {"guesses": 1})
    # the registered step limit truncates: done as well
    env.reset({"secret": 7}, seed=0)
    assert [env.step("9")[2] for _ in range(3)] == [False, False, True]
    env.close()


def test_a_gymnasium_env_from_a_factory_is_wrapped_and_a_non_text_space_refused():
    env = make_environment(GuessingGame, {}, "tests:GuessingGame")
    assert isinstance(env, GymnasiumEnvironment)
    env.reset({"secret": 2}, seed=1)
    assert env.step("2")[1:3] == (1.0, True)
    with pytest.raises(ValueError, match=r"observation space Discrete\(3\).*gymnasium.spaces.Text"):
        GymnasiumEnvironment(CountingGame())
    with pytest.raises(ValueError, match="Discrete"):
        make_environment(CountingGame, {}, "tests:CountingGame")
    assert isinstance(gymnasium_environment(GUESS_ID), GymnasiumEnvironment)


# ---------------------------------------------------------------- interactive randomwalks


def test_randomwalks_legal_and_illegal_moves():
    env = interactive_randomwalks()
    assert env.reset({"start": "b"}, seed=0) == "b:dju>"
    assert env.step("j") == ("j:n>", 0.0, False, {})
    assert env.step("n\n") == ("n:ab>", 0.0, False, {})
    observation, reward, done, _ = env.step("a")
    assert (observation, done) == (None, True)
    assert 0 < reward < 1  # 'a' reached in 4 nodes, a shortest path has 3
    for illegal in ("c", "z", "dj", "", ":", "<|endoftext|>"):
        env.reset({"start": "b"}, seed=0)
        observation, reward, done, info = env.step(illegal)
        assert (observation, reward, done) == (None, 0.0, True) and "illegal_move" in info
    with pytest.raises(RuntimeError, match="after the episode ended"):
        env.step("d")
    for bad_row in ({"start": "a"}, {"start": "bb"}, {}, {"start": "z"}):
        with pytest.raises(ValueError, match="'start' must be a letter 'b'..'u'"):
            env.reset(bad_row, seed=0)


def test_randomwalks_shortest_path_scores_one_and_the_cap_scores_zero():
    env = InteractiveRandomWalks()
    env.reset({"start": "b"}, seed=0)
    assert env.step("d")[:3] == ("d:alt>", 0.0, False)
    assert env.step("a")[:3] == (None, 1.0, True)
    # b -> j -> n -> b ... never reaches 'a': the episode ends with the walk at MAX_LENGTH nodes
    env.reset({"start": "b"}, seed=0)
    moves = ("jnb" * 3)[: MAX_LENGTH - 1]
    results = [env.step(move) for move in moves]
    assert [done for _, _, done, _ in results] == [False] * (MAX_LENGTH - 2) + [True]
    assert results[-1][:2] == (None, 0.0)


def test_randomwalks_rows_are_the_tasks_prompts():
    env = InteractiveRandomWalks()
    assert env.rows() == [{"start": p} for p in RandomWalksTask().prompts()]
    assert env.eval_rows() == env.rows()
    recipe = (env.tokenizer_kind, env.model_kind, env.max_new_tokens, env.metric)
    assert recipe == ("chars", "gpt2", 2, "optimality")
    assert {**env.model_config, "n_positions": 32} == RandomWalksTask().model_config


def test_randomwalks_sft_transcripts_are_episodes_token_for_token():
    """Each SFT text, tokenised as the warm start does (text, then EOS), is the token sequence of the episode
    that makes the same moves: observation, move, EOS, next observation, ..., the last move, EOS."""
    env = InteractiveRandomWalks()
    tokenizer = build_char_tokenizer(env.vocabulary)
    eos = tokenizer.eos_token_id
    colon = tokenizer.convert_tokens_to_ids(":")
    assert tokenizer(f"b{EOS}:")["input_ids"] == [LETTERS.index("b"), eos, colon]  # EOS inside a text: one id
    corpus = env.sft_corpus()
    assert len(corpus) == len(env.graph.walks) == 1000
    n_positions = env.model_config["n_positions"]
    for text, walk in zip(corpus, env.graph.walks, strict=True):
        ids = encode_observation(env.reset({"start": walk[0]}, seed=0), tokenizer, first=True)
        for i, move in enumerate(walk[1:], start=1):
            observation, _, done, _ = env.step(move)
            ids += [tokenizer.convert_tokens_to_ids(move), eos]
            assert done == (i == len(walk) - 1)
            if not done:
                ids += encode_observation(observation, tokenizer, first=False)
        assert tokenizer(text)["input_ids"] + [eos] == ids
        assert len(ids) <= n_positions


def test_randomwalks_n_positions_covers_the_longest_trajectory():
    env = InteractiveRandomWalks()
    observation_length = {node: len(env.observation(node)) for node in LETTERS}

    def longest(node: str, moves_left: int) -> int:
        """Most tokens from ``node``'s observation on: each turn 2 sampled tokens (a move and EOS; anything
        else is illegal and ends the episode), then the next observation unless the episode ended."""
        if moves_left == 0 or node == "a":
            return 0
        here = observation_length[node] + env.max_new_tokens
        neighbours = np.flatnonzero(env.graph.adjacency[LETTERS.index(node)])
        return here + max(longest(LETTERS[j], moves_left - 1) for j in neighbours)

    worst = max(longest(row["start"], MAX_LENGTH - 1) for row in env.rows())
    assert 128 <= env.model_config["n_positions"] and worst <= env.model_config["n_positions"]
    assert worst > 32  # the one-shot task's n_positions would not do


# ---------------------------------------------------------------- calculator


def test_calculator_correct_call_and_answer_scores_one():
    env = calculator(seed=0)
    question, answer = problem(0, 5, 20)
    messages = env.reset({"index": 5}, seed=123)
    assert [m["role"] for m in messages] == ["system", "user"] and messages[1]["content"] == question
    assert all(tag in messages[0]["content"] for tag in ("<calc>", "</calc>", "<result>", "<answer>"))
    assert env.reset({"index": 5}, seed=0) == messages  # a row is always the same problem
    assert env.step("Let me compute. <calc>3 + 4 * 2</calc>") == (
        [{"role": "user", "content": "<result>11</result>"}], 0.0, False, {"tool_calls": 1})
    assert env.step("<calc>7 / 2</calc>")[0] == [{"role": "user", "content": "<result>3.5</result>"}]
    assert env.step(f"The answer is <answer> {answer} </answer>")[:3] == (None, 1.0, True)
    with pytest.raises(RuntimeError):
        env.step("<answer>1</answer>")


def test_calculator_wrong_answer_no_answer_and_too_many_calls_score_zero():
    env = CalculatorEnvironment(seed=1)
    env.reset({"question": "What is 2 + 2?", "answer": 4}, seed=0)
    assert env.step("<answer>5</answer>")[:3] == (None, 0.0, True)
    env.reset({"question": "What is 2 + 2?", "answer": "4"}, seed=0)
    assert env.step("<answer>4.0</answer>")[:3] == (None, 1.0, True)
    env.reset({"index": 0}, seed=0)
    assert env.step("I think it is four.")[:3] == (None, 0.0, True)
    env.reset({"index": 0}, seed=0)
    results = [env.step("<calc>1 + 1</calc>") for _ in range(MAX_CALLS + 1)]
    assert [r[2] for r in results] == [False] * MAX_CALLS + [True] and results[-1][1] == 0.0
    with pytest.raises(ValueError, match="calculator row"):
        env.reset({"question": "q", "answer": "four"}, seed=0)


@pytest.mark.parametrize(
    ("turn", "error"),
    [
        ("<calc>2 +</calc>", "cannot parse"),
        ("<calc>1 / (2 - 2)</calc>", "division by zero"),
        ("<calc>3 + 4", "unbalanced tags"),
        ("3 + 4</calc>", "unbalanced tags"),
        ("<calc>__import__('os').system('echo hi')</calc>", "is not allowed"),
        ("<calc>2 ** 100</calc>", "is not allowed"),
        ("<calc>" + "9" * 300 + "</calc>", "longer than"),
    ],
)
def test_calculator_malformed_call_is_an_error_observation(turn, error):
    env = calculator()
    env.reset({"index": 1}, seed=0)
    result = check_step_result(env.step(turn), "calculator")
    assert (result.reward, result.done, result.info) == (0.0, False, {"tool_calls": 1})
    [message] = result.observation
    assert message["role"] == "user" and message["content"].startswith("<error>")
    assert error in message["content"]


def test_calculator_expression_evaluator():
    assert evaluate("(3 + 4) * 2 / 7") == 2
    assert evaluate("-3 + +2") == -1
    assert evaluate("0.1 + 0.2") == evaluate("3 / 10")  # exact: the literals' text, not floats
    for refused in ("__import__('os')", "x + 1", "abs(-2)", "[1]", "'a' * 3", "2 ** 3", "1 if 1 else 2",
                    "True + 1"):
        with pytest.raises(ValueError):
            evaluate(refused)
    with pytest.raises(ZeroDivisionError):
        evaluate("1 / 0")


def test_calculator_rows_are_integer_problems():
    env = calculator(seed=3, max_operand=12)
    assert len(env.rows()) == 256 and len(env.eval_rows()) == 64
    assert not {r["index"] for r in env.rows()} & {r["index"] for r in env.eval_rows()}
    for row in env.rows(64) + env.eval_rows():
        question, answer = problem(3, row["index"], 12)
        assert isinstance(answer, int) and answer >= 0 and question
    assert (env.metric, env.max_new_tokens) == ("accuracy", 48)


def test_the_readme_environment_is_the_one_the_tests_run():
    """The README's complete environment, as a user copies it, is tests/readme_environment.py, which
    tests/test_agents.py runs as a job."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    readme = (root / "README.md").read_text()
    code = (root / "tests" / "readme_environment.py").read_text()
    assert f"```python\n# my_env.py\n{code}```" in readme
