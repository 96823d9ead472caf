"""A run's storage: a local directory or a URI (``file://``, ``s3://``, ``gs://``) through fsspec.

Everything a run keeps goes through one ``RunStorage``: config.yaml, metrics.jsonl, summary.json,
curves.png, samples/ and checkpoints. Object stores have no append and no rename, so files are written
whole (append only on local disks) and a checkpoint is sealed by its manifest and the ``latest``
pointer, never by renaming a directory. ``s3://`` needs the ``s3fs`` package and ``gs://`` needs
``gcsfs``; credentials come from their usual environment. Only local paths and ``file://`` are tested.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import uuid
from pathlib import Path

from services.errors import TetherError


class StorageError(TetherError, RuntimeError):
    pass


def sha256_file(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


class RunStorage:
    """A directory in a filesystem that fsspec knows. Paths given to methods are relative to it
    ('/'-separated).

    Picklable through ``url``: actors rebuild it with ``RunStorage(url)``.
    """

    def __init__(self, url: str | Path) -> None:
        from fsspec.core import url_to_fs

        self.url = str(url)
        try:
            self.fs, root = url_to_fs(self.url)
        except (ImportError, ValueError) as err:
            raise StorageError(f"storage {self.url!r} cannot be opened: {err} (s3:// needs the s3fs package, "
                               f"gs:// needs gcsfs)") from err
        self.root = root.rstrip("/") or "/"
        if self.is_local:
            self.root = os.path.abspath(self.root)

    def __reduce__(self):
        return (RunStorage, (self.url,))

    @property
    def is_local(self) -> bool:
        """True on a local filesystem, where append and atomic rename exist."""
        protocol = self.fs.protocol
        return "file" in (protocol if isinstance(protocol, tuple | list) else (protocol,))

    def child(self, *parts: str) -> RunStorage:
        """The storage of a subdirectory (same filesystem)."""
        return RunStorage(self.display(*parts) if self.is_local
                          else self.fs.unstrip_protocol(self.path(*parts)))

    def path(self, *parts: str) -> str:
        """The filesystem path (no protocol) of ``parts`` under this storage."""
        rel = "/".join(p.strip("/") for p in parts if p)
        return f"{self.root.rstrip('/')}/{rel}" if rel else self.root

    def display(self, *parts: str) -> str:
        """What messages name: the plain path on a local disk, the full URI elsewhere."""
        path = self.path(*parts)
        return path if self.is_local else self.fs.unstrip_protocol(path)

    def __str__(self) -> str:
        return self.display()

    # ------------------------------------------------------------------ queries

    def exists(self, *parts: str) -> bool:
        return self.fs.exists(self.path(*parts))

    def isdir(self, *parts: str) -> bool:
        return self.fs.isdir(self.path(*parts))

    def isfile(self, *parts: str) -> bool:
        return self.fs.isfile(self.path(*parts))

    def size(self, *parts: str) -> int | None:
        """Bytes of a file, or None when it does not exist."""
        try:
            return int(self.fs.info(self.path(*parts))["size"])
        except FileNotFoundError:
            return None

    def listdir(self, *parts: str) -> list[str]:
        """Names (not paths) directly under ``parts``; [] when it does not exist."""
        try:
            entries = self.fs.ls(self.path(*parts), detail=False)
        except FileNotFoundError:
            return []
        return sorted(e.rstrip("/").rsplit("/", 1)[-1] for e in entries)

    def files(self, *parts: str) -> list[str]:
        """Every file under ``parts``, as paths relative to it."""
        base = self.path(*parts).rstrip("/") + "/"
        try:
            found = self.fs.find(self.path(*parts))
        except FileNotFoundError:
            return []
        return sorted(f[len(base):] for f in found if f.startswith(base))

    # ------------------------------------------------------------------ reading and writing

    def read_bytes(self, *parts: str) -> bytes:
        return self.fs.cat_file(self.path(*parts))

    def read_text(self, *parts: str) -> str:
        return self.read_bytes(*parts).decode()

    def write_bytes(self, data: bytes, *parts: str) -> None:
        """Write a whole file. Atomic on a local disk (temp file + rename); one PUT on an object store."""
        target = self.path(*parts)
        self.fs.makedirs(target.rsplit("/", 1)[0], exist_ok=True)
        if self.is_local:
            tmp = f"{target}.tmp-{uuid.uuid4().hex[:8]}"
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, target)
        else:
            self.fs.pipe_file(target, data)

    def write_text(self, text: str, *parts: str) -> None:
        self.write_bytes(text.encode(), *parts)

    def append_text(self, text: str, *parts: str) -> None:
        """Append on a local disk; elsewhere rewrite the whole file (object stores cannot append)."""
        target = self.path(*parts)
        if self.is_local:
            self.fs.makedirs(target.rsplit("/", 1)[0], exist_ok=True)
            with open(target, "a") as f:
                f.write(text)
        else:
            old = self.read_bytes(*parts) if self.exists(*parts) else b""
            self.write_bytes(old + text.encode(), *parts)

    def upload(self, local: str | Path, *parts: str) -> None:
        target = self.path(*parts)
        self.fs.makedirs(target.rsplit("/", 1)[0], exist_ok=True)
        self.fs.put_file(str(local), target)

    def download(self, local: str | Path, *parts: str) -> None:
        Path(local).parent.mkdir(parents=True, exist_ok=True)
        self.fs.get_file(self.path(*parts), str(local))

    def remove(self, *parts: str) -> None:
        """Delete a file or a directory tree; nothing when it does not exist."""
        if self.exists(*parts):
            self.fs.rm(self.path(*parts), recursive=True)

    def makedirs(self, *parts: str) -> None:
        self.fs.makedirs(self.path(*parts), exist_ok=True)

    # ------------------------------------------------------------------ pre-flight

    def check_writable(self, who: str = "") -> None:
        """Write, read back and delete a small probe file. Raises StorageError naming the storage and
        ``who`` (the node and role, e.g. 'node 10.0.0.3, learner rank 1: ') when any step fails."""
        token = uuid.uuid4().hex
        name = f".probe-{token}"
        try:
            self.write_text(token, name)
            if self.read_text(name) != token:
                raise StorageError(f"{who}storage {self.display()}: probe file {self.display(name)} read "
                                   "back wrong")
        except (OSError, StorageError) as err:
            raise StorageError(f"{who}storage {self.display()} is not writable: {err}") from err
        finally:
            try:
                self.remove(name)
            except OSError:
                pass

    def write_probe(self) -> str:
        """Write ``.probe-<token>`` and return its name: another node checks it with ``read_probe``."""
        token = uuid.uuid4().hex
        name = f".probe-{token}"
        try:
            self.write_text(token, name)
        except OSError as err:
            raise StorageError(f"storage {self.display()} is not writable: {err}") from err
        return name

    def read_probe(self, name: str, who: str = "") -> None:
        """Check that a probe file written elsewhere is visible here. Raises StorageError
        naming ``who`` (e.g. 'node 10.0.0.3, learner rank 1: ') and the file when it is not."""
        try:
            content = self.read_text(name)
        except (OSError, FileNotFoundError) as err:
            raise StorageError(f"{who}cannot see {self.display(name)}, written by the driver: the run "
                               f"storage {self.display()} is not shared with this node ({err})") from err
        if content != name.removeprefix(".probe-"):
            raise StorageError(f"{who}{self.display(name)} has other content than the driver wrote")


def scratch_dir(prefix: str) -> str:
    """A node-local temporary directory (the caller removes it)."""
    return tempfile.mkdtemp(prefix=prefix)
