"""The agent endpoint with real parts only: a tiny Llama and a tokenizer built here, transformers' and vLLM's
engines, uvicorn, and the ``openai`` package's own client. The tokenizer merges every pair of lowercase
letters, so text the model sampled often re-encodes to other ids: what is recorded must be the engine's."""

from __future__ import annotations

import asyncio
import json
import math
import string
import threading

import pytest

from actors.agent_endpoint import (
    AgentEndpoint,
    Call,
    call_seed,
    episode_base_seed,
    merge_calls,
    parse_tool_calls,
    run_agents,
)
from actors.engines import HFEngine, SamplingSettings, VLLMEngine
from actors.specs import EngineSpec
from services.experience import FINISH_LENGTH, FINISH_STOP

MAX_MODEL_LEN = 512
SAMPLING = SamplingSettings(temperature=1.0, top_p=1.0, max_new_tokens=12)
# ChatML; tools and tool calls rendered simply; a role it has no turn for is the template's error
TEMPLATE = (
    "{%- if tools %}<|im_start|>system\ntools:{% for t in tools %} {{ t | tojson }}{% endfor %}<|im_end|>\n"
    "{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role not in ['system', 'user', 'assistant', 'tool'] %}"
    "{{ raise_exception('no turn for role ' ~ m.role) }}{% endif -%}"
    "<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{%- for c in m.tool_calls or [] %}<tool_call>{{ {'name': c.function.name, 'arguments': "
    "c.function.arguments} | tojson }}</tool_call>{% endfor %}<|im_end|>\n"
    "{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "the weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
QUESTION = [{"role": "user", "content": "weather in paris?"}]
TOOL_CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "paris"}}</tool_call>'


def build_tokenizer():
    """Printable ASCII one character a token, every pair of lowercase letters merged, ChatML's markers."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {ch: i for i, ch in enumerate(dict.fromkeys(string.printable[:95] + "\n"))}
    merges = [(a, b) for a in string.ascii_lowercase for b in string.ascii_lowercase]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    markers = ["<|im_start|>", "<|im_end|>"]
    for marker in markers:
        vocab[marker] = len(vocab)
    core = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=None, fuse_unk=False))
    core.add_special_tokens(markers)
    core.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<|im_start|>",
                                        eos_token="<|im_end|>", pad_token="<|im_end|>",
                                        model_max_length=MAX_MODEL_LEN)
    tokenizer.chat_template = TEMPLATE
    return tokenizer


def chat_ids(tokenizer, messages, tools=None) -> list[int]:
    return list(tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True,
                                              tokenize=True)["input_ids"])


class Recorded:
    """The engine as it is, plus a record of its generate calls (to count batches and compare ids) and of
    how many ran at once."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.batches: list[tuple[list[list[int]], list[int], list]] = []
        self.running = self.most_running = 0
        self.lock = threading.Lock()

    def generate(self, prompts, sampling, seeds, max_new_tokens=None):
        with self.lock:
            self.running += 1
            self.most_running = max(self.most_running, self.running)
        try:
            generations = super().generate(prompts, sampling, seeds, max_new_tokens)
        finally:
            with self.lock:
                self.running -= 1
        self.batches.append((prompts, seeds, generations))
        return generations

    def generation_of(self, prompt_ids: list[int]):
        """What the engine returned for this prompt (the last time)."""
        found = [g for prompts, _, gens in self.batches for p, g in zip(prompts, gens, strict=True)
                 if p == prompt_ids]
        return found[-1]


class RecordedHF(Recorded, HFEngine):
    pass


class RecordedVLLM(Recorded, VLLMEngine):
    pass


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


@pytest.fixture(scope="module")
def model_dir(tokenizer, tmp_path_factory) -> str:
    """A random-init Llama, head_dim 32 (a size vLLM's CPU attention takes)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from services.models import save_model_dir

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, head_dim=32,
                         max_position_embeddings=MAX_MODEL_LEN, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    path = tmp_path_factory.mktemp("agent-model") / "random"
    return str(save_model_dir(LlamaForCausalLM(config), tokenizer, path))


@pytest.fixture(scope="module")
def tool_model_dir(model_dir, tokenizer, tmp_path_factory) -> str:
    """The random model taught one answer: QUESTION with TOOLS gets TOOL_CALL, then EOS."""
    import torch

    from services.models import load_causal_lm, save_model_dir

    torch.manual_seed(0)
    model = load_causal_lm(model_dir)
    prompt = chat_ids(tokenizer, QUESTION, TOOLS)
    answer = tokenizer.encode(TOOL_CALL, add_special_tokens=False) + [tokenizer.eos_token_id]
    ids = torch.tensor([prompt + answer])
    labels = ids.clone()
    labels[0, : len(prompt)] = -100
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    model.train()
    # Float sums differ with the thread count, so the steps needed vary a little by machine: a wide cap,
    # left as soon as the answer is learnt.
    for _ in range(2000):
        loss = model(input_ids=ids, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if loss.item() < 1e-3:
            break
    assert loss.item() < 1e-3, loss.item()
    model.eval()
    return str(save_model_dir(model, tokenizer, tmp_path_factory.mktemp("agent-model") / "tool"))


@pytest.fixture(scope="module")
def engine(model_dir):
    return RecordedHF(model_dir, seed=0)


@pytest.fixture(scope="module")
def endpoint(engine, model_dir):
    from services.models import load_tokenizer

    with AgentEndpoint(engine, load_tokenizer(model_dir), SAMPLING, MAX_MODEL_LEN, gather_s=0.02) as ep:
        yield ep


def client(base_url: str):
    from openai import AsyncOpenAI

    return AsyncOpenAI(base_url=base_url, api_key="tether", max_retries=0)


async def chat(endpoint, key: str, messages, **kwargs):
    async with client(endpoint.base_url(key)) as c:
        return await c.chat.completions.create(model="policy", messages=messages, **kwargs)


def test_chat_completion_records_the_engines_ids_and_seeds_calls_reproducibly(endpoint, engine, tokenizer):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]
    for key, seed in (("a", 7), ("b", 7), ("c", 8)):
        endpoint.register(key, seed)

    async def episodes():
        a = [await chat(endpoint, "a", messages), await chat(endpoint, "a", messages, max_tokens=5)]
        return a, await chat(endpoint, "b", messages), await chat(endpoint, "c", messages)

    before = len(engine.batches)
    (first, capped), same_seed, other_seed = asyncio.run(episodes())
    calls = endpoint.take_calls("a")
    # one engine call each, in order (a's two, b's, c's), seeded by the episode's seed and the call's index
    batches = engine.batches[before:]
    assert [seeds for _, seeds, _ in batches] == [
        [call_seed(episode_base_seed(7), 0)], [call_seed(episode_base_seed(7), 1)],
        [call_seed(episode_base_seed(7), 0)], [call_seed(episode_base_seed(8), 0)]]
    prompt = chat_ids(tokenizer, messages)
    assert [c.prompt_ids for c in calls] == [prompt, prompt]
    assert first.object == "chat.completion" and first.model == "policy"
    assert first.choices[0].message.role == "assistant"
    assert first.usage.prompt_tokens == len(prompt)
    assert first.usage.completion_tokens == len(calls[0].completion_ids) <= SAMPLING.max_new_tokens
    assert len(calls[1].completion_ids) <= 5 and capped.choices[0].finish_reason in ("stop", "length")
    for call, response, (_, _, [sampled]) in zip(calls, (first, capped), batches, strict=False):
        assert call.completion_ids == sampled.response_ids[: len(call.completion_ids)]
        assert call.logprobs == sampled.logprobs[: len(call.logprobs)]
        text = tokenizer.decode(call.completion_ids, skip_special_tokens=True)
        assert response.choices[0].message.content == text
        reason = "length" if call.finish_reason == FINISH_LENGTH else "stop"
        assert response.choices[0].finish_reason == reason
        # the engine's log-probs of the recorded ids: the same ids the learner will score
        scored = engine.score([call.prompt_ids + call.completion_ids], [len(call.prompt_ids)])[0]
        assert max(abs(a - b) for a, b in zip(call.logprobs, scored, strict=True)) < 1e-4
    # the text re-encoded is other ids: only the record keeps what was sampled
    assert any(tokenizer.encode(tokenizer.decode(c.completion_ids, skip_special_tokens=True),
                                add_special_tokens=False) != c.completion_ids for c in calls)
    # the episode's seed and the call's index give the seed: same episode seed, same first sample
    assert same_seed.choices[0].message.content == first.choices[0].message.content
    assert other_seed.choices[0].message.content != first.choices[0].message.content
    assert endpoint.take_calls("b")[0].completion_ids == calls[0].completion_ids
    endpoint.take_calls("c")


def test_completions_and_merge_calls(endpoint, engine, tokenizer):
    endpoint.register("m", 1)
    prompt = tokenizer.encode("the cat sat", add_special_tokens=False)
    between = tokenizer.encode("\nok\n", add_special_tokens=False)

    async def episode():
        async with client(endpoint.base_url("m")) as c:
            text = await c.completions.create(model="policy", prompt="the cat sat")
            # the next prompt, built from ids: the previous prompt, what the engine sampled, a few new ids
            continued = prompt + engine.generation_of(prompt).response_ids + between
            await c.completions.create(model="policy", prompt=continued, max_tokens=4)
            await c.completions.create(model="policy", prompt=[5, 6, 7])
            return text

    text = asyncio.run(episode())
    calls = endpoint.take_calls("m")
    assert calls[0].prompt_ids == prompt
    assert text.object == "text_completion"
    assert text.choices[0].text == tokenizer.decode(calls[0].completion_ids, skip_special_tokens=True)
    assert len(calls[1].completion_ids) <= 4 and calls[2].prompt_ids == [5, 6, 7]

    first, second = merge_calls(calls)
    assert first.prompt_ids == calls[0].prompt_ids
    assert first.ids == calls[0].completion_ids + between + calls[1].completion_ids
    assert first.action_mask == [1] * len(calls[0].completion_ids) + [0] * len(between) + [1] * len(
        calls[1].completion_ids)
    assert first.logprobs == calls[0].logprobs + [0.0] * len(between) + calls[1].logprobs
    assert first.finish_reason == calls[1].finish_reason
    assert (second.prompt_ids, second.ids, second.logprobs) == ([5, 6, 7], calls[2].completion_ids,
                                                                  calls[2].logprobs)


def test_merge_calls_keeps_a_call_that_does_not_extend_token_for_token_apart():
    a = Call([1, 2], [3, 4], [-0.5, -0.25], FINISH_STOP)
    b = Call([1, 2, 3, 9], [5], [-1.0], FINISH_LENGTH)  # differs at the completion's second token
    c = Call([1, 2, 3, 9, 5], [6], [-2.0], FINISH_STOP)  # extends b with nothing between
    first, second = merge_calls([a, b, c])
    assert (first.ids, first.action_mask, first.finish_reason) == ([3, 4], [1, 1], FINISH_STOP)
    assert (second.ids, second.action_mask, second.logprobs) == ([5, 6], [1, 1], [-1.0, -2.0])
    assert merge_calls([]) == []


def test_merge_calls_keeps_each_model_tokens_version():
    """In-flight updates: a call's tokens carry the versions they were sampled under (a call may span two);
    the environment's tokens between calls are -1, and a call without versions (no in-flight updates) is -1
    too."""
    a = Call([1, 2], [3, 4], [-0.5, -0.25], FINISH_STOP, versions=[6, 7])
    b = Call([1, 2, 3, 4, 8], [5], [-1.0], FINISH_STOP, versions=[7])
    c = Call([9], [6], [-2.0], FINISH_STOP)
    first, second = merge_calls([a, b, c])
    assert (first.ids, first.versions) == ([3, 4, 8, 5], [6, 7, -1, 7])
    assert second.versions == [-1]


def test_parse_tool_calls():
    content, calls = parse_tool_calls('let me look <tool_call>{"name": "f", "arguments": {"x": 1}}'
                                      '</tool_call> <tool_call>{"name": broken</tool_call>')
    assert content == "let me look  <tool_call>{\"name\": broken</tool_call>"
    assert [(c["type"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("function", "f", {"x": 1})]
    assert parse_tool_calls('<tool_call>{"name": "g"}</tool_call>')[0] is None
    assert parse_tool_calls("plain") == ("plain", [])


async def weather_agent(base_url: str, row: dict) -> float:
    """Asks, runs the tool the model calls, hands back its result, asks again."""
    async with client(base_url) as c:
        messages = list(row["messages"])
        first = await c.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
        message = first.choices[0].message
        if first.choices[0].finish_reason != "tool_calls" or message.content is not None:
            return 0.0
        messages.append(message.model_dump(exclude_none=True))
        for call in message.tool_calls:
            city = json.loads(call.function.arguments)["city"]
            messages.append({"role": "tool", "tool_call_id": call.id, "content": row["weather"][city]})
        second = await c.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
        return 1.0 if second.choices[0].message.role == "assistant" else 0.5


def test_tool_call_round_trip_is_one_trajectory(tool_model_dir):
    from services.models import load_tokenizer

    tokenizer = load_tokenizer(tool_model_dir)
    engine = HFEngine(tool_model_dir, seed=0)
    sampling = SamplingSettings(temperature=1.0, max_new_tokens=64)  # room for the whole tool call
    with AgentEndpoint(engine, tokenizer, sampling, MAX_MODEL_LEN) as endpoint:
        [result] = asyncio.run(run_agents(endpoint, weather_agent, [{"messages": QUESTION,
                                                                      "weather": {"paris": "sunny"}}],
                                          [3], 30))
    assert result.ok and result.reward == 1.0, result
    first, second = result.calls
    assert tokenizer.decode(first.completion_ids) == TOOL_CALL + "<|im_end|>"
    assert "tools: " in tokenizer.decode(first.prompt_ids)
    # the assistant turn the template renders back is the sampled one, token for token: one trajectory whose
    # tool turn is context only
    [trajectory] = merge_calls(result.calls)
    tool_turn = second.prompt_ids[len(first.prompt_ids) + len(first.completion_ids):]
    assert tokenizer.decode(tool_turn) == "\n<|im_start|>tool\nsunny<|im_end|>\n<|im_start|>assistant\n"
    assert trajectory.ids == first.completion_ids + tool_turn + second.completion_ids
    assert trajectory.action_mask == [1] * len(first.completion_ids) + [0] * len(tool_turn) + [1] * len(
        second.completion_ids)
    assert trajectory.logprobs[len(first.completion_ids): -len(second.completion_ids)] == \
        [0.0] * len(tool_turn)


def test_concurrent_episodes_are_one_engine_call(engine, model_dir):
    from services.models import load_tokenizer

    n = 6
    barrier = asyncio.Barrier(n)

    async def agent(base_url: str, row: dict) -> float:
        async with client(base_url) as c:
            await barrier.wait()  # the episodes' first calls leave together
            response = await c.chat.completions.create(model="policy", messages=[
                {"role": "user", "content": f"question {row['i']}"}])
            return float(response.usage.completion_tokens)

    before = len(engine.batches)
    with AgentEndpoint(engine, load_tokenizer(model_dir), SAMPLING, MAX_MODEL_LEN, gather_s=0.3) as endpoint:
        results = asyncio.run(run_agents(endpoint, agent, [{"i": i} for i in range(n)], list(range(n)), 30))
    assert all(r.ok for r in results), results
    assert len(engine.batches) - before == 1
    prompts, seeds, _ = engine.batches[-1]
    assert len(prompts) == n and len(set(seeds)) == n
    assert engine.most_running == 1
    assert [r.reward for r in results] == [float(len(r.calls[0].completion_ids)) for r in results]


def test_refused_requests(endpoint, tokenizer):
    import openai

    endpoint.register("r", 0)
    hello = [{"role": "user", "content": "hi"}]

    async def too_long():
        async with client(endpoint.base_url("r")) as c:
            await c.completions.create(model="policy", prompt=[5] * (MAX_MODEL_LEN - 7), max_tokens=8)

    async def refusals():
        out = []
        for kwargs in ({"temperature": 0.7}, {"top_p": 0.9}, {"n": 2}, {"stop": ["x"]},
                       {"messages": [{"role": "critic", "content": "no"}]}, None):
            try:
                await (too_long() if kwargs is None else chat(endpoint, "r", **{"messages": hello, **kwargs}))
                out.append(None)
            except openai.BadRequestError as e:
                out.append(e.message)
        accepted = await chat(endpoint, "r", hello, temperature=1.0, top_p=1.0)
        async with client(endpoint.base_url("unknown")) as c:
            with pytest.raises(openai.NotFoundError):
                await c.chat.completions.create(model="policy", messages=hello)
        async with client(endpoint.base_url("r")) as c:
            models = await c.models.list()
        return out, accepted, models

    (temperature, top_p, n, stop, role, length), accepted, models = asyncio.run(refusals())
    assert "temperature=0.7" in temperature and "temperature=1.0" in temperature
    assert "top_p=0.9" in top_p and "top_p=1.0" in top_p
    assert "n=2" in n and "stop strings" in stop
    assert "chat template" in role and "no turn for role critic" in role
    assert "(505 tokens) plus max_tokens (8)" in length and "max_model_len (512)" in length
    assert accepted.choices[0].message.role == "assistant"
    assert [m.id for m in models.data] == ["tether"]
    assert len(endpoint.take_calls("r")) == 1  # a refused call is not recorded


def test_failed_episodes_are_named_and_spare_the_others(endpoint):
    import openai

    async def agent(base_url: str, row: dict):
        kind = row["kind"]
        async with client(base_url) as c:
            await c.completions.create(model="policy", prompt="go", max_tokens=2)
        if kind == "raise":
            raise ValueError("the tool broke")
        if kind == "slow":
            await asyncio.sleep(60)
        return {"ok": 0.5, "nan": math.nan, "text": "good"}[kind]

    kinds = ["ok", "raise", "slow", "nan", "text", "ok"]
    # the deadline leaves the others' model call time to finish on a loaded machine; "slow" never would
    results = asyncio.run(run_agents(endpoint, agent, [{"kind": k} for k in kinds], [1, 2, 3, 4, 5, 6], 20.0))
    assert [(r.reward, r.error) for r in results] == [
        (0.5, None), (None, "ValueError: the tool broke"), (None, "timed out after 20 s"),
        (None, "returned nan, not a finite number"), (None, "returned 'good', not a number"), (0.5, None)]
    assert all(len(r.calls) == 1 for r in results)

    async def after():  # an episode that ended takes no more calls
        async with client(endpoint.base_url(results[0].key)) as c:
            await c.completions.create(model="policy", prompt="late")

    with pytest.raises(openai.NotFoundError):
        asyncio.run(after())


def test_vllm_engine_serves_and_records_its_sampled_logprobs(model_dir, tokenizer):
    """The endpoint over vLLM (CPU build, one process, eager): concurrent episodes of two chat turns, the
    recorded ids and log-probs exactly those vLLM sampled, and its prompt log-probs of them agree."""
    # no skip when vLLM fails to start: the project installs it, and a skip hid a broken constructor call once
    engine = RecordedVLLM(model_dir, EngineSpec(max_model_len=MAX_MODEL_LEN, kv_cache_mib=64))

    async def agent(base_url: str, row: dict) -> float:
        async with client(base_url) as c:
            messages = [{"role": "user", "content": row["q"]}]
            first = await c.chat.completions.create(model="policy", messages=messages)
            messages += [{"role": "assistant", "content": first.choices[0].message.content},
                         {"role": "user", "content": "and then?"}]
            second = await c.chat.completions.create(model="policy", messages=messages, max_tokens=6)
            return float(second.usage.completion_tokens)

    with AgentEndpoint(engine, tokenizer, SAMPLING, MAX_MODEL_LEN, gather_s=0.2) as endpoint:
        results = asyncio.run(run_agents(endpoint, agent, [{"q": f"q{i}"} for i in range(4)],
                                         [0, 1, 2, 3], 60))
    assert all(r.ok for r in results), results
    assert engine.most_running == 1 and len(engine.batches) < 8  # turns of the episodes shared engine calls
    calls = [c for r in results for c in r.calls]
    assert len(calls) == 8 and all(len(r.calls[1].completion_ids) <= 6 for r in results)
    for call in calls:
        sampled = engine.generation_of(call.prompt_ids)
        assert call.completion_ids == sampled.response_ids[: len(call.completion_ids)]
        assert call.logprobs == sampled.logprobs[: len(call.logprobs)]
    scored = engine.score([c.prompt_ids + c.completion_ids for c in calls],
                          [len(c.prompt_ids) for c in calls])
    assert max(abs(a - b) for c, s in zip(calls, scored, strict=True)
               for a, b in zip(c.logprobs, s, strict=True)) < 1e-4
    assert any(tokenizer.encode(tokenizer.decode(c.completion_ids, skip_special_tokens=True),
                                add_special_tokens=False) != c.completion_ids for c in calls)
