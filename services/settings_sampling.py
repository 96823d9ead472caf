"""The settings of what a job samples and scores: the model, the task, the rollout engines, the reference,
the reward (a judge among its kinds) and distillation. Sections of ``services.config.JobConfig``, which
checks the rules across them."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PositiveFloat, PositiveInt, model_validator

# The probe's default bound on max |engine - learner| log-prob, per dtype. fp32 engines match the learner
# to ~1e-6. In bf16 the engine's and the learner's kernels round differently: measured 0.02 on randomwalks
# and 0.37 on SmolLM2-135M's probe at the start (mean 0.075; 0.15 on sampled responses), 0.54 after one GRPO
# step (2026-12-01); the same SmolLM2 in bf16 against fp32 on random tokens differs by up to 0.49 (mean
# 0.06). Weights that did not load differ by nats on most tokens; a sync one small step behind is not caught
# in bf16: the version check covers that.
PROBE_TOLERANCE = {"float32": 1e-4, "bfloat16": 1.0}
DYNAMIC_SAMPLING_ROUNDS = 3  # rollout.dynamic_sampling_max_rounds' default


class Section(BaseModel):
    # unknown fields are typos, never silently ignored
    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    def changed_fields(self) -> list[str]:
        """The fields set away from their default, sorted: a resolved config (--print-config, a run's
        config.yaml) sets every field, so being set alone says nothing."""
        return sorted(k for k in self.model_fields_set
                      if getattr(self, k) != type(self).model_fields[k].default)


class ModelConfig(Section):
    path: str | None = Field(None, description="HF model dir (config, weights, tokenizer) or hub id; "
                             "smollm2: the SmolLM2-135M-Instruct installed with the project; none: task "
                             "recipe + SFT")
    cache_dir: str = Field("~/.cache/tether", description="where SFT warm starts are cached by config hash")
    sft_steps: PositiveInt = Field(400, description="SFT warm-start optimizer steps on the task's corpus")
    sft_batch_size: PositiveInt = Field(100, description="SFT warm-start batch size")
    sft_lr: PositiveFloat = Field(1e-3, description="SFT warm-start learning rate")


class TaskConfig(Section):
    name: str = Field("randomwalks", description="task name from services.tasks.TASKS")
    seed: int = Field(1000, description="task data seed (randomwalks: graph and walks)")
    max_prompt_tokens: PositiveInt = Field(
        16, description="longest prompt allowed, in tokens; a dataset job with it unset: its longest prompt, "
        "up to the model's positions less the response's (said at start)")
    long_prompts: Literal["reject", "truncate"] = Field(
        "reject", description="what to do with longer prompts")
    # task.name=dataset: your own prompts from a file (services/tasks/dataset.py)
    path: str | None = Field(None, description="dataset: a .jsonl, .json, .csv or .parquet file, or a saved "
                             "Hugging Face dataset directory; read once, by the driver")
    prompt_field: str = Field("prompt", description="dataset: the field with the prompt: text, or chat "
                              "messages (a list of {role, content}) that get the model's chat template")
    split: str = Field("train", description="dataset: the training split of a saved dataset "
                       "directory with splits")
    eval_path: str | None = Field(None, description="dataset: evaluation prompts from this file or directory")
    eval_split: str | None = Field(None, description="dataset: evaluation prompts from this split (of "
                                   "eval_path, or else of path); neither: the training prompts")
    reward_function: str | None = Field(
        None, description="dataset: package.module:function (reward.kind=function), called as its parameters "
        "say: per sample as function(prompt=, completion=, **fields) -> float; TRL's per batch as "
        "function(prompts=, completions=, **columns) -> list (conversational completions where the prompts "
        "are chat messages); verl's compute_score(data_source, solution_str, ground_truth, extra_info) per "
        "sample")
    reward_fields: list[str] = Field(default_factory=list, description="dataset: the row's fields passed to "
                                     "reward_function by name, e.g. a reference answer; a nested field "
                                     "(verl's reward_model.ground_truth) by its last part")
    # task.name=environment: multi-turn episodes with your own environment (services/environments)
    environment: str | None = Field(None, description="environment: package.module:factory returning an "
                                    "environment (reset(row, seed), step(action)) or a gymnasium.Env")
    environment_kwargs: dict[str, Any] = Field(default_factory=dict, description="environment: keyword "
                                               "arguments the factory is called with")
    environment_workers: PositiveInt = Field(2, description="environment: Ray actors that run the "
                                             "environments' steps, outside the engines' processes")
    environment_num_cpus: float = Field(0.1, ge=0, description="environment: CPUs reserved "
                                        "per environment worker")
    environment_step_timeout_s: PositiveFloat = Field(30.0, description="environment: deadline of one reset "
                                                      "or step; past it the episode fails and is generated "
                                                      "again")
    environment_max_failures: int = Field(8, ge=0, description="environment: failed episodes (a step that "
                                          "raised, hung or returned a malformed result, a worker that died) "
                                          "a rollout engine regenerates before the job fails naming the last "
                                          "one")

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
        reads = {"dataset": DATASET_FIELDS, "environment": ENVIRONMENT_FIELDS,
                 "agent": AGENT_FIELDS}.get(self.name, ())
        given = [f for f in (*DATASET_FIELDS, *ENVIRONMENT_FIELDS) if f not in reads
                 and getattr(self, f) != TaskConfig.model_fields[f].default
                 and getattr(self, f) not in ([], {})]
        if given:
            owner = "dataset" if given[0] in DATASET_FIELDS else "environment"
            raise ValueError(f"task.{given[0]} is set but task.name={self.name!r} does not read it: the "
                             f"{', '.join('task.' + f for f in given)} settings are for task.name={owner!r}")
        if self.name == "agent" and not self.path:
            raise ValueError("task.name='agent' needs task.path: a file of rows (.jsonl, .json, .csv, "
                             ".parquet or a saved dataset directory), each passed whole to rollout.agent")
        if self.name == "environment":
            if not self.environment or ":" not in self.environment:
                raise ValueError("task.name='environment' needs task.environment: package.module:factory "
                                 f"(got {self.environment!r})")
            if self.seed != TaskConfig.model_fields["seed"].default:
                raise ValueError(f"task.seed={self.seed} is set but task.name='environment' does not read "
                                 "it: an environment's own seed is one of its task.environment_kwargs")
            return self
        if self.name != "dataset":
            return self
        if not self.path:
            raise ValueError("task.name='dataset' needs task.path: a .jsonl, .json, .csv or .parquet file, "
                             "or a saved Hugging Face dataset directory")
        if self.reward_function is not None and ":" not in self.reward_function:
            raise ValueError(f"task.reward_function={self.reward_function!r} is not of the form "
                             "package.module:function")
        reserved = {"prompt", "completion", "prompts", "completions", "solution_str"} & {
            f.rsplit(".", 1)[-1] for f in self.reward_fields}
        if reserved:
            raise ValueError(f"task.reward_fields names {sorted(reserved)}: the reward function already "
                             "receives the prompt and the completion by those names; rename the field in the "
                             "dataset")
        return self


DATASET_FIELDS = ("path", "prompt_field", "split", "eval_path", "eval_split", "reward_function",
                  "reward_fields")
# what task.name=environment reads: its rows from a file as a dataset's prompts, or from the environment
ENVIRONMENT_OPTIONS = ("environment", "environment_kwargs", "path", "split", "eval_path", "eval_split")
# what task.name=agent reads: the rows each episode's agent gets
AGENT_FIELDS = ("path", "split", "eval_path", "eval_split")
ENVIRONMENT_FIELDS = (*ENVIRONMENT_OPTIONS, "environment_workers", "environment_num_cpus",
                      "environment_step_timeout_s", "environment_max_failures")


class RolloutConfig(Section):
    engine: Literal["vllm", "hf"] = Field("vllm", description="generation engine: vLLM or "
                                          "transformers generate")
    num_engines: PositiveInt = Field(1, description="rollout actors, one engine each")
    batch_size: PositiveInt = Field(128, description="episodes per iteration (one rollout batch)")
    chunk_size: PositiveInt = Field(32, description="episodes per streamed chunk")
    samples_per_prompt: PositiveInt = Field(
        1, description="episodes sampled per prompt (a group); batch_size and chunk_size count episodes and "
        "must be multiples of it. The group estimators (ppo.advantage grpo, rloo, reinforce_pp_baseline) "
        "need >= 2")
    temperature: PositiveFloat = Field(1.0, description="sampling temperature")
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus sampling mass; only 1.0 (no truncation) is "
                         "accepted: the learner and the reference score the full softmax")
    max_new_tokens: PositiveInt | None = Field(None, description="response length cap (one turn's, in "
                                               "multi-turn episodes); none = the task's")
    ignore_eos: bool = Field(
        False, description="benchmarks only: every response runs to max_new_tokens, EOS sampled and kept as "
        "any other token (vLLM's ignore_eos), so that two systems are timed at equal lengths; the responses "
        "have no end, so refused beside reward.missing_eos_penalty, and with rollout.engine 'hf' or an "
        "episodic task")
    kv_cache_mib: PositiveInt = Field(256, description="vLLM KV cache size in MiB (CPU)")
    engine_threads: PositiveInt = Field(
        1, description="vLLM on CPU: each engine's threads, bound to that many cores (engine i from core "
        "i x engine_threads: VLLM_CPU_OMP_THREADS_BIND, unless the environment sets it). A synchronous job "
        "whose engine generates a batch alone (rollout.chunk_size = rollout.batch_size: nothing scores "
        "beside it) can give it every core; where another role runs beside it, their threads wait on each "
        "other")
    gpu_memory_utilization: float | None = Field(
        None, gt=0, le=1, description="vLLM's share of each of its GPUs (CUDA only); none = 0.9 of the share "
        "the role reserved per GPU (cluster.rollout.num_gpus over rollout.tensor_parallel_size, at most 1)")
    enforce_eager: bool = Field(True, description="vLLM without CUDA graphs / compilation: fast starts")
    tensor_parallel_size: PositiveInt = Field(1, description="GPUs per vLLM engine (tensor parallel)")
    distributed_executor_backend: Literal["uni", "mp", "ray"] | None = Field(
        None, description="vLLM executor: none = 'uni' (the engine in the actor's process) for "
        "tensor_parallel_size 1, 'mp' (a worker process per GPU of the actor's one bundle) for more; 'ray' "
        "is refused")
    eval_samples_per_prompt: PositiveInt = Field(8, description="samples per eval prompt")
    mode: Literal["sync", "async"] = Field(
        "sync", description="sync: generate a batch, then train on it; async: the engines generate the next "
        "batch with the weights they hold while the learner trains on this one")
    max_staleness: int = Field(1, ge=0, description="async: the most policy versions a trained row may lag "
                               "the learner; no batch starts that would arrive staler (0: async is sync)")
    in_flight_updates: Literal["off", "keep_kv", "partial"] = Field(
        "off", description="async: how a new policy version reaches the batch being generated. off: its load "
        "waits for the generation in progress, so every response is one version's; keep_kv: it loads between "
        "two decoding steps and the requests in flight go on with the keys and values they hold; partial "
        "(partial rollouts): the requests in flight stop at the load and go on under the new weights, their "
        "prefix prefilled again. Every sampled token records the version in force when it was sampled, and a "
        "row's staleness is its oldest token's")
    max_turns: PositiveInt = Field(8, description="environment: the model's turns in one episode at most")
    max_trajectory_tokens: PositiveInt = Field(
        256, description="environment, agent: tokens after the prompt in one trajectory at most (the model's "
        "and the environment's); a longer trajectory is cut, with finish reason length")
    agent: str | None = Field(None, description="task.name agent: package.module:function, an async "
                              "agent(base_url, row) -> reward that runs any agent against the "
                              "OpenAI-compatible endpoint at base_url (served by the rollout engine, every "
                              "token recorded)")
    agent_timeout_s: PositiveFloat = Field(300.0, description="agent: deadline of one episode; past it the "
                                           "episode fails and is generated again")
    agent_max_failures: int = Field(8, ge=0, description="agent: failed episodes (raised, timed out, "
                                    "returned no number or made no model call) a rollout engine regenerates "
                                    "before the job fails naming the last one")
    dynamic_sampling: bool = Field(
        False, description="DAPO's dynamic sampling (group estimators): prompt groups whose scores all tie "
        "are dropped and more prompts generated, a batch's worth a round, until every learner rank holds its "
        "share of groups whose scores differ")
    dynamic_sampling_max_rounds: PositiveInt = Field(
        DYNAMIC_SAMPLING_ROUNDS, description="dynamic sampling: extra rounds of generation at most per "
        "batch; a rank still short after them fills its share with tied groups (counted: "
        "dynamic_sampling_filled_groups)")

    def vllm_engine_args(self, gpu_share: float = 0.0) -> dict[str, Any]:
        """The vLLM ``LLM(...)`` arguments these settings map to, for an engine holding ``gpu_share`` of each
        of its GPUs (0: none, on CPU). The executor is always named: left to vLLM, an engine inside a Ray
        placement group gets the 'ray' executor (vllm/config/parallel.py), which takes its workers' GPUs
        from that group (``_executor_runs_in_one_bundle``). On a GPU the memory share is
        ``gpu_memory_utilization``, or else 0.9 of the share the role reserved: a fixed fraction would leave
        most of a GPU of its own unused, or overrun one it shares."""
        args: dict[str, Any] = {"enforce_eager": self.enforce_eager,
                                "tensor_parallel_size": self.tensor_parallel_size,
                                "distributed_executor_backend": self.distributed_executor_backend
                                or ("mp" if self.tensor_parallel_size > 1 else "uni")}
        if gpu_share or self.gpu_memory_utilization is not None:
            args["gpu_memory_utilization"] = (self.gpu_memory_utilization
                                              or round(0.9 * min(1.0, gpu_share), 4))
        return args

    @model_validator(mode="after")
    def _executor_runs_in_one_bundle(self) -> RolloutConfig:
        """Each engine is one actor holding one bundle with all its GPUs. vLLM 0.32's 'ray' executor reuses
        the actor's placement group: it refuses any bundle with more than one GPU and would place its workers
        on bundles that other roles hold (vllm/v1/executor/ray_utils.py, initialize_ray_cluster). 'uni' runs
        one worker: one GPU."""
        backend, tp = self.distributed_executor_backend, self.tensor_parallel_size
        if backend == "ray":
            raise ValueError("rollout.distributed_executor_backend='ray' is refused: vLLM's ray executor "
                             "places its workers in the engine actor's placement group, tether's, whose "
                             "bundles belong to the other actors, and refuses a bundle with more than one "
                             "GPU; use 'mp' (or none: 'uni' for rollout.tensor_parallel_size 1, 'mp' for "
                             "more)")
        if backend == "uni" and tp > 1:
            raise ValueError(f"rollout.distributed_executor_backend='uni' runs one worker on one GPU, but "
                             f"rollout.tensor_parallel_size={tp} needs a worker per GPU; use 'mp' (or none)")
        return self

    @model_validator(mode="after")
    def _dynamic_sampling_rounds(self) -> RolloutConfig:
        # by value, not by which fields were given: a dumped config (config.yaml, --print-config) holds them
        # all
        if not self.dynamic_sampling and self.dynamic_sampling_max_rounds != DYNAMIC_SAMPLING_ROUNDS:
            raise ValueError(f"rollout.dynamic_sampling_max_rounds={self.dynamic_sampling_max_rounds} is set "
                             "but rollout.dynamic_sampling is false; set rollout.dynamic_sampling=true or "
                             "drop it")
        return self

    @model_validator(mode="after")
    def _staleness_is_async(self) -> RolloutConfig:
        default = RolloutConfig.model_fields["max_staleness"].default
        if self.mode == "sync" and self.max_staleness != default:
            raise ValueError(f"rollout.max_staleness={self.max_staleness} is set but rollout.mode='sync' "
                             "ignores it: sync trains each batch on the policy version that generated it; "
                             f"set rollout.mode='async', or rollout.max_staleness={default} (its default)")
        return self

    @model_validator(mode="after")
    def _no_truncated_sampling(self) -> RolloutConfig:
        if self.top_p < 1:
            raise ValueError(
                f"rollout.top_p={self.top_p} is refused: the learner's and the reference's log-probs are "
                "taken on the full softmax, so the PPO ratio and the KL would be computed against a "
                "distribution that did not produce the samples; use rollout.top_p=1.0 (rollout.temperature "
                "is applied on both sides)")
        return self


class ReferenceConfig(Section):
    placement: Literal["auto", "actor", "learner"] = Field(
        "auto", description="actor: reference actors of their own (cluster.reference: their resources); "
        "learner: each learner rank holds a frozen copy of the initial policy on its device and scores its "
        "own chunks (one process fewer to start, no log-probs to ship; the copy's memory on the rank's "
        "device); auto: learner when the learner and the reference are both on CPU, no other reference "
        "setting is changed and LoRA is off (its learner.lora.reference: actor asks for an actor), else "
        "actor")
    backend: Literal["hf", "vllm"] = Field("hf", description="hf: learner numerics (default); "
                                           "vllm: prompt_logprobs")
    num_actors: PositiveInt = Field(1, description="reference actors")
    torch_threads: PositiveInt | None = Field(
        None, description="CPU threads of each reference actor's torch (backend hf); none = Ray's default "
        "(one per whole CPU of the actor). On a CPU-only node it runs below the engines' priority, so it can "
        "use their cores while they idle")
    gpu_memory_utilization: float | None = Field(
        None, gt=0, le=1, description="backend vllm on CUDA: vLLM's share of its GPU (weights and KV cache); "
        "none = 0.9 of the role's share, cluster.reference.num_gpus (at most 1)")

    @model_validator(mode="after")
    def _threads_of_the_hf_backend(self) -> ReferenceConfig:
        if self.torch_threads is not None and self.backend != "hf":
            raise ValueError(f"reference.torch_threads={self.torch_threads} sets the threads of backend "
                             f"'hf'; backend {self.backend!r} runs vLLM's CPU worker, which sets its own")
        if self.gpu_memory_utilization is not None and self.backend != "vllm":
            raise ValueError(f"reference.gpu_memory_utilization={self.gpu_memory_utilization} sizes backend "
                             f"'vllm' on a GPU, but reference.backend={self.backend!r}; set it to null")
        return self


class DistillConfig(Section):
    """On-policy distillation: a teacher model scores the student's own samples (an actor like the reference),
    and each sampled token pays ``coef`` times the reverse KL's estimate ``log pi_student - log
    pi_teacher``."""

    teacher_path: str | None = Field(None, description="the teacher: a Hugging Face model dir or hub id with "
                                     "the policy's tokenizer (an export of a run: <run directory>/export); "
                                     "none = off")
    coef: PositiveFloat = Field(1.0, description="the fixed weight of the per-token reverse KL to the "
                                "teacher (not the controller's beta, which goes on weighing the KL to the "
                                "reference)")
    credit: Literal["reward_to_go", "token"] = Field(
        "reward_to_go", description="reward_to_go: the terms join the per-token rewards beside the reference "
        "KL and each estimator credits them as it credits the KL penalty: the exact gradient of the "
        "sequence-level reverse KL, and GAE's critic learns the KL to go (on randomwalks it ended nearer the "
        "teacher than token: benchmarks/distillation.py); token: each token's advantage gets its own term "
        "after the estimator, the gradient of the per-state reverse KL along the student's own states "
        "(Thinking Machines' on-policy distillation, slime, GKD), which leaves out how a token moves the "
        "later states")
    task_reward: bool = Field(True, description="also learn from the task's score; false: the teacher alone "
                              "(the scores are still computed, logged and evaluated)")
    num_actors: PositiveInt = Field(1, description="teacher actors (cluster.teacher: each one's resources)")


class JudgeConfig(Section):
    """An LLM judge (services/reward_service/judge.py): reward.kind judge in the reward actors, or --judge
    FILE in the service."""

    model_path: str = Field(description="the judge model (a Hugging Face dir or hub id) run by vLLM")
    template: str = Field(description="the judge's prompt, a Python format string with {prompt}, {response} "
                          "and the row's fields (task.reward_fields); a literal brace is {{ or }}")
    parse: Literal["number", "labels"] = Field(
        "number", description="number: the first number of the answer is the score; labels: the first of "
        "reward.judge.labels found in it (a whole word, any case) gives its score")
    pattern: str | None = Field(None, description="a regular expression searched in the answer; its first "
                                "group (else the whole match) is the number or label read; none = the first "
                                "number, or the first label")
    score_range: tuple[float, float] | None = Field(
        None, description="parse number: [low, high]; a number outside it is unparseable")
    labels: dict[str, float] | None = Field(None, description="parse labels: each label's score")
    unparseable_score: float = Field(description="the score of an answer the rule cannot read (no default: "
                                     "choose it); such answers are counted, reward_judge_unparseable")
    chat: bool = Field(True, description="send the template as a user message through the judge's chat "
                       "template (when its tokenizer has one)")
    max_new_tokens: PositiveInt = Field(16, description="the answer's length limit, tokens")
    temperature: float = Field(0.0, ge=0, description="0: greedy, the same response gets the same score")
    seed: int = Field(0, description="the judge's sampling seed")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field("auto", description="the judge's dtype")
    max_model_len: PositiveInt = Field(2048, description="longest judge prompt plus answer, tokens")
    kv_cache_mib: PositiveInt = Field(256, description="the judge's KV cache on CPU, MiB")
    gpu_memory_utilization: float | None = Field(
        None, gt=0, le=1, description="on CUDA: the judge's share of its GPU; none = 0.9 of the reward "
        "role's share (cluster.reward.num_gpus, at most 1)")

    @model_validator(mode="after")
    def _a_rule_that_can_read(self) -> JudgeConfig:
        import math
        import re

        from services.judge_template import template_fields

        template_fields(self.template)  # names only, and {response} among them
        if self.parse == "labels":
            if not self.labels:
                raise ValueError("reward.judge.parse='labels' needs reward.judge.labels, "
                                 "e.g. {yes: 1.0, no: 0.0}")
            if any(not label.strip() for label in self.labels):
                raise ValueError("reward.judge.labels has an empty label")
            if self.score_range is not None:
                raise ValueError("reward.judge.score_range bounds parse 'number'; with parse 'labels' set it "
                                 "to null")
        elif self.labels is not None:
            raise ValueError("reward.judge.labels is set but reward.judge.parse='number'; set parse: labels")
        if self.score_range is not None and not self.score_range[0] < self.score_range[1]:
            raise ValueError(f"reward.judge.score_range={list(self.score_range)} must be [low, high] with "
                             "low < high")
        if self.pattern is not None:
            try:
                groups = re.compile(self.pattern).groups
            except re.error as err:
                raise ValueError(f"reward.judge.pattern={self.pattern!r} "
                                 f"is not a regular expression: {err}") from None
            if groups > 1:
                raise ValueError(f"reward.judge.pattern={self.pattern!r} has {groups} groups; the first is "
                                 "read, so make the others non-capturing, (?:...)")
        values = [self.unparseable_score, *(self.labels or {}).values(), *(self.score_range or ())]
        if not all(math.isfinite(v) for v in values):
            raise ValueError("reward.judge: unparseable_score, labels and score_range must be finite numbers")
        return self

    def engine_args(self, reward_gpus: float) -> dict[str, Any]:
        """The judge's ``LLM(...)`` arguments: eager, one process; on a GPU its share (see
        gpu_memory_utilization)."""
        args: dict[str, Any] = {"enforce_eager": True, "distributed_executor_backend": "uni"}
        if share := min(1.0, reward_gpus):
            args["gpu_memory_utilization"] = self.gpu_memory_utilization or round(0.9 * share, 4)
        return args


class RewardConfig(Section):
    kind: Literal["function", "model", "remote", "judge"] = Field(
        "function", description="the task's function, a classifier model, a reward service over HTTP "
        "(remote), or an LLM judge run by vLLM (reward.judge)")
    placement: Literal["auto", "actor", "learner"] = Field(
        "auto", description="actor: reward actors of their own (cluster.reward: their resources); learner "
        "(kind function): each learner rank scores its own chunks and its share of the evaluation with the "
        "task's function (one process fewer to start, no scores to ship, the function's time in the rank's); "
        "auto: learner for kind function when the learner and the reward are both on CPU and neither "
        "reward.num_actors nor cluster.reward is changed, else actor")
    model_path: str | None = Field(None, description="sequence-classification reward model dir (kind=model)")
    label: int | str | None = Field(None, description="the classifier output that is the reward: an index or "
                                    "a name from its config.id2label; required when it has more than one "
                                    "label")
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
        None, description="DAPO's soft overlong punishment: the last this many tokens before "
        "rollout.max_new_tokens (Lmax); a response of L tokens scores -(L - (Lmax - buffer)) / buffer * "
        "overlong_penalty more within them, -overlong_penalty at Lmax; none = no penalty")
    overlong_penalty: float | None = Field(None, description="the overlong punishment at Lmax (> 0; DAPO: "
                                           "1.0); set with reward.overlong_buffer")

    @model_validator(mode="after")
    def _remote_needs_url(self) -> RewardConfig:
        from urllib.parse import urlsplit

        if self.kind == "remote":
            if not self.url:
                raise ValueError("reward.kind='remote' needs reward.url (http(s)://host:port of the reward "
                                 "service)")
            parts = urlsplit(self.url)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise ValueError(f"reward.url={self.url!r} must be http(s)://host:port")
            if parts.username or parts.password:
                raise ValueError("reward.url must not hold credentials: put the token in the environment "
                                 "variable named by reward.token_env")
        elif self.url is not None:
            raise ValueError(f"reward.url is set but reward.kind={self.kind!r} ignores it; set "
                             "reward.kind=remote or reward.url=null")
        if (self.overlong_buffer is None) != (self.overlong_penalty is None):
            raise ValueError("reward.overlong_buffer and reward.overlong_penalty go together: the buffer "
                             "(tokens before rollout.max_new_tokens) and the penalty at the cap")
        if self.overlong_penalty is not None and not self.overlong_penalty > 0:
            raise ValueError(f"reward.overlong_penalty={self.overlong_penalty} must be > 0: it is subtracted "
                             "from the score of responses that reach into reward.overlong_buffer (a negative "
                             "one would reward length)")
        if (self.kind == "judge") != (self.judge is not None):
            raise ValueError("reward.kind='judge' needs reward.judge (model_path, template, "
                             "unparseable_score)"
                             if self.kind == "judge" else
                             f"reward.judge is set but reward.kind={self.kind!r}; set reward.kind=judge or "
                             "reward.judge=null")
        return self
