"""One DeepSpeed ZeRO rank of the learner, run as a Ray actor without the ``deepspeed`` launcher.

Each rank fetches its shard of chunk refs itself, recomputes old log-probs (and values, with a critic),
builds KL-penalised rewards at the current beta, computes advantages (``ppo.advantage``: GAE or a
critic-free estimator) and runs the PPO epochs, and returns additive sums so the driver's statistics are
exact over the whole batch.
"""

from __future__ import annotations

import os
import time
from datetime import timedelta
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from actors.base import lost_to_dead_actor, starting_up, yield_cpu_to_engines
from learner import rank_checkpoint
from learner.algorithm import episode_view
from learner.lora import adapter_state, merged_state_dict
from learner.plan import RankSpec
from learner.policy_model import PolicyWithValueHead, local_gpu_index
from learner.ppo import (
    DistributedReducer,
    explained_variance_moments,
    ppo_stats_from_sums,
    scheduled_lr,
)
from learner.rank_scoring import ScoresInRank
from learner.results import RankUpdate
from services.config import LearnerConfig
from services.logprobs import token_logprobs
from services.model_source import as_source

if TYPE_CHECKING:  # the batch's module loads in the rank, not in the driver (services/experience.py)
    from services.experience import RolloutBatch


class LearnerRank(ScoresInRank):
    def __init__(self, rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size

    def address(self) -> tuple[str, int]:
        """This node's IP and a free port, for rank 0 to serve as the rendezvous."""
        import socket

        import ray

        with socket.socket() as s:
            s.bind(("", 0))
            return ray.util.get_node_ip_address(), s.getsockname()[1]

    @starting_up()
    def setup(self, master_addr: str, master_port: int, spec: RankSpec) -> int:
        """The DeepSpeed engine of ``spec`` (``RankSpec.of``), joined to rank 0's rendezvous at
        ``master_addr:master_port``. Called again on a live rank, it sets the rank up for another job."""
        model, learner_cfg, algorithm, device = spec.model, spec.learner, spec.algorithm, spec.device
        temperature, seed, run_iterations = spec.temperature, spec.seed, spec.run_iterations
        rollout_batch_size, rows_per_episode_vary = spec.rollout_batch_size, spec.rows_per_episode_vary
        if getattr(self, "engine", None) is not None:
            self._set_up_again(learner_cfg)
        else:
            self.collective_timeout_s = learner_cfg.collective_timeout_s
        # LOCAL_RANK is the GPU DeepSpeed and NCCL take, as CUDA numbers them in this process: Ray shows each rank
        # only its own GPUs (CUDA_VISIBLE_DEVICES), so it is 0 unless every GPU stays visible here
        self.local_gpu = 0
        if device == "cuda":
            import ray

            self.local_gpu = local_gpu_index(ray.get_runtime_context().get_accelerator_ids().get("GPU", []),
                                             os.environ.get("CUDA_VISIBLE_DEVICES"), f"learner-rank-{self.rank}")
        os.environ.update(MASTER_ADDR=master_addr, MASTER_PORT=str(master_port), RANK=str(self.rank),
                          WORLD_SIZE=str(self.world_size), LOCAL_RANK=str(self.local_gpu))
        import deepspeed

        from actors.engines import check_device

        world_size = self.world_size
        ppo_cfg = algorithm.ppo
        self.algorithm, self.ppo, self.learner = algorithm, ppo_cfg, learner_cfg
        self.temperature = temperature
        self.seed = seed
        self.run_iterations = run_iterations
        # DAPO's dynamic sampling: this rank trains on its share of the batch in whole groups whose scores differ
        self.rollout_batch_size = rollout_batch_size
        if algorithm.dynamic_sampling and rollout_batch_size is None:
            raise ValueError("dynamic sampling needs rollout_batch_size: each rank keeps its share of the batch")
        # rollout.agent: an episode gives one row per trajectory its model calls make, so a rank's rows vary; the
        # optimizer steps per epoch are counted in episodes then, the same on every rank (collectives in step)
        self.rows_per_episode_vary = rows_per_episode_vary
        self.minibatches = (rollout_batch_size or ppo_cfg.minibatch_size) // ppo_cfg.minibatch_size
        # rollout.mode async: rows may be a few versions old; the engine's log-probs are the behaviour policy
        off_policy = algorithm.off_policy
        # one optimizer step per batch (one epoch, one minibatch): the policy that generated the rows is the
        # one that takes the step, so the step's own forward gives the old log-probs and values exactly, and
        # collect runs none (what TRL's GRPO does at num_iterations=1). Packed, the step's forward runs its
        # micro-batches one after another and keeps their graphs for the one backward; not under ZeRO-3, whose
        # parameter gathers expect a backward after each forward
        self.single_step = (rollout_batch_size is not None and not off_policy and ppo_cfg.epochs == 1
                            and ppo_cfg.minibatch_size == rollout_batch_size and not rows_per_episode_vary
                            and not (learner_cfg.max_tokens_per_microbatch and learner_cfg.zero_stage == 3))
        on_gpu = check_device(device, f"learner-rank-{self.rank}") == "cuda"
        yield_cpu_to_engines("cuda" if on_gpu else "cpu")
        if spec.torch_threads:
            torch.set_num_threads(spec.torch_threads)
        if not on_gpu:
            # the shared-memory allreduce op costs an ~80 s JIT build and gloo needs none of it
            deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
        # rendezvous and every later collective give up after this, instead of hanging
        deepspeed.init_distributed(dist_backend="nccl" if on_gpu else "gloo", auto_mpi_discovery=False,
                                   timeout=timedelta(seconds=learner_cfg.collective_timeout_s))
        self.device = torch.device("cuda", self.local_gpu) if on_gpu else torch.device("cpu")

        from services.models import load_causal_lm

        # the model's files on this rank's node: a shared path, the HF cache, or shipped by the driver
        self.model_dir = as_source(model).resolve(f"learner-rank-{self.rank}")
        torch.manual_seed(seed)  # same value-head init on every rank
        # fp32 master weights; with learner.dtype bfloat16 DeepSpeed trains a bf16 copy of them
        # the critic (value head, or a separate LM) exists only for GAE
        self.has_critic = algorithm.has_critic
        separate = self.has_critic and learner_cfg.critic == "separate"
        critic = load_causal_lm(self.model_dir, "float32") if separate else None
        lm = load_causal_lm(self.model_dir, "float32")
        self.lora = learner_cfg.lora.rank > 0
        if self.lora:  # learner.lora: only the adapters train (and a value head or critic, when there is one)
            from learner.lora import add_adapters

            lm = add_adapters(lm, learner_cfg.lora)
        model = PolicyWithValueHead(lm, critic, value_head=self.has_critic)
        from torch.optim import AdamW

        # on CPU torch's default AdamW steps one tensor at a time: fused, a randomwalks GPT-2 step takes 1.1 ms
        # instead of 3.5 (on CUDA its default, foreach, is kept)
        self.trained_parameters = [p for p in model.parameters() if p.requires_grad]
        optimizer = AdamW(self.trained_parameters, lr=ppo_cfg.lr,
                          betas=tuple(ppo_cfg.adam_betas), weight_decay=ppo_cfg.weight_decay, eps=1e-8,
                          fused=None if on_gpu else True)
        micro = ppo_cfg.minibatch_size // world_size
        # fp32 without ZeRO: each step clips the gradients itself (``_ppo_epochs``), which gives their norm for
        # the metric once; DeepSpeed's own clipping would compute it a second time
        self.clips_itself = not learner_cfg.zero_stage and learner_cfg.dtype == "float32"
        ds_config = {
            "train_micro_batch_size_per_gpu": micro,
            "gradient_accumulation_steps": 1,
            "train_batch_size": micro * world_size,
            "gradient_clipping": 0.0 if self.clips_itself else ppo_cfg.max_grad_norm,
            "zero_optimization": {"stage": learner_cfg.zero_stage},
            "zero_allow_untested_optimizer": True,
            "bf16": {"enabled": learner_cfg.dtype == "bfloat16"},
            "steps_per_print": 10**9,
            "wall_clock_breakdown": False,
        }
        self.engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
        if self.clips_itself and world_size == 1:  # one rank: DeepSpeed's all-reduce of the gradients is a copy
            self.engine.enable_backward_allreduce = False
        if learner_cfg.max_tokens_per_microbatch:  # packed forwards rely on the model masking across sequences
            from services.packing_check import check_packing_isolation

            check_packing_isolation(self.engine.module.lm, self.engine.module.lm.config.vocab_size,
                                    f"learner-rank-{self.rank}")
        self._set_up_scoring(spec, str(self.device))  # what this rank scores itself: reference, reward (or neither)
        self.reducer = DistributedReducer(self.device)  # the algorithm layer's collectives: over every rank
        self.updates = 0
        self.collected: dict[int, RolloutBatch] = {}  # slot -> chunk with its old_logprobs, old_values, ref_logprobs, scores
        self.forward_version: int | None = None  # the version of the last collect's forwards, when the driver said
        self.timings: dict[str, float] = {}
        return self.rank

    def _set_up_again(self, learner_cfg: LearnerConfig) -> None:
        """A second set-up on this process (a group set up again on its ranks, ``LearnerGroup(ranks=...)``):
        the process group stays, so its timeout must too; the last engine goes."""
        import gc

        if learner_cfg.collective_timeout_s != self.collective_timeout_s:
            raise ValueError(f"learner rank {self.rank} was set up with learner.collective_timeout_s="
                             f"{self.collective_timeout_s:g}, which its process group keeps; got "
                             f"{learner_cfg.collective_timeout_s:g}: start new ranks for it")
        self.engine = self.collected = None
        gc.unfreeze()  # the last set-up froze the engine (starting_up): its reference cycles can go now

    # ------------------------------------------------------------------ one PPO update on this rank's shard

    def collect(self, slots: list[int], chunk_refs: list, ref_logprob_refs: list, score_refs: list,
                forwards: int | None = None, expected_state: tuple | None = None,
                teacher_logprob_refs: list | None = None) -> dict:
        """Fetch this rank's chunks and run the no-grad forward (old log-probs and values) on each.

        Chunk by chunk, in order, so the forward on one chunk overlaps generation of the later ones.
        A chunk lost to a dead actor is reported in ``failed`` for the driver to regenerate; any other
        error (a reward function that raised, NaN) ends the job.

        ``forwards``: how many forwards every rank runs this round (the most slots any rank got). Under
        ZeRO-3 a forward gathers parameters from all ranks, so a rank whose chunk was lost, or that got
        fewer slots, runs a throw-away forward on a one-token batch for each missing one.

        ``expected_state``: the driver's (policy_version, kl_coef), and in async mode (policy_version, None,
        max_staleness): ``stale_rows``' arguments. A chunk with rows stamped otherwise (its engine restarted
        after the driver's version check, or it is too stale) is reported in ``failed`` too, never trained on.

        ``teacher_logprob_refs``: on-policy distillation's teacher log-probs of each chunk (distill.teacher_path).
        """
        import ray

        from services.experience import stale_rows

        failed, wait, start = [], 0.0, time.perf_counter()
        ran = 0
        self.forward_version = expected_state[0] if expected_state is not None else None  # this round's weights
        teacher_refs = teacher_logprob_refs if teacher_logprob_refs is not None else [None] * len(slots)
        # no reference actor: this rank scores the reference, its own copy or LoRA's base (an engine forward)
        ref_refs = ref_logprob_refs if ref_logprob_refs is not None else [None] * len(slots)
        score_refs = score_refs if score_refs is not None else [None] * len(slots)  # reward.placement learner
        forwards_per_chunk = (0 if self.single_step else 1) + (ref_logprob_refs is None and self.reference is None)
        for slot, chunk_ref, ref_ref, score_ref, teacher_ref in zip(slots, chunk_refs, ref_refs, score_refs,
                                                                    teacher_refs, strict=True):
            t0 = time.perf_counter()
            try:
                chunk, *scored = ray.get([chunk_ref] + [r for r in (score_ref, ref_ref, teacher_ref) if r is not None])
            except Exception as err:
                if not lost_to_dead_actor(err):
                    raise
                failed.append(slot)
                continue
            finally:
                wait += time.perf_counter() - t0
            if expected_state is not None and bool(stale_rows(chunk, *expected_state).any()):
                failed.append(slot)
                continue
            chunk_scores = scored.pop(0) if score_ref is not None else self.rewarder.score(chunk, slot)
            if not self.single_step:
                chunk.old_logprobs, chunk.old_values, _ = self._forward(chunk, grad=False)
            chunk.ref_logprobs = scored.pop(0) if ref_ref is not None else self._reference_logprobs(chunk)
            chunk.scores, chunk.teacher_logprobs = chunk_scores, scored.pop(0) if teacher_ref is not None else None
            ran += forwards_per_chunk
            self.collected[slot] = chunk
        if self.learner.zero_stage == 3 and forwards_per_chunk:
            wanted = (forwards if forwards is not None else len(slots)) * forwards_per_chunk
            if ran > wanted:
                raise ValueError(f"rank {self.rank}: ran {ran} forwards but the round has only {wanted}")
            for _ in range(wanted - ran):
                self._forward(_placeholder_batch(), grad=False)  # keeps the ZeRO-3 gathers in step
        self.timings["wait_seconds"] = self.timings.get("wait_seconds", 0.0) + wait
        self.timings["forward_seconds"] = self.timings.get("forward_seconds", 0.0) + time.perf_counter() - start - wait
        return {"failed": failed, "collected": len(self.collected)}

    def evaluation_kl(self, chunk_refs: list, ref_logprob_refs: list | None, forwards: int) -> dict:
        """``kl_sums`` (k1, per episode) of the current policy against the reference on evaluation chunks: this
        rank's log-probs of samples the engines drew with the same weights, so the KL is on-policy in every mode.
        ``forwards``: the most chunks any rank got; under ZeRO-3 a rank with fewer joins with placeholders."""
        import ray

        from learner.kl import kl_sums

        ref_refs = ref_logprob_refs if ref_logprob_refs is not None else [None] * len(chunk_refs)
        per_chunk = 1 + (ref_logprob_refs is None and self.reference is None)
        sums: dict[str, float] = {}
        for chunk_ref, ref_ref in zip(chunk_refs, ref_refs, strict=True):
            chunk = ray.get(chunk_ref)
            logprobs, _, _ = self._forward(chunk, grad=False)
            ref = ray.get(ref_ref) if ref_ref is not None else self._reference_logprobs(chunk)
            view, mask = episode_view(chunk), chunk.action_mask
            part = kl_sums(view.merge(logprobs * mask), view.merge(ref * mask), view.merge(mask), "k1")
            sums = {k: sums.get(k, 0.0) + v for k, v in part.items()}
        if self.learner.zero_stage == 3:
            for _ in range((forwards - len(chunk_refs)) * per_chunk):
                self._forward(_placeholder_batch(), grad=False)  # keeps the ZeRO-3 gathers in step
        return sums

    def update(self, kl_coef: float, iteration: int) -> RankUpdate:
        """The algorithm layer on everything collected (the controller's statistic, KL-penalised rewards at
        ``kl_coef``, advantages), then the PPO epochs; returns additive sums so the driver's statistics are exact
        over all ranks."""
        from services.experience import concat_batches, in_flight_sums, sequence_lengths, stale_tokens

        algorithm = self.algorithm
        batch = concat_batches([self.collected[slot] for slot in sorted(self.collected)])
        timings, self.collected, self.timings = self.timings, {}, {}
        t0 = time.perf_counter()
        group_counts, dropped = {}, None
        if algorithm.dynamic_sampling:  # DAPO: this rank's share of the batch, in whole groups whose scores differ
            share = self.rollout_batch_size // (self.world_size * algorithm.samples_per_prompt)
            keep, group_counts = algorithm.select(batch, share)
            dropped, batch = batch[(~keep).nonzero().squeeze(-1)], batch[keep.nonzero().squeeze(-1)]
            if self.single_step:  # no forward has run on the dropped rows: the statistic needs their log-probs
                self._forward_dropped(dropped)
        step_forward = None
        if self.single_step:  # the one step's forward, before any update: the old log-probs and values too
            step_forward = self._forward(batch, grad=True)
            batch.old_logprobs = step_forward[0].detach().cpu()
            batch.old_values = step_forward[1].detach().cpu() if step_forward[1] is not None else None
        # the controller's statistic over every episode sampled, the dropped groups' too: not a selection on scores
        sums = algorithm.controller_sums(batch, dropped)
        mask = batch.action_mask  # the model's tokens; prepare may take the truncated rows out of the loss's
        sums |= algorithm.prepare(batch, kl_coef, self.reducer)

        lr = scheduled_lr(self.ppo.lr, self.ppo.lr_schedule, iteration, self.run_iterations)
        for group in self.engine.optimizer.param_groups:  # after any checkpoint load: the schedule decides
            group["lr"] = lr
        ppo_sums = self._ppo_epochs(batch, kl_coef, iteration, step_forward)
        if self.has_critic:  # values before the update against their targets, as CleanRL logs it
            ppo_sums["explained_variance_moments"] = explained_variance_moments(batch.old_values * mask, batch.returns,
                                                                                mask).tolist()
        timings["update_seconds"] = time.perf_counter() - t0
        self.updates += 1

        old_logprobs, behaviour = batch.old_logprobs * mask, batch.rollout_logprobs * mask
        mismatch = (old_logprobs - behaviour).abs() * mask
        # rows an older version generated (async): their mismatch is mostly the policy's move since, reported
        # apart from the engine-learner numeric difference, which only rows of the learner's version measure
        version = self.forward_version
        stale = stale_tokens(batch, mask, version)
        sums.update({
            "length_sum": float(mask.sum()),
            # the tokens a forward of these rows runs: the real ones, and in the padded [B, P + T] layout
            "forward_tokens_real": float(sequence_lengths(batch).sum()),
            "forward_tokens_padded": float(batch.shape[0] * (batch.prompt_ids.shape[1] + batch.response_ids.shape[1])),
            "mismatch_abs_sum": float(mismatch.sum()),  # all rows: the stale rows' share is apart below
            "mismatch_max": float((mismatch * (1 - stale)).max()) if mask.any() else 0.0,  # same-version rows
            "stale_tokens": float(stale.sum()),
            "stale_mismatch_abs_sum": float((mismatch * stale).sum()),
            **algorithm.correction_sums(batch, stale),
            # no critic: no values and no returns (the driver's value_mean is nan)
            "value_sum": float((batch.old_values * mask).sum()) if self.has_critic else float("nan"),
            "return_sum": float((batch.returns * mask).sum()) if batch.returns is not None else float("nan"),
        })
        sums.update({f"dynamic_sampling_{name}_groups": float(count) for name, count in group_counts.items()})
        sums.update(in_flight_sums(batch, mask, version))
        if batch.num_turns is not None:  # multi-turn episodes: what the environment added
            sums.update({
                "rows": float(batch.shape[0]),  # an agent's episode may be several rows
                "turns_sum": float(batch.num_turns.sum()),
                "tool_calls_sum": float(batch.tool_calls.sum()),
                "environment_seconds_sum": float(batch.environment_seconds.sum()),
                "environment_failures": float(batch.environment_failures.sum()),
                "environment_tokens_sum": float((batch.response_mask - mask).sum()),
            })
        return RankUpdate(
            sums=sums,
            ppo_sums=ppo_sums,
            ppo=ppo_stats_from_sums([ppo_sums]),  # this rank's own; the group combines ``ppo_sums``
            timings=timings,
            policy_versions=sorted(set(batch.policy_version.tolist())),
            kl_coefs=sorted(set(batch.kl_coef.tolist())),
            lr=float(self.engine.get_lr()[0]),  # what the optimizer stepped with
            rank=self.rank,
        )

    def _forward_dropped(self, dropped: RolloutBatch) -> None:
        """The old log-probs of dynamic sampling's dropped rows, for the controller's statistic: one forward on
        every rank (a one-token placeholder where a rank dropped none), so ZeRO-3's gathers pair up."""
        if dropped.shape[0]:
            dropped.old_logprobs, _, _ = self._forward(dropped, grad=False)
        else:
            self._forward(_placeholder_batch(), grad=False)

    def differing_groups(self) -> int:
        """Dynamic sampling: how many whole groups with scores that differ (penalties applied) this rank holds."""
        from services.experience import concat_batches

        if not self.collected:
            return 0
        return self.algorithm.differing_groups(concat_batches([self.collected[slot] for slot in sorted(self.collected)]))

    def _forward(self, batch: RolloutBatch, grad: bool) -> tuple[Tensor, Tensor, Tensor]:
        """(log-probs [B, T], values [B, T] or None, logits [B, T, V]) of ``batch``'s rows. With
        ``learner.max_tokens_per_microbatch`` the rows run packed without padding, in micro-batches of at most that
        many tokens (with gradients, those of the one step of ``single_step``, each graph kept for its backward;
        the PPO loop's micro-batches already fit). Under ZeRO-3 as one pack: every forward gathers the parameters
        from all ranks, so their forwards must pair up."""
        from services.experience import model_inputs, plan_micro_batches, sequence_lengths

        budget = self.learner.max_tokens_per_microbatch
        if budget is not None and self.learner.zero_stage != 3:
            parts = plan_micro_batches(sequence_lengths(batch), budget)
            if len(parts) > 1:
                outputs = [self._forward_packed(batch[part], grad) for part in parts]
                order = torch.cat(parts).argsort()  # the parts' rows back in the batch's order
                logprobs, values, logits = (None if out[0] is None else torch.cat(out)[order.to(out[0].device)]
                                            for out in zip(*outputs, strict=True))
                return logprobs, values, logits
        if budget is not None:
            return self._forward_packed(batch, grad)
        input_ids, attention_mask, position_ids = (x.to(self.device) for x in model_inputs(batch))
        with torch.set_grad_enabled(grad):
            logits, values = self.engine(input_ids, attention_mask, position_ids, batch.prompt_ids.shape[1],
                                         self.temperature)
            logprobs = token_logprobs(logits, batch.response_ids.to(self.device))
        if not grad:
            return logprobs.detach().cpu(), values.detach().cpu() if values is not None else None, logits.detach()
        return logprobs, values, logits

    def _forward_packed(self, batch: RolloutBatch, grad: bool) -> tuple[Tensor, Tensor, Tensor]:
        """``_forward`` of all of ``batch``'s rows as one pack."""
        from services.experience import pack

        packed = pack(batch).to(self.device)
        with torch.set_grad_enabled(grad):
            logits, values = self.engine(None, None, None, 0, self.temperature, packed=packed)
            logprobs = token_logprobs(logits, batch.response_ids.to(self.device))
        if not grad:
            return logprobs.detach().cpu(), values.detach().cpu() if values is not None else None, logits.detach()
        return logprobs, values, logits

    def _ppo_epochs(self, batch: RolloutBatch, kl_coef: float, iteration: int,
                    step_forward: tuple[Tensor, Tensor, Tensor] | None = None) -> dict:
        """The PPO epochs over ``batch``, which carries old_logprobs, old_values, ref_logprobs, advantages
        and returns: shuffled minibatches ``batch[rows]``, one optimizer step each. ``step_forward``: the
        forward of the whole batch with gradients, for the one step of ``single_step``."""
        micro = self.ppo.minibatch_size // self.world_size
        n = batch.shape[0]
        if step_forward is not None and n > micro:
            raise ValueError(f"rank {self.rank}: {n} rows for one optimizer step of {micro} (ppo.minibatch_size "
                             f"{self.ppo.minibatch_size} over {self.world_size} ranks)")
        generator = torch.Generator().manual_seed(self.seed * 100_003 + iteration)
        totals: dict[str, list] = {}  # name -> [sum, count] (tensors until the end), additive over ranks
        steps = 0
        for _ in range(self.ppo.epochs):
            order = torch.arange(n) if step_forward is not None else torch.randperm(n, generator=generator)
            # ppo.minibatch_size episodes a step: micro rows on this rank, or, when an episode's rows vary
            # (rollout.agent), this rank's share of its episodes, each whole, so every rank takes as many steps
            minibatches = self._episode_minibatches(batch, generator) if self.rows_per_episode_vary else order.split(micro)
            for rows in minibatches:
                mb = batch[rows]
                # global token (or episode) counts over all ranks: W ranks compute what one would
                counts = self.algorithm.loss_counts(mb, self.reducer)
                parts = self._micro_batches(mb) if step_forward is None else [None]
                losses: dict[str, Tensor] = {}
                for i, part in enumerate(parts):
                    if part is not None and not len(part):  # a filler: this rank has fewer micro-batches
                        _, values, logits = self._forward(_placeholder_batch(), grad=True)
                        loss = 0.0 * logits.sum() + (0.0 * values.sum() if values is not None else 0.0)
                        step_stats = {}
                    else:
                        micro_batch = mb if part is None else mb[part]
                        forward = step_forward or self._forward(micro_batch, grad=True)
                        loss, step_stats = self.algorithm.loss(micro_batch, forward, counts, kl_coef)
                        for key in [k for k, (_, count) in step_stats.items() if count is None]:
                            losses[key] = losses.get(key, 0.0) + step_stats.pop(key)[0]
                    if len(parts) > 1:  # one optimizer step accumulates the minibatch's micro-batches
                        self.engine.set_gradient_accumulation_boundary(i == len(parts) - 1)
                    self.engine.backward(loss)
                    for key, (value, count) in step_stats.items():  # token statistics: weighted by tokens
                        acc = totals.setdefault(key, [0.0, 0.0])
                        acc[0] = acc[0] + value.detach().double() * count
                        acc[1] = acc[1] + count
                # the gradient's norm before clipping (ppo.max_grad_norm): DeepSpeed's optimizers under ZeRO and
                # in bf16 report it; an fp32 step without ZeRO clips the parameters' (reduced) gradients here
                norm = None
                if self.clips_itself:  # a parameter without a gradient (unused this step) is left out by torch
                    norm = torch.nn.utils.clip_grad_norm_(self.trained_parameters, self.ppo.max_grad_norm)
                self.engine.step()
                norm = self.engine.get_global_grad_norm() or norm
                if norm is not None:
                    losses["grad_norm"] = torch.as_tensor(float(norm))
                # losses are this rank's share of the global minibatch mean: one count per step
                for key, value in losses.items():
                    acc = totals.setdefault(key, [0.0, 0.0])
                    acc[0] = acc[0] + value.detach().double()
                    acc[1] = acc[1] + 1.0
                steps += 1
        return {"stats": {key: [float(total), float(count)] for key, (total, count) in totals.items()},
                "optimizer_steps": steps}

    def _episode_minibatches(self, batch: RolloutBatch, generator: torch.Generator) -> list[Tensor]:
        """The rows of each of the epoch's ``self.minibatches`` minibatches: this rank's episodes shuffled and split
        as evenly as they go, each episode's rows together (the loss lays them end to end)."""
        view = episode_view(batch)
        episodes = torch.randperm(view.episodes, generator=generator).tensor_split(self.minibatches)
        return [torch.isin(view.episode, part).nonzero().squeeze(-1) for part in episodes]

    def _micro_batches(self, mb: RolloutBatch) -> list[Tensor | None]:
        """The micro-batches of one optimizer step: the whole minibatch ([None]), or with
        ``learner.max_tokens_per_microbatch`` its rows packed by that budget, as many on every rank (the ranks'
        forwards and backwards pair up under ZeRO-3, their gradient reductions under every stage): a rank with
        fewer gets fillers (empty index tensors)."""
        budget = self.learner.max_tokens_per_microbatch
        if budget is None:
            return [None]
        from services.experience import plan_micro_batches, sequence_lengths

        # whole episodes: an episode's rows share its sequence-level terms (learner.algorithm.EpisodeView)
        view = episode_view(mb)
        episode_lengths = torch.zeros(view.episodes, dtype=torch.long).index_add(0, view.episode, sequence_lengths(mb))
        parts = [torch.isin(view.episode, episodes).nonzero().squeeze(-1)
                 for episodes in plan_micro_batches(episode_lengths, budget)]
        if self.world_size > 1:
            import torch.distributed as dist

            most = torch.tensor([len(parts)], dtype=torch.long, device=self.device)
            dist.all_reduce(most, op=dist.ReduceOp.MAX)
            parts += [torch.zeros(0, dtype=torch.long)] * (int(most) - len(parts))
        return parts

    # ------------------------------------------------------------------ weights, probes, fixed-batch checks

    def policy_state_dict(self, dtype: str | None = None, adapter: bool = False) -> list | None:
        """[ObjectRef of the full policy weights (HF names) as ``HostWeights``, in ``dtype`` (default: the
        learner's), their bytes] on rank 0, None elsewhere: put once, read in place by every engine on the node. ``adapter``
        (learner.lora): the LoRA adapter alone, with its config, for engines that take adapters. Collective
        under ZeRO-3."""
        import deepspeed
        import ray

        lm = self.engine.module.lm
        params = list(lm.parameters())
        with deepspeed.zero.GatheredParameters(params, modifier_rank=None, enabled=self.learner.zero_stage == 3):
            if self.rank != 0:
                return None
            from services.weights import HostWeights

            # ray.put copies the bytes: the live parameters can move on after it returns. LoRA: the adapter alone
            # where the engines take one, else merged into the base weights (vLLM's GPT-2 takes no adapters)
            dtype = getattr(torch, dtype or self.learner.dtype)
            if adapter:
                state, adapter_config = adapter_state(lm)
                weights = HostWeights(state, dtype, adapter_config)
            else:
                weights = HostWeights(merged_state_dict(lm) if self.lora else lm.state_dict(), dtype)
            return [ray.put(weights), weights.nbytes]

    def weight_metadata(self) -> list[tuple[str, str, list[int]]]:
        """``[(name, dtype, full HF shape)]`` of the policy parameters the engines receive, as the weight
        transfer announces them. Reads ZeRO-3's ``ds_shape``, no collective: one rank may call it alone."""
        from learner.weight_transfer import announced_parameters

        return announced_parameters(self.engine.module.lm)

    def gpu_location(self) -> tuple[str, list[str]]:
        from services.devices import gpu_location

        return gpu_location()

    def init_weight_transfer(self, backend: str, rollouts: list, workers_per_engine: int, master_addr: str,
                             master_port: int, buffer_bytes: int, timeout_s: float) -> None:
        """Build vLLM's trainer-side weight-transfer engine. Every rank calls it; rank 0 also sets up the
        engines' side (NCCL: a rendezvous with every engine worker at ``master_addr:master_port``)."""
        from vllm.distributed.weight_transfer import WeightTransferTrainerFactory

        from learner.weight_transfer import EngineClient, parameter_source, trainer_init_info

        source = parameter_source(self.engine.module.lm, zero3=self.learner.zero_stage == 3)
        info = trainer_init_info(backend, self.rank, master_addr, master_port,  # type: ignore[arg-type]
                                 1 + len(rollouts) * workers_per_engine, buffer_bytes)
        client = EngineClient(rollouts, workers_per_engine, timeout_s)
        self.weight_transfer = WeightTransferTrainerFactory.trainer_init(info, client=client, source=source)

    def send_weights(self) -> None:
        """Full weights to every engine (start, receive, finish on the engines' side). Every rank calls it:
        under ZeRO-3 each parameter is gathered from all ranks."""
        self.weight_transfer.send_weights()

    def probe_logprobs(self, sequences: list[list[int]], prompt_lengths: list[int]) -> list[list[float]] | None:
        """This rank's log-probs of given sequences (temperature 1). Collective under ZeRO-3."""
        from services.experience import make_batch

        prompts = [s[:p] for s, p in zip(sequences, prompt_lengths, strict=True)]
        responses = [s[p:] for s, p in zip(sequences, prompt_lengths, strict=True)]
        batch = make_batch(prompts, responses, [[0.0] * len(r) for r in responses], [0] * len(prompts),
                           list(range(len(prompts))), 0, 0, 0.0)
        saved, self.temperature = self.temperature, 1.0
        try:
            logprobs, _, _ = self._forward(batch, grad=False)
        finally:
            self.temperature = saved
        if self.rank != 0:
            return None
        return [row[: len(r)].tolist() for row, r in zip(logprobs, responses, strict=True)]

    def save_checkpoint(self, storage_url: str) -> dict:
        """This rank's DeepSpeed files uploaded under ``learner/`` of ``storage_url``: {path: {sha256, bytes}}."""
        return rank_checkpoint.save(self.engine, self.rank, storage_url)

    def load_checkpoint(self, storage_url: str, manifest: dict, saved_world_size: int) -> None:
        """This rank's DeepSpeed state from ``storage_url``, each file checked against ``manifest`` (a checkpoint
        of another rank count through DeepSpeed's universal checkpoint)."""
        rank_checkpoint.load(self.engine, self.rank, self.world_size, storage_url, manifest, saved_world_size)

    def export_hf(self, storage_url: str) -> None:
        """The policy as a Hugging Face model directory at ``storage_url`` (rank 0). Collective under ZeRO-3."""
        rank_checkpoint.export_hf(self.engine.module.lm, self.rank, self.learner.zero_stage == 3, bool(self.lora),
                                  self.model_dir, storage_url)


def _placeholder_batch() -> RolloutBatch:
    """One prompt token and one response token (id 0): the cheapest forward a ZeRO-3 rank can join."""
    from services.experience import make_batch

    return make_batch([[0]], [[0]], [[0.0]], [0], [0], 0, 0, 0.0)
