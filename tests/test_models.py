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
