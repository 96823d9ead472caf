"""rollout.in_flight_updates: a new version loads between two of vLLM's decoding steps with requests in flight
(actors/engine_loop.py). The loop is stepped by the test itself (``run_once``), so the load lands at a known
step: each token keeps the version it was sampled under; under ``partial`` the tokens after the load are the
new weights' exactly; a score in flight is restarted whole; the batch is stamped with each row's oldest
token."""

from __future__ import annotations

import threading

import pytest
import torch

from actors.engine_loop import InFlightEngine, Request
from actors.engines import VLLMEngine
from actors.specs import EngineSpec


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return VLLMEngine(tiny_model_dir, EngineSpec(max_model_len=32, kv_cache_mib=64, in_flight="keep_kv"))


@pytest.fixture(scope="module")
def weights(tiny_model_dir):
    """(the model's weights, other weights 0.05 away)."""
    from transformers import AutoModelForCausalLM

    state = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    g = torch.Generator().manual_seed(0)
    moved = {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in state.items()}
    return state, moved


def until_done(loop, requests: list[Request]) -> None:
    while not all(r.done.is_set() for r in requests):
        loop.run_once()


def load_after(loop, steps: int, weights: dict, version: int) -> list[str]:
    """Run ``steps`` steps, then queue a load (from another thread, as the actor's update call does) and
    step until it is applied; returns what it did not load."""
    for _ in range(steps):
        loop.run_once()
    missing: list = []
    caller = threading.Thread(target=lambda: missing.extend(loop.load(weights, version)))
    caller.start()
    while caller.is_alive():
        loop.run_once()
    caller.join()
    return missing


def score(loop, sequence: list[int], prompt_length: int) -> list[float]:
    request = loop.submit(Request("score", sequence, 1, scored_from=prompt_length))
    until_done(loop, [request])
    return request.result


@pytest.mark.parametrize("mode", ["keep_kv", "partial"])
def test_a_load_between_steps_labels_each_token_with_its_version(engine, weights, mode):
    old, new = weights
    loop = InFlightEngine(engine, mode, start=False).loop
    try:
        prompts = [[1, 2, 3], [4, 5, 6, 7], [2, 9, 4]]
        requests = [loop.submit(Request("sample", p, 16, seed=7 + i)) for i, p in enumerate(prompts)]
        assert load_after(loop, 3, new, 1) == []
        until_done(loop, requests)
        assert loop.loads_in_flight == 1
        spanning = [r for r in requests if r.result.versions[-1] == 1]
        assert spanning, [r.result.versions for r in requests]  # some response went on past the load
        for r in requests:
            g = r.result
            assert len(g.versions) == len(g.response_ids) == len(g.logprobs)
            assert g.versions == sorted(g.versions) and set(g.versions) <= {0, 1}
            assert g.versions[:3] == [0] * min(3, len(g.versions))  # the three steps before the load
        # the new weights' own log-probs of each finished sequence (the engine holds them now)
        for r in spanning:
            g = r.result
            scored = score(loop, r.prompt + g.response_ids, len(r.prompt))
            after = [i for i, v in enumerate(g.versions) if v == 1]
            if mode == "partial":  # prefilled again under the new weights: exactly theirs
                assert [g.logprobs[i] for i in after] == pytest.approx([scored[i] for i in after], abs=1e-4)
            else:
                # the old weights' keys and values stay: the engine's log-prob is the mix's, not the new
                # model's
                assert max(abs(g.logprobs[i] - scored[i]) for i in after) > 1e-3
        # before the load, the old weights' log-probs (scored after loading them back)
        assert load_after(loop, 0, old, 2) == []
        for r in requests:
            g = r.result
            before = [i for i, v in enumerate(g.versions) if v == 0]
            scored = score(loop, r.prompt + g.response_ids, len(r.prompt))
            assert [g.logprobs[i] for i in before] == pytest.approx([scored[i] for i in before], abs=1e-4)
    finally:
        load_after(loop, 0, old, 0)


def test_a_score_in_flight_at_a_load_is_one_versions(engine, weights):
    """A probe's scoring request queued with the load is scored whole by the new weights; a partial rollout
    continues with a seed of its own, reproducibly."""
    old, new = weights
    loop = InFlightEngine(engine, "partial", start=False).loop
    try:
        sequence = [1, 2, 3, 4, 5, 6, 7, 8]
        by_old = score(loop, sequence, 2)
        request = loop.submit(Request("score", sequence, 1, scored_from=2))
        assert load_after(loop, 0, new, 1) == []
        until_done(loop, [request])
        assert request.result == pytest.approx(score(loop, sequence, 2), abs=1e-5)
        assert request.result != pytest.approx(by_old, abs=1e-3)

        def sampled() -> list[int]:
            load_after(loop, 0, new, 1)
            r = loop.submit(Request("sample", [1, 2, 3], 16, seed=3))
            load_after(loop, 2, old, 2)
            until_done(loop, [r])
            return r.result.response_ids

        assert sampled() == sampled()
    finally:
        load_after(loop, 0, old, 0)


def test_a_row_is_stamped_with_its_oldest_token():
    """make_batch: a row's version is its oldest sampled token's (the environment's tokens, -1, do not count);
    the learner's staleness bound is then its oldest token's."""
    from learner.records import Admission
    from services.experience import make_batch

    batch = make_batch([[1], [2], [3]], [[5, 6, 7], [5, 6], []], [[0.0] * 3, [0.0] * 2, []],
                       [0, 0, 0], [0, 1, 2], 22, 4, 0.05, 4, token_versions=[[2, 3, -1], [3, 3], []])
    assert batch.policy_version.tolist() == [2, 3, 4]
    assert batch.token_version.tolist() == [[2, 3, -1, -1], [3, 3, -1, -1], [-1] * 4]
    assert Admission(4, None, 1).refuses(batch.policy_version, batch.kl_coef).tolist() == [True, False, False]


def test_a_request_the_engine_refuses_fails_its_caller_alone(engine):
    """A prompt longer than the engine's max_model_len is refused when it is added: its caller gets vLLM's
    error, the request beside it is generated."""
    loop = InFlightEngine(engine, "keep_kv", start=False).loop
    refused = loop.submit(Request("sample", [1] * 40, 4, seed=1))
    kept = loop.submit(Request("sample", [1, 2, 3], 4, seed=1))
    until_done(loop, [refused, kept])
    with pytest.raises(Exception, match="(?i)length|long|max_model_len"):
        refused.wait()
    assert 1 <= len(kept.wait().response_ids) <= 4


def test_ignore_eos_samples_past_eos_as_the_same_draws_in_both_paths(engine):
    """rollout.ignore_eos (benchmarks at equal lengths): every response runs to its cap, and up to its first
    EOS it is the response the same seed gives without the setting: EOS sampled and kept, the distribution
    unchanged. The same through the engine's call and through the stepped loop."""
    from actors.engines import SamplingSettings
    from services.experience import FINISH_LENGTH

    prompts, seeds = [[1, 2, 3], [4, 5, 6, 7], [2, 9, 4], [3, 1], [5, 5, 2], [7, 2, 8]], list(range(11, 17))
    ended = engine.generate(prompts, SamplingSettings(max_new_tokens=16), seeds)
    assert any(g.response_ids[-1] == engine.eos_id for g in ended), "none ended: the test would show nothing"
    loop = InFlightEngine(engine, "keep_kv", start=False).loop
    stepped = [loop.submit(Request("sample", p, 16, seed=s, ignore_eos=True))
               for p, s in zip(prompts, seeds, strict=True)]
    until_done(loop, stepped)
    for through in (engine.generate(prompts, SamplingSettings(max_new_tokens=16, ignore_eos=True), seeds),
                    [r.result for r in stepped]):
        for short, full in zip(ended, through, strict=True):
            assert len(full.response_ids) == 16 and full.finish_reason == FINISH_LENGTH
            assert full.response_ids[:len(short.response_ids)] == short.response_ids
    assert any(engine.eos_id in g.response_ids[:-1] for g in through)  # sampled past an EOS
