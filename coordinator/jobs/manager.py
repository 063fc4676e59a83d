"""The job lifecycle: submit, open a training session, progress, re-plan after churn, finish.

Every method validates its input and raises StoreError with the gRPC status and a message
a person can act on. A job's driver is whoever opened its newest training session: the
capability the coordinator signed for it (session_id = job id) authorises the driver's
reports, and a capability issued earlier is refused, so two drivers can never advance one
job. The stage layout (the layer ranges) is fixed when the job first opens, because
checkpoints are kept per range; re-planning changes only which node runs a range.
"""

from __future__ import annotations

import asyncio
import logging
import math
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import grpc
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from coordinator.events import EventBus
from coordinator.jobs.billing import JobBilling
from coordinator.jobs.limits import JobLimits
from coordinator.jobs.memory import training_state_bytes
from coordinator.jobs.repository import (
    CheckpointPartRecord,
    JobRecord,
    JobRepository,
    LossRecord,
    StageRecord,
)
from coordinator.model_store.errors import StoreError, invalid, not_found
from coordinator.model_store.importer import validate_name
from coordinator.model_store.layout import ModelLayout
from coordinator.operators import same_operator
from coordinator.router import Holder, NoRouteError, route
from protos import identity
from protos.quoting import shown
from protos.tessera.v1 import client_api_pb2, common_pb2, jobs_pb2, training_pb2

log = logging.getLogger("tessera.jobs")

# A job can run for days; its driver opens a new session (a fresh token) on --resume.
TRAINING_TOKEN_TTL_S = 7 * 24 * 3600.0
MAX_ACCOUNT_CHARS = 256
MAX_LORA_RANK = 4096
SQLITE_MAX_INTEGER = 2**63 - 1
# A node a driver reported as failed gets no stage of that job for this long, even if the
# registry still sees it (its data plane may be dead while its control stream lives).
FAILED_NODE_COOLDOWN_S = 300.0

STATES = {
    "queued": jobs_pb2.JOB_STATE_QUEUED,
    "running": jobs_pb2.JOB_STATE_RUNNING,
    "paused": jobs_pb2.JOB_STATE_PAUSED,
    "failed": jobs_pb2.JOB_STATE_FAILED,
    "done": jobs_pb2.JOB_STATE_DONE,
}
STATE_NAMES = {value: name for name, value in STATES.items()}
FINISHED = ("failed", "done")


def events_topic(job_id: str) -> str:
    return f"tessera/jobs/{job_id}/events"


@dataclass(frozen=True)
class ModelFacts:
    """What jobs need to know about a stored model."""

    name: str
    layout: ModelLayout


class TrainingPlacement(Protocol):
    """The part of coordinator.placement.Placement that training uses."""

    def boundaries(self, model: str) -> list[int] | None: ...
    def ready_holders(self, model: str) -> list[Holder]: ...
    def free_bytes(self, node_id: str) -> int: ...
    def reserve_training(self, holder: str, node_id: str, nbytes: int) -> None: ...
    def release_training(self, holder: str) -> None: ...
    def node_ids(self) -> list[str]: ...
    async def assign_extra(
        self, node_id: str, model: str, start: int, end: int, reserve: int = 0
    ) -> Any: ...


class JobManager:
    def __init__(
        self,
        repo: JobRepository,
        *,
        signing_key: Ed25519PrivateKey,
        bus: EventBus,
        placement: Callable[[], TrainingPlacement | None],
        model_facts: Callable[[str], ModelFacts | None],
        model_names: Callable[[], list[str]],
        limits: JobLimits | None = None,
        hop_details: Callable[[client_api_pb2.Hop], None] | None = None,
        billing: JobBilling | None = None,
        retention_s: float = 0.0,
    ) -> None:
        self.repo = repo
        self._retention_s = retention_s  # how long an ended job is kept (0: forever)
        self.billing = billing  # None: no ledger installed, every job is free
        # Fills each hop's public_key (and trust facts) so the driver can check the
        # signatures of training replies; the verifier component provides it.
        self._hop_details = hop_details
        self.limits = limits or JobLimits()
        self._key = signing_key
        self._public = identity.public_key_bytes(signing_key)
        self._bus = bus
        self._placement = placement  # looked up per call: wired in after us in tests
        self._model_facts = model_facts
        self._model_names = model_names
        self._last_issued_ms = 0
        # (job, node) -> training bytes this job reserved there, so that re-opening a job
        # does not count its own reservation against itself.
        self._reserved: dict[tuple[str, str], int] = {}
        self._failed: dict[tuple[str, str], float] = {}  # (job, node) -> monotonic time
        self._assigning: dict[tuple[str, int, int], str] = {}  # (job, start, end) -> node
        # job -> stage index -> its verification-only checker in the current session.
        self._checkers: dict[str, dict[int, StageRecord]] = {}
        # Arbitration job id -> (job, arbiter node, start, end): whose checkpoint part the
        # arbiter of a training dispute may download under that id.
        self._loans: dict[str, tuple[str, str, int, int]] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    # ---- submit and read ----------------------------------------------------------------

    def submit(self, request: jobs_pb2.SubmitJobRequest) -> JobRecord:
        facts = self._require_model(request.model)
        dataset = self.repo.dataset(request.dataset_id) if request.dataset_id else None
        if dataset is None:
            raise not_found(
                f"no dataset with id {shown(request.dataset_id)}; upload it first "
                "(Client.upload_dataset, or `tessera train --data FILE`)"
            )
        limits = self.limits
        _check_range("steps", request.steps, 1, limits.max_steps)
        _check_range("batch_size", request.batch_size, 1, limits.max_batch_size)
        _check_range("seq_len", request.seq_len, 1, limits.max_seq_len)
        _check_range("checkpoint_every", request.checkpoint_every, 0, limits.max_steps)
        check_hyper(request.hyper, request.batch_size, limits)
        vocab = facts.layout.vocab_size
        if dataset.max_token_id >= vocab:
            raise invalid(
                f"dataset {dataset.name} holds token id {dataset.max_token_id}, outside model "
                f"{facts.name}'s vocabulary of {vocab}; tokenize it for this model"
            )
        window = request.seq_len + 1
        if dataset.example_len and dataset.example_len != window:
            raise invalid(
                f"dataset {dataset.name} holds examples of {dataset.example_len} tokens, so "
                f"seq_len must be {dataset.example_len - 1} (inputs plus the next token)"
            )
        if dataset.num_tokens < window:
            raise invalid(
                f"dataset {dataset.name} has {dataset.num_tokens} tokens, fewer than one "
                f"sequence of seq_len + 1 = {window}; lower --seq-len or add data"
            )
        if request.output_model:
            validate_name(request.output_model)
            if self._model_facts(request.output_model) is not None:
                raise StoreError(
                    grpc.StatusCode.ALREADY_EXISTS,
                    f"a model named {request.output_model!r} already exists; choose another "
                    "--output-model",
                )
        if len(request.account) > MAX_ACCOUNT_CHARS:
            raise invalid(f"account names are at most {MAX_ACCOUNT_CHARS} characters")
        if len(request.owner_public_key) not in (0, identity.PUBLIC_KEY_BYTES):
            raise invalid(
                f"owner_public_key must be a raw {identity.PUBLIC_KEY_BYTES}-byte Ed25519 key "
                "(or empty: a job anyone may open)"
            )
        now = _now_ms()
        job = JobRecord(
            id="j" + secrets.token_hex(8),
            model=facts.name,
            dataset_id=dataset.id,
            hyper=request.hyper.SerializeToString(deterministic=True),
            steps=request.steps,
            batch_size=request.batch_size,
            seq_len=request.seq_len,
            checkpoint_every=request.checkpoint_every,
            output_model=request.output_model,
            account=request.account,
            state="queued",
            created_ms=now,
            updated_ms=now,
            owner_key=request.owner_public_key,
        )
        self.repo.put_job(job)
        log.info(
            "job %s submitted: %s on dataset %s, %d steps of %d x %d tokens",
            job.id, job.model, dataset.name, job.steps, job.batch_size, job.seq_len,
        )  # fmt: skip
        self._publish(job, "state")
        return job

    def delete_finished(self, before_ms: int) -> list[str]:
        """Delete the jobs that ended before ``before_ms`` (JobRepository), and what this
        manager still keeps of them."""
        removed = self.repo.delete_finished_jobs(before_ms)
        gone = set(removed)
        for job_id in removed:
            self._checkers.pop(job_id, None)
        for table in (self._reserved, self._failed, self._assigning):
            for key in [k for k in table if k[0] in gone]:
                del table[key]
        return removed

    def require_job(self, job_id: str) -> JobRecord:
        job = self.repo.job(job_id) if job_id and len(job_id) <= 64 else None
        if job is None:
            kept = (
                f" (a job is deleted {self._retention_s / 86400:g} days after it ended)"
                if self._retention_s > 0
                else ""
            )
            raise not_found(f"no job with id {shown(job_id)}{kept}; `tessera jobs` lists them")
        return job

    def jobs(self, limit: int) -> list[JobRecord]:
        limit = limit or 100
        return self.repo.jobs(min(limit, self.limits.max_list))

    # ---- the driver's session -----------------------------------------------------------

    def open_session(
        self, job_id: str, request: jobs_pb2.OpenTrainingSessionRequest | None = None
    ) -> jobs_pb2.TrainingSession:
        job = self.require_job(job_id)
        if job.state in FINISHED:
            raise StoreError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"job {job.id} is {job.state}; submit a new job to train again",
            )
        facts = self._require_model(job.model)
        hyper = _hyper(job)
        if job.stages:
            stages = self._keep_or_replace(job, facts, hyper)
        else:
            stages = self._first_layout(job, facts, hyper)
        issued_ms = self._next_issue_ms()
        quote = None
        if self.billing is not None:
            # Escrow before the capability exists: a job the client cannot pay never runs.
            quote = self.billing.open(
                job,
                stages,
                request or jobs_pb2.OpenTrainingSessionRequest(job_id=job.id),
                issued_ms + int(TRAINING_TOKEN_TTL_S * 1000),
            )
        # Every stage rolls back to the last consistent checkpoint (or the model's weights).
        job = job.with_(
            stages=tuple(stages),
            state="running",
            step=job.checkpoint_step,
            error="",
            replan_key="",  # a new session: the last re-plan's report is history
            session_issued_ms=issued_ms,
            updated_ms=_now_ms(),
        )
        self._checkers[job.id] = self._pick_checkers(job, facts, hyper)
        self._reserve(job, facts, hyper)
        self.repo.put_job(job)
        log.info(
            "job %s: training session from step %d on %s",
            job.id, job.step, " -> ".join(f"{s.node_id}[{s.start},{s.end})" for s in stages),
        )  # fmt: skip
        self._publish(job, "state")
        session = self._session(job)
        self._price_checkers(job)
        if quote is not None and self.billing is not None:
            session.quote.CopyFrom(quote)
            session.settled.extend(self.billing.settled(job.id))
        return session

    def report_step(self, request: jobs_pb2.ReportStepRequest) -> JobRecord:
        job = self._driven_job(request.job_id, request.capability)
        if request.step != job.step:
            if request.step == job.step - 1 and self._recorded(job.id, request):
                # A retry of the step just recorded, whose answer was lost (this process
                # restarted in between): the driver must not stop for it.
                return job
            raise StoreError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"step {request.step} reported, but job {job.id} is at step {job.step}; report "
                "each step once, in order",
            )
        if request.step >= job.steps:
            raise invalid(f"job {job.id} has only {job.steps} steps")
        if request.usage and self.billing is not None:
            # Periodic settlement (the driver sends receipts at checkpoints); a refused
            # receipt refuses the report, so the driver learns of it.
            self.billing.settle(job.id, request.usage, close=False)
        numbers = [request.loss, request.grad_norm, request.tokens_per_s, request.wall_s]
        if not all(math.isfinite(x) and x >= 0 for x in [*numbers, *request.stage_ms]):
            raise invalid("loss, grad_norm, tokens_per_s, wall_s and stage_ms must be finite, >= 0")
        if len(request.stage_ms) > len(job.stages):
            raise invalid(
                f"{len(request.stage_ms)} stage timings for a job of {len(job.stages)} stages"
            )
        loss = LossRecord(
            step=request.step,
            loss=request.loss,
            grad_norm=request.grad_norm,
            tokens_per_s=request.tokens_per_s,
            stage_ms=list(request.stage_ms),
        )
        self.repo.put_loss(job.id, loss, _now_ms())
        job = job.with_(
            step=request.step + 1,
            last_loss=request.loss,
            tokens_per_s=request.tokens_per_s,
            updated_ms=_now_ms(),
        )
        self.repo.put_job(job)
        self._publish(
            job,
            "step",
            step=request.step,
            loss=request.loss,
            grad_norm=request.grad_norm,
            tokens_per_s=request.tokens_per_s,
            stage_ms=list(request.stage_ms),
        )
        return job

    def stage_failed(self, request: jobs_pb2.StageFailureRequest) -> jobs_pb2.TrainingSession:
        repeated = self._repeated_replan(request)
        if repeated is not None:
            return repeated
        job = self._driven_job(request.job_id, request.capability)
        if request.stage >= len(job.stages):
            raise invalid(
                f"job {job.id} has {len(job.stages)} stages; there is no stage {request.stage}"
            )
        stage = job.stages[request.stage]
        if request.node_id != stage.node_id:
            raise invalid(
                f"stage {request.stage} of job {job.id} runs on node {stage.node_id}, not "
                f"{shown(request.node_id)}"
            )
        if len(request.cause) > 4096:
            raise invalid("the failure cause is longer than 4096 characters")
        facts = self._require_model(job.model)
        hyper = _hyper(job)
        self._failed[(job.id, stage.node_id)] = time.monotonic()
        restore_step = job.checkpoint_step
        if request.HasField("restore_at_most") and request.restore_at_most < restore_step:
            # The failed node uploaded the newer checkpoints' part: roll back past them.
            restore_step = self._consistent_at_most(job, request.restore_at_most)
        exclude = {s.node_id for s in job.stages} | self._recently_failed(job.id)
        replacement = self._pick_node(job, facts, hyper, stage.start, stage.end, exclude)
        stages = list(job.stages)
        stages[request.stage] = replacement
        if restore_step < job.checkpoint_step:
            # Forget the suspect checkpoints, so that a re-upload of one of their steps
            # is never completed by a suspect part of another stage.
            newer = self.repo.checkpoint_steps_after(job.id, restore_step)
            self.repo.drop_checkpoints_except(
                job.id, self.repo.checkpoint_steps_after(job.id, 0) - newer
            )
        log.warning(
            "job %s: stage %d [%d, %d) failed on node %s (%s); re-planned onto node %s, "
            "resuming from checkpoint step %d",
            job.id, request.stage, stage.start, stage.end, stage.node_id,
            request.cause or "no cause given", replacement.node_id, restore_step,
        )  # fmt: skip
        job = job.with_(
            stages=tuple(stages),
            checkpoint_step=restore_step,
            step=restore_step,
            replans=job.replans + 1,
            replan_key=_replan_key(job.session_issued_ms, request.stage, stage.node_id),
            session_issued_ms=self._next_issue_ms(),
            updated_ms=_now_ms(),
        )
        self._checkers[job.id] = self._pick_checkers(job, facts, hyper)
        self._reserve(job, facts, hyper)
        self._price_checkers(job)
        if self.billing is not None:
            self.billing.replanned(
                job.id, replacement.node_id,
                job.session_issued_ms + int(TRAINING_TOKEN_TTL_S * 1000),
            )  # fmt: skip
        self.repo.put_job(job)
        self._publish(
            job,
            "replan",
            stage=request.stage,
            failed_node_id=stage.node_id,
            node_id=replacement.node_id,
            restore_step=job.checkpoint_step,
            cause=request.cause,
        )
        session = self._session(job)
        session.replaced_stage = request.stage
        return session

    def _repeated_replan(
        self, request: jobs_pb2.StageFailureRequest
    ) -> jobs_pb2.TrainingSession | None:
        """The re-plan's answer again, when ``request`` repeats the failure report the job's
        last re-plan answered (the driver's retry after losing the answer, perhaps to a
        coordinator restart): the capability of the session it replaced, the same stage
        and node. None for any other request."""
        job = self.require_job(request.job_id)
        if job.state != "running" or not job.replan_key:
            return None
        claims = identity.open_capability(self._public, request.capability)
        if claims is None or claims.session_id != job.id:
            return None
        if _replan_key(claims.issued_unix_ms, request.stage, request.node_id) != job.replan_key:
            return None
        session = self._session(job)
        session.replaced_stage = request.stage
        return session

    def _recorded(self, job_id: str, request: jobs_pb2.ReportStepRequest) -> bool:
        return any(
            r.step == request.step and r.loss == request.loss and r.grad_norm == request.grad_norm
            for r in self.repo.losses(job_id)
        )

    def repeated_finish(self, request: jobs_pb2.FinishJobRequest) -> JobRecord | None:
        """The job, when ``request`` repeats the end its current session already recorded (a
        retry whose answer was lost); None for any other request."""
        job = self.require_job(request.job_id)
        if job.state == "running" or job.state != STATE_NAMES.get(request.state):
            return None
        claims = identity.open_capability(self._public, request.capability)
        if claims is None or claims.session_id != job.id:
            return None
        return job if claims.issued_unix_ms == job.session_issued_ms else None

    def finish(self, request: jobs_pb2.FinishJobRequest) -> JobRecord:
        """Validate and record the end state; exporting trained weights is the caller's."""
        job = self._driven_job(request.job_id, request.capability)
        state = STATE_NAMES.get(request.state)
        if state not in ("done", "failed", "paused"):
            raise invalid("FinishJob.state must be DONE, FAILED or PAUSED")
        if len(request.error) > 4096:
            raise invalid("the error message is longer than 4096 characters")
        if state == "done" and job.step != job.steps:
            raise StoreError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"job {job.id} is at step {job.step} of {job.steps}; it is not done yet",
            )
        if self.billing is not None:
            # Done or failed: pay the receipts and refund the rest. Paused: pay, keep the hold.
            self.billing.settle(job.id, request.usage, close=state != "paused")
        return job.with_(state=state, error=request.error)

    def record_finish(self, job: JobRecord) -> JobRecord:
        job = job.with_(updated_ms=_now_ms())
        self._release(job)
        self.repo.put_job(job)
        log.info("job %s is %s at step %d%s", job.id, job.state, job.step,
                 f": {job.error}" if job.error else "")  # fmt: skip
        self._publish(job, "state")
        return job

    # ---- checkpoints --------------------------------------------------------------------

    def check_upload(self, header: training_pb2.CheckpointHeader, node_id: str) -> JobRecord:
        """Refuse an upload before any byte is stored; returns the job."""
        job = self.require_job(header.job_id)
        if job.state != "running":
            raise StoreError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"job {job.id} is {job.state}; only a running job takes checkpoints",
            )
        self._require_stage_holder(job, header.layers, node_id)
        if not 1 <= header.step <= job.step:
            raise invalid(
                f"checkpoint step {header.step} is not one job {job.id} has reached (1..{job.step})"
            )
        return job

    def record_checkpoint_part(self, job_id: str, part: CheckpointPartRecord) -> bool:
        """Store a stage's part; True when every stage of that step is now stored."""
        self.repo.put_checkpoint_part(job_id, part, _now_ms())
        job = self.require_job(job_id)
        have = {(p.start, p.end) for p in self.repo.checkpoint_parts(job_id, part.step)}
        consistent = have >= {(s.start, s.end) for s in job.stages}
        if consistent and part.step > job.checkpoint_step:
            previous = job.checkpoint_step
            job = job.with_(checkpoint_step=part.step, updated_ms=_now_ms())
            self.repo.put_job(job)
            # Keep the new checkpoint and the one before it (in case the new one's blobs
            # turn out unreadable), and anything newer still arriving.
            self.repo.drop_checkpoints_except(
                job_id, {previous, part.step} | self.repo.checkpoint_steps_after(job_id, part.step)
            )
            log.info("job %s: checkpoint at step %d is consistent", job_id, part.step)
            self._publish(job, "checkpoint", step=part.step)
        return consistent

    def check_download(self, request: training_pb2.DownloadCheckpointRequest, node_id: str
                       ) -> CheckpointPartRecord:  # fmt: skip
        loan = self._loans.get(request.job_id)
        if loan is not None:
            return self._lent_part(request, node_id, *loan)
        job = self.require_job(request.job_id)
        checkers = self._checkers.get(job.id, {}).values()
        checking = {(c.start, c.end) for c in checkers if c.node_id == node_id}
        if (request.layers.start, request.layers.end) not in checking:
            # A stage's checker re-opens its shadow from the stage's checkpoint too.
            self._require_stage_holder(job, request.layers, node_id)
        part = self.checkpoint_part(job.id, request.step, request.layers.start, request.layers.end)
        if part is not None:
            return part
        raise not_found(
            f"job {job.id} has no checkpoint of layers [{request.layers.start}, "
            f"{request.layers.end}) at step {request.step} (the last consistent one is step "
            f"{job.checkpoint_step})"
        )

    # ---- arbitration of training disputes ----------------------------------------------

    def lend_checkpoint(
        self, loan_id: str, job_id: str, node_id: str, start: int, end: int
    ) -> None:
        """Let ``node_id`` download the job's part of layers [start, end) as ``loan_id``."""
        self._loans[loan_id] = (job_id, node_id, start, end)

    def end_loan(self, loan_id: str) -> None:
        self._loans.pop(loan_id, None)

    def _lent_part(
        self,
        request: training_pb2.DownloadCheckpointRequest,
        node_id: str,
        job_id: str,
        borrower: str,
        start: int,
        end: int,
    ) -> CheckpointPartRecord:
        if node_id != borrower or (request.layers.start, request.layers.end) != (start, end):
            raise StoreError(
                grpc.StatusCode.PERMISSION_DENIED,
                f"node {node_id} may not download layers [{request.layers.start}, "
                f"{request.layers.end}) of job {request.job_id}",
            )
        part = self.checkpoint_part(job_id, request.step, start, end)
        if part is None:
            raise not_found(f"job {request.job_id} has no checkpoint at step {request.step}")
        return part

    def checkpoint_part(
        self, job_id: str, step: int, start: int, end: int
    ) -> CheckpointPartRecord | None:
        # A caller's uint64 step past SQLite's signed 64-bit INTEGER: no part is stored
        # there, and sqlite3 would raise OverflowError (answered as UNKNOWN) on the query.
        if not 0 <= step <= SQLITE_MAX_INTEGER:
            return None
        for part in self.repo.checkpoint_parts(job_id, step):
            if (part.start, part.end) == (start, end):
                return part
        return None

    def training_facts(
        self, job_id: str, start: int, end: int
    ) -> tuple[JobRecord, training_pb2.TrainingHyper, int]:
        """(job, hyper-parameters, bytes of a stage's training state over [start, end))."""
        job = self.require_job(job_id)
        hyper = _hyper(job)
        return job, hyper, self._state_bytes(job, self._require_model(job.model), hyper, start, end)

    # ---- conversions --------------------------------------------------------------------

    def info(self, job: JobRecord, with_losses: bool = False) -> jobs_pb2.JobInfo:
        info = jobs_pb2.JobInfo(
            job_id=job.id,
            model=job.model,
            dataset_id=job.dataset_id,
            hyper=_hyper(job),
            steps=job.steps,
            batch_size=job.batch_size,
            seq_len=job.seq_len,
            checkpoint_every=job.checkpoint_every,
            output_model=job.output_model,
            account=job.account,
            state=STATES[job.state],
            step=job.step,
            last_loss=job.last_loss,
            tokens_per_s=job.tokens_per_s,
            checkpoint_step=job.checkpoint_step,
            stages=[
                jobs_pb2.StagePlan(
                    layers=_range(s.start, s.end), node_id=s.node_id, address=s.address
                )
                for s in job.stages
            ],  # fmt: skip
            error=job.error,
            created_unix_ms=job.created_ms,
            updated_unix_ms=job.updated_ms,
            replans=job.replans,
        )
        if with_losses:
            info.losses.extend(
                jobs_pb2.LossPoint(step=r.step, loss=r.loss) for r in self.repo.losses(job.id)
            )
        return info

    # ---- internals ----------------------------------------------------------------------

    def _require_model(self, name: str) -> ModelFacts:
        facts = self._model_facts(name) if name and len(name) <= 256 else None
        if facts is None:
            known = ", ".join(sorted(self._model_names())) or "none yet"
            raise not_found(f"unknown model {shown(name)}; known models: {known}")
        return facts

    def _driven_job(self, job_id: str, signed: client_api_pb2.SignedCapability) -> JobRecord:
        job = self.require_job(job_id)
        claims = identity.open_capability(self._public, signed)
        if claims is None:
            raise StoreError(
                grpc.StatusCode.UNAUTHENTICATED,
                "the capability was not signed by this coordinator; open a training session",
            )
        if claims.session_id != job.id:
            raise StoreError(
                grpc.StatusCode.PERMISSION_DENIED,
                f"the capability is for {shown(claims.session_id)}, not job {job.id}",
            )
        if claims.expires_unix_ms < _now_ms():
            raise StoreError(
                grpc.StatusCode.UNAUTHENTICATED,
                "the training session's capability expired; resume the job to open a new one",
            )
        if claims.issued_unix_ms != job.session_issued_ms:
            raise StoreError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"job {job.id} has a newer training session (another driver resumed it, or a "
                "stage was re-planned); this driver must stop",
            )
        if job.state != "running":
            raise StoreError(
                grpc.StatusCode.FAILED_PRECONDITION, f"job {job.id} is {job.state}, not running"
            )
        return job

    def _require_stage_holder(
        self, job: JobRecord, layers: common_pb2.LayerRange, node_id: str
    ) -> StageRecord:
        for stage in job.stages:
            if (stage.start, stage.end) == (layers.start, layers.end):
                if stage.node_id != node_id:
                    raise StoreError(
                        grpc.StatusCode.PERMISSION_DENIED,
                        f"node {node_id} does not hold stage [{stage.start}, {stage.end}) of "
                        f"job {job.id}",
                    )
                return stage
        ranges = ", ".join(f"[{s.start}, {s.end})" for s in job.stages) or "none yet"
        raise invalid(
            f"job {job.id} has no stage over layers [{layers.start}, {layers.end}); its "
            f"stages are {ranges}"
        )

    def _state_bytes(self, job: JobRecord, facts: ModelFacts, hyper: training_pb2.TrainingHyper,
                     start: int, end: int) -> int:  # fmt: skip
        return training_state_bytes(
            facts.layout, start, end, hyper.mode, hyper.lora_rank, job.batch_size * job.seq_len
        )

    def _first_layout(
        self, job: JobRecord, facts: ModelFacts, hyper: training_pb2.TrainingHyper
    ) -> list[StageRecord]:
        placement = self._placement()
        boundaries = placement.boundaries(job.model) if placement else None
        holders = placement.ready_holders(job.model) if placement else []
        if not boundaries or not holders:
            raise StoreError(
                grpc.StatusCode.UNAVAILABLE,
                f"model {job.model!r} is not served yet: no node has finished loading it "
                "(try again shortly)",
            )
        # The planner's stage cuts first, one node per stage: the router may merge stages
        # that one node holds, which would make the job's pipeline shallower by chance.
        cuts = list(zip(boundaries, boundaries[1:], strict=False))
        try:
            return self._pick_all(job, facts, hyper, cuts, assign=False)
        except StoreError:
            pass
        try:
            spans = [(stage.start, stage.end) for stage in route(boundaries, holders)]
        except NoRouteError as err:
            raise StoreError(
                grpc.StatusCode.UNAVAILABLE, f"model {job.model!r} is unavailable: {err}"
            ) from None
        return self._pick_all(job, facts, hyper, spans, assign=True)

    def _pick_all(
        self,
        job: JobRecord,
        facts: ModelFacts,
        hyper: training_pb2.TrainingHyper,
        spans: list[tuple[int, int]],
        assign: bool,
    ) -> list[StageRecord]:
        chosen: list[StageRecord] = []
        for start, end in spans:
            taken = {s.node_id for s in chosen}
            chosen.append(self._pick_node(job, facts, hyper, start, end, taken, assign=assign))
        return chosen

    def _keep_or_replace(
        self, job: JobRecord, facts: ModelFacts, hyper: training_pb2.TrainingHyper
    ) -> list[StageRecord]:
        """The job's layout again, on its old nodes where they still hold their ranges."""
        placement = self._placement()
        ready = {h.node_id: h for h in (placement.ready_holders(job.model) if placement else [])}
        self._release(job)
        stages: list[StageRecord] = []
        failed = self._recently_failed(job.id)
        for stage in job.stages:
            holder = ready.get(stage.node_id)
            taken = {s.node_id for s in stages} | failed
            fits = placement is not None and placement.free_bytes(stage.node_id) >= (
                self._state_bytes(job, facts, hyper, stage.start, stage.end)
            )
            if (
                holder
                and stage.node_id not in failed
                and holder.start <= stage.start
                and stage.end <= holder.end
                and fits
            ):
                stages.append(StageRecord(stage.start, stage.end, holder.node_id, holder.address))
            else:
                stages.append(self._pick_node(job, facts, hyper, stage.start, stage.end, taken))
        return stages

    def _pick_node(
        self,
        job: JobRecord,
        facts: ModelFacts,
        hyper: training_pb2.TrainingHyper,
        start: int,
        end: int,
        exclude: set[str],
        assign: bool = True,
    ) -> StageRecord:
        """The cheapest ready holder of [start, end) with memory for the training state;
        with `assign`, placement has a spare node load the layers when there is none."""
        placement = self._placement()
        need = self._state_bytes(job, facts, hyper, start, end)
        candidates = [
            h
            for h in (placement.ready_holders(job.model) if placement else [])
            if h.start <= start and end <= h.end and h.node_id not in exclude
        ]
        candidates.sort(key=lambda h: (h.cost(h.end - h.start), h.node_id))
        short: list[str] = []
        for holder in candidates:
            free = placement.free_bytes(holder.node_id) + self._own_reservation(job, holder.node_id)
            if free >= need:
                return StageRecord(start, end, holder.node_id, holder.address)
            short.append(f"{holder.node_id} has {free}")
        if not candidates:
            loading = self._assign_replacement(job, start, end, need, exclude) if assign else ""
            raise StoreError(
                grpc.StatusCode.UNAVAILABLE,
                f"node {loading} is loading layers [{start}, {end}) of {job.model} to take "
                "over the stage; retry shortly"
                if loading
                else f"no other node has layers [{start}, {end}) of {job.model} loaded and "
                "ready, and none has the memory to load them; resume the job when more nodes "
                "have joined",
            )
        raise StoreError(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"no node holding layers [{start}, {end}) has the {need} bytes the training state "
            f"needs ({'; '.join(short)}); use --mode lora, a smaller --batch-size or --seq-len, "
            "or nodes with more memory",
        )

    def _assign_replacement(
        self, job: JobRecord, start: int, end: int, need: int, exclude: set[str]
    ) -> str:
        """Ask placement to load [start, end) on the roomiest node outside the job; returns
        that node's id ("" if none). The driver retries until the shard is READY."""
        placement = self._placement()
        key = (job.id, start, end)
        pending = self._assigning.get(key)
        if pending and pending not in exclude and placement and pending in placement.node_ids():
            return pending
        if placement is None:
            return ""
        spare = sorted(
            (n for n in placement.node_ids() if n not in exclude),
            key=lambda n: -placement.free_bytes(n),
        )
        if not spare:
            return ""
        node_id = spare[0]
        self._assigning[key] = node_id

        async def assign() -> None:
            shard = await placement.assign_extra(node_id, job.model, start, end, reserve=need)
            if shard is None:
                self._assigning.pop(key, None)
                log.warning(
                    "job %s: node %s cannot load layers [%d, %d)", job.id, node_id, start, end
                )
            else:
                log.info(
                    "job %s: node %s loads layers [%d, %d) to take over a stage",
                    job.id,
                    node_id,
                    start,
                    end,
                )

        task = asyncio.get_running_loop().create_task(assign())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return node_id

    def _recently_failed(self, job_id: str) -> set[str]:
        horizon = time.monotonic() - FAILED_NODE_COOLDOWN_S
        for key in [k for k, t in self._failed.items() if t < horizon]:
            del self._failed[key]
        return {node for job, node in self._failed if job == job_id}

    def _own_reservation(self, job: JobRecord, node_id: str) -> int:
        """What this job already holds on the node (re-opening must not count it twice)."""
        return self._reserved.get((job.id, node_id), 0)

    def _reserve(
        self, job: JobRecord, facts: ModelFacts, hyper: training_pb2.TrainingHyper
    ) -> None:
        placement = self._placement()
        self._release(job)
        if placement is None:
            return
        for index, stage in enumerate(job.stages):
            nbytes = self._state_bytes(job, facts, hyper, stage.start, stage.end)
            placement.reserve_training(f"{job.id}/{index}", stage.node_id, nbytes)
            self._reserved[(job.id, stage.node_id)] = nbytes
        # A checker's shadow is a full training state of its stage too.
        for index, checker in self._checkers.get(job.id, {}).items():
            nbytes = self._state_bytes(job, facts, hyper, checker.start, checker.end)
            placement.reserve_training(f"{job.id}/check{index}", checker.node_id, nbytes)
            self._reserved[(job.id, checker.node_id)] = nbytes

    def _release(self, job: JobRecord) -> None:
        placement = self._placement()
        if placement is None:
            return
        for index in range(len(job.stages)):
            placement.release_training(f"{job.id}/{index}")
            placement.release_training(f"{job.id}/check{index}")
        for key in [k for k in self._reserved if k[0] == job.id]:
            del self._reserved[key]

    def restore_reservations(self) -> None:
        """After a restart: running jobs still hold their nodes' memory."""
        for job in self.repo.jobs_in_states(("running",)):
            facts = self._model_facts(job.model)
            if facts is not None:
                self._reserve(job, facts, _hyper(job))

    def _consistent_at_most(self, job: JobRecord, step: int) -> int:
        """The newest step <= ``step`` whose checkpoint holds every stage (0: none)."""
        spans = {(s.start, s.end) for s in job.stages}
        for candidate in sorted(self.repo.checkpoint_steps_after(job.id, 0), reverse=True):
            if candidate > step:
                continue
            have = {(p.start, p.end) for p in self.repo.checkpoint_parts(job.id, candidate)}
            if have >= spans:
                return candidate
        return 0

    def _pick_checkers(
        self, job: JobRecord, facts: ModelFacts, hyper: training_pb2.TrainingHyper
    ) -> dict[int, StageRecord]:
        """Per stage, where the swarm has one, a ready holder of its layers outside the
        pipeline, of another operator account than the stage's node, with memory for the
        stage's training state (the job planner's estimate): the driver trains a shadow of
        the stage on it in sampled intervals. One stage per checker node. None without a
        verifier component (no keys, no accounts, nobody to report to)."""
        placement = self._placement()
        if self._hop_details is None or placement is None:
            return {}
        holders = placement.ready_holders(job.model)
        taken = {s.node_id for s in job.stages} | self._recently_failed(job.id)
        if self.billing is not None:  # a shadow's samples there would be billed as work
            taken |= self.billing.billed_whole(job.id)
        chosen: dict[int, StageRecord] = {}
        for index, stage in enumerate(job.stages):
            account = self._hop(stage).account
            need = self._state_bytes(job, facts, hyper, stage.start, stage.end)
            candidates = sorted(
                (h for h in holders if h.start <= stage.start and stage.end <= h.end),
                key=lambda h: (h.cost(stage.end - stage.start), h.node_id),
            )
            for holder in candidates:
                if holder.node_id in taken:
                    continue
                free = placement.free_bytes(holder.node_id)
                free += self._own_reservation(job, holder.node_id)
                if free < need or same_operator(account, self._hop(holder).account):
                    continue
                chosen[index] = StageRecord(stage.start, stage.end, holder.node_id, holder.address)
                taken.add(holder.node_id)
                break
        return chosen

    def _price_checkers(self, job: JobRecord) -> None:
        """A checker's receipts bill nothing (checks are not the client's calls), but the
        ledger settles only receipts of nodes it holds a price for."""
        if self.billing is None:
            return
        expires_ms = job.session_issued_ms + int(TRAINING_TOKEN_TTL_S * 1000)
        for checker in self._checkers.get(job.id, {}).values():
            self.billing.replanned(job.id, checker.node_id, expires_ms)

    def _hop(self, stage: StageRecord | Holder) -> client_api_pb2.Hop:
        hop = client_api_pb2.Hop(
            node_id=stage.node_id, address=stage.address, layers=_range(stage.start, stage.end)
        )
        if self._hop_details is not None:
            self._hop_details(hop)
        return hop

    def _session(self, job: JobRecord) -> jobs_pb2.TrainingSession:
        hops = [self._hop(s) for s in job.stages]
        checkers = [self._hop(c) for _, c in sorted(self._checkers.get(job.id, {}).items())]
        claims = client_api_pb2.CapabilityClaims(
            session_id=job.id,
            model=job.model,
            grants=[*hops, *checkers],
            issued_unix_ms=job.session_issued_ms,
            expires_unix_ms=job.session_issued_ms + int(TRAINING_TOKEN_TTL_S * 1000),
            max_tokens=min(job.batch_size * job.seq_len, 2**32 - 1),
            account=job.account,
        )
        if self.billing is not None:
            # A paid job: each node runs at most the credit past what the runner
            # acknowledged, and settles those receipts itself (docs/ledger.md, "Jobs").
            claims.client_public_key, claims.usage_credit = self.billing.credit(job.id)
        parts = (
            self.repo.checkpoint_parts(job.id, job.checkpoint_step) if job.checkpoint_step else []
        )
        return jobs_pb2.TrainingSession(
            job_id=job.id,
            model=job.model,
            hops=hops,
            checkers=checkers,
            capability=identity.sign_capability(self._key, claims),
            restore_step=job.checkpoint_step,
            restore=[
                jobs_pb2.CheckpointPart(
                    layers=_range(p.start, p.end), sha256=p.sha256, total_bytes=p.total_bytes
                )
                for p in parts
            ],
            job=self.info(job),
        )

    def _next_issue_ms(self) -> int:
        # Strictly increasing: the issue time is how a session is told from its successor.
        self._last_issued_ms = max(_now_ms(), self._last_issued_ms + 1)
        return self._last_issued_ms

    def _publish(self, job: JobRecord, kind: str, **fields: Any) -> None:
        payload = {"kind": kind, "job_id": job.id, "state": job.state, "step": job.step,
                   "steps": job.steps, **fields}  # fmt: skip
        try:
            self._bus.publish_nowait(events_topic(job.id), payload)
        except Exception:  # progress events must never break the job itself
            log.exception("publishing %s event of job %s failed", kind, job.id)


def check_hyper(hyper: training_pb2.TrainingHyper, batch_size: int, limits: JobLimits) -> None:
    if hyper.mode not in ("full", "lora"):
        raise invalid(f"mode must be 'full' or 'lora', got {shown(hyper.mode)}")
    if hyper.mode == "lora":
        _check_range("lora_rank", hyper.lora_rank, 1, MAX_LORA_RANK)
        if not (math.isfinite(hyper.lora_alpha) and hyper.lora_alpha > 0):
            raise invalid(f"lora_alpha must be a positive number, got {hyper.lora_alpha}")
    if not (math.isfinite(hyper.lr) and 0 < hyper.lr <= 10):
        raise invalid(f"the learning rate must be in (0, 10], got {hyper.lr}")
    for label, value in (("beta1", hyper.beta1), ("beta2", hyper.beta2)):
        if not (math.isfinite(value) and 0 <= value < 1):
            raise invalid(f"{label} must be in [0, 1), got {value}")
    if not (math.isfinite(hyper.eps) and hyper.eps > 0):
        raise invalid(f"eps must be a positive number, got {hyper.eps}")
    for label, value in (("weight_decay", hyper.weight_decay),
                         ("max_grad_norm", hyper.max_grad_norm)):  # fmt: skip
        if not (math.isfinite(value) and value >= 0):
            raise invalid(f"{label} must be a number >= 0, got {value}")
    _check_range("micro_batches", hyper.micro_batches, 1, limits.max_micro_batches)
    if batch_size % hyper.micro_batches:
        raise invalid(
            f"batch_size {batch_size} does not split into {hyper.micro_batches} equal "
            "micro-batches; pick a divisor"
        )


def _check_range(label: str, value: int, low: int, high: int) -> None:
    if not low <= value <= high:
        raise invalid(f"{label} must be between {low} and {high}, got {value}")


def _hyper(job: JobRecord) -> training_pb2.TrainingHyper:
    return training_pb2.TrainingHyper.FromString(job.hyper)


def _range(start: int, end: int) -> common_pb2.LayerRange:
    return common_pb2.LayerRange(start=start, end=end)


def _now_ms() -> int:
    return int(time.time() * 1000)


def _replan_key(issued_ms: int, stage: int, node_id: str) -> str:
    """What identifies one stage failure report: the session it came in, the stage, the node."""
    return f"{issued_ms}/{stage}/{node_id}"
