"""Packing by token budget (``learner.max_tokens_per_microbatch``): sequences one after another without
padding, positions restarting per sequence and no attention across them, equal to the padded computation in
fp32, and one optimizer step accumulating a variable number of micro-batches, as many on every rank."""

from __future__ import annotations

import pytest
import torch

from services.experience import (
    make_batch,
    model_inputs,
    pack,
    packed_logits,
    packed_response_logprobs,
    plan_micro_batches,
    response_forward,
    response_logits,
    sequence_lengths,
)


def ragged_batch(n: int, seed: int, width: int = 7, vocab: int = 21):
    """Prompts of 1-4 tokens and responses of 0-``width`` tokens (an empty one among them)."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1, vocab, (int(k),), generator=g).tolist()
               for k in torch.randint(1, 5, (n,), generator=g)]
    lengths = torch.randint(0, width + 1, (n,), generator=g).tolist()
    lengths[0] = 0
    responses = [torch.randint(0, vocab, (k,), generator=g).tolist() for k in lengths]
    logprobs = [(-torch.rand(k, generator=g)).tolist() for k in lengths]
    return make_batch(prompts, responses, logprobs, [1] * n, list(range(n)), 22, 0, 0.05, width,
                      group_index=list(range(n)))


@pytest.mark.parametrize("architecture", ["gpt2", "llama"])
def test_a_packed_forward_equals_the_padded_one(tiny_model_dir, architecture):
    from services.models import load_causal_lm

    if architecture == "gpt2":
        model = load_causal_lm(tiny_model_dir)
    else:
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(vocab_size=23, hidden_size=64, intermediate_size=128,
                                             num_hidden_layers=2, num_attention_heads=2,
                                             num_key_value_heads=2, head_dim=32)).eval()
    batch = ragged_batch(9, seed=1)
    packed = pack(batch)
    real = int(sequence_lengths(batch).sum())
    assert packed.input_ids.shape == (1, real) and packed.keep.numel() == int(batch.response_mask.sum())
    with torch.no_grad():
        padded, padded_hidden = response_logits(model, *model_inputs(batch),
                                                batch.prompt_ids.shape[1], hidden=True)
        got, got_hidden = packed_logits(model, packed, hidden=True)
    mask = batch.response_mask.bool()
    assert float((padded[mask] - got[mask]).abs().max()) < 1e-5
    assert float((padded_hidden[mask] - got_hidden[mask]).abs().max()) < 1e-5
    assert float(got[~mask].abs().max()) == 0.0  # the padded layout's padding holds nothing
    want, _, _ = response_forward(model, batch)
    with torch.no_grad():
        for budget in (4, 12, 1000):  # one sequence a micro-batch (each longer than 4), several, all in one
            assert torch.allclose(packed_response_logprobs(model, batch, budget),
                                  want * batch.response_mask, atol=1e-5)


def test_micro_batches_hold_every_row_once_within_the_budget():
    lengths = torch.tensor([5, 9, 2, 14, 7, 7, 1, 3])
    for budget in (1, 8, 14, 20, 100):
        parts = plan_micro_batches(lengths, budget)
        rows = torch.cat(parts)
        assert sorted(rows.tolist()) == list(range(len(lengths)))
        for part in parts:
            assert int(lengths[part].sum()) <= budget or len(part) == 1  # a row over the budget goes alone
            assert part.tolist() == sorted(part.tolist())
    assert len(plan_micro_batches(lengths, 100)) == 1
    # 48 tokens: 14 | 9 5 | 7 7 | 2 1 3... first fit, longest first
    assert len(plan_micro_batches(lengths, 14)) == 4


def test_a_row_without_a_prompt_token_is_refused():
    batch = make_batch([[]], [[3, 4]], [[0.0, 0.0]], [1], [0], 22, 0, 0.0, 4)
    with pytest.raises(ValueError, match="row 0 has no prompt token"):
        pack(batch)


def test_packed_micro_batches_give_the_padded_gradient(tiny_model_dir):
    """The gradient of the PPO loss (token mean over the minibatch, the value loss too) summed over packed
    micro-batches, each divided by the minibatch's count, equals the padded minibatch's (1e-4 relative)."""
    from learner.policy_losses import policy_loss
    from learner.policy_model import PolicyWithValueHead
    from learner.ppo import loss_denominator, value_loss
    from services.config import PPOConfig
    from services.models import load_causal_lm

    torch.manual_seed(0)
    model = PolicyWithValueHead(load_causal_lm(tiny_model_dir))
    batch = ragged_batch(12, seed=5)
    mask = batch.action_mask
    g = torch.Generator().manual_seed(6)
    advantages, returns = torch.randn(mask.shape, generator=g) * mask, \
        torch.randn(mask.shape, generator=g) * mask
    old_values = torch.randn(mask.shape, generator=g) * mask
    denominator = loss_denominator(mask, "token_mean")
    with torch.no_grad():  # the old policy a little away from the current one: some ratios clip
        from services.experience import response_forward

        old_logprobs = (response_forward(model.lm, batch)[0]
                        + 0.3 * torch.randn(mask.shape, generator=g)) * mask

    def loss_of(rows, packed: bool):
        from services.experience import model_inputs
        from services.logprobs import token_logprobs

        part = batch[rows]
        if packed:
            logits, values = model(None, None, None, 0, packed=pack(part))
        else:
            logits, values = model(*model_inputs(part), part.prompt_ids.shape[1])
        logprobs = token_logprobs(logits, part.response_ids)
        pg, _ = policy_loss(logprobs, old_logprobs[rows], advantages[rows], part.action_mask,
                            PPOConfig(clip_range=0.2), "token_mean", denominator)
        vf, _ = value_loss(values, old_values[rows], returns[rows], part.action_mask, 0.2,
                           "token_mean", denominator)
        return pg + vf

    def gradient(loss) -> torch.Tensor:
        model.zero_grad()
        loss.backward()
        return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])

    everything = torch.arange(12)
    want = gradient(loss_of(everything, packed=False))
    parts = plan_micro_batches(sequence_lengths(batch), 10)
    assert len(parts) > 2
    model.zero_grad()
    total = sum(loss_of(part, packed=True) for part in parts)
    got = gradient(total)
    assert float(want.norm()) > 1e-3
    assert float((got - want).norm() / want.norm()) < 1e-4
