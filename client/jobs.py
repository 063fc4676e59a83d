"""Training jobs from the client: upload a dataset, submit a job, and run it to the end.

    with Client("coord:7000") as c:
        job = c.train("llama-tiny", "data.npy", steps=200, batch_size=8, seq_len=64, lr=3e-4,
                      checkpoint_every=20, output_model="llama-tiny-ft")
        for event in job.events():              # step, checkpoint, replan, resume, done
            print(event.step, event.loss)
        job.wait()

The job runner is the driver's loop. It opens the job's training session at the
coordinator (stage nodes plus a capability), restores every stage from the last
consistent checkpoint when there is one, and feeds deterministic batches from the stored
dataset to `TrainingDriver`, one optimizer step at a time. It reports every step, has
every stage checkpoint every K steps and at the end, and then finishes the job. When a
stage node fails, it asks the coordinator to re-plan that stage, puts the new node in,
and rolls every stage back to the last consistent checkpoint, so the job goes on. When
the runner itself dies, `tessera train --resume JOB_ID` starts a new one where the
checkpoints left off: batches depend only on the step, so it trains exactly what the
first runner would have.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import time
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import grpc
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from client import billing
from client.billing import UsageBook
from client.channels import ChannelPool
from client.dataset_cache import CACHE_ENV, DatasetCache
from client.datasets import BatchSampler, Progress, TokenDataset, upload_messages
from client.errors import CoordinatorError, TesseraError
from client.training_driver import (
    StageFailed,
    StageOutOfSync,
    StepResult,
    TrainingDriver,
    TrainingDriverConfig,
    TrainingHop,
)
from protos.coordinator_clock import StampClock
from protos.tessera.v1 import (
    jobs_pb2,
    jobs_pb2_grpc,
    ledger_pb2,
    training_pb2,
    verification_pb2,
    verification_pb2_grpc,
)

log = logging.getLogger("tessera.jobs")

# How long the runner waits for an answer while the coordinator says UNAVAILABLE: a
# re-plan that finds no node yet (replacements still loading the shard), or a coordinator
# that is down or restarting (the stages train without it between reports).
REPLAN_PATIENCE_S = 120.0
# Retries within this time log at INFO (a re-plan's usual wait), later ones at WARNING.
QUIET_RETRY_S = 5.0
MAX_RECOVERIES = 20
# Arbitration replays a stage's calls since a checkpoint on a third node.
DISPUTE_TIMEOUT_S = 600.0
MAX_AGREEMENTS_PER_REPORT = 1024


@dataclass(frozen=True)
class JobEvent:
    """What the runner did: kind is step | checkpoint | replan | resume | done | paused."""

    kind: str
    job_id: str
    step: int  # the stages' step after the event
    steps: int
    loss: float = 0.0
    tokens_per_s: float = 0.0
    detail: str = ""
    result: StepResult | None = None


@dataclass(frozen=True)
class TrainSpec:
    """Everything `Client.train` needs besides the model and the data."""

    steps: int
    batch_size: int
    seq_len: int
    lr: float
    micro_batches: int = 1
    checkpoint_every: int = 0
    mode: str = "full"
    lora_rank: int = 8
    lora_alpha: float = 16.0
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    seed: int = 0
    output_model: str = ""
    account: str = ""

    def hyper(self) -> training_pb2.TrainingHyper:
        return training_pb2.TrainingHyper(
            mode=self.mode,
            lora_rank=self.lora_rank if self.mode == "lora" else 0,
            lora_alpha=self.lora_alpha if self.mode == "lora" else 0.0,
            lr=self.lr,
            beta1=0.9,
            beta2=0.999,
            eps=1e-8,
            weight_decay=self.weight_decay,
            max_grad_norm=self.max_grad_norm,
            seed=self.seed,
            micro_batches=self.micro_batches,
        )


class JobsApi:
    """The Jobs RPCs with the client's error mapping (`call` is AsyncClient._call)."""

    def __init__(
        self, channel: grpc.aio.Channel, call: Callable[..., Any], clock: StampClock
    ) -> None:
        self.stub = jobs_pb2_grpc.JobsStub(channel)
        self.verification = verification_pb2_grpc.VerificationStub(channel)
        self.call = call
        self.clock = clock  # the client's: stamps signed opens by the coordinator's time

    async def upload_dataset(
        self, dataset: TokenDataset, progress: Progress | None = None
    ) -> jobs_pb2.DatasetInfo:
        """Send the dataset unless the coordinator already holds the same tokens."""
        # Hashing a large file takes seconds: off the event loop, which other work shares.
        await asyncio.to_thread(dataset.shard_list, progress)
        try:
            return await self.call(
                "looking up the dataset", self.stub.GetDataset, jobs_pb2.DatasetRef(id=dataset.id)
            )
        except CoordinatorError as err:
            if err.code != grpc.StatusCode.NOT_FOUND:
                raise
        try:
            return await self.stub.UploadDataset(_aiter(upload_messages(dataset, progress)))
        except grpc.aio.AioRpcError as err:
            raise CoordinatorError(
                "uploading the dataset", err.code(), err.details() or ""
            ) from err

    async def download_dataset(
        self, dataset_id: str, cache: DatasetCache, progress: Progress | None = None
    ) -> TokenDataset:
        """The job's dataset from the runner's disk cache, downloaded there first if it is
        not yet (client/dataset_cache.py)."""
        cached = cache.load(dataset_id)
        if cached is not None:
            return cached
        stream = self.stub.DownloadDataset(jobs_pb2.DatasetRef(id=dataset_id))
        try:
            return await cache.download(dataset_id, stream, progress)
        except grpc.aio.AioRpcError as err:
            raise CoordinatorError(
                "downloading the dataset", err.code(), err.details() or ""
            ) from err
        except OSError as err:
            raise TesseraError(
                f"cannot keep the dataset in {cache.dir} ({err}); set {CACHE_ENV} to a "
                "writable directory with room for it"
            ) from err
        except ValueError as err:  # the stream itself was wrong; nothing of it was kept
            raise TesseraError(
                f"downloading dataset {dataset_id[:12]} failed: {err}; try again, and report "
                "it to the coordinator's operator if it happens again"
            ) from err
        finally:
            stream.cancel()  # a stream refused half-way would otherwise still be sending

    async def submit(
        self, model: str, dataset_id: str, spec: TrainSpec, owner: bytes = b""
    ) -> jobs_pb2.JobInfo:
        """Submit a job; ``owner`` (a client public key) is then the only key whose signed
        open starts its sessions, a resume included."""
        request = jobs_pb2.SubmitJobRequest(
            model=model,
            dataset_id=dataset_id,
            hyper=spec.hyper(),
            steps=spec.steps,
            batch_size=spec.batch_size,
            seq_len=spec.seq_len,
            checkpoint_every=spec.checkpoint_every,
            output_model=spec.output_model,
            account=spec.account,
            owner_public_key=owner,
        )
        return await self.call("submitting the job", self.stub.SubmitJob, request)

    async def job(self, job_id: str) -> jobs_pb2.JobInfo:
        return await self.call(
            f"looking up job {job_id}", self.stub.GetJob, jobs_pb2.JobRef(job_id=job_id)
        )

    async def jobs(self, limit: int = 100) -> list[jobs_pb2.JobInfo]:
        reply = await self.call(
            "listing jobs", self.stub.ListJobs, jobs_pb2.ListJobsRequest(limit=limit)
        )
        return list(reply.jobs)

    async def watch(self, job_id: str) -> AsyncIterator[jobs_pb2.JobEvent]:
        async for event in self.stub.WatchJob(jobs_pb2.JobRef(job_id=job_id)):
            yield event


@dataclass
class JobRunner:
    """Runs one job to the end (or until it must pause); see the module docstring."""

    api: JobsApi
    job_id: str
    channels: ChannelPool
    dataset: TokenDataset | None = None  # downloaded from the coordinator when None
    # Where a downloaded dataset is kept (memory-mapped, reused by a later resume).
    dataset_cache: DatasetCache = field(default_factory=DatasetCache)
    on_event: Callable[[JobEvent], None] = lambda event: None
    # Test and demo hook: called after every applied step with the stages' new step.
    after_step: Callable[[int], Any] | None = None
    # With a key the job is paid: it signs the open (the coordinator escrows the quote,
    # refused above max_price) and counter-signs the nodes' usage receipts, which settle
    # at every checkpoint and at the end, and which the nodes settle themselves once
    # acknowledged (docs/ledger.md, "Jobs").
    key: Ed25519PrivateKey | None = None
    max_price: int = 0
    driver_config: TrainingDriverConfig | None = None  # timeouts and step deadlines
    usage: UsageBook = field(default_factory=UsageBook, init=False)
    _seeded: bool = field(default=False, init=False)
    _session: jobs_pb2.TrainingSession | None = field(default=None, init=False)
    recoveries: int = field(default=0, init=False)
    # Signatures of the replies whose agreements were reported. A step redone after a
    # rollback returns the very reply it did before (same weights, same input, and an
    # Ed25519 signature is deterministic); the coordinator counts each signed reply once
    # and refuses a report that repeats one, with every new agreement in it.
    _reported: set[bytes] = field(default_factory=set, init=False)

    async def run(self) -> jobs_pb2.JobInfo:
        if self.dataset is None:  # before the session opens: its nodes would wait meanwhile
            info = await self.api.job(self.job_id)
            self.dataset = await self.api.download_dataset(info.dataset_id, self.dataset_cache)
        session = await self._open_session()
        job = session.job
        sampler = BatchSampler(self.dataset, job.seq_len, job.batch_size, job.hyper.seed)
        driver = TrainingDriver(
            job_id=job.job_id,
            model=job.model,
            hops=[_hop(h) for h in session.hops],
            capability=session.capability,
            hyper=job.hyper,
            channels=self.channels,
            config=self.driver_config,
            usage=self.usage,
            # Independent checkers the coordinator granted; each interval is checked with
            # the primary's own trust-based probability (docs/verification.md).
            checkers=[_hop(c) for c in session.checkers],
            check_probability=None,
            disputes=self._dispute,
            # A paid job's nodes hold the runner to its receipts: it acknowledges them as it
            # goes, and each node settles them itself (docs/ledger.md, "Jobs").
            key=self.key,
        )
        try:
            failure: StageFailed | None = None
            step = -1
            while True:
                try:
                    if failure is not None:  # a stage died (also while restoring): recover
                        step, failure = await self._recover(driver, failure), None
                    elif step < 0:
                        kind = "resume" if session.restore_step else ""
                        step = await self._restore(driver, session, kind)
                    step = await self._train(driver, sampler, step, job)
                    break
                except StageFailed as failed:
                    failure = failed
            await self._report_checks(driver)
            info = await self._finish(jobs_pb2.JOB_STATE_DONE)
            self.on_event(JobEvent("done", job.job_id, info.step, info.steps, info.last_loss))
            return info
        except (asyncio.CancelledError, KeyboardInterrupt):
            await self._pause("the runner was interrupted")
            raise
        except TesseraError as err:
            await self._pause(str(err))
            raise
        finally:
            await driver.close()

    async def _train(
        self, driver: TrainingDriver, sampler: BatchSampler, step: int, job: jobs_pb2.JobInfo
    ) -> int:
        every = job.checkpoint_every
        while step < job.steps:
            inputs, labels = sampler.batch(step)
            result = await driver.train_step(step, inputs, labels)
            tokens_per_s = result.tokens / result.wall_s if result.wall_s > 0 else 0.0
            checkpoint = step + 1 == job.steps or bool(every and (step + 1) % every == 0)
            await self._report(result, tokens_per_s, settle=checkpoint)
            step += 1
            self.on_event(
                JobEvent(
                    "step", job.job_id, step, job.steps, result.loss, tokens_per_s, result=result
                )
            )
            if step == job.steps or (every and step % every == 0):
                await driver.save_checkpoint(step)
                await self._report_checks(driver)
                self.on_event(JobEvent("checkpoint", job.job_id, step, job.steps))
            if self.after_step is not None:
                outcome = self.after_step(step)
                if asyncio.iscoroutine(outcome):
                    await outcome
        return step

    async def _recover(self, driver: TrainingDriver, failure: StageFailed) -> int:
        """Re-plan the failed stage (or just re-sync), then roll every stage back."""
        self.recoveries += 1
        await self._report_checks(driver)  # while the session that granted them holds
        if self.recoveries > MAX_RECOVERIES:
            raise TesseraError(f"gave up after {MAX_RECOVERIES} recoveries; last: {failure}")
        assert self._session is not None
        if isinstance(failure, StageOutOfSync):
            session = await self._open_session()
            for index, hop in enumerate(session.hops):
                driver.replace_hop(index, _hop(hop), session.capability)
            driver.set_checkers([_hop(c) for c in session.checkers])
            return await self._restore(driver, session, f"re-sync: {failure.cause}")
        request = jobs_pb2.StageFailureRequest(
            job_id=self.job_id,
            capability=self._session.capability,
            stage=failure.index,
            node_id=failure.node_id,
            cause=failure.cause[:4000],
        )
        if failure.restore_at_most is not None:
            request.restore_at_most = failure.restore_at_most
        session = await self._with_patience(
            "re-planning the failed stage", self.api.stub.ReportStageFailure, lambda: request
        )
        self._session = session
        index = session.replaced_stage
        driver.replace_hop(index, _hop(session.hops[index]), session.capability)
        driver.set_checkers([_hop(c) for c in session.checkers])
        detail = (
            f"stage {index} [{failure_span(session, index)}) moved from {failure.node_id} to "
            f"{session.hops[index].node_id} ({failure.cause})"
        )
        self.on_event(
            JobEvent("replan", self.job_id, session.restore_step, session.job.steps, detail=detail)
        )
        return await self._restore(driver, session, "")

    async def _restore(
        self, driver: TrainingDriver, session: jobs_pb2.TrainingSession, kind: str
    ) -> int:
        digests = {(p.layers.start, p.layers.end): p.sha256 for p in session.restore}
        step = await driver.open(restore_step=session.restore_step, restore_sha256=digests)
        if kind:
            self.on_event(JobEvent("resume", self.job_id, step, session.job.steps, detail=kind))
        return step

    async def _open_session(self) -> jobs_pb2.TrainingSession:
        def signed() -> jobs_pb2.OpenTrainingSessionRequest:
            # Signed anew for every attempt: the coordinator accepts a signed open only once.
            request = jobs_pb2.OpenTrainingSessionRequest(
                job_id=self.job_id, max_price=self.max_price
            )
            if self.key is not None:
                billing.sign_open_training(request, self.key, self.api.clock.now_ms())
            return request

        self._session = await self._with_patience(
            "opening the training session", self.api.stub.OpenTrainingSession, signed
        )
        if not self._seeded:
            # A resumed job: what earlier runners settled counts as sent (the nodes'
            # cumulative receipts include it); samples a runner that died unannounced had
            # computed after its last settlement are in them too, and not paid
            # (UsageBook.inherited, docs/ledger.md).
            for usage in self._session.settled:
                self.usage.inherited(
                    usage.node_id, usage.layer_start, usage.layer_end, usage.tokens
                )
            self._seeded = True
        return self._session

    async def _with_patience(self, what: str, method: Any, request: Callable[[], Any]) -> Any:
        """Call with ``request()``, retrying while the coordinator answers UNAVAILABLE (no
        node for a stage yet) or cannot be reached (down, or restarting), up to
        REPLAN_PATIENCE_S. The coordinator takes a retry of a report it recorded before its
        answer was lost as a success."""
        began = time.monotonic()
        delay = 0.5
        while True:
            try:
                return await method(request(), timeout=30.0)
            except grpc.aio.AioRpcError as err:
                if self.api.clock.learn(err):
                    continue  # a stamp refused as stale: ``request()`` stamps anew
                waited = time.monotonic() - began
                if err.code() != grpc.StatusCode.UNAVAILABLE or waited > REPLAN_PATIENCE_S:
                    raise CoordinatorError(what, err.code(), err.details() or "") from err
                level = logging.INFO if waited < QUIET_RETRY_S else logging.WARNING
                log.log(level, "%s: %s; retrying in %.1fs", what, err.details(), delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)

    async def _dispute(self, dispute: verification_pb2.TrainingDispute) -> verification_pb2.Verdict:
        """A lockstep check disagreed: the coordinator arbitrates (docs/verification.md)."""
        try:
            return await self.api.verification.ReportTrainingDispute(
                dispute, timeout=DISPUTE_TIMEOUT_S
            )
        except grpc.aio.AioRpcError as err:
            raise CoordinatorError(
                "reporting a training dispute", err.code(), err.details() or ""
            ) from err

    async def _report_checks(self, driver: TrainingDriver) -> None:
        """Agreed lockstep checks raise both nodes' reputation; losing them only costs
        trust, never the job, so a refusal is logged and dropped."""
        assert self._session is not None
        fresh = _unreported(driver.agreements, self._reported)
        driver.agreements.clear()
        while fresh:
            batch = fresh[:MAX_AGREEMENTS_PER_REPORT]
            del fresh[:MAX_AGREEMENTS_PER_REPORT]
            request = verification_pb2.TrainingChecks(
                job_id=self.job_id, capability=self._session.capability, agreements=batch
            )
            try:
                await self.api.verification.ReportTrainingChecks(request, timeout=30.0)
            except grpc.aio.AioRpcError as err:
                log.warning("training checks not reported: %s: %s", err.code().name, err.details())
            else:
                self._reported.update(s.signature for a in batch for s in (a.primary, a.checker))

    def _receipts(self) -> list[ledger_pb2.SignedUsage]:
        return self.usage.countersign(self.job_id, self.key) if self.key is not None else []

    async def _report(self, result: StepResult, tokens_per_s: float, *, settle: bool) -> None:
        assert self._session is not None
        request = jobs_pb2.ReportStepRequest(
            job_id=self.job_id,
            capability=self._session.capability,
            step=result.step,
            loss=result.loss,
            grad_norm=result.grad_norm,
            tokens=result.tokens,
            tokens_per_s=tokens_per_s,
            stage_ms=result.stage_ms,
            wall_s=result.wall_s,
            usage=self._receipts() if settle else [],
        )
        await self._with_patience(
            f"reporting step {result.step}", self.api.stub.ReportStep, lambda: request
        )

    async def _finish(
        self, state: int, error: str = "", *, patient: bool = True
    ) -> jobs_pb2.JobInfo:
        """Record the job's end; ``patient`` waits out a coordinator restart (a pause does
        not: the runner is stopping, and ``--resume`` opens the job whatever it says)."""
        assert self._session is not None
        request = jobs_pb2.FinishJobRequest(
            job_id=self.job_id,
            capability=self._session.capability,
            state=state,
            error=error[:4000],
            usage=self._receipts(),
        )
        if not patient:
            return await self.api.call("finishing the job", self.api.stub.FinishJob, request)
        return await self._with_patience(
            "finishing the job", self.api.stub.FinishJob, lambda: request
        )

    async def _pause(self, reason: str) -> None:
        if self._session is None:
            return
        try:
            await self._finish(jobs_pb2.JOB_STATE_PAUSED, reason, patient=False)
            self.on_event(JobEvent("paused", self.job_id, 0, 0, detail=reason))
        except (TesseraError, grpc.aio.AioRpcError) as err:
            log.info("could not mark job %s paused: %s", self.job_id, err)


def failure_span(session: jobs_pb2.TrainingSession, index: int) -> str:
    layers = session.hops[index].layers
    return f"{layers.start}, {layers.end}"


def _hop(hop: Any) -> TrainingHop:
    return TrainingHop(hop.node_id, hop.address, hop.layers.start, hop.layers.end)


async def _aiter(items: Iterator[Any]) -> AsyncIterator[Any]:
    for item in items:
        yield item


class TrainingJob:
    """A handle on a job that a runner drives in the background (see `Client.train`)."""

    def __init__(
        self, job_id: str, future: Future[jobs_pb2.JobInfo], events: queue.Queue[JobEvent | None]
    ) -> None:
        self.job_id = job_id
        self._future = future
        self._events = events

    def events(self, timeout_s: float | None = None) -> Iterator[JobEvent]:
        """Runner events as they happen, until the run ends (raises what ended it)."""
        while True:
            try:
                event = self._events.get(timeout=timeout_s)
            except queue.Empty:
                raise TimeoutError(f"no event from job {self.job_id} in {timeout_s}s") from None
            if event is None:
                self._future.result()  # re-raise a failure
                return
            yield event

    def wait(self, timeout_s: float | None = None) -> jobs_pb2.JobInfo:
        return self._future.result(timeout=timeout_s)

    def done(self) -> bool:
        return self._future.done()

    def cancel(self) -> None:
        """Stop the runner; the job is marked paused and can be resumed later."""
        self._future.cancel()


def _unreported(
    agreements: list[verification_pb2.TrainingAgreement], reported: set[bytes]
) -> list[verification_pb2.TrainingAgreement]:
    """The agreements none of whose signed replies was reported, nor is in an earlier one of
    these: the coordinator counts each once and refuses a report that repeats one."""
    fresh: list[verification_pb2.TrainingAgreement] = []
    seen: set[bytes] = set()
    for agreement in agreements:
        signatures = {agreement.primary.signature, agreement.checker.signature}
        if not (signatures & reported or signatures & seen):
            seen |= signatures
            fresh.append(agreement)
    return fresh
