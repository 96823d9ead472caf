"""A SkyRL-Gym environment (``skyrl-gym``: GSM8K, AIME, text-to-SQL, search, ...) as a tether environment.

A job names one as ``task.environment: services.environments.skyrl:skyrl_environment`` over a dataset in
SkyRL's layout (``task.path``): each row has ``prompt`` (chat messages), ``env_class`` (a registered SkyRL-Gym
id such as ``gsm8k_multi_turn``), and the env's extras, ``reward_spec`` (``{"ground_truth": ...}``) and
``extra_info`` among them. ``task.environment_kwargs`` may give ``env_class`` for rows without one,
``env_config`` (the env's config), and ``extras``, defaults under each row's own (``{max_turns: 3}``).

SkyRL-Gym's envs are neither ``gymnasium.Env`` nor tether's: one is built per episode from its row
(``skyrl_gym.make(env_class, env_config=..., extras=row)``), ``init(prompt) -> (prompt, metadata)`` gives
the first observation, and ``step(action)`` returns ``{observations, reward, done, metadata}``. Here the
env is built at ``reset``, its chat messages are the observations (rendered with the model's chat template),
the step's reward is the turn's reward, and its metadata the step's info.
"""

from __future__ import annotations

from typing import Any

from services.environments.base import Environment

ROW_FIELDS = ("prompt", "env_class")  # a row's fields that are not the env's extras


class SkyRLEnvironment(Environment):
    """A SkyRL-Gym env built per episode from its row; ``env_class`` for rows that name none."""

    def __init__(self, env_class: str | None = None, env_config: dict | None = None,
                 extras: dict | None = None):
        import skyrl_gym

        self.env_class, self.env_config, self.extras = env_class, env_config or {}, extras or {}
        self.env = None
        if env_class is not None and env_class not in skyrl_gym.registry:
            raise ValueError(f"SkyRL-Gym has no environment {env_class!r}; it has: "
                             f"{', '.join(sorted(skyrl_gym.registry))}")

    def reset(self, row: dict, seed: int) -> list[dict]:
        import skyrl_gym

        env_class = row.get("env_class") or self.env_class
        if env_class is None:
            raise ValueError("the row names no env_class and task.environment_kwargs gives none: a SkyRL-Gym "
                             "row needs one (gsm8k, gsm8k_multi_turn, ...)")
        if "prompt" not in row:
            raise ValueError(f"the row has no 'prompt' (its fields: {sorted(row)}): a SkyRL-Gym row's prompt "
                             "is its chat messages")
        extras = {**self.extras, **{k: v for k, v in row.items() if k not in ROW_FIELDS}}
        from omegaconf import OmegaConf

        # SkyRL's trainer gives envs their config as an omegaconf DictConfig, which some read by attribute
        self.env = skyrl_gym.make(env_class, env_config=OmegaConf.create(self.env_config), extras=extras)
        prompt, _ = self.env.init(messages(row["prompt"]))
        return messages(prompt)

    def step(self, action: str) -> tuple[list[dict] | None, float, bool, dict]:
        out = self.env.step(action)
        done = bool(out["done"])
        turn = messages(out.get("observations") or []) or None
        return (None if done else turn or ""), float(out["reward"]), done, dict(out.get("metadata") or {})

    def close(self) -> None:
        if self.env is not None:
            self.env.close()


def messages(value: Any) -> list[dict]:
    """Chat messages as plain dicts of str (a Parquet row's list of structs arrives as arrays of mappings)."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    return [{"role": str(m["role"]), "content": str(m["content"])} for m in value]


def skyrl_environment(env_class: str | None = None, env_config: dict | None = None,
                      extras: dict | None = None) -> SkyRLEnvironment:
    """SkyRL-Gym's ``env_class`` (or each row's own) as a tether environment over ``task.path``'s rows."""
    return SkyRLEnvironment(env_class, env_config, extras)
