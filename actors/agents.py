"""Agent programs on one rollout engine (``rollout.agent``): each episode's agent talks to the policy through
the engine's OpenAI-compatible endpoint (``actors/agent_endpoint.py``), which records every token it was
given and sampled. Each trajectory of an episode's calls becomes a training row with the episode's index; the
episode's reward lands on the last model token of its last row, once, as on one trajectory (the learner lays
the rows end to end: ``learner.algorithm.EpisodeView``). A failed episode is generated again, and counted.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from actors.engines import Engine, SamplingSettings
from services.environments.base import EnvironmentFailure


class AgentFailure(EnvironmentFailure):
    """An agent episode that raised, timed out, returned no number or made no model call, past
    ``rollout.agent_max_failures``."""

    def __init__(self, environment: str, reason: str, row: int | None = None, turn: int | None = None):
        super().__init__(environment, reason, row, turn)
        RuntimeError.__init__(self, f"agent {environment!r} failed at row {row}: {reason}")


@dataclass(frozen=True)
class AgentSettings:
    """``rollout.agent``, ``rollout.agent_timeout_s``, ``rollout.agent_max_failures`` and
    ``rollout.max_trajectory_tokens``."""

    agent: str
    timeout_s: float
    max_failures: int
    max_trajectory_tokens: int


@dataclass
class AgentRow:
    """One trajectory of an episode's model calls, as a row of the batch."""

    episode: int  # index of its episode's row in the chunk
    prompt: list[int]
    ids: list[int]
    action_mask: list[int]
    logprobs: list[float]
    finish_reason: int  # FINISH_LENGTH also when cut at rollout.max_trajectory_tokens
    turn_rewards: list[float] = field(default_factory=list)
    # each model token's version (in-flight updates), else -1
    versions: list[int] = field(default_factory=list)
    turns: int = 0  # the model calls merged into the row
    tool_calls: int = 0
    failures: int = 0
    seconds: float = 0.0  # environment seconds: an agent's own time is not told apart from the engine's


class AgentRunner:
    """The engine's endpoint (started on first use) and the agent function; ``run`` gives a chunk's rows."""

    def __init__(self, engine: Engine, tokenizer, sampling: SamplingSettings, max_model_len: int,
                 settings: AgentSettings) -> None:
        from actors.agent_endpoint import AgentEndpoint, load_agent

        self.settings, self.tokenizer = settings, tokenizer
        self.agent = load_agent(settings.agent)
        self.endpoint = AgentEndpoint(engine, tokenizer, sampling, max_model_len).start()
        self.failures = 0  # over the engine's life: the job fails past settings.max_failures

    def run(self, rows: list[dict], row_index: list[int], seeds: list[int]) -> list[AgentRow]:
        """Every episode to a reward; those that failed are run again with another seed until they succeed."""
        from actors.agent_endpoint import run_agents

        results: list = [None] * len(rows)
        failures = [0] * len(rows)
        pending, attempt = list(range(len(rows))), 0
        while pending:
            seeds_now = [(seeds[i] + 7_919 * attempt) % (2**31 - 1) for i in pending]
            outcomes = asyncio.run(run_agents(self.endpoint, self.agent, [rows[i] for i in pending],
                                              seeds_now, self.settings.timeout_s))
            failed = []
            for i, outcome in zip(pending, outcomes, strict=True):
                error = outcome.error or (None if outcome.calls else "made no model call")
                if error is None:
                    results[i] = outcome
                    continue
                self.failures += 1
                failures[i] += 1
                failed.append(i)
                if self.failures > self.settings.max_failures:
                    raise AgentFailure(self.settings.agent, f"{error} ({self.failures} failed episodes on "
                                       "this engine, more than rollout.agent_max_failures="
                                       f"{self.settings.max_failures})", row_index[i])
            pending, attempt = failed, attempt + 1
        return [row for i, outcome in enumerate(results) for row in self._rows(i, outcome, failures[i])]

    def _rows(self, episode: int, outcome, failures: int) -> list[AgentRow]:
        from actors.agent_endpoint import merge_calls, parse_tool_calls
        from services.experience import FINISH_LENGTH

        limit = self.settings.max_trajectory_tokens
        tool_calls = sum(len(parse_tool_calls(self.tokenizer.decode(c.completion_ids,
                                                                    skip_special_tokens=True))[1])
                         for c in outcome.calls)
        rows = []
        trajectories = merge_calls(outcome.calls)
        # the last row with a model token gets the episode's reward, on that token
        masks = [t.action_mask[:limit] for t in trajectories]
        rewarded = max((n for n, mask in enumerate(masks) if any(mask)), default=None)
        for n, (trajectory, mask) in enumerate(zip(trajectories, masks, strict=True)):
            cut = len(trajectory.ids) > limit
            rewards = [0.0] * len(mask)
            if n == rewarded:
                rewards[max(t for t, sampled in enumerate(mask) if sampled)] = outcome.reward
            rows.append(AgentRow(episode, trajectory.prompt_ids, trajectory.ids[:limit], mask,
                                 trajectory.logprobs[:limit],
                                 FINISH_LENGTH if cut else trajectory.finish_reason,
                                 rewards, trajectory.versions[:limit], trajectory.calls,
                                 tool_calls if n == 0 else 0, failures if n == 0 else 0))
        return rows
