"""tether's driver: ``python -m learner.main [--config job.yaml] [--kl.target 6 ...]``.

The loop reads top to bottom: sample prompts; stream chunks through rollout, then reference and reward
in parallel; train the learner ranks on the chunk refs; update beta once per batch; broadcast weights
and beta; log; evaluate. Tensors travel as Ray object refs and never pass through this process.
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import sys
from typing import Literal

from pydantic import Field, ValidationError

from services.config import JobConfig, config_to_yaml, merge_settings, read_yaml
from services.errors import TetherError, actor_error
from services.private_api import exit_skipping_teardown

# ====================================================================== scaffolding: CLI, logging


class JobCli(JobConfig):
    """tether job. Settings come from the defaults, then --config YAML, then these flags.
    --print-config prints the resolved config as YAML and exits."""

    config: str | None = Field(None, description="YAML file with settings (flags override it)")
    log_level: Literal["debug", "info", "warning", "error"] | None = Field(
        None, alias="log-level", description="the same as --metrics.log_level")


def parse_cli(argv: list[str]) -> JobConfig | None:
    """Returns the resolved config, or None after --print-config. Raises ValidationError on bad input."""
    from pydantic_settings import CliSettingsSource

    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config")
    pre.add_argument("--print-config", action="store_true")
    known, _ = pre.parse_known_args(argv)
    from_yaml = read_yaml(known.config) if known.config else {}
    # the flags as a nested dict, unvalidated, then on top of the file by the settings' own merge (a dict
    # flag replaces the file's); only what the two set is set: the defaults stay unset (model_fields_set)
    from_cli = CliSettingsSource(JobCli, cli_parse_args=[a for a in argv if a != "--print-config"],
                                 cli_prog_name="python -m learner.main")()
    from_cli.pop("config", None)
    log_level = from_cli.pop("log-level", None)  # JobCli.log_level by its alias
    cfg = JobConfig.model_validate(merge_settings(from_yaml, from_cli))
    if log_level:
        cfg.metrics.log_level = log_level
    if known.print_config:
        print(config_to_yaml(cfg), end="")
        return None
    return cfg


def log(message: str) -> None:
    print(f"[tether] {message}", flush=True)


class Progress:
    """One line per iteration (what `ray job logs` shows); on a terminal also a live tqdm bar. Also feeds
    the experiment trackers of ``metrics.report_to`` (``services.tracking``)."""

    def __init__(self, cfg: JobConfig, run_path) -> None:
        from tqdm import tqdm

        from services.tracking import Tracker

        self.cfg = cfg
        self.tracker = Tracker(cfg.metrics, run_path, cfg.run.name, bool(cfg.run.resume),
                               cfg.model_dump(mode="json"), log=log)
        self.tracker.start()
        self.bar = tqdm(total=cfg.run.iterations, unit="it", dynamic_ncols=True,
                        disable=not (cfg.metrics.progress_bar and sys.stdout.isatty()))

    def update(self, r: dict, samples: list[dict] | None = None) -> None:
        """An iteration's record, and the samples of its evaluation if it had one."""
        target, per_token = self.cfg.kl.target, self.cfg.kl.scope == "token_mean"
        # the KL against its target in the controller's scope (kl.scope token_mean: nats per token)
        fed = r["kl_token_mean"] if per_token else r["kl_response_mean"]
        kl = (f"kl {r['kl_response_mean']:.3f} nats, {fed:.4f}/{target or 0:.4g} per token" if per_token
              else f"kl {fed:.3f}/{target or 0:.1f} nats")
        line = (f"iter {r['iteration']}/{self.cfg.run.iterations} | reward {r['reward_mean']:.3f} | "
                f"score {r['score_mean']:.3f} | {kl} | "
                f"beta {r['kl_coef']:.4f} | "
                + (f"turns {r['turns_mean']:.2f} | env {r['environment_seconds']:.2f}s | "
                   if "turns_mean" in r else "")
                + (f"teacher kl {r['teacher_kl_response_mean']:.3f} | "
                   if "teacher_kl_response_mean" in r else "")
                + (f"judge unparseable {r['reward_judge_unparseable']}/{r['reward_judge_answers']} | "
                   if r.get("reward_judge_answers") else "")
                + "".join(f"eval {k} {v:.3f} | " for k, v in r.get("eval", {}).items())
                + (f"eval kl {r['eval_kl_response_mean']:.3f} | " if "eval_kl_response_mean" in r else "")
                + f"{r['iteration_seconds']:.2f}s")
        if self.bar.disable:
            log(line)
        else:
            self.bar.write(f"[tether] {line}")
            self.bar.set_postfix(reward=f"{r['reward_mean']:.3f}",
                                 kl=f"{fed:.3g}/{target or 0:g}",
                                 beta=f"{r['kl_coef']:.4f}", sec=f"{r['iteration_seconds']:.1f}")
            self.bar.update(1)
        self.tracker.log(r)
        self.samples(r["iteration"], samples)

    def samples(self, iteration: int, samples: list[dict] | None) -> None:
        """An evaluation's samples (iteration 0: before training), as written to samples/."""
        if samples is not None:
            self.tracker.log_samples(iteration, samples)

    def close(self, summary: dict | None = None) -> None:
        """After the summary and the final curves.png: the tracker takes both."""
        self.bar.close()
        self.tracker.finish(summary)


# ================================================================= the job: setup, then a loop of named steps


def plan_and_connect(cfg: JobConfig):
    """The input checked (``learner.plan``: whatever can be wrong with it fails there, before any actor
    starts), and Ray joined or started. Joining is quick and comes after the plan. A local Ray starts on this
    thread (``ray.init`` must run on the main thread) while a second one imports the loop and runs the plan:
    Ray's start mostly waits on the processes it spawns, the imports and the plan are the driver's CPU. On bad
    input the Ray just started stops again; Ctrl-C does not wait for the plan (its thread is a daemon)."""
    import threading

    from actors.base import starting_up
    from learner import cluster

    spec = cluster.ClusterSpec.of(cfg)
    local = cluster.starts_local_ray(spec)

    def imports_and_plan():
        with starting_up():  # the loop's imports, with the actor classes the driver starts
            import learner.loop  # noqa: F401
            from learner.plan import plan
        return plan(cfg, log, local_ray=local)

    if not local:
        planned = imports_and_plan()
        cluster.connect(spec, log=log)
        return planned
    outcome: dict = {}

    def planning():
        try:
            outcome["plan"] = imports_and_plan()
        except BaseException as err:  # noqa: BLE001 (raised on the main thread below)
            outcome["error"] = err

    thread = threading.Thread(target=planning, name="plan", daemon=True)
    thread.start()
    try:
        cluster.connect(spec, log=log)
    except Exception:
        thread.join()
        if "error" in outcome:  # bad input is named first
            raise outcome["error"] from None
        raise
    thread.join()
    if "error" in outcome:
        cluster.disconnect()
        raise outcome["error"]
    return outcome["plan"]


def run(cfg: JobConfig) -> dict:
    """The job: setup, then one iteration after another of named steps (``learner/loop.py``)."""
    import time

    from learner import cluster

    wall_start = time.perf_counter()
    plan = plan_and_connect(cfg)
    from learner.loop import GracefulStop, setup

    # actors up, weights and beta synced, resumed if asked, first eval
    job = setup(cfg, plan, wall_start, log)
    progress, stop = Progress(cfg, job.run_path), GracefulStop()
    progress.samples(0, job.take_eval_samples())  # the evaluation before training (none on a resume)
    iteration, summary = job.first_iteration - 1, None
    try:
        for iteration in range(job.first_iteration, cfg.run.iterations + 1):
            collected = job.collect_batch(iteration)  # generate, score, collect; lost chunks regenerated
            trained = job.update(iteration, collected)  # rewards at this beta, GAE, PPO epochs; then beta
            synced = job.sync(iteration)  # weights (version + 1) and beta to every actor, then the probe
            record = job.record(iteration, collected, trained, synced)  # evaluation too, when due
            progress.update(record, job.take_eval_samples())
            if stop.requested or job.checkpoint_due(iteration):
                job.save_checkpoint(iteration)
            if stop.requested:
                break
        summary = job.finish(iteration, stop)
        return summary
    finally:
        job.placement.remove()
        cluster.disconnect()  # while the last curves draw
        try:
            job.curves.wait()
        finally:
            progress.close(summary)  # the tracker takes the summary and the final curves


def parse(argv: list[str]) -> JobConfig | int:
    """The job's config, or the exit code when there is no job to run: 0 after --print-config, 2 on invalid
    input."""
    try:
        cfg = parse_cli(argv)
    except (ValidationError, FileNotFoundError, ValueError) as err:
        print(f"[tether] invalid config: {err}", file=sys.stderr, flush=True)
        return 2
    return 0 if cfg is None else cfg


def run_job(cfg: JobConfig) -> int:
    """The job's exit code: 0 done, 1 failed (named), 143 stopped by a signal after a clean checkpoint."""
    # learner.cluster before torch loads: it sets the OpenMP environment (THREAD_ENV)
    import learner.cluster  # noqa: F401
    from services.console import quiet_libraries
    from services.cpu_share import StarvationWatch

    quiet_libraries(cfg.metrics.log_level)
    # until the loop takes SIGTERM and SIGINT over (GracefulStop), either unwinds the start-up, so that Ray's
    # exit handler ends the processes a local Ray started, and the job says so in one line (SIGINT too: a
    # process started in the background inherits it ignored, as GracefulStop would not leave it)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.default_int_handler)
    try:
        with StarvationWatch(cfg.run.name, log, cfg.metrics.cpu_watch_s):  # says if other work starves it
            summary = run(cfg)
    except KeyboardInterrupt:
        print("[tether] stopped by a signal before the run's next checkpoint", file=sys.stderr, flush=True)
        return 130
    except (TetherError, FileNotFoundError, ValueError) as err:  # bad input found late, or a named failure
        # raised inside an actor: its one line first, Ray's traceback only when asked
        line, report = actor_error(err) or (str(err), None)
        print(f"[tether] error: {line}", file=sys.stderr, flush=True)
        if report is not None:
            print(report if cfg.metrics.log_level == "debug" else
                  "[tether] (the actor's traceback: --metrics.log_level debug)", file=sys.stderr, flush=True)
        return 1
    if summary["stopped_early"]:
        return 143  # stopped by a signal, like a process killed by SIGTERM, after a clean checkpoint
    return 0 if all(math.isfinite(v) for v in summary["eval_final"].values()) else 1


def main(argv: list[str] | None = None) -> int:
    cfg = parse(sys.argv[1:] if argv is None else argv)
    return cfg if isinstance(cfg, int) else run_job(cfg)


def cli() -> None:
    """The ``tether`` console command (pyproject.toml) and ``python -m learner.main``."""
    # Ray before its import: a call to Ray before the driver connects raises, never starts a second local Ray
    os.environ.setdefault("RAY_ENABLE_AUTO_CONNECT", "0")
    cfg = parse(sys.argv[1:])
    if isinstance(cfg, int):
        sys.exit(cfg)
    code = run_job(cfg)
    # A job has written and closed all it keeps, and Ray has stopped: the atexit handlers run (logging's flush
    # among them), then the process ends without Python's teardown of the thousands of modules a job loads
    # (torch, Ray, DeepSpeed, matplotlib); a plain sys.exit where that is not verified (services.private_api)
    exit_skipping_teardown(code)


if __name__ == "__main__":
    cli()
