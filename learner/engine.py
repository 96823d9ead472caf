"""The learner's training engines behind one small protocol (``TrainingEngine``), which ``learner.update``
drives:

- ``DeepSpeedEngine``: a rank's DeepSpeed ZeRO engine (stages 0-3, fp32 or bf16, gloo or NCCL);
- ``TorchEngine``: the same model and optimizer in plain torch, one process, no DeepSpeed (tests, the device
  check).

Both own the policy (``PolicyWithValueHead``), its forwards (padded, or packed by
``learner.max_tokens_per_microbatch``), the backward, the optimizer step with gradient clipping (it returns
the gradient's norm) and the learning rate. ``lockstep`` and ``agree`` are the one mechanism that keeps the
ranks' collectives in step: under ZeRO-3 every forward gathers parameters from all ranks, so every rank must
run as many; every gradient reduction pairs too."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from datetime import timedelta
from typing import TYPE_CHECKING, Protocol

import torch
from torch import Tensor, nn

from learner.policy_model import PolicyWithValueHead
from learner.ppo import DistributedReducer, Reducer
from services.logprobs import token_logprobs_and_entropy

if TYPE_CHECKING:
    from learner.plan import RankSpec
    from services.config import LearnerConfig, PPOConfig
    from services.experience import RolloutBatch

# (log-probs [B, T], values [B, T] or None, entropy [B, T] or None) of a batch's sampled response tokens
Forward = tuple[Tensor, Tensor | None, Tensor | None]


class TrainingEngine(Protocol):
    """What ``learner.update`` needs of an engine: a policy to run forwards of, and an optimizer to step."""

    rank: int
    world_size: int
    device: torch.device
    reducer: Reducer  # the algorithm layer's collectives: over every rank
    lm: nn.Module  # the policy's causal LM (LoRA's base reference turns its adapters off)

    def forward(self, batch: RolloutBatch, grad: bool) -> Forward: ...

    def backward(self, loss: Tensor, boundary: bool | None = None) -> None: ...

    def step(self) -> float | None: ...

    def set_lr(self, lr: float) -> None: ...

    def lr(self) -> float: ...

    def agree(self, count: int) -> int: ...

    def lockstep(self, forwards: int) -> contextlib.AbstractContextManager: ...

    def filler_backward(self, boundary: bool | None) -> None: ...


def placeholder_batch() -> RolloutBatch:
    """One prompt token and one response token (id 0): the cheapest forward a rank can join its peers with."""
    from services.experience import make_batch

    return make_batch([[0]], [[0]], [[0.0]], [0], [0], 0, 0, 0.0)


class PolicyEngine:
    """The forwards, the learning rate and the lockstep both engines share; ``module`` runs the policy
    (``PolicyWithValueHead``, or DeepSpeed's engine around it), ``optimizer`` steps it."""

    rank, world_size = 0, 1
    pairs_forwards = False  # ZeRO-3 over several ranks: every forward gathers parameters from all of them
    one_pack = False  # ZeRO-3: packed rows run as one pack, each forward's gathers paired across ranks

    def __init__(self, module, optimizer, device: torch.device, reducer: Reducer) -> None:
        self.module, self.optimizer, self.device, self.reducer = module, optimizer, device, reducer
        # DeepSpeed's engine holds the policy as its module
        self.policy: PolicyWithValueHead = getattr(module, "module", module)
        self.temperature = 1.0  # rollout.temperature: the learner scores at the engines' temperature
        self.budget: int | None = None  # learner.max_tokens_per_microbatch: packed forwards
        self.forwards_run = 0  # counted for ``lockstep``

    @property
    def lm(self) -> nn.Module:
        return self.policy.lm

    def forward(self, batch: RolloutBatch, grad: bool) -> Forward:
        """(log-probs [B, T], values [B, T] or None, entropy [B, T] or None) of ``batch``'s rows, at the
        engines' temperature; with ``grad`` the entropy too (no gradient), without it detached, log-probs and
        values on the CPU and no entropy. Packed (``max_tokens_per_microbatch``), the rows run in
        micro-batches of at most that many tokens (with gradients, those of the one step of ``single_step``,
        each graph kept for its backward; the PPO loop's micro-batches already fit); under ZeRO-3 as one pack,
        so that the ranks' forwards pair up."""
        from services.experience import plan_micro_batches, sequence_lengths

        if self.budget is not None and not self.one_pack:
            parts = plan_micro_batches(sequence_lengths(batch), self.budget)
            if len(parts) > 1:
                outputs = [self._forward(batch[part], grad) for part in parts]
                order = torch.cat(parts).argsort()  # the parts' rows back in the batch's order
                return tuple(None if out[0] is None else torch.cat(out)[order.to(out[0].device)]
                             for out in zip(*outputs, strict=True))
        return self._forward(batch, grad)

    def _forward(self, batch: RolloutBatch, grad: bool) -> Forward:
        from services.experience import model_inputs, pack

        self.forwards_run += 1
        with torch.set_grad_enabled(grad):
            if self.budget is not None:
                packed = pack(batch).to(self.device)
                logits, values = self.module(None, None, None, 0, packed=packed)
            else:
                input_ids, attention_mask, position_ids = (x.to(self.device) for x in model_inputs(batch))
                logits, values = self.module(input_ids, attention_mask, position_ids,
                                             batch.prompt_ids.shape[1])
            logprobs, entropy = token_logprobs_and_entropy(logits, batch.response_ids.to(self.device),
                                                           self.temperature, entropy=grad)
        if not grad:
            values = values.detach().cpu() if values is not None else None
            return logprobs.detach().cpu(), values, None
        return logprobs, values, entropy

    def sequence_logprobs(self, sequences: list[list[int]], prompt_lengths: list[int]) -> list[list[float]]:
        """The policy's log-probs (temperature 1) of each sequence's tokens after its first
        ``prompt_lengths``: what the probe compares with the engines' after a sync."""
        from services.experience import make_batch

        prompts = [s[:p] for s, p in zip(sequences, prompt_lengths, strict=True)]
        responses = [s[p:] for s, p in zip(sequences, prompt_lengths, strict=True)]
        batch = make_batch(prompts, responses, [[0.0] * len(r) for r in responses], [0] * len(prompts),
                           list(range(len(prompts))), 0, 0, 0.0)
        saved, self.temperature = self.temperature, 1.0
        try:
            logprobs, _, _ = self.forward(batch, grad=False)
        finally:
            self.temperature = saved
        return [row[: len(r)].tolist() for row, r in zip(logprobs, responses, strict=True)]

    def set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:  # after any checkpoint load: the schedule decides
            group["lr"] = lr

    def agree(self, count: int) -> int:
        """The most ``count`` of any rank (each calls it once, at the same point)."""
        return count

    @contextlib.contextmanager
    def lockstep(self, forwards: int) -> Iterator[None]:
        """A round of ``forwards`` forwards without gradients on this rank (at most): where forwards pair up
        across ranks, every rank runs as many as the rank with the most, the missing ones on a placeholder at
        the end."""
        if not self.pairs_forwards:
            yield
            return
        wanted, start = self.agree(forwards), self.forwards_run
        yield
        ran = self.forwards_run - start
        if ran > wanted:
            raise ValueError(f"rank {self.rank}: ran {ran} forwards but the round has only {wanted}")
        for _ in range(wanted - ran):
            self._forward(placeholder_batch(), grad=False)

    def filler_backward(self, boundary: bool | None) -> None:
        """A micro-batch this rank does not have, where another rank has one: a forward and backward of
        nothing (a loss of 0 with the graph of every output), so that the ranks' gathers and reductions pair
        up."""
        logprobs, values, _ = self._forward(placeholder_batch(), grad=True)
        self.backward(0.0 * logprobs.sum() + (0.0 * values.sum() if values is not None else 0.0), boundary)


def build_policy(model_dir: str, learner: LearnerConfig, has_critic: bool, seed: int) -> PolicyWithValueHead:
    """The policy of ``model_dir`` in fp32 (the master weights; bf16 is the engine's), with LoRA's adapters
    where ``learner.lora`` asks, and a value head (or a separate critic) with ``has_critic``, initialised from
    ``seed``."""
    from services.models import load_causal_lm

    torch.manual_seed(seed)  # the same value-head init on every rank
    separate = has_critic and learner.critic == "separate"
    # sdpa is transformers' default; auto is resolved by a job's plan, and is the default elsewhere (tests)
    attention = "eager" if learner.attention == "eager" else None
    critic = load_causal_lm(model_dir, "float32", attention) if separate else None
    lm = load_causal_lm(model_dir, "float32", attention)
    if learner.lora.rank > 0:  # only the adapters train (and a value head or critic, when there is one)
        from learner.lora import add_adapters

        lm = add_adapters(lm, learner.lora)
    return PolicyWithValueHead(lm, critic, value_head=has_critic)


def build_optimizer(parameters: list[nn.Parameter], ppo: PPOConfig, on_gpu: bool) -> torch.optim.Optimizer:
    """AdamW over the trained ``parameters``: on CPU fused (torch's default steps one tensor at a time, about
    3x slower there), on CUDA its default, foreach."""
    from torch.optim import AdamW

    return AdamW(parameters, lr=ppo.lr, betas=tuple(ppo.adam_betas), weight_decay=ppo.weight_decay, eps=1e-8,
                 fused=None if on_gpu else True)


class TorchEngine(PolicyEngine):
    """The policy trained with plain torch in one process, built as a rank builds it (``build``), the
    gradients clipped by ``ppo.max_grad_norm``: what tests and the device check drive ``learner.update``
    with."""

    def __init__(self, policy: PolicyWithValueHead, ppo: PPOConfig, device: torch.device | str = "cpu",
                 temperature: float = 1.0, max_tokens_per_microbatch: int | None = None) -> None:
        device = torch.device(device)
        policy.to(device)
        self.trained_parameters = [p for p in policy.parameters() if p.requires_grad]
        optimizer = build_optimizer(self.trained_parameters, ppo, device.type == "cuda")
        super().__init__(policy, optimizer, device, Reducer())
        self.temperature, self.budget = temperature, max_tokens_per_microbatch
        self.max_grad_norm = ppo.max_grad_norm

    @classmethod
    def build(cls, model_dir: str, spec: RankSpec, device: torch.device | str = "cpu") -> TorchEngine:
        """The engine a rank of ``spec`` would build (``RankSpec.of``), in this process."""
        policy = build_policy(model_dir, spec.learner, spec.algorithm.has_critic, spec.seed)
        return cls(policy, spec.algorithm.ppo, device, spec.temperature,
                   spec.learner.max_tokens_per_microbatch)

    def backward(self, loss: Tensor, boundary: bool | None = None) -> None:
        loss.backward()

    def step(self) -> float | None:
        norm = torch.nn.utils.clip_grad_norm_(self.trained_parameters, self.max_grad_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(norm)

    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])


def clips_gradients_itself(learner: LearnerConfig) -> bool:
    """fp32 without ZeRO: each step clips the gradients itself, which gives their norm for the metric once;
    DeepSpeed's own clipping would compute it a second time."""
    return not learner.zero_stage and learner.dtype == "float32"


class DeepSpeedEngine(PolicyEngine):
    """A learner rank's DeepSpeed ZeRO engine, joined to its peers' process group (``build``)."""

    def __init__(self, engine, learner: LearnerConfig, ppo: PPOConfig, rank: int, world_size: int,
                 device: torch.device) -> None:
        super().__init__(engine, engine.optimizer, device, DistributedReducer(device))
        self.engine, self.budget = engine, learner.max_tokens_per_microbatch
        self.trained_parameters = [p for p in engine.module.parameters() if p.requires_grad]
        self.rank, self.world_size, self.zero3 = rank, world_size, learner.zero_stage == 3
        self.pairs_forwards, self.one_pack = self.zero3 and world_size > 1, self.zero3
        self.clips_itself = clips_gradients_itself(learner)
        self.max_grad_norm = ppo.max_grad_norm

    @classmethod
    def build(cls, model_dir: str, spec: RankSpec, rank: int, world_size: int,
              device: torch.device) -> DeepSpeedEngine:
        """The engine of rank ``rank`` of ``spec`` (``RankSpec.of``) over the policy in ``model_dir``, once
        this process's rendezvous environment is set (MASTER_ADDR, RANK, ...)."""
        import deepspeed

        learner, ppo = spec.learner, spec.algorithm.ppo

        on_gpu = device.type == "cuda"
        if not on_gpu:
            from services.private_api import skip_unused_deepspeed_ops

            skip_unused_deepspeed_ops()  # gloo needs none of the ops DeepSpeed would JIT-build at its init
        # rendezvous and every later collective give up after this, instead of hanging
        deepspeed.init_distributed(dist_backend="nccl" if on_gpu else "gloo", auto_mpi_discovery=False,
                                   timeout=timedelta(seconds=learner.collective_timeout_s))
        model = build_policy(model_dir, learner, spec.algorithm.has_critic, spec.seed)
        trained = [p for p in model.parameters() if p.requires_grad]
        optimizer = build_optimizer(trained, ppo, on_gpu)
        micro = ppo.minibatch_size // world_size
        clips_itself = clips_gradients_itself(learner)
        ds_config = {
            "train_micro_batch_size_per_gpu": micro,
            "gradient_accumulation_steps": 1,
            "train_batch_size": micro * world_size,
            "gradient_clipping": 0.0 if clips_itself else ppo.max_grad_norm,
            "zero_optimization": {"stage": learner.zero_stage},
            "zero_allow_untested_optimizer": True,
            "bf16": {"enabled": learner.dtype == "bfloat16"},
            "steps_per_print": 10**9,
            "wall_clock_breakdown": False,
        }
        engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
        if clips_itself and world_size == 1:  # one rank: DeepSpeed's all-reduce of the gradients is a copy
            engine.enable_backward_allreduce = False
        if learner.max_tokens_per_microbatch:  # packed forwards rely on the model masking across sequences
            from services.packing_check import check_packing_isolation

            check_packing_isolation(model.lm, model.lm.config.vocab_size, f"learner-rank-{rank}")
        built = cls(engine, learner, ppo, rank, world_size, device)
        built.temperature = spec.temperature
        return built

    def backward(self, loss: Tensor, boundary: bool | None = None) -> None:
        if boundary is not None:  # one optimizer step accumulates the minibatch's micro-batches
            self.engine.set_gradient_accumulation_boundary(boundary)
        self.engine.backward(loss)

    def step(self) -> float | None:
        """The optimizer step; the gradient's norm before clipping (``ppo.max_grad_norm``): DeepSpeed's
        optimizers under ZeRO and in bf16 report it; an fp32 step without ZeRO clips the (reduced) gradients
        here."""
        norm = None
        if self.clips_itself:  # a parameter without a gradient (unused this step) is left out by torch
            norm = torch.nn.utils.clip_grad_norm_(self.trained_parameters, self.max_grad_norm)
        self.engine.step()
        norm = self.engine.get_global_grad_norm() or norm
        return None if norm is None else float(norm)

    def lr(self) -> float:
        return float(self.engine.get_lr()[0])

    def agree(self, count: int) -> int:
        if self.world_size == 1:
            return count
        import torch.distributed as dist

        most = torch.tensor([count], dtype=torch.long, device=self.device)
        dist.all_reduce(most, op=dist.ReduceOp.MAX)
        return int(most)

    def gathered(self) -> contextlib.AbstractContextManager:
        """The policy's full parameters inside (ZeRO-3 gathers them from every rank: collective)."""
        import deepspeed

        return deepspeed.zero.GatheredParameters(list(self.lm.parameters()), modifier_rank=None,
                                                 enabled=self.zero3)

    def policy_weights(self, dtype: str, adapter: bool, merged: bool):
        """Inside ``gathered()``: the full policy weights (HF names) as ``HostWeights`` in ``dtype`` on rank 0
        (views of the live parameters where the dtype matches: copy them before the context ends), None
        elsewhere. ``adapter``: the LoRA adapter alone, with its config; ``merged``: LoRA merged into the base
        weights."""
        from learner.lora import adapter_state, merged_state_dict
        from services.weights import HostWeights

        if self.rank != 0:
            return None
        if adapter:
            state, adapter_config = adapter_state(self.lm)
            return HostWeights(state, getattr(torch, dtype), adapter_config)
        state = merged_state_dict(self.lm) if merged else self.lm.state_dict()
        return HostWeights(state, getattr(torch, dtype))
