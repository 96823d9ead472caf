"""A textarena single-player game as a tether environment (``pip install 'tether[recipes]'``).

A job names one as ``task.environment: services.environments.textarena:textarena_environment`` with
``task.environment_kwargs: {id: GuessTheNumber-v0}`` (plus any keyword the game's class takes). A row is one
game: ``{"game": n}`` resets textarena with seed ``n``, so the episodes of a group play the same game and
GRPO's or RLOO's baseline compares like with like.

tether keeps the conversation, so the game is played without textarena's observation wrappers (each of them
returns the whole history again every turn); its action wrappers stay (``ActionFormattingWrapper`` puts a
move in the brackets the games read). A turn's observation is what the game said since the last turn, the
invalid-move notices included, and the model's own move left out (it is already in the trajectory). The
game's reward for player 0 comes on the last step; the steps before it give 0. Observations are user turns
for the model's chat template (``chat: false``: plain text, for a model without one).
"""

from __future__ import annotations

import textarena

from services.environments.base import EVAL_SEEDS_START, Environment, as_observation


def _without_observation_wrappers(env):
    """``env``'s wrapper chain with each ``textarena.ObservationWrapper`` taken out, the others kept in
    order."""
    if not isinstance(env, textarena.Wrapper):
        return env
    inner = _without_observation_wrappers(env.env)
    if isinstance(env, textarena.ObservationWrapper):
        return inner
    env.env = inner
    return env


class TextArenaEnvironment(Environment):
    """One textarena game for one player, as reset/step; ``games`` and ``eval_games`` rows."""

    def __init__(self, env, id: str, games: int = 256, eval_games: int = 32, chat: bool = True):
        self.env, self.id, self.games, self.eval_games = (_without_observation_wrappers(env), id, games,
                                                          eval_games)
        self.chat = chat

    def rows(self) -> list[dict]:
        return [{"game": n} for n in range(self.games)]

    def eval_rows(self) -> list[dict]:
        return [{"game": EVAL_SEEDS_START + n} for n in range(self.eval_games)]

    def reset(self, row: dict, seed: int) -> str | list[dict]:
        """The game of ``row`` (its ``game`` is textarena's seed; ``seed``, the episode's, is not used: the
        episodes of a row play one game)."""
        self.env.reset(num_players=1, seed=int(row["game"]))
        return self._observation()

    def step(self, action: str) -> tuple[str | list[dict] | None, float, bool, dict]:
        done, _ = self.env.step(action=action)
        if not done:
            return self._observation(), 0.0, False, {}
        rewards, game_info = self.env.close()
        return None, float(rewards[0]), True, {"reason": game_info.get(0, {}).get("reason")}

    def _observation(self) -> str | list[dict]:
        player, messages = self.env.get_observation()
        if player != 0:
            raise ValueError(f"textarena game {self.id!r} asks player {player} to move; a tether environment "
                             "plays single-player games (player 0)")
        # the model's own move is in the trajectory already: only what the game said
        text = "\n".join(text for _, text, kind in messages
                         if kind != textarena.ObservationType.PLAYER_ACTION)
        return as_observation(text, self.chat)


def textarena_environment(id: str, games: int = 256, eval_games: int = 32, chat: bool = True,
                          **kwargs) -> TextArenaEnvironment:
    """``textarena.make(id, **kwargs)`` as a tether environment over ``games`` training games and
    ``eval_games`` evaluation games."""
    env = textarena.make(id, **kwargs)
    try:  # a game for two or more players refuses one at reset: say so here, before any actor starts
        env.reset(num_players=1, seed=0)
    except (AssertionError, ValueError) as err:
        raise ValueError(f"textarena game {id!r} cannot be played by one player ({err}); a tether "
                         "environment plays single-player games") from err
    return TextArenaEnvironment(env, id, games, eval_games, chat)
