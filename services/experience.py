"""The one batch container that flows between roles, and the forward pass that reads it.

A ``RolloutBatch`` holds B episodes. Prompts are left-padded to P, responses right-padded to T, so the
response always starts at column P of ``cat(prompt_ids, response_ids)``. Every response tensor is
response-aligned [B, T]. A multi-turn episode's response is its whole trajectory after the prompt, token for
token as it happened: the model's turns (ids the engine sampled) and the environment's (observation ids),
``response_mask`` marks every real token of it (the attention), ``action_mask`` the ones the model sampled
(the only ones with log-probs, ratios, advantages and KL). A single response is a
trajectory of one turn, where the two masks are equal. Each row carries the ``policy_version`` and ``kl_coef``
it was produced under, so concatenating chunks keeps the stamps. The learner fills the optional fields
(reference log-probs, scores, its own old log-probs and values, advantages, returns), so one container reaches
the loss. ``tensordict``'s tensorclass gives indexing, ``torch.cat``, ``torch.stack`` and device moves for
free.

The driver never imports this module: tensordict imports ``torch._dynamo`` at import (about 1.3 CPU s), so
the actor and rank modules that the driver imports for their classes import it inside the methods that
build or read a batch (``tests/test_models.py`` checks).
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass

import torch
from tensordict import tensorclass
from torch import Tensor

from services.logprobs import token_logprobs

FINISH_STOP, FINISH_LENGTH = 0, 1  # finish_reason codes: EOS (or a stop) vs the max_new_tokens cap


@tensorclass
class RolloutBatch:
    prompt_ids: Tensor  # [B, P] long, left-padded with the pad id
    prompt_mask: Tensor  # [B, P] float 0/1
    response_ids: Tensor  # [B, T] long, right-padded
    response_mask: Tensor  # [B, T] float 0/1: every real token after the prompt (a prefix); the attention
    # [B, T] float 0/1: the tokens the model sampled (each turn up to its EOS); the losses
    action_mask: Tensor
    rollout_logprobs: Tensor  # [B, T] the engine's sampled-token log-probs (diagnostic only)
    finish_reason: Tensor  # [B] long: FINISH_STOP or FINISH_LENGTH
    policy_version: Tensor  # [B] long: weights version that generated the row
    kl_coef: Tensor  # [B] float: beta in force when the row was generated
    prompt_index: Tensor  # [B] long: index into the task's prompt list
    group_index: Tensor  # [B] long: the episodes of one prompt's samples_per_prompt group share it; -1: none
    # [B] long: the rows of one episode share it (an agent's calls may give several rows)
    episode_index: Tensor
    # multi-turn episodes only (an environment's task); None for single responses
    # [B, T] each turn's reward at the turn's last model token (0 elsewhere)
    turn_rewards: Tensor | None = None
    num_turns: Tensor | None = None  # [B] long: the model's turns in the episode
    tool_calls: Tensor | None = None  # [B] long: tool calls the environment executed
    environment_seconds: Tensor | None = None  # [B] float: seconds the episode's environment steps took
    environment_failures: Tensor | None = None  # [B] long: failed attempts at the row before it succeeded
    # in-flight updates (rollout.in_flight_updates) only: a response may span versions
    # [B, T] long: the version each sampled token was sampled under; -1 elsewhere
    token_version: Tensor | None = None
    # filled by the learner rank; None until then
    ref_logprobs: Tensor | None = None  # [B, T] the reference model's log-probs of the sampled tokens
    # [B, T] on-policy distillation: the teacher's (distill.teacher_path)
    teacher_logprobs: Tensor | None = None
    scores: Tensor | None = None  # [B] sequence scores (the reward function's or model's)
    old_logprobs: Tensor | None = None  # [B, T] the learner's log-probs before the update
    # [B, T] the critic's values before the update ("values" is tensordict's)
    old_values: Tensor | None = None
    advantages: Tensor | None = None  # [B, T]
    returns: Tensor | None = None  # [B, T] the value targets

    @property
    def response_lengths(self) -> Tensor:
        """[B] real tokens after the prompt (the model's and the environment's)."""
        return self.response_mask.sum(-1).long()


def pad_right(rows: list[list], pad: float, width: int | None = None, dtype=torch.long) -> Tensor:
    width = max((len(r) for r in rows), default=0) if width is None else width
    out = torch.full((len(rows), width), pad, dtype=dtype)
    for i, row in enumerate(rows):
        if row:
            out[i, : len(row)] = torch.as_tensor(row, dtype=dtype)
    return out


def pad_left(rows: list[list], pad: float, width: int | None = None, dtype=torch.long) -> Tensor:
    width = max((len(r) for r in rows), default=0) if width is None else width
    out = torch.full((len(rows), width), pad, dtype=dtype)
    for i, row in enumerate(rows):
        if row:
            out[i, width - len(row) :] = torch.as_tensor(row, dtype=dtype)
    return out


def make_batch(
    prompts: list[list[int]],
    responses: list[list[int]],
    logprobs: list[list[float]],
    finish_reasons: list[int],
    prompt_index: list[int],
    pad_id: int,
    policy_version: int,
    kl_coef: float,
    response_width: int | None = None,
    group_index: list[int] | None = None,
    action_masks: list[list[int]] | None = None,
    episodes: Episodes | None = None,
    episode_index: list[int] | None = None,
    token_versions: list[list[int]] | None = None,
) -> RolloutBatch:
    """Assemble engine outputs into a RolloutBatch (``response_width`` pads T to a fixed size, so chunks
    of one iteration concatenate; ``group_index`` None: the rows belong to no group, -1). A trajectory
    gives ``action_masks`` (1 on the ids the model sampled; ``logprobs`` 0 elsewhere) and ``episodes``;
    without them every response token is the model's. ``episode_index`` None: every row is an episode of its
    own. ``token_versions`` (in-flight updates): each sampled token's version (-1 on the environment's); a row
    is stamped with its oldest, so the staleness it is admitted by is its oldest token's."""
    b = len(prompts)
    batch = RolloutBatch(
        prompt_ids=pad_left(prompts, pad_id),
        prompt_mask=pad_left([[1] * len(p) for p in prompts], 0, dtype=torch.float32),
        response_ids=pad_right(responses, pad_id, response_width),
        response_mask=pad_right([[1] * len(r) for r in responses], 0, response_width, dtype=torch.float32),
        action_mask=pad_right(action_masks if action_masks is not None else [[1] * len(r) for r in responses],
                              0, response_width, dtype=torch.float32),
        rollout_logprobs=pad_right(logprobs, 0.0, response_width, dtype=torch.float32),
        finish_reason=torch.tensor(finish_reasons, dtype=torch.long),
        policy_version=torch.full((b,), policy_version, dtype=torch.long),
        kl_coef=torch.full((b,), kl_coef, dtype=torch.float32),
        prompt_index=torch.tensor(prompt_index, dtype=torch.long),
        group_index=torch.tensor(group_index if group_index is not None else [-1] * b, dtype=torch.long),
        episode_index=torch.tensor(episode_index if episode_index is not None else range(b),
                                   dtype=torch.long),
        batch_size=[b],
    )
    if token_versions is not None:
        batch.token_version = pad_right(token_versions, -1, response_width)
        batch.policy_version = row_versions(token_versions, policy_version)
    if episodes is not None:
        batch.turn_rewards = pad_right(episodes.turn_rewards, 0.0, response_width, dtype=torch.float32)
        batch.num_turns = torch.tensor(episodes.num_turns, dtype=torch.long)
        batch.tool_calls = torch.tensor(episodes.tool_calls, dtype=torch.long)
        batch.environment_seconds = torch.tensor(episodes.environment_seconds, dtype=torch.float32)
        batch.environment_failures = torch.tensor(episodes.environment_failures, dtype=torch.long)
    return batch


@dataclass
class Episodes:
    """What multi-turn episodes add to ``make_batch``'s rows, one entry per row."""

    turn_rewards: list[list[float]]  # per trajectory token: a turn's reward at its last model token, else 0
    num_turns: list[int]
    tool_calls: list[int]
    environment_seconds: list[float]
    environment_failures: list[int]


def row_versions(token_versions: list[list[int]], default: int) -> Tensor:
    """[B] long: each row's version, its oldest sampled token's (-1 marks the environment's tokens; a row
    without a sampled token takes ``default``): the staleness a row is admitted by."""
    return torch.tensor([min((v for v in row if v >= 0), default=default) for row in token_versions],
                        dtype=torch.long)


def stale_tokens(batch: RolloutBatch, mask: Tensor, version: int | None, cache_kept: bool = False) -> Tensor:
    """[B, T] float: 1 on the tokens of ``mask`` sampled by a version other than the learner's ``version``
    (None: unknown, none counted); token by token with in-flight updates, where a response may span versions.
    ``cache_kept`` (``rollout.in_flight_updates: keep_kv``): a token sampled after a load came from the old
    weights' keys and values mixed with the new weights, so it is the learner's version only where its request
    started under it (the row's oldest token's)."""
    if version is None:
        return torch.zeros_like(mask)
    row_stale = (batch.policy_version != version).unsqueeze(-1)
    if batch.token_version is not None:
        return mask * ((batch.token_version != version) | (row_stale & cache_kept))
    return mask * row_stale


def in_flight_sums(batch: RolloutBatch, mask: Tensor, version: int | None) -> dict[str, float]:
    """With in-flight updates: the rows, the rows whose sampled tokens span versions, and the versions each
    token of ``mask`` lags the learner's ``version``, summed; nothing otherwise."""
    if batch.token_version is None or version is None:
        return {}
    sampled = mask * (batch.token_version >= 0)
    newest = torch.where(sampled.bool(), batch.token_version, -1).max(-1).values
    return {"in_flight_rows": float(batch.shape[0]),
            "in_flight_mixed_rows": float((newest > batch.policy_version).sum()),
            "in_flight_token_staleness_sum": float(((version - batch.token_version) * sampled).sum())}


def concat_batches(batches: list[RolloutBatch]) -> RolloutBatch:
    """Concatenate chunks, left-padding prompts to a common width first; each chunk's episode ids are moved
    past the last chunk's, so an id names one episode of the whole batch."""
    width = max(b.prompt_ids.shape[1] for b in batches)
    aligned, episode_ids, first_id = [], [], 0
    for b in batches:
        ids = b.episode_index - (b.episode_index.min() if b.shape[0] else 0) + first_id
        first_id = int(ids.max()) + 1 if b.shape[0] else first_id
        episode_ids.append(ids)
        extra = width - b.prompt_ids.shape[1]
        if extra:
            b = b.clone()
            # the pad id never matters: padded positions are masked out of attention
            b.prompt_ids = torch.nn.functional.pad(b.prompt_ids, (extra, 0), value=0)
            b.prompt_mask = torch.nn.functional.pad(b.prompt_mask, (extra, 0), value=0.0)
        aligned.append(b)
    batch = torch.cat(aligned)
    batch.episode_index = torch.cat(episode_ids)
    return batch


def model_inputs(batch: RolloutBatch) -> tuple[Tensor, Tensor, Tensor]:
    """(input_ids, attention_mask, position_ids), each [B, P + T], for a forward over prompt + response."""
    input_ids = torch.cat([batch.prompt_ids, batch.response_ids], dim=1)
    attention_mask = torch.cat([batch.prompt_mask, batch.response_mask], dim=1)
    # positions count real tokens only, so left padding does not shift them
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0).long()
    return input_ids, attention_mask.long(), position_ids


def response_logits(model, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor, prompt_width: int,
                    hidden: bool = False) -> tuple[Tensor, Tensor | None]:
    """One forward of a causal LM over prompt + response [B, P + T]: the logits [B, T, V] at the positions
    that predict the response tokens (column P + j - 1 predicts response token j), and with ``hidden`` the
    last hidden states there [B, T, H].

    Only those positions go through the LM head where the model takes transformers' ``logits_to_keep``:
    over a large vocabulary the head is a fifth of SmolLM2's FLOPs, and the prompt's logits are never read.
    """
    inputs = {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids,
              "output_hidden_states": hidden, "use_cache": False}
    span = slice(prompt_width - 1, input_ids.shape[1] - 1)
    if _keeps_logits(type(model)):  # the last T + 1 positions: the span and the final one
        out = model(**inputs, logits_to_keep=input_ids.shape[1] - prompt_width + 1)
        logits = out.logits[:, :-1]
    else:
        out = model(**inputs)
        logits = out.logits[:, span]
    return logits, out.hidden_states[-1][:, span] if hidden else None


@functools.cache
def _keeps_logits(model_class: type) -> bool:
    return "logits_to_keep" in inspect.signature(model_class.forward).parameters


# ---------------------------------------------------------------- packing by token budget


@dataclass
class Packed:
    """Rows of a batch packed one after another into one row, without padding
    (``learner.max_tokens_per_microbatch``).

    ``input_ids``, ``position_ids``: [1, N], each sequence's positions from 0 (transformers reads the restarts
    and masks attention across sequences); ``keep``: [K] the columns that predict a response token; ``rows``,
    ``cols``: [K] which row and response position each predicts, in the padded [b, T] layout of the rows
    packed."""

    input_ids: Tensor
    position_ids: Tensor
    keep: Tensor
    rows: Tensor
    cols: Tensor
    shape: tuple[int, int]  # the padded layout: [b, T]

    def to(self, device) -> Packed:
        return Packed(*(x.to(device)
                        for x in (self.input_ids, self.position_ids, self.keep, self.rows, self.cols)),
                      self.shape)


def sequence_lengths(batch: RolloutBatch) -> Tensor:
    """[B] real tokens of each row: its prompt's and its response's (what a packed forward runs)."""
    return (batch.prompt_mask.sum(-1) + batch.response_mask.sum(-1)).long()


def plan_micro_batches(lengths: Tensor, max_tokens: int) -> list[Tensor]:
    """Rows into micro-batches of at most ``max_tokens`` real tokens (first fit, longest first; a row longer
    than the budget alone). Returns each micro-batch's row indices, in row order; every row in exactly one."""
    bins: list[list[int]] = []
    room: list[int] = []
    for row in sorted(range(len(lengths)), key=lambda r: (-int(lengths[r]), r)):
        n = int(lengths[row])
        fit = next((i for i, left in enumerate(room) if left >= n), None)
        if fit is None:
            bins.append([row])
            room.append(max_tokens - n)
        else:
            bins[fit].append(row)
            room[fit] -= n
    return [torch.tensor(sorted(b), dtype=torch.long) for b in sorted(bins, key=min)]


def pack(batch: RolloutBatch) -> Packed:
    """Every row of ``batch`` packed: its real prompt tokens then its real response tokens. A row needs a
    prompt token: the last one predicts its first response token."""
    ids, positions, keep, rows, cols = [], [], [], [], []
    offset = 0
    for row in range(batch.shape[0]):
        prompt = batch.prompt_ids[row][batch.prompt_mask[row].bool()]
        length = int(batch.response_mask[row].sum())
        if prompt.numel() == 0:
            raise ValueError(f"row {row} has no prompt token: packing needs one to predict its first "
                             "response token")
        sequence = torch.cat([prompt, batch.response_ids[row, :length]])
        ids.append(sequence)
        positions.append(torch.arange(sequence.numel()))
        keep.append(offset + prompt.numel() - 1 + torch.arange(length))
        rows.append(torch.full((length,), row, dtype=torch.long))
        cols.append(torch.arange(length))
        offset += sequence.numel()
    return Packed(torch.cat(ids).unsqueeze(0), torch.cat(positions).unsqueeze(0), torch.cat(keep),
                  torch.cat(rows), torch.cat(cols), (batch.shape[0], batch.response_ids.shape[1]))


def packed_logits(model, packed: Packed, hidden: bool = False) -> tuple[Tensor, Tensor | None]:
    """One forward of a causal LM over ``packed`` sequences (on the model's device): the logits [b, T, V]
    predicting each response token in the padded layout (0 at padding), and with ``hidden`` the last hidden
    states there [b, T, H]. Only the kept columns go through the LM head where the model takes
    ``logits_to_keep``."""
    inputs = {"input_ids": packed.input_ids, "attention_mask": None, "position_ids": packed.position_ids,
              "output_hidden_states": hidden, "use_cache": False}
    keep = packed.keep
    if _keeps_logits(type(model)):
        out = model(**inputs, logits_to_keep=keep)
        kept = out.logits[0]
    else:
        out = model(**inputs)
        kept = out.logits[0, keep]
    rows, cols = packed.rows, packed.cols
    logits = kept.new_zeros(*packed.shape, kept.shape[-1]).index_put((rows, cols), kept)
    if not hidden:
        return logits, None
    states = out.hidden_states[-1][0, keep]
    return logits, states.new_zeros(*packed.shape, states.shape[-1]).index_put((rows, cols), states)


def response_forward(model, batch: RolloutBatch, temperature: float = 1.0, hidden: bool = False):
    """One forward over prompt + response.

    Returns (logprobs [B, T] of the sampled response tokens under ``softmax(logits / temperature)``,
    logits [B, T, V] that predict each response token (the model's dtype, before the temperature), last
    hidden states [B, T, H] or None).
    """
    logits, states = response_logits(model, *model_inputs(batch), batch.prompt_ids.shape[1], hidden)
    return token_logprobs(logits, batch.response_ids, temperature), logits, states


def packed_response_logprobs(model, batch: RolloutBatch, max_tokens: int, temperature: float = 1.0) -> Tensor:
    """[B, T] the sampled-token log-probs of ``response_forward``, computed on micro-batches of at most
    ``max_tokens`` real tokens packed without padding (on the model's device; 0 at padding)."""
    device = next(model.parameters()).device
    out = torch.zeros(batch.response_ids.shape, dtype=torch.float32)
    for part in plan_micro_batches(sequence_lengths(batch), max_tokens):
        rows = batch[part]
        logits, _ = packed_logits(model, pack(rows).to(device))
        out[part] = token_logprobs(logits, rows.response_ids.to(device), temperature).cpu()
    return out * batch.response_mask
