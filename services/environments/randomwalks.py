"""Randomwalks as a multi-turn environment: the model sees where it is and where it may go, and answers one
move per turn. The graph, its walks and the optimality score are those of the single-turn task
(services/walk_graph.py); this adds the turns, and the recipe of the tiny GPT-2 that learns them.

An episode from 'b' on the default graph (seed 1000), in the order its tokens reach the model:
``b:dju>`` (observation), ``d`` + EOS (the model's move), ``d:alt>``, ``a`` + EOS: done, optimality 1.0.
"""

from __future__ import annotations

from functools import cache

from services.environments.base import Environment
from services.models import EOS
from services.walk_graph import (
    GOAL,
    GPT2_CONFIG,
    LETTERS,
    MAX_LENGTH,
    WalkGraph,
    build_graph,
    optimality,
)

GOAL_LETTER = LETTERS[GOAL]


@cache
def _graph(seed: int) -> WalkGraph:
    return build_graph(seed)  # one per seed and process: every episode of a worker walks the same graph


class InteractiveRandomWalks(Environment):
    """One episode is a walk from the row's start letter: each turn the model names one neighbour of the
    current node. Reaching 'a' scores the walk's optimality; an illegal move or the length cap scores 0."""

    name = "interactive-randomwalks"
    tokenizer_kind = "chars"
    model_kind = "gpt2"
    max_new_tokens = 2  # a move: one letter, then EOS
    metric = "optimality"

    def __init__(self, seed: int = 1000):
        self.seed = seed
        self.graph = _graph(seed)
        self.walk = ""  # the letters visited this episode, start first; "" before reset and once done

    # ------------------------------------------------------------------ the task recipe the job reads

    @property
    def vocabulary(self) -> list[str]:
        return list(LETTERS) + [":", ">"]

    @property
    def model_config(self) -> dict:
        """randomwalks' GPT-2 with room for the longest trajectory: the first observation, then every turn
        a move, its EOS and the next observation (the node, ':', up to max-degree letters, '>')."""
        longest_observation = 3 + int(self.graph.adjacency.sum(1).max())
        longest = longest_observation + (MAX_LENGTH - 1) * (self.max_new_tokens + longest_observation)
        n_positions = max(128, 1 << (longest - 1).bit_length())  # a power of two
        return {**GPT2_CONFIG, "n_positions": n_positions}

    def rows(self) -> list[dict]:
        """The walks' start letters that can reach 'a' within the walk length (randomwalks' prompts)."""
        starts = {walk[0] for walk in self.graph.walks}
        scorable = {LETTERS[s] for s in self.graph.scorable_starts}
        return [{"start": s} for s in sorted(starts & scorable)]

    def eval_rows(self) -> list[dict]:
        return self.rows()

    def sft_corpus(self) -> list[str]:
        """The graph's walks as the transcripts an episode produces: observation, move, EOS, next observation,
        ..., the last move. The SFT trainer appends the final EOS."""
        return [EOS.join(self.observation(walk[i]) + walk[i + 1] for i in range(len(walk) - 1))
                for walk in self.graph.walks]

    # ------------------------------------------------------------------ the environment

    def observation(self, node: str) -> str:
        """``node:neighbours>``, the neighbours' letters sorted, e.g. ``b:dju>``."""
        neighbours = "".join(LETTERS[i] for i in self.graph.adjacency[LETTERS.index(node)].nonzero()[0])
        return f"{node}:{neighbours}>"

    def reset(self, row: dict, seed: int) -> str:
        start = row.get("start")
        if not (isinstance(start, str) and len(start) == 1 and start in LETTERS and start != GOAL_LETTER):
            raise ValueError(f"randomwalks row {row!r}: 'start' must be a letter "
                             f"{LETTERS[1]!r}..{LETTERS[-1]!r}")
        self.walk = start
        return self.observation(start)

    def step(self, action: str) -> tuple[str | None, float, bool, dict]:
        if not self.walk:
            raise RuntimeError("step before reset, or after the episode ended")
        move = action.strip()
        here = LETTERS.index(self.walk[-1])
        if len(move) != 1 or move not in LETTERS or not self.graph.adjacency[here, LETTERS.index(move)]:
            self.walk = ""
            return None, 0.0, True, {"illegal_move": action}
        self.walk += move
        if move == GOAL_LETTER or len(self.walk) == MAX_LENGTH:
            # a walk that never reaches 'a' scores 0
            walk, self.walk = self.walk, ""
            return None, optimality(self.graph, walk), True, {"walk": walk}
        return self.observation(move), 0.0, False, {}


def interactive_randomwalks(seed: int = 1000) -> InteractiveRandomWalks:
    """The environment a job names as ``services.environments.randomwalks:interactive_randomwalks``."""
    return InteractiveRandomWalks(seed)
