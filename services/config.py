"""JobConfig: the one pydantic tree every setting lives in. Loads from YAML, takes CLI overrides
(``--kl.target 6``) through pydantic-settings, and validates with messages that name the field."""

from __future__ import annotations

import typing
from collections.abc import Callable
from operator import attrgetter
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from services import task_rules  # noqa: F401 (its rules join JOB_RULES, after job_rules' own)
from services.job_rules import JOB_RULES
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
    ADVANTAGE_LR_SCHEDULE,
    ASYNC_EPOCHS,
    ASYNC_FEWER_EPOCHS,
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

# the settings that follow others when unset (JobConfig._defaults_follow): (section, field, the settings it
# follows)
FOLLOWED_DEFAULTS = (("ppo", "minibatch_size", ("rollout.batch_size",)),
                     ("rollout", "chunk_size", ("rollout.batch_size",)),
                     ("ppo", "lr", ("ppo.advantage",)),
                     ("ppo", "lr_schedule", ("ppo.advantage",)),
                     ("ppo", "epochs", ("rollout.mode", "ppo.policy_loss", "ppo.correction")))


def follow(holder: BaseModel, name: str, value: Any) -> None:
    """``holder.name = value`` for a setting the user left unset, which stays unset: a dumped config records
    the value, and a resume of the run takes it back (``learner.checkpoint.keep_followed_defaults``)."""
    setattr(holder, name, value)
    holder.model_fields_set.discard(name)


def _largest_divisor(n: int, at_most: int, fits: Callable[[int], bool]) -> int | None:
    """The largest divisor of ``n`` no larger than ``at_most`` that ``fits``, or None."""
    return next((d for d in range(min(n, at_most), 0, -1) if n % d == 0 and fits(d)), None)


class JobConfig(BaseSettings):
    """All settings of a tether job."""

    model_config = SettingsConfigDict(
        extra="forbid",
        validate_assignment=True,
        # no cli_parse_args: set (even to False) it makes every JobConfig build an argparse parser of the
        # whole tree (pydantic-settings 2.x, 40 ms a config); the command line is learner.main's
        # CliSettingsSource
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
        ``followed_defaults``); they stay unset, so a dumped config records the value and a resume keeps
        it."""
        r, p, w = self.rollout, self.ppo, self.learner.world_size
        if "minibatch_size" not in p.model_fields_set:
            follow(p, "minibatch_size", _largest_divisor(r.batch_size,
                                                         PPOConfig.model_fields["minibatch_size"].default,
                                                         lambda d: d % w == 0) or p.minibatch_size)
        if "chunk_size" not in r.model_fields_set:
            follow(r, "chunk_size", _largest_divisor(
                r.batch_size, RolloutConfig.model_fields["chunk_size"].default,
                lambda d: d % r.samples_per_prompt == 0 and (r.batch_size // d) % w == 0) or r.chunk_size)
        if "lr" not in p.model_fields_set:  # the estimator's rate, and its schedule unless the user chose one
            follow(p, "lr", ADVANTAGE_LR.get(p.advantage, p.lr))
            if "lr_schedule" not in p.model_fields_set:
                follow(p, "lr_schedule", ADVANTAGE_LR_SCHEDULE.get(p.advantage, p.lr_schedule))
        if "epochs" not in p.model_fields_set and r.mode == "async" and (
                p.policy_loss in ASYNC_FEWER_EPOCHS["policy_loss"]
                or p.correction in ASYNC_FEWER_EPOCHS["correction"]):
            follow(p, "epochs", ASYNC_EPOCHS)
        if "dtype" not in self.learner.model_fields_set and self.pretrained_policy:
            follow(self.learner, "dtype", "auto")  # chosen by a measurement in the plan
        return self

    @property
    def eval_episode_cap(self) -> int | None:
        """``run.eval_max_episodes``, or its default for a multi-turn task (None: no cap)."""
        if self.run.eval_max_episodes is None and self.task.name in ("environment", "agent"):
            return 2 * self.rollout.batch_size
        return self.run.eval_max_episodes

    @property
    def pretrained_policy(self) -> bool:
        """The policy is a pretrained model (``model.path``, or a task whose model is one), not the small one
        tether builds and warm-starts for the embedded randomwalks task."""
        return bool(self.model.path) or self.task.name != "randomwalks"

    def followed_defaults(self) -> str | None:
        """The job's first line when an unset setting followed another (``_defaults_follow``), else None."""
        followed = []
        for section, name, sources in FOLLOWED_DEFAULTS:
            holder = getattr(self, section)
            user_set = any(source.split(".")[1] in getattr(self, source.split(".")[0]).model_fields_set
                           for source in sources)  # the default job's own recipe is not a follow to report
            if (name not in holder.model_fields_set and user_set
                    and getattr(holder, name) != type(holder).model_fields[name].default):
                shown = ", ".join(f"{source}={attrgetter(source)(self)}" for source in sources)
                value = getattr(holder, name)
                followed.append(f"{section}.{name}={value if isinstance(value, str) else format(value, 'g')} "
                                f"follows {shown}")
        return "defaults: " + "; ".join(followed) + " (set them to choose)" if followed else None

    @model_validator(mode="after")
    def _rules_across_sections(self) -> JobConfig:
        """The rules that read more than one section (services/job_rules.py); each section checks its own."""
        JOB_RULES.enforce(self)
        return self

    def tiny_model_settings_notice(self, parameters: int | None) -> str | None:
        """A line for the start of a job whose policy is a pretrained model (``parameters`` or more) while
        ``ppo.lr`` is still the default, which is sized for the embedded randomwalks GPT-2 trained from
        scratch. None otherwise, and when the count is unknown."""
        if parameters is None or parameters < PRETRAINED_PARAMETERS or "lr" in self.ppo.model_fields_set:
            return None
        lr = self.ppo.lr
        return (f"note: ppo.lr={lr:g} is the default for the embedded randomwalks model (about 1M "
                f"parameters, trained from scratch); this policy has {parameters / 1e6:.0f}M. A pretrained "
                "model moves far at that rate (a dataset job on SmolLM2-135M reached a response KL of 6.2 "
                "nats in 3 iterations while its reward fell); the presets on SmolLM2 train at 5e-5, and RL "
                "on larger models usually takes 1e-6 to 1e-5. Set ppo.lr to silence this")

    @property
    def probe_tolerance(self) -> float:
        """The probe's bound on |engine - learner| log-probs: the configured one, or the dtype's."""
        if self.learner.dtype == "auto":
            raise RuntimeError("learner.dtype auto has no probe tolerance before the plan chooses the dtype")
        return self.run.probe_tolerance or PROBE_TOLERANCE[self.learner.dtype]

    def _in_learner(self, role: str, auto_fits: bool) -> bool:
        """``<role>.placement``: learner, or auto where the learner and the role are both on CPU, no
        cluster.<role> setting asks for actors and ``auto_fits`` (what the role itself needs). There the
        role's own process takes a share of the same cores, and its start-up was a fifth of the default
        job's."""
        placement = getattr(self, role).placement
        if placement != "auto":
            return placement == "learner"
        return (auto_fits and self.device(role) == self.device("learner") == "cpu"
                and not getattr(self.cluster, role).changed_fields())

    @property
    def reference_copy_in_learner(self) -> bool:
        """reference.placement: each learner rank holds a copy of the initial policy as the reference and no
        reference actor starts. auto: with the transformers forward, no other reference setting changed and
        LoRA off (its learner.lora.reference 'actor' asks for an actor). Never with learner.lora.reference
        'base': the ranks score the base model itself."""
        return not self.learner.reference_in_learner and self._in_learner(
            "reference", self.reference.backend == "hf" and not self.learner.lora.rank
            and set(self.reference.changed_fields()) <= {"placement"})

    @property
    def reward_in_learner(self) -> bool:
        """reward.placement: each learner rank scores its chunks with the task's function and no reward actor
        starts. auto: for kind function with reward.num_actors unchanged."""
        return self._in_learner("reward", self.reward.kind == "function"
                                and "num_actors" not in self.reward.changed_fields())

    @property
    def adapter_sync(self) -> bool:
        """learner.lora: whether the engines start with LoRA on, to take the adapter alone at each sync (where
        vLLM's model takes adapters): ``lora.sync`` adapter, or auto unless the engines are float32 on CPU."""
        sync = self.learner.lora.sync
        return bool(self.learner.lora.rank) and (sync == "adapter" or (sync == "auto" and (
            self.cluster.rollout.num_gpus > 0 or self.learner.dtype == "bfloat16")))

    @property
    def engine_lora_rank(self) -> int | None:
        """The engines' max_lora_rank: ``learner.vllm_lora_rank`` with ``adapter_sync``, else None (no
        LoRA)."""
        return self.learner.vllm_lora_rank if self.adapter_sync else None

    def learner_may_share_an_engines_gpu(self) -> bool:
        """Whether Ray may place a learner rank and an engine on one GPU: both take a fraction of one (whole
        GPUs are never split between two actors)."""
        c = self.cluster
        return 0 < c.learner.num_gpus < 1 and any(0 < getattr(c, role).num_gpus < 1
                                                  for role in ("rollout", "reference", "reward", "teacher"))

    def device(self, role: str) -> str:
        """'cuda' exactly when the role asks for GPUs; never a GPU it did not reserve."""
        return "cuda" if getattr(self.cluster, role).num_gpus > 0 else "cpu"

    def rollout_vllm_engine_args(self) -> dict[str, Any]:
        """The rollout engine's ``LLM(...)`` arguments (``RolloutConfig.vllm_engine_args``) at the share of
        each GPU its role reserved: ``cluster.rollout.num_gpus`` over the engine's tensor-parallel GPUs."""
        rollout = self.rollout
        return rollout.vllm_engine_args(self.cluster.rollout.num_gpus / rollout.tensor_parallel_size)

    def reference_vllm_engine_args(self) -> dict[str, Any]:
        """The ``LLM(...)`` arguments of a reference with backend vllm. It only scores (prompt log-probs), so
        it starts eager; on a GPU it takes reference.gpu_memory_utilization, or else 0.9 of the GPU share its
        role reserved: vLLM's own default (0.92 of the whole GPU) fails where the GPU is shared, and on a GPU
        of its own holds a KV cache no scoring call fills."""
        args: dict[str, Any] = {"enforce_eager": True, "distributed_executor_backend": "uni"}
        if share := min(1.0, self.cluster.reference.num_gpus):
            args["gpu_memory_utilization"] = self.reference.gpu_memory_utilization or round(0.9 * share, 4)
        return args


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
        raise ValueError(  # noqa: TRY004 - main reports ValueError as bad config
            f"config file {path} must hold a mapping at the top, got {type(data).__name__}")
    return data


def load_config(yaml_path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> JobConfig:
    """YAML file (if any), then ``overrides`` (nested dict) on top, validated as one JobConfig."""
    data = read_yaml(yaml_path) if yaml_path else {}
    return JobConfig.model_validate(merge_settings(data, overrides or {}))


def config_to_yaml(cfg: JobConfig) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)


# the sections live in services/settings_sampling.py and services/settings_training.py; they are named here,
# the one place settings come from
__all__ = ["PROBE_TOLERANCE", "VLLM_LORA_RANKS", "CheckpointConfig", "ClusterConfig", "DistillConfig",
           "JobConfig", "JudgeConfig", "KLConfig", "LearnerConfig", "LoraConfig", "MetricsConfig",
           "ModelConfig", "PPOConfig", "ReferenceConfig", "RewardConfig", "RoleResources", "RolloutConfig",
           "RunConfig", "TaskConfig", "config_to_yaml", "load_config", "merge_settings", "read_yaml"]
