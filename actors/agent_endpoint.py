"""An OpenAI-compatible endpoint served from a rollout engine, so any agent program can be trained.

``rollout.agent: package.module:function`` names ``async def agent(base_url: str, row: dict) -> float``. It
runs an agent however it likes with ``openai.AsyncOpenAI(base_url=base_url, api_key="tether")`` (chat
completions, tool calls, several model calls) and returns the episode's reward. ``AgentEndpoint`` serves
that API from the engine in a background thread and records, per episode, every prompt id the engine was
given and every token id and log-prob it sampled: token-in/token-out, nothing the
learner trains on is text re-encoded. ``run_agents`` runs one agent per row with a deadline each;
``merge_calls`` turns an episode's calls into trajectories.

Routes, per episode (``base_url(key)``): ``POST /episodes/{key}/v1/chat/completions``,
``POST /episodes/{key}/v1/completions``, ``GET /episodes/{key}/v1/models``. A call may not change the
job's sampling distribution (temperature, top_p, penalties, stop strings, constrained output): the learner
scores exactly that distribution, so such a call is refused with 400. A request's own ``seed`` is ignored:
each call's seed comes from its episode's seed and the call's index in the episode. Requests that arrive
together are one engine call.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import math
import numbers
import re
import socket
import threading
import time
import uuid
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import suppress
from dataclasses import dataclass, field
from typing import Self

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from actors.engines import Engine, SamplingSettings
from services.errors import TetherError, load_object

log = logging.getLogger(__name__)

# agent(base_url, row) -> reward
AgentFn = Callable[[str, dict], Awaitable[float]]

_KEY = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")
_TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
# request fields that would change the distribution sampled from, and the value that leaves it alone
_NEUTRAL = {"presence_penalty": (0,), "frequency_penalty": (0,), "repetition_penalty": (1,), "top_k": (-1, 0),
            "min_p": (0,), "min_tokens": (0,), "ignore_eos": (False,)}


@dataclass
class Call:
    """One model call of an episode, as the engine saw it."""

    prompt_ids: list[int]  # exactly what the engine was given
    completion_ids: list[int]  # what it sampled, up to and including EOS
    logprobs: list[float]  # the sampled tokens' log-probs (after temperature)
    finish_reason: int  # FINISH_STOP or FINISH_LENGTH
    versions: list[int] | None = None  # in-flight updates: each sampled token's version


@dataclass
class Trajectory:
    """Consecutive calls of an episode as one token sequence after the prompt."""

    prompt_ids: list[int]
    ids: list[int]  # the model's and the environment's tokens, in the order they happened
    action_mask: list[int]  # 1 where the model sampled the token, 0 on the environment's
    logprobs: list[float]  # the sampled log-prob where action_mask is 1, else 0
    finish_reason: int  # the last call's
    calls: int = 1  # the model calls merged into it
    # each model token's version (in-flight updates), else -1
    versions: list[int] = field(default_factory=list)


@dataclass
class EpisodeResult:
    """What one agent episode gave: a finite reward, or the failure that replaced it; its calls either way."""

    key: str
    reward: float | None
    error: str | None
    calls: list[Call] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass
class _Episode:
    base_seed: int
    next_call: int = 0
    calls: dict[int, Call] = field(default_factory=dict)  # by call index: the order the calls arrived in


@dataclass
class _Pending:
    prompt_ids: list[int]
    max_tokens: int
    seed: int
    future: asyncio.Future


class RequestError(TetherError):
    """A request the endpoint refuses: answered with ``status`` and OpenAI's error JSON."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


def episode_base_seed(seed: int) -> int:
    """The well-mixed start of an episode's call seeds: episodes with consecutive seeds share no call seed."""
    import numpy as np

    return int(np.random.SeedSequence(seed).generate_state(1)[0]) & 0x7FFFFFFF


def call_seed(base_seed: int, call_index: int) -> int:
    """The engine seed of call ``call_index`` of an episode: reproducible, and distinct within the episode."""
    return (base_seed + call_index) & 0x7FFFFFFF


class AgentEndpoint:
    """OpenAI's chat completions and completions over one engine, on 127.0.0.1 and a free port.

    The server runs in its own thread with its own event loop, so agents may run in any loop of any other
    thread (``asyncio.run(run_agents(...))`` in the caller's). One batcher takes every request queued and
    generates them in one engine call, in one worker thread: the engine is never called concurrently. The
    engine must not be used elsewhere while episodes run (the rollout actor's methods run one at a time).
    """

    model_name = "tether"  # the model's name in the answers; agents may ask for any

    def __init__(self, engine: Engine, tokenizer, sampling: SamplingSettings, max_model_len: int, *,
                 gather_s: float = 0.01) -> None:
        if sampling.max_new_tokens < 1 or max_model_len < 2:
            raise ValueError("need max_new_tokens >= 1 and max_model_len >= 2, got "
                             f"{sampling.max_new_tokens}, {max_model_len}")
        self.engine, self.tokenizer, self.sampling = engine, tokenizer, sampling
        self.max_model_len = max_model_len
        # how long the batcher waits, after a first request, for the others of a batch
        self.gather_s = gather_s
        self.vocab_size = len(tokenizer)  # token ids a prompt may hold
        self.port: int | None = None
        self._episodes: dict[str, _Episode] = {}
        self._lock = threading.Lock()  # episodes: registered and taken by the caller, filled by the server
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="agent-endpoint-engine")
        self._server = None
        self._thread: threading.Thread | None = None
        self._queue: asyncio.Queue[_Pending] | None = None

    # ----------------------------------------------------------------------------------------- lifecycle

    def start(self) -> Self:
        """Start serving (returns when the server listens)."""
        if self._thread is not None:
            return self
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(self._app(), lifespan="off", log_config=None, access_log=False, ws="none",
                                server_header=False, date_header=False, timeout_keep_alive=30,
                                timeout_graceful_shutdown=5)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=asyncio.run, args=(self._serve(sock),), daemon=True,
                                        name=f"agent-endpoint:{self.port}")
        self._thread.start()
        while not self._server.started and self._thread.is_alive():
            self._thread.join(0.02)
        if not self._server.started:
            sock.close()
            raise RuntimeError(f"the agent endpoint on 127.0.0.1:{self.port} did not start "
                               "(see the log above)")
        return self

    async def _serve(self, sock: socket.socket) -> None:
        self._queue = asyncio.Queue()
        batcher = asyncio.create_task(self._batcher())
        try:
            await self._server.serve(sockets=[sock])
        finally:
            batcher.cancel()
            with suppress(asyncio.CancelledError):
                await batcher
            sock.close()

    def close(self) -> None:
        """Stop the server, join its thread and the engine's worker."""
        if self._thread is not None:
            self._server.should_exit = True
            self._thread.join(timeout=30)
            self._thread = None
        self._executor.shutdown(wait=True)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def base_url(self, key: str) -> str:
        """The OpenAI base URL of episode ``key``."""
        if self.port is None:
            raise RuntimeError("the agent endpoint is not started")
        return f"http://127.0.0.1:{self.port}/episodes/{key}/v1"

    # ------------------------------------------------------------------------------------------ episodes

    def register(self, key: str, seed: int) -> None:
        """Open episode ``key``; its calls are seeded from ``seed`` and the call's index in the episode."""
        if not isinstance(key, str) or not _KEY.fullmatch(key):
            raise ValueError(f"episode key must be 1-128 characters of [A-Za-z0-9_.-] (it is a URL segment), "
                             f"got {key!r}")
        if not isinstance(seed, int) or seed < 0:
            raise ValueError(f"episode seed must be an integer >= 0, got {seed!r}")
        with self._lock:
            if key in self._episodes:
                raise ValueError(f"episode {key!r} is already registered")
            self._episodes[key] = _Episode(episode_base_seed(seed))

    def take_calls(self, key: str) -> list[Call]:
        """The episode's recorded calls in the order they arrived; the episode ends (later calls get 404)."""
        with self._lock:
            episode = self._episodes.pop(key)
        return [episode.calls[i] for i in sorted(episode.calls)]

    def _episode(self, key: str) -> _Episode:
        """Call under the lock."""
        episode = self._episodes.get(key)
        if episode is None:
            raise RequestError(404, f"unknown episode {key!r}: not registered, or already ended")
        return episode

    def _require(self, key: str) -> None:
        with self._lock:
            self._episode(key)

    def _reserve_call(self, key: str) -> tuple[int, int]:
        with self._lock:
            episode = self._episode(key)
            index = episode.next_call
            episode.next_call += 1
        return index, call_seed(episode.base_seed, index)

    def _record(self, key: str, index: int, call: Call) -> None:
        with self._lock:
            episode = self._episodes.get(key)
            if episode is not None:  # an episode taken meanwhile (its agent timed out) records nothing more
                episode.calls[index] = call

    # ------------------------------------------------------------------------------------------ engine

    async def _generate(self, key: str, prompt_ids: list[int], max_tokens: int) -> Call:
        """One call of episode ``key``: queued for the batcher, recorded once generated."""
        index, seed = self._reserve_call(key)
        future = asyncio.get_running_loop().create_future()
        self._queue.put_nowait(_Pending(prompt_ids, max_tokens, seed, future))
        try:
            generation = await future
        except Exception as e:
            log.exception("agent endpoint: the engine failed")
            raise RequestError(500, f"the engine failed: {type(e).__name__}: {e}") from e
        call = Call(prompt_ids, generation.response_ids, generation.logprobs, generation.finish_reason,
                    generation.versions)
        self._record(key, index, call)
        return call

    async def _batcher(self) -> None:
        """Everything queued, one engine call at a time, in the engine's worker thread."""
        loop = asyncio.get_running_loop()
        while True:
            batch = [await self._queue.get()]
            if self.gather_s > 0:
                await asyncio.sleep(self.gather_s)
            while not self._queue.empty():
                batch.append(self._queue.get_nowait())
            try:
                generations = await loop.run_in_executor(self._executor, self.engine.generate,
                                                         [p.prompt_ids for p in batch], self.sampling,
                                                         [p.seed for p in batch],
                                                         [p.max_tokens for p in batch])
                if len(generations) != len(batch):
                    raise RuntimeError(f"the engine returned {len(generations)} generations for {len(batch)} "
                                       "prompts")
            except Exception as e:  # noqa: BLE001 - each request of the batch answers it as a 500
                for p in batch:
                    if not p.future.done():
                        p.future.set_exception(e)
                continue
            for p, generation in zip(batch, generations, strict=True):
                if not p.future.done():  # a request whose client went away
                    p.future.set_result(generation)

    # ------------------------------------------------------------------------------------------ requests

    def _check_request(self, body: dict, prompt_ids: list[int]) -> int:
        """The request's max_tokens, once its sampling and its length are the job's to give."""
        for name, job in (("temperature", self.sampling.temperature), ("top_p", self.sampling.top_p)):
            value = body.get(name)
            if value is not None and not (_is_number(value) and math.isclose(value, job, rel_tol=1e-6)):
                raise RequestError(400, f"{name}={value!r} is not the job's {name}={job}: the learner "
                                        f"trains on the job's sampling distribution (leave {name} out, or "
                                        f"send {job})", name)
        for name, neutral in _NEUTRAL.items():
            value = body.get(name)
            if value is not None and value not in neutral:
                raise RequestError(400, f"{name}={value!r} would change the job's sampling distribution; "
                                        f"only {' or '.join(map(str, neutral))} (or leaving it out)", name)
        if body.get("logit_bias"):
            raise RequestError(400, "logit_bias would change the job's sampling distribution", "logit_bias")
        for name in ("n", "best_of"):
            if body.get(name) not in (None, 1):
                raise RequestError(400, f"{name}={body[name]!r}: one completion per call "
                                        "(make several calls)", name)
        if body.get("stop") or body.get("stop_token_ids"):
            raise RequestError(400, "stop strings are not supported: a turn ends at the model's EOS", "stop")
        if (body.get("response_format") or {}).get("type", "text") != "text":
            raise RequestError(400, "response_format needs constrained decoding, which would change the "
                                    "job's sampling distribution; only 'text'", "response_format")
        if body.get("stream"):
            raise RequestError(400, "streaming is not supported", "stream")
        if not prompt_ids:
            raise RequestError(400, "the prompt is empty")
        requested = body.get("max_completion_tokens", body.get("max_tokens"))
        if requested is not None and not (isinstance(requested, int) and not isinstance(requested, bool)
                                          and requested >= 1):
            raise RequestError(400, f"max_tokens must be an integer >= 1, got {requested!r}", "max_tokens")
        max_tokens = self.sampling.max_new_tokens if requested is None else min(requested,
                                                                                 self.sampling.max_new_tokens)
        if len(prompt_ids) + max_tokens > self.max_model_len:
            raise RequestError(400, f"the prompt ({len(prompt_ids)} tokens) plus max_tokens ({max_tokens}) "
                                    f"is longer than the model's max_model_len ({self.max_model_len})",
                                    "max_tokens")
        return max_tokens

    def _chat_prompt(self, body: dict) -> list[int]:
        messages, tools = body.get("messages"), body.get("tools") or None
        if not isinstance(messages, list) or not messages:
            raise RequestError(400, "messages must be a non-empty list", "messages")
        if tools is not None and not isinstance(tools, list):
            raise RequestError(400, "tools must be a list", "tools")
        tool_choice = body.get("tool_choice")
        if tool_choice not in (None, "auto", "none"):
            raise RequestError(400, f"tool_choice={tool_choice!r} needs constrained decoding, which would "
                                    "change the job's sampling distribution; only 'auto' or 'none'",
                                    "tool_choice")
        try:
            rendered = self.tokenizer.apply_chat_template([_template_message(m) for m in messages],
                                                          tools=tools, add_generation_prompt=True,
                                                          tokenize=True)
        except RequestError:
            raise
        except Exception as e:  # the template's own error names what it cannot render
            raise RequestError(400, "the chat template cannot render these messages: "
                                    f"{type(e).__name__}: {e}", "messages") from e
        # transformers 5: a BatchEncoding
        ids = rendered["input_ids"] if hasattr(rendered, "keys") else rendered
        return list(ids[0] if ids and isinstance(ids[0], list) else ids)

    def _completion_prompt(self, body: dict) -> list[int]:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, add_special_tokens=False)
        if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            if any(not 0 <= t < self.vocab_size for t in prompt):
                raise RequestError(400, f"prompt token ids must lie in [0, {self.vocab_size})", "prompt")
            return list(prompt)
        raise RequestError(400, "prompt must be a string or a list of token ids (one prompt per call)",
                           "prompt")

    def _app(self):
        # here: tensordict is the actor's to load, not the driver's
        from services.experience import FINISH_LENGTH

        app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)

        @app.exception_handler(RequestError)
        async def refused(request: Request, e: RequestError) -> JSONResponse:
            kind = {400: "invalid_request_error", 404: "not_found_error"}.get(e.status, "server_error")
            return JSONResponse({"error": {"message": e.message, "type": kind, "param": e.param,
                                           "code": None}},
                                status_code=e.status)

        async def json_body(request: Request) -> dict:
            try:
                body = await request.json()
            except ValueError:
                raise RequestError(400, "the body is not JSON") from None
            if not isinstance(body, dict):
                raise RequestError(400, "the body must be a JSON object")
            return body

        def answer(kind: str, body: dict, call: Call, choice: dict) -> dict:
            return {
                "id": f"{kind}-{uuid.uuid4().hex}",
                "object": "chat.completion" if kind == "chatcmpl" else "text_completion",
                "created": int(time.time()),
                "model": body.get("model") if isinstance(body.get("model"), str) else self.model_name,
                "choices": [{"index": 0, "logprobs": None, **choice}],
                "usage": {"prompt_tokens": len(call.prompt_ids),
                          "completion_tokens": len(call.completion_ids),
                          "total_tokens": len(call.prompt_ids) + len(call.completion_ids)},
            }

        @app.get("/episodes/{key}/v1/models")
        async def models(key: str) -> dict:
            self._require(key)
            return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": 0,
                                                "owned_by": "tether", "max_model_len": self.max_model_len}]}

        @app.post("/episodes/{key}/v1/chat/completions")
        async def chat_completions(key: str, request: Request) -> dict:
            self._require(key)
            body = await json_body(request)
            prompt_ids = self._chat_prompt(body)
            call = await self._generate(key, prompt_ids, self._check_request(body, prompt_ids))
            content, tool_calls = parse_tool_calls(self.tokenizer.decode(call.completion_ids,
                                                                         skip_special_tokens=True))
            message = {"role": "assistant", "content": content}
            if tool_calls:
                message["tool_calls"] = tool_calls
            finish = ("length" if call.finish_reason == FINISH_LENGTH
                      else "tool_calls" if tool_calls else "stop")
            return answer("chatcmpl", body, call, {"message": message, "finish_reason": finish})

        @app.post("/episodes/{key}/v1/completions")
        async def completions(key: str, request: Request) -> dict:
            self._require(key)
            body = await json_body(request)
            if body.get("echo") or body.get("suffix"):
                raise RequestError(400, "echo and suffix are not supported")
            prompt_ids = self._completion_prompt(body)
            call = await self._generate(key, prompt_ids, self._check_request(body, prompt_ids))
            text = self.tokenizer.decode(call.completion_ids, skip_special_tokens=True)
            finish = "length" if call.finish_reason == FINISH_LENGTH else "stop"
            return answer("cmpl", body, call, {"text": text, "finish_reason": finish})

        return app


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _template_message(message) -> dict:
    """An OpenAI message as chat templates read it: text content, tool-call arguments as a dict."""
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise RequestError(400, f"each message must be an object with a role, got {message!r:.200}",
                           "messages")
    message = dict(message)
    content = message.get("content")
    if isinstance(content, list):  # OpenAI's content parts: only text ones here
        if any(not isinstance(p, dict) or p.get("type") != "text" for p in content):
            raise RequestError(400, "only text content parts are supported", "messages")
        message["content"] = "".join(p.get("text", "") for p in content)
    elif content is None:
        message["content"] = ""
    if message.get("tool_calls"):
        # Hugging Face chat templates take arguments as a dict; OpenAI sends them as a JSON string
        calls = []
        for c in message["tool_calls"]:
            function = dict(c.get("function") or {}) if isinstance(c, dict) else {}
            arguments = function.get("arguments")
            if isinstance(arguments, str):
                with suppress(ValueError):
                    function["arguments"] = json.loads(arguments)
            calls.append({**c, "function": function} if isinstance(c, dict) else c)
        message["tool_calls"] = calls
    return message


def parse_tool_calls(text: str) -> tuple[str | None, list[dict]]:
    """(content, tool_calls) of a completion: ``<tool_call>{"name": ..., "arguments": ...}</tool_call>``
    blocks (Hermes, Qwen) become OpenAI tool calls, the text outside them the content. A block whose JSON
    does not parse, or names no function, stays in the content as it was."""
    calls, outside, last = [], [], 0
    for match in _TOOL_CALL.finditer(text):
        try:
            parsed = json.loads(match.group(1))
        except ValueError:
            continue
        if not isinstance(parsed, dict) or not isinstance(parsed.get("name"), str):
            continue
        arguments = parsed.get("arguments", {})
        calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                      "function": {"name": parsed["name"],
                                   "arguments": (arguments if isinstance(arguments, str)
                                                 else json.dumps(arguments))}})
        outside.append(text[last:match.start()])
        last = match.end()
    if not calls:
        return text, []
    content = ("".join(outside) + text[last:]).strip()
    return content or None, calls


# ------------------------------------------------------------------------------------------------ agents


def load_agent(spec: str) -> AgentFn:
    """The async function ``package.module:function`` names (``rollout.agent``)."""
    fn = load_object(spec, "rollout.agent", "package.module:function")
    if not inspect.iscoroutinefunction(fn):
        raise ValueError(f"rollout.agent {spec!r} must be an async function (async def agent(base_url, row))")
    return fn


async def run_agents(endpoint: AgentEndpoint, agent_fn: AgentFn, rows: list[dict], seeds: list[int],
                     timeout_s: float) -> list[EpisodeResult]:
    """One agent episode per row, all at once, each with its own episode and a deadline of ``timeout_s``.

    A failure (an exception, the deadline, a reward that is not a finite number) is that episode's result and
    never stops the others. Agents must not block the event loop: a blocked loop misses every deadline."""
    if len(rows) != len(seeds):
        raise ValueError(f"{len(rows)} rows but {len(seeds)} seeds")
    if not (_is_number(timeout_s) and timeout_s > 0):
        raise ValueError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")
    run = uuid.uuid4().hex[:12]
    keys = [f"{run}-{i}" for i in range(len(rows))]

    async def episode(key: str, row: dict, seed: int) -> EpisodeResult:
        endpoint.register(key, seed)
        reward, error = None, None
        deadline = asyncio.timeout(timeout_s)
        try:
            async with deadline:
                value = await agent_fn(endpoint.base_url(key), row)
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                error = f"returned {value!r:.200}, not a number"
            elif not math.isfinite(value):
                error = f"returned {value!r}, not a finite number"
            else:
                reward = float(value)
        except Exception as e:
            error = f"{type(e).__name__}: {e}"
            log.debug("agent episode %s failed", key, exc_info=True)
        finally:
            calls = endpoint.take_calls(key)
        if deadline.expired():  # also when the agent swallowed the cancellation
            reward, error = None, f"timed out after {timeout_s:g} s"
        return EpisodeResult(key, reward, error, calls)

    return list(await asyncio.gather(*(episode(k, r, s) for k, r, s in zip(keys, rows, seeds, strict=True))))


def merge_calls(calls: list[Call]) -> list[Trajectory]:
    """An episode's calls as trajectories: a call whose prompt extends the previous call's prompt and
    completion token for token continues its trajectory (the tokens between are the environment's:
    action_mask 0, log-prob 0); any other call starts a new one."""
    trajectories: list[Trajectory] = []
    for call in calls:
        last = trajectories[-1] if trajectories else None
        if last is not None:
            so_far = len(last.prompt_ids) + len(last.ids)
            if len(call.prompt_ids) >= so_far and call.prompt_ids[:so_far] == last.prompt_ids + last.ids:
                between = call.prompt_ids[so_far:]
                last.ids += between + call.completion_ids
                last.action_mask += [0] * len(between) + [1] * len(call.completion_ids)
                last.logprobs += [0.0] * len(between) + list(call.logprobs)
                last.versions += [-1] * len(between) + call_versions(call)
                last.finish_reason = call.finish_reason
                last.calls += 1
                continue
        trajectories.append(Trajectory(list(call.prompt_ids), list(call.completion_ids),
                                       [1] * len(call.completion_ids), list(call.logprobs),
                                       call.finish_reason, versions=call_versions(call)))
    return trajectories


def call_versions(call: Call) -> list[int]:
    return list(call.versions) if call.versions is not None else [-1] * len(call.completion_ids)
