"""ReferenceActor: a frozen copy of the initial policy that returns ref log-probs of response tokens;
TeacherActor: the same scoring with on-policy distillation's teacher (``distill.teacher_path``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from actors.base import VersionedActor, starting_up
from actors.specs import EngineSpec, ReferenceSpec
from services.model_source import as_source

if TYPE_CHECKING:  # the batch's module loads in the actor, not in the driver (services/experience.py)
    from services.experience import RolloutBatch


class ReferenceModel:
    """A frozen model and its scoring, from a ``ReferenceSpec``: a reference actor's, or
    (``reference.placement`` learner) the copy a learner rank holds and scores its own chunks with. Sets
    nothing process-wide."""

    def __init__(self, spec: ReferenceSpec, device: str, where: str) -> None:
        self.backend, self.temperature, self.device = spec.backend, spec.temperature, device
        self.max_tokens_per_microbatch = spec.max_tokens_per_microbatch
        model_dir = as_source(spec.model).resolve(where)
        if spec.backend == "hf":
            from services.models import load_causal_lm

            # its weights keep requires_grad: scoring runs under no_grad, so no graph or gradient is built,
            # and on CPU in bf16 a forward over weights without it took twice as long (torch 2.13,
            # SmolLM2-135M over 32 x 76 tokens, 2 threads: 2.3 against 1.1 s; fp32 3.4 against 3.2 s)
            self.model = load_causal_lm(model_dir, spec.dtype).to(device)
            # packed scoring relies on the model masking across rows
            if spec.max_tokens_per_microbatch is not None:
                from services.packing_check import check_packing_isolation

                check_packing_isolation(self.model, self.model.config.vocab_size, where)
        elif spec.backend == "vllm":
            from actors.engines import VLLMEngine

            if spec.temperature != 1.0:
                raise ValueError("reference.backend='vllm' scores at temperature 1; use backend 'hf'")
            self.engine = VLLMEngine(model_dir, EngineSpec("vllm", 0, spec.max_model_len, spec.kv_cache_mib,
                                                           spec.dtype, None, device, spec.engine_args))
        else:
            raise ValueError(f"unknown reference backend {spec.backend!r}; expected 'hf' or 'vllm'")

    @torch.no_grad()
    def score(self, batch: RolloutBatch) -> torch.Tensor:
        """[B, T] log-probs of the tokens the model sampled (0 at padding and at environment tokens)."""
        if self.backend == "hf":
            from services.experience import packed_response_logprobs, response_forward

            if self.max_tokens_per_microbatch is not None:
                return packed_response_logprobs(self.model, batch, self.max_tokens_per_microbatch,
                                                self.temperature) * batch.action_mask
            logprobs, _, _ = response_forward(self.model, batch.to(self.device), self.temperature)
            return logprobs.cpu() * batch.action_mask
        sequences, prompt_lengths = [], []
        for p_ids, p_mask, r_ids, n in zip(batch.prompt_ids, batch.prompt_mask, batch.response_ids,
                                           batch.response_lengths, strict=True):
            prompt = p_ids[p_mask.bool()].tolist()
            sequences.append(prompt + r_ids[: int(n)].tolist())
            prompt_lengths.append(len(prompt))
        out = torch.zeros_like(batch.rollout_logprobs)
        for row, scored in enumerate(self.engine.score(sequences, prompt_lengths)):
            out[row, : len(scored)] = torch.tensor(scored)
        return out * batch.action_mask  # a trajectory's environment tokens carry no log-prob


class ReferenceActor(VersionedActor):
    role = "reference"

    @starting_up()
    def __init__(self, index: int, spec: ReferenceSpec) -> None:
        super().__init__(index)
        device = self.on_device(spec.device)
        if spec.torch_threads:
            torch.set_num_threads(spec.torch_threads)
        self.reference = ReferenceModel(spec, device, f"{self.role}-{index}")

    def score(self, batch: RolloutBatch) -> torch.Tensor:
        """[B, T] ref log-probs of the tokens the model sampled (0 at padding and at environment tokens)."""
        with self.busy():
            return self.reference.score(batch)


def check_teacher(teacher_path: str, policy_tokenizer) -> None:
    """Distillation compares the teacher's log-prob of each sampled token id with the student's: the two must
    give every id the same token. Checked on the driver, before any actor starts, when it sees
    ``teacher_path`` (a local directory); a hub id or a path only the nodes have is the user's to match."""
    from pathlib import Path

    directory = Path(teacher_path).expanduser()
    if not (directory / "config.json").is_file():
        return
    from services.models import load_tokenizer

    where = f"the teacher {teacher_path} (distill.teacher_path)"
    try:
        teacher_vocab = load_tokenizer(directory).get_vocab()
    except (OSError, ValueError) as err:
        raise ValueError(f"{where} has no tokenizer the student's can be compared with: {err}") from err
    student_vocab = policy_tokenizer.get_vocab()
    if teacher_vocab != student_vocab:
        differing = sorted(set(teacher_vocab.items()) ^ set(student_vocab.items()))[:3]
        raise ValueError(f"{where} has another vocabulary than the policy's ({len(teacher_vocab)} against "
                         f"{len(student_vocab)} tokens; differing (token, id) pairs such as {differing}): "
                         "its log-probs would be of other tokens")


class TeacherActor(ReferenceActor):
    """On-policy distillation's teacher: the log-probs of the student's sampled tokens under the teacher model
    (``distill.teacher_path``), scored as the reference scores them."""

    role = "teacher"
