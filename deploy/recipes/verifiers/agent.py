"""tether's side of the verifiers recipe (docs/recipes.md): ``rollout.agent:
deploy.recipes.verifiers.agent:agent`` plays each episode as a process of .venv-verifiers' Python running
run_episode.py (actors/agent_command.py), which runs one episode of the verifiers environment the row names
against the engine's OpenAI-compatible endpoint and prints its reward.

verifiers pins ``openai<3`` and tether installs 3.x, so verifiers lives in a virtualenv of its own (``make
verifiers``) and never in the engine's process. The paths are found from this file, so they hold in whatever
directory the engine's process runs (the job itself runs from the clone's root, where ``deploy`` imports); a
clone without that virtualenv fails when this module is imported, which the job does before any actor starts.
"""

from __future__ import annotations

from pathlib import Path

from actors.agent_command import command_agent

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
PYTHON = ROOT / ".venv-verifiers" / "bin" / "python"
RUNNER = HERE / "run_episode.py"

if not PYTHON.is_file() or not any(ROOT.glob(".venv-verifiers/lib/python*/site-packages/verifiers/v1")):
    raise FileNotFoundError(f"the verifiers recipe runs its episodes with {PYTHON}, which is not there or "
                            f"has no verifiers: run `make verifiers` in {ROOT} (verifiers==0.4.0 in a "
                            "virtualenv of its own: it needs openai<3, tether installs 3.x)")

agent = command_agent(PYTHON, RUNNER)
