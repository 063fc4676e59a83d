"""ModelStore: the model RPCs the coordinator's servicers delegate to.

Admin.AddModel/RemoveModel (the server checks the admin token first), ClientApi.ListModels/
GetModel, and Coordinator.GetManifest/FetchTensors for registered nodes, which prove who
they are with metadata `x-tessera-node-id` and `x-tessera-ticket` (the attach ticket from
RegisterResponse, hex encoded, because plain gRPC metadata must be ASCII).
"""

from __future__ import annotations

import asyncio
import errno
import hashlib
import inspect
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from coordinator.model_store.blob_store import BlobStore, is_sha256_hex
from coordinator.model_store.catalog import ModelCatalog, ModelRecord, TensorRecord
from coordinator.model_store.errors import StoreError, invalid, not_found
from coordinator.model_store.importer import (
    ImportPlan,
    TensorReceiver,
    manifest_digest,
    plan_import,
)
from protos.quoting import shown
from protos.tessera.v1 import (
    admin_pb2,
    client_api_pb2,
    common_pb2,
    coordinator_pb2,
)

log = logging.getLogger(__name__)

NODE_ID_METADATA = "x-tessera-node-id"
TICKET_METADATA = "x-tessera-ticket"
NO_PLANNER_REASON = "no node has loaded it yet"

TicketCheck = Callable[[str, bytes], "bool | Awaitable[bool]"]
Coverage = Callable[[str], "list[int] | None"]
ModelListener = Callable[[str, str], None]  # (event "added" | "removed", model name)


@dataclass(frozen=True)
class StoreLimits:
    max_model_bytes: int = 200 << 30
    max_fetch_hashes: int = 4096
    fetch_chunk_bytes: int = 1 << 20
    # Refuse an import that would leave less than this free on the store's disk.
    min_free_bytes: int = 256 << 20


class ModelStore:
    def __init__(
        self,
        db: Any,
        data_dir: str | Path,
        *,
        limits: StoreLimits | None = None,
        check_ticket: TicketCheck | None = None,
        coverage: Coverage | None = None,
        unavailable_reason: Callable[[str], str] | None = None,
    ) -> None:
        self.limits = limits or StoreLimits()
        self.catalog = ModelCatalog(db)
        self.blobs = BlobStore(Path(data_dir) / "blobs")
        self._check_ticket = check_ticket
        self._coverage = coverage
        self._unavailable_reason = unavailable_reason
        self._importing: set[str] = set()
        self._pinned: Counter[str] = Counter()  # digests an import in flight relies on
        self._deleting: set[str] = set()
        # Serializes publishing blobs with deleting them, so neither undoes the other.
        self._blob_lock = asyncio.Lock()
        self._listeners: list[ModelListener] = []
        self._recover()

    @classmethod
    def from_context(cls, ctx: Any, limits: StoreLimits | None = None) -> ModelStore:
        """Build from the coordinator's context (db, data_dir, registry, optional planner)."""
        if limits is None:
            settings = getattr(ctx, "settings", None)
            max_bytes = getattr(settings, "max_model_bytes", None)
            limits = StoreLimits(max_model_bytes=max_bytes) if max_bytes else StoreLimits()

        def check_ticket(node_id: str, ticket: bytes) -> bool | Awaitable[bool]:
            return ctx.registry.check_ticket(node_id, ticket)

        def coverage(model: str) -> list[int] | None:
            # Looked up on every call: the planner may be wired in after the store.
            report = getattr(getattr(ctx, "planner", None), "coverage", None)
            return report(model) if report is not None else None

        def unavailable_reason(model: str) -> str:
            explain = getattr(getattr(ctx, "planner", None), "unavailable_reason", None)
            return explain(model) if explain is not None else ""

        return cls(
            ctx.db,
            ctx.data_dir,
            limits=limits,
            check_ticket=check_ticket,
            coverage=coverage,
            unavailable_reason=unavailable_reason,
        )

    # ---- Python API for the planner and sessions --------------------------------------

    def add_listener(self, listener: ModelListener) -> None:
        """Call `listener(event, name)` after a model is "added" (or replaced) or "removed"."""
        self._listeners.append(listener)

    def model(self, name: str) -> ModelRecord | None:
        return self.catalog.get(name)

    def models(self) -> list[ModelRecord]:
        return self.catalog.list()

    def tensors(self, name: str) -> list[TensorRecord]:
        return self.catalog.tensors(name)

    def layer_bytes(self, name: str) -> tuple[list[int], int]:
        """(weight bytes of each decoder layer, bytes outside layers) for memory planning."""
        record = self.catalog.get(name)
        if record is None:
            raise KeyError(name)
        per_layer = [0] * record.num_layers
        other = 0
        for t in self.catalog.tensors(name):
            if t.layer < 0:
                other += t.nbytes
            else:
                per_layer[t.layer] += t.nbytes
        return per_layer, other

    # ---- Admin ------------------------------------------------------------------------

    async def import_model(
        self, messages: AsyncIterator[admin_pb2.AddModelChunk]
    ) -> client_api_pb2.ModelInfo:
        """AddModel from inside the coordinator (trained weights); StoreError on refusal."""
        return await self._import(messages)

    async def add_model(
        self, request_iterator: AsyncIterator[admin_pb2.AddModelChunk], context: Any
    ) -> client_api_pb2.ModelInfo:
        try:
            return await self._import(request_iterator)
        except StoreError as err:
            log.warning("refused AddModel: %s", err.message)
            await context.abort(err.code, err.message)
            raise  # unreachable: abort raises
        except OSError as err:
            log.exception("AddModel failed while writing the store")
            code = (
                grpc.StatusCode.RESOURCE_EXHAUSTED
                if err.errno == errno.ENOSPC
                else grpc.StatusCode.INTERNAL
            )
            await context.abort(
                code, f"the coordinator could not store the model ({err}); nothing was imported"
            )
            raise

    async def remove_model(self, request: common_pb2.ModelRef, context: Any) -> common_pb2.Empty:
        digests = self.catalog.remove(request.name)
        if digests is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, self._unknown_model(request.name))
        freed = await self._collect(digests or set())
        log.info("removed model %s (%d blobs freed)", request.name, freed)
        self._notify("removed", request.name)
        return common_pb2.Empty()

    # ---- ClientApi --------------------------------------------------------------------

    async def list_models(
        self, request: common_pb2.Empty, context: Any
    ) -> client_api_pb2.ListModelsResponse:
        return client_api_pb2.ListModelsResponse(
            models=[self._info(record) for record in self.catalog.list()]
        )

    async def get_model(
        self, request: common_pb2.ModelRef, context: Any
    ) -> client_api_pb2.ModelDetail:
        record = self.catalog.get(request.name)
        if record is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, self._unknown_model(request.name))
        assert record is not None
        return client_api_pb2.ModelDetail(
            info=self._info(record),
            config_json=record.config_json,
            tokenizer_json=self.catalog.tokenizer_json(record.name),
        )

    # ---- Coordinator (nodes) ----------------------------------------------------------

    async def get_manifest(
        self, request: common_pb2.ModelRef, context: Any
    ) -> coordinator_pb2.Manifest:
        try:
            await self._authorize_node(context)
            record = self._require_model(request.name)
        except StoreError as err:
            await context.abort(err.code, err.message)
            raise
        return coordinator_pb2.Manifest(
            name=record.name,
            config_json=record.config_json,
            num_layers=record.num_layers,
            tensors=[
                coordinator_pb2.TensorEntry(
                    name=t.name,
                    sha256=t.sha256,
                    dtype=t.dtype,
                    shape=list(t.shape),
                    nbytes=t.nbytes,
                )
                for t in self.catalog.tensors(record.name)
            ],
        )

    async def fetch_tensors(
        self, request: coordinator_pb2.FetchRequest, context: Any
    ) -> AsyncIterator[coordinator_pb2.TensorChunk]:
        try:
            node_id = await self._authorize_node(context)
            sizes = self._fetch_plan(request)
        except StoreError as err:
            await context.abort(err.code, err.message)
            raise
        log.info(
            "node %s fetches %d blob(s) of %s (%d bytes)",
            node_id,
            len(sizes),
            request.model,
            sum(sizes.values()),
        )
        for digest, size in sizes.items():
            async for chunk in self._stream_blob(request.model, digest, size, context):
                yield chunk

    # ---- internals --------------------------------------------------------------------

    async def _import(
        self, request_iterator: AsyncIterator[admin_pb2.AddModelChunk]
    ) -> client_api_pb2.ModelInfo:
        messages = request_iterator.__aiter__()
        try:
            first = await messages.__anext__()
        except StopAsyncIteration:
            raise invalid("empty AddModel stream: the first message must be the header") from None
        if first.WhichOneof("kind") != "header":
            raise invalid("the first AddModel message must be the header, before any data")
        plan = plan_import(first.header, self.limits.max_model_bytes)
        self._check_admission(plan)
        started = time.monotonic()
        receiver = TensorReceiver(plan, self.blobs, self._is_stored)
        self._importing.add(plan.name)
        self._pinned.update(plan.digests)
        try:
            async for message in messages:
                if message.WhichOneof("kind") != "data":
                    raise invalid("only the first AddModel message may be a header")
                await receiver.accept(message.data)
            writers = receiver.complete()
            record = self._record(plan)
            async with self._blob_lock:
                await asyncio.to_thread(lambda: [w.publish() for w in writers])
                replaced = self.catalog.put(record, plan.tokenizer_json, plan.tensors)
            # Blobs only the replaced version used are garbage now.
            await self._collect(replaced - plan.digests)
        finally:
            receiver.discard()
            self._importing.discard(plan.name)
            self._pinned.subtract(plan.digests)
            self._pinned += Counter()  # drop zero counts
        log.info(
            "imported model %s: %s, %d layers, %d tensors, %d bytes (%d new on disk) in %.1fs",
            plan.name,
            plan.layout.architecture,
            plan.layout.num_layers,
            len(plan.tensors),
            plan.total_bytes,
            receiver.new_bytes,
            time.monotonic() - started,
        )
        self._notify("added", plan.name)
        return self._info(record)

    def _check_admission(self, plan: ImportPlan) -> None:
        if plan.name in self._importing:
            raise StoreError(
                grpc.StatusCode.ABORTED,
                f"model {plan.name} is being imported by another AddModel right now; "
                "wait for it to finish",
            )
        if not plan.replace and self.catalog.exists(plan.name):
            raise StoreError(
                grpc.StatusCode.ALREADY_EXISTS,
                f"model {plan.name} already exists; add it with --replace (header.replace) "
                "to overwrite it, or remove it first",
            )
        sizes = {t.sha256: t.nbytes for t in plan.tensors if not self.blobs.has(t.sha256)}
        needed = sum(sizes.values())
        free = self.blobs.free_bytes()
        if needed + self.limits.min_free_bytes > free:
            raise StoreError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"model {plan.name} needs {needed} new bytes but the coordinator's store has "
                f"{free} bytes free (keeping {self.limits.min_free_bytes} in reserve)",
            )

    def _record(self, plan: ImportPlan) -> ModelRecord:
        return ModelRecord(
            name=plan.name,
            architecture=plan.layout.architecture,
            num_layers=plan.layout.num_layers,
            hidden_size=plan.layout.hidden_size,
            vocab_size=plan.layout.vocab_size,
            total_bytes=plan.total_bytes,
            config_json=plan.config_json,
            manifest_sha256=manifest_digest(plan.tensors),
            added_ms=int(time.time() * 1000),
            has_tokenizer=bool(plan.tokenizer_json),
        )

    def _info(self, record: ModelRecord) -> client_api_pb2.ModelInfo:
        replicas, reason = self._availability(record)
        return client_api_pb2.ModelInfo(
            name=record.name,
            architecture=record.architecture,
            num_layers=record.num_layers,
            hidden_size=record.hidden_size,
            vocab_size=record.vocab_size,
            total_bytes=record.total_bytes,
            has_tokenizer=record.has_tokenizer,
            available=not reason,
            unavailable_reason=reason,
            ready_replicas=replicas,
            added_unix_ms=record.added_ms,
            sha256=record.manifest_sha256,
            max_positions=record.max_positions,
        )

    def _availability(self, record: ModelRecord) -> tuple[list[int], str]:
        zeros = [0] * record.num_layers
        if self._coverage is None:
            return zeros, NO_PLANNER_REASON
        try:
            replicas = self._coverage(record.name)
        except Exception:  # the planner must never break listing models
            log.exception("planner coverage failed for model %s", record.name)
            return zeros, "the planner could not report coverage; see the coordinator log"
        if replicas is None:
            return zeros, NO_PLANNER_REASON
        replicas = [int(r) for r in replicas]
        if len(replicas) != record.num_layers:
            log.error(
                "planner reported %d layers for %s, which has %d",
                len(replicas),
                record.name,
                record.num_layers,
            )
            return zeros, NO_PLANNER_REASON
        uncovered = [layer for layer, count in enumerate(replicas) if count <= 0]
        if not uncovered:
            return replicas, ""
        planner_says = self._unavailable_reason(record.name) if self._unavailable_reason else ""
        if planner_says:
            return replicas, planner_says
        if len(uncovered) == record.num_layers:
            return replicas, NO_PLANNER_REASON
        return replicas, f"layers {_ranges(uncovered)} have no ready replica"

    async def _authorize_node(self, context: Any) -> str:
        return await authorize_node(context, self._check_ticket)

    def _require_model(self, name: str) -> ModelRecord:
        record = self.catalog.get(name)
        if record is None:
            raise not_found(self._unknown_model(name))
        return record

    def _unknown_model(self, name: str) -> str:
        known = [r.name for r in self.catalog.list()]
        listing = ", ".join(known[:10]) if known else "none yet"
        return f"no model named {shown(name)} (known models: {listing})"

    def _fetch_plan(self, request: coordinator_pb2.FetchRequest) -> dict[str, int]:
        self._require_model(request.model)
        digests = list(dict.fromkeys(request.sha256))
        if not digests:
            raise invalid("FetchRequest lists no sha256 to fetch")
        if len(digests) > self.limits.max_fetch_hashes:
            raise invalid(
                f"FetchRequest lists {len(digests)} blobs; ask for at most "
                f"{self.limits.max_fetch_hashes} per call"
            )
        malformed = [d for d in digests if not is_sha256_hex(d)]
        if malformed:
            raise invalid(f"not sha256 hex digests: {', '.join(shown(d) for d in malformed[:3])}")
        sizes = self.catalog.blob_sizes(request.model, digests)
        foreign = [d for d in digests if d not in sizes]
        if foreign:
            raise invalid(
                f"model {request.model} has no tensor with sha256 {', '.join(foreign[:3])}"
                + (f" (+{len(foreign) - 3} more)" if len(foreign) > 3 else "")
            )
        return {d: sizes[d] for d in digests}

    async def _stream_blob(
        self, model: str, digest: str, size: int, context: Any
    ) -> AsyncIterator[coordinator_pb2.TensorChunk]:
        path = self.blobs.path(digest)
        try:
            handle = await asyncio.to_thread(path.open, "rb")
        except FileNotFoundError:
            log.error("blob %s of model %s is missing from %s", digest, model, self.blobs.root)
            await context.abort(
                grpc.StatusCode.DATA_LOSS,
                f"blob {digest} of model {model} is missing from the coordinator's store",
            )
        checker = hashlib.sha256()
        offset = 0
        try:
            while offset < size:
                want = min(self.limits.fetch_chunk_bytes, size - offset)
                data = await asyncio.to_thread(_read_and_hash, handle, checker, want)
                if not data:
                    break
                yield coordinator_pb2.TensorChunk(
                    sha256=digest, offset=offset, total_bytes=size, data=data
                )
                offset += len(data)
        finally:
            handle.close()
        if offset != size or checker.hexdigest() != digest:
            # The node would reject these bytes anyway; say where the fault is.
            log.error("blob %s of model %s is corrupt on disk", digest, model)
            await context.abort(
                grpc.StatusCode.DATA_LOSS,
                f"blob {digest} of model {model} is corrupt in the coordinator's store; "
                "the operator must re-add the model",
            )

    def _is_stored(self, digest: str) -> bool:
        return digest not in self._deleting and self.blobs.has(digest)

    async def _collect(self, digests: Iterable[str]) -> int:
        """Delete blobs no model references and no import in flight relies on."""
        candidates = {d for d in digests if not self._pinned.get(d)}
        garbage = candidates - self.catalog.referenced(candidates) - self._deleting
        if not garbage:
            return 0
        # Marked before the first await: an import starting now stores its own copy.
        self._deleting |= garbage
        try:
            async with self._blob_lock:
                await asyncio.to_thread(lambda: [self.blobs.delete(d) for d in garbage])
        finally:
            self._deleting -= garbage
        return len(garbage)

    def _recover(self) -> None:
        leftovers = self.blobs.clear_incoming()
        orphans = set(self.blobs.all_digests()) - self.catalog.all_digests()
        for digest in orphans:
            self.blobs.delete(digest)
        if leftovers or orphans:
            log.info(
                "cleaned up after an interrupted import: %d partial and %d orphan blob(s)",
                leftovers,
                len(orphans),
            )

    def _notify(self, event: str, name: str) -> None:
        for listener in self._listeners:
            try:
                listener(event, name)
            except Exception:
                log.exception("model store listener failed on %s %s", event, name)


async def authorize_node(context: Any, check_ticket: TicketCheck | None) -> str:
    """The node id a call's metadata proves (StoreError UNAUTHENTICATED otherwise)."""
    metadata = {key: value for key, value in (context.invocation_metadata() or ())}
    node_id = metadata.get(NODE_ID_METADATA)
    ticket_hex = metadata.get(TICKET_METADATA)
    if not node_id or not ticket_hex:
        raise StoreError(
            grpc.StatusCode.UNAUTHENTICATED,
            f"node calls (model fetches, checkpoints) need metadata {NODE_ID_METADATA} and "
            f"{TICKET_METADATA} (the attach_ticket from RegisterResponse, hex encoded); "
            "register first",
        )
    try:
        ticket = bytes.fromhex(ticket_hex if isinstance(ticket_hex, str) else "")
    except ValueError:
        ticket = b""
    if not ticket:
        raise StoreError(
            grpc.StatusCode.UNAUTHENTICATED, f"{TICKET_METADATA} must be the ticket in hex"
        )
    if check_ticket is None:
        raise StoreError(
            grpc.StatusCode.UNAUTHENTICATED,
            "this coordinator has no node registry to check tickets against",
        )
    valid = check_ticket(node_id, ticket)
    if inspect.isawaitable(valid):
        valid = await valid
    if not valid:
        raise StoreError(
            grpc.StatusCode.UNAUTHENTICATED,
            f"node {shown(node_id)} is unknown or its ticket is stale; register again",
        )
    return node_id


def _read_and_hash(handle: Any, checker: Any, size: int) -> bytes:
    data = handle.read(size)
    checker.update(data)
    return data


def _ranges(layers: list[int]) -> str:
    parts: list[str] = []
    start = prev = layers[0]
    for layer in layers[1:] + [None]:  # type: ignore[list-item]
        if layer is not None and layer == prev + 1:
            prev = layer
            continue
        parts.append(str(start) if start == prev else f"{start}-{prev}")
        if layer is not None:
            start = prev = layer
    return ", ".join(parts)
