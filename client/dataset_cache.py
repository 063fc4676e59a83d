"""The job runner's on-disk copy of a job's dataset, memory-mapped instead of held in RAM.

A runner that did not upload the dataset itself (`tessera train --resume`, a runner on
another machine) downloads it from the coordinator. A dataset may be far larger than the
runner's memory, so the download streams to a `.npy` file, checking each shard's sha256
as its last byte arrives, and the sampler reads only the windows of each batch through a
memory map. The file appears under its final name (the dataset id) only once every shard
checked out, so a file there is a whole, verified dataset, and a later resume reuses it
without downloading a byte. Files unused for `KEEP_DAYS` are deleted at the next download.

Where: `$TESSERA_CACHE_DIR/datasets`, else `$XDG_CACHE_HOME/tessera/datasets`, else
`~/.cache/tessera/datasets`.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import time
import uuid
from collections.abc import AsyncIterable
from pathlib import Path
from typing import BinaryIO

import numpy as np

from client.datasets import Progress, TokenDataset
from client.errors import TesseraError
from protos.datasets import TOKEN_BYTES, TOKEN_DTYPE, dataset_id
from protos.tessera.v1 import jobs_pb2

CACHE_ENV = "TESSERA_CACHE_DIR"
KEEP_DAYS = 7
# Room left on the disk beside the dataset, so that a download never fills it up.
SPARE_BYTES = 256 << 20
_PART_MAX_AGE_S = 24 * 3600  # an interrupted download's leftovers


def default_cache_dir() -> Path:
    root = os.environ.get(CACHE_ENV)
    if root:
        return Path(root)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "tessera"


class DatasetCache:
    def __init__(self, root: Path | None = None) -> None:
        self.dir = (root or default_cache_dir()) / "datasets"

    def path(self, dataset: str) -> Path:
        return self.dir / f"{dataset}.npy"

    def load(self, dataset: str) -> TokenDataset | None:
        """The cached dataset, memory-mapped, or None when it is not here."""
        path = self.path(dataset)
        try:
            tokens = np.load(path, mmap_mode="r", allow_pickle=False)
        except (FileNotFoundError, ValueError, EOFError):
            return None  # only whole, checked downloads get this name; anything else is not ours
        os.utime(path)  # used: keep it another KEEP_DAYS
        example_len = int(tokens.shape[1]) if tokens.ndim == 2 else 0
        return TokenDataset(dataset[:12], tokens.reshape(-1), example_len)

    async def download(
        self,
        dataset: str,
        chunks: AsyncIterable[jobs_pb2.DatasetChunk],
        progress: Progress | None = None,
    ) -> TokenDataset:
        """Write a DownloadDataset stream to the cache and map it; ValueError says what was
        wrong with the stream (nothing of it is kept then)."""
        self.prune()
        self.dir.mkdir(parents=True, exist_ok=True)
        part = self.dir / f"{dataset}.{uuid.uuid4().hex[:8]}.part"
        try:
            with part.open("wb") as out:
                await _write_stream(dataset, chunks, out, self.dir, progress)
            os.replace(part, self.path(dataset))  # atomic: a reader sees all of it or nothing
        finally:
            part.unlink(missing_ok=True)
        loaded = self.load(dataset)
        assert loaded is not None, "the dataset just written is not readable"
        return loaded

    def prune(self, now: float | None = None) -> list[Path]:
        """Delete datasets unused for KEEP_DAYS and old leftovers of broken downloads."""
        now = time.time() if now is None else now
        gone = []
        for path in self.dir.glob("*"):
            limit = _PART_MAX_AGE_S if path.suffix == ".part" else KEEP_DAYS * 86400
            try:
                stale = path.suffix in (".npy", ".part") and now - path.stat().st_mtime > limit
            except FileNotFoundError:
                continue  # another runner's download finished or pruned it meanwhile
            if stale:
                path.unlink(missing_ok=True)
                gone.append(path)
        return gone


async def _write_stream(
    dataset: str,
    chunks: AsyncIterable[jobs_pb2.DatasetChunk],
    out: BinaryIO,
    where: Path,
    progress: Progress | None,
) -> None:
    iterator = aiter(chunks)
    first = await anext(iterator, None)
    if first is None or not first.HasField("header"):
        raise ValueError("the dataset stream did not start with its header")
    header = first.header
    shards = [(s.sha256, s.num_tokens) for s in header.shards]
    if not shards or dataset_id(shards, header.example_len) != dataset:
        raise ValueError(f"the coordinator sent another dataset's header for {dataset}")
    total = sum(n for _, n in shards)
    if header.example_len and total % header.example_len:
        raise ValueError(f"the dataset's {total} tokens are not whole examples")
    free = shutil.disk_usage(where).free
    if total * TOKEN_BYTES + SPARE_BYTES > free:
        raise TesseraError(
            f"the dataset needs {total * TOKEN_BYTES / 2**20:.0f} MiB and {where} has "
            f"{free / 2**20:.0f} MiB free; free some space or set {CACHE_ENV} to another disk"
        )
    shape = (total // header.example_len, header.example_len) if header.example_len else (total,)
    np.lib.format.write_array_header_1_0(
        out, {"descr": TOKEN_DTYPE, "fortran_order": False, "shape": shape}
    )
    index, received, digest, done = 0, 0, hashlib.sha256(), 0

    def close_whole_shards() -> None:
        nonlocal index, received, digest
        while index < len(shards) and received == shards[index][1] * TOKEN_BYTES:
            if digest.hexdigest() != shards[index][0]:
                raise ValueError(f"shard {index} of the downloaded dataset is corrupt")
            index, received, digest = index + 1, 0, hashlib.sha256()

    close_whole_shards()
    async for chunk in iterator:
        data = chunk.data
        if index == len(shards):
            raise ValueError("the dataset stream goes on past its last shard")
        if not chunk.HasField("data") or data.shard != index or data.offset != received:
            raise ValueError("the dataset stream is out of order")
        if received + len(data.data) > shards[index][1] * TOKEN_BYTES:
            raise ValueError(f"shard {index} of the downloaded dataset is longer than announced")
        out.write(data.data)
        digest.update(data.data)
        received += len(data.data)
        done += len(data.data)
        close_whole_shards()
        if progress is not None:
            progress("downloading dataset", done, total * TOKEN_BYTES)
    if index != len(shards):
        raise ValueError(f"the dataset stream ended in shard {index} of {len(shards)}")
