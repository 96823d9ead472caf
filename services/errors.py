"""The one base of tether's own errors, and the one loader of ``package.module:attribute`` settings.

Every error tether raises on purpose is a ``TetherError``, so ``python -m learner.main`` reports any of them
as one line (exit code 1) and a traceback means a bug. Each keeps the builtin it was (a ``RuntimeError``, a
``ValueError`` for bad input) for callers that catch those.
"""

from __future__ import annotations

import importlib
from typing import Any


class TetherError(Exception):
    """An error tether raises on purpose, with a message that names what is wrong and where."""


class ConfigError(TetherError, ValueError):
    """A setting that cannot work: named with its value, before any actor starts where that is possible."""


def load_object(spec: str, setting: str, form: str = "package.module:attribute") -> Any:
    """What ``spec`` names as ``package.module:attribute`` (the attribute may be dotted), imported.

    Raises ConfigError naming ``setting`` when the form is wrong, the import fails (the module is user code:
    whatever its import raises is a bad setting) or the module has no such attribute.
    """
    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        raise ConfigError(f"{setting}={spec!r} must be given as '{form}'")
    try:
        found: Any = importlib.import_module(module_name)
    except Exception as err:
        raise ConfigError(f"{setting}={spec!r}: module {module_name!r} cannot be imported: "
                          f"{type(err).__name__}: {err}") from err
    for name in attribute.split("."):
        if not hasattr(found, name):
            raise ConfigError(f"{setting}={spec!r}: module {module_name!r} has no attribute {attribute!r}")
        found = getattr(found, name)
    return found
