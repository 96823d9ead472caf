"""One episode of a `verifiers` environment (verifiers.v1) against an OpenAI-compatible endpoint, run as
.venv-verifiers/bin/python deploy/recipes/verifiers/run_episode.py: the process tether's command_agent
starts for each episode (deploy/recipes/verifiers/agent.py, actors/agent_command.py).

stdin: ``{"base_url": ..., "row": {"taskset": ID, "idx": N, "taskset_config": {...}}}``, where ``taskset`` is
a verifiers environment's taskset id (an installed package, or a module next to this file, as
``tether-sums``), ``idx`` the task's position in the taskset and ``taskset_config`` (optional) its
``TasksetConfig`` fields. The episode is the environment's own (``Env.run_episode``: setup, its agents' runs,
scoring by the task's rewards) with every agent played by the ``tether-chat`` harness (one chat completion, in
this process) as the model named ``tether`` at ``base_url``; on the host, without a sandbox. The last line on
stdout is the episode's reward: its trainable traces' reward (their mean where an environment has several). A
failed episode exits 1 with its errors on stderr.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys

HARNESS = "tether-chat"  # tether_chat.py, next to this file (on sys.path as the script's directory)
MODEL = "tether"  # what tether's endpoint calls its model (it answers to any name)


def read_episode(text: str) -> tuple[str, str, int, dict]:
    """(base_url, taskset id, task idx, taskset config) of the JSON tether sends; a malformed row is named."""
    episode = json.loads(text)
    row = episode.get("row")
    if not isinstance(row, dict) or not isinstance(row.get("taskset"), str) or not row["taskset"]:
        raise ValueError(f"the row must name a verifiers taskset id as 'taskset', got {row!r:.300}")
    idx = row.get("idx")
    if isinstance(idx, bool) or not isinstance(idx, int) or idx < 0:
        raise ValueError(f"the row's 'idx' must be a task's position in the taskset (an integer >= 0), "
                         f"got {idx!r}")
    config = row.get("taskset_config") or {}
    if not isinstance(config, dict):
        raise TypeError(f"the row's 'taskset_config' must be an object of TasksetConfig fields, "
                        f"got {config!r:.300}")
    return episode["base_url"], row["taskset"], idx, config


async def play(base_url: str, taskset_id: str, idx: int, taskset_config: dict) -> float:
    import verifiers.v1 as vf

    # every seat of the environment (one, "agent", for a plain taskset): the in-process harness, on the host
    seat = {"harness": {"id": HARNESS}, "runtime": {"type": "subprocess"}}
    roles = {name: seat for name, field in vf.env_config_type(taskset_id).model_fields.items()
             if isinstance(field.default, vf.AgentConfig)}
    env = vf.load_environment(vf.resolve_env_config({"taskset": {**taskset_config, "id": taskset_id},
                                                     **roles}))
    task = next(iter(env.taskset.include(idx=[idx])), None)
    if task is None:
        raise ValueError(f"verifiers taskset {taskset_id!r} has no task at idx {idx}")
    ctx = vf.ModelContext(model=MODEL,
                          client=vf.EvalClientConfig(base_url=base_url, api_key_var="OPENAI_API_KEY"))
    async with env.serving():
        episode = await env.run_episode(task, ctx)
    if not episode.ok:
        errors = [*episode.errors, *(e for trace in episode.traces for e in trace.errors)]
        why = "; ".join(f"{e.type}: {e.message}" for e in errors) or "no error recorded"
        raise RuntimeError(f"the episode of {taskset_id!r} task {idx} failed: {why}")
    trained = ([trace for trace in episode.traces if trace.agent is None or trace.agent.trainable]
               or episode.traces)
    return sum(trace.reward for trace in trained) / len(trained)


def main() -> None:
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    base_url, taskset_id, idx, taskset_config = read_episode(sys.stdin.read())
    print(asyncio.run(play(base_url, taskset_id, idx, taskset_config)))


if __name__ == "__main__":
    main()
