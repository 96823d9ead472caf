"""Multi-turn episodes with an environment: ``task.name: environment``, ``task.environment:
package.module:factory`` and ``task.environment_kwargs`` (services/environments).

The rows episodes reset from come from ``task.path`` (read as a dataset's prompts are, every field of a row
kept) or, without one, from the environment's own ``rows()``. The driver builds one environment here to
fail early on a factory that cannot be imported or built, and to read what the environment says about its
model, when it brings a recipe (the built-in interactive randomwalks does: a character tokenizer, a tiny
GPT-2 and its SFT transcripts). The episodes run on the environment workers (``actors/environment.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from services.tasks.base import Task


@dataclass
class EnvironmentTask(Task):
    name: str = "environment"
    seed: int = 1000
    environment: str = ""
    environment_kwargs: dict[str, Any] = field(default_factory=dict)
    path: str | None = None
    split: str = "train"
    eval_path: str | None = None
    eval_split: str | None = None
    metric: str = "return"  # the evaluation's name for the episodes' mean return

    def __post_init__(self) -> None:
        from services.environments import load_environment_factory, make_environment

        self.factory = load_environment_factory(self.environment)
        self.example = make_environment(self.factory, self.environment_kwargs, self.environment)
        # the environment's own recipe for its model, where it has one (else: model.path and its tokenizer)
        for attribute in ("tokenizer_kind", "model_kind", "model_config", "max_new_tokens", "metric"):
            if hasattr(self.example, attribute):
                setattr(self, attribute, getattr(self.example, attribute))

    @property
    def vocabulary(self) -> list[str]:
        return list(self.example.vocabulary)

    def sft_corpus(self) -> list[str] | None:
        corpus = getattr(self.example, "sft_corpus", None)
        return corpus() if callable(corpus) else None

    def model_dir(self, cache_dir: str | Path) -> Path:
        """The environment's own pretrained model (its ``model_dir(cache_dir)``, e.g. the calculator's
        SmolLM2), where it brings one; else the base class's error (set model.path)."""
        own = getattr(self.example, "model_dir", None)
        if callable(own):
            return Path(own(cache_dir))
        return super().model_dir(cache_dir)

    @cached_property
    def train_rows(self) -> list[dict]:
        return self._rows(self.path, self.split, "rows")

    @cached_property
    def eval_rows(self) -> list[dict]:
        if self.eval_path or self.eval_split:
            return self._rows(self.eval_path or self.path, self.eval_split or self.split, "eval_rows")
        if self.path is None and callable(getattr(self.example, "eval_rows", None)):
            return self._rows(None, "", "eval_rows")
        return self.train_rows

    def _rows(self, path: str | None, split: str, method: str) -> list[dict]:
        if path is not None:
            from services.tasks.dataset import read_rows

            columns = read_rows(path, split, None, "task.path" if path == self.path else "task.eval_path")
            names = list(columns)
            return [dict(zip(names, values, strict=True)) for values in zip(*columns.values(), strict=True)]
        source = getattr(self.example, method, None) or getattr(self.example, "rows", None)
        if not callable(source):
            raise ValueError(  # noqa: TRY004 - main reports ValueError as bad config
                f"task.environment {self.environment!r} has no rows() to reset from: give task.path "
                             "(a file of rows), or a rows() method on the environment")
        rows = list(source())
        if not rows or not all(isinstance(r, dict) for r in rows):
            raise ValueError(f"task.environment {self.environment!r}: {method}() must return a non-empty "
                             f"list of dicts, got {rows[:2]!r:.120}")
        return rows

    def prompts(self) -> list[str]:
        """The rows, one per episode start (an environment's prompt is its reset observation)."""
        return [str(r) for r in self.train_rows]

    def eval_prompts(self) -> list[str]:
        return [str(r) for r in self.eval_rows]

    def prompt_origin(self, index: int, split: str = "train") -> str:
        source = self.path if split == "train" else (self.eval_path or self.path)
        return f"{source or 'the environment'}, {'row' if split == 'train' else 'eval row'} {index}"

    def reward(self, prompts: list[str], completions: list[str]) -> list[float]:
        raise NotImplementedError("an environment's episodes are rewarded by its steps "
                                  "(RolloutBatch.turn_rewards)")


@dataclass
class AgentTask(EnvironmentTask):
    """``task.name: agent``: each row of ``task.path`` is passed whole to ``rollout.agent``, an agent program
    that talks to the policy through an OpenAI-compatible endpoint (``actors/agent_endpoint.py``) and returns
    the episode's reward. No environment: the agent is one."""

    name: str = "agent"

    def __post_init__(self) -> None:
        self.example = None
