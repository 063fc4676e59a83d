"""Fetch the tensors of a shard from the coordinator's model store, into a local cache.

Blobs are content-addressed: DATA_DIR/cache/blobs/<sha256> holds the raw bytes of one
tensor. Every blob is hashed on arrival and written atomically (temp file, fsync, rename),
and a cached blob is hashed again before its first use by this process, so a corrupt or
truncated file is fetched anew instead of poisoning a pipeline. Only missing blobs travel,
so a restarted node downloads nothing it already has.

`materialize(model, start, end)` assembles DATA_DIR/shards/<model>/<start>-<end>/ with
config.json and a model.safetensors holding exactly that stage's tensors, which the node
runtime loads like any Hugging Face checkpoint directory.

    fetcher = ShardFetcher.for_data_dir("coord:7000", node_id, ticket, data_dir)
    shard_dir = await fetcher.materialize("tinyllama", 0, 11, on_progress=report)
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import re
import shutil
import struct
import sys
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import grpc
from tqdm import tqdm

from node_agent import backoff
from protos import dialing
from protos.dialing import DIAL_OPTIONS
from protos.tessera.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc

log = logging.getLogger(__name__)

NODE_ID_METADATA = "x-tessera-node-id"
TICKET_METADATA = "x-tessera-ticket"
DTYPE_ITEMSIZE = {"F32": 4, "F16": 2, "BF16": 2}
EMBEDDING = "model.embed_tokens.weight"
FINAL_NORM = "model.norm.weight"
LM_HEAD = "lm_head.weight"
SHARD_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
MARKER_FILE = ".tessera-shard.json"
HASH_CHUNK_BYTES = 4 << 20
# Transient failures worth another try; anything else is a real answer from the coordinator.
_RETRYABLE = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.INTERNAL,
    grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.CANCELLED,
}
_LAYER_NAME = re.compile(r"^model\.layers\.(\d+)\.")
_SHA256_HEX = re.compile(r"^[0-9a-f]{64}$")
_MODEL_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_STALE_PART_S = 24 * 3600

ProgressCallback = Callable[[int, int], None]


class FetchError(RuntimeError):
    """The shard could not be fetched; the message says why and what to do."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    sha256: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    layer: int  # -1 for embedding, final norm and head


@dataclass(frozen=True)
class ModelManifest:
    name: str
    config_json: str
    num_layers: int
    tensors: dict[str, TensorInfo]  # in the coordinator's order


def layer_of(name: str) -> int:
    match = _LAYER_NAME.match(name)
    return int(match.group(1)) if match else -1


def stage_tensor_names(manifest: ModelManifest, start: int, end: int) -> list[str]:
    """The tensors a stage running layers [start, end) needs, in manifest order.

    The first stage holds the embedding; the last the final norm and the head, which is
    the embedding matrix itself when the model ties them (no lm_head.weight then).
    """
    if not 0 <= start <= end <= manifest.num_layers:
        raise FetchError(
            f"layer range [{start}, {end}) is outside model {manifest.name}, which has "
            f"{manifest.num_layers} layers"
        )
    is_first, is_last = start == 0, end == manifest.num_layers
    if start == end and not (is_first or is_last):
        raise FetchError(f"layer range [{start}, {end}) is empty")
    tied = LM_HEAD not in manifest.tensors
    wanted = []
    for name, info in manifest.tensors.items():
        if info.layer >= 0:
            keep = start <= info.layer < end
        elif name == EMBEDDING:
            keep = is_first or (is_last and tied)
        else:
            keep = is_last
        if keep:
            wanted.append(name)
    return wanted


class ShardFetcher:
    def __init__(
        self,
        coordinator: str | grpc.aio.Channel,
        node_id: str,
        ticket: bytes,
        cache_dir: str | Path,
        *,
        shards_dir: str | Path | None = None,
        max_blobs_per_call: int = 256,
        attempts: int = 3,
        retry_pause: backoff.Backoff | None = None,
    ) -> None:
        """`cache_dir` holds the blobs; `shards_dir` the assembled stage directories.

        `ticket` is the attach ticket of the current registration; after the agent
        registers again, assign the new one to `fetcher.ticket`.
        """
        if isinstance(coordinator, str):
            self._channel = dialing.aio_channel(coordinator, DIAL_OPTIONS)
            self._owns_channel = True
        else:
            self._channel = coordinator
            self._owns_channel = False
        self._stub = coordinator_pb2_grpc.CoordinatorStub(self._channel)
        self.node_id = node_id
        self.ticket = ticket
        self.cache_dir = Path(cache_dir)
        self.shards_dir = Path(shards_dir) if shards_dir else self.cache_dir.parent / "shards"
        self.max_blobs_per_call = max_blobs_per_call
        self.attempts = attempts
        # Between attempts: a coordinator that is restarting or overloaded would turn down
        # retries sent at once just the same (shorter in tests via TESSERA_BACKOFF_*).
        self.retry_pause = retry_pause or backoff.from_env(cap_s=5.0)
        self.bytes_fetched = 0  # over the network, since this fetcher was made
        self._incoming = self.cache_dir / ".incoming"
        self._incoming.mkdir(parents=True, exist_ok=True)
        self._verified: set[str] = set()
        self._remove_stale_parts()

    @classmethod
    def for_data_dir(
        cls, coordinator: str | grpc.aio.Channel, node_id: str, ticket: bytes, data_dir: Path
    ) -> ShardFetcher:
        """The standard layout: DATA_DIR/cache/blobs and DATA_DIR/shards."""
        return cls(
            coordinator,
            node_id,
            ticket,
            data_dir / "cache" / "blobs",
            shards_dir=data_dir / "shards",
        )

    async def close(self) -> None:
        if self._owns_channel:
            await self._channel.close()

    def blob_path(self, sha256: str) -> Path:
        if not _SHA256_HEX.match(sha256):
            raise FetchError(f"not a sha256 hex digest: {sha256!r}")
        return self.cache_dir / sha256

    async def fetch_manifest(self, model: str) -> ModelManifest:
        try:
            reply = await self._stub.GetManifest(
                common_pb2.ModelRef(name=model), metadata=self._metadata()
            )
        except grpc.aio.AioRpcError as err:
            raise FetchError(
                f"cannot get the manifest of model {model}: {err.details()} ({err.code().name})"
            ) from err
        return _parse_manifest(model, reply)

    async def ensure_tensors(
        self,
        model: str,
        names: Iterable[str],
        progress: bool | None = None,
        on_progress: ProgressCallback | None = None,
        manifest: ModelManifest | None = None,
    ) -> dict[str, Path]:
        """Make sure the named tensors are cached; returns name -> blob file.

        `progress` draws a byte progress bar on stderr (default: when stderr is a terminal).
        `on_progress(bytes_done, bytes_total)` counts cached bytes as done.
        """
        manifest = manifest or await self.fetch_manifest(model)
        wanted = list(dict.fromkeys(names))
        unknown = [n for n in wanted if n not in manifest.tensors]
        if unknown:
            raise FetchError(f"model {model} has no tensor(s) {', '.join(unknown[:5])}")
        sizes = {manifest.tensors[n].sha256: manifest.tensors[n].nbytes for n in wanted}
        missing = {}
        for digest, size in sizes.items():
            if not await asyncio.to_thread(self._cached_ok, digest, size):
                missing[digest] = size
        total = sum(sizes.values())
        done = total - sum(missing.values())
        if missing:
            log.info(
                "model %s: fetching %d of %d blob(s), %d bytes (%d bytes already cached)",
                model,
                len(missing),
                len(sizes),
                sum(missing.values()),
                done,
            )
        show = sys.stderr.isatty() if progress is None else progress
        with tqdm(
            total=total,
            initial=done,
            desc=f"fetching {model}",
            unit="B",
            unit_scale=True,
            unit_divisor=1024,
            file=sys.stderr,
            disable=not show,
            mininterval=0.5,
        ) as bar:
            counter = _Progress(done, total, bar, on_progress)
            counter.report()
            digests = list(missing)
            for start in range(0, len(digests), self.max_blobs_per_call):
                batch = {d: missing[d] for d in digests[start : start + self.max_blobs_per_call]}
                await self._fetch_with_retries(model, batch, counter)
        return {n: self.blob_path(manifest.tensors[n].sha256) for n in wanted}

    async def materialize(
        self,
        model: str,
        start: int,
        end: int,
        names: Iterable[str] | None = None,
        progress: bool | None = None,
        on_progress: ProgressCallback | None = None,
    ) -> Path:
        """Assemble (or reuse) shards/<model>/<start>-<end>/ for a stage; returns that path."""
        manifest = await self.fetch_manifest(model)
        wanted = list(names) if names is not None else stage_tensor_names(manifest, start, end)
        target = self.shards_dir / manifest.name / f"{start}-{end}"
        expected = {n: manifest.tensors[n].sha256 for n in wanted if n in manifest.tensors}
        if len(expected) == len(wanted) and await asyncio.to_thread(
            _shard_is_intact, target, manifest.config_json, expected
        ):
            blobs = {manifest.tensors[n].sha256: manifest.tensors[n].nbytes for n in wanted}
            total = sum(blobs.values())
            if on_progress:
                on_progress(total, total)
            log.info("model %s [%d, %d): reusing %s", model, start, end, target)
            return target
        paths = await self.ensure_tensors(
            model, wanted, progress=progress, on_progress=on_progress, manifest=manifest
        )
        await asyncio.to_thread(
            _write_shard, target, manifest, [manifest.tensors[n] for n in wanted], paths
        )
        log.info("model %s [%d, %d): assembled %s", model, start, end, target)
        return target

    # ---- internals --------------------------------------------------------------------

    def _metadata(self) -> tuple[tuple[str, str], ...]:
        return ((NODE_ID_METADATA, self.node_id), (TICKET_METADATA, self.ticket.hex()))

    def _cached_ok(self, digest: str, size: int) -> bool:
        path = self.blob_path(digest)
        if digest in self._verified and path.is_file():
            return True
        try:
            actual_size = path.stat().st_size
        except FileNotFoundError:
            return False
        if actual_size == size and _file_sha256(path) == digest:
            self._verified.add(digest)
            return True
        log.warning("cached blob %s is corrupt; fetching it again", path)
        path.unlink(missing_ok=True)
        return False

    async def _fetch_with_retries(
        self, model: str, batch: dict[str, int], counter: _Progress
    ) -> None:
        pending = dict(batch)
        for attempt in range(1, self.attempts + 1):
            try:
                await self._fetch_batch(model, pending, counter)
                self.retry_pause.reset()  # the next outage starts with short waits again
                return
            except grpc.aio.AioRpcError as err:
                if err.code() not in _RETRYABLE or attempt == self.attempts:
                    raise FetchError(
                        f"fetching tensors of model {model} failed: {err.details()} "
                        f"({err.code().name})"
                    ) from err
                problem = f"{err.code().name}: {err.details()}"
            except _BadBlob as err:
                if attempt == self.attempts:
                    raise FetchError(f"model {model}: {err}") from err
                problem = str(err)
            # Blobs that arrived intact stay; only the rest is asked for again.
            pending = {d: s for d, s in pending.items() if d not in self._verified}
            pause = self.retry_pause.next_delay()
            log.warning(
                "model %s: fetch attempt %d/%d failed (%s); retrying %d blob(s) in %.1f s",
                model,
                attempt,
                self.attempts,
                problem,
                len(pending),
                pause,
            )
            await asyncio.sleep(pause)

    async def _fetch_batch(self, model: str, batch: dict[str, int], counter: _Progress) -> None:
        request = coordinator_pb2.FetchRequest(model=model, sha256=list(batch))
        partial: dict[str, _Partial] = {}
        try:
            async for chunk in self._stub.FetchTensors(request, metadata=self._metadata()):
                digest = chunk.sha256
                size = batch.get(digest)
                if size is None or digest in self._verified:
                    raise _BadBlob(f"the coordinator sent blob {digest!r}, which was not asked for")
                part = partial.get(digest)
                if part is None:
                    part = partial[digest] = await asyncio.to_thread(
                        _Partial.open, self._incoming, digest
                    )
                if chunk.total_bytes != size or chunk.offset != part.nbytes:
                    raise _BadBlob(
                        f"blob {digest}: chunk at offset {chunk.offset} of {chunk.total_bytes} "
                        f"bytes, expected offset {part.nbytes} of {size}"
                    )
                if part.nbytes + len(chunk.data) > size:
                    raise _BadBlob(f"blob {digest}: more than the {size} bytes expected")
                await asyncio.to_thread(part.write, chunk.data)
                self.bytes_fetched += len(chunk.data)
                counter.add(len(chunk.data))
                if part.nbytes == size:
                    await asyncio.to_thread(part.commit, self.blob_path(digest))
                    del partial[digest]
                    self._verified.add(digest)
        finally:
            for part in partial.values():
                part.discard()
        absent = [d for d in batch if d not in self._verified]
        if absent:
            raise _BadBlob(f"the stream ended without {len(absent)} blob(s), e.g. {absent[0]}")

    def _remove_stale_parts(self) -> None:
        # Parts of a crashed fetch; young ones may belong to another fetcher running now.
        cutoff = time.time() - _STALE_PART_S
        for leftover in self._incoming.glob("*.part"):
            try:
                if leftover.stat().st_mtime < cutoff:
                    leftover.unlink()
            except FileNotFoundError:
                pass


class _BadBlob(Exception):
    """Bytes that do not match what the manifest promised."""


class _Progress:
    def __init__(self, done: int, total: int, bar: tqdm, callback: ProgressCallback | None) -> None:
        self.done = done
        self.total = total
        self._bar = bar
        self._callback = callback

    def add(self, nbytes: int) -> None:
        self.done += nbytes
        self._bar.update(nbytes)
        self.report()

    def report(self) -> None:
        if self._callback is not None:
            self._callback(self.done, self.total)


class _Partial:
    """One blob being received into a temp file, hashed as it goes."""

    def __init__(self, path: Path, handle: BinaryIO, digest: str) -> None:
        self.path = path
        self._handle: BinaryIO | None = handle
        self._expected = digest
        self._hash = hashlib.sha256()
        self.nbytes = 0

    @classmethod
    def open(cls, incoming: Path, digest: str) -> _Partial:
        path = incoming / f"{digest}.{uuid.uuid4().hex}.part"
        return cls(path, path.open("wb"), digest)

    def write(self, data: bytes) -> None:
        assert self._handle is not None
        self._handle.write(data)
        self._hash.update(data)
        self.nbytes += len(data)

    def commit(self, final: Path) -> None:
        actual = self._hash.hexdigest()
        if actual != self._expected:
            self.discard()
            raise _BadBlob(f"blob {self._expected} arrived with sha256 {actual}; discarded")
        assert self._handle is not None
        self._handle.flush()
        os.fsync(self._handle.fileno())
        self._handle.close()
        self._handle = None
        os.replace(self.path, final)

    def discard(self) -> None:
        if self._handle is not None:
            self._handle.close()
            self._handle = None
        self.path.unlink(missing_ok=True)


def _parse_manifest(model: str, reply: coordinator_pb2.Manifest) -> ModelManifest:
    """Check what the coordinator sent before digests become file names."""
    if reply.name != model or not _MODEL_NAME.match(model):
        raise FetchError(f"the coordinator answered with a manifest for {reply.name!r}")
    try:
        json.loads(reply.config_json)
    except json.JSONDecodeError as err:
        raise FetchError(f"model {model}: the manifest's config_json is not JSON: {err}") from err
    tensors: dict[str, TensorInfo] = {}
    for entry in reply.tensors:
        shape = tuple(entry.shape)
        count = 1
        for dim in shape:
            count *= dim
        if (
            entry.name in tensors
            or not _SHA256_HEX.match(entry.sha256)
            or entry.dtype not in DTYPE_ITEMSIZE
            or any(d <= 0 for d in shape)
            or entry.nbytes != count * DTYPE_ITEMSIZE[entry.dtype]
        ):
            raise FetchError(f"model {model}: the manifest entry for {entry.name!r} is malformed")
        tensors[entry.name] = TensorInfo(
            entry.name, entry.sha256, entry.dtype, shape, entry.nbytes, layer_of(entry.name)
        )
    if reply.num_layers <= 0:
        raise FetchError(f"model {model}: the manifest says it has {reply.num_layers} layers")
    return ModelManifest(model, reply.config_json, reply.num_layers, tensors)


def _file_sha256(path: Path, start: int = 0, length: int | None = None) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        handle.seek(start)
        left = length
        while left is None or left > 0:
            chunk = handle.read(HASH_CHUNK_BYTES if left is None else min(HASH_CHUNK_BYTES, left))
            if not chunk:
                break
            digest.update(chunk)
            if left is not None:
                left -= len(chunk)
    return digest.hexdigest()


def _write_shard(
    target: Path, manifest: ModelManifest, entries: list[TensorInfo], blobs: dict[str, Path]
) -> None:
    """Write config.json + model.safetensors into a temp dir, then swap it into place."""
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = target.parent / f".{target.name}.{uuid.uuid4().hex}.tmp"
    staging.mkdir()
    try:
        (staging / CONFIG_FILE).write_text(manifest.config_json, encoding="utf-8")
        header: dict[str, object] = {"__metadata__": {"format": "pt", "model": manifest.name}}
        offsets: dict[str, int] = {}
        offset = 0
        for entry in entries:
            header[entry.name] = {
                "dtype": entry.dtype,
                "shape": list(entry.shape),
                "data_offsets": [offset, offset + entry.nbytes],
            }
            offsets[entry.name] = offset
            offset += entry.nbytes
        encoded = json.dumps(header, separators=(",", ":")).encode()
        encoded += b" " * (-len(encoded) % 8)  # keeps tensor data 8-byte aligned
        data_start = 8 + len(encoded)
        with (staging / SHARD_FILE).open("wb") as out:
            out.write(struct.pack("<Q", len(encoded)))
            out.write(encoded)
            for entry in entries:
                with blobs[entry.name].open("rb") as blob:
                    shutil.copyfileobj(blob, out, HASH_CHUNK_BYTES)
            out.flush()
            os.fsync(out.fileno())
        marker = {
            "model": manifest.name,
            "tensors": {
                e.name: [e.sha256, data_start + offsets[e.name], e.nbytes] for e in entries
            },
        }
        (staging / MARKER_FILE).write_text(json.dumps(marker), encoding="utf-8")
        old = target.parent / f".{target.name}.{uuid.uuid4().hex}.old"
        if target.exists():
            os.replace(target, old)
        os.replace(staging, target)
        shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _shard_is_intact(target: Path, config_json: str, expected: dict[str, str]) -> bool:
    """True if `target` was assembled from exactly these blobs and its bytes still match."""
    try:
        marker = json.loads((target / MARKER_FILE).read_text(encoding="utf-8"))
        if (target / CONFIG_FILE).read_text(encoding="utf-8") != config_json:
            return False
        recorded = marker["tensors"]
        if {name: entry[0] for name, entry in recorded.items()} != expected:
            return False
        shard = target / SHARD_FILE
        for name, (digest, offset, nbytes) in recorded.items():
            if _file_sha256(shard, offset, nbytes) != digest:
                log.warning("%s: tensor %s is corrupt; assembling the shard again", shard, name)
                return False
    except (OSError, ValueError, KeyError, TypeError):
        return False
    return True
