"""What a task is: prompts, a reward function, an evaluation, and the recipe for its model and tokenizer.

Adding a task is one file that subclasses ``Task`` and one line in ``services/tasks/__init__.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


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

    # Rows: the reward actor knows which prompt (index into ``prompts()``, split "train", or into
    # ``eval_prompts()``, split "eval") each sample answers. Tasks whose reward reads only the text ignore it.

    def reward_rows(self, prompts: list[str], completions: list[str], rows: list[int],
                    split: str) -> list[float]:
        """One score per sample of prompt rows ``rows``; ``reward`` by default."""
        return self.reward(prompts, completions)

    def evaluate_rows(self, prompts: list[str], completions: list[str], rows: list[int], split: str) -> dict:
        """Eval metrics of samples of prompt rows ``rows``; ``evaluate`` by default. An empty dict: the task
        has no metric of its own and the job's reward (reward.kind) is its score."""
        return self.evaluate(prompts, completions)

    def row_fields(self, rows: list[int], split: str) -> list[dict]:
        """Each row's fields the reward reads besides the text (a dataset's task.reward_fields); none here."""
        return [{} for _ in rows]

    def prompt_origin(self, index: int, split: str = "train") -> str:
        """Where a prompt comes from, for error messages."""
        return f"prompt {index}" if split == "train" else f"eval prompt {index}"

    def reward_actor_options(self) -> dict | None:
        """The options a reward actor builds this task from; None: the driver's own (task.seed)."""
        return None

    def format_prompt(self, text: str, tokenizer) -> str:
        """The prompt as the policy sees it (e.g. with its chat template); the text itself by default."""
        return text

    def model_dir(self, cache_dir: str | Path) -> Path:
        """The HF model dir of a task whose model is neither given (model.path) nor built from scratch."""
        raise NotImplementedError(f"task {self.name!r} has no built-in model recipe; set model.path")
