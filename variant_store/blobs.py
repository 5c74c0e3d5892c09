"""Content-addressed blob store on local disk: ``<root>/sha256/<ab>/<digest>``.

A blob's name is the sha256 of its bytes, so a blob is written once and never changes. Writes go
to a temp file in the same directory, are fsynced, then renamed into place: a reader never sees
half a blob, and two writers of the same bytes race harmlessly to the same name.
"""

from __future__ import annotations

import hashlib
import os
import re
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from mesh.errors import BlobError

__all__ = ["CHUNK", "BlobStore", "is_digest", "sha256_file"]

CHUNK = 1 << 20
_DIGEST_RE = re.compile(r"^[0-9a-f]{64}$")


def is_digest(digest: str) -> bool:
    """True for a lowercase sha256 hex string (also guards paths against traversal)."""
    return bool(_DIGEST_RE.match(digest))


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        _hash_into(h, f)
    return h.hexdigest()


def _hash_into(h: hashlib._Hash, f: BinaryIO) -> None:
    while chunk := f.read(CHUNK):
        h.update(chunk)


class BlobStore:
    """Blobs under ``root``. Methods are synchronous file I/O: callers on an event loop run the
    large ones (``put_file``, ``verify``) in an executor."""

    def __init__(self, root: Path | str) -> None:
        self.root = Path(root)
        self._dir = self.root / "sha256"

    def path(self, digest: str) -> Path:
        if not is_digest(digest):
            raise BlobError(f"not a sha256 digest: {digest!r}", digest=digest)
        return self._dir / digest[:2] / digest

    def has(self, digest: str) -> bool:
        return is_digest(digest) and self.path(digest).is_file()

    def size(self, digest: str) -> int:
        return self._existing(digest).stat().st_size

    def put_bytes(self, data: bytes) -> str:
        digest = hashlib.sha256(data).hexdigest()
        if not self.has(digest):
            self._write_atomic(digest, [data])
        return digest

    def put_file(self, path: Path | str) -> str:
        src = Path(path)
        try:
            digest = sha256_file(src)
        except OSError as exc:
            raise BlobError(f"cannot read {src}: {exc}") from exc
        if not self.has(digest):
            self._write_atomic(digest, _chunks(src))
        # the source could have changed between hashing and copying: trust only what landed
        self.verify(digest)
        return digest

    def verify(self, digest: str) -> None:
        """Raise ``BlobError`` unless the stored bytes still hash to ``digest``."""
        got = sha256_file(self._existing(digest))
        if got != digest:
            raise BlobError(f"digest mismatch: expected {digest} got {got}", digest=digest, actual=got)

    def read_bytes(self, digest: str) -> bytes:
        """The blob's bytes, verified (a corrupted blob raises ``BlobError``)."""
        data = self._existing(digest).read_bytes()
        got = hashlib.sha256(data).hexdigest()
        if got != digest:
            raise BlobError(f"digest mismatch: expected {digest} got {got}", digest=digest, actual=got)
        return data

    def digests(self) -> list[str]:
        if not self._dir.is_dir():
            return []
        return sorted(p.name for p in self._dir.glob("*/*") if is_digest(p.name))

    def remove(self, digest: str) -> None:
        self.path(digest).unlink(missing_ok=True)

    def _existing(self, digest: str) -> Path:
        p = self.path(digest)
        if not p.is_file():
            raise BlobError(f"blob not found: {digest}", digest=digest)
        return p

    def _write_atomic(self, digest: str, chunks: Iterator[bytes] | list[bytes]) -> None:
        final = self.path(digest)
        final.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=final.parent)
        try:
            with os.fdopen(fd, "wb") as f:
                for chunk in chunks:
                    f.write(chunk)
                f.flush()
                os.fsync(f.fileno())
            os.chmod(tmp, 0o444)  # a blob never changes after it is named
            os.replace(tmp, final)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        _fsync_dir(final.parent)


def _chunks(path: Path) -> Iterator[bytes]:
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            yield chunk


def _fsync_dir(d: Path) -> None:
    # makes the rename itself durable; some filesystems refuse O_RDONLY on dirs, which is fine
    try:
        fd = os.open(d, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
