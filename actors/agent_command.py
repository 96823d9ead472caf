"""An agent program as a command of its own (``rollout.agent`` of a module that says
``agent = command_agent(...)``): one process per episode, with any interpreter, virtualenv or language.

It is the bridge to agents whose packages cannot share the engine's process: a ``verifiers`` environment
needs ``openai<3``, tether installs 3.x (docs/recipes.md). The process gets one JSON object on stdin,
``{"base_url": ..., "row": ...}``, and the same URL as ``OPENAI_BASE_URL`` (with ``OPENAI_API_KEY=tether``),
so an unchanged OpenAI client reaches the engine's endpoint; its last line on stdout is the episode's reward.
The engine's Python paths are left out of its environment: the command's own interpreter finds only its own
packages. A non-zero exit, or a last line that is not a number, fails the episode with the command's stderr;
at the episode's deadline the process is killed.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
from collections.abc import Awaitable, Callable
from pathlib import Path

from services.errors import TetherError

# What would make another interpreter read the engine's packages instead of its own.
ENGINE_PYTHON_VARIABLES = ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PYTHONSTARTUP")
STDERR_TAIL = 2000  # characters of the command's stderr a failure quotes


class CommandFailed(TetherError, RuntimeError):
    """The command exited non-zero or printed no reward."""


def command_agent(*command: str | Path,
                  cwd: str | Path | None = None) -> Callable[[str, dict], Awaitable[float]]:
    """``async agent(base_url, row) -> reward`` running ``command`` once per episode, from ``cwd`` (default:
    this process's). Refuses at once, so that the job does before any actor starts, a program that is not
    there."""
    if not command:
        raise ValueError("command_agent needs a command: the program and its arguments")
    program = str(command[0])
    if os.sep in program:  # a path, from cwd
        if not os.access(Path(cwd or ".", program), os.X_OK):
            raise FileNotFoundError(f"command_agent: program {program!r} is not an executable file"
                                    f"{f' under {cwd}' if cwd else ''}")
    elif shutil.which(program) is None:
        raise FileNotFoundError(f"command_agent: program {program!r} is not on PATH")
    argv = [str(part) for part in command]
    environment = {k: v for k, v in os.environ.items() if k not in ENGINE_PYTHON_VARIABLES}

    async def agent(base_url: str, row: dict) -> float:
        process = await asyncio.create_subprocess_exec(
            *argv, cwd=cwd, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env={**environment, "OPENAI_BASE_URL": base_url, "OPENAI_API_KEY": "tether"})
        try:
            out, err = await process.communicate(json.dumps({"base_url": base_url, "row": row}).encode())
        except BaseException:  # the deadline's cancellation, above all: no process outlives its episode
            if process.returncode is None:
                process.kill()
                await process.wait()
            raise
        stderr = err.decode(errors="replace")[-STDERR_TAIL:]
        if process.returncode != 0:
            raise CommandFailed(f"{argv[0]} exited with {process.returncode}: {stderr}")
        lines = out.decode(errors="replace").strip().splitlines()
        try:
            return float(lines[-1])
        except (IndexError, ValueError):
            last = lines[-1] if lines else ""
            raise CommandFailed(f"{argv[0]}'s last line on stdout is {last!r:.200}, not a reward; "
                                f"stderr: {stderr}") from None

    agent.__qualname__ = f"command_agent({' '.join(argv)!r})"
    return agent
