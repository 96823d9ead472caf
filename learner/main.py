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

from pydantic import Field, ValidationError

from learner.config import JobConfig, config_to_yaml, read_yaml

# ====================================================================== scaffolding: CLI, logging


class JobCli(JobConfig):
    """tether job. Settings come from the defaults, then --config YAML, then these flags.
    --print-config prints the resolved config as YAML and exits."""

    config: str | None = Field(None, description="YAML file with settings (flags override it)")


def parse_cli(argv: list[str]) -> JobConfig | None:
    """Returns the resolved config, or None after --print-config. Raises ValidationError on bad input."""
    from pydantic_settings import CliApp

    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config")
    pre.add_argument("--print-config", action="store_true")
    known, _ = pre.parse_known_args(argv)
    from_yaml = read_yaml(known.config) if known.config else {}
    cli = CliApp.run(JobCli, cli_args=[a for a in argv if a != "--print-config"], **from_yaml)
    cfg = JobConfig.model_validate(cli.model_dump(exclude={"config"}))
    if known.print_config:
        print(config_to_yaml(cfg), end="")
        return None
    return cfg


def log(message: str) -> None:
    print(f"[tether] {message}", flush=True)


class Progress:
    """One line per iteration (what `ray job logs` shows); on a terminal also a live tqdm bar."""

    def __init__(self, cfg: JobConfig, run_path) -> None:
        from tqdm import tqdm

        self.cfg = cfg
        self.bar = tqdm(total=cfg.run.iterations, unit="it", dynamic_ncols=True,
                        disable=not (cfg.metrics.progress_bar and sys.stdout.isatty()))
        self.tensorboard = None
        if cfg.metrics.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tensorboard = SummaryWriter(run_path.display("tensorboard"))

    def update(self, r: dict) -> None:
        target = self.cfg.kl.target
        line = (f"iter {r['iteration']}/{self.cfg.run.iterations} | reward {r['reward_mean']:.3f} | "
                f"score {r['score_mean']:.3f} | kl {r['kl_response_mean']:.3f}/{target or 0:.1f} nats | "
                f"beta {r['kl_coef']:.4f} | " + "".join(f"eval {k} {v:.3f} | " for k, v in r.get("eval", {}).items())
                + f"{r['iteration_seconds']:.2f}s")
        if self.bar.disable:
            log(line)
        else:
            self.bar.write(f"[tether] {line}")
            self.bar.set_postfix(reward=f"{r['reward_mean']:.3f}", kl=f"{r['kl_response_mean']:.2f}/{target or 0:g}",
                                 beta=f"{r['kl_coef']:.4f}", sec=f"{r['iteration_seconds']:.1f}")
            self.bar.update(1)
        if self.tensorboard:
            for key, value in r.items():
                if isinstance(value, int | float):
                    self.tensorboard.add_scalar(key, value, r["iteration"])
            for key, value in r.get("eval", {}).items():
                self.tensorboard.add_scalar(f"eval/{key}", value, r["iteration"])

    def close(self) -> None:
        self.bar.close()
        if self.tensorboard:
            self.tensorboard.close()


# ====================================================================== the job


def run(cfg: JobConfig) -> dict:
    import ray

    from actors.engines import SamplingSettings
    from actors.reward import check_reward_label
    from learner import checkpoint, cluster, rundir
    from learner.fleet import Fleet
    from learner.group import LearnerGroup
    from learner.kl import AdaptiveKLController, FixedKLController, controller_statistic, kl_stats_from_sums
    from learner.ppo import ppo_stats_from_sums
    from services.metrics import DriverMetrics
    from services.model_source import ModelSource
    from services.models import load_tokenizer, policy_source
    from services.prompts import PromptSampler, encode_prompts
    from services.tasks import get_task

    wall_start = time.perf_counter()
    # ---- everything that can be wrong with the input fails here, before any actor starts
    task = get_task(cfg.task.name, seed=cfg.task.seed)
    run_path = rundir.check_free(cfg)
    resume_from, resume_state = None, None
    if cfg.run.resume:
        resume_from = checkpoint.resolve(run_path, cfg.run.resume)
        resume_state = checkpoint.verify(resume_from)  # presence and sizes; the ranks check sha256 on download
        checkpoint.check_compatible(resume_state["config"], cfg, resume_from)
    log("KL accounting: " + ", ".join(f"{k}={v}" for k, v in cfg.kl.model_dump().items()))
    # the policy as every node reaches it: a shared path or hub id, or files the driver makes and ships
    model = policy_source(task, cfg.model.path, cfg.model.cache_dir, cfg.run.seed, cfg.model.sft_steps,
                          cfg.model.sft_batch_size, cfg.model.sft_lr, log=log)
    reward_model = ModelSource.configured(cfg.reward.model_path) if cfg.reward.kind == "model" else None
    if reward_model is not None:
        check_reward_label(cfg.reward.model_path, cfg.reward.label)  # a local dir: its labels, before any actor
    tokenizer = load_tokenizer(model.resolve("driver"))
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    prompts, eval_prompts = (
        encode_prompts([task.format_prompt(t, tokenizer) for t in texts], tokenizer, cfg.task.max_prompt_tokens,
                       cfg.task.long_prompts, log)
        for texts in (task.prompts(), task.eval_prompts())
    )
    sampling = SamplingSettings(cfg.rollout.temperature, cfg.rollout.top_p,
                                cfg.rollout.max_new_tokens or task.max_new_tokens)
    probe_set = ([p + [(7 * j + 3 * k) % len(tokenizer) for k in range(sampling.max_new_tokens)]
                  for j, p in enumerate(eval_prompts[:8])], [len(p) for p in eval_prompts[:8]])
    run_path = rundir.prepare(cfg)
    log(f"run directory {run_path}")

    # ---- cluster and actors: each role on its own bundle
    cluster.connect(cfg, log=log)
    placement = cluster.reserve(cfg)
    cluster.preflight(cfg, placement, [m for m in (model, reward_model) if m], run_path, log=log)
    # every actor starts at once: the learner ranks set up DeepSpeed while the engines start vLLM
    fleet = Fleet(cfg, model, placement, sampling, pad_id,
                  max_model_len=cfg.task.max_prompt_tokens + sampling.max_new_tokens + 1, reward_model=reward_model,
                  wait=False)
    learner = LearnerGroup(cfg, model, placement)
    fleet.wait_ready()
    log(f"actors ready: {len(fleet.rollouts)} rollout, {len(fleet.references)} reference, {len(fleet.rewards)} "
        f"reward, {cfg.learner.world_size} learner rank(s), ZeRO-{cfg.learner.zero_stage}, {cfg.learner.dtype} "
        f"({time.perf_counter() - wall_start:.1f}s)")

    kl_ctl = (AdaptiveKLController(cfg.kl.init_kl_coef, cfg.kl.target, cfg.kl.horizon)
              if cfg.kl.controller == "adaptive" else FixedKLController(cfg.kl.init_kl_coef))
    sampler = PromptSampler(len(prompts), cfg.run.seed)
    policy_version, first_iteration, weights = 0, 1, None
    gpu_transfer = cfg.learner.weight_sync != "object_store"
    if gpu_transfer:
        learner.connect_engines(fleet.rollouts, cfg.learner.weight_sync, cfg.learner.sync_bucket_mib << 20,
                                workers_per_engine=cfg.rollout.tensor_parallel_size)

    def sync_weights(version: int):
        """Weights to the engines: through vLLM's transfer, NCCL or IPC (returns None), or as one
        object-store ref the fleet loads."""
        if gpu_transfer:
            learner.send_weights(fleet.rollouts, version, kl_ctl.value)
            return None
        return learner.policy_weights()

    if resume_state is not None:
        learner.load(resume_from.url, checkpoint.read_manifest(resume_from),
                     resume_state["config"]["learner"]["world_size"])
        kl_ctl.load_state_dict(resume_state["kl_controller"])
        sampler.load_state_dict(resume_state["prompt_cursor"])
        policy_version, first_iteration = resume_state["policy_version"], resume_state["iteration"] + 1
        weights = sync_weights(policy_version)
        log(f"resumed from {resume_from} at iteration {resume_state['iteration']}, version {policy_version}, "
            f"beta {kl_ctl.value:.6f}")
    fleet.broadcast(weights, policy_version, kl_ctl.value)
    if policy_version:
        fleet.probe(learner, *probe_set)

    job_metrics = DriverMetrics(ray.get_runtime_context().get_job_id())
    progress = Progress(cfg, run_path)
    stop = GracefulStop()
    records = rundir.read_metrics(run_path, first_iteration - 1) if resume_state else []
    if resume_state:
        start_eval = resume_state["eval_start"]
    else:
        start_eval, samples = fleet.evaluate(eval_prompts, 0)
        rundir.write_samples(run_path, 0, samples)
    eval_metrics = dict(start_eval)
    log("eval before training: " + ", ".join(f"{k} {v:.3f}" for k, v in start_eval.items()))
    fleet.take_busy_seconds()

    def save_checkpoint(iteration: int) -> None:
        ckpt = checkpoint.begin(run_path, iteration)
        rank_files = learner.save(ckpt.url)
        state = {"iteration": iteration, "policy_version": policy_version, "kl_controller": kl_ctl.state_dict(),
                 "prompt_cursor": sampler.state_dict(), "eval_start": start_eval,
                 "config": cfg.model_dump(mode="json")}
        final = checkpoint.commit(run_path, ckpt, rank_files, state, cfg.checkpoint.keep)
        log(f"checkpoint {final}")

    iteration = first_iteration - 1
    for iteration in range(first_iteration, cfg.run.iterations + 1):
        t_iter = time.perf_counter()
        # 0. actors that restarted come back at version 0: re-sync them (and probe) before they generate
        resynced = fleet.bring_up_to_date(learner, weights, policy_version, kl_ctl.value, probe_set)

        # 1. sample prompts
        prompt_rows = sampler.next(cfg.rollout.batch_size)

        # 2. stream chunks: generate, then reference and reward in parallel on the refs
        chunk_refs = fleet.generate(prompt_rows, prompts, iteration)
        ref_refs, score_refs = fleet.score(chunk_refs)

        # 3. learner: ranks fetch their chunks and run the forward as they arrive; lost chunks are redone
        # a chunk from an engine that restarted after step 0 is stamped with its version 0: lost too
        current = (policy_version, kl_ctl.value)
        lost = learner.collect(chunk_refs, ref_refs, score_refs, current)
        for retry in range(cfg.run.max_chunk_retries):
            if not lost:
                break
            log(f"iteration {iteration}: chunks {lost} lost to a dead or restarted actor; regenerating "
                f"(retry {retry + 1})")
            resynced += fleet.bring_up_to_date(learner, weights, policy_version, kl_ctl.value, probe_set)
            chunk_refs = fleet.generate(prompt_rows, prompts, iteration, slots=lost)
            ref_refs, score_refs = fleet.score(chunk_refs)
            lost = learner.collect(chunk_refs, ref_refs, score_refs, current)
        if lost:
            raise RuntimeError(f"iteration {iteration}: chunks {lost} still lost after "
                               f"{cfg.run.max_chunk_retries} retries")
        kl_coef = kl_ctl.value
        results = learner.update(kl_coef, iteration)  # KL-penalised rewards at this beta, GAE, PPO epochs
        t_learner = time.perf_counter() - t_iter
        sums = {k: sum(r["sums"][k] for r in results) for k in results[0]["sums"]}
        sums["mismatch_max"] = max(r["sums"]["mismatch_max"] for r in results)
        kl = kl_stats_from_sums(sums)
        if kl["num_responses"] != cfg.rollout.batch_size:
            raise RuntimeError(f"iteration {iteration}: trained on {kl['num_responses']:.0f} episodes, "
                               f"expected {cfg.rollout.batch_size}")
        # on-policy: every row was generated by the learner's current version, under the current beta
        versions = sorted({v for r in results for v in r["policy_versions"]})
        stamped_betas = sorted({b for r in results for b in r["kl_coefs"]})
        if versions != [policy_version] or any(abs(b - kl_coef) > 1e-6 * max(kl_coef, 1) for b in stamped_betas):
            raise RuntimeError(f"iteration {iteration}: batch stamped with versions {versions} and betas "
                               f"{stamped_betas}, but the learner is at version {policy_version}, beta {kl_coef}")

        # 4. the controller sees exactly the KL the reward penalised, once per batch
        kl_ctl.update(controller_statistic(kl, cfg.kl.scope), n_steps=int(kl["num_responses"]))

        # 5. broadcast weights (version + 1) and beta, then check the engines really have them
        t_sync = time.perf_counter()
        policy_version += 1
        t_weights = time.perf_counter()
        weights = sync_weights(policy_version)
        engine_load_seconds = fleet.broadcast(weights, policy_version, kl_ctl.value)
        sync_seconds = engine_load_seconds if weights is not None else time.perf_counter() - t_weights
        resynced += fleet.bring_up_to_date(learner, weights, policy_version, kl_ctl.value, probe_set)
        actor_states = fleet.states(learner, weights, policy_version, kl_ctl.value, probe_set)
        stale = [s for s in actor_states if s["policy_version"] != policy_version or s["kl_coef"] != kl_ctl.value]
        if stale:
            raise RuntimeError(f"broadcast of version {policy_version}, beta {kl_ctl.value} did not reach {stale}")
        probe_error = (fleet.probe(learner, *probe_set) if policy_version % cfg.run.probe_every == 0
                       else float("nan"))
        t_sync = time.perf_counter() - t_sync

        # 6. metrics and a progress line
        n = kl["num_responses"]
        ppo_stats = ppo_stats_from_sums([r["ppo_sums"] for r in results])  # exact over ranks
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
            "prompt_rows": prompt_rows,
            "score_mean": sums["score_sum"] / n,
            "reward_mean": sums["reward_sum"] / n,
            "response_length_mean": sums["length_sum"] / n,
            "truncated_fraction": sums["truncated"] / n,
            "missing_eos_penalized_fraction": sums["missing_eos_penalized"] / n,  # reward.missing_eos_penalty
            "lr": results[0]["lr"],
            "rollout_learner_logprob_mismatch": sums["mismatch_abs_sum"] / max(kl["num_tokens"], 1),
            "rollout_learner_logprob_mismatch_max": sums["mismatch_max"],
            "value_mean": sums["value_sum"] / max(kl["num_tokens"], 1),
            "probe_max_abs_error": probe_error,
            "batch_policy_versions": versions,
            "batch_kl_coefs": stamped_betas,
            "actor_states": actor_states,
            "resynced_actors": resynced,
            "learner_seconds": t_learner,
            "learner_forward_seconds": max(r["timings"]["forward_seconds"] for r in results),
            "learner_update_seconds": max(r["timings"]["update_seconds"] for r in results),
            "weight_sync_seconds": sync_seconds,
            "sync_and_probe_seconds": t_sync,
            **{f"ppo_{k}": v for k, v in ppo_stats.items()},
        }

        # 7. periodic evaluation, checkpoint
        if iteration % cfg.run.eval_every == 0 or iteration == cfg.run.iterations:
            eval_metrics, samples = fleet.evaluate(eval_prompts, iteration, learner, weights, policy_version,
                                                   kl_ctl.value, probe_set)
            record["eval"] = eval_metrics
            rundir.write_samples(run_path, iteration, samples)
        record["iteration_seconds"] = time.perf_counter() - t_iter
        record.update(fleet.take_busy_seconds())  # busy time per role, evaluation included
        records.append(record)
        rundir.append_metrics(run_path, record)
        job_metrics.record(record)
        progress.update(record)
        if iteration % cfg.metrics.plot_every == 0:
            rundir.plot_curves(run_path, records, cfg.kl.target, start_eval)
        if stop.requested or (cfg.checkpoint.every and iteration % cfg.checkpoint.every == 0) \
                or iteration == cfg.run.iterations:
            save_checkpoint(iteration)
        if stop.requested:
            break

    summary = {
        "run": cfg.run.name,
        "iterations": iteration,
        "stopped_early": stop.requested,
        "policy_version": policy_version,
        "eval_start": start_eval,
        "eval_final": eval_metrics,
        "kl_coef_final": kl_ctl.value,
        "kl_controller": kl_ctl.state_dict(),
        "kl_response_mean_final": records[-1]["kl_response_mean"] if records else None,
        "kl_token_mean_final": records[-1]["kl_token_mean"] if records else None,
        "kl_target": cfg.kl.target,
        "wall_seconds": time.perf_counter() - wall_start,
    }
    if cfg.checkpoint.export_hf:
        learner.export_hf(run_path.child("export").url)
        log(f"policy exported as a Hugging Face model directory: {run_path.display('export')}")
    rundir.write_summary(run_path, summary)
    progress.close()
    if records:
        rundir.plot_curves(run_path, records, cfg.kl.target, start_eval)
    if stop.requested:
        log(f"stopped by {stop.signal_name} after iteration {iteration}; checkpoint written; continue with "
            f"--run.resume latest --run.name {cfg.run.name}")
    else:
        log("summary: " + " ".join(f"final {k} {v:.3f}" for k, v in eval_metrics.items())
            + f" | kl {summary['kl_response_mean_final']:.3f} nats | beta {kl_ctl.value:.4f} | "
            f"wall {summary['wall_seconds']:.1f}s | {run_path.display('summary.json')}")
    placement.remove()
    return summary


class GracefulStop:
    """SIGTERM (``ray job stop``, preemption) or SIGINT: finish the current iteration, checkpoint, exit."""

    def __init__(self) -> None:
        import signal

        self.requested, self.signal_name = False, ""
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)

    def _handle(self, signum, _frame) -> None:
        import signal

        if self.requested:  # a second signal: stop now
            raise KeyboardInterrupt
        self.requested, self.signal_name = True, signal.Signals(signum).name
        print(f"[tether] {self.signal_name}: finishing the current iteration, then checkpointing", flush=True)


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
    from learner.checkpoint import CheckpointError
    from learner.cluster import ClusterError
    from learner.fleet import ProbeError
    from learner.rundir import RunDirectoryError
    from learner.storage import StorageError

    try:
        summary = run(cfg)
    except (ClusterError, RunDirectoryError, RewardError, CheckpointError, ProbeError, StorageError,
            FileNotFoundError, ValueError) as err:
        print(f"[tether] error: {err}", file=sys.stderr, flush=True)
        return 1
    if summary["stopped_early"]:
        return 143  # stopped by a signal, like a process killed by SIGTERM, after a clean checkpoint
    return 0 if all(math.isfinite(v) for v in summary["eval_final"].values()) else 1

if __name__ == "__main__":
    sys.exit(main())
