"""vLLM worker extension that loads new policy weights in place (the object-store path).

``LLM(worker_extension_cls="actors.vllm_extension.WeightSyncExtension")`` mixes this class into every
vLLM worker; the rollout actor calls it through ``llm.collective_rpc``. ``reload_weights`` goes through
the model's own loader, so vLLM's CPU kernels get their repacked weights (plain ``load_weights`` does not
do that on CPU). Weights arrive as tensors (single-process engine) or safetensors bytes (multiprocess
engine): never pickled callables.

On GPU, ``learner.weight_sync: nccl | ipc`` uses vLLM's own weight transfer instead
(``learner/weight_transfer.py``), which needs no extension.
"""

from __future__ import annotations


class WeightSyncExtension:
    def load_policy_weights(self, weights) -> int:
        """Load a {name: tensor} dict, or its safetensors bytes, named as transformers saves them."""
        if isinstance(weights, bytes | bytearray):
            from safetensors.torch import load

            weights = load(bytes(weights))
        self.reload_weights(weights_iterator=iter(weights.items()))  # type: ignore[attr-defined]
        return len(weights)
