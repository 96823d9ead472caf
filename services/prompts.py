"""Prompt encoding (with the long-prompt policy) and the resumable prompt sampler."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np


def encode_prompts(texts: list[str], tokenizer, max_tokens: int, long_prompts: str, log=print,
                   origin: Callable[[int], str] | None = None) -> list[list[int]]:
    """Token ids of each prompt. Longer than ``max_tokens``: an error ("reject"), or keep the last
    ``max_tokens`` tokens ("truncate"), counted and logged. An empty prompt set is an error. ``origin(i)``
    says where prompt i comes from in errors (a dataset's file, row and field); "prompt i" by default."""
    origin = origin or (lambda i: f"prompt {i}")
    if not texts:
        raise ValueError("the task has an empty prompt set")
    encoded = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    empty = [i for i, ids in enumerate(encoded) if not ids]
    if empty:
        raise ValueError(f"{len(empty)} prompt(s) encode to zero tokens; first is {origin(empty[0])} "
                         f"({texts[empty[0]]!r})")
    long = [i for i, ids in enumerate(encoded) if len(ids) > max_tokens]
    if long and long_prompts == "reject":
        first, longest = long[0], max(len(encoded[i]) for i in long)
        raise ValueError(
            f"{len(long)} prompt(s) are longer than task.max_prompt_tokens={max_tokens}; first is "
            f"{origin(first)} with {len(encoded[first])} tokens, the longest has {longest}. Raise "
            f"task.max_prompt_tokens to {longest} (prompt and response must fit the model's positions), or "
            "set task.long_prompts=truncate to keep each prompt's last tokens (a chat prompt then loses its "
            "first turns, the system turn among them)"
        )
    if long:
        log(f"prompts: truncated {len(long)} prompt(s) to their last {max_tokens} tokens (first: "
            f"{origin(long[0])})")
        encoded = [ids[-max_tokens:] for ids in encoded]
    return encoded


class PromptSampler:
    """Walks through shuffled passes over the prompt set; its state is the data cursor of a checkpoint."""

    def __init__(self, num_prompts: int, seed: int) -> None:
        self.num_prompts, self.seed = num_prompts, seed
        self.epoch, self.position = 0, 0

    def _order(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(self.num_prompts)

    def next(self, count: int) -> list[int]:
        out: list[int] = []
        while len(out) < count:
            order = self._order(self.epoch)
            take = order[self.position : self.position + count - len(out)]
            out += take.tolist()
            self.position += len(take)
            if self.position >= self.num_prompts:
                self.epoch, self.position = self.epoch + 1, 0
        return out

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position, "num_prompts": self.num_prompts,
                "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        if state["num_prompts"] != self.num_prompts:
            raise ValueError(f"prompt cursor is for {state['num_prompts']} prompts, this task has "
                             f"{self.num_prompts}")
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
