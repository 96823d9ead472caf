"""tether's driver: ``python -m learner.main [--config job.yaml] [--kl.target 6 ...]``.

The loop reads top to bottom: sample prompts; stream chunks through rollout, then reference and reward
in parallel; train the learner ranks on the chunk refs; update beta once per batch; broadcast weights
and beta; log; evaluate. Tensors travel as Ray object refs and never pass through this process.
"""

from __future__ import annotations

import argparse
import math
import sys
import time

from pydantic import ValidationError

from learner.config import JobConfig, config_to_yaml, read_yaml


# ====================================================================== scaffolding: CLI, logging


class JobCli(JobConfig):
    """tether job. Settings come from the defaults, then --config YAML, then these flags."""

    config: str | None = None
    print_config: bool = False


def parse_cli(argv: list[str]) -> JobConfig | None:
    """Returns the resolved config, or None after --print-config. Raises ValidationError on bad input."""
    from pydantic import Field  # noqa: F401  (pydantic-settings renders the help from field descriptions)
    from pydantic_settings import CliApp

    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config")
    known, _ = pre.parse_known_args(argv)
    from_yaml = read_yaml(known.config) if known.config else {}
    cli = CliApp.run(JobCli, cli_args=argv, **from_yaml)
    cfg = JobConfig.model_validate(cli.model_dump(exclude={"config", "print_config"}))
    if cli.print_config:
        print(config_to_yaml(cfg), end="")
        return None
    return cfg


def log(message: str) -> None:
    print(f"[tether] {message}", flush=True)


def seed_for(run_seed: int, iteration: int, row: int) -> int:
    """A distinct, reproducible sampling seed per episode."""
    return (run_seed * 1_000_003 + iteration * 100_003 + row) % (2**31 - 1)


# ====================================================================== the job


def run(cfg: JobConfig) -> dict:
    import ray

    from actors.engines import SamplingSettings
    from actors.reference import ReferenceActor
    from actors.reward import RewardActor
    from actors.rollout import RolloutActor
    from learner import cluster, rundir
    from learner.group import LearnerGroup
    from learner.kl import AdaptiveKLController, FixedKLController, controller_statistic, kl_stats_from_sums
    from services.models import load_tokenizer, policy_dir
    from services.prompts import PromptSampler, encode_prompts
    from services.tasks import get_task

    wall_start = time.perf_counter()
    # ---- everything that can be wrong with the input fails here, before any actor starts
    task = get_task(cfg.task.name, seed=cfg.task.seed)
    rundir.check_free(cfg)
    log("KL accounting: " + ", ".join(f"{k}={v}" for k, v in cfg.kl.model_dump().items()))
    model_dir = str(policy_dir(task, cfg.model.path, cfg.model.cache_dir, cfg.run.seed, cfg.model.sft_steps,
                               cfg.model.sft_batch_size, cfg.model.sft_lr, log=log))
    tokenizer = load_tokenizer(model_dir)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    prompts = encode_prompts(task.prompts(), tokenizer, cfg.task.max_prompt_tokens, cfg.task.long_prompts, log)
    eval_prompts = encode_prompts(task.eval_prompts(), tokenizer, cfg.task.max_prompt_tokens,
                                  cfg.task.long_prompts, log)
    sampling = SamplingSettings(cfg.rollout.temperature, cfg.rollout.top_p,
                                cfg.rollout.max_new_tokens or task.max_new_tokens)
    max_model_len = cfg.task.max_prompt_tokens + sampling.max_new_tokens + 1

    run_path = rundir.prepare(cfg)
    log(f"run directory {run_path}")

    # ---- cluster and actors: each role on its own bundle
    cluster.connect(cfg, log=log)
    placement = cluster.reserve(cfg)
    c = cfg.cluster
    rollouts = [
        cluster.start_actor(RolloutActor, "rollout", i, c.rollout, placement, i, cfg.rollout.engine, model_dir,
                            cfg.run.seed + i, max_model_len, cfg.rollout.kv_cache_mib, "float32", i)
        for i in range(cfg.rollout.num_engines)
    ]
    references = [
        cluster.start_actor(ReferenceActor, "reference", i, c.reference, placement, i, model_dir,
                            cfg.reference.backend, "float32", max_model_len, 128, cfg.rollout.temperature)
        for i in range(cfg.reference.num_actors)
    ]
    rewards = [
        cluster.start_actor(RewardActor, "reward", i, c.reward, placement, i, cfg.task.name,
                            {"seed": cfg.task.seed}, model_dir, cfg.reward.kind, cfg.reward.model_path,
                            cfg.reward.score_clip)
        for i in range(cfg.reward.num_actors)
    ]
    learner = LearnerGroup(cfg, model_dir, placement)
    ray.get([a.ready.remote() for a in rollouts + references + rewards])
    log(f"actors ready: {len(rollouts)} rollout, {len(references)} reference, {len(rewards)} reward, "
        f"{cfg.learner.world_size} learner rank(s), ZeRO-{cfg.learner.zero_stage} ({time.perf_counter() - wall_start:.1f}s)")

    kl_ctl = (AdaptiveKLController(cfg.kl.init_kl_coef, cfg.kl.target, cfg.kl.horizon)
              if cfg.kl.controller == "adaptive" else FixedKLController(cfg.kl.init_kl_coef))
    sampler = PromptSampler(len(prompts), cfg.run.seed)
    policy_version = 0
    all_actors = rollouts + references + rewards
    ray.get([a.set_state.remote(policy_version, kl_ctl.value) for a in all_actors])
    probe_prompt_lengths = [len(p) for p in eval_prompts[:8]]
    probe_sequences = [p + [(7 * j + 3 * k) % len(tokenizer) for k in range(sampling.max_new_tokens)]
                       for j, p in enumerate(eval_prompts[:8])]

    def generate(prompt_rows: list[int], prompt_set: list[list[int]], iteration: int) -> list:
        """Chunk refs for these prompts, spread over the rollout engines."""
        size = cfg.rollout.chunk_size
        refs = []
        for i, start in enumerate(range(0, len(prompt_rows), size)):
            rows = prompt_rows[start:start + size]
            seeds = [seed_for(cfg.run.seed, iteration, start + j) for j in range(len(rows))]
            refs.append(rollouts[i % len(rollouts)].generate.remote([prompt_set[r] for r in rows], rows, seeds,
                                                                    sampling, pad_id))
        return refs

    def evaluate(iteration: int) -> dict[str, float]:
        rows = [r for r in range(len(eval_prompts)) for _ in range(cfg.rollout.eval_samples_per_prompt)]
        chunks = generate(rows, eval_prompts, -1 - iteration)
        parts = ray.get([rewards[i % len(rewards)].evaluate.remote(ch) for i, ch in enumerate(chunks)])
        count = sum(p["count"] for p in parts)
        return {k: sum(p[k] for p in parts) / count for k in parts[0] if k != "count"}

    records: list[dict] = []
    eval_metrics = evaluate(0)
    log("eval before training: " + ", ".join(f"{k} {v:.3f}" for k, v in eval_metrics.items()))
    start_eval = dict(eval_metrics)
    ray.get([a.take_busy_seconds.remote() for a in rollouts + references + rewards])

    for iteration in range(1, cfg.run.iterations + 1):
        t_iter = time.perf_counter()
        # 1. sample prompts
        prompt_rows = sampler.next(cfg.rollout.batch_size)

        # 2. stream chunks: generate, then reference and reward in parallel on the refs
        chunk_refs = generate(prompt_rows, prompts, iteration)
        ref_refs = [references[i % len(references)].score.remote(ch) for i, ch in enumerate(chunk_refs)]
        score_refs = [rewards[i % len(rewards)].score.remote(ch, i) for i, ch in enumerate(chunk_refs)]

        # 3. learner: old log-probs, KL-penalised rewards at the current beta, GAE, PPO epochs
        kl_coef = kl_ctl.value
        results = learner.train(chunk_refs, ref_refs, score_refs, kl_coef, iteration)
        t_learner = time.perf_counter() - t_iter
        sums = {k: sum(r["sums"][k] for r in results) for k in results[0]["sums"]}
        sums["mismatch_max"] = max(r["sums"]["mismatch_max"] for r in results)
        kl = kl_stats_from_sums(sums)
        # on-policy: every row was generated by the learner's current version, under the current beta
        versions = sorted({v for r in results for v in r["policy_versions"]})
        stamped_betas = sorted({b for r in results for b in r["kl_coefs"]})
        if versions != [policy_version] or any(abs(b - kl_coef) > 1e-6 * max(kl_coef, 1) for b in stamped_betas):
            raise RuntimeError(f"iteration {iteration}: batch stamped with versions {versions} and betas "
                               f"{stamped_betas}, but the learner is at version {policy_version}, beta {kl_coef}")

        # 4. the controller sees exactly the KL the reward penalised, once per batch
        kl_ctl.update(controller_statistic(kl, cfg.kl.scope), n_steps=int(kl["num_responses"]))

        # 5. broadcast weights (version + 1) and beta
        t_sync = time.perf_counter()
        policy_version += 1
        weights = learner.policy_weights()
        sync_seconds = ray.get([r.update_weights.remote(weights, policy_version, kl_ctl.value) for r in rollouts])
        ray.get([a.set_state.remote(policy_version, kl_ctl.value) for a in references + rewards])
        del weights
        actor_states = ray.get([a.get_state.remote() for a in all_actors])
        stale = [s for s in actor_states if s["policy_version"] != policy_version or s["kl_coef"] != kl_ctl.value]
        if stale:
            raise RuntimeError(f"broadcast of version {policy_version}, beta {kl_ctl.value} did not reach {stale}")
        probe_error = float("nan")
        if policy_version % cfg.run.probe_every == 0:
            expected = learner.probe(probe_sequences, probe_prompt_lengths)
            for r in rollouts:
                got = ray.get(r.probe.remote(probe_sequences, probe_prompt_lengths))
                probe_error = max(abs(a - b) for e, g in zip(expected, got, strict=True)
                                  for a, b in zip(e, g, strict=True))
                if probe_error > cfg.run.probe_tolerance:
                    raise RuntimeError(f"weight sync probe failed after version {policy_version}: engine log-probs "
                                       f"differ from the learner's by {probe_error:.2e} > {cfg.run.probe_tolerance}")
        t_sync = time.perf_counter() - t_sync

        # 6. metrics and a progress line
        n = kl["num_responses"]
        ppo_stats = {k: sum(r["ppo"][k] for r in results) / len(results) for k in results[0]["ppo"]}
        record = {
            "iteration": iteration,
            "policy_version": policy_version,
            "kl_coef": kl_ctl.value,
            "kl_coef_used": kl_coef,
            "kl_target": cfg.kl.target,
            "kl_response_mean": kl["response_mean"],
            "kl_token_mean": kl["token_mean"],
            "kl_response_sqrt": kl["response_sqrt"],
            "kl_k1_response_mean": kl["k1_response_mean"],
            "kl_k2_response_mean": kl["k2_response_mean"],
            "kl_k3_response_mean": kl["k3_response_mean"],
            "empty_responses": kl["empty_responses"],
            "episodes": n,
            "score_mean": sums["score_sum"] / n,
            "reward_mean": sums["reward_sum"] / n,
            "response_length_mean": sums["length_sum"] / n,
            "truncated_fraction": sums["truncated"] / n,
            "rollout_learner_logprob_mismatch": sums["mismatch_abs_sum"] / max(kl["num_tokens"], 1),
            "rollout_learner_logprob_mismatch_max": sums["mismatch_max"],
            "value_mean": sums["value_sum"] / max(kl["num_tokens"], 1),
            "probe_max_abs_error": probe_error,
            "learner_seconds": t_learner,
            "learner_update_seconds": max(r["timings"]["update_seconds"] for r in results),
            "weight_sync_seconds": max(sync_seconds),
            "batch_policy_versions": versions,
            "batch_kl_coefs": stamped_betas,
            "actor_states": actor_states,
            "sync_and_probe_seconds": t_sync,
            "learner_forward_seconds": max(r["timings"]["forward_seconds"] for r in results),
            **{f"ppo_{k}": v for k, v in ppo_stats.items()},
        }

        # 7. periodic evaluation
        if iteration % cfg.run.eval_every == 0 or iteration == cfg.run.iterations:
            eval_metrics = evaluate(iteration)
            record["eval"] = eval_metrics
        record["iteration_seconds"] = time.perf_counter() - t_iter
        # busy time per role (summed over its actors, evaluation included): what an iteration is made of
        busy = ray.get([a.take_busy_seconds.remote() for a in rollouts + references + rewards])
        record["generate_seconds"] = sum(busy[: len(rollouts)])
        record["reference_seconds"] = sum(busy[len(rollouts): len(rollouts) + len(references)])
        record["reward_seconds"] = sum(busy[len(rollouts) + len(references):])
        records.append(record)
        rundir.append_metrics(run_path, record)
        log(f"iter {iteration}/{cfg.run.iterations} | reward {record['reward_mean']:.3f} | "
            f"score {record['score_mean']:.3f} | kl {kl['response_mean']:.3f}/{cfg.kl.target or 0:.1f} nats | "
            f"beta {kl_ctl.value:.4f} | " + "".join(f"eval {k} {v:.3f} | " for k, v in record.get("eval", {}).items())
            + f"{record['iteration_seconds']:.2f}s")

    summary = {
        "run": cfg.run.name,
        "iterations": cfg.run.iterations,
        "policy_version": policy_version,
        "eval_start": start_eval,
        "eval_final": eval_metrics,
        "kl_coef_final": kl_ctl.value,
        "kl_controller": kl_ctl.state_dict(),
        "kl_response_mean_final": records[-1]["kl_response_mean"],
        "kl_token_mean_final": records[-1]["kl_token_mean"],
        "kl_target": cfg.kl.target,
        "wall_seconds": time.perf_counter() - wall_start,
    }
    rundir.write_summary(run_path, summary)
    rundir.plot_curves(run_path, records, cfg.kl.target)
    log("summary: " + " ".join(f"final {k} {v:.3f}" for k, v in eval_metrics.items())
        + f" | kl {summary['kl_response_mean_final']:.3f} nats | beta {kl_ctl.value:.4f} | "
        f"wall {summary['wall_seconds']:.1f}s | {run_path}/summary.json")
    placement.remove()
    return summary


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        cfg = parse_cli(argv)
    except ValidationError as err:
        print(f"[tether] invalid config: {err}", file=sys.stderr, flush=True)
        return 2
    except (FileNotFoundError, ValueError) as err:
        print(f"[tether] invalid config: {err}", file=sys.stderr, flush=True)
        return 2
    if cfg is None:
        return 0
    from actors.reward import RewardError
    from learner.cluster import ClusterError
    from learner.rundir import RunDirectoryError

    try:
        summary = run(cfg)
    except (ClusterError, RunDirectoryError, RewardError, FileNotFoundError, ValueError) as err:
        print(f"[tether] error: {err}", file=sys.stderr, flush=True)
        return 1
    return 0 if all(math.isfinite(v) for v in summary["eval_final"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
