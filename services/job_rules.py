"""The rules across settings sections, checked on every JobConfig (``JOB_RULES``, in this order); each
function takes the JobConfig and returns its refusal or None. A rule within one section lives with that
section."""

from __future__ import annotations

from typing import Any

from services.rules import Rules
from services.settings_training import VLLM_LORA_RANKS

JOB_RULES = Rules("")
rule = JOB_RULES.rule
EPISODIC_TASKS = ("environment", "agent")  # rewarded by their episodes, not per response
AGENT = {"task": {"name": "agent", "path": "rows.jsonl"}, "rollout": {"agent": "my_agent:run"},
         "model": {"path": "policy"}}


# --- the algorithm's own combinations ---

@rule("ppo.grpo_normalize", "kl.placement",
      example={"ppo": {"advantage": "grpo", "grpo_normalize": "return"}, "rollout": {"samples_per_prompt": 4},
               "kl": {"placement": "loss", "loss_form": "kl_to_go"}})
def return_normalisation_needs_the_kl_in_the_return(cfg: Any) -> str | None:
    if cfg.ppo.grpo_normalize == "return" and cfg.kl.placement == "loss":
        return ("ppo.grpo_normalize='return' normalises score - beta * KL_b, but kl.placement='loss' puts no "
                "KL in the return; set ppo.grpo_normalize='score'")
    return None


@rule("reward.overlong_buffer", "rollout.max_new_tokens",
      example={"reward": {"overlong_buffer": 4, "overlong_penalty": 1.0}})
def overlong_buffer_needs_max_new_tokens(cfg: Any) -> str | None:
    if cfg.reward.overlong_buffer is not None and cfg.rollout.max_new_tokens is None:
        return ("reward.overlong_buffer needs rollout.max_new_tokens: the penalty is measured back from it "
                "(Lmax), so set it explicitly")
    return None


@rule("reward.overlong_buffer", "rollout.max_new_tokens",
      example={"reward": {"overlong_buffer": 8, "overlong_penalty": 1.0}, "rollout": {"max_new_tokens": 8}})
def overlong_buffer_within_max_new_tokens(cfg: Any) -> str | None:
    buffer, cap = cfg.reward.overlong_buffer, cfg.rollout.max_new_tokens
    if buffer is not None and cap is not None and buffer >= cap:
        return (f"reward.overlong_buffer={buffer} must be less than rollout.max_new_tokens={cap}: the "
                "penalty starts max_new_tokens - overlong_buffer tokens in, so every response would pay it")
    return None


@rule("reward.overlong_buffer", "reward.missing_eos_penalty",
      example={"reward": {"overlong_buffer": 4, "overlong_penalty": 1.0, "missing_eos_penalty": 1.0},
               "rollout": {"max_new_tokens": 8}})
def one_penalty_for_cut_responses(cfg: Any) -> str | None:
    if cfg.reward.overlong_buffer is not None and cfg.reward.missing_eos_penalty is not None:
        return ("reward.overlong_buffer and reward.missing_eos_penalty both penalise responses cut at "
                "rollout.max_new_tokens (which would pay both); choose one")
    return None


@rule("ppo.mask_truncated", "reward.missing_eos_penalty",
      example={"ppo": {"mask_truncated": True}, "reward": {"missing_eos_penalty": 1.0}})
def masked_rows_pay_no_penalty(cfg: Any) -> str | None:
    if cfg.ppo.mask_truncated and cfg.reward.missing_eos_penalty is not None:
        return ("ppo.mask_truncated leaves the responses cut at rollout.max_new_tokens out of the loss, so "
                "reward.missing_eos_penalty, their score, would reach only their group's baseline; set one "
                "of them off")
    return None


@rule("ppo.mask_truncated", "kl.placement",
      example={"ppo": {"mask_truncated": True}, "kl": {"placement": "loss", "loss_form": "kl_to_go"}})
def loss_kl_over_every_row(cfg: Any) -> str | None:
    if cfg.ppo.mask_truncated and cfg.kl.placement == "loss":
        return ("ppo.mask_truncated with kl.placement='loss' is refused: the KL term in the loss is the "
                "gradient of the batch's mean response KL, the statistic the controller is fed, over every "
                "row; leaving the truncated rows out of it would make the two differ. Use "
                "kl.placement='reward'")
    return None


@rule("kl.controller", "kl.horizon", "rollout.batch_size", example={"kl": {"horizon": 64}})
def batch_within_the_kl_horizon(cfg: Any) -> str | None:
    r, kl = cfg.rollout, cfg.kl
    if kl.controller == "adaptive" and r.batch_size > kl.horizon:
        return (f"rollout.batch_size={r.batch_size} exceeds kl.horizon={kl.horizon}: the adaptive KL "
                "controller updates once per batch with n_steps=batch_size and refuses more than its horizon "
                "(beta could flip sign); raise kl.horizon or lower rollout.batch_size")
    return None


@rule("rollout.temperature", "reference.backend",
      example={"rollout": {"temperature": 0.7}, "reference": {"backend": "vllm"}})
def reference_scores_at_the_sampling_temperature(cfg: Any) -> str | None:
    temperature = cfg.rollout.temperature
    # the reference actor refuses it too (actors/reference.py): vLLM's prompt_logprobs are at temperature 1
    if cfg.reference.backend == "vllm" and temperature != 1:
        return (f"rollout.temperature={temperature} is refused with reference.backend='vllm': vLLM's "
                "prompt_logprobs score at temperature 1, while the engines sample and the learner scores at "
                f"{temperature}, so the KL would be taken to another distribution than the reference "
                "policy's; use reference.backend='hf' (it scores at rollout.temperature) or "
                "rollout.temperature=1.0")
    return None


# --- how a batch divides into groups, chunks, minibatches and ranks ---

@rule("rollout.batch_size", "rollout.samples_per_prompt",
      example={"rollout": {"batch_size": 100, "samples_per_prompt": 8, "chunk_size": 8},
               "ppo": {"minibatch_size": 4}})
def batch_of_whole_groups(cfg: Any) -> str | None:
    r = cfg.rollout
    if r.batch_size % r.samples_per_prompt:
        return (f"rollout.batch_size={r.batch_size} counts episodes: it must be a multiple of "
                f"rollout.samples_per_prompt={r.samples_per_prompt}")
    return None


@rule("rollout.chunk_size", "rollout.samples_per_prompt",
      example={"rollout": {"chunk_size": 12, "samples_per_prompt": 8}})
def chunk_of_whole_groups(cfg: Any) -> str | None:
    r = cfg.rollout
    if r.chunk_size % r.samples_per_prompt:
        # chunks of whole groups, aligned, never split a prompt's group over chunks or learner ranks
        return (f"rollout.chunk_size={r.chunk_size} is not a multiple of rollout.samples_per_prompt="
                f"{r.samples_per_prompt}: a prompt's group must stay in one chunk (and so on one learner "
                "rank)")
    return None


@rule("rollout.batch_size", "rollout.chunk_size", example={"rollout": {"chunk_size": 48}})
def batch_of_whole_chunks(cfg: Any) -> str | None:
    r = cfg.rollout
    if r.batch_size % r.chunk_size:
        return f"rollout.batch_size={r.batch_size} is not a multiple of rollout.chunk_size={r.chunk_size}"
    return None


@rule("rollout.batch_size", "rollout.chunk_size", "learner.world_size",
      example={"rollout": {"chunk_size": 64}, "learner": {"world_size": 4}, "ppo": {"minibatch_size": 32}})
def chunks_split_over_ranks(cfg: Any) -> str | None:
    r, w = cfg.rollout, cfg.learner.world_size
    chunks = r.batch_size // r.chunk_size
    if chunks % w:
        return (f"rollout.batch_size/chunk_size = {chunks} chunks cannot be split over "
                f"learner.world_size={w} ranks")
    return None


@rule("rollout.batch_size", "ppo.minibatch_size", example={"ppo": {"minibatch_size": 48}})
def batch_of_whole_minibatches(cfg: Any) -> str | None:
    r, p = cfg.rollout, cfg.ppo
    if r.batch_size % p.minibatch_size:
        return f"rollout.batch_size={r.batch_size} is not a multiple of ppo.minibatch_size={p.minibatch_size}"
    return None


@rule("ppo.minibatch_size", "learner.world_size", "learner.zero_stage",
      example={"ppo": {"minibatch_size": 2}, "learner": {"world_size": 4}, "rollout": {"chunk_size": 32}})
def minibatch_splits_over_ranks(cfg: Any) -> str | None:
    p, w = cfg.ppo, cfg.learner.world_size
    if p.minibatch_size % w:
        return (f"ppo.minibatch_size={p.minibatch_size} cannot be split over learner.world_size={w} ranks"
                + (" (ZeRO-3 partitions every step over all ranks)" if cfg.learner.zero_stage == 3 else ""))
    return None


# --- in-flight weight updates ---

IN_FLIGHT = {"rollout": {"mode": "async", "in_flight_updates": "keep_kv"}}


@rule("rollout.ignore_eos", "rollout.engine", example={"rollout": {"ignore_eos": True, "engine": "hf"}})
def ignore_eos_in_vllm(cfg: Any) -> str | None:
    if cfg.rollout.ignore_eos and cfg.rollout.engine != "vllm":
        return ("rollout.ignore_eos is vLLM's sampling setting; transformers' generate "
                "(rollout.engine='hf') stops at EOS: use rollout.engine='vllm'")
    return None


@rule("rollout.ignore_eos", "task.name",
      example={**AGENT, "rollout": {**AGENT["rollout"], "ignore_eos": True}})
def ignore_eos_single_turn(cfg: Any) -> str | None:
    if cfg.rollout.ignore_eos and cfg.task.name in EPISODIC_TASKS:
        return (f"rollout.ignore_eos times fixed-length responses; task.name={cfg.task.name!r} runs episodes "
                "whose turns end at EOS: unset it")
    return None


@rule("rollout.ignore_eos", "reward.missing_eos_penalty",
      example={"rollout": {"ignore_eos": True}, "reward": {"missing_eos_penalty": -1.0}})
def ignore_eos_leaves_no_eos_to_miss(cfg: Any) -> str | None:
    if cfg.rollout.ignore_eos and cfg.reward.missing_eos_penalty is not None:
        return (f"rollout.ignore_eos runs every response to rollout.max_new_tokens, so "
                f"reward.missing_eos_penalty={cfg.reward.missing_eos_penalty} would score every one; set "
                "reward.missing_eos_penalty=null")
    return None


@rule("rollout.engine_threads", "rollout.engine", example={"rollout": {"engine_threads": 2, "engine": "hf"}})
def engine_threads_in_vllm(cfg: Any) -> str | None:
    if cfg.rollout.engine_threads > 1 and cfg.rollout.engine != "vllm":
        return (f"rollout.engine_threads={cfg.rollout.engine_threads} binds vLLM's CPU worker; transformers' "
                "generate (rollout.engine='hf') runs on torch's threads: unset it")
    return None


@rule("rollout.engine_threads", "cluster.rollout.num_gpus",
      example={"rollout": {"engine_threads": 2}, "cluster": {"rollout": {"num_gpus": 1}}})
def engine_threads_on_cpu(cfg: Any) -> str | None:
    if cfg.rollout.engine_threads > 1 and cfg.device("rollout") != "cpu":
        return (f"rollout.engine_threads={cfg.rollout.engine_threads} binds vLLM's CPU worker to cores, but "
                "the engines run on GPUs (cluster.rollout.num_gpus > 0): unset it")
    return None


@rule("rollout.in_flight_updates", "rollout.mode", example={"rollout": {"in_flight_updates": "partial"}})
def in_flight_updates_are_async(cfg: Any) -> str | None:
    r = cfg.rollout
    if r.in_flight_updates != "off" and (r.mode != "async" or r.max_staleness < 1):
        return (f"rollout.in_flight_updates={r.in_flight_updates!r} loads a new version into a batch being "
                "generated while the learner trains, which needs rollout.mode='async' with "
                f"rollout.max_staleness >= 1 (got mode {r.mode!r}, max_staleness {r.max_staleness}): in sync "
                "mode nothing generates during an update")
    return None


@rule("rollout.in_flight_updates", "rollout.engine",
      example={"rollout": {**IN_FLIGHT["rollout"], "engine": "hf"}})
def in_flight_updates_need_vllm(cfg: Any) -> str | None:
    if cfg.rollout.in_flight_updates != "off" and cfg.rollout.engine != "vllm":
        return (f"rollout.in_flight_updates={cfg.rollout.in_flight_updates!r} steps vLLM's engine between "
                "decoding steps; transformers' generate (rollout.engine='hf') runs a whole batch in one "
                "call, so no version can load inside it; use rollout.engine='vllm' or "
                "rollout.in_flight_updates='off'")
    return None


@rule("rollout.in_flight_updates", "learner.weight_sync",
      example={**IN_FLIGHT, "learner": {"weight_sync": "nccl"}, "rollout": {**IN_FLIGHT["rollout"],
               "gpu_memory_utilization": 0.3},
               "cluster": {"rollout": {"num_gpus": 1}, "learner": {"num_gpus": 1}}})
def in_flight_updates_through_the_object_store(cfg: Any) -> str | None:
    if cfg.rollout.in_flight_updates != "off" and cfg.learner.weight_sync != "object_store":
        return (f"rollout.in_flight_updates={cfg.rollout.in_flight_updates!r} with learner.weight_sync="
                f"{cfg.learner.weight_sync!r}: vLLM's weight transfer is four calls the learner drives in "
                "step with the engine, which the engine's decoding loop cannot interleave yet; in-flight "
                "loads take the weights through 'object_store'")
    return None


@rule("rollout.in_flight_updates", "learner.lora.rank", "learner.lora.sync",
      example={**IN_FLIGHT, "learner": {"lora": {"rank": 8, "sync": "adapter"}}})
def in_flight_updates_load_merged_weights(cfg: Any) -> str | None:
    if cfg.rollout.in_flight_updates != "off" and cfg.adapter_sync:
        return (f"rollout.in_flight_updates={cfg.rollout.in_flight_updates!r} with LoRA's adapter-only sync "
                f"(learner.lora.sync={cfg.learner.lora.sync!r}): vLLM fixes a request's adapter when the "
                "request is added, so a request in flight would keep the old version's adapter after the "
                "load; set learner.lora.sync='merged' (float32), or rollout.in_flight_updates='off'")
    return None


# --- LoRA and the reference ---

@rule("learner.lora.rank", "learner.weight_sync",
      example={"learner": {"lora": {"rank": 8}, "weight_sync": "nccl"},
               "rollout": {"gpu_memory_utilization": 0.3},
               "cluster": {"rollout": {"num_gpus": 1}, "learner": {"num_gpus": 1}}})
def lora_syncs_through_the_object_store(cfg: Any) -> str | None:
    lora, sync = cfg.learner.lora, cfg.learner.weight_sync
    if lora.rank and sync != "object_store":
        return (f"learner.lora.rank={lora.rank} with learner.weight_sync={sync!r}: vLLM's weight transfer "
                "announces the learner's parameters by name, and LoRA's are the adapters; LoRA's merged "
                "weights travel through 'object_store'")
    return None


@rule("learner.lora.sync", "learner.dtype",
      example={"learner": {"lora": {"rank": 8, "sync": "merged"}, "dtype": "bfloat16"}})
def merged_lora_needs_float32(cfg: Any) -> str | None:
    lora = cfg.learner.lora
    if lora.rank and lora.sync == "merged" and cfg.learner.dtype == "bfloat16":
        return (f"learner.lora.sync='merged' with learner.dtype={cfg.learner.dtype!r}: merged into bf16 "
                "weights, the adapters' updates round away (W + BA rounds to W), so the engines would sample "
                "another policy than the learner trains (measured on SmolLM2: the probe 1.39 > 1.0 at "
                "iteration 5); use learner.lora.sync 'adapter' or 'auto', or float32")
    return None


@rule("learner.lora.rank", "learner.lora.sync", "rollout.engine",
      example={"learner": {"lora": {"rank": 1024, "sync": "adapter"}}})
def lora_rank_within_vllms(cfg: Any) -> str | None:
    rank = cfg.learner.lora.rank
    if rank > VLLM_LORA_RANKS[-1] and cfg.rollout.engine == "vllm" and cfg.adapter_sync:
        return (f"learner.lora.rank={rank} is above vLLM's largest LoRA rank, {VLLM_LORA_RANKS[-1]}: an "
                "engine whose model takes adapters could not load it; learner.lora.sync='merged' sends the "
                "merged weights instead")
    return None


@rule("learner.lora.reference", "reference.*",
      example={"learner": {"lora": {"rank": 8, "reference": "base"}}, "reference": {"num_actors": 2}})
def base_reference_starts_no_actor(cfg: Any) -> str | None:
    changed = cfg.reference.changed_fields()
    if cfg.learner.reference_in_learner and changed:
        return (f"reference.{changed[0]}={getattr(cfg.reference, changed[0])!r} is set, but with "
                "learner.lora.reference='base' the learner scores the reference itself and no reference "
                f"actor starts; set learner.lora.reference='actor' to keep them, or reference.{changed[0]} "
                "back to its default")
    return None


@rule("reference.placement", "reference.*", "cluster.reference.*",
      example={"reference": {"placement": "learner", "num_actors": 2}})
def reference_copy_in_learner_starts_no_actor(cfg: Any) -> str | None:
    if cfg.reference.placement != "learner" or cfg.learner.reference_in_learner:
        return None  # LoRA's base reference: base_reference_starts_no_actor names the setting
    changed = [f"reference.{k}" for k in cfg.reference.changed_fields() if k != "placement"]
    changed += [f"cluster.reference.{k}" for k in cfg.cluster.reference.changed_fields()]
    if changed:
        return (f"{changed[0]} is set, but with reference.placement='learner' each learner rank scores with "
                "its own transformers copy of the initial policy, on its own device, and no reference actor "
                f"starts; set reference.placement='actor' to keep them, or {changed[0]} back to its default")
    return None


@rule("reward.placement", "reward.kind", "reward.num_actors", "cluster.reward.*",
      example={"reward": {"placement": "learner", "kind": "remote", "url": "http://127.0.0.1:8000"}})
def reward_in_learner_is_the_tasks_function(cfg: Any) -> str | None:
    if cfg.reward.placement != "learner":
        return None
    if cfg.reward.kind != "function":
        return (f"reward.placement='learner' scores with the task's function in the learner ranks, but "
                f"reward.kind={cfg.reward.kind!r} runs in reward actors of its own; set "
                "reward.placement='actor'")
    changed = ["reward.num_actors"] if "num_actors" in cfg.reward.changed_fields() else []
    changed += [f"cluster.reward.{k}" for k in cfg.cluster.reward.changed_fields()]
    if changed:
        return (f"{changed[0]} is set, but with reward.placement='learner' the learner ranks score their own "
                "chunks and no reward actor starts; set reward.placement='actor' to keep them, or "
                f"{changed[0]} back to its default")
    return None


# --- devices ---

@rule("learner.weight_sync", "rollout.engine", "cluster.rollout.num_gpus", "cluster.learner.num_gpus",
      example={"learner": {"weight_sync": "nccl"}, "rollout": {"gpu_memory_utilization": 0.3}})
def gpu_weight_transfer_needs_gpus(cfg: Any) -> str | None:
    sync = cfg.learner.weight_sync
    if sync != "object_store" and (cfg.rollout.engine != "vllm" or not cfg.cluster.rollout.num_gpus
                                   or not cfg.cluster.learner.num_gpus):
        return (f"learner.weight_sync={sync!r} is vLLM's GPU weight transfer: it needs rollout.engine='vllm' "
                "and GPUs for the rollout engines and the learner (cluster.rollout.num_gpus, "
                "cluster.learner.num_gpus); on CPU use 'object_store'")
    return None


@rule("rollout.tensor_parallel_size", "cluster.rollout.num_gpus",
      example={"rollout": {"tensor_parallel_size": 2}, "cluster": {"rollout": {"num_gpus": 1}}})
def tensor_parallel_needs_its_gpus(cfg: Any) -> str | None:
    tp, engine_gpus = cfg.rollout.tensor_parallel_size, cfg.cluster.rollout.num_gpus
    if tp > 1 and engine_gpus < tp:
        return (f"rollout.tensor_parallel_size={tp} needs that many GPUs per engine: "
                f"cluster.rollout.num_gpus={engine_gpus}")
    return None


@rule("rollout.tensor_parallel_size", "cluster.rollout.num_gpus",
      example={"rollout": {"tensor_parallel_size": 2}, "cluster": {"rollout": {"num_gpus": 3}}})
def one_worker_per_engine_gpu(cfg: Any) -> str | None:
    tp, engine_gpus = cfg.rollout.tensor_parallel_size, cfg.cluster.rollout.num_gpus
    # the engine's actor holds its bundle's GPUs and vLLM's mp executor runs a worker on each of the first tp
    # it sees: any more would sit idle, a fraction would be shared with another actor
    if tp > 1 and engine_gpus != tp:
        return (f"rollout.tensor_parallel_size={tp} runs one vLLM worker per GPU of the engine's bundle: "
                f"cluster.rollout.num_gpus must be {tp}, got {engine_gpus}")
    return None


@rule("reference.gpu_memory_utilization", "cluster.reference.num_gpus",
      example={"reference": {"backend": "vllm", "gpu_memory_utilization": 0.3}})
def reference_gpu_memory_needs_a_gpu(cfg: Any) -> str | None:
    memory = cfg.reference.gpu_memory_utilization
    if memory is not None and not cfg.cluster.reference.num_gpus:
        return (f"reference.gpu_memory_utilization={memory} sizes vLLM on a GPU, but "
                "cluster.reference.num_gpus=0 runs the reference on CPU; set it to null")
    return None


@rule("reference.gpu_memory_utilization", "cluster.reference.num_gpus",
      example={"reference": {"backend": "vllm", "gpu_memory_utilization": 0.5},
               "cluster": {"reference": {"num_gpus": 0.25}}})
def reference_gpu_memory_within_its_share(cfg: Any) -> str | None:
    memory, share = cfg.reference.gpu_memory_utilization, cfg.cluster.reference.num_gpus
    if memory is not None and share and memory > share:
        return (f"reference.gpu_memory_utilization={memory} exceeds the GPU share the reference reserves, "
                f"cluster.reference.num_gpus={share}: the actors that share its GPU would run out of memory")
    return None


@rule("cluster.learner.num_gpus", "learner.world_size",
      example={"cluster": {"learner": {"num_gpus": 0.5}}, "learner": {"world_size": 2}})
def whole_gpus_per_rank(cfg: Any) -> str | None:
    gpus, w = cfg.cluster.learner.num_gpus, cfg.learner.world_size
    # Ray may give two ranks' fractions of one GPU to both, and each rank computes on its first visible GPU:
    # NCCL cannot run two ranks of one group on one device
    if w > 1 and gpus and not float(gpus).is_integer():
        return (f"cluster.learner.num_gpus={gpus} with learner.world_size={w}: a fraction of a GPU per rank "
                "lets Ray place two ranks on one GPU, where NCCL cannot run them; give each rank whole GPUs "
                "(cluster.learner.num_gpus=1) or use learner.world_size=1")
    return None


# --- the run ---

@rule("run.resume", "run.overwrite", example={"run": {"resume": "latest", "overwrite": True}})
def resume_keeps_the_run_directory(cfg: Any) -> str | None:
    if cfg.run.resume and cfg.run.overwrite:
        return "run.resume and run.overwrite exclude each other: resuming keeps the run directory"
    return None

