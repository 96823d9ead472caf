"""What a task is: prompts, a reward function, an evaluation, and the recipe for its model and tokenizer.

Adding a task is one file that subclasses ``Task`` and one line in ``services/tasks/__init__.py``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Task:
    name: str = "task"
    # "chars": a local one-character-per-token tokenizer over ``vocabulary``; "pretrained": the model's own.
    tokenizer_kind: str = "pretrained"
    # "gpt2": built from ``model_config`` with random init, then SFT-trained on ``sft_corpus``.
    model_kind: str = "pretrained"
    model_config: dict | None = None
    max_new_tokens: int = 32

    @property
    def vocabulary(self) -> list[str]:
        raise NotImplementedError

    def prompts(self) -> list[str]:
        """Training prompts, as text."""
        raise NotImplementedError

    def eval_prompts(self) -> list[str]:
        return self.prompts()

    def sft_corpus(self) -> list[str] | None:
        """Texts for the SFT warm start of a model built from scratch; None when the model is pretrained."""
        return None

    def reward(self, prompts: list[str], completions: list[str]) -> list[float]:
        """One scalar score per (prompt, completion) pair."""
        raise NotImplementedError

    def evaluate(self, prompts: list[str], completions: list[str]) -> dict[str, float]:
        return {"score": sum(self.reward(prompts, completions)) / max(len(prompts), 1)}
