"""task.name: dataset: your own prompts from a file the test writes (JSONL, CSV, Parquet, a saved Hugging Face
dataset directory), a reward function with the row's fields, and the errors for bad input."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
import torch

from actors.specs import RewardSpec
from tests.conftest import run_cli, run_job

REWARD = "tests.dataset_rewards:letter_distance"
ROWS = [{"prompt": p, "answer": a, "note": f"row {i}"} for i, (p, a) in enumerate(zip("bcdefgh", "cdefghi"))]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def dataset_task(path, **options):
    from services.tasks import get_task

    options = {"reward_function": REWARD, "reward_fields": ["answer"], **options}
    return get_task("dataset", path=str(path), **options)


def dataset_config(path, **task):
    from services.config import load_config

    return load_config(None, {"model": {"path": "/models/policy"},
                              "task": {"name": "dataset", "path": str(path), "reward_function": REWARD,
                                       "reward_fields": ["answer"], **task}})


# ---------------------------------------------------------------------- formats


def _write(kind: str, tmp_path: Path) -> Path:
    import datasets

    if kind == "jsonl":
        return write_jsonl(tmp_path / "prompts.jsonl", ROWS)
    if kind == "csv":
        path = tmp_path / "prompts.csv"
        path.write_text("prompt,answer,note\n" + "".join(f"{r['prompt']},{r['answer']},{r['note']}\n"
                                                         for r in ROWS))
        return path
    if kind == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        path = tmp_path / "prompts.parquet"
        pq.write_table(pa.Table.from_pylist(ROWS), path)
        return path
    path = tmp_path / "saved"
    datasets.Dataset.from_list(ROWS).save_to_disk(str(path))
    return path


@pytest.mark.parametrize("kind", ["jsonl", "csv", "parquet", "saved"])
def test_every_format_gives_the_same_prompts_and_fields(tmp_path, kind):
    task = dataset_task(_write(kind, tmp_path))
    assert task.prompts() == [r["prompt"] for r in ROWS]
    assert task.eval_prompts() == task.prompts()  # no evaluation set given: the training prompts
    assert task.row_fields([2, 0], "train") == [{"answer": "e"}, {"answer": "c"}]
    # the score reads the row's answer: the same completion scores differently on rows 0 and 6
    assert task.reward_rows(["?", "?"], ["c", "c"], [0, 6], "train") == [0.0, -0.3]


def test_saved_dataset_dict_splits_and_an_eval_file(tmp_path):
    import datasets

    evaluation = [{"prompt": "t", "answer": "u"}, {"prompt": "u", "answer": "a"}]
    datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS),
                          "test": datasets.Dataset.from_list(evaluation)}).save_to_disk(
        str(tmp_path / "dict"))
    task = dataset_task(tmp_path / "dict", eval_split="test")
    assert task.prompts() == list("bcdefgh") and task.eval_prompts() == ["t", "u"]
    # the evaluation's rows are its own: row 1 of "eval" has answer 'a', row 1 of "train" has 'd'
    assert task.row_fields([1], "eval") == [{"answer": "a"}] and \
        task.row_fields([1], "train") == [{"answer": "d"}]
    assert task.evaluate_rows(["t", "u"], ["u", "a"], [0, 1], "eval") == {"score": 0.0}
    on_file = dataset_task(tmp_path / "dict", eval_path=str(write_jsonl(tmp_path / "eval.jsonl", evaluation)))
    assert on_file.eval_prompts() == ["t", "u"] and on_file.prompt_origin(1, "eval").startswith(str(tmp_path))
    with pytest.raises(ValueError, match=r"has no split 'validation'; its splits are \['test', 'train'\]"):
        dataset_task(tmp_path / "dict", eval_split="validation")
    with pytest.raises(ValueError,
                       match="task.eval_split='test' needs a saved dataset directory with splits"):
        dataset_task(_write("jsonl", tmp_path), eval_split="test")


def _chat_tokenizer(tmp_path: Path):
    """A char tokenizer with a chat template, built and saved here: nothing is downloaded."""
    from services.models import build_char_tokenizer, load_tokenizer

    tokenizer = build_char_tokenizer(list("abcdefghijklmnopqrstuvwxyz<>/ ?"))
    tokenizer.chat_template = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</{{ m['role'] }}>"
                               "{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}")
    tokenizer.save_pretrained(tmp_path / "chat-tokenizer")
    return load_tokenizer(tmp_path / "chat-tokenizer")


def test_chat_messages_get_the_chat_template_and_reach_the_reward_as_messages(tmp_path):
    from services.models import build_char_tokenizer
    from services.prompts import encode_prompts

    rows = [{"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}],
             "weight": 2.0},
            {"messages": [{"role": "user", "content": "why"}], "weight": 0.5}]
    path = write_jsonl(tmp_path / "chat.jsonl", rows)
    task = dataset_task(path, prompt_field="messages", reward_function="tests.dataset_rewards:chat_length",
                        reward_fields=["weight"])
    tokenizer = _chat_tokenizer(tmp_path)
    texts = [task.format_prompt(m, tokenizer) for m in task.prompts()]
    assert texts == \
        ["<system>be brief</system><user>hi there</user><assistant>", "<user>why</user><assistant>"]
    assert [len(ids) for ids in encode_prompts(texts, tokenizer, 64, "reject", log=lambda _: None)] == \
        [len(t) for t in texts]
    assert task.reward_rows(texts, ["abc", "abcd"], [0, 1], "train") == [6.0, 2.0]
    with pytest.raises(ValueError, match=r"task.prompt_field 'messages' of .*chat.jsonl holds chat messages, "
                                         r"but the model's tokenizer has no chat template"):
        task.format_prompt(task.prompts()[0], build_char_tokenizer(list("abc")))


@pytest.mark.parametrize("function, message", [
    ("first_letter", (r"first_letter raised IndexError on train row 0: string index out of range \(called "
                      r"once on .*prompts.jsonl, row 0, field 'prompt' with an empty completion, before")),
    ("hangs", r"hangs' did not return within 3 s on .*prompts.jsonl, row 0, field 'prompt'"),
    ("not_a_number", (r"not_a_number' returned 'good' on .*row 0, field 'prompt' with an empty completion; "
                      r"a reward is a finite number")),
])
def test_the_reward_function_is_called_once_before_any_actor(tmp_path, function, message):
    """On the first row with an empty completion (an engine's response can be one), in a process of its own
    with a deadline: a function that raises, hangs or returns no number is named at start."""
    task = dataset_task(_write("jsonl", tmp_path), reward_function=f"tests.dataset_rewards:{function}")
    with pytest.raises(ValueError, match=message):
        task.trial_reward(timeout_s=3)
    dataset_task(_write("jsonl", tmp_path)).trial_reward()  # letter_distance takes an empty completion


def test_a_plain_prompt_is_used_as_it_is(tmp_path):
    task = dataset_task(_write("jsonl", tmp_path))
    assert task.format_prompt("b", _chat_tokenizer(tmp_path)) == "b"


# ---------------------------------------------------------------------- bad input: file, row and field named


def test_bad_data_is_named_by_file_row_and_field(tmp_path):
    jsonl = _write("jsonl", tmp_path)
    with pytest.raises(FileNotFoundError, match=r"task.path .*nowhere.jsonl does not exist"):
        dataset_task(tmp_path / "nowhere.jsonl")
    with pytest.raises(ValueError, match=r"task.path .*prompts.jsonl has no field 'question' "
                                         r"\(task.prompt_field\); its fields are \['prompt', 'answer', "
                                         r"'note'\]"):
        dataset_task(jsonl, prompt_field="question")
    with pytest.raises(ValueError,
                       match=r"task.path .*prompts.jsonl has no field 'solution' \(task.reward_fields\)"):
        dataset_task(jsonl, reward_fields=["solution"])
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ValueError, match=r"task.path .*empty.jsonl has no rows \(the file is empty\)"):
        dataset_task(tmp_path / "empty.jsonl")
    (tmp_path / "header.csv").write_text("prompt,answer\n")
    with pytest.raises(ValueError, match=r"task.path .*header.csv has no rows"):
        dataset_task(tmp_path / "header.csv")
    import datasets

    datasets.Dataset.from_dict({"prompt": [], "answer": []}).save_to_disk(str(tmp_path / "empty-dir"))
    with pytest.raises(ValueError, match=r"task.path .*empty-dir has no rows"):
        dataset_task(tmp_path / "empty-dir")
    holes = write_jsonl(tmp_path / "holes.jsonl",
                        [ROWS[0], ROWS[1], {"prompt": "d"}, {"answer": "x", "prompt": ""}])
    with pytest.raises(ValueError, match=r"task.path .*holes.jsonl, row 2: field 'answer' "
                                         r"\(task.reward_fields\) has no value"):
        dataset_task(holes)
    with pytest.raises(ValueError, match=r".*holes.jsonl, row 3, field 'prompt' is empty"):
        dataset_task(holes, reward_fields=[])
    numbers = write_jsonl(tmp_path / "numbers.jsonl", [{"prompt": 3, "answer": "a"}])
    with pytest.raises(ValueError,
                       match=r"numbers.jsonl, row 0, field 'prompt' holds 3; expected text or chat"):
        dataset_task(numbers)
    (tmp_path / "prompts.txt").write_text("b\n")
    with pytest.raises(ValueError, match=r"task.path .*prompts.txt: unknown format '.txt'"):
        dataset_task(tmp_path / "prompts.txt")
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"prompt": "b", "answer": "c"}\n{"prompt": \n')
    with pytest.raises(ValueError, match=r"task.path .*broken.jsonl cannot be read as .jsonl"):
        dataset_task(broken)


def test_an_evaluation_file_is_checked_like_the_training_file(tmp_path):
    jsonl = _write("jsonl", tmp_path)
    bad_eval = write_jsonl(tmp_path / "eval.jsonl", [{"prompt": "b"}])
    with pytest.raises(ValueError,
                       match=r"task.eval_path .*eval.jsonl has no field 'answer' \(task.reward_fields\)"):
        dataset_task(jsonl, eval_path=str(bad_eval))


@pytest.mark.parametrize("function, message", [
    ("tests.dataset_rewards:nowhere", "has no attribute 'nowhere'"),
    ("tests.no_such_module:score", "cannot be imported: ModuleNotFoundError"),
    ("tests.dataset_rewards:not_a_function", "is a int, not a function"),
    ("tests.dataset_rewards:no_fields", r"cannot be called with \(prompt, completion, answer\)"),
])
def test_a_bad_reward_function_is_refused_where_the_task_is_built(tmp_path, function, message):
    with pytest.raises(ValueError, match=rf"task.reward_function='{function}'.* {message}"):
        dataset_task(_write("jsonl", tmp_path), reward_function=function)


VERL = "tests.dataset_rewards:compute_score"
VERL_ROWS = [{"prompt": [{"role": "user", "content": p}], "data_source": "letters",
              "reward_model": {"style": "rule", "ground_truth": a}, "extra_info": {"index": i}}
             for i, (p, a) in enumerate(zip("bcdefgh", "cdefghi"))]


def test_a_trl_reward_function_scores_a_chunk_in_one_call_with_its_columns(tmp_path):
    """TRL's shape, recognised from the function: ``(prompts, completions, **columns)``, one call for the
    chunk, the row fields as lists; with chat prompts the completions arrive as TRL's conversational ones."""
    from services.tasks.dataset import reward_style
    from tests.dataset_rewards import letter_distance, trl_letter_distance

    assert reward_style(trl_letter_distance) == "trl"
    trl = "tests.dataset_rewards:trl_letter_distance"
    task = dataset_task(_write("jsonl", tmp_path), reward_function=trl)
    rows, completions = [0, 3, 6], ["c", "zz", "g"]
    want = [letter_distance("", c, ROWS[r]["answer"]) for r, c in zip(rows, completions, strict=True)]
    assert task.reward_rows([""] * 3, completions, rows, "train") == pytest.approx(want)
    chat = write_jsonl(tmp_path / "chat.jsonl", [{"prompt": [{"role": "user", "content": r["prompt"]}],
                                                   "answer": r["answer"]} for r in ROWS])
    task = dataset_task(chat, reward_function=trl)
    assert task.reward_rows([""] * 3, completions, rows, "train") == pytest.approx(want)
    with pytest.raises(ValueError, match=r"\(TRL's reward function, one call per batch\) cannot be called "
                                         r"with \(prompts, completions, note\)"):
        dataset_task(_write("jsonl", tmp_path), reward_function=trl, reward_fields=["note"])


def test_verls_compute_score_reads_the_nested_ground_truth_of_a_verl_parquet(tmp_path):
    """verl's shape, recognised from the function: ``compute_score(data_source, solution_str, ground_truth,
    extra_info)`` per sample, over a parquet laid out as verl's (the ground truth under reward_model), the
    nested field named task.reward_fields reward_model.ground_truth."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from tests.dataset_rewards import letter_distance

    path = tmp_path / "verl.parquet"
    pq.write_table(pa.Table.from_pylist(VERL_ROWS), path)
    fields = ["data_source", "reward_model.ground_truth", "extra_info"]
    task = dataset_task(path, reward_function=VERL, reward_fields=fields)
    rows, completions = [0, 3, 6], ["c", "zz", "g"]
    want = [letter_distance("", c, VERL_ROWS[r]["reward_model"]["ground_truth"])
            for r, c in zip(rows, completions, strict=True)]
    assert task.reward_rows([""] * 3, completions, rows, "train") == pytest.approx(want)
    with pytest.raises(ValueError, match=r"verl's compute_score.* cannot be called with \(solution_str, "
                                         r"data_source\)"):
        dataset_task(path, reward_function=VERL, reward_fields=["data_source"])
    task.reward_fields = ["data_source", "reward_model.answer"]  # a key the rows do not hold
    with pytest.raises(ValueError, match=r"'reward_model.answer': train row 0's 'reward_model' holds no "
                                         r"'answer'"):
        task.row_fields([0], "train")


def test_the_libraries_own_reward_functions_score_as_they_do_in_their_trainers(tmp_path):
    """TRL's ``trl.rewards.accuracy_reward`` (conversational completions, the ``solution`` column) and verl's
    ``default_compute_score`` (a verl parquet: data_source, the ground truth under reward_model) named as
    ``task.reward_function`` as they are: each row's score is the library's own call's, and the trial call
    before any actor passes."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from trl.rewards import accuracy_reward
    from verl.utils.reward_score import default_compute_score

    questions = [("What is 2 + 3?", "5"), ("What is 4 * 2?", "8")]
    chat = write_jsonl(tmp_path / "math.jsonl", [{"prompt": [{"role": "user", "content": q}], "solution": a}
                                                  for q, a in questions])
    task = dataset_task(chat, reward_function="trl.rewards:accuracy_reward", reward_fields=["solution"])
    task.trial_reward()
    completions = [r"It is \boxed{5}", r"\boxed{9}"]
    want = accuracy_reward([[{"role": "assistant", "content": c}] for c in completions], ["5", "8"])
    assert task.reward_rows([""] * 2, completions, [0, 1], "train") == want == [1.0, 0.0]

    path = tmp_path / "gsm8k.parquet"
    pq.write_table(pa.Table.from_pylist([
        {"prompt": [{"role": "user", "content": q}], "data_source": "openai/gsm8k",
         "reward_model": {"style": "rule", "ground_truth": a}, "extra_info": {"index": i}}
        for i, (q, a) in enumerate(questions)]), path)
    task = dataset_task(path, reward_function="verl.utils.reward_score:default_compute_score",
                        reward_fields=["data_source", "reward_model.ground_truth", "extra_info"])
    task.trial_reward()
    completions = ["so #### 5", "#### 9"]
    want = [default_compute_score("openai/gsm8k", c, a, {"index": i})
            for i, (c, (_, a)) in enumerate(zip(completions, questions, strict=True))]
    assert task.reward_rows([""] * 2, completions, [0, 1], "train") == want == [1.0, 0.0]


def test_long_prompts_are_named_by_file_row_and_field_or_truncated(tmp_path):
    from services.models import build_char_tokenizer
    from services.prompts import encode_prompts

    rows = [{"prompt": "b"}, {"prompt": "c" * 20}, {"prompt": "d" * 30}]
    task = dataset_task(write_jsonl(tmp_path / "long.jsonl", rows), reward_function=None, reward_fields=[])
    tokenizer = build_char_tokenizer(list("bcd"))
    with pytest.raises(ValueError, match=r"2 prompt\(s\) are longer than task.max_prompt_tokens=16; first is "
                                         r".*long.jsonl, row 1, field 'prompt' with 20 tokens"):
        encode_prompts(task.prompts(), tokenizer, 16, "reject", log=lambda _: None, origin=task.prompt_origin)
    notes = []
    encoded = encode_prompts(task.prompts(), tokenizer, 16, "truncate", log=notes.append,
                             origin=task.prompt_origin)
    assert [len(e) for e in encoded] == [1, 16, 16]
    assert re.search(r"truncated 2 prompt\(s\) .*long.jsonl, row 1, field 'prompt'", notes[0]), notes


def test_config_refuses_dataset_settings_that_cannot_work(tmp_path):
    from pydantic import ValidationError

    from services.config import load_config

    path = _write("jsonl", tmp_path)
    assert dataset_config(path).task.options()["reward_fields"] == ["answer"]
    cases = [
        ({"task": {"name": "dataset"}, "model": {"path": "/m"}}, "task.name='dataset' needs task.path"),
        ({"task": {"name": "randomwalks", "path": str(path)}},
         "task.path is set but task.name='randomwalks'"),
        ({"task": {"name": "dataset", "path": str(path)}, "model": {"path": "/m"}},
         "needs task.reward_function"),
        ({"task": {"name": "dataset", "path": str(path), "reward_function": REWARD}}, "needs model.path"),
        ({"task": {"name": "dataset", "path": str(path), "reward_function": "score"},
          "model": {"path": "/m"}},
         "is not of the form package.module:function"),
        ({"task": {"name": "dataset", "path": str(path), "reward_function": REWARD}, "model": {"path": "/m"},
          "reward": {"kind": "model", "model_path": "/r"}},
         "task.reward_function is set but reward.kind='model'"),
        ({"task": {"name": "dataset", "path": str(path), "reward_function": REWARD,
                   "reward_fields": ["prompt"]},
          "model": {"path": "/m"}}, "task.reward_fields names ['prompt']"),
    ]
    for overrides, message in cases:
        with pytest.raises(ValidationError, match=re.escape(message)):
            load_config(None, overrides)
    # a reward model scores a dataset task without a function
    assert load_config(None, {"task": {"name": "dataset", "path": str(path)}, "model": {"path": "/m"},
                              "reward": {"kind": "model", "model_path": "/r"}}).task.reward_function is None


# ---------------------------------------------------------------------- the reward actor


def test_reward_actor_scores_each_sample_with_its_rows_answer(tiny_model_dir, tmp_path):
    """The reward actor's task is built from the rows the driver read (here by value), not from the file;
    each sample is scored against the answer of the row its prompt came from."""
    from actors.reward import RewardActor
    from services.experience import make_batch
    from services.models import load_tokenizer
    from services.tasks.randomwalks import LETTERS

    path = _write("jsonl", tmp_path)
    task = dataset_task(path)
    options = {"prompt_field": "prompt", "reward_function": REWARD, "reward_fields": ["answer"],
               "rows": {split: {c: rows[c] for c in ("prompt", "answer")}
                        for split, rows in task.rows.items()}}
    path.unlink()  # the actor never reads the file
    # a plain object here: no Ray needed
    actor = RewardActor(0, RewardSpec("dataset", options, tiny_model_dir))
    tok = load_tokenizer(tiny_model_dir)
    rows = [0, 6, 3, 3]
    responses = [tok("c")["input_ids"], tok("c")["input_ids"], tok("fz")["input_ids"][:1], []]
    batch = make_batch([tok(task.prompts()[r])["input_ids"] for r in rows], responses,
                       [[0.0] * len(r) for r in responses], [0] * 4, rows, tok.pad_token_id, 0, 0.0, 4)
    expected = [0.0, -abs(LETTERS.index("c") - LETTERS.index("i")) / 20, 0.0, -1.0]
    assert actor.score(batch, 0).tolist() == pytest.approx(expected)
    out = actor.evaluate(batch, 0, keep_samples=2)
    assert out["sums"]["score"] == pytest.approx(sum(expected)) and [s["score"] for s in out["samples"]] == \
        pytest.approx(expected[:2])


def test_without_a_reward_function_a_reward_model_scores_and_evaluates(tiny_model_dir, tmp_path):
    """reward.kind: model on a dataset task: the classifier's logit is the score, and, the task having no
    metric of its own, the evaluation's "score" is the mean of the same logits."""
    from transformers import GPT2Config, GPT2ForSequenceClassification

    from actors.reward import RewardActor
    from services.experience import make_batch
    from services.models import load_tokenizer

    task = dataset_task(_write("csv", tmp_path), reward_function=None, reward_fields=[])
    tok = load_tokenizer(tiny_model_dir)
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=len(tok), n_layer=1, n_embd=16, n_head=2, n_positions=32, num_labels=1,
                        pad_token_id=tok.pad_token_id)
    GPT2ForSequenceClassification(config).eval().save_pretrained(tmp_path / "classifier")
    tok.save_pretrained(tmp_path / "classifier")
    options = {"prompt_field": "prompt", "reward_function": None, "reward_fields": [],
               "rows": {split: {"prompt": rows["prompt"]} for split, rows in task.rows.items()}}
    actor = RewardActor(0, RewardSpec("dataset", options, tiny_model_dir, kind="model",
                                         model_path=str(tmp_path / "classifier")))
    responses = [tok("cd")["input_ids"], tok("e")["input_ids"]]
    batch = make_batch([tok("b")["input_ids"], tok("c")["input_ids"]], responses,
                       [[0.0] * len(r) for r in responses], [0, 0], [0, 1], tok.pad_token_id, 0, 0.0, 2)
    scores = actor.score(batch, 0)
    out = actor.evaluate(batch, 0, keep_samples=2)
    assert out["sums"] == {"score": pytest.approx(float(scores.sum()), abs=1e-5)}
    assert [s["score"] for s in out["samples"]] == pytest.approx(scores.tolist(), abs=1e-6)


def test_rows_reach_a_reward_actor_through_the_object_store(ray_client, tiny_model_dir, tmp_path):
    """``reward_actor_options`` holds the rows, never the path, shipped as one object ref once Ray is up: a
    real Ray actor builds the task from it after the file is gone."""
    import pickle

    from actors.reward import RewardActor
    from services.experience import make_batch
    from services.models import load_tokenizer

    path = _write("parquet", tmp_path)
    task = dataset_task(path)
    options = task.reward_actor_options()
    assert "path" not in options and options["rows"] is task.reward_actor_options()["rows"]
    options["rows"].ship()
    assert isinstance(options["rows"].ref, ray_client.ObjectRef)
    assert pickle.loads(pickle.dumps(options["rows"])).value is None  # the ref travels, not the rows
    path.unlink()
    actor = ray_client.remote(num_cpus=0)(RewardActor).remote(0,
                                                              RewardSpec("dataset", options, tiny_model_dir))
    tok = load_tokenizer(tiny_model_dir)
    batch = make_batch([tok("b")["input_ids"], tok("h")["input_ids"]],
                       [tok("c")["input_ids"]] * 2, [[0.0]] * 2, [0, 0], [0, 6], tok.pad_token_id, 0, 0.0, 1)
    scores = ray_client.get(actor.score.remote(batch, 0))
    assert torch.allclose(scores, torch.tensor([0.0, -0.3]))
    ray_client.kill(actor)


def test_the_plan_of_a_dataset_job_starts_no_ray(cache_dir, tiny_model_dir, tmp_path):
    """The start-up race's losing order, every time: the plan runs to its end before anything connects (the
    driver runs it beside Ray's start), in a process without Ray. It must not start one by a side effect (a
    ``ray.put`` of the rows did: the driver's own ``ray.init`` then failed, "Perhaps you called ray.init
    twice")."""
    import subprocess
    import sys

    from tests.conftest import RAY_ENV, ROOT

    data = write_jsonl(tmp_path / "data.jsonl", ROWS)
    script = (
        "import ray\n"
        "from learner.main import parse\n"
        "from learner.plan import plan\n"
        f"cfg = parse({_job_args(cache_dir, tiny_model_dir, tmp_path / 'runs', data)!r})\n"
        "planned = plan(cfg, print, local_ray=True)\n"
        "assert planned.shipments and planned.shipments[0].ref is None\n"
        "print('ray started:', ray.is_initialized())\n")
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_ENABLE_AUTO_CONNECT")}
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, env={**env, **RAY_ENV}, check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "ray started: False" in proc.stdout


# ---------------------------------------------------------------------- the job


def _job_args(cache_dir, tiny_model_dir, out, data, *extra) -> list[str]:
    return ["--model.path", tiny_model_dir, "--model.cache_dir", cache_dir, "--run.output_dir", str(out),
            "--task.name", "dataset", "--task.path", str(data), "--task.reward_function", REWARD,
            "--task.reward_fields", '["answer"]', "--rollout.max_new_tokens", "9", *extra]


@pytest.mark.parametrize("rows, extra, message", [
    ([{"prompt": "b", "answer": "c"}, {"prompt": "c" * 20, "answer": "d"}],
     ["--task.max_prompt_tokens", "16"],
     ("1 prompt(s) are longer than task.max_prompt_tokens=16; first is {path}, row 1, field 'prompt' "
      "with 20 tokens")),
    # unset, the limit is what the tiny model's 32 positions leave beside the response's 9 + 1
    ([{"prompt": "b", "answer": "c"}, {"prompt": "c" * 30, "answer": "d"}], [],
     ("1 prompt(s) are longer than task.max_prompt_tokens=22; first is {path}, row 1, field 'prompt' "
      "with 30 tokens")),
    ([{"prompt": "b"}], [], "task.path {path} has no field 'answer' (task.reward_fields)"),
    ([{"prompt": "b", "answer": "c"}], ["--task.reward_function", "tests.dataset_rewards:nowhere"],
     "task.reward_function='tests.dataset_rewards:nowhere': module 'tests.dataset_rewards' has no attribute"),
])
def test_bad_dataset_fails_the_job_before_any_actor(cache_dir, tiny_model_dir, tmp_path, rows,
                                                    extra, message):
    data = write_jsonl(tmp_path / "data.jsonl", rows)
    out = tmp_path / "runs"
    proc = run_cli([*_job_args(cache_dir, tiny_model_dir, out, data, *extra),
                    "--cluster.address", "127.0.0.1:1"])
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert message.format(path=data) in proc.stderr, proc.stderr[-2000:]
    assert "actors ready" not in proc.stdout and not out.exists()


def test_a_dataset_jobs_prompt_length_follows_its_longest_prompt(cache_dir, tiny_model_dir, tmp_path):
    """task.max_prompt_tokens unset: a dataset job takes its longest prompt (20 tokens here, longer than the
    embedded task's 16) within what the model's positions leave, and says so at start; the plan runs to its
    end (the job then fails only to reach the cluster that is not there)."""
    data = write_jsonl(tmp_path / "data.jsonl", [{"prompt": "b", "answer": "c"}, {"prompt": "c" * 20,
                                                                                   "answer": "d"}])
    proc = run_cli([*_job_args(cache_dir, tiny_model_dir, tmp_path / "runs", data),
                    "--cluster.address", "127.0.0.1:1", "--cluster.connect_timeout_s", "1"])
    said = ("prompts: task.max_prompt_tokens=20 follows the longest prompt; the model's 32 positions less "
            "the response's 9 + 1 allow 22 (set it to choose)")
    assert said in proc.stdout, proc.stdout[-2000:] + proc.stderr
    assert "longer than task.max_prompt_tokens" not in proc.stderr


def _samples(path: Path) -> list[tuple[float, str, str]]:
    """(score, prompt, response) of each sample in a samples/iteration-NNNN.md file."""
    found = re.findall(r"## \d+\. score (\S+)\n\nPrompt:\n\n> (.*)\n\nResponse:\n\n> (.*)\n",
                       path.read_text())
    return [(float(score), prompt, "" if response == "(empty)" else response)
            for score, prompt, response in found]


@pytest.mark.integration
def test_dataset_job_trains_with_the_rows_answers(ray_head, cache_dir, tiny_model_dir, tmp_path):
    """A real job on a JSONL training file and a JSONL evaluation file: it completes, and every evaluation
    sample's score is the reward function's on that row's answer from the evaluation file (whose answers
    differ from the training file's for the same prompt)."""
    from tests.dataset_rewards import letter_distance

    train = write_jsonl(tmp_path / "train.jsonl", [{"prompt": p, "answer": "a"} for p in "bcdefghijk"])
    eval_answers = dict(zip("bcde", "uqmi"))
    evaluation = write_jsonl(tmp_path / "eval.jsonl",
                             [{"prompt": p, "answer": a} for p, a in eval_answers.items()])
    proc = run_job([*_job_args(cache_dir, tiny_model_dir, tmp_path, train), "--task.eval_path",
                    str(evaluation), "--cluster.address", ray_head.address, "--run.name", "data",
                    "--run.seed", "1", "--run.iterations", "2", "--run.eval_every", "2",
                    "--rollout.batch_size", "32", "--rollout.chunk_size", "16", "--ppo.minibatch_size", "16",
                    "--rollout.eval_samples_per_prompt", "4", "--metrics.eval_samples_saved", "16",
                    # a shared CPU machine can take minutes to place
                    "--no-checkpoint.export_hf", "--cluster.placement_timeout_s", "300"])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run_dir = tmp_path / "data"
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in records] == [1, 2]
    assert all(-1.0 <= r["score_mean"] <= 0.0 for r in records), [r["score_mean"] for r in records]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert set(summary["eval_final"]) == {"score"}
    for name in ("iteration-0000.md", "iteration-0002.md"):
        samples = _samples(run_dir / "samples" / name)
        assert len(samples) == 16 and {p for _, p, _ in samples} == set(eval_answers), samples
        for score, prompt, response in samples:
            assert score == pytest.approx(letter_distance(prompt, response, eval_answers[prompt]),
                                          abs=1e-3), (prompt, response, score)
        # the evaluation file's answers, not the training file's 'a': a score the training answer cannot give
        assert any(abs(score - letter_distance(p, r, "a")) > 1e-3 for score, p, r in samples), samples


@pytest.mark.integration
@pytest.mark.parametrize("style", ["trl", "verl"])
def test_a_job_trains_with_a_trl_or_verl_reward_function_as_written(style, ray_head, cache_dir,
                                                                      tiny_model_dir, tmp_path):
    """A one-iteration dataset job whose task.reward_function is TRL's batch function over a JSONL file, or
    verl's compute_score over a verl-style parquet (the ground truth under reward_model): it completes, and
    each saved evaluation sample's score is the function's on that row's answer."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from tests.dataset_rewards import letter_distance

    answers = dict(zip("bcdefghijk", "cdefghijkl"))
    if style == "trl":
        data = write_jsonl(tmp_path / "train.jsonl", [{"prompt": p, "answer": a} for p, a in answers.items()])
        reward = ["--task.reward_function", "tests.dataset_rewards:trl_letter_distance"]
    else:
        data = tmp_path / "train.parquet"
        rows = [{"prompt": p, "data_source": "letters", "extra_info": {"index": i},
                 "reward_model": {"style": "rule", "ground_truth": a}}
                for i, (p, a) in enumerate(answers.items())]
        pq.write_table(pa.Table.from_pylist(rows), data)
        reward = ["--task.reward_function", VERL, "--task.reward_fields",
                  '["data_source", "reward_model.ground_truth", "extra_info"]']
    args = _job_args(cache_dir, tiny_model_dir, tmp_path, data)
    for setting in ("--task.reward_function", "--task.reward_fields"):  # a list given twice is joined
        at = args.index(setting)
        del args[at:at + 2]
    if style == "trl":
        reward += ["--task.reward_fields", '["answer"]']
    proc = run_job([*args, *reward, "--cluster.address",
                    ray_head.address, "--run.name", style, "--run.seed", "1", "--run.iterations", "1",
                    "--no-run.eval_before_training", "--rollout.batch_size", "16",
                    "--rollout.chunk_size", "8",
                    "--ppo.minibatch_size", "16", "--rollout.eval_samples_per_prompt", "2",
                    "--metrics.eval_samples_saved", "8", "--no-checkpoint.export_hf",
                    "--cluster.placement_timeout_s", "300"])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run_dir = tmp_path / style
    record = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])
    assert -1.0 <= record["score_mean"] <= 0.0, record["score_mean"]
    samples = _samples(run_dir / "samples" / "iteration-0001.md")
    assert len(samples) == 8, samples
    for score, prompt, response in samples:
        assert score == pytest.approx(letter_distance(prompt, response, answers[prompt]), abs=1e-3), samples
