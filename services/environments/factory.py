"""An environment from its name: ``package.module:factory`` imported, then called with the job's
``task.environment_kwargs``; a gymnasium.Env is wrapped in the adapter (``services.environments.gym``)."""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable
from typing import Any

from services.environments.base import Environment
from services.errors import load_object


def load_environment_factory(spec: str) -> Callable[..., Environment]:
    """The callable ``spec`` names as ``package.module:factory`` (a class or a function)."""
    factory = load_object(spec, "task.environment", "package.module:factory")
    if not callable(factory):
        raise ValueError(  # noqa: TRY004 - main reports ValueError as bad config
            f"environment {spec!r} is of type {type(factory).__name__}, not a class or function")
    return factory


def make_environment(factory: Callable[..., Any], kwargs: dict, spec: str) -> Environment:
    """``factory(**kwargs)`` as an environment: a gymnasium.Env is wrapped, anything with callable ``reset``
    and ``step`` is taken as it is."""
    try:
        env = factory(**kwargs)
    except Exception as err:
        raise ValueError(f"environment {spec!r} with kwargs {kwargs} raised "
                         f"{type(err).__name__}: {err}") from err
    # an object can be a gymnasium.Env only once gymnasium is imported
    gymnasium = sys.modules.get("gymnasium")
    if gymnasium is not None and isinstance(env, gymnasium.Env):
        from services.environments.gym import GymnasiumEnvironment

        return GymnasiumEnvironment(env)
    missing = [name for name in ("reset", "step") if not callable(getattr(env, name, None))]
    if missing:
        raise ValueError(f"environment {spec!r} returned a {type(env).__name__} without callable "
                         f"{' and '.join(missing)}; an environment needs reset(row, seed) and step(action)")
    check_calls(env, spec)
    return env


def check_calls(env: Any, spec: str) -> None:
    """ValueError, before any actor, where ``reset`` or ``step`` cannot be called the way the environment
    workers call them: ``reset(row, seed)`` and ``step(action)``, positionally (GEM's ``reset(seed)``, for
    one, cannot)."""
    for name, arguments in (("reset", ("row", "seed")), ("step", ("action",))):
        method = getattr(env, name)
        try:
            signature = inspect.signature(method)
        except ValueError:  # a builtin without a signature: called as it is
            continue
        try:
            signature.bind(*arguments)
        except TypeError as err:
            raise ValueError(
                f"environment {spec!r}: {type(env).__name__}.{name}{signature} cannot be called as "
                f"{name}({', '.join(arguments)}), as the environment workers call it ({err}); an environment "
                "needs reset(row, seed), row the task's row and seed an int, and step(action); wrap the "
                "environment in a class that has them (a gymnasium.Env is wrapped for you)") from err
