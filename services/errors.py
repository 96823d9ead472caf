"""The one base of tether's own errors, and the one loader of ``package.module:attribute`` settings.

Every error tether raises on purpose is a ``TetherError``, so ``python -m learner.main`` reports any of them
as one line (exit code 1) and a traceback means a bug. Each keeps the builtin it was (a ``RuntimeError``, a
``ValueError`` for bad input) for callers that catch those.
"""

from __future__ import annotations

import importlib
import re
import sys
from typing import Any

ANSI = re.compile(r"\x1b\[[0-9;]*m")


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


def actor_error(err: BaseException) -> tuple[str, str] | None:
    """An error raised inside a Ray actor or task (Ray's ``RayTaskError``), as (tether's one line: the actor's
    method it ran in and the original error, the whole report Ray gave with its traceback), or None for any
    other error. Read from the error's ``cause`` (through actors that called actors) and from the first line
    of Ray's report, ``ray::Actor.method()``."""
    exceptions = getattr(sys.modules.get("ray"), "exceptions", None)
    task_error = getattr(exceptions, "RayTaskError", None)
    if task_error is None or not isinstance(err, task_error):
        return None
    report, cause = ANSI.sub("", str(err)), err
    while isinstance(cause, task_error) and getattr(cause, "cause", None) is not None:
        cause = cause.cause
    where = re.match(r"ray::([\w.]+)", report)
    if isinstance(cause, task_error):  # no cause to read: the report's last line is the error
        message = report.strip().splitlines()[-1]
    elif isinstance(cause, TetherError | ValueError):  # tether's own message says what and where
        message = str(cause)
    else:
        message = f"{type(cause).__name__}: {cause}"
    return (f"{where.group(1)}: {message}" if where else message), report
