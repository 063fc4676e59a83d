"""Receive an AddModel stream without trusting the uploader.

The header is checked in full against the architecture before any data is accepted:
every required tensor, nothing extra, shapes and dtypes from config.json, nbytes equal to
prod(shape) * itemsize, well-formed digests, the size limit. Then each tensor's bytes must
arrive contiguously, in order, exactly once; their sha256 is recomputed and compared.
Blobs wait in the incoming area until the whole model is intact, so an import that fails
or is cancelled leaves nothing behind.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from coordinator.model_store.blob_store import BlobStore, BlobWriter, DigestMismatch, is_sha256_hex
from coordinator.model_store.catalog import TensorRecord
from coordinator.model_store.errors import CheckpointError, StoreError, invalid
from coordinator.model_store.layout import ModelLayout, check_tensor, layer_of, tensor_nbytes
from protos.quoting import shown
from protos.tessera.v1 import admin_pb2

MODEL_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
MAX_CONFIG_BYTES = 1 << 20
_MAX_NAMES_SHOWN = 8
_MANIFEST_DOMAIN = b"tessera/v1/manifest\n"


@dataclass(frozen=True)
class ImportPlan:
    """A validated AddModel header."""

    name: str
    config_json: str
    layout: ModelLayout
    tokenizer_json: bytes
    replace: bool
    tensors: list[TensorRecord]  # in layout order

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    @property
    def digests(self) -> set[str]:
        return {t.sha256 for t in self.tensors}


def validate_name(name: str) -> None:
    if not MODEL_NAME.match(name):
        raise invalid(
            f"model name {shown(name)} is not allowed: use 1-128 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit (it appears in file paths and event topics)"
        )


def plan_import(header: admin_pb2.AddModelHeader, max_model_bytes: int) -> ImportPlan:
    """Validate the header; StoreError (INVALID_ARGUMENT, RESOURCE_EXHAUSTED) names the problem."""
    validate_name(header.name)
    layout = _layout(header.config_json)
    tokenizer = bytes(header.tokenizer_json)
    if tokenizer:
        try:
            json.loads(tokenizer.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise invalid(f"tokenizer_json is not valid UTF-8 JSON: {err}") from None
    expected = layout.expected_shapes()
    declared: dict[str, TensorRecord] = {}
    extra: dict[str, None] = {}  # ordered set: lookups stay O(1) on hostile headers
    for item in header.tensors:
        if item.name in declared or item.name in extra:
            raise invalid(f"tensor {shown(item.name)} appears twice in the header")
        if item.name not in expected:
            extra[item.name] = None
            continue
        declared[item.name] = _checked_entry(item, expected[item.name])
    missing = [name for name in expected if name not in declared]
    if missing:
        raise invalid(
            f"the header lacks {len(missing)} tensor(s) that {layout.architecture} with "
            f"{layout.num_layers} layers needs: {_names(missing)}"
        )
    if extra:
        raise invalid(
            f"the header lists {len(extra)} tensor(s) that {layout.architecture} does not use: "
            f"{_names(list(extra))}; send only the architecture's tensors"
        )
    plan = ImportPlan(
        name=header.name,
        config_json=header.config_json,
        layout=layout,
        tokenizer_json=tokenizer,
        replace=header.replace,
        tensors=[declared[name] for name in expected],
    )
    if plan.total_bytes > max_model_bytes:
        raise StoreError(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"model {plan.name} has {plan.total_bytes} bytes of weights, above this "
            f"coordinator's limit of {max_model_bytes} bytes per model; the operator can raise it",
        )
    return plan


def manifest_digest(tensors: list[TensorRecord]) -> str:
    """sha256 over (name, dtype, shape, sha256) of every tensor: names the exact weights."""
    digest = hashlib.sha256(_MANIFEST_DOMAIN)
    for t in sorted(tensors, key=lambda t: t.name):
        digest.update(f"{t.name}\t{t.dtype}\t{list(t.shape)}\t{t.sha256}\n".encode())
    return digest.hexdigest()


class TensorReceiver:
    """Takes TensorData messages for one import and turns them into verified blobs."""

    def __init__(
        self, plan: ImportPlan, blobs: BlobStore, is_stored: Callable[[str], bool]
    ) -> None:
        self._plan = plan
        self._blobs = blobs
        self._is_stored = is_stored
        self._by_name = {t.name: t for t in plan.tensors}
        self._done: set[str] = set()
        self._current: TensorRecord | None = None
        self._sink: BlobWriter | _DigestOnly | None = None
        self._received = 0
        # One writer per new digest: identical tensors (e.g. norms of ones) are stored once.
        self._writers: dict[str, BlobWriter] = {}
        self.new_bytes = 0

    async def accept(self, data: admin_pb2.TensorData) -> None:
        entry = self._by_name.get(data.name)
        if entry is None:
            raise invalid(f"data for tensor {shown(data.name)}, which the header does not list")
        if data.name in self._done:
            raise invalid(f"tensor {data.name} was sent twice")
        if self._current is None:
            self._start(entry)
        elif self._current.name != data.name:
            raise invalid(
                f"data for tensor {data.name} arrived while tensor {self._current.name} is "
                f"incomplete ({self._received} of {self._current.nbytes} bytes); send each "
                "tensor's bytes contiguously"
            )
        if data.offset != self._received:
            raise invalid(
                f"tensor {data.name}: chunk at offset {data.offset}, expected {self._received}"
            )
        if self._received + len(data.data) > entry.nbytes:
            raise invalid(
                f"tensor {data.name}: more bytes than the {entry.nbytes} the header declared"
            )
        assert self._sink is not None
        if data.data:
            await asyncio.to_thread(self._sink.write, data.data)
            self._received += len(data.data)
        if self._received == entry.nbytes:
            await self._finish(entry)

    def complete(self) -> list[BlobWriter]:
        """The writers of new blobs, once every tensor arrived; StoreError otherwise."""
        missing = [t.name for t in self._plan.tensors if t.name not in self._done]
        if missing:
            raise invalid(
                f"the stream ended before {len(missing)} tensor(s) were complete: "
                f"{_names(missing)}; nothing was imported"
            )
        return list(self._writers.values())

    def discard(self) -> None:
        """Delete whatever was not published (safe to call in any state)."""
        if isinstance(self._sink, BlobWriter):
            self._sink.discard()
        for writer in self._writers.values():
            writer.discard()

    def _start(self, entry: TensorRecord) -> None:
        self._current = entry
        self._received = 0
        if entry.sha256 in self._writers or self._is_stored(entry.sha256):
            self._sink = _DigestOnly()
        else:
            self._sink = self._blobs.new_writer()

    async def _finish(self, entry: TensorRecord) -> None:
        sink = self._sink
        assert sink is not None
        try:
            await asyncio.to_thread(sink.finish, entry.sha256)
        except DigestMismatch as err:
            raise invalid(
                f"tensor {entry.name}: the received bytes have sha256 {err.actual}, but the "
                f"header declared {err.expected}; the upload is corrupt"
            ) from None
        if isinstance(sink, BlobWriter):
            self._writers[entry.sha256] = sink
            self.new_bytes += entry.nbytes
        self._done.add(entry.name)
        self._current = None
        self._sink = None


class _DigestOnly:
    """For bytes the store already holds: verify them, keep nothing."""

    def __init__(self) -> None:
        self._digest = hashlib.sha256()

    def write(self, data: bytes) -> None:
        self._digest.update(data)

    def finish(self, expected_sha256: str) -> None:
        actual = self._digest.hexdigest()
        if actual != expected_sha256:
            raise DigestMismatch(expected_sha256, actual)


def _layout(config_json: str) -> ModelLayout:
    if len(config_json) > MAX_CONFIG_BYTES:
        raise invalid(f"config_json is longer than {MAX_CONFIG_BYTES} characters")
    try:
        return ModelLayout.from_config(json.loads(config_json))
    except json.JSONDecodeError as err:
        raise invalid(f"config_json is not valid JSON: {err}") from None
    except CheckpointError as err:
        raise invalid(str(err)) from None


def _checked_entry(item: admin_pb2.TensorHeader, shape: tuple[int, ...]) -> TensorRecord:
    try:
        check_tensor(item.name, item.dtype, tuple(item.shape), shape)
    except CheckpointError as err:
        raise invalid(str(err)) from None
    needed = tensor_nbytes(item.dtype, shape)
    if item.nbytes != needed:
        raise invalid(
            f"tensor {item.name} declares {item.nbytes} bytes, but shape {list(shape)} of "
            f"{item.dtype} needs {needed}"
        )
    if not is_sha256_hex(item.sha256):
        raise invalid(
            f"tensor {item.name}: sha256 must be 64 lowercase hex digits, got {shown(item.sha256)}"
        )
    return TensorRecord(item.name, item.sha256, item.dtype, shape, item.nbytes, layer_of(item.name))


def _names(names: list[str]) -> str:
    # Names from a caller's header: each quoted and cut (protos.quoting).
    listed = ", ".join(shown(name) for name in names[:_MAX_NAMES_SHOWN])
    extra = len(names) - _MAX_NAMES_SHOWN
    return f"{listed} (+{extra} more)" if extra > 0 else listed
