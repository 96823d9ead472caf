"""vLLM worker extension that loads new policy weights in place.

``LLM(worker_extension_cls="actors.vllm_extension.WeightSyncExtension")`` mixes this class into every
vLLM worker; the rollout actor calls it through ``llm.collective_rpc``. ``reload_weights`` goes through
the model's own loader, so vLLM's CPU kernels get their repacked weights (plain ``load_weights`` does not
do that on CPU). Weights arrive as tensors (single-process engine) or safetensors bytes (multiprocess
engine): never pickled callables.

On GPU the weights come over NCCL instead: ``init_weight_sync_group`` joins the group whose rank 0 is
the learner (``learner.nccl_sync.WeightBroadcaster``), and ``receive_policy_weights`` receives the
packed buckets it broadcasts and streams them into ``reload_weights``. Only control messages (metadata,
sizes) go through ``collective_rpc``. CUDA and NCCL pieces are imported inside the methods.
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

    # ------------------------------------------------------------------------------ NCCL (GPU workers)

    def init_weight_sync_group(self, master_address: str, master_port: int, rank_offset: int,
                               world_size: int) -> None:
        """Join the learner's weight-sync group as ``rank_offset`` + this worker's rank in the engine.

        Collective: the learner builds its ``WeightBroadcaster`` (rank 0) at the same time, and every
        other worker of every engine in the group joins too.
        """
        from learner.nccl_sync import join_weight_sync_group

        # rank inside this engine's TP x PP group: the TP rank when pipeline parallelism is off
        engine_rank = self.vllm_config.parallel_config.rank  # type: ignore[attr-defined]
        device = self.device  # type: ignore[attr-defined]  # the worker's own CUDA device
        if device.type != "cuda":
            raise RuntimeError(f"NCCL weight sync needs a CUDA worker, this one runs on {device}; "
                               "use load_policy_weights instead")
        comm = join_weight_sync_group(master_address, master_port, rank_offset + engine_rank, world_size,
                                      device)
        self.attach_weight_sync_comm(comm)

    def attach_weight_sync_comm(self, comm) -> None:
        """Use ``comm`` (``broadcast(tensor, src)`` and ``device``) for ``receive_policy_weights``."""
        old = getattr(self, "_weight_sync_comm", None)
        if old is not None and old is not comm and hasattr(old, "destroy"):
            old.destroy()
        self._weight_sync_comm = comm

    def receive_policy_weights(self, metadata: list[tuple[str, str, list[int]]], bucket_bytes: int) -> int:
        """Receive the buckets rank 0 broadcasts for ``metadata`` and load them; returns the tensor count.

        Runs while the learner's ``WeightBroadcaster.broadcast`` sends the same tensors with the same
        ``bucket_bytes``. The caller resets the prefix cache afterwards, as for ``load_policy_weights``.

        Not one ``reload_weights`` per bucket: in ``model_loader/reload/inplace.py`` each call runs
        ``initialize_layerwise_reload`` -> ``model.load_weights`` -> ``finalize_layerwise_reload``, and
        the finalize step puts the old kernel tensors back on every layer that bucket did not load and
        processes a layer split across two buckets with only part of its weights. So one call gets an
        iterator that receives bucket k+1 only after the loader has taken all of bucket k: one reload
        session, with about one bucket (plus layers still waiting for their last weight) in memory.
        """
        from learner.nccl_sync import receive_buckets

        comm = getattr(self, "_weight_sync_comm", None)
        if comm is None:
            raise RuntimeError("receive_policy_weights before init_weight_sync_group")
        received = 0

        def counted():
            nonlocal received
            for item in receive_buckets(comm, metadata, bucket_bytes, src=0):
                received += 1
                yield item

        stream = counted()
        try:
            # one reload over a lazy bucket stream: each reload_weights call is a whole reload session
            self.reload_weights(weights_iterator=stream)  # type: ignore[attr-defined]
        finally:
            # the sender broadcasts every bucket: receive any the loader left unread (or all the rest
            # after a loader error), so rank 0 is not left blocked in NCCL
            for _ in stream:
                pass
        if received != len(metadata):
            raise RuntimeError(f"received {received} of {len(metadata)} tensors")
        return received
