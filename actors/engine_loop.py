"""In-flight weight updates (``rollout.in_flight_updates``): vLLM's engine stepped by one thread of the
rollout actor, so that a new policy version loads between two decoding steps while requests are in flight.

Why a loop of our own: vLLM's offline ``LLM.generate`` steps every unfinished request until all are done, so
a weight load, a probe or an evaluation issued meanwhile would wait for the whole batch; and ``AsyncLLM``'s
``pause_generation(mode="keep")`` needs the engine in a process of its own, which costs the actor its 2-5 s
starts and the direct tensor hand-over. Here the one thread that owns ``llm.llm_engine`` adds requests from
any caller (generation, the probe's scoring, an evaluation), runs ``step()``, hands each finished request to
its caller, and applies queued weight loads between steps. Every sampled token is labelled with the version
in force at the step that sampled it.

At a load the requests in flight either keep their KV cache (``keep_kv``: a token sampled after the load is
computed from keys and values partly of the old weights; its behaviour log-prob is the engine's own, so the
correction stays right, and its version reads "sampled after version v loaded"), or stop and go on under the
new weights with their prefix prefilled again (``partial``: partial rollouts; each later token then is the
new version's exactly). A scoring request (the probe) in flight at a load is restarted whole in both modes,
so its log-probs are one version's. Prefix caching is off: vLLM refuses to reset it with requests running,
and a kept prefix would mix versions in the probe.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from vllm import SamplingParams, TokensPrompt

from actors.engines import Generation
from services.experience import FINISH_LENGTH, FINISH_STOP

if TYPE_CHECKING:
    from actors.engines import SamplingSettings, VLLMEngine


def continuation_seed(seed: int, sampled: int) -> int:
    """A partial rollout's seed once ``sampled`` tokens are in: reproducible, and not the first part's
    stream."""
    return (seed * 1_000_003 + sampled) % (2**31 - 1)


@dataclass
class Request:
    """One caller's request, from submission to its result; ``done`` is set when ``result`` (or ``error``)
    is."""

    kind: str  # "sample" or "score"
    prompt: list[int]
    max_tokens: int
    seed: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    ignore_eos: bool = False
    scored_from: int = 0  # score: the prompt's length; the tokens after it are scored
    ids: list[int] = field(default_factory=list)  # sampled so far (sample)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)  # each sampled token's version
    seen: int = 0  # tokens of the current vLLM request already taken (a partial rollout restarts it)
    vllm_id: str = ""
    result: object = None
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)

    def wait(self):
        self.done.wait()
        if self.error is not None:
            raise self.error
        return self.result


class EngineLoop:
    """The engine's one stepping thread (``start()``; a test may call ``run_once`` itself instead)."""

    def __init__(self, engine: VLLMEngine, mode: str) -> None:
        if mode not in ("keep_kv", "partial"):
            raise ValueError(f"in-flight mode {mode!r}: expected 'keep_kv' or 'partial'")
        self.engine, self.llm_engine, self.mode = engine, engine.llm.llm_engine, mode
        self.version = 0  # the version in force: every token sampled from here on is labelled with it
        self.cv = threading.Condition()
        self.inbox: list[Request] = []  # submitted, not yet added
        self.loads: list[tuple] = []  # (weights, version, Request) to apply between steps
        self.running: dict[str, Request] = {}
        self.next_id = 0
        self.loads_in_flight = 0  # loads applied with a sampling request running
        self.busy_seconds = 0.0  # in steps and loads: the engine's time, whatever number of calls wait on it
        # the engine's error that ended the loop: every later call raises it
        self.failed: BaseException | None = None
        self.thread: threading.Thread | None = None

    def start(self) -> None:
        self.thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self.thread.start()

    # ------------------------------------------------------------------ callers (any thread)

    def submit(self, request: Request) -> Request:
        with self.cv:
            self._check_alive()
            self.inbox.append(request)
            self.cv.notify()
        return request

    def _check_alive(self) -> None:
        if self.failed is not None:
            raise RuntimeError(f"the rollout engine failed earlier: {self.failed!r}") from self.failed

    def load(self, weights: dict, version: int) -> list[str]:
        """New weights between two steps, labelled ``version``; returns the parameters not loaded."""
        marker = Request("load", [], 0)
        with self.cv:
            self._check_alive()
            self.loads.append((weights, version, marker))
            self.cv.notify()
        return marker.wait()

    # ------------------------------------------------------------------ the loop (one thread)

    def _run(self) -> None:
        while True:
            with self.cv:
                while not (self.inbox or self.loads or self.running):
                    self.cv.wait()
            try:
                self.run_once()
            except BaseException as err:  # noqa: BLE001 - the engine is gone: no caller may wait on it
                with self.cv:
                    self.failed = err
                    waiting = self.inbox + [marker for *_, marker in self.loads]
                    self.inbox, self.loads = [], []
                for request in waiting:
                    request.error = err
                    request.done.set()
                return

    def run_once(self) -> None:
        """Apply the queued loads, add the submitted requests, then one engine step if anything runs."""
        start = time.perf_counter()
        with self.cv:
            loads, self.loads = self.loads, []
            new, self.inbox = self.inbox, []
        for weights, version, marker in loads:
            self._apply(weights, version, marker)
        for request in new:
            self._add(request)
        if self.running:
            self._step()
        self.busy_seconds += time.perf_counter() - start

    def _step(self) -> None:
        try:
            with self.engine.compile_stance():
                outputs = self.llm_engine.step()
        except BaseException as err:  # the engine failed: every caller hears it, none waits forever
            for request in self.running.values():
                request.error = err
                request.done.set()
            self.running.clear()
            raise
        for out in outputs:
            self._take(out)

    def _apply(self, weights: dict, version: int, marker: Request) -> None:
        restart = [r for r in self.running.values() if r.kind == "score" or self.mode == "partial"]
        if any(r.kind == "sample" for r in self.running.values()):
            self.loads_in_flight += 1
        if restart:
            self.llm_engine.abort_request([r.vllm_id for r in restart])
            for r in restart:
                del self.running[r.vllm_id]
        try:
            marker.result = self.engine.load_weights(weights, version)
        except BaseException as err:  # noqa: BLE001 - the load's caller raises it (the sync fails, naming it)
            marker.error = err
        self.version = version
        marker.done.set()
        for r in restart:  # under the new weights: a score whole, a partial rollout from its prefix
            self._add(r)

    def _add(self, r: Request) -> None:
        r.vllm_id, self.next_id = str(self.next_id), self.next_id + 1
        r.seen = 0
        if r.kind == "score":
            params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0)
            prompt = r.prompt
        else:
            sampled = len(r.ids)
            params = SamplingParams(temperature=r.temperature, top_p=r.top_p,
                                    max_tokens=r.max_tokens - sampled, logprobs=0, ignore_eos=r.ignore_eos,
                                    seed=r.seed if not sampled else continuation_seed(r.seed, sampled))
            prompt = r.prompt + r.ids
        try:
            self.llm_engine.add_request(r.vllm_id, TokensPrompt(prompt_token_ids=prompt), params)
        except BaseException as err:  # noqa: BLE001 - a request vLLM refuses fails its caller alone
            r.error = err
            r.done.set()
            return
        self.running[r.vllm_id] = r

    def _take(self, out) -> None:
        r = self.running.get(out.request_id)
        if r is None:  # aborted at a load, its last output already on the way
            return
        if r.kind == "sample":
            completion = out.outputs[0]
            ids = list(completion.token_ids)
            for step, token in zip(completion.logprobs[r.seen:], ids[r.seen:], strict=True):
                r.ids.append(token)
                r.logprobs.append(step[token].logprob)
                r.versions.append(self.version)
            r.seen = len(ids)
            if out.finished:
                reason = FINISH_LENGTH if completion.finish_reason == "length" else FINISH_STOP
                r.result = Generation(r.ids, r.logprobs, reason, r.versions)
        elif out.finished:
            r.result = [out.prompt_logprobs[i][r.prompt[i]].logprob
                        for i in range(r.scored_from, len(r.prompt))]
        if out.finished:
            del self.running[out.request_id]
            r.done.set()


class InFlightEngine:
    """The ``Engine`` of a rollout actor with in-flight updates: every call goes through one ``EngineLoop``,
    so it is safe from any thread of the actor and a load never waits for a generation."""

    def __init__(self, engine: VLLMEngine, mode: str, start: bool = True) -> None:
        self.inner = engine
        self.eos_id = engine.eos_id
        self.takes_adapters = False  # refused with in-flight updates (services/job_rules.py)
        self.loop = EngineLoop(engine, mode)
        if start:
            self.loop.start()

    def generate(self, prompts: list[list[int]], sampling: SamplingSettings, seeds: list[int],
                 max_new_tokens: list[int] | None = None) -> list[Generation]:
        caps = max_new_tokens or [sampling.max_new_tokens] * len(prompts)
        requests = [self.loop.submit(Request("sample", list(p), min(cap, sampling.max_new_tokens), seed,
                                             sampling.temperature, sampling.top_p, sampling.ignore_eos))
                    for p, seed, cap in zip(prompts, seeds, caps, strict=True)]
        return [r.wait() for r in requests]

    def score(self, sequences: list[list[int]], prompt_lengths: list[int]) -> list[list[float]]:
        requests = [self.loop.submit(Request("score", list(sequence), 1, scored_from=length))
                    for sequence, length in zip(sequences, prompt_lengths, strict=True)]
        return [r.wait() for r in requests]

    def load_weights(self, weights: dict, version: int = 0) -> list[str]:
        return self.loop.load(weights, version)

    def load_adapter(self, *args) -> None:
        raise RuntimeError("in-flight updates load merged weights "
                           "(services/job_rules.py refuses adapter-only sync)")
