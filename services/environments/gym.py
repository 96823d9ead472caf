"""A gymnasium.Env with text observations as a tether environment.

A job names one registered with gymnasium as
``task.environment: services.environments.gym:gymnasium_environment`` with
``task.environment_kwargs: {id: ...}`` (plus any keyword ``gymnasium.make`` takes). The model's turn is
the action, as text; the row goes to ``reset`` as its ``options``.
"""

from __future__ import annotations

import gymnasium

from services.environments.base import Environment


class GymnasiumEnvironment(Environment):
    """``env`` behind tether's interface. Its observation space must be ``gymnasium.spaces.Text``, or unset
    where the env returns str observations (checked at each step)."""

    def __init__(self, env: gymnasium.Env):
        space = getattr(env, "observation_space", None)
        if space is not None and not isinstance(space, gymnasium.spaces.Text):
            raise ValueError(f"gymnasium env {env} has observation space {space}; a tether environment needs "
                             f"gymnasium.spaces.Text (the observation is text for the model)")
        self.env = env

    def reset(self, row: dict, seed: int) -> str:
        observation, _ = self.env.reset(seed=seed, options=row)
        return self._text(observation, "reset")

    def step(self, action: str) -> tuple[str, float, bool, dict]:
        observation, reward, terminated, truncated, info = self.env.step(action)
        return self._text(observation, "step"), float(reward), bool(terminated or truncated), dict(info)

    def close(self) -> None:
        self.env.close()

    def _text(self, observation, where: str) -> str:
        if not isinstance(observation, str):
            raise TypeError(f"gymnasium env {self.env} {where} returned a {type(observation).__name__} "
                            f"observation, expected str")
        return observation


def gymnasium_environment(id: str, **kwargs) -> GymnasiumEnvironment:
    """``gymnasium.make(id, **kwargs)`` as a tether environment."""
    return GymnasiumEnvironment(gymnasium.make(id, **kwargs))
