"""RewardActor with kind="model": a tiny randomly initialised GPT-2 sequence classifier built locally,
scored in padded batches. Checks shape, batch/padding invariance, right padding, and that the score is
the classifier head at each sequence's last real token (against a manual forward of the unpadded text)."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import GPT2Config, GPT2ForSequenceClassification

from actors.reward import RewardActor
from actors.specs import RewardSpec
from services.models import build_char_tokenizer
from services.tasks import get_task

pytestmark = pytest.mark.timeout(120)

# (prompt, completion) pairs of different lengths, so a batch needs padding; one completion is empty
PAIRS = [("b", "cda"), ("bcdefg", ""), ("u", "tsrqponm"), ("ki", "ja"), ("e", "f")]


def make_reward_model(path, pad: str = "eos", seed: int = 0):
    """Save a tiny GPT2ForSequenceClassification (num_labels=1) and its char tokenizer to ``path``.

    pad="eos": tokenizer and config both pad with <|endoftext|> (the usual setup);
    pad="none": neither has a pad token (GPT-2 style);
    pad="mismatch": the config names a real letter as pad_token_id while the tokenizer pads with eos.
    """
    tokenizer = build_char_tokenizer(get_task("randomwalks").vocabulary)
    pad_token_id = {"eos": tokenizer.pad_token_id, "none": None,
                    "mismatch": tokenizer.convert_tokens_to_ids("c")}[pad]
    if pad == "none":
        tokenizer.pad_token = None
    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=len(tokenizer), n_layer=2, n_embd=32, n_head=2,
                        n_positions=64, num_labels=1, bos_token_id=tokenizer.eos_token_id,
                        eos_token_id=tokenizer.eos_token_id, pad_token_id=pad_token_id, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0)
    model = GPT2ForSequenceClassification(config).eval()
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return model, tokenizer


def manual_score(model, tokenizer, text: str) -> float:
    """The score head on the transformer's last hidden state of the unpadded text (no pooling logic)."""
    ids = torch.tensor([tokenizer(text)["input_ids"]])
    with torch.no_grad():
        hidden = model.transformer(input_ids=ids).last_hidden_state[0, -1]
        return float(model.score(hidden)[0])


@pytest.fixture(params=["eos", "none", "mismatch"])
def setup(request, tmp_path):
    model, tokenizer = make_reward_model(tmp_path, pad=request.param)
    actor = RewardActor(0,
                        RewardSpec("randomwalks", {}, str(tmp_path), kind="model", model_path=str(tmp_path)))
    return actor, model, tokenizer


def test_scores_have_one_float_per_sample(setup):
    actor, _, _ = setup
    prompts, completions = zip(*PAIRS, strict=True)
    scores = actor.scorer.reward_model(list(prompts), list(completions))
    assert len(scores) == len(PAIRS)
    assert all(isinstance(s, float) for s in scores)
    assert torch.tensor(scores).shape == (len(PAIRS),)
    assert len(set(scores)) > 1  # different texts, different scores (the model is not constant)


def test_batch_equals_one_at_a_time(setup):
    actor, _, _ = setup
    prompts, completions = zip(*PAIRS, strict=True)
    batched = actor.scorer.reward_model(list(prompts), list(completions))
    alone = [actor.scorer.reward_model([p], [c])[0] for p, c in PAIRS]
    assert batched == pytest.approx(alone, abs=1e-5)
    # order in the batch does not matter either
    reversed_scores = actor.scorer.reward_model(list(prompts[::-1]), list(completions[::-1]))
    assert reversed_scores[::-1] == pytest.approx(batched, abs=1e-5)


def test_score_is_taken_at_last_real_token(setup):
    actor, model, tokenizer = setup
    prompts, completions = zip(*PAIRS, strict=True)
    batched = actor.scorer.reward_model(list(prompts), list(completions))
    expected = [manual_score(model, tokenizer, p + c) for p, c in PAIRS]
    assert batched == pytest.approx(expected, abs=1e-5)


def test_batches_are_right_padded(setup):
    actor, _, _ = setup
    seen = {}

    def capture(_module, args, kwargs):
        seen.update(input_ids=kwargs["input_ids"].clone(), attention_mask=kwargs["attention_mask"].clone())

    handle = actor.scorer.reward_model.model.register_forward_pre_hook(capture, with_kwargs=True)
    try:
        prompts, completions = zip(*PAIRS, strict=True)
        actor.scorer.reward_model(list(prompts), list(completions))
    finally:
        handle.remove()
    mask = seen["attention_mask"]
    lengths = torch.tensor([len(p + c) for p, c in PAIRS])
    assert mask.shape == (len(PAIRS), int(lengths.max()))
    # every row: its real tokens first, then padding
    expected = (torch.arange(mask.shape[1])[None, :] < lengths[:, None]).long()
    assert torch.equal(mask.long(), expected)
    pad_id = actor.scorer.reward_model.tokenizer.pad_token_id
    assert pad_id is not None and actor.scorer.reward_model.model.config.pad_token_id == pad_id
    assert torch.all(seen["input_ids"][mask == 0] == pad_id)


def test_left_padding_tokenizer_is_still_right_padded(tmp_path):
    """A reward model saved with padding_side='left' is padded on the right all the same."""
    model, tokenizer = make_reward_model(tmp_path)
    config_file = tmp_path / "tokenizer_config.json"  # save_pretrained does not keep padding_side
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), "padding_side": "left"}))
    actor = RewardActor(0,
                        RewardSpec("randomwalks", {}, str(tmp_path), kind="model", model_path=str(tmp_path)))
    assert actor.scorer.reward_model.tokenizer.padding_side == "left"
    enc_seen = {}
    handle = actor.scorer.reward_model.model.register_forward_pre_hook(
        lambda _m, _a, kw: enc_seen.update(mask=kw["attention_mask"].clone()), with_kwargs=True)
    try:
        prompts, completions = zip(*PAIRS, strict=True)
        scores = actor.scorer.reward_model(list(prompts), list(completions))
    finally:
        handle.remove()
    assert bool(enc_seen["mask"][:, 0].all())  # first column real everywhere: right padding
    assert scores == pytest.approx([manual_score(model, tokenizer, p + c) for p, c in PAIRS], abs=1e-5)
