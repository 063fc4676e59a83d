"""Content-addressed blobs on disk: DATA_DIR/blobs/ab/cdef... named by the sha256 of the bytes.

A blob becomes visible only by an atomic rename after its bytes are fsync'd and its digest
checked, so a crash never leaves a half-written blob under a real address. Identical
tensors of different models share one file.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

SHA256_HEX = re.compile(r"^[0-9a-f]{64}$")
_INCOMING = "incoming"


def is_sha256_hex(value: str) -> bool:
    return bool(SHA256_HEX.match(value))


class DigestMismatch(Exception):
    def __init__(self, expected: str, actual: str) -> None:
        super().__init__(f"expected sha256 {expected}, got {actual}")
        self.expected = expected
        self.actual = actual


class BlobStore:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.incoming = root / _INCOMING
        self.incoming.mkdir(parents=True, exist_ok=True)

    def path(self, sha256: str) -> Path:
        if not is_sha256_hex(sha256):
            raise ValueError(f"not a sha256 hex digest: {sha256!r}")
        return self.root / sha256[:2] / sha256[2:]

    def has(self, sha256: str) -> bool:
        return self.path(sha256).is_file()

    def free_bytes(self) -> int:
        return shutil.disk_usage(self.root).free

    def new_writer(self) -> BlobWriter:
        return BlobWriter(self, self.incoming / f"{uuid.uuid4().hex}.part")

    def delete(self, sha256: str) -> None:
        self.path(sha256).unlink(missing_ok=True)

    def all_digests(self) -> Iterator[str]:
        for prefix in self.root.iterdir():
            if prefix.name == _INCOMING or not prefix.is_dir():
                continue
            for blob in prefix.iterdir():
                digest = prefix.name + blob.name
                if is_sha256_hex(digest):
                    yield digest

    def clear_incoming(self) -> int:
        """Remove leftovers of imports that a crash interrupted; returns how many."""
        removed = 0
        for leftover in self.incoming.iterdir():
            leftover.unlink(missing_ok=True)
            removed += 1
        return removed


class BlobWriter:
    """Receives one blob's bytes into a temp file, hashing as it goes.

    finish() checks and fsyncs; publish() makes the blob visible. An import publishes its
    blobs only once every tensor has arrived intact, so a failed import leaves nothing.
    """

    def __init__(self, store: BlobStore, temp_path: Path) -> None:
        self._store = store
        self._temp_path = temp_path
        self._file: BinaryIO | None = temp_path.open("wb")
        self._digest = hashlib.sha256()
        self._sha256: str | None = None
        self.nbytes = 0

    def write(self, data: bytes) -> None:
        assert self._file is not None, "writer already closed"
        self._file.write(data)
        self._digest.update(data)
        self.nbytes += len(data)

    def hexdigest(self) -> str:
        return self._digest.hexdigest()

    def finish(self, expected_sha256: str) -> None:
        """fsync and check the digest; the blob stays in the incoming area until publish()."""
        actual = self.hexdigest()
        if actual != expected_sha256:
            self.discard()
            raise DigestMismatch(expected_sha256, actual)
        assert self._file is not None, "writer already closed"
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        self._file = None
        self._sha256 = actual

    def publish(self) -> Path:
        """Move a finished blob under its address; a blob already there is kept (same bytes)."""
        assert self._sha256 is not None, "publish() before finish()"
        final = self._store.path(self._sha256)
        if final.is_file():
            self._temp_path.unlink(missing_ok=True)
            return final
        final.parent.mkdir(exist_ok=True)
        os.replace(self._temp_path, final)
        _fsync_dir(final.parent)
        return final

    def discard(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        self._temp_path.unlink(missing_ok=True)


def _fsync_dir(path: Path) -> None:
    # The rename itself must survive a power cut, not only the file's bytes.
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
