"""trlX's randomwalks benchmark: walk a random graph to node 'a' by
the shortest path. Needs no download: graph, walks, tokenizer and a tiny GPT-2 are all built here."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from services.tasks.base import Task
from services.walk_graph import GPT2_CONFIG, LETTERS, MAX_LENGTH, WalkGraph, build_graph, optimality


@dataclass
class RandomWalksTask(Task):
    """Prompts are the start letters 'b'..'u' that can reach 'a' (all 20 on the default seed); the reward
    is the walk's optimality."""

    name: str = "randomwalks"
    seed: int = 1000
    tokenizer_kind: str = "chars"
    model_kind: str = "gpt2"
    model_config: dict = field(default_factory=lambda: dict(GPT2_CONFIG))
    max_new_tokens: int = MAX_LENGTH - 1

    @cached_property
    def graph(self) -> WalkGraph:
        return build_graph(self.seed)

    @property
    def vocabulary(self) -> list[str]:
        return list(LETTERS) + ["|"]

    def prompts(self) -> list[str]:
        """The walks' start letters that can reach 'a' within the walk length; the others are left out
        (with a warning naming them), since no walk from them can score."""
        starts = sorted({walk[0] for walk in self.graph.walks})
        scorable = {LETTERS[s] for s in self.graph.scorable_starts}
        left_out = [s for s in starts if s not in scorable]
        if left_out:
            warnings.warn(f"randomwalks task.seed={self.seed}: {len(left_out)} of {len(starts)} start nodes "
                          f"({''.join(left_out)}) have no path to 'a' shorter than {MAX_LENGTH} nodes and "
                          f"are left out of the prompts", stacklevel=2)
        return [s for s in starts if s in scorable]

    def eval_prompts(self) -> list[str]:
        return self.prompts()

    def sft_corpus(self) -> list[str]:
        return list(self.graph.walks)

    def reward(self, prompts: list[str], completions: list[str]) -> list[float]:
        return [optimality(self.graph, p + c) for p, c in zip(prompts, completions, strict=True)]

    def evaluate(self, prompts: list[str], completions: list[str]) -> dict[str, float]:
        scores = self.reward(prompts, completions)
        return {"optimality": float(np.mean(scores))}
