"""One PPO update on a learner rank's rows, top to bottom as CleanRL's loop reads: the rows to train on, their
old log-probs, the controller's sums, the advantages, the learning rate, then epochs x minibatches x
micro-batches (forward, loss, backward, step), and the sums the driver's metrics are made of.

The math is ``learner.algorithm``'s (one layer over the batch, with the registered entries it calls); the
model and the optimizer are a ``learner.engine.TrainingEngine``'s: DeepSpeed's in a rank, plain torch in a
test. No Ray and no DeepSpeed here. ``collect_chunk`` is what a rank runs on each chunk as it arrives (the
no-grad forward, the reference and the reward it scores itself), so that an update needs nothing but the
collected rows. """

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from learner.algorithm import Algorithm, episode_view
from learner.kl import episode_kl
from learner.ppo import explained_variance_moments, ppo_stats_from_sums, scheduled_lr
from learner.records import RankUpdate

if TYPE_CHECKING:  # the batch's module loads in the rank, not in the driver (services/experience.py)
    from actors.reference import ReferenceModel
    from actors.reward import RewardScorer
    from learner.engine import Forward, TrainingEngine
    from learner.plan import UpdateSettings
    from learner.records import ChunkRefs
    from services.experience import RolloutBatch


class RankScoring:
    """What a rank scores itself where no actor of that role starts: the reference (its own frozen copy of the
    initial policy, or LoRA's base: the policy with its adapters off) and the reward (the task's function)."""

    def __init__(self, engine: TrainingEngine, reference: ReferenceModel | None,
                 rewarder: RewardScorer | None) -> None:
        self.engine, self.reference, self.rewarder = engine, reference, rewarder

    def reference_logprobs(self, chunk: RolloutBatch) -> Tensor:
        """[B, T] the reference's log-probs of the sampled tokens, at the rollout temperature, 0 off the
        mask."""
        if self.reference is not None:
            return self.reference.score(chunk)
        with self.engine.lm.disable_adapter():
            logprobs, _, _ = self.engine.forward(chunk, grad=False)
        return logprobs * chunk.action_mask

    def engine_forwards(self, chunks: list[ChunkRefs], single_step: bool) -> int:
        """The engine's forwards on ``chunks``: per chunk the old log-probs' (none in one step), and LoRA's
        base reference's where no reference actor scored them."""
        in_engine = self.reference is None and any(c.reference is None for c in chunks)
        return len(chunks) * ((0 if single_step else 1) + in_engine)


def collect_chunk(engine: TrainingEngine, scoring: RankScoring, chunk: RolloutBatch, slot: int,
                  single_step: bool, scores: Tensor | None, ref_logprobs: Tensor | None,
                  teacher_logprobs: Tensor | None) -> None:
    """Fills ``chunk`` for the update: scores (given, or the rank's reward function's), the old log-probs and
    values (no-grad forward; in one step the step's own forward gives them), the reference's and the teacher's
    log-probs."""
    chunk_scores = scores if scores is not None else scoring.rewarder.score(chunk, slot)
    if not single_step:
        chunk.old_logprobs, chunk.old_values, _ = engine.forward(chunk, grad=False)
    chunk.ref_logprobs = ref_logprobs if ref_logprobs is not None else scoring.reference_logprobs(chunk)
    chunk.scores, chunk.teacher_logprobs = chunk_scores, teacher_logprobs


def evaluation_kl_sums(engine: TrainingEngine, scoring: RankScoring, chunk: RolloutBatch,
                       ref_logprobs: Tensor | None) -> dict[str, float]:
    """``kl_sums`` (k1, per episode) of the engine's policy against the reference on an evaluation chunk that
    the engines sampled with the same weights (``ref_logprobs`` None: ``scoring`` scores the reference)."""
    from learner.kl import kl_sums

    logprobs, _, _ = engine.forward(chunk, grad=False)
    ref = ref_logprobs if ref_logprobs is not None else scoring.reference_logprobs(chunk)
    view, mask = episode_view(chunk), chunk.action_mask
    return kl_sums(view.merge(logprobs * mask), view.merge(ref * mask), view.merge(mask), "k1")


def update(engine: TrainingEngine, algorithm: Algorithm, settings: UpdateSettings, batch: RolloutBatch,
           kl_coef: float, iteration: int, version: int | None = None) -> RankUpdate:
    """The update on ``batch``, this rank's collected rows (``collect_chunk``), at ``kl_coef``; ``version``:
    the learner's, which the rows' staleness is counted from (None: unknown). Returns additive sums, so that
    the driver's statistics are exact over all ranks."""
    t0 = time.perf_counter()
    single_step = settings.single_step(algorithm.off_policy)
    # the rows to train on: with DAPO's dynamic sampling this rank's share, in whole groups whose scores
    # differ
    group_counts, dropped = {}, None
    if algorithm.dynamic_sampling:
        if settings.rollout_batch_size is None:
            raise ValueError("dynamic sampling needs rollout_batch_size: each rank keeps its share of the "
                             "batch")
        share = settings.rollout_batch_size // (engine.world_size * algorithm.samples_per_prompt)
        keep, group_counts = algorithm.select(batch, share)
        dropped, batch = batch[(~keep).nonzero().squeeze(-1)], batch[keep.nonzero().squeeze(-1)]
        if single_step:  # no forward has run on the dropped rows: the statistic needs their log-probs
            with engine.lockstep(1 if dropped.shape[0] else 0):
                if dropped.shape[0]:
                    dropped.old_logprobs, _, _ = engine.forward(dropped, grad=False)
    # old log-probs and values: collected with each chunk, or in one step the step's own forward, before any
    # update
    step_forward = None
    if single_step:
        step_forward = engine.forward(batch, grad=True)
        batch.old_logprobs = step_forward[0].detach().cpu()
        batch.old_values = step_forward[1].detach().cpu() if step_forward[1] is not None else None
    # the controller's statistic over every episode sampled, the dropped groups' too: not a selection on
    # scores
    sums = algorithm.controller_sums(batch, dropped)
    episodes = episode_table(algorithm, batch)  # before prepare: the loss's mask may leave rows out
    mask = batch.action_mask  # the model's tokens; prepare may take the truncated rows out of the loss's
    # the advantages (KL-penalised rewards at kl_coef, then the estimator), and what the episodes were given
    sums |= algorithm.prepare(batch, kl_coef, engine.reducer)
    engine.set_lr(scheduled_lr(settings.ppo.lr, settings.ppo.lr_schedule, iteration, settings.run_iterations))
    ppo_sums = ppo_epochs(engine, algorithm, settings, batch, kl_coef, iteration, step_forward)
    if algorithm.has_critic:  # values before the update against their targets, as CleanRL logs it
        moments = explained_variance_moments(batch.old_values * mask, batch.returns, mask)
        ppo_sums["explained_variance_moments"] = moments.tolist()
    update_seconds = time.perf_counter() - t0
    sums |= batch_sums(algorithm, batch, mask, version, group_counts, settings.cache_kept)
    return RankUpdate(
        sums=sums,
        ppo_sums=ppo_sums,
        ppo=ppo_stats_from_sums([ppo_sums]),  # this rank's own; the group combines ``ppo_sums``
        timings={"update_seconds": update_seconds},
        policy_versions=sorted(set(batch.policy_version.tolist())),
        kl_coefs=sorted(set(batch.kl_coef.tolist())),
        lr=engine.lr(),  # what the optimizer stepped with
        rank=engine.rank,
        episodes=episodes,
    )


def ppo_epochs(engine: TrainingEngine, algorithm: Algorithm, settings: UpdateSettings, batch: RolloutBatch,
               kl_coef: float, iteration: int, step_forward: Forward | None = None) -> dict:
    """The PPO epochs over ``batch`` (with old_logprobs, old_values, ref_logprobs, advantages and returns):
    shuffled minibatches ``batch[rows]``, one optimizer step each, its micro-batches accumulated.
    ``step_forward``: the forward of the whole batch with gradients, for the one step of ``single_step``.
    Returns {"stats": {name: [sum, count]}, "optimizer_steps": n}, additive over ranks."""
    ppo = settings.ppo
    micro = ppo.minibatch_size // engine.world_size
    n = batch.shape[0]
    if step_forward is not None and n > micro:
        raise ValueError(f"rank {engine.rank}: {n} rows for one optimizer step of {micro} "
                         f"(ppo.minibatch_size {ppo.minibatch_size} over {engine.world_size} ranks)")
    generator = torch.Generator().manual_seed(settings.seed * 100_003 + iteration)
    totals: dict[str, list] = {}  # name -> [sum, count] (tensors until the end)
    steps = 0
    for _ in range(ppo.epochs):
        order = torch.arange(n) if step_forward is not None else torch.randperm(n, generator=generator)
        # ppo.minibatch_size episodes a step: micro rows on this rank, or, where an episode's rows vary
        # (rollout.agent), this rank's share of its episodes, each whole, so every rank takes as many steps
        minibatches = (episode_minibatches(batch, settings.minibatches, generator)
                       if settings.rows_per_episode_vary else order.split(micro))
        for rows in minibatches:
            mb = batch[rows]
            # global token (or episode) counts over all ranks: W ranks compute what one would
            counts = algorithm.loss_counts(mb, engine.reducer)
            packed = settings.max_tokens_per_microbatch is not None and step_forward is None
            parts = micro_batches(mb, settings.max_tokens_per_microbatch) if packed else [None]
            # packed, as many micro-batches on every rank: the ranks' gathers and gradient reductions pair up
            total = engine.agree(len(parts)) if packed else 1
            losses: dict[str, Tensor] = {}
            for i in range(total):
                boundary = i == total - 1 if total > 1 else None
                if i >= len(parts):  # a filler: this rank has fewer micro-batches
                    engine.filler_backward(boundary)
                    continue
                micro_batch = mb if parts[i] is None else mb[parts[i]]
                forward = step_forward or engine.forward(micro_batch, grad=True)
                loss, step_stats = algorithm.loss(micro_batch, forward, counts, kl_coef)
                for key in [k for k, (_, count) in step_stats.items() if count is None]:
                    losses[key] = losses.get(key, 0.0) + step_stats.pop(key)[0]
                engine.backward(loss, boundary)
                for key, (value, count) in step_stats.items():  # token statistics: weighted by tokens
                    acc = totals.setdefault(key, [0.0, 0.0])
                    acc[0] = acc[0] + value.detach().double() * count
                    acc[1] = acc[1] + count
            norm = engine.step()  # the gradient's norm before clipping
            if norm is not None:
                losses["grad_norm"] = torch.as_tensor(norm)
            # losses are this rank's share of the minibatch's: one count a step
            for key, value in losses.items():
                acc = totals.setdefault(key, [0.0, 0.0])
                acc[0] = acc[0] + value.detach().double()
                acc[1] = acc[1] + 1.0
            steps += 1
    return {"stats": {key: [float(total), float(count)] for key, (total, count) in totals.items()},
            "optimizer_steps": steps}


def episode_minibatches(batch: RolloutBatch, minibatches: int, generator: torch.Generator) -> list[Tensor]:
    """The rows of each of an epoch's ``minibatches``: this rank's episodes shuffled and split as evenly as
    they go, each episode's rows together (the loss lays them end to end)."""
    view = episode_view(batch)
    episodes = torch.randperm(view.episodes, generator=generator).tensor_split(minibatches)
    return [torch.isin(view.episode, part).nonzero().squeeze(-1) for part in episodes]


def micro_batches(mb: RolloutBatch, budget: int | None) -> list[Tensor | None]:
    """The micro-batches of one optimizer step: the whole minibatch ([None]), or with
    ``learner.max_tokens_per_microbatch`` its rows packed by that budget, whole episodes each (an episode's
    rows share its sequence-level terms)."""
    if budget is None:
        return [None]
    from services.experience import plan_micro_batches, sequence_lengths

    view = episode_view(mb)
    episode_lengths = torch.zeros(view.episodes, dtype=torch.long).index_add(0, view.episode,
                                                                             sequence_lengths(mb))
    return [torch.isin(view.episode, episodes).nonzero().squeeze(-1)
            for episodes in plan_micro_batches(episode_lengths, budget)]


def episode_table(algorithm: Algorithm, batch: RolloutBatch) -> dict[str, list]:
    """Each trained episode's row of the run's episodes.jsonl, as columns: the prompt it answered (its index
    in the prompt set) and its group, the version that sampled it (its oldest token's), its score (penalties
    applied), the response KL its reward was penalised by (the estimator's, unweighted), its model tokens,
    whether it was cut at the length cap, and an episode's turns."""
    from services.experience import FINISH_LENGTH

    view, mask = episode_view(batch), batch.action_mask
    kl = episode_kl(view.merge(batch.old_logprobs * mask), view.merge(batch.ref_logprobs * mask),
                    view.merge(mask), algorithm.kl.estimator)
    columns = {"prompt_index": view.first(batch.prompt_index), "group": view.first(batch.group_index),
               "policy_version": view.first(batch.policy_version),
               "score": view.total(algorithm.final_scores(batch)[0].double()), "kl": kl,
               "length": view.total(mask.sum(-1).double()),
               "truncated": view.total((batch.finish_reason == FINISH_LENGTH).double()) > 0}
    if batch.num_turns is not None:
        columns["turns"] = view.total(batch.num_turns.double())
    return {name: values.tolist() for name, values in columns.items()}


def batch_sums(algorithm: Algorithm, batch: RolloutBatch, mask: Tensor, version: int | None,
               group_counts: dict[str, int], cache_kept: bool = False) -> dict[str, float]:
    """The update's sums over the rows besides the algorithm's own: lengths, the forward's tokens, the
    engine-learner mismatch (tokens of an older version apart, and with ``cache_kept`` the tokens sampled
    after a load from the older version's cache), the rollout correction's, values and returns, dynamic
    sampling's groups, the in-flight rows' and the environment's."""
    from services.experience import in_flight_sums, sequence_lengths, stale_tokens

    old_logprobs, behaviour = batch.old_logprobs * mask, batch.rollout_logprobs * mask
    mismatch = (old_logprobs - behaviour).abs() * mask
    # rows an older version generated (async): their mismatch is mostly the policy's move since, reported
    # apart from the engine-learner numeric difference, which only rows of the learner's version measure
    stale = stale_tokens(batch, mask, version, cache_kept)
    sums = {
        "length_sum": float(mask.sum()),
        # the tokens a forward of these rows runs: the real ones, and in the padded [B, P + T] layout
        "forward_tokens_real": float(sequence_lengths(batch).sum()),
        "forward_tokens_padded": float(batch.shape[0]
                                       * (batch.prompt_ids.shape[1] + batch.response_ids.shape[1])),
        "mismatch_abs_sum": float(mismatch.sum()),  # all rows: the stale rows' share is apart below
        "mismatch_max": float((mismatch * (1 - stale)).max()) if mask.any() else 0.0,  # same-version rows
        "stale_tokens": float(stale.sum()),
        "stale_mismatch_abs_sum": float((mismatch * stale).sum()),
        **algorithm.correction_sums(batch, stale),
        # no critic: no values and no returns (the driver's value_mean is nan)
        "value_sum": float((batch.old_values * mask).sum()) if algorithm.has_critic else float("nan"),
        "return_sum": float((batch.returns * mask).sum()) if batch.returns is not None else float("nan"),
        **{f"dynamic_sampling_{name}_groups": float(count) for name, count in group_counts.items()},
        **in_flight_sums(batch, mask, version),
    }
    if batch.num_turns is not None:  # multi-turn episodes: what the environment added
        sums.update({
            "rows": float(batch.shape[0]),  # an agent's episode may be several rows
            "turns_sum": float(batch.num_turns.sum()),
            "tool_calls_sum": float(batch.tool_calls.sum()),
            "environment_seconds_sum": float(batch.environment_seconds.sum()),
            "environment_failures": float(batch.environment_failures.sum()),
            "environment_tokens_sum": float((batch.response_mask - mask).sum()),
        })
    return sums
