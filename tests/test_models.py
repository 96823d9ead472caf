"""What the driver loads: ``load_tokenizer``'s shortcut gives AutoTokenizer's tokenizer, and the driver's
imports stay free of what only the actors need (its start-up is on every job's critical path)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TEXTS = ["abcdefgh", "hgfa", "a" * 40 + "<|endoftext|>", ""]


def test_load_tokenizer_gives_autotokenizers_tokenizer(tiny_model_dir, tmp_path):
    from transformers import AutoTokenizer

    from services.models import load_tokenizer

    ours, auto = load_tokenizer(tiny_model_dir), AutoTokenizer.from_pretrained(tiny_model_dir)
    assert type(ours) is type(auto)
    assert (ours.eos_token_id, ours.pad_token_id, ours.bos_token_id, len(ours)) == (
        auto.eos_token_id, auto.pad_token_id, auto.bos_token_id, len(auto))
    assert [ours(t)["input_ids"] for t in TEXTS] == [auto(t)["input_ids"] for t in TEXTS]
    assert ours.decode(ours("abc")["input_ids"]) == auto.decode(auto("abc")["input_ids"])

    # a directory of another tokenizer class or model type goes through AutoTokenizer itself
    import shutil

    other = tmp_path / "other"
    shutil.copytree(tiny_model_dir, other)
    config = json.loads((other / "tokenizer_config.json").read_text())
    (other / "tokenizer_config.json").write_text(json.dumps({**config, "tokenizer_class": "GPT2Tokenizer"}))
    assert type(load_tokenizer(other)) is type(AutoTokenizer.from_pretrained(other))


def test_driver_imports_leave_actor_libraries_to_the_actors(tiny_model_dir):
    """The driver's modules, and a tokenizer of tether's own, load neither the batch container's tensordict
    nor torch._dynamo nor DeepSpeed nor vLLM: together about 3 CPU s before any actor could start."""
    code = ("import sys, learner.main, learner.loop; from services.models import load_tokenizer; "
            f"load_tokenizer({tiny_model_dir!r}); "
            "print([m for m in ('tensordict', 'torch._dynamo', 'deepspeed', 'vllm') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout


def test_response_logits_are_the_full_forwards_response_positions():
    """``response_logits`` passes the LM head only the positions that predict response tokens (GPT-2 and
    Llama take ``logits_to_keep``), and falls back to slicing the full logits for a model that does not:
    the same numbers either way, with left-padded prompts."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    from services.experience import response_logits

    class WithoutLogitsToKeep(GPT2LMHeadModel):
        def forward(self, input_ids=None, attention_mask=None, position_ids=None, output_hidden_states=None,
                    use_cache=None):
            return super().forward(input_ids=input_ids, attention_mask=attention_mask,
                                   position_ids=position_ids, output_hidden_states=output_hidden_states,
                                   use_cache=use_cache)

    torch.manual_seed(0)
    gpt2 = GPT2Config(vocab_size=29, n_positions=16, n_embd=32, n_layer=2, n_head=2)
    models = [GPT2LMHeadModel(gpt2), WithoutLogitsToKeep(gpt2),
              LlamaForCausalLM(LlamaConfig(vocab_size=29, hidden_size=32, intermediate_size=64,
                                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                           max_position_embeddings=16))]
    ids = torch.randint(0, 29, (3, 9))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0  # left padding of a 4-wide prompt
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    for model in models:
        model.eval()
        full = model(input_ids=ids, attention_mask=mask, position_ids=positions, output_hidden_states=True,
                     use_cache=False)
        logits, hidden = response_logits(model, ids, mask, positions, prompt_width=4, hidden=True)
        assert logits.shape == (3, 5, 29) and hidden.shape == (3, 5, 32)
        torch.testing.assert_close(logits, full.logits[:, 3:8], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(hidden, full.hidden_states[-1][:, 3:8])


def test_loaded_gpt2_computes_gelu_new_as_one_op_and_saves_as_it_was(tiny_model_dir, tmp_path):
    """``load_causal_lm`` gives GPT-2's ``gelu_new`` as torch's one-op tanh GELU: the logits of the model as
    transformers builds it within float rounding, and the config it saves (what vLLM and an export read)
    unchanged."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.activations import GELUTanh, NewGELUActivation

    from services.models import load_causal_lm

    model = load_causal_lm(tiny_model_dir)
    as_built = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    activations = [type(m) for m in model.modules() if isinstance(m, GELUTanh | NewGELUActivation)]
    assert activations == [GELUTanh] * model.config.n_layer
    assert sum(isinstance(m, NewGELUActivation) for m in as_built.modules()) == model.config.n_layer
    ids = torch.randint(0, model.config.vocab_size, (4, 12))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, as_built(ids).logits, rtol=0, atol=1e-5)
    model.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["activation_function"] == "gelu_new"


def test_parameter_count_reads_the_safetensors_headers(tmp_path):
    """The driver counts a model's parameters without loading it: every shard's header, tied weights once
    (transformers saves them once), nothing for a directory without safetensors files."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    from services.models import parameter_count

    gpt2 = GPT2LMHeadModel(GPT2Config(n_embd=64, n_layer=2, n_head=2, vocab_size=50, n_positions=32))
    gpt2.save_pretrained(tmp_path / "gpt2")
    llama = LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=2, vocab_size=50, tie_word_embeddings=False))
    llama.to(torch.bfloat16).save_pretrained(tmp_path / "llama", max_shard_size="100KB")  # several shards
    assert len(list((tmp_path / "llama").glob("*.safetensors"))) > 1
    assert parameter_count(tmp_path / "gpt2") == sum(p.numel() for p in gpt2.parameters())
    assert parameter_count(tmp_path / "llama") == sum(p.numel() for p in llama.parameters())
    assert parameter_count(tmp_path) is None and parameter_count(tmp_path / "nowhere") is None


def test_a_pretrained_policy_on_the_tiny_models_lr_is_told_at_start():
    """ppo.lr's default is sized for the embedded randomwalks model trained from scratch: a job whose policy
    is a pretrained model (20M parameters or more) says so at start, with the reason, unless ppo.lr was set
    (by the config file or the command line); a small policy, or one whose size the driver cannot see, is
    not told."""
    from services.config import load_config

    default = load_config(None, {})
    notice = default.tiny_model_settings_notice(134_515_008)
    assert notice.startswith("note: ppo.lr=0.0003 is the default for the embedded randomwalks model")
    assert "this policy has 135M" in notice and "Set ppo.lr" in notice
    assert default.tiny_model_settings_notice(1_200_000) is None
    assert default.tiny_model_settings_notice(None) is None
    assert load_config(None, {"ppo": {"lr": 3e-4}}).tiny_model_settings_notice(134_515_008) is None
    preset = load_config(ROOT / "deploy" / "configs" / "smollm2-sentiment.yaml")
    assert preset.tiny_model_settings_notice(134_515_008) is None
    # the command line keeps what it was not given unset
    from learner.main import parse_cli

    assert parse_cli(["--task.max_prompt_tokens", "8"]).tiny_model_settings_notice(134_515_008) == notice
    assert parse_cli(["--ppo.lr", "3e-4"]).tiny_model_settings_notice(134_515_008) is None
    assert parse_cli(["--config", str(ROOT / "deploy" / "configs" / "smollm2-sentiment.yaml")]
                     ).tiny_model_settings_notice(134_515_008) is None
