"""LoRA on the learner (``learner.lora``): only the adapters train, the engines get the merged weights, the
base model is the reference, and a LoRA job learns, resumes exactly and exports both the merged model and the
adapter. The job test is also the distillation job test: a LoRA student of a teacher (``distill.*``)."""

from __future__ import annotations

import json

import pytest
import torch
from pydantic import ValidationError

from services.config import LoraConfig, load_config


def randomised(lm, seed: int = 0):
    """The adapters' B away from 0, so that the adapted policy differs from the base model."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in lm.named_parameters():
            if "lora_B" in name:
                p.copy_(0.05 * torch.randn(p.shape, generator=g))
    return lm


def logits_of(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_only_the_adapters_train_and_the_merged_weights_are_the_adapted_policy(tiny_model_dir):
    from learner.lora import add_adapters, merged_state_dict
    from services.models import load_causal_lm

    lm = add_adapters(load_causal_lm(tiny_model_dir), LoraConfig(rank=4, alpha=8))
    trainable = [n for n, p in lm.named_parameters() if p.requires_grad]
    assert trainable and all("lora_A" in n or "lora_B" in n for n in trainable)
    assert {n.split(".lora_")[0].rsplit(".", 1)[-1] for n in trainable} == {"c_attn", "c_proj", "c_fc"}
    ids = torch.tensor([[1, 5, 9, 3, 7, 2], [4, 4, 8, 1, 6, 0]])
    base = load_causal_lm(tiny_model_dir)
    # B starts at 0: the policy is the base model
    assert torch.equal(logits_of(lm, ids), logits_of(base, ids))
    randomised(lm)
    adapted = logits_of(lm, ids)
    assert float((adapted - logits_of(base, ids)).abs().max()) > 1e-3
    # the engines' weights: the base model's names, each adapter merged; they compute the adapted policy
    merged = merged_state_dict(lm)
    assert set(merged) == set(base.state_dict())
    base.load_state_dict(merged)
    assert float((logits_of(base, ids) - adapted).abs().max()) < 1e-5
    with lm.disable_adapter():  # the reference: the base model, untouched by the merge
        assert torch.equal(logits_of(lm, ids), logits_of(load_causal_lm(tiny_model_dir), ids))


def test_unknown_target_modules_are_refused_naming_the_field(tiny_model_dir):
    from learner.lora import check_lora_model

    check_lora_model(tiny_model_dir, LoraConfig(rank=4, target_modules=["c_attn", "c_fc"]))
    with pytest.raises(ValueError, match=r"learner.lora.target_modules \['q_proj'\] match no module of the "
                                         r"model \(GPT2LMHeadModel\); its leaf modules are .*'c_attn'"):
        check_lora_model(tiny_model_dir, LoraConfig(rank=4, target_modules=["c_attn", "q_proj"]))


@pytest.mark.parametrize(("overrides", "message"), [
    ({"learner": {"lora": {"rank": -1}}}, "learner.lora.rank"),
    ({"learner": {"lora": {"rank": 8, "target_modules": ["all-linear", "c_fc"]}}}, "give it alone"),
    ({"learner": {"lora": {"rank": 8, "target_modules": []}}}, "learner.lora.target_modules"),
    ({"learner": {"lora": {"rank": 8}, "weight_sync": "nccl"}, "cluster": {"rollout": {"num_gpus": 1},
                                                                          "learner": {"num_gpus": 1}}},
     "LoRA's merged weights travel through 'object_store'"),
    ({"learner": {"lora": {"rank": 8}}, "reference": {"num_actors": 2}},
     "reference.num_actors=2 is set, but with learner.lora.reference='base'"),
])
def test_refused_lora_settings_name_the_field(overrides, message):
    with pytest.raises(ValidationError, match=message):
        load_config(overrides=overrides)
    # a preset's reference setting put back to its default is no longer in the way
    load_config(overrides={"learner": {"lora": {"rank": 8}}, "reference": {"torch_threads": None}})


@pytest.mark.integration
def test_a_lora_student_distils_with_the_base_model_as_reference_resumes_exactly_and_exports_both(
        small_run, ray_head, cache_dir, tiny_model_dir, tmp_path):
    """The small job with rank-8 adapters, packed in micro-batches of 96 tokens, distilling the small run's
    export (trained 4 iterations) beside the task's reward, as on-policy distillation into LoRA is run
    (Tinker's cookbook): no reference actor starts (the learner scores the base model), the first batch has no
    KL to the reference at all, the merged weights pass every probe, the teacher actor scores every chunk, and
    the student learns the task and moves toward the teacher. Resumed from its checkpoint of iteration 2 with
    a reference actor instead (``learner.lora.reference: actor``, which holds the base model), iteration 3
    comes out as it did: the same optimizer and adapters, and the base model's KL whoever scores it. The
    export is the merged model, with the adapter in PEFT's format beside it; the two compute the same."""
    from peft import PeftModel

    from services.models import load_causal_lm
    from tests.conftest import SMALL, run_job

    teacher_dir, teacher_proc = small_run
    assert teacher_proc.returncode == 0, teacher_proc.stderr[-3000:]

    def job(*extra):
        return run_job(["--cluster.address", ray_head.address, "--model.cache_dir", cache_dir,
                        "--run.output_dir", str(tmp_path), "--run.name", "lora", *SMALL,
                        "--learner.lora.rank", "8", "--ppo.lr", "1e-3", "--checkpoint.every", "2",
                        "--run.iterations", "3", "--learner.max_tokens_per_microbatch", "96",
                        "--distill.teacher_path", str(teacher_dir / "export"), *extra])

    first = job("--run.eval_every", "3")
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    assert "1 rollout, 1 teacher, 1 learner rank(s) scoring the reference and reward" in first.stdout
    assert "teacher kl " in first.stdout
    run_dir = tmp_path / "lora"
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert records[0]["kl_response_mean"] == 0.0 and records[0]["kl_k3_response_mean"] == 0.0
    assert all(r["learner_padding_fraction"] == 0.0 and r["teacher_seconds"] > 0 for r in records)
    probes = [r["probe_max_abs_error"] for r in records]
    assert all(0 <= p < 1e-4 for p in probes), probes
    teacher_kl = [r["teacher_kl_response_mean"] for r in records]
    assert teacher_kl[0] > 0.5 and teacher_kl[-1] < 0.5 * teacher_kl[0], teacher_kl
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["eval_final"]["optimality"] > summary["eval_start"]["optimality"] + 0.1, summary

    export = run_dir / "export"
    ids = torch.tensor([[1, 5, 9, 3, 7, 2]])
    # the small job's SFT start is the tests' tiny model (the same recipe, seed and steps)
    adapter = PeftModel.from_pretrained(load_causal_lm(tiny_model_dir), str(export / "adapter"))
    assert float((logits_of(load_causal_lm(export), ids) - logits_of(adapter, ids)).abs().max()) < 1e-5

    resumed = job("--run.resume", str(run_dir / "checkpoints" / "iter-000002"),
                  "--learner.lora.reference", "actor", "--run.eval_every", "100")
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "1 rollout, 1 reference, 1 teacher, 1 learner rank(s) scoring the reward" in resumed.stdout
    again = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()][2]
    for key in ("kl_response_mean", "kl_k3_response_mean", "teacher_kl_response_mean", "score_mean",
                "ppo_policy_loss", "kl_coef"):
        assert again[key] == pytest.approx(records[2][key], rel=1e-5, abs=1e-7), key


def test_vllm_lora_ranks_are_vllms():
    from typing import get_args

    from vllm.config.lora import MaxLoRARanks

    from services.config import VLLM_LORA_RANKS

    assert VLLM_LORA_RANKS == get_args(MaxLoRARanks)
    assert load_config(overrides={"learner": {"lora": {"rank": 4}}}).learner.vllm_lora_rank == 8
    with pytest.raises(ValidationError, match="learner.lora.rank=600 is above vLLM's largest LoRA rank, 512"):
        load_config(overrides={"learner": {"lora": {"rank": 600, "sync": "adapter"}}})
    # learner.lora.sync merged, or auto with the engines on CPU: the engines run the plain model, so any rank
    # goes
    for sync in ("merged", "auto"):
        cfg = load_config(overrides={"learner": {"lora": {"rank": 600, "sync": sync}}})
        assert not cfg.adapter_sync and cfg.engine_lora_rank is None
    assert load_config(overrides={"learner": {"lora": {"rank": 4, "sync": "adapter"}}}).engine_lora_rank == 8
    on_gpus = {"learner": {"lora": {"rank": 4}}, "cluster": {"rollout": {"num_gpus": 1}}}
    # auto: adapter-only sync where engines have GPUs
    assert load_config(overrides=on_gpus).engine_lora_rank == 8
    in_bf16 = {"learner": {"lora": {"rank": 4}, "dtype": "bfloat16"}}
    # and in bf16, where a merge would round it away
    assert load_config(overrides=in_bf16).engine_lora_rank == 8
    with pytest.raises(ValidationError, match="learner.lora.sync='merged' with learner.dtype='bfloat16'"):
        load_config(overrides={"learner": {"lora": {"rank": 4, "sync": "merged"}, "dtype": "bfloat16"}})
