"""The Jobs (clients) and TrainingStore (nodes) gRPC services, and `build(ctx)`.

Datasets and checkpoint parts are blobs in a content-addressed store of their own under
DATA_DIR/job_blobs (the model store's BlobStore class; a separate root because the model
store deletes every blob no model references when it starts). Nodes authenticate uploads
and downloads with the same ticket metadata as FetchTensors.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any, NoReturn

import grpc

from coordinator.context import CoordinatorContext
from coordinator.jobs import datasets, export
from coordinator.jobs.billing import JobBilling
from coordinator.jobs.blob_io import read_blob
from coordinator.jobs.limits import JobLimits
from coordinator.jobs.manager import (
    FINISHED,
    STATES,
    JobManager,
    ModelFacts,
    events_topic,
)
from coordinator.jobs.repository import CheckpointPartRecord, JobRecord, JobRepository
from coordinator.model_store.blob_store import BlobStore, BlobWriter, DigestMismatch, is_sha256_hex
from coordinator.model_store.errors import StoreError, invalid
from coordinator.model_store.layout import ModelLayout
from coordinator.model_store.service import authorize_node
from protos.datasets import TOKEN_BYTES
from protos.quoting import shown
from protos.tessera.v1 import (
    client_api_pb2,
    common_pb2,
    jobs_pb2,
    jobs_pb2_grpc,
    training_pb2,
    training_pb2_grpc,
)

log = logging.getLogger("tessera.jobs")
# How often old jobs and unused datasets are looked for, at most (a quarter of the shorter
# of their times to live, if that is shorter).
PRUNE_EVERY_S = 600.0

TicketCheck = Callable[[str, bytes], "bool | Awaitable[bool]"]


async def _abort(context: Any, err: StoreError) -> NoReturn:
    await context.abort(err.code, err.message, trailing_metadata=err.trailing_metadata)
    raise AssertionError("unreachable: abort() raises")


async def _answer(context: Any, call: Callable[[], Any]) -> Any:
    """Run `call`, mapping StoreError (and a full disk) to a gRPC status."""
    try:
        result = call()
        if asyncio.iscoroutine(result):
            result = await result
        return result
    except StoreError as err:
        log.info("refused: %s: %s", err.code.name, err.message)
        await _abort(context, err)
    except OSError as err:
        log.exception("the jobs store failed")
        code = (
            grpc.StatusCode.RESOURCE_EXHAUSTED
            if err.errno == errno.ENOSPC
            else grpc.StatusCode.INTERNAL
        )
        await context.abort(code, f"the coordinator could not store the data ({err})")


class Jobs:
    """The jobs component: the manager, its blob store and both servicers."""

    def __init__(
        self,
        ctx: CoordinatorContext,
        data_dir: Path,
        *,
        limits: JobLimits | None = None,
        check_ticket: TicketCheck | None = None,
    ) -> None:
        self.ctx = ctx
        self.limits = limits or JobLimits()
        self.blobs = BlobStore(data_dir / "job_blobs")
        self.repo = JobRepository(ctx.db)
        self.check_ticket = check_ticket
        self.manager = JobManager(
            self.repo,
            signing_key=ctx.signing_key,
            bus=ctx.bus,
            placement=lambda: ctx.planner,
            model_facts=self._model_facts,
            model_names=lambda: (
                [m.name for m in ctx.model_store.models()] if ctx.model_store else []
            ),
            limits=self.limits,
            hop_details=self._hop_details,
            billing=_billing(ctx),
            retention_s=ctx.settings.job_retention_s,
        )
        # Publishing a blob and recording the row that references it happen under this
        # lock, and so does collecting unreferenced blobs: neither can undo the other.
        self._blob_lock = asyncio.Lock()
        self._exporting: set[str] = set()
        self.watchers = 0  # open WatchJob streams
        self._pruning: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self.blobs.clear_incoming()
        self.manager.restore_reservations()
        settings = self.ctx.settings
        ages = [t for t in (settings.dataset_ttl_s, settings.job_retention_s) if t > 0]
        if ages:
            every = max(0.05, min(min(ages) / 4, PRUNE_EVERY_S))
            self._pruning = asyncio.get_running_loop().create_task(self._prune_forever(every))

    async def stop(self) -> None:
        if self._pruning is not None:
            self._pruning.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._pruning

    async def _prune_forever(self, every_s: float) -> None:
        # Anyone may upload a dataset or submit a job: neither may hold the disk forever.
        settings = self.ctx.settings
        while True:
            await asyncio.sleep(every_s)
            try:
                now = time.time()
                if settings.job_retention_s > 0:
                    await self.prune_jobs(int((now - settings.job_retention_s) * 1000))
                if settings.dataset_ttl_s > 0:
                    await self.prune_datasets(int((now - settings.dataset_ttl_s) * 1000))
            except Exception:  # a failed sweep is tried again at the next one
                log.exception("pruning old jobs and unused datasets failed")

    async def prune_jobs(self, before_ms: int) -> list[str]:
        """Delete the jobs that ended before ``before_ms``, and then their blobs."""
        days = self.ctx.settings.job_retention_s / 86400
        return await self._prune(
            lambda: self.manager.delete_finished(before_ms),
            f"job(s) that ended, or were submitted and never opened, {days:.1f} days ago or more",
        )

    async def prune_datasets(self, before_ms: int) -> list[str]:
        """Delete the datasets no job uses that nobody uploaded or looked up since
        ``before_ms``, and then their blobs."""
        hours = self.ctx.settings.dataset_ttl_s / 3600
        return await self._prune(
            lambda: self.repo.delete_unused_datasets(before_ms),
            f"dataset(s) that no job used and nobody asked for in {hours:.1f} h",
        )

    async def _prune(self, delete: Callable[[], list[str]], what: str) -> list[str]:
        async with self._blob_lock:
            removed = delete()
            if removed:
                await self._collect_garbage()
        if removed:
            shown_ids = ", ".join(i[:16] for i in removed[:5])
            log.info("removed %d %s: %s%s", len(removed), what, shown_ids,
                     " ..." if len(removed) > 5 else "")  # fmt: skip
        return removed

    def add_to_server(self, server: grpc.aio.Server) -> None:
        jobs_pb2_grpc.add_JobsServicer_to_server(JobsServicer(self), server)
        training_pb2_grpc.add_TrainingStoreServicer_to_server(TrainingStoreServicer(self), server)

    def _hop_details(self, hop: client_api_pb2.Hop) -> None:
        # Looked up per call: the verifier component is built after this one.
        if self.ctx.verifier is not None:
            self.ctx.verifier.describe_hop(hop)

    def _model_facts(self, name: str) -> ModelFacts | None:
        store = self.ctx.model_store
        record = store.model(name) if store is not None else None
        if record is None:
            return None
        return ModelFacts(record.name, ModelLayout.from_config(json.loads(record.config_json)))

    # ---- datasets -----------------------------------------------------------------------

    async def upload_dataset(
        self, messages: AsyncIterator[jobs_pb2.DatasetChunk]
    ) -> jobs_pb2.DatasetInfo:
        iterator = messages.__aiter__()
        try:
            first = await iterator.__anext__()
        except StopAsyncIteration:
            raise invalid("empty UploadDataset stream: send the header first") from None
        if first.WhichOneof("kind") != "header":
            raise invalid("the first UploadDataset message must be the header")
        plan = datasets.plan_dataset(first.header, self.limits)
        existing = self.repo.dataset(plan.id)
        needed = plan.num_tokens * TOKEN_BYTES
        if existing is None and needed + self.limits.min_free_bytes > self.blobs.free_bytes():
            raise StoreError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"the dataset needs {needed} bytes, more than the coordinator's store has free",
            )
        receiver = datasets.DatasetReceiver(plan, self.blobs)
        try:
            async for message in iterator:
                if message.WhichOneof("kind") != "data":
                    raise invalid("only the first UploadDataset message may be a header")
                await receiver.accept(message.data)
            writers = receiver.complete()
            record = dataclasses.replace(plan, max_token_id=receiver.max_token_id)
            async with self._blob_lock:
                await asyncio.to_thread(lambda: [w.publish() for w in writers])
                self.repo.put_dataset(record)
        finally:
            receiver.discard()
        log.info(
            "dataset %s (%s): %d tokens in %d shards",
            record.id[:12], record.name, record.num_tokens, len(record.shards),
        )  # fmt: skip
        return datasets.to_info(self.repo.dataset(record.id) or record)

    def get_dataset(self, dataset_id: str) -> jobs_pb2.DatasetInfo:
        record = self.repo.dataset(dataset_id) if is_sha256_hex(dataset_id) else None
        if record is None:
            ttl_h = self.ctx.settings.dataset_ttl_s / 3600
            why = (
                f" (one that no job used is deleted {ttl_h:g} h after it was last uploaded or "
                "looked up)"
                if ttl_h > 0
                else ""
            )
            raise StoreError(
                grpc.StatusCode.NOT_FOUND,
                f"no dataset with id {shown(dataset_id)}{why}; upload it with UploadDataset",
            )
        # A client looks a dataset up before it submits a job on it: keep it a while.
        self.repo.touch_dataset(record.id, int(time.time() * 1000))
        return datasets.to_info(record)

    # ---- checkpoints --------------------------------------------------------------------

    def _checkpoint_limit(self, job: JobRecord) -> int:
        facts = self._model_facts(job.model)
        shapes = facts.layout.expected_shapes().values() if facts else []
        params = sum(_numel(s) for s in shapes)
        return (
            self.limits.checkpoint_bytes_per_fp32_model * 4 * params
            + self.limits.checkpoint_header_slack
        )

    async def upload_checkpoint(
        self, messages: AsyncIterator[training_pb2.CheckpointChunk], context: Any
    ) -> training_pb2.CheckpointReceipt:
        node_id = await authorize_node(context, self.check_ticket)
        iterator = messages.__aiter__()
        try:
            first = await iterator.__anext__()
        except StopAsyncIteration:
            raise invalid(
                "empty UploadCheckpoint stream: the first chunk carries the header"
            ) from None
        if not first.HasField("header"):
            raise invalid("the first UploadCheckpoint chunk must carry the header")
        header = first.header
        job = self.manager.check_upload(header, node_id)
        if not is_sha256_hex(header.sha256):
            raise invalid(
                f"header.sha256 must be 64 lowercase hex digits, got {shown(header.sha256)}"
            )
        limit = self._checkpoint_limit(job)
        if not 0 < header.total_bytes <= limit:
            raise StoreError(
                grpc.StatusCode.RESOURCE_EXHAUSTED
                if header.total_bytes
                else grpc.StatusCode.INVALID_ARGUMENT,
                f"a checkpoint part of job {job.id} must hold 1..{limit} bytes, the header "
                f"declares {header.total_bytes}",
            )
        writer = self.blobs.new_writer()
        try:
            await _receive(writer, first, iterator, header.total_bytes)
            try:
                await asyncio.to_thread(writer.finish, header.sha256)
            except DigestMismatch as err:
                raise invalid(
                    f"the checkpoint's bytes have sha256 {err.actual}, but the header declared "
                    f"{err.expected}; the upload is corrupt and was not recorded"
                ) from None
            part = CheckpointPartRecord(
                header.step, header.layers.start, header.layers.end, header.sha256,
                header.total_bytes, node_id,
            )  # fmt: skip
            async with self._blob_lock:
                await asyncio.to_thread(writer.publish)
                consistent = self.manager.record_checkpoint_part(job.id, part)
                if consistent:
                    await self._collect_garbage()
        finally:
            writer.discard()
        log.info(
            "job %s: node %s uploaded layers [%d, %d) at step %d (%d bytes)%s",
            job.id, node_id, part.start, part.end, part.step, part.total_bytes,
            ", checkpoint consistent" if consistent else "",
        )  # fmt: skip
        return training_pb2.CheckpointReceipt(
            sha256=header.sha256, total_bytes=header.total_bytes, consistent=consistent
        )

    async def download_checkpoint(
        self, request: training_pb2.DownloadCheckpointRequest, node_id: str
    ) -> AsyncIterator[training_pb2.CheckpointChunk]:
        part = self.manager.check_download(request, node_id)
        yield training_pb2.CheckpointChunk(
            header=training_pb2.CheckpointHeader(
                job_id=request.job_id,
                step=part.step,
                layers=common_pb2.LayerRange(start=part.start, end=part.end),
                total_bytes=part.total_bytes,
                sha256=part.sha256,
            )
        )
        offset = 0
        async for data in read_blob(self.blobs, part.sha256, self.limits.chunk_bytes):
            yield training_pb2.CheckpointChunk(offset=offset, data=data)
            offset += len(data)

    async def _collect_garbage(self) -> None:
        """Delete blobs no dataset and no kept checkpoint references (under _blob_lock)."""
        referenced = self.repo.referenced_blobs()
        garbage = [d for d in self.blobs.all_digests() if d not in referenced]
        if garbage:
            await asyncio.to_thread(lambda: [self.blobs.delete(d) for d in garbage])
            log.info("removed %d blob(s) no dataset or kept checkpoint uses", len(garbage))

    # ---- finishing ----------------------------------------------------------------------

    async def finish(self, request: jobs_pb2.FinishJobRequest) -> jobs_pb2.JobInfo:
        repeated = self.manager.repeated_finish(request)
        if repeated is not None:
            return self.manager.info(repeated)  # settled and exported the first time
        job = self.manager.finish(request)
        if job.state == "done" and job.output_model:
            await self._export(job)
        return self.manager.info(self.manager.record_finish(job))

    async def _export(self, job: JobRecord) -> None:
        store = self.ctx.model_store
        if store is None:
            raise StoreError(grpc.StatusCode.UNIMPLEMENTED, "this coordinator has no model store")
        parts = self.repo.checkpoint_parts(job.id, job.steps)
        if {(p.start, p.end) for p in parts} < {(s.start, s.end) for s in job.stages} or not parts:
            raise StoreError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"job {job.id} has no consistent checkpoint at its final step {job.steps}; "
                "save one on every stage before finishing with --output-model",
            )
        if job.id in self._exporting:
            raise StoreError(grpc.StatusCode.ABORTED, f"job {job.id} is already being exported")
        base = store.model(job.model)
        if base is None:
            raise StoreError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"the base model {job.model} was removed; the trained weights cannot be "
                "assembled without it",
            )
        self._exporting.add(job.id)
        try:
            stage_parts = [
                export.StagePart(self.blobs.path(p.sha256), p.start, p.end) for p in parts
            ]
            tensors = await asyncio.to_thread(
                export.trained_tensors, store.tensors(job.model), store.blobs.path, stage_parts
            )
            messages = export.import_messages(
                job.output_model,
                base.config_json,
                store.catalog.tokenizer_json(job.model),
                tensors,
            )
            info = await store.import_model(messages)
        finally:
            self._exporting.discard(job.id)
        log.info("job %s: trained weights registered as model %s", job.id, info.name)

    # ---- watching -----------------------------------------------------------------------

    def take_watcher(self) -> None:
        """Count one more WatchJob stream, or refuse it past the limit; the caller gives
        the slot back with `release_watcher` when the stream ends, however it ends."""
        if self.watchers >= self.limits.max_watchers:
            raise StoreError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{self.watchers} WatchJob streams are open on this coordinator, its limit; "
                "close one, or poll GetJob instead",
            )
        self.watchers += 1

    def release_watcher(self) -> None:
        self.watchers -= 1

    async def watch(self, job_id: str) -> AsyncIterator[jobs_pb2.JobEvent]:
        job = self.manager.require_job(job_id)
        subscription = self.ctx.bus.subscribe(events_topic(job.id))
        try:
            await subscription.ready()
            # Read again after subscribing, so no event falls between snapshot and stream.
            job = self.manager.require_job(job_id)
            yield jobs_pb2.JobEvent(kind="snapshot", job=self.manager.info(job), step=job.step)
            if job.state in FINISHED:
                return
            async for event in subscription:
                payload = event.json()
                kind = str(payload.get("kind", ""))
                message = jobs_pb2.JobEvent(
                    kind=kind,
                    step=int(payload.get("step", 0)),
                    loss=float(payload.get("loss", 0.0)),
                    tokens_per_s=float(payload.get("tokens_per_s", 0.0)),
                    json=event.payload.decode(),
                )
                if kind == "state":
                    message.job.CopyFrom(self.manager.info(self.manager.require_job(job_id)))
                yield message
                if kind == "state" and payload.get("state") in FINISHED:
                    return
        finally:
            subscription.close()


async def _receive(
    writer: BlobWriter,
    first: training_pb2.CheckpointChunk,
    rest: AsyncIterator[training_pb2.CheckpointChunk],
    total: int,
) -> None:
    received = 0

    async def take(chunk: training_pb2.CheckpointChunk) -> None:
        nonlocal received
        if chunk.offset != received:
            raise invalid(f"checkpoint chunk at offset {chunk.offset}, expected {received}")
        if received + len(chunk.data) > total:
            raise invalid(f"the checkpoint has more bytes than the {total} its header declared")
        if chunk.data:
            await asyncio.to_thread(writer.write, chunk.data)
            received += len(chunk.data)

    await take(first)
    async for chunk in rest:
        if chunk.HasField("header"):
            raise invalid("only the first UploadCheckpoint chunk may carry a header")
        await take(chunk)
    if received != total:
        raise invalid(
            f"the stream ended after {received} of {total} checkpoint bytes; nothing was recorded"
        )


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for dim in shape:
        count *= dim
    return count


class JobsServicer(jobs_pb2_grpc.JobsServicer):
    def __init__(self, jobs: Jobs) -> None:
        self.jobs = jobs
        self.manager = jobs.manager

    async def UploadDataset(self, request_iterator: Any, context: Any) -> Any:
        return await _answer(context, lambda: self.jobs.upload_dataset(request_iterator))

    async def GetDataset(self, request: jobs_pb2.DatasetRef, context: Any) -> Any:
        return await _answer(context, lambda: self.jobs.get_dataset(request.id))

    async def DownloadDataset(self, request: jobs_pb2.DatasetRef, context: Any) -> Any:
        info = await _answer(context, lambda: self.jobs.get_dataset(request.id))
        record = self.jobs.repo.dataset(info.id)
        assert record is not None
        try:
            async for chunk in datasets.stream_dataset(
                record, self.jobs.blobs, self.jobs.limits.chunk_bytes
            ):
                yield chunk
        except FileNotFoundError:
            await context.abort(
                grpc.StatusCode.DATA_LOSS,
                f"a shard of dataset {info.id} is missing from the coordinator's store; upload "
                "the dataset again",
            )

    async def SubmitJob(self, request: jobs_pb2.SubmitJobRequest, context: Any) -> Any:
        job = await _answer(context, lambda: self.manager.submit(request))
        return self.manager.info(job)

    async def GetJob(self, request: jobs_pb2.JobRef, context: Any) -> Any:
        job = await _answer(context, lambda: self.manager.require_job(request.job_id))
        return self.manager.info(job, with_losses=True)

    async def ListJobs(self, request: jobs_pb2.ListJobsRequest, context: Any) -> Any:
        jobs = await _answer(context, lambda: self.manager.jobs(request.limit))
        return jobs_pb2.ListJobsResponse(jobs=[self.manager.info(j) for j in jobs])

    async def WatchJob(self, request: jobs_pb2.JobRef, context: Any) -> Any:
        await _answer(context, lambda: self.manager.require_job(request.job_id))
        await _answer(context, self.jobs.take_watcher)
        try:
            async for event in self.jobs.watch(request.job_id):
                yield event
        finally:
            self.jobs.release_watcher()

    async def OpenTrainingSession(self, request: Any, context: Any) -> Any:
        return await _answer(context, lambda: self.manager.open_session(request.job_id, request))

    async def ReportStep(self, request: jobs_pb2.ReportStepRequest, context: Any) -> Any:
        await _answer(context, lambda: self.manager.report_step(request))
        return common_pb2.Empty()

    async def ReportStageFailure(self, request: Any, context: Any) -> Any:
        return await _answer(context, lambda: self.manager.stage_failed(request))

    async def FinishJob(self, request: jobs_pb2.FinishJobRequest, context: Any) -> Any:
        return await _answer(context, lambda: self.jobs.finish(request))


class TrainingStoreServicer(training_pb2_grpc.TrainingStoreServicer):
    def __init__(self, jobs: Jobs) -> None:
        self.jobs = jobs

    async def UploadCheckpoint(self, request_iterator: Any, context: Any) -> Any:
        return await _answer(
            context, lambda: self.jobs.upload_checkpoint(request_iterator, context)
        )

    async def DownloadCheckpoint(
        self, request: training_pb2.DownloadCheckpointRequest, context: Any
    ) -> Any:
        node_id = await _answer(context, lambda: authorize_node(context, self.jobs.check_ticket))
        stream = self.jobs.download_checkpoint(request, node_id)
        try:
            first = await _answer(context, lambda: stream.__anext__())
            yield first
            async for chunk in stream:
                yield chunk
        except FileNotFoundError:
            await context.abort(
                grpc.StatusCode.DATA_LOSS,
                f"checkpoint of job {request.job_id} at step {request.step} is missing from "
                "the coordinator's store",
            )


def _billing(ctx: CoordinatorContext) -> JobBilling | None:
    ledger = getattr(ctx, "ledger", None)
    if ledger is None:
        return None
    credit = ctx.settings.training_usage_credit_samples
    return JobBilling(ledger.ledger, ledger.training_price_of, usage_credit=credit)


def build(ctx: CoordinatorContext) -> Jobs:
    def check_ticket(node_id: str, ticket: bytes) -> bool | Awaitable[bool]:
        return ctx.registry.check_ticket(node_id, ticket)

    return Jobs(ctx, ctx.data_dir, check_ticket=check_ticket)


__all__ = ["STATES", "Jobs", "build"]
