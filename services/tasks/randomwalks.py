"""trlX's randomwalks benchmark: walk a random graph to node 'a' by
the shortest path. Needs no download: graph, walks, tokenizer and a tiny GPT-2 are all built here."""

from __future__ import annotations

import string
import warnings
from collections import deque
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from services.tasks.base import Task

N_NODES = 21
MAX_LENGTH = 10
N_WALKS = 1000
P_EDGE = 0.1
GOAL = 0
LETTERS = string.ascii_lowercase[:N_NODES]  # 'a'..'u'; node i is LETTERS[i]


@dataclass(frozen=True)
class WalkGraph:
    adjacency: np.ndarray  # [N, N] bool, adjacency[i, j] = edge i -> j
    walks: list[str]
    best: list[int]  # best[s]: nodes on a shortest path s -> 'a', start and goal counted, capped at M

    @property
    def scorable_starts(self) -> list[int]:
        """Start nodes with a path to the goal shorter than the walk length: from the others every walk
        ends at the cap (unreachable, or reached only at the M-th node), so optimality has nothing to rank."""
        return [s for s in range(N_NODES) if s != GOAL and self.best[s] < MAX_LENGTH]


def build_graph(seed: int = 1000) -> WalkGraph:
    """The graph and walks exactly as trlX generates them: same RNG calls, same order (except on seeds
    where trlX's graph leaves no start able to reach the goal: those draw on to the next graph)."""
    rng = np.random.RandomState(seed)
    while True:
        adjacency = rng.rand(N_NODES, N_NODES) > 1 - P_EDGE
        np.fill_diagonal(adjacency, False)
        if not np.all(adjacency.sum(1) > 0):  # every node has an out-edge (trlX checks rows)
            continue
        adjacency[GOAL, :] = False
        adjacency[GOAL, GOAL] = True  # the goal is absorbing
        best = [_shortest_path_nodes(adjacency, s) for s in range(N_NODES)]
        # beyond trlX (same draws wherever it has a task): on ~12% of seeds no start reaches the goal within
        # the walk length (often 'a' has no in-edge), which leaves no prompt; draw another graph then
        if any(best[s] < MAX_LENGTH for s in range(N_NODES) if s != GOAL):
            break

    walks = []
    for _ in range(N_WALKS):
        node = rng.randint(N_NODES)
        while node == GOAL:
            node = rng.randint(N_NODES)
        walk = [node]
        for _ in range(MAX_LENGTH - 1):
            node = rng.choice(np.flatnonzero(adjacency[node]))
            walk.append(node)
            if node == GOAL:
                break
        walks.append("".join(LETTERS[i] for i in walk))
    return WalkGraph(adjacency=adjacency, walks=walks, best=best)


def _shortest_path_nodes(adjacency: np.ndarray, start: int) -> int:
    """Nodes on a BFS shortest path start -> goal (both counted), capped at MAX_LENGTH."""
    depth = {start: 1}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        if node == GOAL:
            return min(depth[node], MAX_LENGTH)
        for nxt in np.flatnonzero(adjacency[node]):
            if nxt not in depth:
                depth[int(nxt)] = depth[node] + 1
                queue.append(int(nxt))
    return MAX_LENGTH


def optimality(graph: WalkGraph, sample: str) -> float:
    """(M - bound) / (M - best[start]) in [0, 1]; 1 is a shortest path, 0 invalid or never at 'a'.

    ``sample`` is the decoded prompt plus completion. Anything after the first 'a' is ignored.
    """
    bound = MAX_LENGTH
    prev = None
    for position, ch in enumerate(sample, start=1):
        if ch not in LETTERS:
            break
        node = LETTERS.index(ch)
        if prev is not None and not graph.adjacency[prev, node]:
            break
        if node == GOAL:
            bound = position
            break
        prev = node
    start = LETTERS.index(sample[0]) if sample and sample[0] in LETTERS else GOAL
    # trlX's best[] covers starts 1..N-1, so a start at the goal reads its last entry (a quirk kept as is)
    headroom = MAX_LENGTH - graph.best[start if start != GOAL else N_NODES - 1]
    # a start without a path shorter than the cap (left out of the prompts) has bound = M: 0, not 0/0
    return (MAX_LENGTH - bound) / headroom if headroom else 0.0


@dataclass
class RandomWalksTask(Task):
    """Prompts are the start letters 'b'..'u' that can reach 'a' (all 20 on the default seed); the reward
    is the walk's optimality."""

    name: str = "randomwalks"
    seed: int = 1000
    tokenizer_kind: str = "chars"
    model_kind: str = "gpt2"
    # GPT-2 of trlX's size class with a head size vLLM's CPU attention accepts (128 / 4 = 32).
    model_config: dict = field(
        default_factory=lambda: {
            "n_layer": 6,
            "n_embd": 128,
            "n_head": 4,
            "n_positions": 32,
            "resid_pdrop": 0.0,
            "embd_pdrop": 0.0,
            "attn_pdrop": 0.0,
        }
    )
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
                          f"({''.join(left_out)}) have no path to 'a' shorter than {MAX_LENGTH} nodes and are left "
                          f"out of the prompts", stacklevel=2)
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
