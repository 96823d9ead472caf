"""Reward functions for the dataset-task tests, loaded by name as ``tests.dataset_rewards:<function>``."""

from __future__ import annotations

from services.tasks import get_task
from services.tasks.randomwalks import LETTERS

RANDOMWALKS = get_task("randomwalks")  # the job's default task seed


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


def randomwalks_score(prompt: str, completion: str) -> float:
    """The randomwalks task's reward as a user writes one: a function of one sample."""
    return RANDOMWALKS.reward([prompt], [completion])[0]


def no_fields(prompt: str, completion: str) -> float:
    return 0.0


not_a_function = 42


def trl_letter_distance(prompts: list, completions: list, answer: list, **kwargs) -> list[float]:
    """``letter_distance`` as TRL's reward function: a batch, the row's column as a list, conversational
    completions (message lists) where the prompts are chat messages."""
    texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
    return [letter_distance("", text, a) for text, a in zip(texts, answer, strict=True)]


def compute_score(data_source: str, solution_str: str, ground_truth: str, extra_info=None) -> float:
    """``letter_distance`` as verl's compute_score, over a verl-style row (its ground truth under
    reward_model)."""
    assert data_source == "letters", data_source
    return letter_distance("", solution_str, ground_truth)


def first_letter(prompt: str, completion: str, answer: str) -> float:
    """Reads the completion's first character: fails on an empty completion, which an engine can give."""
    return letter_distance(prompt, completion[0], answer)


def hangs(prompt: str, completion: str, answer: str) -> float:
    """Never returns."""
    import time

    while True:
        time.sleep(1)


def not_a_number(prompt: str, completion: str, answer: str) -> str:
    return "good"
