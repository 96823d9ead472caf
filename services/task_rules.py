"""The rules across settings sections on rewards and tasks: part of ``services.job_rules.JOB_RULES``, checked
after its others (``services.config`` imports this module after that one)."""

from __future__ import annotations

from typing import Any

from services.job_rules import AGENT, EPISODIC_TASKS, rule

# --- rewards ---

@rule("reward.kind", "reward.model_path", example={"reward": {"kind": "model"}})
def reward_model_needs_its_path(cfg: Any) -> str | None:
    if cfg.reward.kind == "model" and not cfg.reward.model_path:
        return "reward.kind='model' needs reward.model_path"
    return None


JUDGE = {"model_path": "judge", "template": "Rate {response} 0-10:", "unparseable_score": 0.0}


@rule("reward.judge.template", "task.reward_fields",
      example={"reward": {"kind": "judge",
                          "judge": {**JUDGE, "template": "Rate {response} against {answer}:"}}})
def judge_template_fields_from_the_task(cfg: Any) -> str | None:
    from services.judge_template import check_template_fields

    if cfg.reward.judge is None:
        return None
    try:
        check_template_fields(cfg.reward.judge.template, cfg.task.reward_fields,
                              f"task {cfg.task.name!r} (task.reward_fields={cfg.task.reward_fields})")
    except ValueError as err:
        return str(err)
    return None


@rule("reward.judge.gpu_memory_utilization", "cluster.reward.num_gpus",
      example={"reward": {"kind": "judge", "judge": {**JUDGE, "gpu_memory_utilization": 0.3}}})
def judge_gpu_memory_needs_a_gpu(cfg: Any) -> str | None:
    judge = cfg.reward.judge
    if judge is not None and judge.gpu_memory_utilization is not None and not cfg.cluster.reward.num_gpus:
        return (f"reward.judge.gpu_memory_utilization={judge.gpu_memory_utilization} sizes the judge on a "
                "GPU, but cluster.reward.num_gpus=0 runs it on CPU; set it to null")
    return None


@rule("reward.judge.gpu_memory_utilization", "cluster.reward.num_gpus",
      example={"reward": {"kind": "judge", "judge": {**JUDGE, "gpu_memory_utilization": 0.5}},
               "cluster": {"reward": {"num_gpus": 0.25}}})
def judge_gpu_memory_within_its_share(cfg: Any) -> str | None:
    judge, share = cfg.reward.judge, cfg.cluster.reward.num_gpus
    if (judge is not None and judge.gpu_memory_utilization is not None and share
            and judge.gpu_memory_utilization > share):
        return (f"reward.judge.gpu_memory_utilization={judge.gpu_memory_utilization} exceeds the GPU share "
                f"of a reward actor, cluster.reward.num_gpus={share}")
    return None


@rule("task.name", "reward.kind", "task.reward_function",
      example={"task": {"name": "dataset", "path": "prompts.jsonl"}, "model": {"path": "policy"}})
def dataset_function_reward_needs_its_function(cfg: Any) -> str | None:
    if cfg.task.name == "dataset" and cfg.reward.kind == "function" and not cfg.task.reward_function:
        return ("task.name='dataset' with reward.kind='function' needs task.reward_function "
                "(package.module:function), or another reward.kind")
    return None


@rule("task.reward_function", "reward.kind",
      example={"task": {"name": "dataset", "path": "prompts.jsonl", "reward_function": "my_rewards:score"},
               "model": {"path": "policy"}, "reward": {"kind": "model", "model_path": "scorer"}})
def reward_function_needs_kind_function(cfg: Any) -> str | None:
    if cfg.task.reward_function and cfg.reward.kind != "function":
        return (f"task.reward_function is set but reward.kind={cfg.reward.kind!r} scores the responses; set "
                "task.reward_function=null or reward.kind='function'")
    return None


@rule("reward.label", "reward.kind", example={"reward": {"label": "POSITIVE"}})
def reward_label_needs_a_model(cfg: Any) -> str | None:
    if cfg.reward.kind != "model" and cfg.reward.label is not None:
        return (f"reward.label={cfg.reward.label!r} is set but reward.kind={cfg.reward.kind!r} has no "
                "labels; set reward.label=null")
    return None


# --- tasks ---

@rule("task.name", "model.path",
      example={"task": {"name": "dataset", "path": "prompts.jsonl", "reward_function": "my_rewards:score"}})
def dataset_needs_a_policy(cfg: Any) -> str | None:
    if cfg.task.name == "dataset" and not cfg.model.path:
        return "task.name='dataset' needs model.path: the policy to train on your prompts"
    return None


@rule("task.name", "rollout.agent",
      example={"task": {"name": "agent", "path": "rows.jsonl"}, "model": {"path": "p"}})
def agent_task_needs_an_agent(cfg: Any) -> str | None:
    if cfg.task.name == "agent" and cfg.rollout.agent is None:
        return ("task.name='agent' and rollout.agent go together: the agent function "
                "(package.module:function) runs one episode per row of task.path")
    return None


@rule("rollout.agent", "task.name", example={"rollout": {"agent": "my_agent:run"}})
def agent_needs_the_agent_task(cfg: Any) -> str | None:
    if cfg.rollout.agent is not None and cfg.task.name != "agent":
        return (f"rollout.agent={cfg.rollout.agent!r} is set but task.name={cfg.task.name!r}; set "
                "task.name='agent' (rows from task.path)")
    return None


@rule("rollout.agent", example={**AGENT, "rollout": {"agent": "my_agent.run"}})
def agent_is_a_function_path(cfg: Any) -> str | None:
    agent = cfg.rollout.agent
    if agent is not None and ":" not in agent:
        return f"rollout.agent={agent!r} is not of the form package.module:function"
    return None


@rule("rollout.agent", "model.path", example={**AGENT, "model": {"path": None}})
def agent_needs_a_policy(cfg: Any) -> str | None:
    if cfg.rollout.agent is not None and not cfg.model.path:
        return "task.name='agent' needs model.path: the policy the agent's calls are served by"
    return None


@rule("task.name", "reward.kind", example={**AGENT, "reward": {"kind": "model", "model_path": "scorer"}})
def episodes_are_their_own_reward(cfg: Any) -> str | None:
    if cfg.task.name in EPISODIC_TASKS and cfg.reward.kind != "function":
        return (f"task.name={cfg.task.name!r} is rewarded by its episodes (the environment's steps, the "
                f"agent's return), but reward.kind={cfg.reward.kind!r}; set reward.kind='function'")
    return None


@rule("task.name", "reward.score_clip", "reward.missing_eos_penalty",
      example={**AGENT, "reward": {"missing_eos_penalty": 1.0}})
def episode_rewards_as_they_are(cfg: Any) -> str | None:
    if cfg.task.name in EPISODIC_TASKS:
        for field in ("score_clip", "missing_eos_penalty"):
            if getattr(cfg.reward, field) is not None:
                return (f"reward.{field} is set but task.name={cfg.task.name!r} takes its rewards from its "
                        f"episodes as they are; set reward.{field}=null")
    return None


@rule("task.name", "reward.overlong_buffer",
      example={**AGENT, "reward": {"overlong_buffer": 4, "overlong_penalty": 1.0}, "rollout": {
          "agent": "my_agent:run", "max_new_tokens": 8}})
def episodes_pay_no_overlong_penalty(cfg: Any) -> str | None:
    if cfg.task.name in EPISODIC_TASKS and cfg.reward.overlong_buffer is not None:
        return (f"reward.overlong_buffer is set but task.name={cfg.task.name!r} takes its rewards from its "
                "episodes as they are, and a trajectory's length holds the environment's tokens; set "
                "reward.overlong_buffer=null")
    return None


@rule("task.name", "ppo.mask_truncated", "rollout.dynamic_sampling",
      example={**AGENT, "ppo": {"mask_truncated": True}})
def episodes_are_not_single_responses(cfg: Any) -> str | None:
    if cfg.task.name in EPISODIC_TASKS and (cfg.ppo.mask_truncated or cfg.rollout.dynamic_sampling):
        field = "ppo.mask_truncated" if cfg.ppo.mask_truncated else "rollout.dynamic_sampling"
        return (f"{field} is for single responses: task.name={cfg.task.name!r} gives trajectories cut by the "
                "turn and token budgets and rewarded per turn; set it to false")
    return None


@rule("rollout.max_new_tokens", "rollout.max_trajectory_tokens",
      example={**AGENT, "rollout": {"agent": "my_agent:run", "max_new_tokens": 64,
                                    "max_trajectory_tokens": 32}})
def turn_within_the_trajectory(cfg: Any) -> str | None:
    r = cfg.rollout
    if (cfg.task.name in EPISODIC_TASKS and r.max_new_tokens is not None
            and r.max_new_tokens > r.max_trajectory_tokens):
        return (f"rollout.max_new_tokens={r.max_new_tokens} (one turn) exceeds rollout.max_trajectory_tokens="
                f"{r.max_trajectory_tokens} (the whole episode)")
    return None


# --- distillation ---

@rule("distill.*", "distill.teacher_path", example={"distill": {"coef": 0.5}})
def distillation_needs_a_teacher(cfg: Any) -> str | None:
    d = cfg.distill
    unused = [k for k in d.changed_fields() if k != "teacher_path"] if d.teacher_path is None else []
    if unused:
        return (f"distill.{unused[0]} is set but distill.teacher_path is not: without a teacher there is no "
                "distillation; set distill.teacher_path")
    return None


@rule("distill.task_reward", "rollout.dynamic_sampling",
      example={"distill": {"teacher_path": "teacher", "task_reward": False},
               "rollout": {"dynamic_sampling": True, "samples_per_prompt": 4}, "ppo": {"advantage": "grpo"}})
def teacher_alone_keeps_every_group(cfg: Any) -> str | None:
    if cfg.distill.teacher_path is not None and not cfg.distill.task_reward and cfg.rollout.dynamic_sampling:
        return ("rollout.dynamic_sampling drops the groups whose scores tie, and with "
                "distill.task_reward=false no score is trained on: every group would be dropped")
    return None
