"""``learner.attention: auto`` chosen on given timings (never a timed assertion), the two timed forms the same
attention, and the setting reaching the learner's model."""

from __future__ import annotations

import json

import pytest
import torch

from services.attention_choice import EAGER_MIN_SPEEDUP, AttentionTiming, attention_ways, choose
from services.config import load_config


def test_eager_only_where_it_is_at_least_the_margin_faster():
    assert choose(AttentionTiming(0.03, 0.01, 26, 77)) == "eager"  # bf16, short sequences
    assert choose(AttentionTiming(EAGER_MIN_SPEEDUP, 1.0, 26, 77)) == "eager"
    assert choose(AttentionTiming(1.1, 1.0, 26, 77)) == "sdpa"  # faster, within a timing's noise
    assert choose(AttentionTiming(0.2, 0.5, 2, 1024)) == "sdpa"  # long sequences
    assert AttentionTiming(0.033, 0.015, 26, 77).describe() == (
        "one layer's attention over 26 x 77 tokens, forward and backward: sdpa 33 ms, eager 15 ms (2.20x)")


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("shape", [(4, 4, 8), (6, 2, 8)])  # multi-head, grouped-query
def test_the_timed_forms_are_one_attention_with_the_same_gradient(shape, packed):
    """What the choice times compares like with like: in float32 both give the same output and gradients,
    padded rows (some keys masked) and packed ones (each sequence alone) alike."""
    outputs, grads = {}, {}
    ways, inputs = attention_ways(shape, "float32", 12, packed, rows=3)
    for name, attention in ways.items():
        out = attention()
        weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
        outputs[name], grads[name] = out, torch.autograd.grad((out * weights).sum(), inputs)
    torch.testing.assert_close(outputs["eager"], outputs["sdpa"], rtol=1e-5, atol=1e-5)
    for eager, sdpa in zip(grads["eager"], grads["sdpa"], strict=True):
        torch.testing.assert_close(eager, sdpa, rtol=1e-4, atol=1e-5)


def model_dir(tmp_path, hidden=576, heads=9, kv_heads=3, inner=1536, vocab=49152):
    (tmp_path / "config.json").write_text(json.dumps({
        "hidden_size": hidden, "intermediate_size": inner, "vocab_size": vocab, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads}))
    return str(tmp_path)


@pytest.mark.parametrize("timing, chosen", [((0.033, 0.015), "eager"), ((0.2, 0.5), "sdpa")])
def test_the_plan_resolves_auto_from_the_timing_and_says_the_figures(tmp_path, monkeypatch, timing, chosen):
    from learner import plan as plan_module
    from services import attention_choice

    timed = []

    def given(shape, dtype, length, threads, packed, rounds=5):
        timed.append((shape, dtype, length, threads, packed))
        return AttentionTiming(*timing, 26, length)

    monkeypatch.setattr(attention_choice, "time_attention", given)
    cfg = load_config(None, {"task": {"name": "smollm2-sentiment"}, "learner": {"dtype": "bfloat16"}})
    lines = []
    plan_module.choose_learner_attention(cfg, model_dir(tmp_path), 77, 2, lines.append)
    assert cfg.learner.attention == chosen and timed == [((9, 3, 64), "bfloat16", 77, 2, False)]
    assert "attention" not in cfg.learner.model_fields_set  # followed: a dumped config records the choice
    figures = AttentionTiming(*timing, 26, 77).describe()
    assert lines == [f"learner.attention auto: {chosen} ({figures} at bfloat16; eager only at >= 1.2x)"]
    packed = load_config(None, {"learner": {"dtype": "bfloat16", "max_tokens_per_microbatch": 512}})
    plan_module.choose_learner_attention(packed, model_dir(tmp_path), 512, 2, lines.append)
    assert timed[-1] == ((9, 3, 64), "bfloat16", 512, 2, True)


def test_auto_without_a_timing_on_a_gpu_and_a_tiny_model(tmp_path, monkeypatch):
    from learner import plan as plan_module
    from services import attention_choice

    monkeypatch.setattr(attention_choice, "time_attention", lambda *a, **k: pytest.fail("timed"))
    tiny = model_dir(tmp_path, hidden=64, heads=4, kv_heads=4, inner=256, vocab=30)
    for overrides, why in [({"cluster": {"learner": {"num_gpus": 1}}}, "the learner on a GPU"),
                           ({}, "MFLOP, too small to time")]:
        cfg, lines = load_config(None, overrides), []
        plan_module.choose_learner_attention(cfg, tiny, 40, None, lines.append)
        assert cfg.learner.attention == "sdpa" and why in lines[0], (overrides, lines)


def test_the_learner_s_model_takes_the_attention_and_scores_the_same(tiny_model_dir):
    """``learner.attention`` eager reaches the policy the engine trains, and its log-probs on padded rows are
    sdpa's (float32)."""
    from learner.engine import build_policy
    from services.config import LearnerConfig
    from services.experience import make_batch, response_forward

    batch = make_batch([[3, 4, 5], [6]], [[7, 8], [9, 10]], [[0.0, 0.0]] * 2, [0, 0], [0, 1], 0, 0, 0.0)
    logprobs = {}
    for attention in ("sdpa", "eager"):
        policy = build_policy(tiny_model_dir, LearnerConfig(attention=attention), False, seed=0)
        assert policy.lm.config._attn_implementation == attention
        with torch.no_grad():
            logprobs[attention] = response_forward(policy.lm, batch)[0]
    torch.testing.assert_close(logprobs["eager"], logprobs["sdpa"], rtol=0, atol=1e-5)
