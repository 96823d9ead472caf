"""JobConfig: the one pydantic tree every setting lives in. Loads from YAML, takes CLI overrides
(``--kl.target 6``) through pydantic-settings, and validates with messages that name the field."""

from __future__ import annotations

import hashlib
import json
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from services.choices import GROUP_ESTIMATORS
from services.settings_sampling import (
    PROBE_TOLERANCE,
    DistillConfig,
    JudgeConfig,
    ModelConfig,
    ReferenceConfig,
    RewardConfig,
    RolloutConfig,
    TaskConfig,
)
from services.settings_training import (
    ADVANTAGE_LR,
    PRETRAINED_PARAMETERS,
    VLLM_LORA_RANKS,
    CheckpointConfig,
    ClusterConfig,
    KLConfig,
    LearnerConfig,
    LoraConfig,
    MetricsConfig,
    PPOConfig,
    RoleResources,
    RunConfig,
)

# the settings that follow another when unset (JobConfig._defaults_follow): (section, field, what it follows)
FOLLOWED_DEFAULTS = (("ppo", "minibatch_size", "rollout.batch_size"), ("rollout", "chunk_size", "rollout.batch_size"),
                     ("ppo", "lr", "ppo.advantage"))


def _largest_divisor(n: int, at_most: int, fits: Callable[[int], bool]) -> int | None:
    """The largest divisor of ``n`` no larger than ``at_most`` that ``fits``, or None."""
    return next((d for d in range(min(n, at_most), 0, -1) if n % d == 0 and fits(d)), None)


class JobConfig(BaseSettings):
    """All settings of a tether job."""

    model_config = SettingsConfigDict(
        extra="forbid",
        validate_assignment=True,
        # no cli_parse_args: set (even to False) it makes every JobConfig build an argparse parser of the whole tree
        # (pydantic-settings 2.x, 40 ms a config); the command line is learner.main's CliSettingsSource
        cli_implicit_flags=True,
        nested_model_default_partial_update=True,
    )

    model: ModelConfig = Field(default_factory=ModelConfig)
    task: TaskConfig = Field(default_factory=TaskConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    reference: ReferenceConfig = Field(default_factory=ReferenceConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    distill: DistillConfig = Field(default_factory=DistillConfig)
    ppo: PPOConfig = Field(default_factory=PPOConfig)
    # The KL controller's own defaults follow lm-human-preferences (beta 0.15, target 6, horizon 10000).
    # The embedded randomwalks job starts at trlX's adaptive randomwalks beta of 0.05: at 0.15 the
    # KL-regularised optimum of this task samples below 0.95 optimality.
    kl: KLConfig = KLConfig(init_kl_coef=0.05)
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)
    learner: LearnerConfig = Field(default_factory=LearnerConfig)
    run: RunConfig = Field(default_factory=RunConfig)
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)

    @model_validator(mode="after")
    def _defaults_follow(self) -> JobConfig:
        """Unset settings that depend on others take a value that fits what the user did set (listed by
        ``followed_defaults``); they stay unset, so a dumped config records the value and a resume keeps it."""
        r, p, w = self.rollout, self.ppo, self.learner.world_size
        if "minibatch_size" not in p.model_fields_set:
            p.minibatch_size = _largest_divisor(r.batch_size, PPOConfig.model_fields["minibatch_size"].default,
                                                lambda d: d % w == 0) or p.minibatch_size
            p.model_fields_set.discard("minibatch_size")
        if "chunk_size" not in r.model_fields_set:
            r.chunk_size = _largest_divisor(
                r.batch_size, RolloutConfig.model_fields["chunk_size"].default,
                lambda d: d % r.samples_per_prompt == 0 and (r.batch_size // d) % w == 0) or r.chunk_size
            r.model_fields_set.discard("chunk_size")
        if "lr" not in p.model_fields_set:
            p.lr = ADVANTAGE_LR[p.advantage]
            p.model_fields_set.discard("lr")
        return self

    def followed_defaults(self) -> str | None:
        """The job's first line when an unset setting followed another (``_defaults_follow``), else None."""
        followed = []
        for section, name, source in FOLLOWED_DEFAULTS:
            holder = getattr(self, section)
            if name not in holder.model_fields_set and getattr(holder, name) != type(holder).model_fields[name].default:
                source_section, source_name = source.split(".")
                followed.append(f"{section}.{name}={getattr(holder, name):g} follows "
                                f"{source}={getattr(getattr(self, source_section), source_name)}")
        return "defaults: " + "; ".join(followed) + " (set them to choose)" if followed else None

    @model_validator(mode="after")
    def _distillation(self) -> JobConfig:
        d = self.distill
        if d.teacher_path is None:
            unused = [k for k in d.changed_fields() if k != "teacher_path"]
            if unused:
                raise ValueError(f"distill.{unused[0]} is set but distill.teacher_path is not: without a teacher there "
                                 "is no distillation; set distill.teacher_path")
            return self
        if not d.task_reward and self.rollout.dynamic_sampling:
            raise ValueError("rollout.dynamic_sampling drops the groups whose scores tie, and with "
                             "distill.task_reward=false no score is trained on: every group would be dropped")
        return self

    @model_validator(mode="after")
    def _batch_divides(self) -> JobConfig:
        r, p, w = self.rollout, self.ppo, self.learner.world_size
        n = r.samples_per_prompt
        if p.advantage in GROUP_ESTIMATORS and n < 2:
            raise ValueError(f"ppo.advantage={p.advantage!r} takes its baseline over the samples of one prompt: it "
                             f"needs rollout.samples_per_prompt >= 2 (got {n})")
        if p.correction == "none" and r.mode == "async":
            raise ValueError("ppo.correction='none' with rollout.mode='async' would train on rows an older policy "
                             "sampled as if the learner's had: async mode needs the weight pi_prox / pi_behav; set "
                             "ppo.correction to 'tis' or 'mis'")
        if p.grpo_normalize == "return" and self.kl.placement == "loss":
            raise ValueError("ppo.grpo_normalize='return' normalises score - beta * KL_b, but kl.placement='loss' puts "
                             "no KL in the return; set ppo.grpo_normalize='score'")
        if r.dynamic_sampling and p.advantage not in GROUP_ESTIMATORS:
            raise ValueError(f"rollout.dynamic_sampling drops prompt groups whose scores tie, which carry no signal "
                             f"only for a group estimator ({', '.join(sorted(GROUP_ESTIMATORS))}); ppo.advantage="
                             f"{p.advantage!r} learns from every row")
        if self.reward.overlong_buffer is not None:
            if r.max_new_tokens is None:
                raise ValueError("reward.overlong_buffer needs rollout.max_new_tokens: the penalty is measured back "
                                 "from it (Lmax), so set it explicitly")
            if self.reward.overlong_buffer >= r.max_new_tokens:
                raise ValueError(f"reward.overlong_buffer={self.reward.overlong_buffer} must be less than "
                                 f"rollout.max_new_tokens={r.max_new_tokens}: the penalty starts "
                                 "max_new_tokens - overlong_buffer tokens in, so every response would pay it")
            if self.reward.missing_eos_penalty is not None:
                raise ValueError("reward.overlong_buffer and reward.missing_eos_penalty both penalise responses cut at "
                                 "rollout.max_new_tokens (which would pay both); choose one")
        if p.mask_truncated and self.reward.missing_eos_penalty is not None:
            raise ValueError("ppo.mask_truncated leaves the responses cut at rollout.max_new_tokens out of the loss, "
                             "so reward.missing_eos_penalty, their score, would reach only their group's baseline; "
                             "set one of them off")
        if p.mask_truncated and self.kl.placement == "loss":
            raise ValueError("ppo.mask_truncated with kl.placement='loss' is refused: the KL term in the loss is the "
                             "gradient of the batch's mean response KL, the statistic the controller is fed, over "
                             "every row; leaving the truncated rows out of it would make the two differ. Use "
                             "kl.placement='reward'")
        if self.learner.critic == "separate" and p.advantage != "gae":
            raise ValueError(f"learner.critic='separate' builds a critic, but ppo.advantage={p.advantage!r} uses "
                             "none (only 'gae' does); set learner.critic='value_head' (ignored without GAE)")
        if r.batch_size % n:
            raise ValueError(f"rollout.batch_size={r.batch_size} counts episodes: it must be a multiple of "
                             f"rollout.samples_per_prompt={n}")
        if r.chunk_size % n:
            # chunks of whole groups, aligned, never split a prompt's group over chunks or learner ranks
            raise ValueError(f"rollout.chunk_size={r.chunk_size} is not a multiple of rollout.samples_per_prompt={n}: "
                             "a prompt's group must stay in one chunk (and so on one learner rank)")
        if r.batch_size % r.chunk_size:
            raise ValueError(f"rollout.batch_size={r.batch_size} is not a multiple of rollout.chunk_size={r.chunk_size}")
        chunks = r.batch_size // r.chunk_size
        if chunks % w:
            raise ValueError(
                f"rollout.batch_size/chunk_size = {chunks} chunks cannot be split over learner.world_size={w} ranks"
            )
        if r.batch_size % p.minibatch_size:
            raise ValueError(f"rollout.batch_size={r.batch_size} is not a multiple of ppo.minibatch_size={p.minibatch_size}")
        if p.minibatch_size % w:
            raise ValueError(
                f"ppo.minibatch_size={p.minibatch_size} cannot be split over learner.world_size={w} ranks"
                + (" (ZeRO-3 partitions every step over all ranks)" if self.learner.zero_stage == 3 else "")
            )
        lora = self.learner.lora
        if lora.rank and self.learner.weight_sync != "object_store":
            raise ValueError(f"learner.lora.rank={lora.rank} with learner.weight_sync={self.learner.weight_sync!r}: "
                             "vLLM's weight transfer announces the learner's parameters by name, and LoRA's are the "
                             "adapters; LoRA's merged weights travel through 'object_store'")
        if lora.rank and lora.sync == "merged" and self.learner.dtype != "float32":
            raise ValueError(f"learner.lora.sync='merged' with learner.dtype={self.learner.dtype!r}: merged into "
                             "bf16 weights, the adapters' updates round away (W + BA rounds to W), so the engines "
                             "would sample another policy than the learner trains (measured on SmolLM2: the probe "
                             "1.39 > 1.0 at iteration 5); use learner.lora.sync 'adapter' or 'auto', or float32")
        if lora.rank > VLLM_LORA_RANKS[-1] and self.rollout.engine == "vllm" and self.adapter_sync:
            raise ValueError(f"learner.lora.rank={lora.rank} is above vLLM's largest LoRA rank, {VLLM_LORA_RANKS[-1]}: "
                             "an engine whose model takes adapters could not load it; learner.lora.sync='merged' "
                             "sends the merged weights instead")
        changed = self.reference.changed_fields()
        if self.learner.reference_in_learner and changed:
            raise ValueError(f"reference.{changed[0]}={getattr(self.reference, changed[0])!r} is set, but with "
                             "learner.lora.reference='base' the learner scores the reference itself and no reference "
                             f"actor starts; set learner.lora.reference='actor' to keep them, or reference.{changed[0]} "
                             "back to its default")
        sync = self.learner.weight_sync
        if sync != "object_store" and (self.rollout.engine != "vllm" or not self.cluster.rollout.num_gpus
                                       or not self.cluster.learner.num_gpus):
            raise ValueError(f"learner.weight_sync={sync!r} is vLLM's GPU weight transfer: it needs rollout.engine="
                             "'vllm' and GPUs for the rollout engines and the learner (cluster.rollout.num_gpus, "
                             "cluster.learner.num_gpus); on CPU use 'object_store'")
        tp, engine_gpus = self.rollout.tensor_parallel_size, self.cluster.rollout.num_gpus
        if tp > 1 and engine_gpus < tp:
            raise ValueError(f"rollout.tensor_parallel_size={tp} needs that many GPUs "
                             f"per engine: cluster.rollout.num_gpus={engine_gpus}")
        if tp > 1 and engine_gpus != tp:
            # the engine's actor holds its bundle's GPUs and vLLM's mp executor runs a worker on each of the
            # first tp it sees: any more would sit idle, a fraction would be shared with another actor
            raise ValueError(f"rollout.tensor_parallel_size={tp} runs one vLLM worker per GPU of the engine's "
                             f"bundle: cluster.rollout.num_gpus must be {tp}, got {engine_gpus}")
        reference_share, reference_memory = self.cluster.reference.num_gpus, self.reference.gpu_memory_utilization
        if reference_memory is not None and not reference_share:
            raise ValueError(f"reference.gpu_memory_utilization={reference_memory} sizes vLLM on a GPU, but "
                             "cluster.reference.num_gpus=0 runs the reference on CPU; set it to null")
        if reference_memory is not None and reference_memory > reference_share:
            raise ValueError(f"reference.gpu_memory_utilization={reference_memory} exceeds the GPU share the "
                             f"reference reserves, cluster.reference.num_gpus={reference_share}: the actors that "
                             "share its GPU would run out of memory")
        learner_gpus = self.cluster.learner.num_gpus
        if w > 1 and learner_gpus and not float(learner_gpus).is_integer():
            # Ray may give two ranks' fractions of one GPU to both, and each rank computes on its first visible
            # GPU: NCCL cannot run two ranks of one group on one device
            raise ValueError(f"cluster.learner.num_gpus={learner_gpus} with learner.world_size={w}: a fraction of a "
                             "GPU per rank lets Ray place two ranks on one GPU, where NCCL cannot run them; give each "
                             "rank whole GPUs (cluster.learner.num_gpus=1) or use learner.world_size=1")
        if self.run.resume and self.run.overwrite:
            raise ValueError("run.resume and run.overwrite exclude each other: resuming keeps the run directory")
        if self.kl.controller == "adaptive" and r.batch_size > self.kl.horizon:
            raise ValueError(f"rollout.batch_size={r.batch_size} exceeds kl.horizon={self.kl.horizon}: the adaptive "
                             "KL controller updates once per batch with n_steps=batch_size and refuses more than "
                             "its horizon (beta could flip sign); raise kl.horizon or lower rollout.batch_size")
        if self.reward.kind == "model" and not self.reward.model_path:
            raise ValueError("reward.kind='model' needs reward.model_path")
        if self.reward.judge is not None:
            from services.judge_template import check_template_fields

            check_template_fields(self.reward.judge.template, self.task.reward_fields,
                                  f"task {self.task.name!r} (task.reward_fields={self.task.reward_fields})")
            judge_memory, reward_share = self.reward.judge.gpu_memory_utilization, self.cluster.reward.num_gpus
            if judge_memory is not None and not reward_share:
                raise ValueError(f"reward.judge.gpu_memory_utilization={judge_memory} sizes the judge on a GPU, but "
                                 "cluster.reward.num_gpus=0 runs it on CPU; set it to null")
            if judge_memory is not None and judge_memory > reward_share:
                raise ValueError(f"reward.judge.gpu_memory_utilization={judge_memory} exceeds the GPU share of a reward "
                                 f"actor, cluster.reward.num_gpus={reward_share}")
        if self.task.name == "dataset" and self.reward.kind == "function" and not self.task.reward_function:
            raise ValueError("task.name='dataset' with reward.kind='function' needs task.reward_function "
                             "(package.module:function), or another reward.kind")
        if self.task.reward_function and self.reward.kind != "function":
            raise ValueError(f"task.reward_function is set but reward.kind={self.reward.kind!r} scores the "
                             "responses; set task.reward_function=null or reward.kind='function'")
        if self.task.name == "dataset" and not self.model.path:
            raise ValueError("task.name='dataset' needs model.path: the policy to train on your prompts")
        if (self.task.name == "agent") != (r.agent is not None):
            raise ValueError("task.name='agent' and rollout.agent go together: the agent function "
                             "(package.module:function) runs one episode per row of task.path"
                             if r.agent is None else f"rollout.agent={r.agent!r} is set but task.name="
                             f"{self.task.name!r}; set task.name='agent' (rows from task.path)")
        if r.agent is not None:
            if ":" not in r.agent:
                raise ValueError(f"rollout.agent={r.agent!r} is not of the form package.module:function")
            if not self.model.path:
                raise ValueError("task.name='agent' needs model.path: the policy the agent's calls are served by")
        if self.task.name in ("environment", "agent"):
            if self.reward.kind != "function":
                raise ValueError(f"task.name={self.task.name!r} is rewarded by its episodes (the environment's "
                                 f"steps, the agent's return), but reward.kind={self.reward.kind!r}; set "
                                 "reward.kind='function'")
            for field in ("score_clip", "missing_eos_penalty"):
                if getattr(self.reward, field) is not None:
                    raise ValueError(f"reward.{field} is set but task.name={self.task.name!r} takes its rewards from "
                                     f"its episodes as they are; set reward.{field}=null")
            if self.reward.overlong_buffer is not None:
                raise ValueError(f"reward.overlong_buffer is set but task.name={self.task.name!r} takes its rewards "
                                 "from its episodes as they are, and a trajectory's length holds the environment's "
                                 "tokens; set reward.overlong_buffer=null")
            if p.mask_truncated or r.dynamic_sampling:
                field = "ppo.mask_truncated" if p.mask_truncated else "rollout.dynamic_sampling"
                raise ValueError(f"{field} is for single responses: task.name={self.task.name!r} gives trajectories "
                                 "cut by the turn and token budgets and rewarded per turn; set it to false")
            if r.max_new_tokens is not None and r.max_new_tokens > r.max_trajectory_tokens:
                raise ValueError(f"rollout.max_new_tokens={r.max_new_tokens} (one turn) exceeds "
                                 f"rollout.max_trajectory_tokens={r.max_trajectory_tokens} (the whole episode)")
        if self.reward.kind != "model" and self.reward.label is not None:
            raise ValueError(f"reward.label={self.reward.label!r} is set but reward.kind={self.reward.kind!r} has no labels; "
                             "set reward.label=null")
        return self

    @model_validator(mode="after")
    def _scored_as_sampled(self) -> JobConfig:
        """The reference scores at the temperature the engines sampled at."""
        temperature = self.rollout.temperature
        if self.reference.backend == "vllm" and temperature != 1:
            # the reference actor refuses it too (actors/reference.py): vLLM's prompt_logprobs are at temperature 1
            raise ValueError(f"rollout.temperature={temperature} is refused with reference.backend='vllm': vLLM's "
                             "prompt_logprobs score at temperature 1, while the engines sample and the learner scores "
                             f"at {temperature}, so the KL would be taken to another distribution than the reference "
                             "policy's; use reference.backend='hf' (it scores at rollout.temperature) or "
                             "rollout.temperature=1.0")
        return self

    def tiny_model_settings_notice(self, parameters: int | None) -> str | None:
        """A line for the start of a job whose policy is a pretrained model (``parameters`` or more) while
        ``ppo.lr`` is still the default, which is sized for the embedded randomwalks GPT-2 trained from scratch.
        None otherwise, and when the count is unknown."""
        if parameters is None or parameters < PRETRAINED_PARAMETERS or "lr" in self.ppo.model_fields_set:
            return None
        lr = self.ppo.lr
        return (f"note: ppo.lr={lr:g} is the default for the embedded randomwalks model (about 1M parameters, "
                f"trained from scratch); this policy has {parameters / 1e6:.0f}M. A pretrained model moves far "
                f"at that rate (a dataset job on SmolLM2-135M reached a response KL of 6.2 nats in 3 iterations "
                f"while its reward fell); the presets on SmolLM2 train at 5e-5, and RL on larger models "
                f"usually takes 1e-6 to 1e-5. Set ppo.lr to silence this")

    @property
    def probe_tolerance(self) -> float:
        """The probe's bound on |engine - learner| log-probs: the configured one, or the dtype's."""
        return self.run.probe_tolerance or PROBE_TOLERANCE[self.learner.dtype]

    @property
    def adapter_sync(self) -> bool:
        """learner.lora: whether the engines start with LoRA on, to take the adapter alone at each sync (where
        vLLM's model takes adapters): ``lora.sync`` adapter, or auto unless the engines are float32 on CPU."""
        sync = self.learner.lora.sync
        return bool(self.learner.lora.rank) and (sync == "adapter" or (sync == "auto" and (
            self.cluster.rollout.num_gpus > 0 or self.learner.dtype != "float32")))

    @property
    def engine_lora_rank(self) -> int | None:
        """The engines' max_lora_rank: ``learner.vllm_lora_rank`` with ``adapter_sync``, else None (no LoRA)."""
        return self.learner.vllm_lora_rank if self.adapter_sync else None

    def device(self, role: str) -> str:
        """'cuda' exactly when the role asks for GPUs; never a GPU it did not reserve."""
        return "cuda" if getattr(self.cluster, role).num_gpus > 0 else "cpu"

    def reference_vllm_engine_args(self) -> dict[str, Any]:
        """The ``LLM(...)`` arguments of a reference with backend vllm. It only scores (prompt log-probs), so it
        starts eager; on a GPU it takes reference.gpu_memory_utilization, or else 0.9 of the GPU share its role
        reserved: vLLM's own default (0.92 of the whole GPU) fails where the GPU is shared, and on a GPU of its
        own holds a KV cache no scoring call fills."""
        args: dict[str, Any] = {"enforce_eager": True, "distributed_executor_backend": "uni"}
        if share := min(1.0, self.cluster.reference.num_gpus):
            args["gpu_memory_utilization"] = self.reference.gpu_memory_utilization or round(0.9 * share, 4)
        return args

    def fingerprint(self) -> str:
        return hashlib.sha256(json.dumps(self.model_dump(mode="json"), sort_keys=True).encode()).hexdigest()[:12]


def _section(model: type[BaseModel], key: str) -> type[BaseModel] | None:
    """The settings section ``model.key`` holds (a nested model, optional or not), or None for a value."""
    field = model.model_fields.get(key) or next(
        (f for f in model.model_fields.values() if f.alias == key), None)
    if field is None:
        return None
    for kind in (field.annotation, *typing.get_args(field.annotation)):
        if isinstance(kind, type) and issubclass(kind, BaseModel):
            return kind
    return None


def merge_settings(base: dict[str, Any], override: dict[str, Any],
                   model: type[BaseModel] | None = None) -> dict[str, Any]:
    """``override`` on top of ``base``, both nested dicts of ``model``'s settings (JobConfig's by default).

    Sections merge key by key; every value replaces, a dict-valued setting as a list does: the file's
    ``task.environment_kwargs`` for one environment never reaches another given on the command line.
    """
    model = model or JobConfig
    merged = dict(base)
    for key, value in override.items():
        section = _section(model, key)
        if section is not None and isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = merge_settings(merged[key], value, section)
        else:
            merged[key] = value
    return merged


def read_yaml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"config file {path} does not exist")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise ValueError(f"config file {path} is not valid YAML: {err}") from err
    if not isinstance(data, dict):
        raise ValueError(f"config file {path} must hold a mapping at the top, got {type(data).__name__}")  # noqa: TRY004 - main reports ValueError as bad config
    return data


def load_config(yaml_path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> JobConfig:
    """YAML file (if any), then ``overrides`` (nested dict) on top, validated as one JobConfig."""
    data = read_yaml(yaml_path) if yaml_path else {}
    return JobConfig.model_validate(merge_settings(data, overrides or {}))


def config_to_yaml(cfg: JobConfig) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)


# the sections live in services/settings_sampling.py and services/settings_training.py; they are named here,
# the one place settings come from
__all__ = ["PROBE_TOLERANCE", "VLLM_LORA_RANKS", "CheckpointConfig", "ClusterConfig", "DistillConfig", "JobConfig",
           "JudgeConfig", "KLConfig", "LearnerConfig", "LoraConfig", "MetricsConfig", "ModelConfig", "PPOConfig",
           "ReferenceConfig", "RewardConfig", "RoleResources", "RolloutConfig", "RunConfig", "TaskConfig",
           "config_to_yaml", "load_config", "merge_settings", "read_yaml"]
