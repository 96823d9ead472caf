"""Bad data gets a clear error naming what and where; nothing is overwritten."""

from __future__ import annotations

import re

import pytest
import torch

from actors.specs import RewardSpec
from tests.conftest import run_cli, run_job


def _reward_actor(task_name, tokenizer_dir):
    from actors.reward import RewardActor

    return RewardActor(0, RewardSpec(task_name, {}, tokenizer_dir))  # a plain object here: no Ray needed


def _chunk():
    from services.experience import make_batch

    prompts = [[i % 20 + 1] for i in range(6)]
    responses = [[3, 0, 22], [5, 22], [], [1, 2, 3], [0, 22], [7]]
    return make_batch(prompts, responses, [[0.0] * len(r) for r in responses], [0] * 6,
                      list(range(6)), 22, 0, 0.0, 9)


@pytest.mark.parametrize("task, message", [
    ("tests.faulty_tasks:RaisingReward",
     r"task 'raising-reward', chunk 5 raised RuntimeError: the reward backend is down"),
    ("tests.faulty_tasks:NaNReward", r"task 'nan-reward', chunk 5 returned nan for sample 3"),
    ("tests.faulty_tasks:ShortReward", r"task 'short-reward', chunk 5 returned 5 scores for 6 samples"),
])
def test_reward_function_errors_name_task_chunk_and_sample(tiny_model_dir, task, message):
    from actors.reward import RewardError

    with pytest.raises(RewardError, match=message):
        _reward_actor(task, tiny_model_dir).score(_chunk(), chunk_index=5)


def test_good_reward_scores_every_sample_including_empty_responses(tiny_model_dir):
    scores = _reward_actor("randomwalks", tiny_model_dir).score(_chunk(), chunk_index=0)
    assert scores.shape == (6,) and torch.isfinite(scores).all()


def test_prompts_longer_than_the_context(tiny_model_dir):
    from services.models import load_tokenizer
    from services.prompts import encode_prompts

    tokenizer = load_tokenizer(tiny_model_dir)
    texts = ["b" * 40, "c", "d" * 30]
    with pytest.raises(ValueError, match=r"2 prompt\(s\) are longer than task.max_prompt_tokens=16; first is "
                                         r"prompt 0 with 40 tokens, the longest has 40. Raise "
                                         r"task.max_prompt_tokens to 40 .* task.long_prompts=truncate"):
        encode_prompts(texts, tokenizer, 16, "reject", log=lambda _: None)
    notes = []
    encoded = encode_prompts(texts, tokenizer, 16, "truncate", log=notes.append)
    assert [len(e) for e in encoded] == [16, 1, 16] and "truncated 2 prompt(s)" in notes[0]
    with pytest.raises(ValueError, match="empty prompt set"):
        encode_prompts([], tokenizer, 16, "reject")


@pytest.mark.parametrize("task, message", [
    ("tests.faulty_tasks:NoPrompts", "the task has an empty prompt set"),
    ("tests.faulty_tasks:LongPrompts", "2 prompt(s) are longer than task.max_prompt_tokens=16"),
    ("tests.faulty_tasks:Missing",
     "task.name='tests.faulty_tasks:Missing': module 'tests.faulty_tasks' has no attribute 'Missing'"),
])
def test_bad_task_data_fails_before_any_actor(cache_dir, tmp_path, task, message):
    proc = run_cli(["--run.output_dir", str(tmp_path), "--model.cache_dir", cache_dir, "--run.seed", "1",
                    "--model.sft_steps", "60", "--model.sft_batch_size", "50", "--task.name", task,
                    "--cluster.address", "127.0.0.1:1"])
    assert proc.returncode != 0
    assert message in proc.stderr
    assert "actors ready" not in proc.stdout
    assert "SFT warm start" not in proc.stdout  # the prompts fail before a warm start trains for them
    assert not any(tmp_path.iterdir())  # no run directory was created


def test_a_model_directory_without_a_tokenizer_is_named_before_any_actor(tiny_model_dir, tmp_path):
    """A model saved without its tokenizer: the job names the directory and the missing files, not a symptom
    downstream (it read "the model's tokenizer has no chat template" for a chat dataset)."""
    import shutil

    from services.models import TOKENIZER_FILES

    bare = tmp_path / "bare"
    shutil.copytree(tiny_model_dir, bare, ignore=shutil.ignore_patterns(*TOKENIZER_FILES))
    proc = run_cli(["--model.path", str(bare), "--run.output_dir", str(tmp_path / "runs"),
                    "--cluster.address", "127.0.0.1:1"])
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert f"{bare} holds no tokenizer (none of tokenizer.json, tokenizer_config.json" in proc.stderr, \
        proc.stderr


@pytest.mark.parametrize("args, message", [
    (["--ppo.policy_loss", "ppo2"],
     "ppo.policy_loss='ppo2' is not a registered policy loss; registered: ppo, gspo, gspo_token, cispo"),
    (["--ppo.correction", "icepop", "--ppo.is_cap", "3"],
     "[correction_reads] ppo.is_cap=3.0 is set but ppo.correction='icepop' ignores it"),
])
def test_a_registered_entry_the_config_cannot_run_is_named_before_any_actor(tiny_model_dir, tmp_path, args,
                                                                             message):
    """The config holds an entry's name as a string; the check of the entries it chooses runs with the plan,
    before any actor (here before reaching the cluster, which does not exist)."""
    proc = run_cli(["--model.path", tiny_model_dir, "--run.output_dir", str(tmp_path / "runs"),
                    "--cluster.address", "127.0.0.1:1", *args])
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert f"[tether] error: {message}" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "runs").exists()


@pytest.mark.integration
def test_bad_task_data_with_a_local_ray_fails_before_any_actor_and_stops_that_ray(cache_dir, tmp_path):
    """With no cluster.address the driver starts its Ray while the plan checks the input: the plan's error is
    the job's, no actor starts, and every process of that Ray is gone when the job exits."""
    import os
    import shutil
    import tempfile

    import psutil

    ray_tmp = tempfile.mkdtemp(prefix="rt", dir="/tmp")  # short: Ray's socket paths are under it
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"} | {"RAY_TMPDIR": ray_tmp}
    try:
        proc = run_job(["--run.output_dir", str(tmp_path / "runs"), "--model.cache_dir", cache_dir,
                        "--run.seed", "1", "--model.sft_steps", "60", "--model.sft_batch_size", "50",
                        "--task.name", "tests.faulty_tasks:NoPrompts"], timeout_s=300, env=env)
        assert proc.returncode == 1, proc.stderr[-3000:]
        assert "[tether] error: the task has an empty prompt set" in proc.stderr, proc.stderr[-3000:]
        assert "Traceback" not in proc.stderr
        assert "ray: started a local Ray" in proc.stdout  # beside the plan
        assert "actors ready" not in proc.stdout and not (tmp_path / "runs").exists()
        left = [p.info["pid"] for p in psutil.process_iter(["pid", "cmdline"])
                if ray_tmp in " ".join(p.info["cmdline"] or [])]
        assert left == [], f"processes of the job's Ray still running: {left}"
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)


@pytest.mark.integration
def test_a_raising_reward_fails_the_job_with_its_location(ray_head, cache_dir, tiny_model_dir, tmp_path):
    # the tests' randomwalks policy (the faulty task's prompts and vocabulary are randomwalks')
    proc = run_job(["--cluster.address", ray_head.address, "--run.output_dir", str(tmp_path),
                    "--model.cache_dir", cache_dir, "--run.seed", "1", "--model.path", tiny_model_dir,
                    "--task.name", "tests.faulty_tasks:RaisingReward", "--rollout.batch_size", "32",
                    "--rollout.chunk_size", "16", "--ppo.minibatch_size", "16"], timeout_s=600)
    assert proc.returncode == 1
    # the first call of the reward function is the evaluation before training (it scores the saved samples),
    # said as tether's one line with the actor's method, Ray's traceback left out
    first = next(line for line in proc.stderr.splitlines() if line.startswith("[tether] error:"))
    assert re.search(r"^\[tether\] error: \w+\.\w+: [^\n]*task 'raising-reward', evaluation chunk \d+ raised "
                     r"RuntimeError: the reward backend is down$", first), proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "--metrics.log_level debug" in proc.stderr, proc.stderr[-3000:]


def test_an_error_raised_inside_an_actor_is_one_line_with_the_actors_method():
    """Ray's report of an error raised in an actor is its traceback, colour codes and all, with the line
    that says what is wrong at the bottom; tether's line is the actor's method and that error (through an
    actor that called another), and the report stays whole for --metrics.log_level debug."""
    import ray

    from services.errors import actor_error

    def raised(where: str, cause: BaseException) -> BaseException:
        return ray.exceptions.RayTaskError(where, "Traceback (most recent call last):\n  File x", cause,
                                           proctitle=f"ray::{where}").as_instanceof_cause()

    tether = raised("RewardActor.score", ValueError("task 'x', chunk 5 raised RuntimeError: down"))
    line, report = actor_error(tether)
    assert line == "RewardActor.score: task 'x', chunk 5 raised RuntimeError: down"
    assert report.startswith("ray::RewardActor.score()") and "\x1b[" not in report
    nested = raised("LearnerRank.collect", raised("RewardActor.score", KeyError("answer")))
    assert actor_error(nested)[0] == "LearnerRank.collect: KeyError: 'answer'"
    assert actor_error(ValueError("not from an actor")) is None
