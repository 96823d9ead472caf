"""vLLM worker extension that loads new policy weights in place (the object-store path).

``LLM(worker_extension_cls="actors.vllm_extension.WeightSyncExtension")`` mixes this class into every
vLLM worker; the rollout actor calls it through ``llm.collective_rpc``. ``reload_weights`` goes through
the model's own loader, so vLLM's CPU kernels get their repacked weights (plain ``load_weights`` does not
do that on CPU). Weights arrive as tensors (single-process engine) or safetensors bytes (multiprocess
engine): never pickled callables.

On GPU, ``learner.weight_sync: nccl | ipc`` uses vLLM's own weight transfer instead
(``learner/weight_transfer.py``); around it the extension records what was loaded.

Every sync is checked to have loaded every parameter of the engine's model: vLLM's layerwise reload keeps a
layer's old weights when no tensor reaches it and only logs "Failed to load weights" (and its in-place
reload only logs the parameters it did not load), so an engine could serve version v under the label v+1,
which a bf16 probe (tolerance 1.0) would not see. Both paths load through ``model.load_weights``, which
returns the names it loaded: recorded over one sync, they must cover ``model.named_parameters()``. A layer
with buffers and no parameters (RotaryEmbedding's ``cos_sin_cache``, computed at start) gets vLLM's warning
although it has no weights to load; it has no parameter, so the check does not count it.
"""

from __future__ import annotations


class WeightSyncExtension:
    def load_policy_weights(self, weights) -> list[str]:
        """Load a {name: tensor} dict, or its safetensors bytes, named as transformers saves them. Returns
        the model's parameters that it did not load (none when the sync is whole)."""
        if isinstance(weights, bytes | bytearray):
            from safetensors.torch import load

            weights = load(bytes(weights))
        self.begin_load_record()
        try:
            self.reload_weights(weights_iterator=iter(weights.items()))  # type: ignore[attr-defined]
        finally:
            missing = self.end_load_record()
        return missing

    def begin_load_record(self) -> None:
        """From now until ``end_load_record``, record the parameter names ``model.load_weights`` loads (an
        instance attribute over the model's method: vLLM's loaders call it, per bucket on the transfer
        path)."""
        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        loaded: set[str] = set()
        load_weights = model.load_weights

        def recording_load_weights(weights):
            names = load_weights(weights)
            loaded.update(names or ())
            return names

        self.load_record = (loaded, model.__dict__.get("load_weights"))
        model.load_weights = recording_load_weights

    def end_load_record(self) -> list[str]:
        """Stop recording; the model's parameters that no ``load_weights`` call loaded since the start."""
        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        loaded, own = self.__dict__.pop("load_record")
        if own is None:
            del model.load_weights  # the class's method again
        else:
            model.load_weights = own
        return sorted(name for name, _ in model.named_parameters() if name not in loaded)
