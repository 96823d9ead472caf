"""Environments for the agent tests (tests/test_agents.py), loaded by the environment workers (Ray actors) as
``tests.agent_envs:<factory>``, the way tests/dataset_rewards.py is loaded by the reward actors.

``Scripted`` is deterministic: what it returns depends only on its row, the turn and the attempt, never on the
model's turns (which it records). Every attempt at an episode (each gets a fresh instance, on any worker)
writes what it was given and what it returned to ``<root>/<row key>/attempt-<n>.json``, so a test can compare
a batch with what the environment did, token for token, and count the attempts. A row can ask for a fault on
its first attempts only: raise, hang past the step deadline, return something malformed, or kill its worker.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

from services.environments import Environment

# the interactive randomwalks vocabulary: letters a..u, ':' and '>' (services/environments/randomwalks.py)
CHARS = "abcdefghijklmnopqrstu:>"
FAULTS = ("raise", "hang", "malformed", "nan", "no_observation", "die")


def row(key: str, turns: int, **fields) -> dict:
    """A row of ``Scripted``: ``key`` names its attempt files (unique per row of a test), ``turns`` is the
    model turns after which the episode ends (done). Optional fields:

    - ``id`` (int): varies its observations and rewards;
    - ``kind``: "text" (default) or "ids" (observations as token ids, one of them the EOS id);
    - ``obs_len`` (int): every observation that many tokens (default 1-3, by id and turn);
    - ``prompt_len`` (int): the first observation that many tokens;
    - ``fault``: {"at": "reset" | "step", "turn": t, "kind": one of FAULTS, "attempts": n (default 1),
      "seconds": a hang's length}: the fault on the row's first n attempts.
    """
    return {"key": key, "turns": turns, **fields}


class Scripted(Environment):
    """An episode of ``turns`` model turns: the observations and rewards follow from (row id, turn,
    attempt)."""

    def __init__(self, root: str, eos_id: int = len(CHARS)):
        self.root, self.eos_id = Path(root), eos_id
        self.row: dict = {}
        self.turn = 0

    # ------------------------------------------------------------------ what the episode is

    def observation(self, turn: int) -> str | list[int]:
        """The observation after ``turn`` model turns (0: the prompt). The attempt is in the prompt's first
        token, so a batch shows which attempt a row holds."""
        ident = int(self.row.get("id", 0))
        if turn == 0:
            n = int(self.row.get("prompt_len", 2 + ident % 3))
            letters = [CHARS[(ident + self.attempt * 7) % 21]] + \
                [CHARS[(ident + 3 * k) % 23] for k in range(1, n)]
        else:
            n = int(self.row.get("obs_len", 1 + (ident + turn) % 3))
            letters = [CHARS[(5 * ident + 2 * turn + k) % 23] for k in range(n)]
        if self.row.get("kind") == "ids" and turn > 0:
            ids = [CHARS.index(c) for c in letters]
            return ids[:1] + [self.eos_id] + ids[1:] if n > 1 else ids  # an EOS id that text would lose
        return "".join(letters)

    def reward(self, turn: int) -> float:
        ident = int(self.row.get("id", 0))
        return round((-1) ** ident * (0.5 + 0.25 * turn) + 0.01 * ident, 6)

    # ------------------------------------------------------------------ the environment

    def reset(self, row: dict, seed: int):
        self.row, self.turn = row, 0
        folder = self.root / row["key"]
        folder.mkdir(parents=True, exist_ok=True)
        self.attempt = 0
        while True:  # claim this attempt's number (attempts of one row never overlap, but be exact anyway)
            try:
                os.close(os.open(folder / f"attempt-{self.attempt}.json", os.O_CREAT | os.O_EXCL))
                break
            except FileExistsError:
                self.attempt += 1
        self.path = folder / f"attempt-{self.attempt}.json"
        self.log = {"row": row, "seed": seed, "attempt": self.attempt, "pid": os.getpid(), "steps": [],
                    "fault": None, "done": False}
        fault = self.fault("reset")
        if fault == "malformed":
            return {"not": "an observation"}
        if fault == "no_observation":
            return ""
        self.log["reset"] = self.observation(0)
        self.save()
        return self.log["reset"]

    def step(self, action: str):
        self.turn += 1
        fault = self.fault("step")
        observation, reward, done = self.observation(self.turn), self.reward(self.turn), \
            self.turn >= self.row["turns"]
        if fault == "malformed":
            return observation, reward, done  # three values, not four
        if fault == "nan":
            return observation, math.nan, done, {}
        if fault == "no_observation":
            return None, reward, False, {}  # an episode that goes on needs its next observation
        info = {"tool_calls": self.turn % 2}
        self.log["steps"].append({"action": action, "observation": None if done else observation,
                                  "reward": reward, "done": done, "tool_calls": info["tool_calls"]})
        self.log["done"] = done
        self.save()
        return (None if done else observation), reward, done, info

    def fault(self, at: str) -> str | None:
        """The row's fault, if this attempt and this call have it: raises, hangs or exits here, or returns the
        kind of malformed result to give."""
        fault = self.row.get("fault")
        if not fault or self.attempt >= fault.get("attempts", 1) or fault["at"] != at:
            return None
        if at == "step" and fault["turn"] != self.turn:
            return None
        self.log["fault"] = {"kind": fault["kind"], "turn": self.turn}
        self.save()
        if fault["kind"] == "raise":
            raise RuntimeError(f"injected fault at turn {self.turn}")
        if fault["kind"] == "hang":
            time.sleep(fault.get("seconds", 5.0))  # past the deadline: what this returns then is never read
            raise RuntimeError("a hung step came back")
        if fault["kind"] == "die":
            os._exit(1)  # the worker's process, with every episode it holds
        return fault["kind"]

    def save(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.log))
        tmp.replace(self.path)


def scripted(root: str) -> Scripted:
    """What a job names as ``tests.agent_envs:scripted``; ``root`` (task.environment_kwargs) holds the
    attempt files."""
    return Scripted(root)


def attempts(root: str | Path, key: str) -> list[dict]:
    """The attempt files of row ``key``, in order (for the tests)."""
    folder = Path(root) / key
    count = len(list(folder.glob("attempt-*.json")))
    return [json.loads((folder / f"attempt-{n}.json").read_text()) for n in range(count)]
