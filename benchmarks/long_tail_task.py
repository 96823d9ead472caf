"""The long-tail task of ``benchmarks/long_tail.py``: each prompt is a letter that names how many tokens its
answer must have, from 2 to 64, most of them short (``TARGETS``); the reward is ``length_score``. Loaded by
the job's reward actors as ``benchmarks.long_tail_task:length_score``."""

from __future__ import annotations

# letter -> the answer's length in tokens: half the prompts want at most 4, one in twelve the whole cap of 64
TARGETS = {"a": 2, "b": 2, "c": 3, "d": 3, "e": 4, "f": 4, "g": 6, "h": 8, "i": 12, "j": 16, "k": 32, "l": 64}
MAX_NEW_TOKENS = 64


def length_score(prompt: str, completion: str, length: int) -> float:
    """1 for an answer of exactly ``length`` tokens (one character each), falling linearly to 0 at a distance
    of ``length``; any characters count."""
    return max(0.0, 1.0 - abs(len(completion) - length) / length)
