"""JobConfig: the one pydantic tree every setting lives in. Loads from YAML, takes CLI overrides
(``--kl.target 6``) through pydantic-settings, and validates with messages that name the field."""

from __future__ import annotations

import hashlib
import json
import warnings
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, PositiveFloat, PositiveInt, model_validator
from pydantic_settings import BaseSettings, CliApp, SettingsConfigDict

from services.choices import GROUP_ESTIMATORS, GRPO_TOKEN_K3_WARNING, Estimator, LossForm

# The probe's default bound on max |engine - learner| log-prob, per dtype. fp32 engines match the learner
# to ~1e-6. In bf16 the engine's and the learner's kernels round differently: measured 0.02 on randomwalks
# and 0.37 on SmolLM2-135M's probe at the start (mean 0.075; 0.15 on sampled responses), 0.54 after one GRPO
# step (2026-12-01); the same SmolLM2 in bf16 against fp32 on random tokens differs by up to 0.49 (mean
# 0.06). Weights that did not load differ by nats on most tokens; a sync one small step behind is not caught
# in bf16: the version check covers that.
PROBE_TOLERANCE = {"float32": 1e-4, "bfloat16": 1.0}
DYNAMIC_SAMPLING_ROUNDS = 3  # rollout.dynamic_sampling_max_rounds' default
# vLLM's max_lora_rank takes these (vllm.config.lora.MaxLoRARanks; tests/test_lora.py checks): an engine that takes
# LoRA adapters starts with the smallest one at least learner.lora.rank
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


class Section(BaseModel):
    # unknown fields are typos, never silently ignored
    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    def changed_fields(self) -> list[str]:
        """The fields set away from their default, sorted: a resolved config (--print-config, a run's
        config.yaml) sets every field, so being set alone says nothing."""
        return sorted(k for k in self.model_fields_set if getattr(self, k) != type(self).model_fields[k].default)


class ModelConfig(Section):
    path: str | None = Field(None, description="HF model dir (config, weights, tokenizer); none = task recipe + SFT")
    cache_dir: str = Field("~/.cache/tether", description="where SFT warm starts are cached by config hash")
    sft_steps: PositiveInt = Field(400, description="SFT warm-start optimizer steps on the task's corpus")
    sft_batch_size: PositiveInt = Field(100, description="SFT warm-start batch size")
    sft_lr: PositiveFloat = Field(1e-3, description="SFT warm-start learning rate")


class TaskConfig(Section):
    name: str = Field("randomwalks", description="task name from services.tasks.TASKS")
    seed: int = Field(1000, description="task data seed (randomwalks: graph and walks)")
    max_prompt_tokens: PositiveInt = Field(16, description="longest prompt allowed, in tokens")
    long_prompts: Literal["reject", "truncate"] = Field("reject", description="what to do with longer prompts")
    # task.name=dataset: your own prompts from a file (services/tasks/dataset.py)
    path: str | None = Field(None, description="dataset: a .jsonl, .json, .csv or .parquet file, or a saved Hugging "
                             "Face dataset directory; read once, by the driver")
    prompt_field: str = Field("prompt", description="dataset: the field with the prompt: text, or chat messages "
                              "(a list of {role, content}) that get the model's chat template")
    split: str = Field("train", description="dataset: the training split of a saved dataset directory with splits")
    eval_path: str | None = Field(None, description="dataset: evaluation prompts from this file or directory")
    eval_split: str | None = Field(None, description="dataset: evaluation prompts from this split (of eval_path, "
                                   "or else of path); neither: the training prompts")
    reward_function: str | None = Field(None, description="dataset: package.module:function called per sample "
                                        "as function(prompt=, completion=, **fields) -> float (reward.kind=function)")
    reward_fields: list[str] = Field(default_factory=list, description="dataset: the row's fields passed to "
                                     "reward_function by name, e.g. a reference answer")
    # task.name=environment: multi-turn episodes with your own environment (services/environments)
    environment: str | None = Field(None, description="environment: package.module:factory returning an "
                                    "environment (reset(row, seed), step(action)) or a gymnasium.Env")
    environment_kwargs: dict[str, Any] = Field(default_factory=dict, description="environment: keyword arguments "
                                               "the factory is called with")
    environment_workers: PositiveInt = Field(2, description="environment: Ray actors that run the environments' "
                                             "steps, outside the engines' processes")
    environment_num_cpus: float = Field(0.1, ge=0, description="environment: CPUs reserved per environment worker")
    environment_step_timeout_s: PositiveFloat = Field(30.0, description="environment: deadline of one reset or "
                                                      "step; past it the episode fails and is generated again")
    environment_max_failures: int = Field(8, ge=0, description="environment: failed episodes (a step that raised, "
                                          "hung or returned a malformed result, a worker that died) a rollout "
                                          "engine regenerates before the job fails naming the last one")

    def options(self) -> dict[str, Any]:
        """The keyword arguments the task is built from (``services.tasks.get_task(name, **options)``)."""
        if self.name == "agent":
            return {"seed": self.seed, **self.model_dump(include=set(AGENT_FIELDS))}
        if self.name == "environment":
            return {"seed": self.seed, **self.model_dump(include=set(ENVIRONMENT_OPTIONS))}
        if self.name != "dataset":
            return {"seed": self.seed}
        return {"seed": self.seed, **self.model_dump(include=set(DATASET_FIELDS))}

    @model_validator(mode="after")
    def _dataset_fields(self) -> TaskConfig:
        reads = {"dataset": DATASET_FIELDS, "environment": ENVIRONMENT_FIELDS, "agent": AGENT_FIELDS}.get(self.name, ())
        given = [f for f in (*DATASET_FIELDS, *ENVIRONMENT_FIELDS) if f not in reads
                 and getattr(self, f) != TaskConfig.model_fields[f].default and getattr(self, f) not in ([], {})]
        if given:
            owner = "dataset" if given[0] in DATASET_FIELDS else "environment"
            raise ValueError(f"task.{given[0]} is set but task.name={self.name!r} does not read it: the "
                             f"{', '.join('task.' + f for f in given)} settings are for task.name={owner!r}")
        if self.name == "agent" and not self.path:
            raise ValueError("task.name='agent' needs task.path: a file of rows (.jsonl, .json, .csv, .parquet or a "
                             "saved dataset directory), each passed whole to rollout.agent")
        if self.name == "environment":
            if not self.environment or ":" not in self.environment:
                raise ValueError(f"task.name='environment' needs task.environment: package.module:factory (got "
                                 f"{self.environment!r})")
            if self.seed != TaskConfig.model_fields["seed"].default:
                raise ValueError(f"task.seed={self.seed} is set but task.name='environment' does not read it: an "
                                 "environment's own seed is one of its task.environment_kwargs")
            return self
        if self.name != "dataset":
            return self
        if not self.path:
            raise ValueError("task.name='dataset' needs task.path: a .jsonl, .json, .csv or .parquet file, or a "
                             "saved Hugging Face dataset directory")
        if self.reward_function is not None and ":" not in self.reward_function:
            raise ValueError(f"task.reward_function={self.reward_function!r} is not of the form "
                             "package.module:function")
        reserved = {"prompt", "completion"} & set(self.reward_fields)
        if reserved:
            raise ValueError(f"task.reward_fields names {sorted(reserved)}: the reward function already receives "
                             "prompt= and completion=; rename the field in the dataset")
        return self


DATASET_FIELDS = ("path", "prompt_field", "split", "eval_path", "eval_split", "reward_function", "reward_fields")
# what task.name=environment reads: its rows from a file as a dataset's prompts, or from the environment
ENVIRONMENT_OPTIONS = ("environment", "environment_kwargs", "path", "split", "eval_path", "eval_split")
# what task.name=agent reads: the rows each episode's agent gets
AGENT_FIELDS = ("path", "split", "eval_path", "eval_split")
ENVIRONMENT_FIELDS = (*ENVIRONMENT_OPTIONS, "environment_workers", "environment_num_cpus",
                      "environment_step_timeout_s", "environment_max_failures")


class RolloutConfig(Section):
    engine: Literal["vllm", "hf"] = Field("vllm", description="generation engine: vLLM or transformers generate")
    num_engines: PositiveInt = Field(1, description="rollout actors, one engine each")
    batch_size: PositiveInt = Field(128, description="episodes per iteration (one rollout batch)")
    chunk_size: PositiveInt = Field(32, description="episodes per streamed chunk")
    samples_per_prompt: PositiveInt = Field(
        1, description="episodes sampled per prompt (a group); batch_size and chunk_size count episodes and "
        "must be multiples of it. The group estimators (ppo.advantage grpo, rloo, reinforce_pp_baseline) need >= 2")
    temperature: PositiveFloat = Field(1.0, description="sampling temperature")
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus sampling mass; only 1.0 (no truncation) is "
                         "accepted: the learner and the reference score the full softmax")
    max_new_tokens: PositiveInt | None = Field(None, description="response length cap (one turn's, in multi-turn "
                                               "episodes); none = the task's")
    kv_cache_mib: PositiveInt = Field(256, description="vLLM KV cache size in MiB (CPU)")
    gpu_memory_utilization: float = Field(0.3, gt=0, le=1, description="vLLM's share of its GPU (CUDA only)")
    enforce_eager: bool = Field(True, description="vLLM without CUDA graphs / compilation: fast starts")
    tensor_parallel_size: PositiveInt = Field(1, description="GPUs per vLLM engine (tensor parallel)")
    distributed_executor_backend: Literal["uni", "mp", "ray"] | None = Field(
        None, description="vLLM executor: none = 'uni' (the engine in the actor's process) for "
        "tensor_parallel_size 1, 'mp' (a worker process per GPU of the actor's one bundle) for more; 'ray' is "
        "refused")
    eval_samples_per_prompt: PositiveInt = Field(8, description="samples per eval prompt")
    mode: Literal["sync", "async"] = Field(
        "sync", description="sync: generate a batch, then train on it; async: the engines generate the next "
        "batch with the weights they hold while the learner trains on this one")
    max_staleness: int = Field(1, ge=0, description="async: the most policy versions a trained row may lag the "
                               "learner; no batch starts that would arrive staler (0: async is sync)")
    max_turns: PositiveInt = Field(8, description="environment: the model's turns in one episode at most")
    max_trajectory_tokens: PositiveInt = Field(
        256, description="environment, agent: tokens after the prompt in one trajectory at most (the model's and "
        "the environment's); a longer trajectory is cut, with finish reason length")
    agent: str | None = Field(None, description="task.name agent: package.module:function, an async "
                              "agent(base_url, row) -> reward that runs any agent against the OpenAI-compatible "
                              "endpoint at base_url (served by the rollout engine, every token recorded)")
    agent_timeout_s: PositiveFloat = Field(300.0, description="agent: deadline of one episode; past it the "
                                           "episode fails and is generated again")
    agent_max_failures: int = Field(8, ge=0, description="agent: failed episodes (raised, timed out, returned "
                                    "no number or made no model call) a rollout engine regenerates before the "
                                    "job fails naming the last one")
    dynamic_sampling: bool = Field(
        False, description="DAPO's dynamic sampling (group estimators): prompt groups whose scores all tie are "
        "dropped and more prompts generated, a batch's worth a round, until every learner rank holds its share "
        "of groups whose scores differ")
    dynamic_sampling_max_rounds: PositiveInt = Field(
        DYNAMIC_SAMPLING_ROUNDS, description="dynamic sampling: extra rounds of generation at most per batch; a rank still short after "
        "them fills its share with tied groups (counted: dynamic_sampling_filled_groups)")

    def vllm_engine_args(self) -> dict[str, Any]:
        """The vLLM ``LLM(...)`` arguments these settings map to. The executor is always named: left to vLLM,
        an engine inside a Ray placement group gets the 'ray' executor (vllm/config/parallel.py), which
        takes its workers' GPUs from that group (``_executor_runs_in_one_bundle``)."""
        return {"enforce_eager": self.enforce_eager, "tensor_parallel_size": self.tensor_parallel_size,
                "gpu_memory_utilization": self.gpu_memory_utilization,
                "distributed_executor_backend": self.distributed_executor_backend
                or ("mp" if self.tensor_parallel_size > 1 else "uni")}

    @model_validator(mode="after")
    def _executor_runs_in_one_bundle(self) -> RolloutConfig:
        """Each engine is one actor holding one bundle with all its GPUs. vLLM 0.32's 'ray' executor reuses
        the actor's placement group: it refuses any bundle with more than one GPU and would place its workers
        on bundles that other roles hold (vllm/v1/executor/ray_utils.py, initialize_ray_cluster). 'uni' runs
        one worker: one GPU."""
        backend, tp = self.distributed_executor_backend, self.tensor_parallel_size
        if backend == "ray":
            raise ValueError("rollout.distributed_executor_backend='ray' is refused: vLLM's ray executor places its "
                             "workers in the engine actor's placement group, tether's, whose bundles belong to the "
                             "other actors, and refuses a bundle with more than one GPU; use 'mp' (or none: 'uni' "
                             "for rollout.tensor_parallel_size 1, 'mp' for more)")
        if backend == "uni" and tp > 1:
            raise ValueError(f"rollout.distributed_executor_backend='uni' runs one worker on one GPU, but "
                             f"rollout.tensor_parallel_size={tp} needs a worker per GPU; use 'mp' (or none)")
        return self

    @model_validator(mode="after")
    def _dynamic_sampling_rounds(self) -> RolloutConfig:
        # by value, not by which fields were given: a dumped config (config.yaml, --print-config) holds them all
        if not self.dynamic_sampling and self.dynamic_sampling_max_rounds != DYNAMIC_SAMPLING_ROUNDS:
            raise ValueError(f"rollout.dynamic_sampling_max_rounds={self.dynamic_sampling_max_rounds} is set but "
                             "rollout.dynamic_sampling is false; set rollout.dynamic_sampling=true or drop it")
        return self

    @model_validator(mode="after")
    def _staleness_is_async(self) -> RolloutConfig:
        default = RolloutConfig.model_fields["max_staleness"].default
        if self.mode == "sync" and self.max_staleness != default:
            raise ValueError(f"rollout.max_staleness={self.max_staleness} is set but rollout.mode='sync' ignores it: "
                             "sync trains each batch on the policy version that generated it; set "
                             f"rollout.mode='async', or rollout.max_staleness={default} (its default)")
        return self

    @model_validator(mode="after")
    def _no_truncated_sampling(self) -> RolloutConfig:
        if self.top_p < 1:
            raise ValueError(
                f"rollout.top_p={self.top_p} is refused: the learner's and the reference's log-probs are taken on "
                "the full softmax, so the PPO ratio and the KL would be computed against a distribution that did "
                "not produce the samples; use rollout.top_p=1.0 (rollout.temperature is applied on both sides)")
        return self


class ReferenceConfig(Section):
    backend: Literal["hf", "vllm"] = Field("hf", description="hf: learner numerics (default); vllm: prompt_logprobs")
    num_actors: PositiveInt = Field(1, description="reference actors")
    torch_threads: PositiveInt | None = Field(
        None, description="CPU threads of each reference actor's torch (backend hf); none = Ray's default (one "
        "per whole CPU of the actor). On a CPU-only node it runs below the engines' priority, so it can use "
        "their cores while they idle")
    gpu_memory_utilization: float | None = Field(
        None, gt=0, le=1, description="backend vllm on CUDA: vLLM's share of its GPU (weights and KV cache); "
        "none = 0.9 of the role's share, cluster.reference.num_gpus (at most 1)")

    @model_validator(mode="after")
    def _threads_of_the_hf_backend(self) -> ReferenceConfig:
        if self.torch_threads is not None and self.backend != "hf":
            raise ValueError(f"reference.torch_threads={self.torch_threads} sets the threads of backend 'hf'; "
                             f"backend {self.backend!r} runs vLLM's CPU worker, which sets its own")
        if self.gpu_memory_utilization is not None and self.backend != "vllm":
            raise ValueError(f"reference.gpu_memory_utilization={self.gpu_memory_utilization} sizes backend 'vllm' "
                             f"on a GPU, but reference.backend={self.backend!r}; set it to null")
        return self


class DistillConfig(Section):
    """On-policy distillation: a teacher model scores the student's own samples (an actor like the reference),
    and each sampled token pays ``coef`` times the reverse KL's estimate ``log pi_student - log pi_teacher``."""

    teacher_path: str | None = Field(None, description="the teacher: a Hugging Face model dir or hub id with the "
                                     "policy's tokenizer (an export of a run: <run directory>/export); none = off")
    coef: PositiveFloat = Field(1.0, description="the fixed weight of the per-token reverse KL to the teacher (not "
                                "the controller's beta, which goes on weighing the KL to the reference)")
    credit: Literal["reward_to_go", "token"] = Field(
        "reward_to_go", description="reward_to_go: the terms join the per-token rewards beside the reference KL and "
        "each estimator credits them as it credits the KL penalty: the exact gradient of the sequence-level reverse "
        "KL, and GAE's critic learns the KL to go (on randomwalks it ended nearer the teacher than token: "
        "benchmarks/distillation.py); token: each token's advantage gets its own term after the estimator, the "
        "gradient of the per-state reverse KL along the student's own states (Thinking Machines' on-policy "
        "distillation, slime, GKD), which leaves out how a token moves the later states")
    task_reward: bool = Field(True, description="also learn from the task's score; false: the teacher alone (the "
                              "scores are still computed, logged and evaluated)")
    num_actors: PositiveInt = Field(1, description="teacher actors (cluster.teacher: each one's resources)")


class JudgeConfig(Section):
    """An LLM judge (services/judge.py): reward.kind judge in the reward actors, or --judge FILE in the service."""

    model_path: str = Field(description="the judge model (a Hugging Face dir or hub id) run by vLLM")
    template: str = Field(description="the judge's prompt, a Python format string with {prompt}, {response} and "
                          "the row's fields (task.reward_fields); a literal brace is {{ or }}")
    parse: Literal["number", "labels"] = Field(
        "number", description="number: the first number of the answer is the score; labels: the first of "
        "reward.judge.labels found in it (a whole word, any case) gives its score")
    pattern: str | None = Field(None, description="a regular expression searched in the answer; its first group "
                                "(else the whole match) is the number or label read; none = the first number, "
                                "or the first label")
    score_range: tuple[float, float] | None = Field(
        None, description="parse number: [low, high]; a number outside it is unparseable")
    labels: dict[str, float] | None = Field(None, description="parse labels: each label's score")
    unparseable_score: float = Field(description="the score of an answer the rule cannot read (no default: "
                                     "choose it); such answers are counted, reward_judge_unparseable")
    chat: bool = Field(True, description="send the template as a user message through the judge's chat template "
                       "(when its tokenizer has one)")
    max_new_tokens: PositiveInt = Field(16, description="the answer's length limit, tokens")
    temperature: float = Field(0.0, ge=0, description="0: greedy, the same response gets the same score")
    seed: int = Field(0, description="the judge's sampling seed")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field("auto", description="the judge's dtype")
    max_model_len: PositiveInt = Field(2048, description="longest judge prompt plus answer, tokens")
    kv_cache_mib: PositiveInt = Field(256, description="the judge's KV cache on CPU, MiB")
    gpu_memory_utilization: float | None = Field(
        None, gt=0, le=1, description="on CUDA: the judge's share of its GPU; none = 0.9 of the reward role's "
        "share (cluster.reward.num_gpus, at most 1)")

    @model_validator(mode="after")
    def _a_rule_that_can_read(self) -> JudgeConfig:
        import math
        import re

        from services.judge_template import template_fields

        template_fields(self.template)  # names only, and {response} among them
        if self.parse == "labels":
            if not self.labels:
                raise ValueError("reward.judge.parse='labels' needs reward.judge.labels, e.g. {yes: 1.0, no: 0.0}")
            if any(not label.strip() for label in self.labels):
                raise ValueError("reward.judge.labels has an empty label")
            if self.score_range is not None:
                raise ValueError("reward.judge.score_range bounds parse 'number'; with parse 'labels' set it to null")
        elif self.labels is not None:
            raise ValueError("reward.judge.labels is set but reward.judge.parse='number'; set parse: labels")
        if self.score_range is not None and not self.score_range[0] < self.score_range[1]:
            raise ValueError(f"reward.judge.score_range={list(self.score_range)} must be [low, high] with low < high")
        if self.pattern is not None:
            try:
                groups = re.compile(self.pattern).groups
            except re.error as err:
                raise ValueError(f"reward.judge.pattern={self.pattern!r} is not a regular expression: {err}") from None
            if groups > 1:
                raise ValueError(f"reward.judge.pattern={self.pattern!r} has {groups} groups; the first is read, so "
                                 "make the others non-capturing, (?:...)")
        values = [self.unparseable_score, *(self.labels or {}).values(), *(self.score_range or ())]
        if not all(math.isfinite(v) for v in values):
            raise ValueError("reward.judge: unparseable_score, labels and score_range must be finite numbers")
        return self

    def engine_args(self, reward_gpus: float) -> dict[str, Any]:
        """The judge's ``LLM(...)`` arguments: eager, one process; on a GPU its share (see gpu_memory_utilization)."""
        args: dict[str, Any] = {"enforce_eager": True, "distributed_executor_backend": "uni"}
        if share := min(1.0, reward_gpus):
            args["gpu_memory_utilization"] = self.gpu_memory_utilization or round(0.9 * share, 4)
        return args


class RewardConfig(Section):
    kind: Literal["function", "model", "remote", "judge"] = Field(
        "function", description="the task's function, a classifier model, a reward service over HTTP (remote), "
        "or an LLM judge run by vLLM (reward.judge)")
    model_path: str | None = Field(None, description="sequence-classification reward model dir (kind=model)")
    label: int | str | None = Field(None, description="the classifier output that is the reward: an index or a "
                                    "name from its config.id2label; required when it has more than one label")
    num_actors: PositiveInt = Field(1, description="reward actors")
    score_clip: PositiveFloat | None = Field(None, description="clip scores to [-c, c]; none = no clip")
    missing_eos_penalty: float | None = Field(
        None, description="score given instead of its own to a response cut at max_new_tokens without EOS "
        "(lm-human-preferences' penalty_reward_value, -1 there); none = no penalty")
    url: str | None = Field(None, description="reward service base URL, http(s)://host:port (kind=remote; "
                            "serve one with python -m services.reward_service)")
    token_env: str = Field("TETHER_REWARD_TOKEN", description="environment variable holding the service's "
                           "bearer token, read on the reward actors (else forwarded from the driver's)")
    timeout_s: PositiveFloat = Field(30.0, description="longest wait for one answer of the reward service")
    max_retries: int = Field(3, ge=0, description="retries of a reward request that timed out or got a 5xx, "
                             "with exponential backoff; a 4xx or a malformed answer ends the job")
    judge: JudgeConfig | None = Field(None, description="the LLM judge (kind=judge)")
    overlong_buffer: PositiveInt | None = Field(
        None, description="DAPO's soft overlong punishment: the last this many tokens before rollout.max_new_tokens "
        "(Lmax); a response of L tokens scores -(L - (Lmax - buffer)) / buffer * overlong_penalty more within them, "
        "-overlong_penalty at Lmax; none = no penalty")
    overlong_penalty: float | None = Field(None, description="the overlong punishment at Lmax (> 0; DAPO: 1.0); "
                                           "set with reward.overlong_buffer")

    @model_validator(mode="after")
    def _remote_needs_url(self) -> RewardConfig:
        from urllib.parse import urlsplit

        if self.kind == "remote":
            if not self.url:
                raise ValueError("reward.kind='remote' needs reward.url (http(s)://host:port of the reward service)")
            parts = urlsplit(self.url)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise ValueError(f"reward.url={self.url!r} must be http(s)://host:port")
            if parts.username or parts.password:
                raise ValueError("reward.url must not hold credentials: put the token in the environment "
                                 "variable named by reward.token_env")
        elif self.url is not None:
            raise ValueError(f"reward.url is set but reward.kind={self.kind!r} ignores it; set reward.kind=remote "
                             "or reward.url=null")
        if (self.overlong_buffer is None) != (self.overlong_penalty is None):
            raise ValueError("reward.overlong_buffer and reward.overlong_penalty go together: the buffer (tokens "
                             "before rollout.max_new_tokens) and the penalty at the cap")
        if self.overlong_penalty is not None and not self.overlong_penalty > 0:
            raise ValueError(f"reward.overlong_penalty={self.overlong_penalty} must be > 0: it is subtracted from the "
                             "score of responses that reach into reward.overlong_buffer (a negative one would reward "
                             "length)")
        if (self.kind == "judge") != (self.judge is not None):
            raise ValueError("reward.kind='judge' needs reward.judge (model_path, template, unparseable_score)"
                             if self.kind == "judge" else
                             f"reward.judge is set but reward.kind={self.kind!r}; set reward.kind=judge or "
                             "reward.judge=null")
        return self


# a policy this large is a pretrained model, not a task's small model trained from scratch (the embedded
# randomwalks GPT-2 has about 1M parameters)
PRETRAINED_PARAMETERS = 20_000_000


# what only GAE reads (learner/advantages.py's _gae; the critic's value loss, learner/algorithm.py), and what it is
GAE_ONLY_FIELDS = {
    "lam": "GAE's lambda",
    "whiten_rewards": "the whitening of the per-token rewards GAE sees",
    "whiten_advantages": "the whitening of GAE's advantages (the other estimators normalise theirs as they define)",
    "vf_coef": "the weight of the critic's value loss",
    "clip_range_value": "the clip of the critic's values in its value loss",
}


def _shown(value: Any) -> str:
    """A setting's value as the YAML and the command line write it: true, false, null, 'text', 0.5."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return "null" if value is None else repr(value)


class PPOConfig(Section):
    advantage: Estimator = Field(
        "gae", description="advantage estimator (learner.advantages): gae (with a critic), or the critic-free "
        "grpo, rloo, reinforce_pp, reinforce_pp_baseline")
    epochs: PositiveInt = Field(4, description="PPO epochs over each rollout batch")
    minibatch_size: PositiveInt = Field(64, description="episodes per optimizer step, over all ranks")
    lr: PositiveFloat = Field(3e-4, description="AdamW learning rate")
    lr_schedule: Literal["constant", "linear"] = Field(
        "constant", description="linear: lr * (1 - (i - 1) / run.iterations) at iteration i, annealed to 0 over "
        "the run as in lm-human-preferences; constant: lr throughout")
    adam_betas: tuple[float, float] = Field((0.9, 0.95), description="AdamW betas")
    weight_decay: float = Field(1e-6, ge=0, description="AdamW weight decay")
    clip_range: PositiveFloat = Field(0.2, description="policy ratio clip epsilon")
    clip_range_low: PositiveFloat | None = Field(
        None, description="lower ratio clip epsilon, the ratio's floor 1 - it (< 1); none = clip_range "
        "(policy_loss ppo)")
    clip_range_high: PositiveFloat | None = Field(
        None, description="upper ratio clip epsilon, the ratio's ceiling 1 + it (DAPO's clip-higher: 0.28 with a "
        "low of 0.2); none = clip_range (policy_loss ppo)")
    policy_loss: Literal["ppo", "gspo", "gspo_token"] = Field(
        "ppo", description="ppo: a ratio per token; gspo: one length-normalised ratio per sequence, "
        "(pi/pi_old)^(1/|y|), clipped per sequence (Zheng et al. 2025); gspo_token: GSPO's ratio with each token's "
        "gradient (its per-token advantages)")
    gspo_clip_low: PositiveFloat = Field(3e-4, description="gspo, gspo_token: lower clip epsilon of the sequence "
                                         "ratio (the paper's 3e-4)")
    gspo_clip_high: PositiveFloat = Field(4e-4, description="gspo, gspo_token: upper clip epsilon of the sequence "
                                          "ratio (the paper's 4e-4)")
    clip_range_value: PositiveFloat = Field(0.2, description="value clip around old values (gae only)")
    vf_coef: float = Field(1.0, ge=0, description="value loss weight (gae only)")
    gamma: float = Field(1.0, gt=0, le=1, description="discount (gae, reinforce_pp; reinforce_pp_baseline takes "
                         "only 1)")
    lam: float = Field(0.95, ge=0, le=1, description="GAE lambda")
    whiten_advantages: bool = Field(True, description="whiten GAE's advantages over the batch (gae only: the "
                                    "other estimators normalise as defined)")
    whiten_rewards: bool = Field(False, description="scale the KL-penalised per-token rewards to unit variance "
                                 "over the batch, mean kept, before GAE (lm-human-preferences: true; gae only)")
    loss_aggregation: Literal["token_mean", "sequence_mean", "seq_mean_token_sum_norm"] = Field(
        "token_mean", description="loss mean: over tokens, over sequences (each over its tokens), or "
        "seq_mean_token_sum_norm (Dr. GRPO: each sequence's token sum over rollout.max_new_tokens, then the mean)")
    max_grad_norm: PositiveFloat = Field(1.0, description="gradient clipping norm")
    mask_truncated: bool = Field(
        False, description="DAPO's overlong filtering: responses cut at rollout.max_new_tokens without EOS leave the "
        "policy and value losses (their advantages and the groups' baselines are computed with them, and their KL "
        "still counts in the controller's statistic)")
    correction: Literal["tis", "mis", "none"] = Field(
        "tis", description="rollout correction, both modes: each token's loss term times w = pi_old / pi_behav, the "
        "learner's policy at the start of the update over the engine's sampled log-probs; tis truncates w at is_cap, "
        "mis masks what exceeds it; none only in sync mode")
    correction_level: Literal["token", "sequence"] = Field(
        "token", description="the rollout correction's weight: per token, or the whole response's likelihood ratio "
        "on each of its tokens (gspo takes sequence)")
    is_cap: PositiveFloat = Field(2.0, description="the rollout correction's bound on w = pi_old / pi_behav (> 1): "
                                  "tis truncates w to it, mis masks the tokens (sequence: rows) beyond it; in async "
                                  "mode pi_old is pi_prox (decoupled PPO)")
    grpo_normalize: Literal["score", "return"] = Field(
        "score", description="grpo with the KL in the reward: score normalises the score in its group and adds the "
        "KL penalty to go unscaled (DeepSeekMath, OpenRLHF, TRL); return normalises score - beta * KL_b (verl's "
        "use_kl_in_reward, only to reproduce it: where a group's scores tie, KL noise becomes unit advantages)")

    @model_validator(mode="after")
    def _estimator_settings(self) -> PPOConfig:
        if self.advantage == "reinforce_pp_baseline" and self.gamma != 1:
            raise ValueError(f"ppo.advantage='reinforce_pp_baseline' needs ppo.gamma=1 (got {self.gamma}): the group "
                             "baseline subtracted at the last token and discounted reaches token t as "
                             "-gamma^(L-1-t) * baseline, a bias by the response's length L (OpenRLHF forces 1)")
        if self.grpo_normalize != "score" and self.advantage != "grpo":
            raise ValueError(f"ppo.grpo_normalize={self.grpo_normalize!r} is set but ppo.advantage="
                             f"{self.advantage!r} ignores it; set ppo.grpo_normalize='score' or ppo.advantage='grpo'")
        defaults = type(self).model_fields
        if self.advantage != "gae":
            # by value, not by which fields were given: a dumped config (config.yaml, --print-config) holds them all
            for name, what in GAE_ONLY_FIELDS.items():
                value, default = getattr(self, name), defaults[name].default
                if value != default:
                    raise ValueError(f"ppo.{name}={_shown(value)} is set but ppo.advantage={self.advantage!r} ignores "
                                     f"it: {what} is read only by ppo.advantage='gae'; set ppo.{name}="
                                     f"{_shown(default)} (its default) or ppo.advantage='gae'")
        if self.advantage in ("grpo", "rloo") and self.gamma != defaults["gamma"].default:
            raise ValueError(f"ppo.gamma={self.gamma} is set but ppo.advantage={self.advantage!r} ignores it: "
                             f"{self.advantage} scores each response by its undiscounted return; set ppo.gamma=1.0 "
                             "(its default), or ppo.advantage 'gae' or 'reinforce_pp', which discount")
        return self

    def ratio_clip_range(self) -> tuple[float, float]:
        """(eps_low, eps_high) of the policy ratio's clip: GSPO's own for gspo and gspo_token; else clip_range_low
        and clip_range_high, each clip_range when unset."""
        if self.policy_loss != "ppo":
            return self.gspo_clip_low, self.gspo_clip_high
        return (self.clip_range if self.clip_range_low is None else self.clip_range_low,
                self.clip_range if self.clip_range_high is None else self.clip_range_high)

    @model_validator(mode="after")
    def _policy_loss_settings(self) -> PPOConfig:
        gspo = self.policy_loss != "ppo"
        for name in ("clip_range_low", "clip_range_high"):
            if gspo and getattr(self, name) is not None:
                raise ValueError(f"ppo.{name} is set but ppo.policy_loss={self.policy_loss!r} clips its sequence ratio "
                                 "with ppo.gspo_clip_low and ppo.gspo_clip_high; set it to null")
        defaults = type(self).model_fields
        if gspo and self.clip_range != defaults["clip_range"].default:
            raise ValueError(f"ppo.clip_range={self.clip_range} is set but ppo.policy_loss={self.policy_loss!r} "
                             "ignores it: it clips its sequence ratio with ppo.gspo_clip_low and ppo.gspo_clip_high; "
                             f"set those, and ppo.clip_range={defaults['clip_range'].default} (its default), or "
                             "ppo.policy_loss='ppo'")
        both = self.clip_range_low is not None and self.clip_range_high is not None
        if both and self.clip_range != defaults["clip_range"].default:
            raise ValueError(f"ppo.clip_range={self.clip_range} is set but ppo.clip_range_low and ppo.clip_range_high "
                             "are both set, and the ratio's clip takes them alone; drop ppo.clip_range or one of "
                             "the two bounds")
        for name in ("gspo_clip_low", "gspo_clip_high"):
            if not gspo and getattr(self, name) != defaults[name].default:
                raise ValueError(f"ppo.{name}={getattr(self, name)} is set but ppo.policy_loss='ppo' ignores it; set "
                                 "ppo.policy_loss='gspo' (or 'gspo_token'), or ppo.clip_range_low/high for PPO's ratio")
        low = self.ratio_clip_range()[0]
        field = "gspo_clip_low" if gspo else "clip_range" if self.clip_range_low is None else "clip_range_low"
        if low >= 1:
            raise ValueError(f"ppo.{field}={low} puts the ratio's floor 1 - {low} at or below 0, where no ratio "
                             "reaches it (a ratio is > 0): the lower clip epsilon must be < 1")
        if self.policy_loss == "gspo" and self.advantage == "gae":
            raise ValueError("ppo.policy_loss='gspo' gives every token of a response the sequence's one ratio, so its "
                             "gradient averages GAE's per-token advantages over the response; use "
                             "ppo.policy_loss='gspo_token' (GSPO's ratio, each token's own advantage) with gae")
        if self.correction == "none":
            if self.correction_level != "token" or self.is_cap != defaults["is_cap"].default:
                raise ValueError("ppo.correction_level or ppo.is_cap is set but ppo.correction='none' ignores them; "
                                 "set ppo.correction to 'tis' or 'mis', or drop them")
            return self
        if self.is_cap <= 1:
            cut = "truncate" if self.correction == "tis" else "mask"
            raise ValueError(f"ppo.is_cap={self.is_cap} must be > 1 with ppo.correction={self.correction!r}: where the "
                             f"engine and the learner agree the weight is 1, and a bound at or below it would {cut} "
                             "the tokens the learner favours even there")
        if self.policy_loss == "gspo" and self.correction_level == "token":
            raise ValueError("ppo.policy_loss='gspo' takes one ratio per response; its rollout correction must be one "
                             "weight per response too, the response's likelihood ratio pi_old(y) / pi_behav(y): set "
                             "ppo.correction_level='sequence' (or ppo.correction='none' in sync mode)")
        return self


class KLConfig(Section):
    controller: Literal["adaptive", "fixed"] = Field("adaptive", description="adaptive (Ziegler et al.) or fixed")
    estimator: Literal["k1", "k2", "k3"] = Field("k1", description="per-token KL estimator")
    scope: Literal["response_sum", "token_mean"] = Field("response_sum", description="statistic fed to controller")
    placement: Literal["reward", "loss"] = Field("reward", description="KL penalty in the reward or in the loss")
    loss_form: LossForm | None = Field(
        None, description="KL term in the loss (placement 'loss' only): kl_to_go or response_k2 (exact gradient "
        "of the response KL, per response), or grpo_token_k3 (GRPO's, only to reproduce it)")
    init_kl_coef: float = Field(0.15, ge=0, description="initial beta")
    target: PositiveFloat | None = Field(6.0, description="target response KL, nats (adaptive only)")
    horizon: PositiveInt = Field(10000, description="controller horizon, episodes")

    @model_validator(mode="after")
    def _target_matches_controller(self) -> KLConfig:
        if self.controller == "adaptive" and self.target is None:
            raise ValueError("kl.target is required with kl.controller='adaptive'")
        if self.controller == "fixed" and self.target is not None:
            raise ValueError("kl.target is set but kl.controller='fixed' ignores it; set kl.target=null")
        if self.scope == "token_mean":
            warnings.warn("kl.scope='token_mean' feeds the controller a per-token mean (other frameworks' choice)")
        if self.placement == "loss" and self.loss_form is None:
            raise ValueError(
                "kl.placement='loss' needs kl.loss_form: a per-token k(r) in the loss has the wrong gradient "
                f"whichever kl.estimator (here {self.estimator!r}) it uses (k1: 0 in expectation; k3: the reverse "
                "KL's; k2: misses later tokens' log-ratios). Set kl.loss_form to 'kl_to_go' or 'response_k2' "
                "(exact gradient of the response KL) or 'grpo_token_k3' (only to reproduce GRPO)")
        if self.placement == "reward" and self.loss_form is not None:
            raise ValueError(f"kl.loss_form={self.loss_form!r} is set but kl.placement='reward' ignores it; "
                             "set kl.loss_form=null or kl.placement='loss'")
        if self.loss_form == "grpo_token_k3":
            warnings.warn(GRPO_TOKEN_K3_WARNING)
        return self


class RoleResources(Section):
    num_cpus: float = Field(0.25, ge=0, description="CPUs per actor")
    num_gpus: float = Field(0.0, ge=0, description="GPUs per actor (fractional to share)")
    resources: dict[str, float] = Field(default_factory=dict, description="custom Ray resources per actor")


class ClusterConfig(Section):
    address: str | None = Field(None, description="Ray address; none = RAY_ADDRESS (ray job) or a local Ray")
    num_cpus: PositiveInt | None = Field(None, description="CPUs of a local Ray started by the job")
    object_store_mib: PositiveInt = Field(512, description="object store of a local Ray, MiB")
    connect_timeout_s: PositiveFloat = Field(30.0, description="give up reaching the cluster after this")
    placement_timeout_s: PositiveFloat = Field(30.0, description="give up waiting for resources after this")
    rollout: RoleResources = Field(default_factory=RoleResources)
    reference: RoleResources = Field(default_factory=RoleResources)
    reward: RoleResources = Field(default_factory=RoleResources)
    teacher: RoleResources = Field(default_factory=RoleResources)  # distill.teacher_path only
    learner: RoleResources = Field(default_factory=RoleResources)


class LoraConfig(Section):
    """LoRA adapters on the policy (through peft); rank 0 trains every weight."""

    rank: int = Field(0, ge=0, description="the adapters' rank r; 0 = off (full fine-tuning)")
    alpha: PositiveFloat = Field(16.0, description="the adapters' scale is alpha / rank")
    target_modules: list[str] = Field(
        default_factory=lambda: ["all-linear"], min_length=1, description="the modules that get adapters, by "
        "name (a module matches when its dotted name ends with it: GPT-2's c_attn, c_proj, c_fc; Llama's q_proj, "
        "k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj), or ['all-linear'] (every linear layer but the "
        "output head)")
    sync: Literal["auto", "adapter", "merged"] = Field(
        "auto", description="adapter: where vLLM's implementation of the model takes LoRA adapters, the engines run "
        "with LoRA on and each sync ships the adapter alone (elsewhere the merged weights); merged: the engines run "
        "the plain model and each sync ships the base weights with the adapters merged in (float32 only: in bf16 "
        "W + BA rounds the adapters' updates away); auto: merged for float32 engines on CPU, where vLLM's build "
        "generates with an adapter 3-7x slower than without (benchmarks/trl_smollm2.py), else adapter")
    reference: Literal["base", "actor"] = Field(
        "base", description="base: the reference log-probs are the learner's own forward with the adapters "
        "disabled (the base model is the initial policy), so no reference actor or second copy of the weights; "
        "actor: the reference actors as without LoRA")

    @model_validator(mode="after")
    def _all_linear_alone(self) -> LoraConfig:
        if "all-linear" in self.target_modules and len(self.target_modules) > 1:
            raise ValueError(f"learner.lora.target_modules {self.target_modules}: 'all-linear' already takes every "
                             "linear layer; give it alone or name the modules")
        return self


class LearnerConfig(Section):
    world_size: PositiveInt = Field(1, description="DeepSpeed ranks")
    zero_stage: int = Field(0, ge=0, le=3, description="ZeRO stage 0-3")
    dtype: Literal["float32", "bfloat16"] = Field("float32", description="training dtype")
    critic: Literal["value_head", "separate"] = Field("value_head", description="value head or a separate critic")
    weight_sync: Literal["object_store", "nccl", "ipc"] = Field(
        "object_store", description="weights to the engines: Ray object store (CPU or GPU), or vLLM's weight "
        "transfer over NCCL (learner and engines on separate GPUs) or CUDA IPC (engines on the learner's GPUs)")
    sync_bucket_mib: PositiveInt = Field(64, description="packed buffer of vLLM's NCCL/IPC weight transfer, MiB; "
                                         "raised to the largest parameter's size when that is larger (logged)")
    collective_timeout_s: PositiveFloat = Field(
        1800.0, description="longest wait for the learner ranks in one call (rendezvous, collect, update, "
        "weight sync) before the job fails naming the ranks that did not answer")
    torch_threads: PositiveInt | None = Field(
        None, description="CPU threads of each rank's torch; none = Ray's default (one per whole CPU of the "
        "actor). On a CPU-only node the engines idle during the PPO update, so a rank can use their cores too")
    max_tokens_per_microbatch: PositiveInt | None = Field(
        None, description="pack the learner's forwards and backwards (and the reference's forward) into "
        "micro-batches of at most this many real tokens, sequences one after another without padding; one "
        "optimizer step accumulates as many as its minibatch needs. None: padded [rows, prompt + response] blocks. "
        "Attention without a variable-length kernel (SDPA, on CPU too) runs a micro-batch as one masked [N, N] "
        "block, so keep N to a few sequences' length there")
    lora: LoraConfig = Field(default_factory=LoraConfig)

    @property
    def vllm_lora_rank(self) -> int | None:
        """The max_lora_rank of an engine that takes the adapters: vLLM's smallest at least lora.rank (whether the
        engines take them is ``JobConfig.adapter_sync``)."""
        return next((r for r in VLLM_LORA_RANKS if r >= self.lora.rank), None) if self.lora.rank else None

    @property
    def reference_in_learner(self) -> bool:
        """LoRA with reference 'base': the learner ranks score the reference log-probs, no reference actor."""
        return self.lora.rank > 0 and self.lora.reference == "base"


class RunConfig(Section):
    iterations: PositiveInt = Field(30, description="rollout/train iterations")
    seed: int = Field(1000, description="seed for sampling, prompts and init")
    output_dir: str = Field("runs", description="parent of run directories: a local directory or a URI "
                            "(file://, s3://, gs://; s3 and gs need the s3fs or gcsfs package)")
    name: str = Field("randomwalks", description="run name: the run directory is output_dir/name")
    overwrite: bool = Field(False, description="replace an existing run directory")
    resume: str | None = Field(None, description="continue from a checkpoint: 'latest' or its directory")
    eval_every: PositiveInt = Field(5, description="evaluate every N iterations (and at the end)")
    probe_every: PositiveInt = Field(1, description="check engine vs learner log-probs every N syncs")
    probe_tolerance: PositiveFloat | None = Field(
        None, description="max |logp diff| allowed by the probe; none = by learner.dtype (float32 1e-4, "
        "bfloat16 see PROBE_TOLERANCE)")
    actor_max_restarts: int = Field(-1, ge=-1, description="restarts of a crashed rollout/reference/reward "
                                    "actor (-1: unlimited, as a long run on preemptible nodes needs)")
    max_chunk_retries: int = Field(3, ge=0, description="times a chunk lost to a dead actor is regenerated")


class WandbConfig(Section):
    enabled: bool = Field(False, description="log the run to Weights & Biases (WANDB_MODE=offline writes it "
                          "only to disk; WANDB_API_KEY or `wandb login` for the server)")
    project: str = Field("tether", description="wandb project")
    entity: str | None = Field(None, description="wandb entity (team or user); none = the account's default")
    name: str | None = Field(None, description="wandb run name; none = run.name")
    tags: list[str] = Field(default_factory=list, description="wandb run tags")


class MetricsConfig(Section):
    plot_every: PositiveInt = Field(10, description="redraw curves.png every N iterations (and at the end)")
    tensorboard: bool = Field(False, description="also write TensorBoard logs into the run directory")
    progress_bar: bool = Field(True, description="live progress bar when stdout is a terminal")
    eval_samples_saved: int = Field(8, ge=0, description="evaluation samples written as text to "
                                    "samples/iteration-NNNN.md at each evaluation (0 = none)")
    wandb: WandbConfig = Field(default_factory=WandbConfig)
    log_level: Literal["debug", "info", "warning", "error"] = Field(
        "warning", description="logging of vLLM, transformers, DeepSpeed and Ray in the driver and every actor "
        "(tether's own lines always show); debug also shows the warnings tether knows to be harmless")


class CheckpointConfig(Section):
    every: int = Field(10, ge=0, description="save every N iterations (0 = only at the end and on stop)")
    keep: PositiveInt = Field(3, description="how many checkpoints to keep")
    export_hf: bool = Field(True, description="at the end of the run, write the policy as a Hugging Face model "
                            "directory (safetensors, config, tokenizer) to <run directory>/export")


class JobConfig(BaseSettings):
    """All settings of a tether job."""

    model_config = SettingsConfigDict(
        extra="forbid",
        validate_assignment=True,
        # no cli_parse_args: set (even to False) it makes every JobConfig build an argparse parser of the whole tree
        # (pydantic-settings 2.x, 40 ms a config); the command line is learner.main's CliApp.run
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
        lr = PPOConfig.model_fields["lr"].default
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


def deep_merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = deep_merge(merged[key], value)
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
    return JobConfig.model_validate(deep_merge(data, overrides or {}))


def config_to_yaml(cfg: JobConfig) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)


__all__ = ["CliApp", "JobConfig", "config_to_yaml", "load_config", "read_yaml"]
