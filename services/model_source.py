"""Where an actor finds a model, on whatever node it runs (no driver-local path crosses a process).

A model is one of:
- a directory every node has (baked into the image, or on a shared volume), named by ``model.path``;
- a Hugging Face Hub id, resolved through the node's HF cache (``HF_HUB_OFFLINE=1`` never downloads);
- files the driver produced itself (the SFT warm start, the GGUF conversion). Those are identified by a
  content hash. A node that sees the driver's directory with that hash uses it in place; any other node
  gets the files through the Ray object store and keeps them in ``<cache_dir>/models/<hash>``.

Errors name the node, the role and what is missing.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import socket
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from services.errors import TetherError

HASH_FILE = ".tether-content-hash"


class ModelNotFoundError(TetherError, FileNotFoundError):
    pass


def node_name() -> str:
    """``host (ip)`` of this process's Ray node, for error messages."""
    try:
        import ray

        if not ray.is_initialized():
            return f"node {socket.gethostname()}"
        ip = ray.util.get_node_ip_address()
    except Exception:  # noqa: BLE001 - a name for a message; never the reason a check fails
        ip = "?"
    return f"node {socket.gethostname()} ({ip})"


def content_hash(directory: Path) -> str:
    """sha256 over every file's relative path and bytes (the hash file itself excluded), cached in the
    directory so that a large model is hashed once."""
    cached = directory / HASH_FILE
    if cached.is_file():
        return cached.read_text().strip()
    digest = hashlib.sha256()
    for path in sorted(p for p in directory.rglob("*") if p.is_file() and p.name != HASH_FILE):
        digest.update(str(path.relative_to(directory)).encode() + b"\0")
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    value = digest.hexdigest()[:24]
    tmp = directory / f".{HASH_FILE}.{os.getpid()}"
    tmp.write_text(value + "\n")
    os.replace(tmp, cached)
    return value


def read_files(directory: Path) -> dict[str, bytes]:
    """Every file of ``directory`` by relative path: what the driver puts in the object store."""
    return {str(p.relative_to(directory)): p.read_bytes()
            for p in sorted(directory.rglob("*")) if p.is_file()}


def looks_like_hub_id(name: str) -> bool:
    return name.count("/") == 1 and not name.startswith((".", "/", "~")) and " " not in name


@dataclass
class ModelSource:
    """A model as every node can reach it. ``location`` is a path or hub id; for driver-made files it is
    the driver's own directory, used only where it holds the same ``content_hash``."""

    location: str
    content_hash: str | None = None
    cache_dir: str = "~/.cache/tether"  # on each node (``~`` is that node's home): shipped models go here
    files: object | None = field(default=None, repr=False)  # ObjectRef of {relative path: bytes}

    @classmethod
    def configured(cls, path_or_id: str) -> ModelSource:
        """``model.path``: a directory every node has, or a hub id."""
        return cls(path_or_id)

    @classmethod
    def produced(cls, directory: Path, cache_dir: str) -> ModelSource:
        """Files the driver made: shipped to nodes that do not see ``directory`` (see ``ship``)."""
        return cls(str(directory), content_hash(directory), cache_dir)

    @property
    def shippable(self) -> bool:
        return self.content_hash is not None

    def ship(self) -> None:
        """Put the files in the object store once; every node that lacks them reads them from there."""
        import ray

        if self.shippable and self.files is None:
            self.files = ray.put(read_files(Path(self.location)))

    def check(self) -> str:
        """On this node: 'local' (a directory here), 'cached' (hub cache or an earlier shipment), or
        'ship' (driver-made files that must come through the object store). Raises ModelNotFoundError."""
        if self.shippable:
            if (_holds(Path(self.location), self.content_hash)
                    or _holds(self._cache_path(), self.content_hash)):
                return "local"
            return "ship"
        self.resolve()
        return "local" if Path(self.location).expanduser().is_dir() else "cached"

    def resolve(self, role: str = "") -> str:
        """A local directory holding the model on this node, materialised from the object store if
        needed (cached by content hash)."""
        where = f"{node_name()}" + (f", role {role}" if role else "")
        if self.shippable:
            for candidate in (Path(self.location), self._cache_path()):
                if _holds(candidate, self.content_hash):
                    return str(candidate)
            if self.files is None:
                raise ModelNotFoundError(
                    f"{where}: the model the driver made at {self.location} (content {self.content_hash}) is "
                    f"not on this node and was not shipped")
            return str(self._materialise())
        path = Path(self.location).expanduser()
        if path.is_dir():
            if not (path / "config.json").is_file():
                raise ModelNotFoundError(f"{where}: model.path {path} is not a Hugging Face model directory "
                                         "(no config.json)")
            return str(path)
        if looks_like_hub_id(self.location):
            return _hub_snapshot(self.location, where)
        raise ModelNotFoundError(
            f"{where}: model.path {self.location!r} is not a directory on this node (it must be on every "
            "node: baked into the image or on a shared volume) nor a Hugging Face Hub id")

    def _cache_path(self) -> Path:
        return Path(self.cache_dir).expanduser() / "models" / str(self.content_hash)

    def _materialise(self) -> Path:
        import ray

        target = self._cache_path()
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
        try:
            for name, data in ray.get(self.files).items():
                (tmp / name).parent.mkdir(parents=True, exist_ok=True)
                (tmp / name).write_bytes(data)
            if content_hash(tmp) != self.content_hash:
                raise ModelNotFoundError(f"{node_name()}: shipped model files do not match content hash "
                                         f"{self.content_hash}")
            try:
                os.replace(tmp, target)
            except OSError:
                if not _holds(target, self.content_hash):  # not another actor of this node that won the race
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return target


def _holds(directory: Path, expected_hash: str | None) -> bool:
    marker = directory / HASH_FILE
    try:
        return marker.is_file() and marker.read_text().strip() == expected_hash
    except OSError:
        return False


def _hub_snapshot(repo_id: str, where: str) -> str:
    """The hub id's snapshot in this node's HF cache (no download when HF_HUB_OFFLINE=1)."""
    from huggingface_hub import snapshot_download

    offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes")
    try:
        return snapshot_download(repo_id, local_files_only=offline)
    except Exception as err:
        raise ModelNotFoundError(
            f"{where}: Hugging Face Hub id {repo_id!r} cannot be resolved"
            + (" from the local HF cache (HF_HUB_OFFLINE is set)" if offline else "") + f": {err}") from err


def as_source(model: ModelSource | str) -> ModelSource:
    """Accept a plain path (tests, tools on one machine) wherever a ModelSource goes."""
    return model if isinstance(model, ModelSource) else ModelSource.configured(str(model))
