"""What each actor is built from, and nothing else: one frozen spec per role, made by the driver's plan
(``learner.plan.plan``) from the job's settings, resolved once. An actor never sees the whole ``JobConfig``;
a test builds an actor from a spec of its own."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from services.model_source import ModelSource

if TYPE_CHECKING:  # the settings' classes are the driver's: an actor only carries the sections it was given
    from services.settings_sampling import JudgeConfig, RewardConfig


@dataclass(frozen=True)
class EngineSpec:
    """One generation engine (``actors.engines.make_engine``): vLLM's in the actor's process, or
    transformers'."""

    kind: str = "vllm"  # rollout.engine: 'vllm' or 'hf'
    seed: int = 0  # the engine's own seed (run.seed + the engine's index); each episode has a seed of its own
    max_model_len: int = 64  # the longest prompt plus response (or trajectory) the job makes, plus one
    kv_cache_mib: int = 64
    dtype: str = "float32"  # learner.dtype: engines compute in the learner's dtype
    cpu_core: int | None = None  # the engine's index on its machine: vLLM's CPU worker binds from there
    device: str = "cpu"  # the device the role reserved
    engine_args: dict | None = None  # extra vLLM ``LLM(...)`` arguments (rollout.vllm_engine_args)
    # learner.weight_sync 'nccl' | 'ipc': vLLM's transfer; None: object store
    weight_transfer: str | None = None
    lora_rank: int | None = None  # learner.lora.rank: vLLM starts with LoRA on where its model takes adapters
    # rollout.in_flight_updates: 'keep_kv' | 'partial' step vLLM in a loop (actors/engine_loop.py)
    in_flight: str = "off"
    cpu_threads: int = 1  # rollout.engine_threads: vLLM's CPU worker binds that many cores


@dataclass(frozen=True)
class RolloutSpec:
    """A rollout actor: the policy's files as its node reaches them, and its engine."""

    model: ModelSource | str
    engine: EngineSpec = EngineSpec()


@dataclass(frozen=True)
class ReferenceSpec:
    """A reference (or distillation's teacher): the model it scores with and how."""

    model: ModelSource | str
    backend: str = "hf"  # reference.backend: a transformers forward, or vLLM's prompt log-probs
    dtype: str = "float32"
    max_model_len: int = 64  # backend vllm
    kv_cache_mib: int = 128  # backend vllm
    temperature: float = 1.0  # rollout.temperature: log-probs of the distribution the engines sample
    device: str = "cpu"
    torch_threads: int | None = None  # reference.torch_threads
    # backend vllm's ``LLM(...)`` arguments (JobConfig.reference_vllm_engine_args)
    engine_args: dict | None = None
    # backend hf: score rows packed in micro-batches of this many tokens
    max_tokens_per_microbatch: int | None = None


@dataclass(frozen=True)
class RewardSpec:
    """A reward actor: the task whose reward function (or model, service, judge) scores a chunk."""

    task_name: str
    task_options: dict
    policy: ModelSource | str  # the policy's tokenizer decodes the responses
    kind: str = "function"  # reward.kind: function | model | remote | judge
    model_path: ModelSource | str | None = None  # kind model: the classifier; kind judge: the judge's model
    score_clip: float | None = None
    device: str = "cpu"
    label: int | str | None = None  # kind model: the classifier's label whose logit is the score
    remote: RewardConfig | None = None  # kind remote: the service's settings
    # kind remote: the driver's token, for actors whose environment lacks it
    forwarded_token: str | None = None
    judge: JudgeConfig | None = None  # kind judge
    judge_engine_args: dict | None = None


@dataclass(frozen=True)
class EnvironmentSpec:
    """An environment worker: the environment's factory, its arguments and the step deadline."""

    environment: str  # task.environment, 'package.module:factory'
    kwargs: dict
    policy: ModelSource | str  # the policy's tokenizer encodes the observations
    step_timeout_s: float = 30.0
