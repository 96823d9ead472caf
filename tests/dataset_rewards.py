"""Reward functions for the dataset-task tests, loaded by name as ``tests.dataset_rewards:<function>``."""

from __future__ import annotations

from services.tasks.randomwalks import LETTERS


def letter_distance(prompt: str, completion: str, answer: str) -> float:
    """-|first letter of the completion - the row's answer| / 20 (0 is right); -1 when the completion does
    not start with a letter a-u. Depends on ``answer``, so a score shows which row's answer arrived."""
    if not completion or completion[0] not in LETTERS:
        return -1.0
    return -abs(LETTERS.index(completion[0]) - LETTERS.index(answer)) / 20


def chat_length(prompt: list[dict], completion: str, weight: float) -> float:
    """The row's weight times the completion length: a chat-messages prompt arrives as the messages."""
    assert isinstance(prompt, list) and prompt[-1]["role"] == "user", prompt
    return weight * len(completion)


def no_fields(prompt: str, completion: str) -> float:
    return 0.0


not_a_function = 42
