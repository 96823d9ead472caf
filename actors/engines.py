"""Generation engines behind one interface: vLLM (CPU build or CUDA) and transformers ``generate``.

Each engine samples responses with their sampled-token log-probs, scores given sequences
(log-prob of every token after the prompt), and loads new weights in place: from a state dict (the
object store), or through vLLM's weight transfer (NCCL or CUDA IPC on GPU). ``Engine`` is that
interface; ``RolloutActor`` uses nothing else.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import Protocol

import torch

from actors.specs import EngineSpec
from services.errors import TetherError


@dataclass
class Generation:
    response_ids: list[int]  # up to and including the first EOS (past it: ignore_eos)
    logprobs: list[float]  # sampled-token log-probs after temperature
    finish_reason: int  # FINISH_STOP or FINISH_LENGTH
    # in-flight updates: each token's policy version; None: the engine's one
    versions: list[int] | None = None


@dataclass
class SamplingSettings:
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 16
    ignore_eos: bool = False  # benchmarks: every response runs to its cap


class Engine(Protocol):
    """What a rollout actor asks of its engine."""

    eos_id: int

    def generate(self, prompts: list[list[int]], sampling: SamplingSettings, seeds: list[int],
                 max_new_tokens: list[int] | None = None) -> list[Generation]:
        """One sampled response per prompt, seeded per prompt; ``max_new_tokens`` caps each prompt's below
        ``sampling.max_new_tokens`` (a trajectory's last turn gets what its token budget has left)."""
        ...

    def score(self, sequences: list[list[int]], prompt_lengths: list[int]) -> list[list[float]]:
        """Log-prob of each token after the prompt (temperature 1): the probe."""
        ...

    def load_weights(self, weights: dict[str, torch.Tensor], version: int = 0) -> list[str]:
        """New policy weights (HF names) in place, as policy ``version``; returns the model's parameters that
        were not loaded."""
        ...

    # vLLM's weight transfer (learner.weight_sync nccl | ipc), in this order: init once, then per sync
    # start, receive (while learner rank 0 sends), finish
    def init_weight_transfer(self, init_info: dict) -> None: ...

    def start_weight_transfer(self) -> None: ...

    def receive_weight_transfer(self, update_info: dict) -> None: ...

    def finish_weight_transfer(self) -> list[str]:
        """The model's parameters that this sync did not load."""
        ...

    def set_weight_version(self, version: int) -> None:
        """The policy version the engine's weights are now (vLLM reports it with each output)."""
        ...


class WeightLoadError(TetherError, RuntimeError):
    """A sync after which some of the engine's parameters still hold the previous version's weights."""


def check_loaded(missing: list[str], engine: str, what: str) -> None:
    """Fail the sync when any of the engine's parameters was not loaded by it, naming them."""
    if missing:
        shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
        raise WeightLoadError(f"{engine}: {what} did not load {len(missing)} of the engine's parameters "
                              f"({shown}); they would keep the previous version's weights. Every parameter "
                              "of the policy must be sent at every sync")


def check_device(device: str, role: str, own_gpus_only: bool = True) -> str:
    """``device`` as the config decided it; a CUDA role on a node without CUDA is named, not moved to CPU.
    ``own_gpus_only``: a CUDA role inside a Ray actor sees only the GPUs Ray assigned it, also where Ray
    leaves every GPU visible (``RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES``): vLLM and transformers take
    the first visible GPU, which is then the actor's own (set before torch touches CUDA, which reads the
    variable once). A learner rank picks its GPU by index instead (``local_gpu_index``)."""
    if device == "cuda" and own_gpus_only:
        import os

        from services.devices import assigned_gpus, visible_gpus

        visible = visible_gpus(assigned_gpus(), os.environ.get("CUDA_VISIBLE_DEVICES"))
        if visible is not None:
            os.environ["CUDA_VISIBLE_DEVICES"] = visible
    if device == "cuda" and not torch.cuda.is_available():
        from services.model_source import node_name

        raise RuntimeError(f"{node_name()}, role {role}: the config gives this role GPUs (num_gpus > 0), but "
                           "torch sees no CUDA device here")
    return device


def in_flight_args(in_flight: str) -> dict:
    """vLLM's arguments for ``rollout.in_flight_updates``: loads land with requests running, where vLLM can
    neither reset its prefix cache nor keep a step queued ahead (async scheduling, its default on GPU, would
    run a step launched before a load after it, and its tokens would carry the new version)."""
    return {} if in_flight == "off" else {"enable_prefix_caching": False, "async_scheduling": False}


class VLLMEngine:
    """vLLM in the actor's own process (single-process mode: 2-5 s starts, tensors pass directly); with
    tensor parallelism (executor 'mp') its workers run in a process per GPU of the actor."""

    def __init__(self, model_dir: str, spec: EngineSpec | None = None) -> None:
        """``spec.lora_rank``: the learner trains LoRA adapters of this rank; where vLLM's model takes
        adapters the engine starts with LoRA on and each sync loads the adapter alone (``takes_adapters``)."""
        from services.devices import build_llm

        spec = spec or EngineSpec()
        # in-flight updates load with requests running, where vLLM cannot reset its prefix cache
        self.prefix_caching = spec.in_flight == "off"
        lora_rank, weight_transfer, engine_args, device = (spec.lora_rank, spec.weight_transfer,
                                                           spec.engine_args, spec.device)
        self.device = device
        # the adapter of the version in force (adapter-only sync); None: base weights
        self.lora_request = None
        self.takes_adapters = lora_rank is not None and vllm_takes_adapters(model_dir)
        lora_args = ({"enable_lora": True, "max_lora_rank": lora_rank, "max_loras": 1} if self.takes_adapters
                     else {})
        weight_transfer_args = {}
        if weight_transfer is not None:  # vLLM's trainer-to-engine transfer: "nccl" or "ipc" (GPU)
            from vllm.config import WeightTransferConfig

            weight_transfer_args["weight_transfer_config"] = WeightTransferConfig(backend=weight_transfer)
        # An eager engine on CPU still meets torch.compile: vLLM compiles its sampler's log-prob rank helper
        # with inductor on the first call that returns log-probs (measured: 1.2 s of the first generate with a
        # warm inductor cache, a C++ build without one; steady calls and log-probs unchanged when eager)
        self.eager = device == "cpu" and bool((engine_args or {}).get("enforce_eager", True))
        self.llm = build_llm(
            model_dir, spec.seed, spec.max_model_len, spec.kv_cache_mib, spec.dtype, device, engine_args,
            spec.cpu_core, spec.cpu_threads,
            # log-probs of the distribution actually sampled from (after temperature)
            logprobs_mode="processed_logprobs",
            **in_flight_args(spec.in_flight),
            worker_extension_cls="actors.vllm_extension.WeightSyncExtension",
            **weight_transfer_args, **lora_args,
        )
        self.adapter_root = None
        if self.takes_adapters:  # each version's adapter in a directory of its own, which vLLM loads from
            import tempfile

            self.adapter_root = tempfile.mkdtemp(prefix="tether-adapters-")
        self.eos_id = self.llm.get_tokenizer().eos_token_id

    def compile_stance(self):
        """Around every vLLM call that samples or scores: nothing compiled when the engine is eager on CPU
        (see __init__)."""
        return torch.compiler.set_stance("force_eager") if self.eager else nullcontext()

    def generate(self, prompts: list[list[int]], sampling: SamplingSettings, seeds: list[int],
                 max_new_tokens: list[int] | None = None) -> list[Generation]:
        from vllm import SamplingParams, TokensPrompt

        from services.experience import FINISH_LENGTH, FINISH_STOP  # here: the driver imports this module

        caps = max_new_tokens or [sampling.max_new_tokens] * len(prompts)
        params = [
            SamplingParams(
                temperature=sampling.temperature, top_p=sampling.top_p,
                max_tokens=min(cap, sampling.max_new_tokens), logprobs=0, seed=seed,
                ignore_eos=sampling.ignore_eos,
            )
            for seed, cap in zip(seeds, caps, strict=True)
        ]
        with self.compile_stance():
            outputs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params,
                                        use_tqdm=False, lora_request=self.lora_request)
        generations = []
        for out in outputs:
            completion = out.outputs[0]
            ids = list(completion.token_ids)
            logprobs = [step[token].logprob for step, token in zip(completion.logprobs, ids, strict=True)]
            reason = FINISH_LENGTH if completion.finish_reason == "length" else FINISH_STOP
            generations.append(Generation(ids, logprobs, reason))
        return generations

    def score(self, sequences: list[list[int]], prompt_lengths: list[int]) -> list[list[float]]:
        """Log-prob of each token after the prompt, via ``prompt_logprobs`` (temperature 1)."""
        from vllm import SamplingParams, TokensPrompt

        params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0)
        prompts = [TokensPrompt(prompt_token_ids=s) for s in sequences]
        with self.compile_stance():
            if self.takes_adapters and self.device == "cpu":
                # vLLM 0.32's CPU LoRA maps the prompt log-probs of a batch of several sequences wrongly (an
                # einsum shape error that ends the engine; with an adapter or without): one sequence a call
                outputs = [out for p in prompts
                           for out in self.llm.generate([p], params, use_tqdm=False,
                                                        lora_request=self.lora_request)]
            else:
                outputs = self.llm.generate(prompts, params, use_tqdm=False, lora_request=self.lora_request)
        scored = []
        for out, seq, plen in zip(outputs, sequences, prompt_lengths, strict=True):
            scored.append([out.prompt_logprobs[i][seq[i]].logprob for i in range(plen, len(seq))])
        return scored

    def load_weights(self, weights: dict[str, torch.Tensor], version: int = 0) -> list[str]:
        missing = self.llm.collective_rpc("load_policy_weights", args=(weights,))
        self.set_weight_version(version)
        if self.prefix_caching:  # cached keys were computed by the old weights
            self.llm.reset_prefix_cache()
        return sorted(set().union(*missing))  # every worker's (tensor parallel: each holds its shard)

    def load_adapter(self, weights: dict[str, torch.Tensor], adapter_config: dict,
                     policy_version: int) -> None:
        """Version ``policy_version``'s LoRA adapter (PEFT's names and config), loaded now and generated with
        from here on; the previous version's goes. The base weights stay as they are."""
        import json
        import os
        import shutil

        from safetensors.torch import save_file
        from vllm.lora.request import LoRARequest

        if not self.takes_adapters:
            raise WeightLoadError("this engine started without LoRA (its vLLM model takes no adapters): it "
                                  "loads merged weights")
        path = os.path.join(self.adapter_root, f"v{policy_version}")
        os.makedirs(path, exist_ok=True)
        save_file({k: v.contiguous() for k, v in weights.items()},
                  os.path.join(path, "adapter_model.safetensors"))
        with open(os.path.join(path, "adapter_config.json"), "w") as f:
            json.dump(adapter_config, f)
        request = LoRARequest(f"policy-v{policy_version}", policy_version, path, load_inplace=True)
        if not self.llm.llm_engine.add_lora(request):
            raise WeightLoadError(f"vLLM did not load the adapter of version {policy_version} from {path}")
        previous, self.lora_request = self.lora_request, request
        if previous is not None and previous.lora_int_id != request.lora_int_id:
            self.llm.llm_engine.remove_lora(previous.lora_int_id)
            shutil.rmtree(previous.lora_path, ignore_errors=True)
        self.llm.reset_prefix_cache()  # cached keys were computed by the old adapter

    def init_weight_transfer(self, init_info: dict) -> None:
        """This engine's side of vLLM's weight transfer (NCCL: join the learner's group; collective)."""
        self.llm.init_weight_transfer_engine({"init_info": init_info})

    def start_weight_transfer(self) -> None:
        self.llm.collective_rpc("begin_load_record")
        self.llm.start_weight_update()

    def receive_weight_transfer(self, update_info: dict) -> None:
        self.llm.update_weights({"update_info": update_info})

    def finish_weight_transfer(self) -> list[str]:
        self.llm.finish_weight_update()
        missing = self.llm.collective_rpc("end_load_record")
        self.llm.reset_prefix_cache()  # cached keys were computed by the old weights
        return sorted(set().union(*missing))

    def set_weight_version(self, version: int) -> None:
        self.llm.llm_engine.set_weight_version(str(version))


class HFEngine:
    """transformers ``generate``: the fallback engine, and the reference for what vLLM must match."""

    def __init__(self, model_dir: str, seed: int, dtype: str = "float32", device: str = "cpu") -> None:
        from services.models import load_causal_lm, load_tokenizer

        self.device = device
        self.takes_adapters = False  # learner.lora: merged weights
        self.model = load_causal_lm(model_dir, dtype).to(self.device)
        self.tokenizer = load_tokenizer(model_dir)
        self.eos_id = self.tokenizer.eos_token_id
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.eos_id

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], sampling: SamplingSettings, seeds: list[int],
                 max_new_tokens: list[int] | None = None) -> list[Generation]:
        from services.experience import FINISH_LENGTH, FINISH_STOP, pad_left

        torch.manual_seed(seeds[0] if seeds else 0)
        input_ids = pad_left(prompts, self.pad_id).to(self.device)
        attention_mask = pad_left([[1] * len(p) for p in prompts], 0).to(self.device)
        out = self.model.generate(
            input_ids=input_ids, attention_mask=attention_mask, do_sample=True,
            temperature=sampling.temperature, top_p=sampling.top_p, top_k=0,
            max_new_tokens=sampling.max_new_tokens, eos_token_id=self.eos_id, pad_token_id=self.pad_id,
            output_scores=True, return_dict_in_generate=True,
        )
        new_tokens = out.sequences[:, input_ids.shape[1]:]
        # processed scores: logits after temperature/top-p, i.e. the distribution sampled from
        logprobs = torch.stack([torch.log_softmax(s.float(), -1) for s in out.scores], dim=1)
        token_logprobs = logprobs.gather(-1, new_tokens.unsqueeze(-1)).squeeze(-1)
        generations = []
        caps = max_new_tokens or [sampling.max_new_tokens] * len(prompts)
        for ids, lps, cap in zip(new_tokens.tolist(), token_logprobs.tolist(), caps, strict=True):
            # a row's own cap: what it sampled up to there is what it would have
            ids, lps = ids[:cap], lps[:cap]
            if self.eos_id in ids:
                end = ids.index(self.eos_id) + 1
                generations.append(Generation(ids[:end], lps[:end], FINISH_STOP))
            else:
                generations.append(Generation(ids, lps, FINISH_LENGTH))
        return generations

    @torch.no_grad()
    def score(self, sequences: list[list[int]], prompt_lengths: list[int]) -> list[list[float]]:
        scored = []
        for seq, plen in zip(sequences, prompt_lengths, strict=True):
            ids = torch.tensor([seq], device=self.device)
            logprobs = torch.log_softmax(self.model(input_ids=ids).logits[0, :-1].float(), -1)
            scored.append(logprobs[torch.arange(plen - 1, len(seq) - 1), ids[0, plen:]].tolist())
        return scored

    def load_weights(self, weights: dict[str, torch.Tensor], version: int = 0) -> list[str]:
        loaded = self.model.load_state_dict(weights, strict=False)
        if loaded.unexpected_keys:
            raise ValueError(f"weights for parameters this model does not have: {loaded.unexpected_keys[:5]}")
        return sorted(loaded.missing_keys)

    # vLLM's weight transfer has no transformers side (the config refuses it for rollout.engine='hf')
    def init_weight_transfer(self, init_info: dict) -> None:
        _no_weight_transfer()

    def start_weight_transfer(self) -> None:
        _no_weight_transfer()

    def receive_weight_transfer(self, update_info: dict) -> None:
        _no_weight_transfer()

    def finish_weight_transfer(self) -> list[str]:
        _no_weight_transfer()

    def set_weight_version(self, version: int) -> None:
        _no_weight_transfer()


def _no_weight_transfer() -> None:
    raise ValueError("learner.weight_sync 'nccl' and 'ipc' are vLLM's weight transfer: they need "
                     "rollout.engine='vllm', not 'hf'")


def vllm_takes_adapters(model_dir: str) -> bool:
    """Whether vLLM's implementation of the model's architecture takes LoRA adapters (its GPT-2 does not)."""
    import json
    import os

    from vllm.model_executor.models import ModelRegistry, supports_lora

    with open(os.path.join(model_dir, "config.json")) as f:
        architectures = json.load(f).get("architectures") or []
    classes = [ModelRegistry._try_load_model_cls(a) for a in architectures]
    return bool(classes) and all(c is not None and supports_lora(c) for c in classes)


def make_engine(model_dir: str, spec: EngineSpec) -> Engine:
    if spec.kind == "vllm":
        return VLLMEngine(model_dir, spec)
    if spec.kind == "hf":
        return HFEngine(model_dir, spec.seed, spec.dtype, spec.device)
    raise ValueError(f"unknown rollout engine {spec.kind!r}; expected 'vllm' or 'hf'")
