"""A GEM environment (``gem-llm``: games, math, QA) as a tether environment.

A job names one as ``task.environment: services.environments.gem:gem_environment`` with
``task.environment_kwargs: {id: "game:GuessTheNumber-v0-easy"}`` (plus any keyword ``gem.make`` takes). GEM's
envs are not ``gymnasium.Env``: ``reset(seed) -> (observation, info)`` and ``step(action) -> (observation,
reward, terminated, truncated, info)``, all text. A row is one game: ``{"seed": n}`` resets GEM with seed
``n``, so the episodes of a group play the same game and GRPO's or RLOO's baseline compares like with like.

tether keeps the conversation, so the game is played without GEM's observation wrappers (which send the
history again every turn): a turn's observation is what the env said after the model's move, framed by the
``prefix`` and ``suffix`` its ``info`` carries (the next-move prompt), as GEM's own wrapper frames it. The
step's reward is the turn's reward. Observations are user turns for the model's chat template
(``chat: false``: plain text, for a model without one); ``instructions`` come before the first observation,
as the system turn with ``chat: true``.

GEM seeds Python's global ``random`` (and numpy's) at each reset: the environment workers run a blocking
reset alone (``actors/environment.py``), so a reset draws what it seeded.
"""

from __future__ import annotations

from services.environments.base import EVAL_SEEDS_START, Environment, as_observation


def framed(observation: str, info: dict) -> str:
    """``observation`` between ``info``'s ``prefix`` and ``suffix``, on a line of its own, as GEM's
    ``ObservationWrapper`` frames one."""
    text = observation if not observation or observation.endswith("\n") else observation + "\n"
    return f"{info.get('prefix', '')}{text}{info.get('suffix', '')}".strip()


class GemEnvironment(Environment):
    """One GEM env, as reset/step; ``episodes`` training and ``eval_episodes`` evaluation rows."""

    def __init__(self, env, id: str, episodes: int = 256, eval_episodes: int = 32, chat: bool = True,
                 instructions: str | None = None):
        self.env, self.id, self.episodes, self.eval_episodes = env, id, episodes, eval_episodes
        self.chat, self.instructions = chat, instructions

    def rows(self) -> list[dict]:
        return [{"seed": n} for n in range(self.episodes)]

    def eval_rows(self) -> list[dict]:
        return [{"seed": EVAL_SEEDS_START + n} for n in range(self.eval_episodes)]

    def reset(self, row: dict, seed: int) -> str | list[dict]:
        """The game of ``row`` (its ``seed`` is GEM's; ``seed``, the episode's, is used only for a row
        without one)."""
        observation, info = self.env.reset(seed=int(row.get("seed", seed)))
        return as_observation(framed(self._text(observation, "reset"), info), self.chat, self.instructions)

    def step(self, action: str) -> tuple[str | list[dict] | None, float, bool, dict]:
        observation, reward, terminated, truncated, info = self.env.step(action)
        done = bool(terminated or truncated)
        turn = None if done else as_observation(framed(self._text(observation, "step"), info), self.chat)
        return turn, float(reward), done, dict(info)

    def close(self) -> None:
        close = getattr(self.env, "close", None)
        if callable(close):
            close()

    def _text(self, observation, where: str) -> str:
        if not isinstance(observation, str):
            raise TypeError(f"GEM env {self.id!r} {where} returned a {type(observation).__name__} "
                            "observation, expected str (a tether environment reads text)")
        return observation


def gem_environment(id: str, episodes: int = 256, eval_episodes: int = 32, chat: bool = True,
                    instructions: str | None = None, **kwargs) -> GemEnvironment:
    """``gem.make(id, **kwargs)`` as a tether environment over ``episodes`` training games and
    ``eval_episodes`` evaluation games."""
    import gem

    try:
        env = gem.make(id, **kwargs)
    except ValueError as err:  # an id GEM does not have: its message names none, so list what it has
        ids = ", ".join(sorted(gem.envs.registration.ENV_REGISTRY))
        raise ValueError(f"GEM has no environment {id!r} ({err}); it has: {ids}") from err
    return GemEnvironment(env, id, episodes, eval_episodes, chat, instructions)
