"""Packing's isolation, checked once at setup in every role that packs
(``learner.max_tokens_per_microbatch``): the learner rank, the hf reference and the teacher run several
sequences in one row without padding, their positions restarting at 0, and rely on transformers to read the
restarts and mask attention across sequences. A model class that does not (transformers 5.19's Falcon, Bloom
and MPT build their causal mask without the positions) would let each sequence attend to the ones before it in
the row, silently.

The check is a leak test, not an equality test: it changes every token of the row's first sequence and
measures how far the log-probs of the sequences after it move, against how far the changed sequence's own
log-probs move (the scale of a change that is seen). Isolated, the neighbours move by rounding at most (0
exactly on CPU, fp32 and bf16, for a tiny GPT-2 and Llama); a leak moves them by a few % of the scale or more
(``tests/test_packing_check.py``). Pure torch and transformers."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from services.experience import make_batch, pack, packed_logits
from services.logprobs import token_logprobs

# a fraction of the changed sequence's own move: the leaks measured moved the neighbours by 1.4-76 % of it
# (tiny GPT-2 and Llama with whole-row attention, fp32 and bf16; 4-24 % for the SFT-trained GPT-2), isolation
# by 0
RELATIVE_TOLERANCE = 1e-3
# the rounding floor: half an ulp of the largest neighbour logit in the model's dtype (one rounding of the
# logits), or this many times what the same row run again moves them by (nondeterministic kernels; 0 on CPU)
FLOOR_ULPS = 0.5
REPEAT_MARGIN = 4.0
CHANGED_LENGTH, NEIGHBOUR_LENGTH = 12, 8  # tokens: the changed sequence first and longest, so a leak is large


@dataclass(frozen=True)
class Leak:
    """What changing every token of the packed row's first sequence moved (max absolute log-prob changes)."""

    neighbour: float  # the log-probs of the sequences after it: rounding at most, when isolated
    own: float  # its own log-probs: the scale of a change that is seen
    repeat: float  # the neighbours', the same row run twice: the kernels' nondeterminism
    # the neighbours' largest absolute logit: what one rounding of the logits is relative to
    logit_scale: float


def isolation_sequences(vocab_size: int, seed: int = 0) -> tuple[list[list[int]], list[int]]:
    """(three sequences of token ids below ``vocab_size``: the changed one, of ``CHANGED_LENGTH``, then two
    neighbours of ``NEIGHBOUR_LENGTH``; the changed one with every token replaced by another id),
    deterministic."""
    g = torch.Generator().manual_seed(seed)
    lengths = (CHANGED_LENGTH, NEIGHBOUR_LENGTH, NEIGHBOUR_LENGTH)
    sequences = [torch.randint(0, vocab_size, (n,), generator=g) for n in lengths]
    # a nonzero shift modulo the vocabulary: every position gets another id
    shift = torch.randint(1, max(vocab_size, 2), (CHANGED_LENGTH,), generator=g)
    changed = (sequences[0] + shift) % vocab_size
    return [s.tolist() for s in sequences], changed.tolist()


def packed_sequence_logprobs(model, sequences: list[list[int]]) -> tuple[Tensor, Tensor]:
    """(the sampled-token log-probs [S, L - 1] (float32, on CPU; 0 past a sequence's end), each sequence's
    largest absolute logit [S]) of ``sequences`` (S of at most L tokens; each its first token as the prompt,
    the rest as the response), all packed in one row."""
    responses = [s[1:] for s in sequences]
    batch = make_batch([s[:1] for s in sequences], responses, [[0.0] * len(r) for r in responses],
                       [1] * len(sequences), list(range(len(sequences))), 0, 0, 0.0)
    device = next(model.parameters()).device
    logits, _ = packed_logits(model, pack(batch).to(device))
    logprobs = token_logprobs(logits.float(), batch.response_ids.to(device)).cpu() * batch.response_mask
    return logprobs, logits.float().abs().amax(dim=(1, 2)).cpu()  # padding's logits are 0


def packing_leak(model, vocab_size: int, seed: int = 0) -> Leak:
    """``Leak`` of ``model`` when every token of the packed row's first sequence changes. Three forwards of 28
    tokens, on the model's device, in eval mode (no dropout) and without grad."""
    sequences, changed = isolation_sequences(vocab_size, seed)
    modes = [(module, module.training) for module in model.modules()]
    model.eval()
    try:
        with torch.no_grad():
            before, logit_scale = packed_sequence_logprobs(model, sequences)
            again, _ = packed_sequence_logprobs(model, sequences)
            after, _ = packed_sequence_logprobs(model, [changed, *sequences[1:]])
    finally:
        for module, training in modes:
            module.training = training
    moved = (after - before).abs()
    return Leak(neighbour=float(moved[1:].max()), own=float(moved[0].max()),
                repeat=float((again - before)[1:].abs().max()), logit_scale=float(logit_scale[1:].max()))


def compute_dtype(model) -> torch.dtype:
    """The least precise floating dtype of ``model``'s parameters (a LoRA model may keep its adapters in
    fp32)."""
    dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()} or {torch.float32}
    return max(dtypes, key=lambda dtype: torch.finfo(dtype).eps)


def leak_tolerance(leak: Leak, dtype: torch.dtype) -> float:
    """The most the neighbours' log-probs may move in ``dtype`` without a leak: a small fraction of the
    changed sequence's own move, plus the rounding floor (half an ulp of the largest logit, or the repeat's
    noise with margin)."""
    floor = max(FLOOR_ULPS * torch.finfo(dtype).eps * leak.logit_scale, REPEAT_MARGIN * leak.repeat)
    return RELATIVE_TOLERANCE * leak.own + floor


def model_class_name(model) -> str:
    """The class of the model that computes: under a peft wrapper (learner.lora), the wrapped one's."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return type(base).__name__


def check_packing_isolation(model, vocab_size: int, where: str, seed: int = 0) -> None:
    """Refuse ``model`` (ValueError naming ``where``, the role) when sequences packed in one row attend to
    each other: when changing one sequence's tokens moves the log-probs of the sequences after it by more than
    ``leak_tolerance``. Under ZeRO-3 every rank must call it (its forwards gather parameters)."""
    leak = packing_leak(model, vocab_size, seed)
    dtype = compute_dtype(model)
    tolerance = leak_tolerance(leak, dtype)
    if leak.neighbour > tolerance:
        raise ValueError(
            f"{where}: {model_class_name(model)} lets packed sequences attend to each other: changing one "
            "sequence's tokens moved the log-probs of the sequences after it in the packed row by "
            f"{leak.neighbour:.3g} (its own by {leak.own:.3g}; {dtype} tolerates {tolerance:.3g}), so its "
            "attention does not read the positions' restarts. Unset learner.max_tokens_per_microbatch to run "
            "this model padded")
