"""A learner rank's DeepSpeed state in the run's checkpoint storage, and the policy exported as a Hugging
Face model directory: what ``LearnerRank.save_checkpoint``, ``load_checkpoint`` and ``export_hf`` run.

Each rank writes and reads node-local scratch and moves files through ``services.storage.RunStorage``, so
the ranks need not share a file system with the driver or with each other.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from learner.checkpoint import CheckpointError
from learner.lora import merged_state_dict
from services.storage import RunStorage, scratch_dir, sha256_file


def save(engine, rank: int, storage_url: str) -> dict:
    """Save this rank's DeepSpeed files into node-local scratch and upload them under ``learner/`` of
    the checkpoint storage ``storage_url``. Returns {relative path: {sha256, bytes}} of what it uploaded."""
    ckpt = RunStorage(storage_url)
    scratch = scratch_dir(f"tether-save-rank{rank}-")
    try:
        engine.save_checkpoint(scratch, tag="learner", save_latest=False)
        files = {}
        for file in sorted(p for p in Path(scratch).rglob("*") if p.is_file()):
            name = file.relative_to(scratch).as_posix()
            files[name] = {"sha256": sha256_file(file), "bytes": file.stat().st_size}
            ckpt.upload(file, name)
        return files
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def load(engine, rank: int, world_size: int, storage_url: str, manifest: dict, saved_world_size: int) -> None:
    """Download what this rank needs from the checkpoint storage into node-local scratch, verifying
    each file's sha256 against ``manifest``, and load it. A checkpoint of ``saved_world_size`` ranks
    other than this group's loads through DeepSpeed's universal checkpoint, converted here from all
    ranks' files (ZeRO 1-3 and bf16; fp32 ZeRO-0 keeps the whole optimizer state in rank 0's model
    states, which every rank reads)."""
    ckpt = RunStorage(storage_url)
    # ZeRO 1-3 and bf16 split the optimizer state into per-rank files; fp32 ZeRO-0 keeps it whole
    partitioned = any(n.endswith("optim_states.pt") for n in manifest)
    resized = saved_world_size != world_size
    own = lambda name: "zero_pp_rank_" not in name or f"zero_pp_rank_{rank}_" in name
    wanted = [n for n in sorted(manifest) if n.startswith("learner/") and (resized or own(n))]
    scratch = scratch_dir(f"tether-load-rank{rank}-")
    try:
        for name in wanted:
            local = os.path.join(scratch, name)
            ckpt.download(local, name)
            if sha256_file(local) != manifest[name]["sha256"]:
                raise CheckpointError(f"checkpoint file {ckpt.display(name)} is corrupt: its sha256 does "
                                      f"not match the manifest")
        if resized and partitioned:
            try:
                load_dir = to_universal(os.path.join(scratch, "learner"), os.path.join(scratch, "universal"))
            except Exception as err:
                raise CheckpointError(f"checkpoint {ckpt} of {saved_world_size} learner ranks cannot be "
                                      f"re-partitioned for {world_size} through DeepSpeed's universal "
                                      f"checkpoint: {err!r}; resume with learner.world_size="
                                      f"{saved_world_size}") from err
            engine._config.load_universal_checkpoint = True
        else:
            load_dir = scratch
        try:
            load_path, _ = engine.load_checkpoint(load_dir, tag="learner")
        finally:
            engine._config.load_universal_checkpoint = False
        if load_path is None:
            raise CheckpointError(f"rank {rank}: no DeepSpeed checkpoint under {ckpt.display('learner')}")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def export_hf(lm, rank: int, zero3: bool, lora: bool, model_dir: str, storage_url: str) -> None:
    """Rank 0 writes the policy LM (``save_pretrained``: safetensors + config) and the tokenizer it was
    set up with (from ``model_dir``) into node-local scratch and uploads them to ``storage_url``. Collective
    under ZeRO-3."""
    import deepspeed

    from services.models import load_tokenizer

    with deepspeed.zero.GatheredParameters(list(lm.parameters()), modifier_rank=None, enabled=zero3):
        if rank != 0:
            return
        scratch = scratch_dir("tether-export-")
        try:
            if lora:  # the merged model, and the adapter in PEFT's format beside it (adapter/)
                lm.save_pretrained(f"{scratch}/adapter")
                lm.get_base_model().save_pretrained(scratch, state_dict=merged_state_dict(lm),
                                                    safe_serialization=True)
            else:
                lm.save_pretrained(scratch, safe_serialization=True)
            load_tokenizer(model_dir).save_pretrained(scratch)
            target = RunStorage(storage_url)
            target.remove()
            for file in sorted(p for p in Path(scratch).rglob("*") if p.is_file()):
                target.upload(file, file.relative_to(scratch).as_posix())
        finally:
            shutil.rmtree(scratch, ignore_errors=True)


def to_universal(ds_dir: str, out_root: str) -> str:
    """DeepSpeed's rank-count-independent form of the checkpoint in ``ds_dir``; returns the load dir
    (its tag is ``learner``)."""
    from argparse import Namespace

    from deepspeed.checkpoint.ds_to_universal import main as ds_to_universal

    out = os.path.join(out_root, "learner")
    ds_to_universal(Namespace(input_folder=ds_dir, output_folder=out, num_extract_workers=1,
                              num_merge_workers=1, keep_temp_folder=False, strict=True,
                              inject_missing_state=True))
    return out_root
