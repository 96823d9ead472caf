"""One learner rank as a Ray actor: a thin shell over its training engine (``learner.engine.DeepSpeedEngine``)
and the update (``learner.update``). It joins its peers' process group (without the ``deepspeed`` launcher),
fetches its chunks by their refs as they arrive, runs the update on what it collected, and hands out weights,
probes and checkpoints. Every statistic it returns is a sum, so the driver's are exact over all ranks."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from actors.base import lost_to_dead_actor, starting_up, take_cpu_priority
from learner import rank_checkpoint
from learner.plan import RankSpec
from learner.policy_model import join_rendezvous, rendezvous_address
from learner.records import Admission, ChunkRefs, RankUpdate
from learner.update import RankScoring, collect_chunk, evaluation_kl_sums, update
from services.cpu_share import ThreadClock

if TYPE_CHECKING:  # the batch's module loads in the rank, not in the driver (services/experience.py)
    from services.experience import RolloutBatch


class LearnerRank:
    def __init__(self, rank: int, world_size: int) -> None:
        self.rank, self.world_size, self.engine = rank, world_size, None

    def address(self) -> tuple[str, int]:
        """This node's IP and a free port, for rank 0 to serve as the rendezvous."""
        return rendezvous_address()

    @starting_up()
    def setup(self, master_addr: str, master_port: int, spec: RankSpec) -> int:
        """The engine of ``spec`` joined to rank 0's rendezvous at ``master_addr:master_port``. On a live rank
        it sets the rank up for another job: the process group (and its timeout) stay. Returns the rank's
        niceness (``take_cpu_priority``)."""
        from actors.reference import ReferenceModel
        from actors.reward import RewardScorer
        from learner.engine import DeepSpeedEngine
        from services.model_source import as_source

        learner, where = spec.learner, f"learner-rank-{self.rank}"
        if self.engine is not None:
            if learner.collective_timeout_s != self.learner.collective_timeout_s:
                raise ValueError(f"learner rank {self.rank} was set up with learner.collective_timeout_s="
                                 f"{self.learner.collective_timeout_s:g}, which its process group keeps; got "
                                 f"{learner.collective_timeout_s:g}: start new ranks for it")
            import gc

            self.engine = None
            gc.unfreeze()  # the last set-up froze the engine (starting_up): its cycles can go now
        self.learner, self.algorithm, self.settings = learner, spec.algorithm, spec.update
        device = join_rendezvous(self.rank, self.world_size, master_addr, master_port, spec.device, where)
        niceness = take_cpu_priority(device.type)
        if spec.torch_threads:
            torch.set_num_threads(spec.torch_threads)
        # the model's files on this rank's node: a shared path, the HF cache, or shipped by the driver
        self.model_dir = as_source(spec.model).resolve(where)
        self.engine = DeepSpeedEngine.build(self.model_dir, spec, self.rank, self.world_size, device)
        self.single_step = self.settings.single_step(spec.algorithm.off_policy)
        # what it scores itself: its copy of the initial policy (a resume loads the engine alone), the reward
        reference = spec.reference and ReferenceModel(spec.reference, str(device), where)
        rewarder = spec.reward and RewardScorer(spec.reward, "cpu", where)
        self.scoring = RankScoring(self.engine, reference, rewarder)
        self.collected: dict[int, RolloutBatch] = {}  # slot -> chunk, filled by ``collect_chunk``
        self.version: int | None = None  # the learner's version at the last collect, when the driver said
        self.timings: dict[str, float] = {}
        self.cpu_clock = ThreadClock()
        self.cpu_clock.take(["self"])
        return niceness

    def cpu_seconds(self) -> tuple[float, float]:
        """This rank's CPU seconds, and its seconds ready to run but waiting for a core, since the last
        call."""
        return self.cpu_clock.take(["self"])

    def collect(self, slots: list[int], chunks: list[ChunkRefs], admission: Admission | None = None) -> dict:
        """Fetch this rank's chunks in order and run ``collect_chunk`` on each as it arrives (overlapping the
        generation of later ones). ``failed``: the slots to regenerate, lost to a dead actor or with rows
        ``admission`` refuses. Any other error (a reward function that raised, NaN) ends the job."""
        import ray

        failed, wait, start = [], 0.0, time.perf_counter()
        self.version = admission.policy_version if admission is not None else None
        with self.engine.lockstep(self.scoring.engine_forwards(chunks, self.single_step)):
            for slot, refs in zip(slots, chunks, strict=True):
                t0, scored = time.perf_counter(), refs.scored()
                try:
                    chunk, *values = ray.get([refs.rollout, *scored.values()])
                except Exception as err:
                    if not lost_to_dead_actor(err):
                        raise
                    failed.append(slot)
                    continue
                finally:
                    wait += time.perf_counter() - t0
                if admission is not None and admission.refuses(chunk.policy_version, chunk.kl_coef).any():
                    failed.append(slot)
                    continue
                scored = dict(zip(scored, values, strict=True))
                collect_chunk(self.engine, self.scoring, chunk, slot, self.single_step, scored.get("score"),
                              scored.get("reference"), scored.get("teacher"))
                self.collected[slot] = chunk
        forward = time.perf_counter() - start - wait
        self.timings["wait_seconds"] = self.timings.get("wait_seconds", 0.0) + wait
        self.timings["forward_seconds"] = self.timings.get("forward_seconds", 0.0) + forward
        return {"failed": failed, "collected": len(self.collected)}

    def update(self, kl_coef: float, iteration: int) -> RankUpdate:
        """``learner.update.update`` on everything collected."""
        batch = self._collected_batch()
        timings, self.collected, self.timings = self.timings, {}, {}
        result = update(self.engine, self.algorithm, self.settings, batch, kl_coef, iteration, self.version)
        result.timings = timings | result.timings
        return result

    def differing_groups(self) -> int:
        """Dynamic sampling: the whole groups this rank holds whose scores differ (penalties applied)."""
        return self.algorithm.differing_groups(self._collected_batch()) if self.collected else 0

    def _collected_batch(self) -> RolloutBatch:
        from services.experience import concat_batches

        return concat_batches([self.collected[slot] for slot in sorted(self.collected)])

    def evaluation_kl(self, chunks: list[ChunkRefs]) -> dict:
        """``learner.update.evaluation_kl_sums`` over evaluation chunks: on-policy in every mode."""
        import ray

        sums: dict[str, float] = {}
        with self.engine.lockstep(self.scoring.engine_forwards(chunks, single_step=False)):
            for refs in chunks:
                ref = ray.get(refs.reference) if refs.reference is not None else None
                part = evaluation_kl_sums(self.engine, self.scoring, ray.get(refs.rollout), ref)
                sums = {k: sums.get(k, 0.0) + v for k, v in part.items()}
        return sums

    def evaluate_rewards(self, chunk_refs: list, slots: list[int], keep: int) -> list[tuple[int, dict]]:
        """reward.placement learner: (slot, eval metrics and first samples) of each evaluation chunk."""
        import ray

        return [(slot, self.scoring.rewarder.evaluate(ray.get(ref), slot, keep))
                for ref, slot in zip(chunk_refs, slots, strict=True)]

    def policy_state_dict(self, dtype: str | None = None, adapter: bool = False) -> list | None:
        """[ObjectRef of the full policy weights as ``HostWeights`` in ``dtype`` (default: the learner's),
        their bytes] on rank 0, None elsewhere; ``adapter``: LoRA's adapter alone. Collective under ZeRO-3."""
        import ray

        with self.engine.gathered():  # ray.put copies the bytes inside: the parameters move on after
            lora = self.learner.lora.rank > 0
            weights = self.engine.policy_weights(dtype or self.learner.dtype, adapter, lora)
            return None if weights is None else [ray.put(weights), weights.nbytes]

    def weight_metadata(self) -> list[tuple[str, str, list[int]]]:
        """``[(name, dtype, full HF shape)]`` of what the engines receive (no collective)."""
        from learner.weight_transfer import announced_parameters

        return announced_parameters(self.engine.lm)

    def gpu_location(self) -> tuple[str, list[str]]:
        from services.devices import gpu_location

        return gpu_location()

    def init_weight_transfer(self, backend: str, rollouts: list, workers_per_engine: int, master_addr: str,
                             master_port: int, buffer_bytes: int, timeout_s: float) -> None:
        """vLLM's trainer-side weight-transfer engine; rank 0 also sets up the engines' side."""
        from learner.weight_transfer import trainer_engine

        self.weight_transfer, self.engine_client = trainer_engine(
            self.engine.lm, self.engine.zero3, backend, self.rank, rollouts, workers_per_engine, master_addr,
            master_port, buffer_bytes, timeout_s)

    def send_weights(self, policy_version: int) -> None:
        """Full weights to every engine, which take them as ``policy_version``; every rank calls it (ZeRO-3
        gathers each parameter from all)."""
        self.engine_client.version = policy_version
        self.weight_transfer.send_weights()

    def probe_logprobs(self, sequences: list[list[int]], prompt_lengths: list[int]) -> list | None:
        """Rank 0's log-probs of given sequences at temperature 1, None elsewhere. Collective under ZeRO-3."""
        logprobs = self.engine.sequence_logprobs(sequences, prompt_lengths)
        return logprobs if self.rank == 0 else None

    def save_checkpoint(self, storage_url: str) -> dict:
        """This rank's DeepSpeed files under ``learner/`` of ``storage_url``: {path: {sha256, bytes}}."""
        return rank_checkpoint.save(self.engine.engine, self.rank, storage_url)

    def load_checkpoint(self, storage_url: str, manifest: dict, saved_world_size: int) -> None:
        """This rank's DeepSpeed state from ``storage_url``, each file checked against ``manifest``."""
        rank_checkpoint.load(self.engine.engine, self.rank, self.world_size, storage_url, manifest,
                             saved_world_size)

    def export_hf(self, storage_url: str) -> None:
        """The policy as a Hugging Face model directory at ``storage_url`` (collective under ZeRO-3)."""
        rank_checkpoint.export_hf(self.engine.lm, self.rank, self.engine.zero3, self.learner.lora.rank > 0,
                                  self.model_dir, storage_url)
