"""RolloutActor: holds one generation engine, emits RolloutBatch chunks stamped with its state."""

from __future__ import annotations

import threading
import time
from dataclasses import replace
from typing import TYPE_CHECKING

from actors.base import Answering, VersionedActor, starting_up, take_cpu_priority
from actors.engines import SamplingSettings, check_device, check_loaded, make_engine
from actors.specs import RolloutSpec
from services.devices import gpu_location
from services.model_source import as_source

if TYPE_CHECKING:  # the batch's module loads in the actor, not in the driver (services/experience.py)
    from actors.agents import AgentRunner, AgentSettings
    from actors.episodes import EpisodeLimits, EpisodeRunner
    from services.experience import RolloutBatch
    from services.weights import HostWeights


class RolloutActor(Answering, VersionedActor):
    role = "rollout"

    @starting_up()
    def __init__(self, index: int, spec: RolloutSpec) -> None:
        super().__init__(index)
        self.engine_kind = spec.engine.kind
        self.model_dir = model_dir = as_source(spec.model).resolve(f"rollout-{index}")
        self.episodes: EpisodeRunner | None = None  # multi-turn episodes: built on the first chunk
        self.agents: AgentRunner | None = None  # agent programs (rollout.agent): built on the first chunk
        self.max_model_len = spec.engine.max_model_len
        device = check_device(spec.engine.device, f"rollout-{index}")
        self.niceness = take_cpu_priority(device, engine=True)  # before vLLM starts its threads
        self.engine = make_engine(model_dir, replace(spec.engine, device=device))
        # in-flight updates: calls run on several threads and reach vLLM through one loop that steps it
        # (chunks of two batches share its steps); an agent runner serves one chunk at a time
        self.in_flight = spec.engine.in_flight != "off"
        if self.in_flight:
            from actors.engine_loop import InFlightEngine

            self.engine = InFlightEngine(self.engine, spec.engine.in_flight)
        self.runners_lock = threading.Lock()
        self.last_tokens_per_second: float | None = None  # no rate, and no gauge, before a generation

    def generate(self, prompts: list[list[int]], prompt_index: list[int], seeds: list[int],
                 sampling: SamplingSettings, pad_id: int,
                 group_index: list[int] | None = None) -> RolloutBatch:
        from services.experience import make_batch

        start = time.perf_counter()
        generations = self.engine.generate(prompts, sampling, seeds)
        seconds = time.perf_counter() - start
        self.busy_seconds += seconds
        tokens = sum(len(g.response_ids) for g in generations)
        self.last_tokens_per_second = tokens / max(seconds, 1e-9)
        return make_batch(
            prompts=prompts,
            responses=[g.response_ids for g in generations],
            logprobs=[g.logprobs for g in generations],
            finish_reasons=[g.finish_reason for g in generations],
            prompt_index=prompt_index,
            pad_id=pad_id,
            policy_version=self.policy_version,
            kl_coef=self.kl_coef,
            response_width=sampling.max_new_tokens,
            group_index=group_index,
            token_versions=[g.versions for g in generations] if self.in_flight else None,
        )

    def run_episodes(self, rows: list[dict], prompt_index: list[int], seeds: list[int],
                     sampling: SamplingSettings, pad_id: int, group_index: list[int] | None, workers: list,
                     limits: EpisodeLimits, first_worker: int = 0) -> RolloutBatch:
        """Multi-turn episodes with an environment, one per row, all advancing turn by turn together (one
        engine call per turn); the environments step on ``workers``. Every row is a whole trajectory of
        this engine's one policy version: the prompt, then the model's and the environment's tokens."""
        from actors.episodes import EpisodeRunner
        from services.models import load_tokenizer

        start = time.perf_counter()
        with self.runners_lock:
            if self.episodes is None:  # the failures it counts are this engine's, over the job
                self.episodes = EpisodeRunner(self.engine, load_tokenizer(self.model_dir), workers, limits)
            self.episodes.workers, self.episodes.limits = workers, limits
        episodes = self.episodes.run(rows, prompt_index, seeds, sampling, first_worker)
        return self._trajectory_batch(episodes, start, prompt_index, group_index, pad_id,
                                      limits.max_trajectory_tokens)

    def run_agents(self, rows: list[dict], prompt_index: list[int], seeds: list[int],
                   sampling: SamplingSettings, pad_id: int, group_index: list[int] | None,
                   settings: AgentSettings) -> RolloutBatch:
        """One agent episode per row, all at once, served by this engine through its OpenAI-compatible
        endpoint. Each trajectory of an episode's model calls is a row (calls merge into one when the next
        prompt extends the last call token for token); an episode's rows share its episode index and group,
        and its reward lands on the last model token of its last row (the learner lays the rows end to
        end)."""
        from actors.agents import AgentRunner
        from services.models import load_tokenizer

        start = time.perf_counter()
        with self.runners_lock:
            if self.agents is None:
                self.agents = AgentRunner(self.engine, load_tokenizer(self.model_dir), sampling,
                                          self.max_model_len, settings)
            trajectories = self.agents.run(rows, prompt_index, seeds)
        return self._trajectory_batch(trajectories, start, prompt_index, group_index, pad_id,
                                      settings.max_trajectory_tokens)

    def _trajectory_batch(self, trajectories: list, start: float, prompt_index: list[int],
                          group_index: list[int] | None, pad_id: int, width: int) -> RolloutBatch:
        """Trajectories (``Episode``s or ``AgentRow``s) as a batch stamped with this engine's state; each
        row keeps the prompt row and group of the episode it came from."""
        from services.experience import Episodes, make_batch

        seconds = time.perf_counter() - start
        self.busy_seconds += seconds
        self.last_tokens_per_second = sum(sum(t.action_mask) for t in trajectories) / max(seconds, 1e-9)
        return make_batch(
            prompts=[t.prompt for t in trajectories], responses=[t.ids for t in trajectories],
            logprobs=[t.logprobs for t in trajectories],
            finish_reasons=[t.finish_reason for t in trajectories],
            prompt_index=[prompt_index[t.episode] for t in trajectories], pad_id=pad_id,
            policy_version=self.policy_version, kl_coef=self.kl_coef, response_width=width,
            group_index=None if group_index is None else [group_index[t.episode] for t in trajectories],
            action_masks=[t.action_mask for t in trajectories],
            episode_index=[t.episode for t in trajectories],
            episodes=Episodes([t.turn_rewards for t in trajectories], [t.turns for t in trajectories],
                              [t.tool_calls for t in trajectories], [t.seconds for t in trajectories],
                              [t.failures for t in trajectories]),
            token_versions=[t.versions for t in trajectories] if self.in_flight else None)

    def take_counts(self) -> dict[str, float]:
        if self.in_flight:  # its calls overlap (two batches, an evaluation): the engine loop's own busy time
            self.busy_seconds, self.engine.loop.busy_seconds = self.engine.loop.busy_seconds, 0.0
        return super().take_counts()

    def takes_adapters(self) -> bool:
        """learner.lora: whether this engine loads the adapter alone at each sync (else the merged
        weights)."""
        return self.engine.takes_adapters

    def update_weights(self, weights: HostWeights, policy_version: int, kl_coef: float) -> float:
        """Load new weights in place (or a LoRA adapter: ``weights.adapter_config``) and take their version;
        returns the seconds it took."""
        start = time.perf_counter()
        # over the object store's bytes: loaded, then let go
        if weights.adapter_config is not None:
            self.engine.load_adapter(weights.tensors(), weights.adapter_config, policy_version)
        else:
            check_loaded(self.engine.load_weights(weights.tensors(), policy_version),
                         f"{self.role}-{self.index}", f"the sync of version {policy_version}")
        self.set_state(policy_version, kl_coef)
        return time.perf_counter() - start

    # vLLM's weight transfer (GPU): learner.weight_transfer.EngineClient drives these four, in order
    def gpu_location(self) -> tuple[str, list[str]]:
        """(node id, GPU ids): learner.weight_sync='ipc' checks that this engine shares a learner GPU."""
        return gpu_location()

    def init_weight_transfer(self, init_info: dict) -> None:
        """This engine's side of vLLM's weight transfer (NCCL: join the learner's group; collective)."""
        self.engine.init_weight_transfer(init_info)

    def start_weight_transfer(self) -> None:
        self.engine.start_weight_transfer()

    def receive_weight_transfer(self, update_info: dict) -> None:
        """Receive what learner rank 0 sends now (NCCL: runs while it broadcasts) and load it."""
        self.engine.receive_weight_transfer(update_info)

    def finish_weight_transfer(self, version: int | None = None) -> None:
        """Load what was received; the engine takes ``version`` once every parameter is loaded."""
        check_loaded(self.engine.finish_weight_transfer(), f"{self.role}-{self.index}", "the weight transfer")
        if version is not None:
            self.engine.set_weight_version(version)

    def probe(self, sequences: list[list[int]], prompt_lengths: list[int]) -> list[list[float]]:
        """The engine's log-probs of given sequences, to compare with the learner's after a sync."""
        return self.engine.score(sequences, prompt_lengths)

    def stats(self) -> dict:
        failures = sum(runner.failures for runner in (self.episodes, self.agents) if runner is not None)
        return {**self.get_state(), "tokens_per_second": self.last_tokens_per_second,
                # what task.environment_max_failures (rollout.agent_max_failures) bounds
                "episode_failures": failures}
