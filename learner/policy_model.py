"""The module the learner's engine trains: the policy LM with its value head (or a separate critic), and where
on the node a rank computes."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

if TYPE_CHECKING:
    from services.experience import Packed


class PolicyWithValueHead(nn.Module):
    """The causal LM plus a value head (hidden -> 2*hidden -> ReLU -> 1) on the last hidden state; without
    ``value_head`` (a critic-free ``ppo.advantage``) the LM alone, and no values."""

    def __init__(self, lm: nn.Module, critic: nn.Module | None = None, value_head: bool = True) -> None:
        super().__init__()
        self.lm = lm
        # critic: a separate copy of the LM whose last hidden state feeds the value head; None shares the
        # policy's
        self.critic = critic
        hidden = lm.config.hidden_size
        self.value_head = (nn.Sequential(nn.Linear(hidden, 2 * hidden), nn.ReLU(), nn.Linear(2 * hidden, 1))
                           if value_head else None)

    def forward(self, input_ids: Tensor | None, attention_mask: Tensor | None, position_ids: Tensor | None,
                prompt_width: int, packed: Packed | None = None) -> tuple[Tensor, Tensor | None]:
        """Returns (logits [B, T, V] predicting each response token, in the model's dtype and before any
        sampling temperature, values [B, T] or None without a head).
        ``packed``: the rows packed without padding (``learner.max_tokens_per_microbatch``) instead of the
        padded [B, P + T] inputs."""
        from services.experience import packed_logits, response_logits

        def run(model: nn.Module, hidden: bool) -> tuple[Tensor, Tensor | None]:
            if packed is not None:
                return packed_logits(model, packed, hidden)
            return response_logits(model, input_ids, attention_mask, position_ids, prompt_width,
                                   hidden=hidden)

        shared = self.value_head is not None and self.critic is None
        logits, hidden = run(self.lm, shared)
        if self.value_head is None:
            return logits, None
        if self.critic is not None:
            _, hidden = run(self.critic, True)
        return logits, self.value_head(hidden).squeeze(-1).float()


def local_gpu_index(assigned: list[str], visible: str | None, actor: str) -> int:
    """The first GPU Ray ``assigned`` this actor, as CUDA numbers it in this process: its position among
    ``visible`` (CUDA_VISIBLE_DEVICES). Ray sets that to the assigned ids, so it is 0; where Ray leaves it
    unset (RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES) every GPU is visible and it is the id itself."""
    if not assigned:
        raise RuntimeError(f"{actor}: the config gives it GPUs, but Ray assigned it none")
    if visible is None:
        return int(assigned[0])
    order = [device.strip() for device in visible.split(",")]
    if assigned[0] not in order:
        raise RuntimeError(f"{actor}: Ray assigned it GPU {assigned[0]}, but "
                           f"CUDA_VISIBLE_DEVICES={visible!r} "
                           "does not show it")
    return order.index(assigned[0])


def join_rendezvous(rank: int, world_size: int, master_addr: str, master_port: int, device: str,
                    where: str) -> torch.device:
    """The device learner rank ``rank`` computes on (``device`` as the config decided it; a CUDA role on a
    node without CUDA is named), with the environment DeepSpeed's rendezvous at ``master_addr:master_port``
    reads set. LOCAL_RANK is the GPU DeepSpeed and NCCL take, as CUDA numbers them in this process: Ray shows
    each rank only its own GPUs (CUDA_VISIBLE_DEVICES), so it is 0 unless every GPU stays visible here."""
    import os

    from actors.engines import check_device

    local_gpu = 0
    if device == "cuda":
        import ray

        local_gpu = local_gpu_index(ray.get_runtime_context().get_accelerator_ids().get("GPU", []),
                                    os.environ.get("CUDA_VISIBLE_DEVICES"), where)
    os.environ.update(MASTER_ADDR=master_addr, MASTER_PORT=str(master_port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(local_gpu))
    on_cuda = check_device(device, where, own_gpus_only=False) == "cuda"
    return torch.device("cuda", local_gpu) if on_cuda else torch.device("cpu")


def rendezvous_address() -> tuple[str, int]:
    """This node's IP and a free port, for a rank 0 to serve as the rendezvous."""
    import socket

    import ray

    with socket.socket() as s:
        s.bind(("", 0))
        return ray.util.get_node_ip_address(), s.getsockname()[1]
