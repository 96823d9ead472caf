"""LoRA on the learner (``learner.lora``): only the adapters train, the engines get the merged weights, the base
model is the reference, and a LoRA job learns, resumes exactly and exports both the merged model and the adapter."""

from __future__ import annotations

import json

import pytest
import ray
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
    assert torch.equal(logits_of(lm, ids), logits_of(base, ids))  # B starts at 0: the policy is the base model
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
    with pytest.raises(ValueError, match=r"learner.lora.target_modules \['q_proj'\] match no module of the model "
                                         r"\(GPT2LMHeadModel\); its leaf modules are .*'c_attn'"):
        check_lora_model(tiny_model_dir, LoraConfig(rank=4, target_modules=["c_attn", "q_proj"]))


@pytest.mark.parametrize(("overrides", "message"), [
    ({"learner": {"lora": {"rank": -1}}}, "learner.lora.rank"),
    ({"learner": {"lora": {"rank": 8, "target_modules": ["all-linear", "c_fc"]}}}, "give it alone"),
    ({"learner": {"lora": {"rank": 8, "target_modules": []}}}, "learner.lora.target_modules"),
    ({"learner": {"lora": {"rank": 8}, "weight_sync": "nccl"}, "cluster": {"rollout": {"num_gpus": 1},
                                                                          "learner": {"num_gpus": 1}}},
     "LoRA's merged weights travel through 'object_store'"),
    ({"learner": {"lora": {"rank": 8}}, "reference": {"num_actors": 2}},
     "reference.num_actors is set, but with learner.lora.reference='base'"),
])
def test_refused_lora_settings_name_the_field(overrides, message):
    with pytest.raises(ValidationError, match=message):
        load_config(overrides=overrides)


@pytest.mark.integration
def test_a_lora_job_learns_with_the_base_model_as_reference_resumes_exactly_and_exports_both(
        ray_head, cache_dir, tiny_model_dir, tmp_path):
    """The small job with rank-8 adapters, packed in micro-batches of 96 tokens: no reference actor starts (the
    learner scores the base model), the first batch has no KL at all, the merged weights pass every probe, and it learns. Resumed from its checkpoint
    of iteration 2 with a reference actor instead (``learner.lora.reference: actor``, which holds the base model),
    iteration 3 comes out as it did: the same optimizer and adapters, and the base model's KL whoever scores it.
    The export is the merged model, with the adapter in PEFT's format beside it; the two compute the same."""
    from peft import PeftModel

    from services.models import load_causal_lm
    from tests.conftest import SMALL, run_job

    def job(*extra):
        return run_job(["--cluster.address", ray_head.address, "--model.cache_dir", cache_dir, "--run.output_dir",
                        str(tmp_path), "--run.name", "lora", *SMALL, "--learner.lora.rank", "8", "--ppo.lr", "1e-3",
                        "--checkpoint.every", "2", "--run.iterations", "3", "--learner.max_tokens_per_microbatch", "96",
                        *extra])

    first = job("--run.eval_every", "3")
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    assert "0 reference, 1 reward, 1 learner rank(s)" in first.stdout
    run_dir = tmp_path / "lora"
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert records[0]["kl_response_mean"] == 0.0 and records[0]["kl_k3_response_mean"] == 0.0
    assert all(r["learner_padding_fraction"] == 0.0 for r in records)
    probes = [r["probe_max_abs_error"] for r in records]
    assert all(0 <= p < 1e-4 for p in probes), probes
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["eval_final"]["optimality"] > summary["eval_start"]["optimality"] + 0.1, summary

    export = run_dir / "export"
    ids = torch.tensor([[1, 5, 9, 3, 7, 2]])
    # the small job's SFT start is the tests' tiny model (the same recipe, seed and steps)
    adapter = PeftModel.from_pretrained(load_causal_lm(tiny_model_dir), str(export / "adapter"))
    assert float((logits_of(load_causal_lm(export), ids) - logits_of(adapter, ids)).abs().max()) < 1e-5

    resumed = job("--run.resume", str(run_dir / "checkpoints" / "iter-000002"), "--learner.lora.reference", "actor",
                  "--run.eval_every", "100")
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "1 reference, 1 reward, 1 learner rank(s)" in resumed.stdout
    again = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()][2]
    for key in ("kl_response_mean", "kl_k3_response_mean", "score_mean", "ppo_policy_loss", "kl_coef"):
        assert again[key] == pytest.approx(records[2][key], rel=1e-5, abs=1e-7), key



def test_vllm_lora_ranks_are_vllms():
    from typing import get_args

    from vllm.config.lora import MaxLoRARanks

    from services.config import VLLM_LORA_RANKS

    assert VLLM_LORA_RANKS == get_args(MaxLoRARanks)
    assert load_config(overrides={"learner": {"lora": {"rank": 4}}}).learner.vllm_lora_rank == 8
    with pytest.raises(ValidationError, match="learner.lora.rank=600 is above vLLM's largest LoRA rank, 512"):
        load_config(overrides={"learner": {"lora": {"rank": 600}}})


@pytest.fixture(scope="module")
def tiny_llama_dir(tiny_model_dir, tmp_path_factory) -> str:
    """A random-init Llama with the randomwalks tokenizer (vLLM's Llama takes LoRA adapters; its GPT-2 does not);
    head_dim 32, a size vLLM's CPU attention takes."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from services.models import load_tokenizer, save_model_dir

    tokenizer = load_tokenizer(tiny_model_dir)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, head_dim=32, max_position_embeddings=64,
                         bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    return str(save_model_dir(LlamaForCausalLM(config), tokenizer, tmp_path_factory.mktemp("llama") / "random"))


@pytest.mark.integration
def test_adapter_only_sync_on_a_llama_the_engine_generates_with_the_learners_adapter(ray_client, tiny_llama_dir,
                                                                                     rank_pool):
    """learner.lora on a model vLLM takes adapters for: each sync ships the adapter alone, the engine generates
    and scores with it, and its log-probs equal the learner's (the probe) after an update that moved them; the same adapter loaded again changes nothing. The engine's base
    weights are never touched."""
    from actors.engines import SamplingSettings
    from actors.rollout import RolloutActor
    from learner.cluster import start_actor
    from tests.test_pipeline import kill, probe_set, small_config

    cfg = small_config(learner={"lora": {"rank": 8}}, ppo={"minibatch_size": 8, "epochs": 2, "lr": 3e-2})
    engine = start_actor(RolloutActor, "rollout", 0, cfg.cluster.rollout, None, 0, "vllm", tiny_llama_dir, 0, 32, 64,
                         "float32", 0, lora_rank=cfg.learner.vllm_lora_rank)
    try:
        assert ray.get(engine.takes_adapters.remote())
        group = rank_pool.group(cfg, tiny_llama_dir, tag="lora")
        sequences, prompt_lengths = probe_set()
        before = ray.get(engine.probe.remote(sequences, prompt_lengths))
        assert max(abs(a - b) for g, e in zip(before, group.probe(sequences, prompt_lengths)) for a, b in zip(g, e)) < 1e-4
        full = ray.get(group.policy_weights(adapter=False))
        chunks = [engine.generate.remote([[i % 20 + 1] for i in range(8)], list(range(8)), list(range(8)),
                                         SamplingSettings(1.0, 1.0, 9), 22)]
        scores = [ray.put(torch.linspace(0, 1, 8))]
        result = group.train(chunks, None, scores, kl_coef=0.05, iteration=1)  # the base model as the reference
        assert result.kl["response_mean"] == pytest.approx(0.0, abs=1e-6)  # the batch came from the base policy
        adapter = ray.get(group.policy_weights(adapter=True))
        # rank 8 on layers 64 wide: a fifth of this tiny model (SmolLM2-135M, all-linear at rank 16: 3.6%)
        assert adapter.adapter_config["r"] == 8 and adapter.nbytes < full.nbytes / 4
        assert all("lora_A" in name or "lora_B" in name for name in adapter.tensors())
        for _ in range(2):  # a restarted engine's re-sync loads the same version again
            ray.get(engine.update_weights.remote(adapter, 1, 0.05))
            after = ray.get(engine.probe.remote(sequences, prompt_lengths))
            learner = group.probe(sequences, prompt_lengths)
            assert max(abs(a - b) for g, e in zip(after, learner) for a, b in zip(g, e)) < 1e-4
            assert max(abs(a - b) for g, e in zip(after, before) for a, b in zip(g, e)) > 1e-3
        chunk = ray.get(engine.generate.remote([[3], [5]], [0, 1], [7, 8], SamplingSettings(1.0, 1.0, 9), 22))
        assert chunk.policy_version.tolist() == [1, 1]
    finally:
        kill(engine)


@pytest.mark.integration
@pytest.mark.parametrize("stage", [2, 3])
def test_lora_on_two_zero_ranks_matches_one_rank(rank_pool, tiny_model_dir, stage):
    """Only the adapters train, on every ZeRO stage: two ranks (ZeRO-2 or ZeRO-3, which partitions the frozen
    base weights too) take the step one rank takes, and the base model scored as the reference is the same."""
    from tests.test_pipeline import _fixed_batch, small_config

    batch = _fixed_batch(16, 6, seed=0)
    chunks = [ray.put(batch[:8]), ray.put(batch[8:])]
    scores = [ray.put(torch.linspace(0, 1, 8)), ray.put(torch.linspace(1, 0, 8))]
    results = {}
    for world_size, zero_stage in ((1, 0), (2, stage)):
        cfg = small_config(ppo={"minibatch_size": 16, "epochs": 1, "lr": 1e-2},
                           learner={"world_size": world_size, "zero_stage": zero_stage, "lora": {"rank": 8}},
                           rollout={"batch_size": 16, "chunk_size": 8, "max_new_tokens": 6})
        group = rank_pool.group(cfg, tiny_model_dir, tag="lora-zero")
        first = group.train(chunks, None, scores, kl_coef=0.05, iteration=1)
        second = group.train(chunks, None, scores, kl_coef=0.05, iteration=2)  # after a step: a KL, a moved policy
        results[world_size] = (first.kl["response_mean"], second.kl["response_mean"],
                               sum(r.ppo["loss"] for r in second.ranks) / len(second.ranks))
    assert results[1][0] == pytest.approx(0.0, abs=1e-6) and abs(results[1][1]) > 1e-4
    assert results[2] == pytest.approx(results[1], rel=1e-4, abs=1e-6)
