"""trlX's randomwalks world: a random directed graph over the letters 'a'..'u', walks on it, and the
optimality of a walk to node 'a' (the goal). The single-turn task (``services.tasks.randomwalks``) and the
multi-turn environment (``services.environments.randomwalks``) both read it, so it sits beneath both.
"""

from __future__ import annotations

import string
from collections import deque
from dataclasses import dataclass

import numpy as np

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


# GPT-2 of trlX's size class with a head size vLLM's CPU attention accepts (128 / 4 = 32): the policy both
# randomwalks settings train from random init
GPT2_CONFIG = {"n_layer": 6, "n_embd": 128, "n_head": 4, "n_positions": 32, "resid_pdrop": 0.0,
               "embd_pdrop": 0.0, "attn_pdrop": 0.0}
