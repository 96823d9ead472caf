"""Checkpoints: every rank's DeepSpeed engine (policy, value head, optimizer) plus the driver's state
(iteration, policy version, KL controller, prompt cursor, resolved config).

Written atomically: into ``checkpoints/.tmp-iter-N``, sealed with a manifest of sha256 sums, renamed to
``checkpoints/iter-N``, and only then is the ``latest`` pointer replaced. Loading verifies every file
against the manifest, so a truncated or corrupted checkpoint is named, never silently skipped.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

from learner.config import JobConfig

# settings a resumed run may change; anything else must match the checkpoint's config
RESUMABLE_CHANGES = ("run.iterations", "run.resume", "run.overwrite", "run.eval_every", "cluster", "metrics",
                     "checkpoint", "run.probe_every", "learner.torch_threads")


class CheckpointError(RuntimeError):
    pass


def checkpoints_dir(run_path: Path) -> Path:
    return run_path / "checkpoints"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def begin(run_path: Path, iteration: int) -> Path:
    """A fresh temporary directory for the checkpoint of ``iteration``."""
    tmp = checkpoints_dir(run_path) / f".tmp-iter-{iteration:06d}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    return tmp


def commit(run_path: Path, tmp: Path, iteration: int, driver_state: dict, keep: int) -> Path:
    """Seal ``tmp`` (driver state + manifest), rename it into place, move ``latest``, prune old ones."""
    (tmp / "driver.json").write_text(json.dumps(driver_state, indent=2))
    files = sorted(p for p in tmp.rglob("*") if p.is_file())
    manifest = {str(p.relative_to(tmp)): {"sha256": _sha256(p), "bytes": p.stat().st_size} for p in files}
    (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1))
    final = checkpoints_dir(run_path) / f"iter-{iteration:06d}"
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    pointer = checkpoints_dir(run_path) / ".latest.tmp"
    pointer.write_text(final.name + "\n")
    os.replace(pointer, checkpoints_dir(run_path) / "latest")
    kept = sorted(p for p in checkpoints_dir(run_path).glob("iter-*") if p.is_dir())
    for old in kept[:-keep]:
        shutil.rmtree(old)
    return final


def resolve(run_path: Path, resume: str) -> Path:
    """``latest`` (through the pointer) or an explicit checkpoint directory."""
    if resume == "latest":
        pointer = checkpoints_dir(run_path) / "latest"
        if not pointer.is_file():
            raise CheckpointError(f"--run.resume latest: no checkpoint pointer at {pointer}")
        path = checkpoints_dir(run_path) / pointer.read_text().strip()
    else:
        path = Path(resume)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint directory {path} does not exist")
    return path


def verify(path: Path) -> dict:
    """Check every file against the manifest; return the driver state. Errors name the file."""
    manifest_path = path / "manifest.json"
    try:
        manifest = json.loads(manifest_path.read_text())
    except FileNotFoundError as err:
        raise CheckpointError(f"checkpoint {path} is incomplete: {manifest_path} is missing") from err
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"checkpoint manifest {manifest_path} is corrupt: {err}") from err
    for name, entry in manifest.items():
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"checkpoint file {file} is missing")
        size = file.stat().st_size
        if size != entry["bytes"]:
            raise CheckpointError(f"checkpoint file {file} is truncated or changed: {size} bytes, expected {entry['bytes']}")
        if _sha256(file) != entry["sha256"]:
            raise CheckpointError(f"checkpoint file {file} is corrupt: its sha256 does not match the manifest")
    try:
        return json.loads((path / "driver.json").read_text())
    except json.JSONDecodeError as err:
        raise CheckpointError(f"checkpoint file {path / 'driver.json'} is corrupt: {err}") from err


def _flatten(tree: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(_flatten(value, name + "."))
        else:
            flat[name] = value
    return flat


def check_compatible(saved: dict, cfg: JobConfig, path: Path) -> None:
    """Refuse a checkpoint whose config differs from ``cfg`` in anything that shapes the run."""
    old, new = _flatten(saved), _flatten(cfg.model_dump(mode="json"))
    allowed = lambda key: any(key == a or key.startswith(a + ".") for a in RESUMABLE_CHANGES)
    differing = sorted(k for k in set(old) | set(new) if not allowed(k) and old.get(k) != new.get(k))
    if differing:
        details = ", ".join(f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in differing[:8])
        raise CheckpointError(f"checkpoint {path / 'driver.json'} was written by an incompatible config ({details})")
