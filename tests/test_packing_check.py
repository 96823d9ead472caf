"""Packing's isolation check (``services/packing_check.py``), run at setup by every role that packs
(``learner.max_tokens_per_microbatch``): it passes the models whose attention reads the positions' restarts (a
tiny GPT-2 and Llama, fp32 and bf16) and refuses, naming the role, a real leak: a real model run over the
packed row with a full attention mask or with positions that do not restart, and Falcon, whose causal mask
(transformers 5.19) ignores the positions. Random-init models built from a config: no SFT warm start, no
Ray."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from actors.specs import ReferenceSpec
from services.packing_check import check_packing_isolation, leak_tolerance, packing_leak

VOCAB = 23
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def tiny_lm(architecture: str, dtype: str = "fp32") -> nn.Module:
    """A random-init causal LM of ``architecture`` (gpt2, llama, falcon) in eval mode."""
    from transformers import (
        FalconConfig,
        FalconForCausalLM,
        GPT2Config,
        GPT2LMHeadModel,
        LlamaConfig,
        LlamaForCausalLM,
    )

    torch.manual_seed(0)
    if architecture == "gpt2":
        model = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=2, n_positions=64,
                                           bos_token_id=0, eos_token_id=0))
    elif architecture == "llama":
        model = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                                             num_hidden_layers=2, num_attention_heads=2,
                                             num_key_value_heads=2, head_dim=32, max_position_embeddings=64))
    else:  # rotary positions, no ALiBi: its attention would read positions, its mask does not
        model = FalconForCausalLM(FalconConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2,
                                               num_attention_heads=2, alibi=False,
                                               new_decoder_architecture=False, multi_query=False,
                                               bos_token_id=0, eos_token_id=0))
    return model.to(DTYPES[dtype]).eval()


class WholeRowAttention(nn.Module):
    """A real LM whose attention spans the whole packed row: a full attention mask (transformers reads the
    restarts only without one) or, ``restart_positions`` False, positions counting on across the row."""

    def __init__(self, lm: nn.Module, restart_positions: bool = True) -> None:
        super().__init__()
        self.lm, self.restart_positions = lm, restart_positions
        self.config = lm.config

    def forward(self, input_ids, attention_mask=None, position_ids=None, **kwargs):
        if self.restart_positions:
            attention_mask = torch.ones_like(input_ids)
        else:
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0)
        return self.lm(input_ids=input_ids, attention_mask=attention_mask,
                       position_ids=position_ids, **kwargs)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("architecture", ["gpt2", "llama"])
def test_an_isolating_model_passes(architecture, dtype):
    model = tiny_lm(architecture, dtype)
    leak = packing_leak(model, VOCAB)
    assert leak.own > 0.1  # the changed sequence's own log-probs move: the test sees a change
    assert leak.neighbour <= leak_tolerance(leak, DTYPES[dtype])
    check_packing_isolation(model, VOCAB, "learner-rank-0")


@pytest.mark.parametrize("restart_positions", [True, False], ids=["full-mask", "positions-on"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("architecture", ["gpt2", "llama"])
def test_attention_across_the_packed_row_is_refused(architecture, dtype, restart_positions):
    model = WholeRowAttention(tiny_lm(architecture, dtype), restart_positions)
    leak = packing_leak(model, VOCAB)
    # a margin over the tolerance, not a near miss
    assert leak.neighbour > 2 * leak_tolerance(leak, DTYPES[dtype])
    with pytest.raises(ValueError, match=r"reference-0: WholeRowAttention lets packed sequences attend to "
                                         r"each other.*Unset learner.max_tokens_per_microbatch"):
        check_packing_isolation(model, VOCAB, "reference-0")


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_model_class_whose_mask_ignores_the_restarts_is_refused(dtype):
    with pytest.raises(ValueError,
                       match=r"teacher-0: FalconForCausalLM lets packed sequences attend to each other"):
        check_packing_isolation(tiny_lm("falcon", dtype), VOCAB, "teacher-0")


def test_a_lora_model_is_checked_as_its_base_model():
    """learner.lora: the rank's LM is a peft model; the check runs through it and names the wrapped class."""
    from peft import LoraConfig, get_peft_model

    llama = get_peft_model(tiny_lm("llama"), LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    llama.train()
    check_packing_isolation(llama, llama.config.vocab_size, "learner-rank-0")
    assert all(module.training for module in llama.modules())  # the check's eval mode is undone
    falcon = get_peft_model(tiny_lm("falcon"), LoraConfig(r=2, target_modules=["query_key_value"]))
    with pytest.raises(ValueError, match="learner-rank-1: FalconForCausalLM lets packed sequences"):
        check_packing_isolation(falcon, falcon.config.vocab_size, "learner-rank-1")


def test_a_packing_reference_or_teacher_checks_its_model_at_start(tmp_path):
    """Backend hf with ``max_tokens_per_microbatch``: built as plain objects, the reference starts on Llama,
    the teacher refuses Falcon; unpacked, Falcon is taken (its padded forward masks by the attention mask)."""
    from actors.reference import ReferenceActor, TeacherActor

    llama, falcon = tmp_path / "llama", tmp_path / "falcon"
    tiny_lm("llama").save_pretrained(llama)
    tiny_lm("falcon").save_pretrained(falcon)
    ReferenceActor(0, ReferenceSpec(str(llama), max_tokens_per_microbatch=64))
    ReferenceActor(0, ReferenceSpec(str(falcon)))
    with pytest.raises(ValueError,
                       match=r"teacher-1: FalconForCausalLM .* learner.max_tokens_per_microbatch"):
        TeacherActor(1, ReferenceSpec(str(falcon), max_tokens_per_microbatch=64))
