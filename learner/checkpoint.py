"""Checkpoints: every rank's DeepSpeed engine (policy, value head, optimizer) plus the driver's state
(iteration, policy version, KL controller, prompt cursor, resolved config), in the run's storage.

Layout: ``checkpoints/iter-N/`` holds ``learner/`` (the ranks' DeepSpeed files), ``driver.json`` and
``manifest.json`` (sha256 and bytes of every other file); ``checkpoints/latest`` names the newest one.
Each rank saves into node-local scratch and uploads its files, reporting their sha256 and size. The
driver checks that every reported file is in the storage with that size, writes ``driver.json``, and
only then the manifest (the seal: object stores have no directory rename) and the ``latest`` pointer.
A checkpoint without a manifest is never resumed. Ranks verify every file they download against it.
"""

from __future__ import annotations

import hashlib
import json

from services.config import FOLLOWED_DEFAULTS, JobConfig, follow
from services.errors import TetherError
from services.storage import RunStorage

# settings a resumed run may change; anything else must match the checkpoint's config
# run.output_dir: a run directory moved elsewhere (another mount point, another bucket) resumes there
# learner.lora.reference: the base model's log-probs from the learner's forward or from a reference actor,
#   the same KL
# reference.placement, reward.placement: the same scoring in an actor of its own or in the learner ranks
# learner.attention: the same attention by another kernel (auto measures again on resume)
RESUMABLE_CHANGES = ("run.iterations", "run.resume", "run.overwrite", "run.eval_every",
                     "run.eval_before_training", "run.output_dir", "cluster", "metrics", "checkpoint",
                     "run.probe_every", "learner.torch_threads", "learner.world_size", "learner.attention",
                     "learner.lora.reference", "reference.placement", "reward.placement")


class CheckpointError(TetherError, RuntimeError):
    pass


def checkpoint_name(iteration: int) -> str:
    return f"iter-{iteration:06d}"


def begin(run: RunStorage, iteration: int) -> RunStorage:
    """An empty ``checkpoints/iter-N`` (a leftover one, unsealed or sealed, is removed first)."""
    ckpt = run.child("checkpoints", checkpoint_name(iteration))
    ckpt.remove()
    return ckpt


def commit(run: RunStorage, ckpt: RunStorage, rank_files: list[dict], driver_state: dict,
           keep: int) -> RunStorage:
    """Seal ``ckpt``: check every file the ranks reported ({relative path: {sha256, bytes}}) is there with
    its size, write driver.json and then the manifest, move ``latest``, prune old checkpoints."""
    manifest: dict[str, dict] = {}
    for rank, files in enumerate(rank_files):
        for name, entry in files.items():
            if name in manifest:
                raise CheckpointError(f"checkpoint {ckpt}: file {name} was written by two learner ranks")
            size = ckpt.size(name)
            if size is None:
                raise CheckpointError(f"checkpoint {ckpt} not sealed: learner rank {rank}'s file "
                                      f"{ckpt.display(name)} is missing from the storage")
            if size != entry["bytes"]:
                raise CheckpointError(f"checkpoint {ckpt} not sealed: learner rank {rank}'s file "
                                      f"{ckpt.display(name)} has {size} bytes in the storage, the rank wrote "
                                      f"{entry['bytes']}")
            manifest[name] = {"sha256": entry["sha256"], "bytes": entry["bytes"]}
    state = json.dumps(driver_state, indent=2).encode()
    ckpt.write_bytes(state, "driver.json")
    manifest["driver.json"] = {"sha256": hashlib.sha256(state).hexdigest(), "bytes": len(state)}
    ckpt.write_text(json.dumps(dict(sorted(manifest.items())), indent=1), "manifest.json")
    name = ckpt.path().rsplit("/", 1)[-1]
    run.write_text(name + "\n", "checkpoints", "latest")
    sealed = [n for n in run.listdir("checkpoints") if n.startswith("iter-") and run.exists("checkpoints", n,
                                                                                            "manifest.json")]
    for old in sealed[:-keep]:
        run.remove("checkpoints", old)
    for unsealed in set(run.listdir("checkpoints")) - set(sealed) - {"latest", name}:
        if unsealed.startswith("iter-") and unsealed < name:  # a save that died before its seal
            run.remove("checkpoints", unsealed)
    return ckpt


def resolve(run: RunStorage, resume: str) -> RunStorage:
    """``latest`` (through the pointer) or an explicit checkpoint directory (a path or a URI)."""
    if resume == "latest":
        if not run.isfile("checkpoints", "latest"):
            raise CheckpointError("--run.resume latest: no checkpoint pointer at "
                                  f"{run.display('checkpoints', 'latest')}")
        ckpt = run.child("checkpoints", run.read_text("checkpoints", "latest").strip())
    else:
        ckpt = RunStorage(resume)
    if not ckpt.isdir():
        raise CheckpointError(f"checkpoint directory {ckpt} does not exist")
    return ckpt


def read_manifest(ckpt: RunStorage) -> dict:
    """{relative path: {sha256, bytes}}; a checkpoint without a readable manifest is refused, naming it."""
    try:
        return json.loads(ckpt.read_text("manifest.json"))
    except FileNotFoundError as err:
        raise CheckpointError(f"checkpoint {ckpt} is incomplete: {ckpt.display('manifest.json')} "
                              "is missing") from err
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"checkpoint manifest {ckpt.display('manifest.json')} is corrupt: "
                              f"{err}") from err


def verify(ckpt: RunStorage) -> dict:
    """Check every file's presence and size against the manifest, and driver.json's sha256; return the
    driver state. The ranks check the sha256 of what they download. Errors name the file."""
    manifest = read_manifest(ckpt)
    for name, entry in manifest.items():
        size = ckpt.size(name)
        if size is None:
            raise CheckpointError(f"checkpoint file {ckpt.display(name)} is missing")
        if size != entry["bytes"]:
            raise CheckpointError(f"checkpoint file {ckpt.display(name)} is truncated or changed: "
                                  f"{size} bytes, expected {entry['bytes']}")
    if "driver.json" not in manifest:
        raise CheckpointError(f"checkpoint manifest {ckpt.display('manifest.json')} does not list "
                              "driver.json")
    state = ckpt.read_bytes("driver.json")
    if hashlib.sha256(state).hexdigest() != manifest["driver.json"]["sha256"]:
        raise CheckpointError(f"checkpoint file {ckpt.display('driver.json')} is corrupt: its sha256 "
                              "does not match the manifest")
    try:
        return json.loads(state)
    except json.JSONDecodeError as err:
        raise CheckpointError(f"checkpoint file {ckpt.display('driver.json')} is corrupt: {err}") from err


def _flatten(tree: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(_flatten(value, name + "."))
        else:
            flat[name] = value
    return flat


def keep_followed_defaults(saved: dict, cfg: JobConfig) -> None:
    """A resume keeps what the run's followed defaults were (``JobConfig.followed_defaults``): an unset
    ``ppo.lr``, ``ppo.epochs``, ``ppo.minibatch_size`` or ``rollout.chunk_size`` takes the checkpoint's value,
    which a version of tether with other defaults may have resolved differently, and ``learner.dtype`` auto
    the dtype it chose."""
    for section, name, _ in FOLLOWED_DEFAULTS:
        holder, value = getattr(cfg, section), saved.get(section, {}).get(name)
        if value is not None and name not in holder.model_fields_set and getattr(holder, name) != value:
            follow(holder, name, value)
    if cfg.learner.dtype == "auto":  # the dtype the run's auto chose: a resume does not measure again
        follow(cfg.learner, "dtype", saved.get("learner", {}).get("dtype", "float32"))


def check_compatible(saved: dict, cfg: JobConfig, ckpt: RunStorage) -> None:
    """Refuse a checkpoint whose config differs from ``cfg`` in anything that shapes the run. A setting
    the old checkpoint does not know (added to the config since) is compatible when it has its default."""
    old, new = _flatten(saved), _flatten(cfg.model_dump(mode="json"))
    defaults = _flatten(type(cfg).model_construct().model_dump(mode="json"))
    allowed = lambda key: any(key == a or key.startswith(a + ".") for a in RESUMABLE_CHANGES)
    new_at_default = lambda key: key not in old and key in defaults and new.get(key) == defaults[key]
    differing = sorted(k for k in set(old) | set(new)
                       if not allowed(k) and not new_at_default(k) and old.get(k) != new.get(k))
    if differing:
        details = ", ".join(f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in differing[:8])
        raise CheckpointError(f"checkpoint {ckpt.display('driver.json')} was written by an incompatible "
                              f"config ({details})")
