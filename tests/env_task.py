"""A randomwalks task whose reward, run in the job's reward actors, checks the environment they got: the
job's own variables (``ray job submit --runtime-env-json``) and tether's per-actor ones. Loaded by the job
as ``tests.env_task:JobEnvTask``."""

from __future__ import annotations

import os
from dataclasses import dataclass

from services.tasks.randomwalks import RandomWalksTask

# what the submit test passes in the job's runtime env: MY_FLAG of the user's own, and three that tether also
# sets for its actors (Ray refused a job that set any of tether's keys); the job's values must win
RUN_NAME = "job-env"
JOB_ENV = {"MY_FLAG": "1", "DS_ACCELERATOR": "cpu", "TOKENIZERS_PARALLELISM": "false",
           "VLLM_LOGGING_LEVEL": "ERROR"}
# what tether sets per actor (metrics.log_level at its default) where the job does not
TETHER_ENV = {"TETHER_RUN": RUN_NAME, "TETHER_LOG_LEVEL": "warning", "TRANSFORMERS_VERBOSITY": "warning"}


@dataclass
class JobEnvTask(RandomWalksTask):
    name: str = "randomwalks"  # randomwalks' SFT warm start and its cache: only the reward's check is added

    def reward(self, prompts, completions):
        wanted = {**JOB_ENV, **TETHER_ENV}
        found = {key: os.environ.get(key) for key in wanted}
        if found != wanted:
            raise RuntimeError(f"reward actor environment {found}, expected {wanted}")
        return super().reward(prompts, completions)
