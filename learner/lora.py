"""LoRA on the learner (``learner.lora``), through ``peft``: the policy's adapters, their merged weights for
the engines, and the base model as the reference.

With LoRA on, the policy is ``W + (alpha / r) * B @ A`` on each target module, B starting at 0, so the policy
starts as the base model, and the base model (the adapters disabled) stays the initial policy for the whole
run: the reference's log-probs come from the learner's own forward without adapters, and the KL is the same
quantity as against a reference actor holding the initial weights.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from services.config import LoraConfig

ADAPTER_NAME = "default"  # peft's


def add_adapters(lm: nn.Module, cfg: LoraConfig) -> nn.Module:
    """``lm`` wrapped by peft with fresh adapters on ``cfg.target_modules``: only their parameters train."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    targets = cfg.target_modules if cfg.target_modules != ["all-linear"] else "all-linear"
    check_target_modules(lm, cfg.target_modules)
    from transformers.pytorch_utils import Conv1D

    # GPT-2's Conv1D stores its weight as [in, out]: peft needs to know
    # (it would set it itself, with a warning)
    fan_in_fan_out = any(isinstance(module, Conv1D) for module in lm.modules())
    peft_config = PeftLoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, target_modules=targets, lora_dropout=0.0,
                                 bias="none", task_type="CAUSAL_LM", fan_in_fan_out=fan_in_fan_out)
    return get_peft_model(lm, peft_config)


def check_target_modules(lm: nn.Module, target_modules: list[str]) -> None:
    """Raise ValueError naming ``learner.lora.target_modules`` when a name matches no module of ``lm`` (peft
    matches a name against the end of each module's dotted name)."""
    if target_modules == ["all-linear"]:
        return
    names = [name for name, _ in lm.named_modules()]
    missing = [t for t in target_modules if not any(n == t or n.endswith(f".{t}") for n in names)]
    if missing:
        leaves = sorted({n.rsplit(".", 1)[-1] for n, m in lm.named_modules() if not list(m.children()) and n})
        raise ValueError(f"learner.lora.target_modules {missing} match no module of the model "
                         f"({type(lm).__name__}); its leaf modules are {leaves}, or use ['all-linear']")


def check_lora_model(model_dir: str, cfg: LoraConfig) -> None:
    """The target modules against the model's architecture, before any actor starts: the model is built on the
    meta device from its config (no weights read)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        lm = AutoModelForCausalLM.from_config(config)
    check_target_modules(lm, cfg.target_modules)


def merged_state_dict(lm: nn.Module) -> dict[str, torch.Tensor]:
    """The HF state dict of the policy with every adapter merged, ``W + delta``, under the base model's names
    (what the engines load and what a full-weight export holds). ``lm`` is left as it is."""
    from peft.tuners.lora import LoraLayer

    base = lm.get_base_model()
    deltas = {f"{name}.base_layer.weight": module.get_delta_weight(ADAPTER_NAME)
              for name, module in base.named_modules() if isinstance(module, LoraLayer)}
    merged = {}
    for key, value in base.state_dict().items():
        if "lora_" in key:
            continue
        if key in deltas:
            value = value + deltas[key].to(value.dtype)
        merged[key.replace(".base_layer.", ".")] = value.detach()
    return merged


def adapter_state(lm: nn.Module) -> tuple[dict[str, torch.Tensor], dict]:
    """(the adapter's tensors under PEFT's names, its adapter_config.json as a dict): what ``save_pretrained``
    writes, for an engine that loads the adapter alone."""
    from peft import get_peft_model_state_dict

    config = lm.peft_config[ADAPTER_NAME].to_dict()
    config = {k: sorted(v) if isinstance(v, set) else v for k, v in config.items()}  # JSON has no sets
    return {k: v.detach() for k, v in get_peft_model_state_dict(lm).items()}, config
