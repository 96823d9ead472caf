"""The loop's steps, and what they share (``Job``): ``run()`` in ``learner/main.py`` calls them in order.

- ``setup``: once the input is checked (``learner.plan``) and Ray is up: actors, resume, the first evaluation;
- ``collect_batch``: generate, score, collect on the learner ranks; lost chunks are regenerated;
- ``update``: KL-penalised rewards, GAE and the PPO epochs on every rank, one combined ``UpdateResult``;
  then the controller's beta;
- ``sync``: weights, version and beta to every actor (``WeightSync``), with the probe;
- ``record``: the metrics line (``services.metrics.iteration_record``), with an evaluation when due.

The loop's own checks raise ``LoopError``; ``main()`` turns it into an exit code.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from learner import checkpoint, cluster, rundir
from learner.cluster import Placement
from learner.fleet import Fleet
from learner.group import LearnerGroup
from learner.kl import AdaptiveKLController, FixedKLController, controller_statistic
from learner.plan import Plan
from learner.records import Admission, ChunkRefs, UpdateResult
from learner.weight_sync import WeightSync
from services.config import JobConfig, config_to_yaml
from services.cpu_share import describe_priorities
from services.errors import TetherError
from services.metrics import DriverMetrics, iteration_record
from services.prompts import PromptSampler
from services.storage import RunStorage


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


class LoopError(TetherError, RuntimeError):
    """A check of the loop itself failed: chunks still lost after the retries, a batch other than the one
    generated for this version and beta, or a sync that did not reach every actor."""


@dataclass
class Collected:
    """One rollout batch, collected on the learner ranks (the tensors stay there)."""

    prompt_rows: list[int]
    resynced: list[dict]  # actors re-synced before generating (restarted ones)
    started: float  # perf_counter at the start of the iteration
    extra_rounds: int | None = None  # rollout.dynamic_sampling: the rounds of generation after the first


@dataclass
class Started:
    """A rollout batch whose chunks are being generated and scored (their refs)."""

    prompt_rows: list[int]
    chunks: dict[int, ChunkRefs]  # by slot
    prompt_cursor: dict  # the prompt sampler's state before these prompts: a checkpoint taken while the
    # batch is in flight saves this, so a resume (empty pipeline) draws them again


@dataclass
class Trained:
    result: UpdateResult
    kl_coef_used: float  # the beta the rewards were penalised with
    learner_seconds: float  # from the start of the iteration to the end of the update


@dataclass
class Synced:
    weight_sync_seconds: float
    sync_and_probe_seconds: float
    probe_max_abs_error: float  # NaN between probes
    actor_states: list[dict]
    resynced: list[dict]


@dataclass
class Job:
    """What the loop's steps share: the config, the actors, the controller and the books."""

    cfg: JobConfig
    run_path: RunStorage
    prompts: list[list[int]]
    eval_prompts: list[list[int]]
    placement: Placement
    fleet: Fleet
    learner: LearnerGroup
    weights: WeightSync
    kl_ctl: AdaptiveKLController | FixedKLController
    sampler: PromptSampler
    first_iteration: int
    start_eval: dict
    eval_metrics: dict
    records: list[dict]
    job_metrics: DriverMetrics
    wall_start: float
    log: Callable[[str], None]  # one line to the job log
    curves: rundir.Curves  # curves.png, drawn on a thread of its own
    # async: the next batches, generating while the learner trains
    ahead: list[Started] = field(default_factory=list)
    eval_samples: list[dict] | None = None  # the last evaluation's samples, until the tracker takes them
    eval_kl: float | None = None  # the last evaluation's KL of the policy to the reference, nats per episode

    # ------------------------------------------------------------------ the steps of one iteration

    def collect_batch(self, iteration: int) -> Collected:
        """Sample prompts; stream chunks through rollout, then reference and reward in parallel on the refs;
        the learner ranks fetch their chunks and run the forward as they arrive. A chunk lost to a dead actor,
        generated by an engine that restarted after the version check, or too stale, is regenerated. In async
        mode the batch was started ahead, and the next one starts as soon as this one is in (unless it started
        at the last sync: in-flight updates)."""
        started = time.perf_counter()
        # actors that restarted come back at version 0: re-sync them (and probe) before they generate
        resynced = self.weights.bring_up_to_date()
        batch = self.ahead.pop(0) if self.ahead else self._start(iteration)
        resynced += self._collect_chunks(iteration, batch, batch.chunks)
        extra_rounds = (self._dynamic_sampling(iteration, batch, resynced)
                        if self.cfg.rollout.dynamic_sampling else None)
        if self._overlaps() and not self.ahead and iteration < self.cfg.run.iterations:
            # generates with version v while v + 1 trains; after any extra rounds, so that the prompt cursor a
            # checkpoint saves (the next batch's) comes after every prompt this batch drew
            self.ahead.append(self._start(iteration + 1))
        return Collected(batch.prompt_rows, resynced, started, extra_rounds)

    def _collect_chunks(self, iteration: int, batch: Started, chunks: dict[int, ChunkRefs]) -> list[dict]:
        """The learner ranks collect these chunks; lost ones are regenerated (the same slots of
        ``batch.prompt_rows``). Returns the actors re-synced meanwhile."""
        lost: list[int] = []
        resynced: list[dict] = []
        for retry in range(self.cfg.run.max_chunk_retries + 1):
            if retry:
                self.log(f"iteration {iteration}: chunks {lost} lost to a dead or restarted actor, or too "
                         f"stale; regenerating (retry {retry})")
                resynced += self.weights.bring_up_to_date()
                chunks = self.fleet.chunks(batch.prompt_rows, self.prompts, iteration, slots=lost)
            lost = self.learner.collect(chunks, self._admission())
            if not lost:
                return resynced
        raise LoopError(f"iteration {iteration}: chunks {lost} still lost after "
                        f"{self.cfg.run.max_chunk_retries} retries")

    def _dynamic_sampling(self, iteration: int, batch: Started, resynced: list[dict]) -> int:
        """DAPO's dynamic sampling: while a learner rank holds fewer whole groups whose scores differ than its
        share of the batch, a batch's worth of prompts more, drawn from the sampler and laid out after the
        batch's (the next chunk slots, group ids and seeds: slot i still goes to rank i % W), at most
        ``rollout.dynamic_sampling_max_rounds`` times. The ranks keep their share (``dynamic_sampling_rows``).
        Returns the extra rounds."""
        r = self.cfg.rollout
        share = r.batch_size // (r.samples_per_prompt * self.cfg.learner.world_size)
        extra = 0
        while min(held := self.learner.differing_groups()) < share:
            if extra == r.dynamic_sampling_max_rounds:
                # a rank still short trains on tied groups too: the batch stays full and whole, as without
                # dynamic sampling, rather than end a run on one hard batch that a resume would draw again
                self.log(f"iteration {iteration}: dynamic sampling: after {extra} extra rounds the learner "
                         f"ranks hold {held} groups whose scores differ, short of {share} each; tied groups "
                         "fill the rest (rollout.dynamic_sampling_max_rounds)")
                break
            first = len(batch.prompt_rows) * r.samples_per_prompt // r.chunk_size
            batch.prompt_rows += self.sampler.next(r.batch_size // r.samples_per_prompt)
            slots = list(range(first, first + r.batch_size // r.chunk_size))
            chunks = self.fleet.chunks(batch.prompt_rows, self.prompts, iteration, slots=slots)
            resynced += self._collect_chunks(iteration, batch, chunks)
            extra += 1
        return extra

    def _start(self, iteration: int) -> Started:
        cursor = self.sampler.state_dict()
        prompt_rows = self.sampler.next(self.cfg.rollout.batch_size // self.cfg.rollout.samples_per_prompt)
        return Started(prompt_rows, self.fleet.chunks(prompt_rows, self.prompts, iteration), cursor)

    def _overlaps(self) -> bool:
        """Admission: a batch started now, at the engines' version v, is trained at v + 1 at the earliest,
        so in async mode the next batch starts during this update only if that is within
        ``rollout.max_staleness``; it starts at most one batch ahead (two: ``_starts_at_sync``)."""
        return self.cfg.rollout.mode == "async" and self.cfg.rollout.max_staleness >= 1

    def _starts_at_sync(self) -> bool:
        """In-flight updates: the batch after next starts as soon as a version has loaded, so the engines fill
        the long tail of the batch in flight with the next one's requests. Started at version v, it trains at
        v + 1 at the latest, within any ``rollout.max_staleness``. Not with dynamic sampling: its extra rounds
        draw prompts while this batch is collected, after the next batch's, and a checkpoint's prompt cursor
        (the next batch's) would come before them, so a resume would draw them again."""
        r = self.cfg.rollout
        return self._overlaps() and r.in_flight_updates != "off" and not r.dynamic_sampling

    def _admission(self) -> Admission:
        """The rows the learner may train on now. Sync: exactly its version and beta. Async: versions at most
        ``rollout.max_staleness`` behind, under any stamped beta (the penalty uses the controller's at the
        update)."""
        if self.cfg.rollout.mode == "sync":
            return Admission(self.weights.policy_version, self.weights.kl_coef)
        return Admission(self.weights.policy_version, None, self.cfg.rollout.max_staleness)

    def update(self, iteration: int, collected: Collected) -> Trained:
        """KL-penalised rewards at the current beta, GAE and the PPO epochs on every rank; then the
        controller sees exactly the KL the reward penalised, once per batch."""
        kl_coef = self.kl_ctl.value
        result = self.learner.update(kl_coef, iteration)
        learner_seconds = time.perf_counter() - collected.started
        if result.trained_episodes != self.cfg.rollout.batch_size:  # an agent's episode may be several rows
            raise LoopError(f"iteration {iteration}: trained on {result.trained_episodes} episodes, expected "
                            f"{self.cfg.rollout.batch_size}")
        # every row trained on is one the collection admitted: the ranks checked each chunk,
        # this checks the batch
        version, versions, betas = self.weights.policy_version, result.policy_versions, result.kl_coefs
        if bool(self._admission().refuses(torch.tensor(versions),
                                          torch.tensor(betas, dtype=torch.float64)).any()):
            raise LoopError(f"iteration {iteration}: batch stamped with versions {versions} and betas "
                            f"{betas}, but the learner is at version {version}, beta {kl_coef} "
                            f"(rollout.mode {self.cfg.rollout.mode}, rollout.max_staleness "
                            f"{self.cfg.rollout.max_staleness})")
        self.kl_ctl.update(controller_statistic(result.kl, self.cfg.kl.scope),
                           n_steps=self.cfg.rollout.batch_size)
        return Trained(result, kl_coef, learner_seconds)

    def sync(self, iteration: int) -> Synced:
        """The updated weights as version + 1, and the new beta, to every actor; then check that every
        actor holds them and that the engines' log-probs equal the learner's. With in-flight updates the
        batch after next then starts, under the version just loaded."""
        start = time.perf_counter()
        weight_seconds = self.weights.publish(self.kl_ctl.value)
        resynced = self.weights.bring_up_to_date()
        states = self.weights.states()
        if behind := self.weights.behind(states):
            raise LoopError(f"broadcast of version {self.weights.policy_version}, beta "
                            f"{self.weights.kl_coef} did not reach {behind}")
        probe_error = self.weights.probe()
        if self._starts_at_sync() and len(self.ahead) == 1 and iteration + 2 <= self.cfg.run.iterations:
            self.ahead.append(self._start(iteration + 2))
        return Synced(weight_seconds, time.perf_counter() - start, probe_error, states, resynced)

    def record(self, iteration: int, collected: Collected, trained: Trained, synced: Synced) -> dict:
        """The iteration's metrics (with an evaluation when one is due), written to metrics.jsonl, the Ray
        dashboard and, every ``metrics.plot_every``, the curves."""
        cfg, result = self.cfg, trained.result
        record = iteration_record(
            iteration, self.weights.policy_version, self.kl_ctl.value, trained.kl_coef_used, cfg.kl.target,
            result.kl, result.sums, result.ppo, result.lr, collected.prompt_rows, result.policy_versions,
            result.kl_coefs,
            sync={"probe_max_abs_error": synced.probe_max_abs_error, "actor_states": synced.actor_states,
                  "resynced_actors": collected.resynced + synced.resynced},
            seconds={"learner": trained.learner_seconds, "learner_forward": result.forward_seconds,
                     "learner_update": result.update_seconds, "weight_sync": synced.weight_sync_seconds,
                     "sync_and_probe": synced.sync_and_probe_seconds},
            packed=cfg.learner.max_tokens_per_microbatch is not None)
        record.update(dapo_metrics(result.sums, collected.extra_rounds))
        # object store: what one sync sends (LoRA: less)
        record["weight_sync_bytes"] = self.learner.weights_bytes
        if iteration % cfg.run.eval_every == 0 or iteration == cfg.run.iterations:
            eval_start = time.perf_counter()
            self.eval_metrics, samples, kl = self.fleet.evaluate(self.eval_prompts, iteration,
                                                                 self.weights.bring_up_to_date, self.learner)
            record["eval"] = self.eval_metrics
            record["eval_seconds"] = time.perf_counter() - eval_start  # within iteration_seconds
            # the current policy's KL to the reference on the evaluation's own samples:
            # on-policy in every mode
            record["eval_kl_response_mean"], record["eval_kl_response_stderr"] = (
                kl["response_mean"], kl["response_stderr"])
            self.eval_kl = kl["response_mean"]
            rundir.write_samples(self.run_path, iteration, samples)
            self.eval_samples = samples
        record["iteration_seconds"] = time.perf_counter() - collected.started
        # busy time and CPU share per role and a judge's answers, evaluation included
        record.update(self.fleet.take_counts())
        if (share := self.learner.cpu_share()) is not None:
            record["learner_cpu_share"] = share
        self.records.append(record)
        rundir.append_metrics(self.run_path, record)
        rundir.append_episodes(self.run_path, iteration, result.episodes)
        self.job_metrics.record(record)
        # the last: beside the end
        if iteration % cfg.metrics.plot_every == 0 or iteration == cfg.run.iterations:
            self.curves.draw(self.records)
        return record

    def take_eval_samples(self) -> list[dict] | None:
        """The samples of an evaluation not yet handed on (iteration 0's from setup, then the loop's)."""
        samples, self.eval_samples = self.eval_samples, None
        return samples

    # ------------------------------------------------------------------ checkpoints and the end of the run

    def checkpoint_due(self, iteration: int) -> bool:
        every = self.cfg.checkpoint.every
        return bool(every and iteration % every == 0) or iteration == self.cfg.run.iterations

    def save_checkpoint(self, iteration: int) -> None:
        ckpt = checkpoint.begin(self.run_path, iteration)
        rank_files = self.learner.save(ckpt.url)
        state = {"iteration": iteration, "policy_version": self.weights.policy_version,
                 "kl_controller": self.kl_ctl.state_dict(),
                 # a batch in flight is not saved: the resume draws its prompts again, into an empty pipeline
                 "prompt_cursor": self.ahead[0].prompt_cursor if self.ahead else self.sampler.state_dict(),
                 "eval_start": self.start_eval, "config": self.cfg.model_dump(mode="json")}
        final = checkpoint.commit(self.run_path, ckpt, rank_files, state, self.cfg.checkpoint.keep)
        self.log(f"checkpoint {final}")

    def finish(self, iteration: int, stop: GracefulStop) -> dict:
        """The summary (and, if asked, the policy as a Hugging Face directory)."""
        cfg, records, kl_coef = self.cfg, self.records, self.kl_ctl.value
        summary = {
            "run": cfg.run.name,
            "iterations": iteration,
            "stopped_early": stop.requested,
            "policy_version": self.weights.policy_version,
            "eval_start": self.start_eval,
            "eval_final": self.eval_metrics,
            "kl_coef_final": kl_coef,
            "kl_controller": self.kl_ctl.state_dict(),
            "kl_response_mean_final": records[-1]["kl_response_mean"] if records else None,
            "kl_token_mean_final": records[-1]["kl_token_mean"] if records else None,
            "kl_target": cfg.kl.target,
            # the last evaluation's on-policy KL to the reference
            "eval_kl_response_mean_final": self.eval_kl,
            "wall_seconds": time.perf_counter() - self.wall_start,
        }
        if cfg.checkpoint.export_hf:
            self.learner.export_hf(self.run_path.child("export").url)
            self.log(f"policy exported as a Hugging Face model directory: {self.run_path.display('export')}")
        rundir.write_summary(self.run_path, summary)
        # a job stopped early: its last records (the loop drew the last iteration's)
        self.curves.draw(records)
        if stop.requested:
            self.log(f"stopped by {stop.signal_name} after iteration {iteration}; checkpoint written; "
                     f"continue with --run.resume latest --run.name {cfg.run.name}")
        else:
            self.log("summary: " + " ".join(f"final {k} {v:.3f}" for k, v in self.eval_metrics.items())
                     + f" | kl {summary['kl_response_mean_final']:.3f} nats | beta {kl_coef:.4f} | "
                     f"wall {summary['wall_seconds']:.1f}s | {self.run_path.display('summary.json')}")
        return summary


def dapo_metrics(sums: dict[str, float], extra_rounds: int | None) -> dict[str, float]:
    """The metrics of DAPO's options that are on: dynamic sampling's rounds and groups (tied: scores all
    equal; dropped: tied and not trained on; filled: tied and trained on, the rounds' bound reached; surplus:
    differing beyond the batch), the overlong penalty's mean and share of rows, the truncated rows left out of
    the loss."""
    n = sums["trained_episodes"]
    metrics: dict[str, float] = {}
    if extra_rounds is not None:
        metrics["dynamic_sampling_extra_rounds"] = extra_rounds
        metrics |= {k: sums[k] for k in sums if k.startswith("dynamic_sampling_")}
        metrics["dynamic_sampling_dropped_groups"] = (sums["dynamic_sampling_tied_groups"]
                                                      - sums["dynamic_sampling_filled_groups"])
    if "overlong_penalty_sum" in sums:
        metrics |= {"overlong_penalty_mean": sums["overlong_penalty_sum"] / n,
                    "overlong_penalized_fraction": sums["overlong_penalized"] / n}
    if "truncated_masked" in sums:
        metrics["truncated_masked_fraction"] = sums["truncated_masked"] / n
    return metrics


def setup(cfg: JobConfig, plan: Plan, wall_start: float, log: Callable[[str], None]) -> Job:
    """Everything else before the first iteration, once the input is checked (``plan``) and Ray is up: the
    actors, the resume (if asked) and the evaluation before training. ``wall_start``: the job's start."""
    import ray

    run_path = rundir.prepare(cfg.run, config_to_yaml(cfg))
    log(f"run directory {run_path}")

    for shipment in plan.shipments:  # Ray is up now: the driver's data the actors read, put once
        shipment.ship()
    # the actors: each role on its own bundle
    placement = cluster.reserve(plan.cluster)
    cluster.preflight(plan.cluster, placement, plan.models.all(), run_path, log=log)
    fleet = Fleet(plan.fleet, placement, wait=False)
    if cfg.learner_may_share_an_engines_gpu():
        # vLLM sizes its cache from the GPU memory free at its start and fails if it changes meanwhile, as
        # DeepSpeed's set-up (empty_cache) would change it: on a shared GPU the engines start first
        fleet.wait_ready()
    learner = LearnerGroup(plan.rank, placement)  # DeepSpeed sets up while the engines start
    fleet.wait_ready()
    held = (("rollout", fleet.rollouts), ("reference", fleet.references), ("reward", fleet.rewards),
            ("teacher", fleet.teachers))
    # reference.placement / reward.placement learner (or LoRA's base reference): the ranks score it themselves
    in_ranks = " and ".join(role for role, actors in held[1:3] if not actors)
    log(f"actors ready: {', '.join(f'{len(actors)} {role}' for role, actors in held if actors)}, "
        f"{cfg.learner.world_size} learner rank(s){' scoring the ' + in_ranks if in_ranks else ''}, "
        f"ZeRO-{cfg.learner.zero_stage}, {cfg.learner.dtype} "
        f"({time.perf_counter() - wall_start:.1f}s)")
    if "cpu" in (cfg.device("rollout"), cfg.device("learner")):
        engines = fleet.niceness[:len(fleet.rollouts)]
        log(describe_priorities(engines, fleet.niceness[len(engines):] + learner.niceness,
                                os.getpriority(os.PRIO_PROCESS, 0)))

    kl_ctl = (AdaptiveKLController(cfg.kl.init_kl_coef, cfg.kl.target, cfg.kl.horizon)
              if cfg.kl.controller == "adaptive" else FixedKLController(cfg.kl.init_kl_coef))
    prompts, eval_prompts, resume_from, resume_state = (plan.prompts, plan.eval_prompts, plan.resume_from,
                                                        plan.resume_state)
    sampler = PromptSampler(len(prompts), cfg.run.seed)
    weights = WeightSync(plan.sync, learner, fleet, plan.probe_set, kl_ctl.value, log=log)
    policy_version, first_iteration = 0, 1
    if resume_state is not None:
        learner.load(resume_from.url, checkpoint.read_manifest(resume_from),
                     resume_state["config"]["learner"]["world_size"])
        kl_ctl.load_state_dict(resume_state["kl_controller"])
        sampler.load_state_dict(resume_state["prompt_cursor"])
        policy_version, first_iteration = resume_state["policy_version"], resume_state["iteration"] + 1
        log(f"resumed from {resume_from} at iteration {resume_state['iteration']}, version {policy_version}, "
            f"beta {kl_ctl.value:.6f}")
    weights.start(policy_version, kl_ctl.value)  # a resumed version's weights too, then the probe

    job_metrics = DriverMetrics(ray.get_runtime_context().get_job_id())
    records = rundir.read_metrics(run_path, first_iteration - 1) if resume_state else []
    start_eval, samples = {}, None
    if resume_state:
        start_eval = resume_state["eval_start"]
    elif cfg.run.eval_before_training:
        start_eval, samples, _ = fleet.evaluate(eval_prompts, 0, learner=learner, with_kl=False)
        rundir.write_samples(run_path, 0, samples)
    if start_eval:
        log("eval before training: " + ", ".join(f"{k} {v:.3f}" for k, v in start_eval.items()))
    fleet.take_counts(), learner.cpu_share()  # the CPU shares per iteration count from here
    return Job(cfg, run_path, prompts, eval_prompts, placement, fleet, learner, weights, kl_ctl, sampler,
               first_iteration, start_eval, dict(start_eval), records, job_metrics, wall_start, log,
               rundir.Curves(run_path, cfg.kl.target, start_eval), eval_samples=samples)
