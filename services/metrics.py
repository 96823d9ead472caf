"""Metrics for the Ray dashboard through ``ray.util.metrics``; they appear on the head's Prometheus
endpoint as ``ray_tether_<name>``. Ray drops a gauge two report intervals after its last set, so
every gauge is set again each iteration.

Every series carries ``tether_run`` (the run name, run.name) and ``ray_job`` (the Ray job id). Not ``job``:
Prometheus keeps that label for its scrape job and renames ours to ``exported_job``, so a board filtering
on it would merge every run."""

from __future__ import annotations

import os

from ray.util.metrics import Counter, Gauge

TAG_KEYS = ("tether_run", "ray_job", "role")


def run_name() -> str:
    """The run these metrics belong to: ``TETHER_RUN``, which learner.cluster sets in the driver and in
    every actor; an actor started outside a job has none."""
    return os.environ.get("TETHER_RUN", "")

# driver gauges: name -> (metrics.jsonl key, description)
DRIVER_GAUGES = {
    "kl_coef": ("kl_coef", "beta after this iteration's controller update"),
    "kl_response_mean": ("kl_response_mean", "mean response KL, nats (the controller's statistic)"),
    "kl_response_mean_stderr": ("kl_response_mean_stderr",
                                "standard error of the controller's statistic, nats"),
    "kl_token_mean": ("kl_token_mean", "per-token mean KL, nats (diagnostic)"),
    "kl_target": ("kl_target", "the controller's target response KL, nats"),
    "reward_mean": ("reward_mean", "mean per-episode reward: score minus beta * KL"),
    "score_mean": ("score_mean", "mean reward-function score"),
    "response_length_mean": ("response_length_mean", "mean response tokens"),
    "learner_step_seconds": ("learner_seconds", "seconds from generate to the end of the PPO update"),
    "weight_sync_seconds": ("weight_sync_seconds", "seconds to load new weights into the engines"),
    "rollout_learner_logprob_mismatch": ("rollout_learner_logprob_mismatch",
                                         ("mean |engine - learner| sampled-token log-prob, rows of the "
                                          "learner's version")),
    "rollout_stale_logprob_shift": ("rollout_stale_logprob_shift",
                                    ("mean |engine - learner| sampled-token log-prob on rows of an older "
                                     "version (async): the policy's move since")),
    # multi-turn episodes (task.name environment); unset for single responses
    "turns_per_episode": ("turns_mean", "the model's turns per episode"),
    "tool_calls_per_episode": ("tool_calls_mean", "tool calls the environment executed per episode"),
    "environment_seconds": ("environment_seconds", "environment seconds this iteration, over all episodes"),
    "trajectory_model_tokens_mean": ("trajectory_model_tokens_mean", "tokens the model sampled per episode"),
    "trajectory_environment_tokens_mean": ("trajectory_environment_tokens_mean",
                                           "tokens the environment added per episode"),
    "environment_failures": ("environment_failures", "episodes regenerated after their environment failed"),
    "truncated_fraction": ("truncated_fraction", "episodes cut at the length or turn limit"),
    # on-policy distillation (distill.teacher_path); unset without a teacher
    "teacher_kl_response_mean": ("teacher_kl_response_mean",
                                 "mean response reverse KL to the teacher, nats (k1 of the sampled tokens)"),
    # reward.kind judge; unset for other rewards
    "reward_judge_unparseable": ("reward_judge_unparseable",
                                 ("judge answers this iteration that its rule could not read (scored "
                                  "unparseable_score)")),
    "iteration": ("iteration", "last finished iteration"),
    "policy_version": ("policy_version", "the learner's policy version"),
}


class DriverMetrics:
    def __init__(self, job_id: str) -> None:
        self.tags = {"tether_run": run_name(), "ray_job": job_id, "role": "driver"}
        self.gauges = {name: Gauge(f"tether_{name}", description=desc, tag_keys=TAG_KEYS)
                       for name, (_, desc) in DRIVER_GAUGES.items()}
        self.iterations = Counter("tether_iterations", description="finished iterations", tag_keys=TAG_KEYS)
        self.episodes = Counter("tether_episodes", description="trained episodes", tag_keys=TAG_KEYS)

    def record(self, record: dict) -> None:
        for name, (key, _) in DRIVER_GAUGES.items():
            value = record.get(key)
            if value is not None:
                self.gauges[name].set(float(value), tags=self.tags)
        self.iterations.inc(1, tags=self.tags)
        self.episodes.inc(float(record["episodes"]), tags=self.tags)


class ActorMetrics:
    """Per-actor gauges: the version and beta an actor holds (so a broadcast is visible), and
    rollout throughput."""

    def __init__(self, job_id: str, role: str, index: int) -> None:
        self.tags = {"tether_run": run_name(), "ray_job": job_id, "role": role, "actor": f"{role}-{index}"}
        keys = (*TAG_KEYS, "actor")
        self.version = Gauge("tether_actor_policy_version", description="policy version this actor holds",
                             tag_keys=keys)
        self.kl_coef = Gauge("tether_actor_kl_coef", description="beta this actor holds", tag_keys=keys)
        self.tokens_per_second = Gauge("tether_rollout_tokens_per_second",
                                       description="generated tokens per second of the last chunk",
                                       tag_keys=keys)

    def record(self, policy_version: int, kl_coef: float, tokens_per_second: float | None = None) -> None:
        self.version.set(policy_version, tags=self.tags)
        self.kl_coef.set(kl_coef, tags=self.tags)
        if tokens_per_second is not None:
            self.tokens_per_second.set(tokens_per_second, tags=self.tags)


def iteration_record(iteration: int, policy_version: int, kl_coef: float, kl_coef_used: float,
                     kl_target: float | None, kl: dict, sums: dict, ppo: dict, lr: float,
                     prompt_rows: list[int], batch_policy_versions: list[int], batch_kl_coefs: list[float],
                     sync: dict, seconds: dict, packed: bool = False) -> dict:
    """One line of metrics.jsonl: what one iteration trained on and how it went.

    ``kl``: the batch's KL statistics (``kl_stats_from_sums``); ``sums``: the learner's additive sums over
    all ranks; ``ppo``: the PPO statistics over all ranks; ``sync``: probe_max_abs_error, actor_states,
    resynced_actors; ``seconds``: learner, learner_forward, learner_update, weight_sync, sync_and_probe;
    ``packed``: the learner's forwards ran packed (``learner.max_tokens_per_microbatch``).
    """
    n, tokens = sums["trained_episodes"], sums["length_sum"]  # what the update trained on
    episodes = {}
    if "turns_sum" in sums:  # multi-turn episodes
        episodes = {"turns_mean": sums["turns_sum"] / n, "tool_calls_mean": sums["tool_calls_sum"] / n,
                    "environment_seconds": sums["environment_seconds_sum"],
                    "trajectory_model_tokens_mean": sums["length_sum"] / n,
                    "trajectory_environment_tokens_mean": sums["environment_tokens_sum"] / n,
                    "environment_failures": sums["environment_failures"],
                    "rows_per_episode": sums["rows"] / n}
    return {
        "iteration": iteration,
        "policy_version": policy_version,
        "kl_coef": kl_coef,
        "kl_coef_used": kl_coef_used,
        "kl_target": kl_target,
        # the controller's statistic: an unbiased estimate of the response KL of the learner's policy, over
        # every episode sampled (dynamic sampling's dropped groups too; async: prefix-weighted), and its
        # standard error
        "kl_response_mean": kl["response_mean"],
        "kl_response_mean_stderr": kl["response_stderr"],
        # the unweighted response KL the reward penalised, over the trained episodes (sync: the statistic
        # itself)
        "kl_penalty_mean": kl.get("penalty_mean"),
        "kl_token_mean": kl["token_mean"],
        "kl_response_sqrt": kl["response_sqrt"],
        "kl_k1_response_mean": kl["k1_response_mean"],
        "kl_k2_response_mean": kl["k2_response_mean"],
        "kl_k3_response_mean": kl["k3_response_mean"],
        "empty_responses": kl["empty_responses"],
        "episodes": n,
        "prompt_rows": prompt_rows,
        "score_mean": sums["score_sum"] / n,
        "reward_mean": sums["reward_sum"] / n,
        "response_length_mean": sums["length_sum"] / n,
        # of the tokens the learner's forwards ran: padding in the [B, P + T] layout, none packed
        "learner_padding_fraction": (0.0 if packed else
                                     1 - sums["forward_tokens_real"] / max(sums["forward_tokens_padded"], 1)),
        "truncated_fraction": sums["truncated"] / n,
        "missing_eos_penalized_fraction": sums["missing_eos_penalized"] / n,  # reward.missing_eos_penalty
        "lr": lr,
        # the engine-learner numeric difference, on rows of the learner's own version (none: null); on stale
        # rows (async) the difference is mostly the policy's move since, reported apart
        "rollout_learner_logprob_mismatch": ((sums["mismatch_abs_sum"] - sums["stale_mismatch_abs_sum"])
                                             / (tokens - sums["stale_tokens"])
                                             if tokens > sums["stale_tokens"] else None),
        "rollout_learner_logprob_mismatch_max": sums["mismatch_max"],
        "rollout_stale_logprob_shift": sums["stale_mismatch_abs_sum"] / max(sums["stale_tokens"], 1),
        # the rollout correction (ppo.correction): k3 of KL(engine || learner) per token on the rows of the
        # learner's version, and the fractions of tokens whose weight pi_old / pi_behav it truncated (tis) or
        # masked (mis)
        "rollout_correction_mismatch_k3": (sums["correction_mismatch_k3_sum"]
                                           / max(tokens - sums["stale_tokens"], 1)),
        "rollout_correction_truncated_fraction": sums["correction_truncated_tokens"] / max(tokens, 1),
        "rollout_correction_masked_fraction": sums["correction_masked_tokens"] / max(tokens, 1),
        "value_mean": sums["value_sum"] / max(tokens, 1),
        "probe_max_abs_error": sync["probe_max_abs_error"],
        "batch_policy_versions": batch_policy_versions,
        "batch_kl_coefs": batch_kl_coefs,
        # versions the oldest row lagged the learner that trained on it (0 in sync mode)
        "batch_staleness_max": policy_version - 1 - min(batch_policy_versions),
        "actor_states": sync["actor_states"],
        "resynced_actors": sync["resynced_actors"],
        "learner_seconds": seconds["learner"],
        "learner_forward_seconds": seconds["learner_forward"],
        "learner_update_seconds": seconds["learner_update"],
        "weight_sync_seconds": seconds["weight_sync"],
        "sync_and_probe_seconds": seconds["sync_and_probe"],
        **episodes,
        **({"in_flight_mixed_row_fraction": sums["in_flight_mixed_rows"] / sums["in_flight_rows"],
            # versions the learner is ahead of each trained token's own, over the tokens
            "in_flight_token_staleness_mean": sums["in_flight_token_staleness_sum"] / max(tokens, 1)}
           if "in_flight_rows" in sums else {}),
        **({"teacher_kl_response_mean": sums["teacher_kl_sum"] / n} if "teacher_kl_sum" in sums else {}),
        **{f"ppo_{k}": v for k, v in ppo.items()},
    }
