"""A reasoning-gym dataset as a one-turn tether environment, scored by the dataset's own verifier
(``pip install 'tether[recipes]'``).

A job names one as ``task.environment: services.environments.reasoning_gym:reasoning_gym_environment`` with
``task.environment_kwargs: {dataset: leg_counting}`` (plus ``size``, ``eval_size``, ``seed`` and any keyword
of the dataset's config). The generator makes ``size + eval_size`` problems from ``seed``: the first ``size``
are the training rows, the rest the evaluation's. An episode is one question and one answer: the model's
turn, with the text between its last ``<answer>`` and ``</answer>`` taken as the answer when it writes the
tags (reasoning-gym's own ``extract_answer``), goes to the dataset's ``score_answer``, whose score is the
reward.
"""

from __future__ import annotations

import reasoning_gym
from reasoning_gym.utils import SYSTEM_PROMPTS, extract_answer

from services.environments.base import Environment, as_observation


class ReasoningGymEnvironment(Environment):
    """Rows ``{"index": i}`` of one generated dataset; ``reset`` asks its question, ``step`` scores the
    answer."""

    def __init__(self, dataset, size: int, eval_size: int, system_prompt: str | None, chat: bool):
        self.dataset, self.size, self.eval_size = dataset, size, eval_size
        self.system_prompt, self.chat = system_prompt, chat
        self.entry: dict | None = None

    def rows(self) -> list[dict]:
        return [{"index": i} for i in range(self.size)]

    def eval_rows(self) -> list[dict]:
        return [{"index": self.size + i} for i in range(self.eval_size)]

    def reset(self, row: dict, seed: int) -> str | list[dict]:
        """The question of problem ``row["index"]`` (a row is always the same problem; ``seed`` is unused)."""
        self.entry = self.dataset[int(row["index"])]
        if not self.chat:  # the plain question: a model without a chat template has no system turn either
            return self.entry["question"]
        return as_observation(self.entry["question"], True,
                              SYSTEM_PROMPTS[self.system_prompt] if self.system_prompt else None)

    def step(self, action: str) -> tuple[None, float, bool, dict]:
        answer = extract_answer(action)
        score = self.dataset.score_answer(answer=answer if answer is not None else action, entry=self.entry)
        return None, float(score), True, {}


def reasoning_gym_environment(dataset: str, size: int = 512, eval_size: int = 64, seed: int = 1,
                              system_prompt: str | None = "direct", chat: bool = True,
                              **config) -> ReasoningGymEnvironment:
    """``reasoning_gym.create_dataset(dataset, size=size + eval_size, seed=seed, **config)`` as a tether
    environment. ``system_prompt`` names one of reasoning-gym's ``SYSTEM_PROMPTS`` ("direct" asks for the
    answer in ``<answer>`` tags and nothing else; none: no system turn); ``chat: false`` gives the question as
    plain text, for a model without a chat template."""
    if system_prompt is not None and system_prompt not in SYSTEM_PROMPTS:
        raise ValueError(f"system_prompt {system_prompt!r} is not one of reasoning-gym's: "
                         f"{sorted(SYSTEM_PROMPTS)}")
    generated = reasoning_gym.create_dataset(dataset, size=size + eval_size, seed=seed, **config)
    return ReasoningGymEnvironment(generated, size, eval_size, system_prompt, chat)
