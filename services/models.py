"""Model and tokenizer recipes: local tokenizers, tiny models from a config, and the SFT warm start.

Nothing here downloads anything. A policy is always materialised as a Hugging Face model directory
(config, safetensors, tokenizer) so that vLLM, transformers and DeepSpeed all load the same files.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Protocol

import numpy as np
import torch
from filelock import FileLock
from tokenizers import Tokenizer, decoders, models
from transformers import PreTrainedTokenizerFast

from services.model_source import ModelSource

EOS = "<|endoftext|>"


class PolicyRecipe(Protocol):
    """What the policy's recipe reads of a task (``services.tasks.Task`` has it all): a model it converts or
    builds, and for a GPT-2 from random init, the config, the characters and the SFT corpus."""

    name: str
    model_kind: str
    model_config: dict | None

    @property
    def vocabulary(self) -> list[str]: ...

    def sft_corpus(self) -> list[str] | None: ...

    def model_dir(self, cache_dir: str | Path) -> Path: ...


def build_char_tokenizer(vocabulary: list[str]) -> PreTrainedTokenizerFast:
    """One character per token over ``vocabulary``, plus <|endoftext|> as eos, bos and pad.
    Like trlX's GPT-2 BPE with an empty merges file, but built locally."""
    vocab = {ch: i for i, ch in enumerate(vocabulary)}
    vocab[EOS] = len(vocab)
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None, fuse_unk=False))
    core.add_special_tokens([EOS])
    core.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=core, eos_token=EOS, bos_token=EOS, pad_token=EOS, model_max_length=1024
    )


def build_gpt2(tokenizer: PreTrainedTokenizerFast, model_config: dict, seed: int):
    """A random-init ``GPT2LMHeadModel``. The modeling classes are imported here, not by the driver, which
    needs only the tokenizer when the SFT model is cached."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **model_config,
    )
    return with_fused_activations(GPT2LMHeadModel(config))


def with_fused_activations(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` with each of transformers' ``NewGELUActivation`` modules (GPT-2's ``gelu_new``, written as
    seven tensor ops) replaced by its ``GELUTanh``: the same tanh approximation as one torch op, equal up to
    float rounding. Measured on the randomwalks GPT-2 (64 rows x 14 tokens, one thread): forward and backward
    1.25x faster, logits within 6e-7. Only the modules change: the config still says ``gelu_new``, so a saved
    or exported model is what it was, and vLLM, which builds its own, computes what it did."""
    from transformers.activations import GELUTanh, NewGELUActivation

    for parent in list(model.modules()):
        for name, child in parent.named_children():
            if isinstance(child, NewGELUActivation):
                setattr(parent, name, GELUTanh())
    return model


def save_model_dir(model, tokenizer, path: Path) -> Path:
    """Write a HF model dir atomically: into a temp dir beside it, then rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    if path.exists():
        shutil.rmtree(path)
    os.replace(tmp, path)
    return path


def sft_warm_start(task: PolicyRecipe, tokenizer, seed: int, steps: int, batch_size: int, lr: float,
                   log=print):
    """Train the task's GPT-2 from random init on its SFT corpus (text + eos), next-token loss."""
    model = build_gpt2(tokenizer, task.model_config or {}, seed)
    model.loss_type = "ForCausalLM"  # the loss GPT-2 uses; unset, transformers warns that it guesses it
    corpus = [tokenizer(text)["input_ids"] + [tokenizer.eos_token_id] for text in task.sft_corpus()]
    width = max(len(x) for x in corpus)
    ids = torch.full((len(corpus), width), tokenizer.pad_token_id, dtype=torch.long)
    labels = torch.full((len(corpus), width), -100, dtype=torch.long)
    for i, row in enumerate(corpus):
        ids[i, : len(row)] = torch.tensor(row)
        labels[i, : len(row)] = torch.tensor(row)
    from torch.optim import AdamW

    optimizer = AdamW(model.parameters(), lr=lr)
    rng = np.random.default_rng(seed)
    model.train()
    start = time.perf_counter()
    for step in range(steps):
        rows = torch.as_tensor(rng.choice(len(corpus), size=min(batch_size, len(corpus)), replace=False))
        loss = model(input_ids=ids[rows], attention_mask=(labels[rows] != -100).long(),
                     labels=labels[rows]).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % 100 == 0 or step == steps - 1:
            log(f"sft step {step + 1}/{steps} loss {loss.item():.4f} ({time.perf_counter() - start:.0f}s)")
    model.eval()
    return model


def sft_tokenizer(task: PolicyRecipe):
    """The tokenizer the task's SFT warm start will have (its characters), known before it trains; None for a
    task without that recipe."""
    if task.model_kind != "gpt2" or task.sft_corpus() is None:
        return None
    return build_char_tokenizer(task.vocabulary)


def policy_source(task: PolicyRecipe, model_path: str | None, cache_dir: str, seed: int, steps: int,
                  batch_size: int, lr: float, log=print) -> ModelSource:
    """The policy as every node can reach it: ``model_path`` (a directory every node has, or a hub id), or
    a model the driver makes here (the task's SFT warm start or conversion) and ships to the nodes."""
    if model_path:
        return ModelSource.configured(model_path)
    return ModelSource.produced(policy_dir(task, None, cache_dir, seed, steps, batch_size, lr, log),
                                cache_dir)


def policy_dir(task: PolicyRecipe, model_path: str | None, cache_dir: str, seed: int, steps: int,
               batch_size: int, lr: float, log=print) -> Path:
    """The policy's HF model dir on this machine: ``model_path`` if given, else the task's own model (its
    conversion, or its SFT warm start cached by a hash of everything that determines it, built on a miss)."""
    if model_path:
        path = Path(model_path).expanduser()
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"model.path {path} is not a Hugging Face model directory (no "
                                    "config.json)")
        return path
    if task.model_kind != "gpt2":
        return task.model_dir(cache_dir)
    if task.sft_corpus() is None:
        raise ValueError(f"task {task.name!r} has no built-in model recipe; set model.path")
    recipe = {
        "task": task.name, "task_seed": getattr(task, "seed", None), "vocab": task.vocabulary,
        "model": task.model_config, "seed": seed, "steps": steps, "batch_size": batch_size, "lr": lr,
        # the corpus itself, not only the task seed that drew it: a task may change how a seed draws
        "corpus": hashlib.sha256(json.dumps(task.sft_corpus()).encode()).hexdigest(), "format": 1,
    }
    key = hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:16]
    path = Path(cache_dir).expanduser() / "sft" / f"{task.name}-{key}"
    if (path / "config.json").is_file():
        log(f"SFT warm start: cached at {path}")
        return path
    locks = Path(cache_dir).expanduser() / ".locks"
    locks.mkdir(parents=True, exist_ok=True)
    # jobs that start together on one cache train it once: the others wait here, then find it cached
    with FileLock(locks / f"sft-{path.name}.lock"):
        if (path / "config.json").is_file():
            log(f"SFT warm start: cached at {path} (trained by another job meanwhile)")
            return path
        log(f"SFT warm start: training {task.name} GPT-2 from random init ({steps} steps) -> {path}")
        start = time.perf_counter()
        tokenizer = build_char_tokenizer(task.vocabulary)
        model = sft_warm_start(task, tokenizer, seed, steps, batch_size, lr, log=log)
        saved = save_model_dir(model, tokenizer, path)
        log(f"SFT warm start: saved ({time.perf_counter() - start:.1f}s)")
        return saved


# model types whose directories tether writes itself (the SFT warm starts, the SmolLM2 conversion)
OWN_MODEL_TYPES = ("gpt2", "llama")


# the files a saved tokenizer leaves in a model directory, one at least (fast, slow and sentencepiece ones)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model", "spiece.model")


def load_tokenizer(path: str | Path):
    """``AutoTokenizer.from_pretrained(path)``, without importing AutoTokenizer where its choice is known:
    a directory of one of ``OWN_MODEL_TYPES`` saved with transformers' generic ``TokenizersBackend`` loads
    with that class, which is what AutoTokenizer picks for it (tests/test_models.py and
    tests/test_sentiment_task.py check). Importing AutoTokenizer pulls in transformers' model mappings,
    generation and ``torch._dynamo``: about 2 CPU s in the driver and each reward actor, which need nothing
    else of them. Anything else goes through AutoTokenizer."""
    directory = Path(path)
    if directory.is_dir() and not any((directory / name).is_file() for name in TOKENIZER_FILES):
        raise ValueError(f"{path} holds no tokenizer (none of {', '.join(TOKENIZER_FILES)}): save the "
                         "model's tokenizer beside it, tokenizer.save_pretrained(that directory)")
    try:
        saved = json.loads((directory / "tokenizer_config.json").read_text())
        model_type = json.loads((directory / "config.json").read_text()).get("model_type")
    except (OSError, ValueError):
        # a hub id, or a directory without these files: AutoTokenizer says what is wrong
        saved, model_type = {}, None
    if (saved.get("tokenizer_class") == "TokenizersBackend" and "auto_map" not in saved
            and model_type in OWN_MODEL_TYPES and (directory / "tokenizer.json").is_file()):
        from transformers import TokenizersBackend

        return TokenizersBackend.from_pretrained(str(directory))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def model_positions(path: str | Path) -> int | None:
    """The positions a model directory's config.json gives it (``max_position_embeddings``, GPT-2's
    ``n_positions``); None when the directory has no config.json or the config says neither."""
    try:
        config = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    positions = config.get("max_position_embeddings", config.get("n_positions"))
    return int(positions) if isinstance(positions, int) else None


def parameter_count(path: str | Path) -> int | None:
    """Parameters in a model directory's safetensors files, summed from their headers (no tensor is read);
    None when the directory has none (a hub id, or a path only the cluster's nodes see)."""
    files = sorted(Path(path).glob("*.safetensors")) if Path(path).is_dir() else []
    if not files:
        return None
    total = 0
    for file in files:
        with open(file, "rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        total += sum(int(np.prod(entry["shape"])) for name, entry in header.items() if name != "__metadata__")
    return total


def load_causal_lm(path: str | Path, dtype: str = "float32", attention: str | None = None):
    """The causal LM at ``path`` in ``dtype``, in eval mode, with ``attention`` (transformers'
    attn_implementation; None: its default, sdpa where the architecture has it)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=getattr(torch, dtype),
                                                 attn_implementation=attention)
    model.eval()
    return with_fused_activations(model)
