"""A small `verifiers` environment (verifiers.v1, the taskset id ``tether-sums``): one-turn sums of two
one-digit numbers, generated from a seed, each scored by the task's own ``@vf.reward``.

It runs under .venv-verifiers' Python (``make verifiers``), never in tether's: run_episode.py plays one of its
tasks per episode. Any installed verifiers environment is played the same way (docs/recipes.md).
"""

from __future__ import annotations

import random
import re

import verifiers.v1 as vf

SYSTEM_PROMPT = "Answer with the number only."
_INTEGER = re.compile(r"-?\d+")


class SumsData(vf.TaskData):
    """One problem: the prompt, and the answer the reward compares with."""

    answer: int


class SumsTask(vf.Task[SumsData]):
    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        """1 when the last integer of the model's reply is the sum, else 0."""
        numbers = _INTEGER.findall(trace.last_reply)
        return float(bool(numbers) and int(numbers[-1]) == self.data.answer)


class SumsConfig(vf.TasksetConfig):
    num_tasks: int = 2048
    """How many problems the taskset holds (the ``idx`` of a tether row picks one)."""
    seed: int = 0
    """Problem ``idx`` is always the same two numbers for a seed."""
    max_operand: int = 9
    """Each number is drawn from 0..max_operand."""


class SumsTaskset(vf.Taskset[SumsTask, SumsConfig]):
    def load(self):
        for idx in range(self.config.num_tasks):
            draw = random.Random(f"{self.config.seed}-{idx}")
            a, b = draw.randint(0, self.config.max_operand), draw.randint(0, self.config.max_operand)
            yield SumsTask(SumsData(prompt=f"What is {a} + {b}?", system_prompt=SYSTEM_PROMPT, answer=a + b),
                           self.config.task)


__all__ = ["SumsTaskset"]
