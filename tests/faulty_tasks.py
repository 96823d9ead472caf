"""Tasks that misbehave on purpose, loaded by the job as ``tests.faulty_tasks:<Class>``."""

from __future__ import annotations

from dataclasses import dataclass

from services.tasks.randomwalks import RandomWalksTask


@dataclass
class RaisingReward(RandomWalksTask):
    name: str = "raising-reward"

    def reward(self, prompts, completions):
        raise RuntimeError("the reward backend is down")


@dataclass
class NaNReward(RandomWalksTask):
    name: str = "nan-reward"

    def reward(self, prompts, completions):
        scores = super().reward(prompts, completions)
        scores[3] = float("nan")
        return scores


@dataclass
class ShortReward(RandomWalksTask):
    name: str = "short-reward"

    def reward(self, prompts, completions):
        return super().reward(prompts, completions)[:-1]


@dataclass
class NoPrompts(RandomWalksTask):
    name: str = "no-prompts"

    def prompts(self):
        return []


@dataclass
class LongPrompts(RandomWalksTask):
    name: str = "long-prompts"

    def prompts(self):
        return ["b" * 40, "c", "d" * 30]
