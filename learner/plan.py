"""The job's settings resolved once, before any actor starts: ``plan(cfg)`` checks what can be checked without
a cluster (the config's rules have run when it was built; here the files, models and their context length, the
reward service, the agent or environment, LoRA's targets, the teacher, a resume's checkpoint) and returns a
``Plan``: one frozen spec per role. Actors, ranks, the fleet, the learner group and the weight sync are built
from their spec and nothing else; none of them sees the whole ``JobConfig``. The per-node checks come once the
cluster is up (``learner.cluster.preflight``)."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from actors.agents import AgentSettings
from actors.engines import SamplingSettings
from actors.episodes import EpisodeLimits
from actors.specs import EngineSpec, EnvironmentSpec, ReferenceSpec, RewardSpec, RolloutSpec
from learner.algorithm import Algorithm
from services.config import JobConfig, LearnerConfig, PPOConfig, RoleResources, follow
from services.job_rules import JOB_RULES
from services.model_source import ModelSource
from services.shipment import Shipment
from services.storage import RunStorage

if TYPE_CHECKING:
    from learner.cluster import ClusterSpec


@dataclass(frozen=True)
class UpdateSettings:
    """What the update reads besides the algorithm's settings: the optimizer steps and their schedule."""

    ppo: PPOConfig
    seed: int = 0  # run.seed: the minibatches' shuffle
    run_iterations: int = 1  # run.iterations: ppo.lr_schedule's length
    rollout_batch_size: int | None = None  # episodes per batch: the optimizer steps per epoch
    rows_per_episode_vary: bool = False  # rollout.agent: an episode gives a row per trajectory of its calls
    max_tokens_per_microbatch: int | None = None  # learner.max_tokens_per_microbatch: packed micro-batches
    zero3: bool = False  # learner.zero_stage 3: every forward gathers the parameters from all ranks
    # rollout.in_flight_updates keep_kv: a token sampled after a load is of its request's starting version's
    # cache mixed with the new weights
    cache_kept: bool = False

    @property
    def minibatches(self) -> int:
        return (self.rollout_batch_size or self.ppo.minibatch_size) // self.ppo.minibatch_size

    def single_step(self, off_policy: bool) -> bool:
        """One optimizer step per batch (one epoch, one minibatch): the policy that generated the rows is the
        one that takes the step, so the step's own forward gives the old log-probs and values exactly, and
        collection runs none (TRL's GRPO at num_iterations=1). Packed, the step's forward runs its
        micro-batches one after another and keeps their graphs for the one backward; not under ZeRO-3, whose
        parameter gathers expect a backward after each forward."""
        return (self.rollout_batch_size is not None and not off_policy and self.ppo.epochs == 1
                and self.ppo.minibatch_size == self.rollout_batch_size and not self.rows_per_episode_vary
                and not (self.max_tokens_per_microbatch and self.zero3))


def resolved_dtype(cfg: JobConfig) -> str:
    """learner.dtype, once chosen: ``auto`` is the plan's to resolve (``choose_learner_dtype``)."""
    if cfg.learner.dtype == "auto":
        raise ValueError("learner.dtype 'auto' is chosen by the plan (learner.plan.plan) from a measurement; "
                         "set float32 or bfloat16 to build a role's spec without it")
    return cfg.learner.dtype


def learner_threads(cfg: JobConfig, machine_cpus: int | None) -> int | None:
    """A learner rank's torch threads: learner.torch_threads; unset, a synchronous job on CPU on the local Ray
    it started shares the machine's CPUs (``machine_cpus``) among its ranks; else None (Ray's default)."""
    threads = cfg.learner.torch_threads
    if threads is None and machine_cpus and cfg.device("learner") == "cpu" and cfg.rollout.mode == "sync":
        threads = max(1, machine_cpus // cfg.learner.world_size)
    return threads


@dataclass(frozen=True)
class RankSpec:
    """What a learner rank is built from, and nothing else: the policy's files, the learner's settings, the
    algorithm layer (``learner.algorithm``, with the settings it reads) and the update's
    (``learner.update``)."""

    model: ModelSource | str
    learner: LearnerConfig
    algorithm: Algorithm
    update: UpdateSettings
    temperature: float = 1.0  # rollout.temperature: the learner scores at the engines' temperature
    seed: int = 0  # run.seed: the value head's init, the same on every rank
    device: str = "cpu"  # the device the learner role reserved
    resources: RoleResources = field(default_factory=RoleResources)  # cluster.learner: each rank's actor
    # reference.placement learner: the rank's own copy of the initial policy
    reference: ReferenceSpec | None = None
    reward: RewardSpec | None = None  # reward.placement learner: the task whose function the rank scores with
    # learner.torch_threads as resolved (``RankSpec.of``); none: Ray's default
    torch_threads: int | None = None

    @classmethod
    def of(cls, cfg: JobConfig, model: ModelSource | str, task_options: dict | None = None,
           machine_cpus: int | None = None) -> RankSpec:
        """``task_options``: what the reward is built from (``reward_spec``). ``machine_cpus``: the CPUs of
        the one machine a local Ray gives the job alone; there an unset learner.torch_threads shares them
        among the ranks of a synchronous job on CPU, whose engines and reference idle while the ranks
        update."""
        dtype = resolved_dtype(cfg)
        reference = ReferenceSpec(model, "hf", dtype, temperature=cfg.rollout.temperature,
                                  device=cfg.device("learner"),
                                  max_tokens_per_microbatch=cfg.learner.max_tokens_per_microbatch) \
            if cfg.reference_copy_in_learner else None
        reward = reward_spec(cfg, Models(model), task_options) if cfg.reward_in_learner else None
        threads = learner_threads(cfg, machine_cpus)
        update = UpdateSettings(cfg.ppo, cfg.run.seed, cfg.run.iterations, cfg.rollout.batch_size,
                                cfg.rollout.agent is not None, cfg.learner.max_tokens_per_microbatch,
                                cfg.learner.zero_stage == 3, cfg.rollout.in_flight_updates == "keep_kv")
        return cls(model, cfg.learner, Algorithm.from_config(cfg), update, cfg.rollout.temperature,
                   cfg.run.seed, cfg.device("learner"), cfg.cluster.learner, reference, reward, threads)


@dataclass(frozen=True)
class FleetSpec:
    """The non-learner actors (one spec each, in bundle order within a role), how they restart, and what the
    driver hands them with each chunk."""

    rollouts: tuple[RolloutSpec, ...]
    references: tuple[ReferenceSpec, ...]
    rewards: tuple[RewardSpec, ...]
    teachers: tuple[ReferenceSpec, ...]
    environments: tuple[EnvironmentSpec, ...]
    resources: dict[str, RoleResources]  # cluster.<role>; environment workers: task.environment_num_cpus
    restarts: int  # run.actor_max_restarts
    engine_restarts: int  # 0 with vLLM's weight transfer: an NCCL group cannot take back a restarted member
    sampling: SamplingSettings
    pad_id: int
    chunk_size: int  # rollout.chunk_size
    samples_per_prompt: int  # rollout.samples_per_prompt
    run_seed: int  # run.seed: each episode's sampling seed
    max_chunk_retries: int  # run.max_chunk_retries
    collective_timeout_s: float  # learner.collective_timeout_s: an actor that does not answer is named
    probe_tolerance: float  # JobConfig.probe_tolerance
    dtype: str  # learner.dtype, named in the probe's refusal
    eval_samples_per_prompt: int = 1  # rollout.eval_samples_per_prompt
    eval_samples_saved: int = 0  # metrics.eval_samples_saved
    episode_limits: EpisodeLimits | None = None  # multi-turn episodes (task.name 'environment')
    agent_settings: AgentSettings | None = None  # agent programs (rollout.agent)

    @property
    def roles(self) -> list[tuple[str, int]]:
        """(role, index) of every actor but the environment workers, in bundle order."""
        counts = {"rollout": self.rollouts, "reference": self.references, "reward": self.rewards,
                  "teacher": self.teachers}
        return [(role, i) for role, specs in counts.items() for i in range(len(specs))]


@dataclass(frozen=True)
class SyncSpec:
    """How the learner's weights reach the engines (``learner.weight_sync.WeightSync``)."""

    transfer: str | None = None  # learner.weight_sync 'nccl' | 'ipc'; None: the object store
    probe_every: int = 1  # run.probe_every
    max_retries: int = 1  # run.max_chunk_retries
    lora: bool = False  # learner.lora.rank set
    lora_sync: str = "auto"  # learner.lora.sync
    adapter_sync: bool = False  # JobConfig.adapter_sync: the engines started with LoRA on
    bucket_mib: int = 256  # learner.sync_bucket_mib
    workers_per_engine: int = 1  # rollout.tensor_parallel_size

    @classmethod
    def of(cls, cfg: JobConfig) -> SyncSpec:
        transfer = None if cfg.learner.weight_sync == "object_store" else cfg.learner.weight_sync
        return cls(transfer, cfg.run.probe_every, cfg.run.max_chunk_retries, bool(cfg.learner.lora.rank),
                   cfg.learner.lora.sync, cfg.adapter_sync, cfg.learner.sync_bucket_mib,
                   cfg.rollout.tensor_parallel_size)


@dataclass(frozen=True)
class Models:
    """The models as every node reaches them: a shared path or hub id, or files the driver made and ships."""

    policy: ModelSource
    reward: ModelSource | None = None  # reward.kind model: the classifier; judge: the judge's model
    teacher: ModelSource | None = None  # distill.teacher_path

    def all(self) -> list[ModelSource]:
        return [m for m in (self.policy, self.reward, self.teacher) if m is not None]


@dataclass(frozen=True)
class Plan:
    """Everything the driver starts from, checked: the task's prompts, a resume's checkpoint,
    the models, the probe set, one spec per role and the cluster's."""

    models: Models
    prompts: list
    eval_prompts: list
    # token ids the engines and the learner score after each sync
    probe_set: tuple[list[list[int]], list[int]]
    fleet: FleetSpec
    rank: RankSpec
    sync: SyncSpec
    cluster: ClusterSpec
    resume_from: RunStorage | None = None
    resume_state: dict | None = None
    # what actors read that the driver holds (a dataset's rows): shipped once Ray is up, never by the plan,
    # which runs before or beside Ray's start and must not start a Ray of its own by a side effect
    shipments: tuple[Shipment, ...] = ()


def reward_spec(cfg: JobConfig, models: Models, task_options: dict | None = None) -> RewardSpec:
    """What the reward is built from, in a reward actor or (reward.placement learner) a learner rank.
    ``task_options``: ``Task.reward_actor_options`` (none: the task's settings)."""
    reward = RewardSpec(cfg.task.name, task_options or cfg.task.options(), models.policy, cfg.reward.kind,
                        models.reward, cfg.reward.score_clip, cfg.device("reward"), cfg.reward.label)
    if cfg.reward.kind == "remote":  # the driver's token goes to the reward actors whose environment lacks it
        reward = replace(reward, remote=cfg.reward, forwarded_token=os.environ.get(cfg.reward.token_env))
    if cfg.reward.kind == "judge":
        reward = replace(reward, judge=cfg.reward.judge,
                         judge_engine_args=cfg.reward.judge.engine_args(cfg.cluster.reward.num_gpus))
    return reward


def fleet_spec(cfg: JobConfig, models: Models, sampling: SamplingSettings, pad_id: int, max_model_len: int,
               task_options: dict | None = None) -> FleetSpec:
    """Each non-learner actor's spec: engines and the reference compute in the learner's dtype, on the device
    their role reserved. ``task_options``: what the reward actors build the task from
    (``Task.reward_actor_options``; none: the task's settings)."""
    c, dtype, model = cfg.cluster, resolved_dtype(cfg), models.policy
    # actors per role: the cluster reserves a bundle for each
    from learner.cluster import role_counts  # Ray: not for the Ray-free users of the specs (the device check)

    sync, counts = SyncSpec.of(cfg), role_counts(cfg)
    rollouts = tuple(
        RolloutSpec(model, EngineSpec(cfg.rollout.engine, cfg.run.seed + i, max_model_len,
                                      cfg.rollout.kv_cache_mib, dtype, i, cfg.device("rollout"),
                                      cfg.rollout_vllm_engine_args(), sync.transfer,
                                      cfg.engine_lora_rank if cfg.rollout.engine == "vllm" else None,
                                      cfg.rollout.in_flight_updates, cfg.rollout.engine_threads))
        for i in range(counts["rollout"]))
    references = tuple(
        ReferenceSpec(model, cfg.reference.backend, dtype, max_model_len, 128, cfg.rollout.temperature,
                      cfg.device("reference"), cfg.reference.torch_threads, cfg.reference_vllm_engine_args(),
                      cfg.learner.max_tokens_per_microbatch)
        for _ in range(counts["reference"]))
    reward = reward_spec(cfg, models, task_options)
    # on-policy distillation (distill.teacher_path): the teacher scores the student's samples as the
    # reference does
    teachers = tuple(
        ReferenceSpec(models.teacher, "hf", dtype, max_model_len, 128, cfg.rollout.temperature,
                      cfg.device("teacher"), max_tokens_per_microbatch=cfg.learner.max_tokens_per_microbatch)
        for _ in range(counts["teacher"]))
    # multi-turn episodes: the environments step on workers of their own, outside the engines' processes
    environments, limits, task = (), None, cfg.task
    if task.name == "environment":
        environments = tuple(EnvironmentSpec(task.environment, task.environment_kwargs, model,
                                             task.environment_step_timeout_s)
                             for _ in range(task.environment_workers))
        limits = EpisodeLimits(cfg.rollout.max_turns, cfg.rollout.max_trajectory_tokens,
                               task.max_prompt_tokens, task.environment_step_timeout_s,
                               task.environment_max_failures, task.environment)
    agents = None if cfg.rollout.agent is None else AgentSettings(
        cfg.rollout.agent, cfg.rollout.agent_timeout_s, cfg.rollout.agent_max_failures,
        cfg.rollout.max_trajectory_tokens)
    resources = {"rollout": c.rollout, "reference": c.reference, "reward": c.reward, "teacher": c.teacher,
                 "environment": RoleResources(num_cpus=task.environment_num_cpus)}
    return FleetSpec(
        rollouts, references, (reward,) * counts["reward"], teachers, environments, resources,
        cfg.run.actor_max_restarts, cfg.run.actor_max_restarts if sync.transfer is None else 0, sampling,
        pad_id, cfg.rollout.chunk_size, cfg.rollout.samples_per_prompt, cfg.run.seed,
        cfg.run.max_chunk_retries, cfg.learner.collective_timeout_s, cfg.probe_tolerance, dtype,
        cfg.rollout.eval_samples_per_prompt, cfg.metrics.eval_samples_saved, limits, agents)


def choose_learner_dtype(cfg: JobConfig, model_dir: str, machine_cpus: int | None, log) -> None:
    """``learner.dtype`` auto, resolved (``services.dtype_choice``) and said in a line: bfloat16 on a GPU; on
    CPU the faster of the two on the model's own matmuls at the learner's threads, timed on this (the
    driver's) node, float32 for a model too small to time or with LoRA's merged sync. The rules that read the
    dtype run again on the choice."""
    from services.dtype_choice import choose, model_widths, time_dtypes, too_small_to_time

    if cfg.device("learner") != "cpu":
        chosen, why = "bfloat16", "the learner on a GPU"
    elif cfg.learner.lora.rank and cfg.learner.lora.sync == "merged":
        chosen, why = "float32", "learner.lora.sync merged keeps the engines' weights in float32"
    elif small := too_small_to_time(model_dir):
        chosen, why = "float32", small
    else:
        timing = time_dtypes(model_widths(model_dir), learner_threads(cfg, machine_cpus) or 1)
        chosen, why = choose(timing), timing.describe() + " on the driver's node; bfloat16 only at >= 1.2x"
    follow(cfg.learner, "dtype", chosen)
    JOB_RULES.enforce(cfg)
    log(f"learner.dtype auto: {chosen} ({why})")


def choose_learner_attention(cfg: JobConfig, model_dir: str, sequence_tokens: int, machine_cpus: int | None,
                             log) -> None:
    """``learner.attention`` auto, resolved (``services.attention_choice``) and said in a line: sdpa on a GPU
    or for a model too small to time; on CPU the faster at the learner's dtype and threads over the job's
    ``sequence_tokens`` (its longest sequence, or a packed micro-batch), timed on this (the driver's) node."""
    from services.attention_choice import EAGER_MIN_SPEEDUP, attention_shape, choose, time_attention
    from services.dtype_choice import too_small_to_time

    if cfg.device("learner") != "cpu":
        chosen, why = "sdpa", "the learner on a GPU"
    elif small := too_small_to_time(model_dir):
        chosen, why = "sdpa", small
    else:
        timing = time_attention(attention_shape(model_dir), cfg.learner.dtype, sequence_tokens,
                                learner_threads(cfg, machine_cpus) or 1,
                                packed=cfg.learner.max_tokens_per_microbatch is not None)
        chosen = choose(timing)
        why = f"{timing.describe()} at {cfg.learner.dtype}; eager only at >= {EAGER_MIN_SPEEDUP}x"
    follow(cfg.learner, "attention", chosen)
    log(f"learner.attention auto: {chosen} ({why})")


def evaluation_rows(cfg: JobConfig, rows: list, response_width: int, log) -> list:
    """The evaluation's rows, the first ``cfg.eval_episode_cap`` episodes' worth, and a line on what an
    evaluation runs against a training iteration (its generation, the task's scoring, and the learner's and
    the reference's forwards for the evaluation KL: an iteration's work but the update)."""
    samples, cap = cfg.rollout.eval_samples_per_prompt, cfg.eval_episode_cap
    kept = rows if cap is None or len(rows) * samples <= cap else rows[:max(1, cap // samples)]
    episodes, batch = len(kept) * samples, cfg.rollout.batch_size
    capped = "" if len(kept) == len(rows) else (f"; the first {len(kept)} of {len(rows)} rows: "
                                                 f"run.eval_max_episodes={cap}")
    log(f"evaluation: {episodes} episodes of up to {response_width} response tokens ({len(kept)} rows x "
        f"{samples}{capped}), {episodes / batch:.1f}x a training iteration's {batch}, every "
        f"{cfg.run.eval_every} iteration(s)")
    return kept


def plan(cfg: JobConfig, log: Callable[[str], None] = print, local_ray: bool = False) -> Plan:
    """Everything that can be wrong with the input fails here, before any actor starts. ``local_ray``: the job
    starts a Ray of its own on this machine (``cluster.starts_local_ray``), which then runs nothing but the
    job."""
    from actors.reference import check_teacher
    from actors.reward import check_reward_label, check_reward_service
    from learner import checkpoint, rundir
    from learner.lora import check_lora_model
    from services.models import load_tokenizer, model_positions, parameter_count, policy_source, sft_tokenizer
    from services.prompts import encode_prompts
    from services.smollm2 import SMOLLM2, smollm2_dir
    from services.tasks import get_task

    task = get_task(cfg.task.name, **cfg.task.options())
    if cfg.task.name == "dataset" and cfg.reward.kind == "function":
        task.trial_reward()  # the reward function once, on a real row, before any actor starts
    if cfg.rollout.agent is not None:
        from actors.agent_endpoint import load_agent

        load_agent(cfg.rollout.agent)  # an agent that cannot be imported fails before any actor starts
    run_path = rundir.check_free(cfg.run)
    if cfg.reward.kind == "remote":
        check_reward_service(cfg.reward, log=log)  # the service answers at reward.url, before any actor
    resume_from, resume_state = None, None
    if cfg.run.resume:
        resume_from = checkpoint.resolve(run_path, cfg.run.resume)
        # presence and sizes; the ranks check sha256 on download
        resume_state = checkpoint.verify(resume_from)
        checkpoint.keep_followed_defaults(resume_state["config"], cfg)
        checkpoint.check_compatible(resume_state["config"], cfg, resume_from)
    if followed := cfg.followed_defaults():
        log(followed)
    log("KL accounting: " + ", ".join(f"{k}={v}" for k, v in cfg.kl.model_dump().items()))

    episodic = cfg.task.name in ("environment", "agent")

    def encoded_prompts(tokenizer, log=log, limit: int = cfg.task.max_prompt_tokens) -> tuple[list, list]:
        if episodic:  # multi-turn: rows the environments reset from; each prompt is its reset's observation
            return task.train_rows, task.eval_rows
        return tuple(
            encode_prompts([task.format_prompt(t, tokenizer) for t in texts], tokenizer, limit,
                           cfg.task.long_prompts, log,
                           origin=lambda i, split=split: task.prompt_origin(i, split))
            for split, texts in (("train", task.prompts()), ("eval", task.eval_prompts())))

    if not cfg.model.path and (early := sft_tokenizer(task)) is not None:
        # bad prompts fail before an SFT warm start trains for them
        encoded_prompts(early, log=lambda _: None)
    if cfg.model.path == SMOLLM2:  # the SmolLM2-135M-Instruct that installs with the project, converted once
        converted = smollm2_dir(cfg.model.cache_dir, log)
        log(f"model: SmolLM2-135M-Instruct, converted at {converted} (a Hugging Face directory, tokenizer "
            "included, that model.path can name)")
        model = ModelSource.produced(converted, cfg.model.cache_dir)
    else:
        model = policy_source(task, cfg.model.path, cfg.model.cache_dir, cfg.run.seed, cfg.model.sft_steps,
                              cfg.model.sft_batch_size, cfg.model.sft_lr, log=log)
    reward_model = ModelSource.configured(cfg.reward.model_path) if cfg.reward.kind == "model" else None
    if reward_model is not None:
        # a local dir: its labels, before any actor
        check_reward_label(cfg.reward.model_path, cfg.reward.label)
    if cfg.reward.kind == "judge":  # the judge's model reaches the reward actors as the policy's does
        reward_model = ModelSource.configured(cfg.reward.judge.model_path)
    tokenizer = load_tokenizer(model.resolve("driver"))
    teacher = None
    # on-policy distillation: the teacher reaches its actors as the policy
    if cfg.distill.teacher_path is not None:
        check_teacher(cfg.distill.teacher_path, tokenizer)
        teacher = ModelSource.configured(cfg.distill.teacher_path)
    models = Models(model, reward_model, teacher)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    sampling = SamplingSettings(cfg.rollout.temperature, cfg.rollout.top_p,
                                cfg.rollout.max_new_tokens or task.max_new_tokens, cfg.rollout.ignore_eos)
    response_width = cfg.rollout.max_trajectory_tokens if episodic else sampling.max_new_tokens
    model_dir = model.resolve("driver")
    from learner.cluster import ClusterSpec

    cluster = ClusterSpec.of(cfg)
    if cfg.learner.dtype == "auto":
        choose_learner_dtype(cfg, model_dir, cluster.local_cpus if local_ray else None, log)
    positions = model_positions(model_dir)
    # a dataset's prompts, task.max_prompt_tokens unset: as long as the model's context leaves room for
    prompt_limit = cfg.task.max_prompt_tokens
    follows_context = cfg.task.name == "dataset" and "max_prompt_tokens" not in cfg.task.model_fields_set
    if follows_context and positions is not None:
        prompt_limit = positions - response_width - 1
    prompts, eval_prompts = encoded_prompts(tokenizer, limit=prompt_limit)
    eval_prompts = evaluation_rows(cfg, eval_prompts, response_width, log)
    if follows_context:
        prompt_limit = max(len(p) for p in prompts + eval_prompts)
        room = "" if positions is None else (f"; the model's {positions} positions less the response's "
                                             f"{response_width} + 1 allow {positions - response_width - 1}")
        log(f"prompts: task.max_prompt_tokens={prompt_limit} follows the longest prompt{room} (set it to "
            "choose)")
    # token ids the engines and the learner score after each sync: the eval prompts (an environment's rows
    # are not tokens: a few ids then) followed by arbitrary ids
    probe_prompts = [[(5 * j + 11 * k) % len(tokenizer) for k in range(4)] for j in range(8)] if episodic \
        else eval_prompts[:8]
    probe_set = ([p + [(7 * j + 3 * k) % len(tokenizer) for k in range(sampling.max_new_tokens)]
                  for j, p in enumerate(probe_prompts)], [len(p) for p in probe_prompts])
    max_model_len = prompt_limit + response_width + 1
    if cfg.learner.attention == "auto":
        choose_learner_attention(cfg, model_dir, cfg.learner.max_tokens_per_microbatch or max_model_len - 1,
                                 cluster.local_cpus if local_ray else None, log)
    if cfg.learner.lora.rank:  # the target modules against the architecture, before any actor starts
        check_lora_model(model_dir, cfg.learner.lora)
    if notice := cfg.tiny_model_settings_notice(parameter_count(model_dir)):
        log(notice)
    if positions is not None and max_model_len > positions:  # the engines would refuse it at start-up
        raise ValueError(f"task.max_prompt_tokens={prompt_limit} + "
                         f"{'rollout.max_trajectory_tokens' if episodic else 'rollout.max_new_tokens'}="
                         f"{response_width} + 1 = {max_model_len} tokens do not fit the model's "
                         f"{positions} positions")
    task_options = task.reward_actor_options()  # its shipments go to the object store once Ray is up
    shipments = tuple(v for v in (task_options or {}).values() if isinstance(v, Shipment))
    return Plan(models, prompts, eval_prompts, probe_set,
                fleet_spec(cfg, models, sampling, pad_id, max_model_len, task_options),
                RankSpec.of(cfg, model, task_options, cluster.local_cpus if local_ray else None),
                SyncSpec.of(cfg), cluster, resume_from, resume_state, shipments)
