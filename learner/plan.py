"""The specs the driver builds the learner's workers from: each holds what its role reads of the job's
settings, resolved once, and nothing else (a rank never sees the whole ``JobConfig``)."""

from __future__ import annotations

from dataclasses import dataclass

from learner.algorithm import Algorithm
from services.config import JobConfig, LearnerConfig
from services.model_source import ModelSource


@dataclass(frozen=True)
class RankSpec:
    """What a learner rank is built from, and nothing else: the policy's files, the learner's settings, the
    algorithm layer (``learner.algorithm``, with the settings it reads) and the few figures of the job the
    optimizer steps and their schedule need."""

    model: ModelSource | str
    learner: LearnerConfig
    algorithm: Algorithm
    temperature: float = 1.0  # rollout.temperature: the learner scores at the engines' temperature
    seed: int = 0  # run.seed: the value head's init, the same on every rank
    device: str = "cpu"  # the device the learner role reserved
    run_iterations: int = 1  # run.iterations: ppo.lr_schedule's length
    rollout_batch_size: int | None = None  # episodes per batch: the optimizer steps per epoch
    rows_per_episode_vary: bool = False  # rollout.agent: an episode gives a row per trajectory of its calls

    @classmethod
    def of(cls, cfg: JobConfig, model: ModelSource | str) -> RankSpec:
        return cls(model, cfg.learner, Algorithm.from_config(cfg), cfg.rollout.temperature, cfg.run.seed,
                   cfg.device("learner"), cfg.run.iterations, cfg.rollout.batch_size, cfg.rollout.agent is not None)
