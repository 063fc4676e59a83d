"""The node's training data plane: the ``TrainingStage`` gRPC service.

A driver trains one pipeline stage of a job here: ``OpenTraining`` builds a
``StageTrainer`` on an fp32 copy of the READY shard's weights (the served shard is never
touched), ``ForwardTrain`` / ``BackwardTrain`` run micro-batches, ``GradNorm`` reports this
stage's share of the global norm, ``OptimizerStep`` applies AdamW once per version and
``SaveCheckpoint`` streams the state to the coordinator's ``TrainingStore``.

Only data arrives (hyper-parameters, token ids, labels, gradients, numbers), never code.
Every call is validated before it touches the model, as the inference ``Stage`` service
does: the coordinator-signed capability (its session_id must be the job id, its grants must
give this node the stage's layers), then the tensors (dtype, shape, hidden size, vocabulary,
sizes), then the job's state machine (version, which micro-batches are pending or done).
A refusal answers one call with a status and a message a person can act on; the job's state
is unchanged by it.

Keep vs recompute: a micro-batch's activations are kept for its backward while they fit
the node's usable memory; one that would not fit keeps only its input and is recomputed
at backward (see docs/training.md). Model work runs on the shard manager's compute thread,
so the event loop stays free for other calls and inference sessions.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import math
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TypeVar

import grpc
import numpy as np
import torch

from node_agent import failpoints
from node_agent.acknowledgments import check_credit, take_acknowledgments
from node_agent.checkpoint_client import CheckpointClient, CheckpointRef, CheckpointTransferError
from node_agent.context import AgentContext
from node_agent.receipts import UsageMeter, save_usage
from node_agent.runtime import StageModel, tensor_names_for_stage
from node_agent.runtime.training import (
    NonFiniteGradientError,
    StageTrainer,
    TooManyMicroBatchesError,
    TrainingInputError,
    TrainingMemory,
    state_from_bytes,
    state_to_bytes,
    training_memory,
)
from node_agent.shard_manager import LoadedShard, ShardManager
from node_agent.stage_errors import StageError
from node_agent.stage_server import check_expiry, check_grant, open_capability
from node_agent.usage_settlement import UsageSettler, settle_every_s
from protos import codec, identity, output_check
from protos.tessera.v1 import (
    client_api_pb2,
    common_pb2,
    stage_pb2,
    training_pb2,
    training_pb2_grpc,
)

log = logging.getLogger(__name__)

T = TypeVar("T")
# Where the usage counts of training jobs are kept, in the data dir (receipts.py).
USAGE_FILE = "usage/training.json"
_JOB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")
_SHA256_HEX = re.compile(r"^[0-9a-f]{64}$")
FP32_BYTES = 4


@dataclass(frozen=True)
class TrainingLimits:
    max_batch: int = 64  # sequences per micro-batch
    max_tokens_per_micro_batch: int = 16384
    max_micro_batches: int = 64  # per optimizer step; also the pending cap
    max_lora_rank: int = 256
    # A job no call touched for this long is dropped: its driver is gone, and a resumed
    # driver re-opens every stage from a checkpoint anyway.
    idle_ttl_s: float = 1800.0
    # The idle sweep, which also writes the usage counts to disk: what a kill -9 can lose.
    expiry_interval_s: float = 5.0
    # How often acknowledged receipts go to the coordinator (node_agent.usage_settlement).
    settle_every_s: float = field(default_factory=settle_every_s)


@dataclass
class _Job:
    job_id: str
    model: str
    start: int
    end: int
    micro_batches: int
    trainer: StageTrainer
    memory: TrainingMemory
    config_hidden: int
    vocab: int
    max_positions: int
    is_first: bool
    is_last: bool
    # Bytes each pending micro-batch holds; recomputed ones also reserve their transient
    # activations for the backward that re-runs them.
    held: dict[int, int] = field(default_factory=dict)
    recompute_reserve: dict[int, int] = field(default_factory=dict)
    done: set[int] = field(default_factory=set)  # backpropagated in this step
    poisoned: str = ""  # why this step's gradients may not be applied
    abandoned: str = ""  # why GradNorm abandoned the last attempt of this step
    nonfinite_refusals: int = 0
    last_used: float = field(default_factory=time.monotonic)

    @property
    def fixed_bytes(self) -> int:
        m = self.memory
        return m.weight_bytes + m.grad_bytes + m.optimizer_bytes

    def bytes_held(self) -> int:
        reserve = max(self.recompute_reserve.values(), default=0)
        return self.fixed_bytes + sum(self.held.values()) + reserve

    def describe(self) -> str:
        return f"job {self.job_id!r} layers [{self.start}, {self.end})"

    def forget_step(self) -> None:
        self.held.clear()
        self.recompute_reserve.clear()
        self.done.clear()
        self.poisoned = ""


class TrainingStageServicer(training_pb2_grpc.TrainingStageServicer):
    def __init__(
        self,
        ctx: AgentContext,
        shards: ShardManager,
        limits: TrainingLimits | None = None,
        clock: Callable[[], float] | None = None,
        store: CheckpointClient | None = None,
    ) -> None:
        self._ctx = ctx
        self._shards = shards
        self.limits = limits or TrainingLimits()
        # Capabilities expire by the coordinator's clock (AgentContext.coordinator_time).
        self._clock = clock or ctx.coordinator_time
        self._store = store or CheckpointClient(ctx)
        self._jobs: dict[str, _Job] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._expiry_task: asyncio.Task[None] | None = None
        # None unless TESSERA_FAILPOINTS is set: tampers with ForwardTrain hidden states,
        # BackwardTrain gradients or OptimizerStep (docs/failpoints.md).
        self._failpoints = failpoints.from_env()
        # Samples computed per (job, layers), signed on every forward reply: what the job's
        # client pays for per sample-layer (docs/ledger.md, "Jobs"). Kept after a job
        # closes, so a resumed job's receipts stay cumulative.
        self._usage = UsageMeter(ctx.private_key, path=ctx.data_dir / USAGE_FILE, whole_counts=True)
        # A paid job's runner acknowledges those receipts as it goes (Acknowledge); the node
        # settles them itself, so it is paid even if the runner never reports again.
        self._settler = UsageSettler(
            ctx.coordinator_address, ctx.channel_options, self.limits.settle_every_s
        )

    # ---- RPCs -----------------------------------------------------------------------

    async def OpenTraining(  # noqa: N802 - gRPC method name
        self, request: training_pb2.OpenTrainingRequest, context: grpc.aio.ServicerContext
    ) -> training_pb2.OpenTrainingResponse:
        return await self._answer(context, "OpenTraining", lambda: self._open(request))

    async def ForwardTrain(  # noqa: N802 - gRPC method name
        self, request: training_pb2.TrainForwardRequest, context: grpc.aio.ServicerContext
    ) -> training_pb2.TrainForwardResponse:
        return await self._answer(context, "ForwardTrain", lambda: self._forward(request))

    async def BackwardTrain(  # noqa: N802 - gRPC method name
        self, request: training_pb2.TrainBackwardRequest, context: grpc.aio.ServicerContext
    ) -> training_pb2.TrainBackwardResponse:
        return await self._answer(context, "BackwardTrain", lambda: self._backward(request))

    async def GradNorm(  # noqa: N802 - gRPC method name
        self, request: training_pb2.GradNormRequest, context: grpc.aio.ServicerContext
    ) -> training_pb2.GradNormResponse:
        return await self._answer(context, "GradNorm", lambda: self._grad_norm(request))

    async def OptimizerStep(  # noqa: N802 - gRPC method name
        self, request: training_pb2.OptimizerStepRequest, context: grpc.aio.ServicerContext
    ) -> training_pb2.OptimizerStepResponse:
        return await self._answer(context, "OptimizerStep", lambda: self._optimizer_step(request))

    async def SaveCheckpoint(  # noqa: N802 - gRPC method name
        self, request: training_pb2.SaveCheckpointRequest, context: grpc.aio.ServicerContext
    ) -> training_pb2.SaveCheckpointResponse:
        return await self._answer(context, "SaveCheckpoint", lambda: self._save(request))

    async def CloseTraining(  # noqa: N802 - gRPC method name
        self, request: training_pb2.CloseTrainingRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.Empty:
        return await self._answer(context, "CloseTraining", lambda: self._close(request))

    async def Acknowledge(  # noqa: N802 - gRPC method name
        self, request: stage_pb2.AcknowledgeRequest, context: grpc.aio.ServicerContext
    ) -> stage_pb2.AcknowledgeResponse:
        return await self._answer(context, "Acknowledge", lambda: self._acknowledge(request))

    async def _answer(
        self, context: grpc.aio.ServicerContext, name: str, work: Callable[[], Awaitable[T]]
    ) -> T:
        self._start_expiry()
        try:
            return await work()
        except StageError as err:
            log.info("%s refused (%s): %s", name, err.code.name, err.message)
            await context.abort(err.code, err.message)
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except Exception as err:  # a bug here must fail one call, not the node
            log.exception("%s failed unexpectedly", name)
            await context.abort(
                grpc.StatusCode.INTERNAL, f"the node hit an internal error: {type(err).__name__}"
            )
        raise AssertionError("context.abort() returned")  # pragma: no cover

    # ---- OpenTraining ---------------------------------------------------------------

    async def _open(
        self, request: training_pb2.OpenTrainingRequest
    ) -> training_pb2.OpenTrainingResponse:
        claims = self._claims(request.capability, request.job_id, request.HasField("capability"))
        start, end = request.layers.start, request.layers.end
        check_grant(claims, self._ctx.node_id, request.model, start, end)
        if not self._ctx.accepting_work:
            raise StageError(
                grpc.StatusCode.UNAVAILABLE,
                "this node is draining: it finishes open jobs but opens no new training; ask "
                "the coordinator to re-plan the stage",
            )
        hyper = request.hyper
        self._check_hyper(hyper)
        self._check_restore(request)
        shard = self._shards.find(request.model, start, end)
        if shard is None:
            raise StageError(
                grpc.StatusCode.NOT_FOUND,
                f"no READY shard of {request.model!r} covers layers [{start}, {end}) on this "
                f"node (it holds {self._shards.describe(request.model)}); ask the coordinator "
                "to assign the shard first",
            )
        try:
            memory = training_memory(
                shard.config, start, end, hyper.mode, hyper.lora_rank, FP32_BYTES
            )
        except ValueError as err:
            raise StageError(grpc.StatusCode.INVALID_ARGUMENT, str(err)) from err
        async with self._lock_for(request.job_id):
            # Re-opening replaces the job's state: that is how a stage rolls back.
            await self._drop_job(request.job_id)
            self._check_memory_for(memory, request)
            job = await self._build_job(request, shard, memory)
            if request.restore_step:
                await self._restore(job, request)
            self._jobs[request.job_id] = job
        log.info(
            "training %s of %s opened at step %d (%s, %d trainable parameters, %.1f MiB)",
            job.describe(),
            job.model,
            job.trainer.version,
            hyper.mode,
            memory.trainable_params,
            job.fixed_bytes / 2**20,
        )
        return training_pb2.OpenTrainingResponse(
            step=job.trainer.version,
            trainable_params=memory.trainable_params,
            state_bytes=job.fixed_bytes,
        )

    def _check_hyper(self, hyper: training_pb2.TrainingHyper) -> None:
        problems: list[str] = []
        if hyper.mode not in ("full", "lora"):
            problems.append(f"mode must be 'full' or 'lora', got {hyper.mode!r}")
        if hyper.mode == "lora" and not 1 <= hyper.lora_rank <= self.limits.max_lora_rank:
            problems.append(
                f"lora_rank must be in [1, {self.limits.max_lora_rank}], got {hyper.lora_rank}"
            )
        if hyper.mode == "lora" and not (math.isfinite(hyper.lora_alpha) and hyper.lora_alpha > 0):
            problems.append(f"lora_alpha must be a positive number, got {hyper.lora_alpha}")
        for name in ("lr", "eps"):
            value = getattr(hyper, name)
            if not (math.isfinite(value) and value > 0):
                problems.append(f"{name} must be a positive number, got {value}")
        for name in ("beta1", "beta2"):
            value = getattr(hyper, name)
            if not 0 <= value < 1:
                problems.append(f"{name} must be in [0, 1), got {value}")
        for name in ("weight_decay", "max_grad_norm"):
            value = getattr(hyper, name)
            if not (math.isfinite(value) and value >= 0):
                problems.append(f"{name} must be a number >= 0, got {value}")
        if not 1 <= hyper.micro_batches <= self.limits.max_micro_batches:
            problems.append(
                f"micro_batches must be in [1, {self.limits.max_micro_batches}], got "
                f"{hyper.micro_batches}"
            )
        if problems:
            raise StageError(
                grpc.StatusCode.INVALID_ARGUMENT, "bad hyper-parameters: " + "; ".join(problems)
            )

    @staticmethod
    def _check_restore(request: training_pb2.OpenTrainingRequest) -> None:
        if request.restore_step == 0:
            if request.restore_sha256:
                raise StageError(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    "restore_sha256 is set but restore_step is 0 (a fresh start); name the "
                    "checkpoint's step too",
                )
            return
        if not _SHA256_HEX.match(request.restore_sha256):
            raise StageError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"restoring step {request.restore_step} needs restore_sha256, the 64-hex "
                "sha256 the coordinator recorded for this stage's checkpoint; got "
                f"{request.restore_sha256[:80]!r}",
            )

    def _check_memory_for(
        self, memory: TrainingMemory, request: training_pb2.OpenTrainingRequest
    ) -> None:
        need = memory.weight_bytes + memory.grad_bytes + memory.optimizer_bytes
        free = self._free_bytes()
        if need > free:
            usable = self._ctx.hardware.memory_usable_bytes
            raise StageError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"the {request.hyper.mode} training state of layers [{request.layers.start}, "
                f"{request.layers.end}) needs {_mib(need)} (fp32 weights, gradients and AdamW "
                f"moments) but only {_mib(free)} of this node's {_mib(usable)} usable memory "
                "are free; train with mode='lora' or a smaller lora_rank, or ask the "
                "coordinator for a stage with fewer layers or another node",
            )

    def _free_bytes(self) -> int:
        used = self._shards.memory_bytes() + sum(j.bytes_held() for j in self._jobs.values())
        return self._ctx.hardware.memory_usable_bytes - used

    async def _build_job(
        self,
        request: training_pb2.OpenTrainingRequest,
        shard: LoadedShard,
        memory: TrainingMemory,
    ) -> _Job:
        hyper = request.hyper
        start, end = request.layers.start, request.layers.end

        def build() -> StageTrainer:
            stage = _fp32_copy(shard, start, end)
            return StageTrainer(
                stage,
                hyper.mode,  # type: ignore[arg-type]
                lora_rank=hyper.lora_rank or 8,
                lora_alpha=hyper.lora_alpha or 16.0,
                lr=hyper.lr,
                betas=(hyper.beta1, hyper.beta2),
                weight_decay=hyper.weight_decay,
                eps=hyper.eps,
                seed=hyper.seed,
                num_micro_batches=hyper.micro_batches,
                max_pending=self.limits.max_micro_batches,
            )

        try:
            trainer = await self._shards.run(build)
        except (TrainingInputError, ValueError) as err:
            raise StageError(grpc.StatusCode.INVALID_ARGUMENT, str(err)) from err
        config = shard.config
        return _Job(
            job_id=request.job_id,
            model=request.model,
            start=start,
            end=end,
            micro_batches=hyper.micro_batches,
            trainer=trainer,  # type: ignore[arg-type]
            memory=memory,
            config_hidden=config.hidden_size,
            vocab=config.vocab_size,
            max_positions=config.max_position_embeddings,
            is_first=start == 0,
            is_last=end == shard.num_layers,
        )

    async def _restore(self, job: _Job, request: training_pb2.OpenTrainingRequest) -> None:
        ref = CheckpointRef(job.job_id, request.restore_step, job.start, job.end)
        tensors = len(job.trainer.trainable_parameters()) * 4  # param + 3 AdamW fields
        # The state holds the parameters and both moments, plus a JSON header.
        max_bytes = 3 * job.memory.trainable_params * FP32_BYTES + tensors * 512 + (1 << 20)
        try:
            data = await self._store.download(ref, request.restore_sha256, max_bytes)
        except CheckpointTransferError as err:
            await self._shards.run(job.trainer.close)
            raise StageError(err.code, err.message) from err

        def load() -> None:
            tensors_in, metadata = state_from_bytes(data)
            job.trainer.load_state_dict(tensors_in, metadata)

        try:
            await self._shards.run(load)
        except TrainingInputError as err:
            await self._shards.run(job.trainer.close)
            raise StageError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"the checkpoint of {ref.describe()} cannot be restored here: {err}",
            ) from err
        if job.trainer.version != request.restore_step:
            await self._shards.run(job.trainer.close)
            raise StageError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"the checkpoint stored for step {request.restore_step} holds version "
                f"{job.trainer.version}; the coordinator's record is inconsistent",
            )

    # ---- ForwardTrain / BackwardTrain -------------------------------------------------

    async def _forward(
        self, request: training_pb2.TrainForwardRequest
    ) -> training_pb2.TrainForwardResponse:
        claims, job = self._job_for(request.capability, request.job_id, request)
        mb = self._check_micro_batch_id(job, request.micro_batch)
        x = self._decode_input(job, request, claims)
        labels = self._decode_labels(job, request, x)
        tokens = int(x.shape[0] * x.shape[1])
        async with self._lock_for(job.job_id):
            job = self._current(job, request.step)
            if mb in job.held or mb in job.done:
                state = "awaits backward" if mb in job.held else "was already backpropagated"
                raise StageError(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"micro-batch {mb} of step {request.step} {state} on {job.describe()}; "
                    "each micro-batch runs forward once per step",
                )
            # A paid job's runner must keep acknowledging this node's sample receipts.
            check_credit(self._usage, claims, job.job_id, job.start, job.end, training=True)
            recompute, held, reserve = self._activation_plan(job, tokens)
            trainer = job.trainer

            def run() -> tuple[torch.Tensor, float]:
                began = time.perf_counter()
                trainer.recompute = recompute
                out = trainer.forward(mb, x, labels)
                return out, (time.perf_counter() - began) * 1000.0

            out, compute_ms = await self._compute(job, run)
            job.abandoned = ""
            job.held[mb] = held
            if recompute:
                job.recompute_reserve[mb] = reserve
        response = training_pb2.TrainForwardResponse(
            step=request.step, micro_batch=mb, compute_ms=compute_ms
        )
        if job.is_last:
            response.loss = float(out)
            if self._failpoints is not None:  # tests and demos only: lie, then sign
                response.loss = self._failpoints.tamper_loss(response.loss)
            response.label_tokens = int((labels != -100).sum()) if labels is not None else 0
            payload = identity.training_loss_bytes(response.loss, response.label_tokens)
        else:
            output = codec.encode(out.cpu().numpy(), "float32")
            if self._failpoints is not None:  # tests and demos only: tamper, then sign
                output = await self._failpoints.apply(output, request.input)
            response.output.CopyFrom(output)
            payload = response.output.data
        labels_sent = request.labels if request.HasField("labels") else None
        self._sign(response, "forward", job, mb, payload, request.input, labels_sent)
        samples = int(x.shape[0])
        response.usage.CopyFrom(
            self._usage.record(
                job.job_id, job.start, job.end, request.step, samples, claims.client_public_key
            )
        )
        return response

    def _activation_plan(self, job: _Job, tokens: int) -> tuple[bool, int, int]:
        """(recompute?, bytes held while pending, transient bytes of its backward).

        The node cannot know how many micro-batches the driver keeps in flight, so it
        plans for all of the step's (GPipe's worst case): keep activations if that many
        fit, else keep only inputs and recompute one micro-batch at a time in backward.
        """
        keep = tokens * job.memory.activation_bytes_per_token
        inputs = tokens * job.memory.input_bytes_per_token
        # What this job's activations may use: free memory plus what they hold already.
        room = self._free_bytes() + job.bytes_held() - job.fixed_bytes
        count = job.micro_batches
        if count * keep <= room:
            return False, keep, 0
        if count * inputs + keep <= room:
            return True, inputs, keep
        raise StageError(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"{count} micro-batches of {tokens} tokens need {_mib(count * keep)} of "
            f"activations ({_mib(count * inputs + keep)} even when recomputed) on "
            f"{job.describe()}, but only {_mib(max(0, room))} are free; use smaller "
            "micro-batches or a shorter seq_len",
        )

    async def _backward(
        self, request: training_pb2.TrainBackwardRequest
    ) -> training_pb2.TrainBackwardResponse:
        _, job = self._job_for(request.capability, request.job_id, request)
        mb = self._check_micro_batch_id(job, request.micro_batch)
        grad = self._decode_grad(job, request)
        async with self._lock_for(job.job_id):
            job = self._current(job, request.step)
            if mb not in job.held:
                why = (
                    "it was already backpropagated"
                    if mb in job.done
                    else "no forward of it is pending"
                )
                raise StageError(
                    grpc.StatusCode.NOT_FOUND,
                    f"unknown micro-batch {mb} at step {request.step} on {job.describe()}: "
                    f"{why} (pending: {sorted(job.held)}); run ForwardTrain first, and "
                    "BackwardTrain each micro-batch once",
                )
            trainer = job.trainer

            def run() -> tuple[torch.Tensor | None, float]:
                began = time.perf_counter()
                grad_input = trainer.backward(mb, grad)
                return grad_input, (time.perf_counter() - began) * 1000.0

            try:
                grad_input, compute_ms = await self._compute(job, run)
            except StageError as err:
                if mb in trainer.pending:
                    raise  # refused before autograd ran: a corrected retry works
                # The stage's own backward overflowed from a finite gradient: the
                # micro-batch is gone and the step's gradients are incomplete. Nothing was
                # applied; GradNorm reports the step as non-finite and abandons it.
                self._release(job, mb)
                job.poisoned = f"backward of micro-batch {mb} produced NaN/inf gradients"
                raise StageError(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"step {request.step} of {job.describe()} is poisoned: {err.message}. "
                    "Call GradNorm (it abandons the step, finite=false) and retry the step, "
                    "or re-open every stage from the last checkpoint",
                ) from err
            self._release(job, mb)
            job.done.add(mb)
        response = training_pb2.TrainBackwardResponse(
            step=request.step, micro_batch=mb, compute_ms=compute_ms
        )
        if grad_input is not None:
            grad_tensor = codec.encode(grad_input.cpu().numpy(), "float32")
            if self._failpoints is not None:  # tests and demos only: tamper, then sign
                grad_tensor = self._failpoints.tamper_backward(grad_tensor)
            response.grad_input.CopyFrom(grad_tensor)
        grad_sent = request.grad_output if request.HasField("grad_output") else None
        self._sign(response, "backward", job, mb, response.grad_input.data, grad_sent)
        return response

    @staticmethod
    def _release(job: _Job, mb: int) -> None:
        job.held.pop(mb, None)
        job.recompute_reserve.pop(mb, None)

    # ---- GradNorm / OptimizerStep ---------------------------------------------------

    async def _grad_norm(
        self, request: training_pb2.GradNormRequest
    ) -> training_pb2.GradNormResponse:
        _, job = self._job_for(request.capability, request.job_id, request)
        async with self._lock_for(job.job_id):
            job = self._current(job, request.step)
            reason = job.poisoned
            if not reason:
                self._check_step_complete(job, request.step, "report its gradient norm")
                sq_norm = await self._shards.run(job.trainer.grad_sq_norm)
                if not math.isfinite(sq_norm):
                    reason = "the accumulated gradients overflowed"
            if reason:
                # Never applied: forget the step so the driver can retry it at this version.
                trainer = job.trainer

                def abandon() -> None:
                    trainer.discard()
                    trainer.zero_grad()

                await self._shards.run(abandon)
                job.forget_step()
                job.abandoned = reason
                job.nonfinite_refusals += 1
                log.warning(
                    "%s: step %d abandoned, %s; nothing was applied",
                    job.describe(),
                    request.step,
                    reason,
                )
                return self._signed_norm(job, request.step, 0.0, False)
        return self._signed_norm(job, request.step, sq_norm, True)

    def _signed_norm(
        self, job: _Job, step: int, sq_norm: float, finite: bool
    ) -> training_pb2.GradNormResponse:
        value = identity.training_norm_bytes(sq_norm, finite)
        return training_pb2.GradNormResponse(
            step=step, sq_norm=sq_norm, finite=finite,
            signature=self._sign_scalar("norm", job, step, value),
        )  # fmt: skip

    def _sign_scalar(self, pass_name: str, job: _Job, step: int, value: bytes) -> bytes:
        """Sign a GradNorm or OptimizerStep answer: evidence in a training dispute."""
        digest = hashlib.sha256(value).digest()
        payload = identity.training_payload(
            pass_name, job.job_id, step, 0, job.start, job.end, digest, b""
        )
        return self._ctx.private_key.sign(payload)

    async def _optimizer_step(
        self, request: training_pb2.OptimizerStepRequest
    ) -> training_pb2.OptimizerStepResponse:
        _, job = self._job_for(request.capability, request.job_id, request)
        clip = request.clip_coef
        if not (math.isfinite(clip) and 0 < clip <= 1):
            raise StageError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"clip_coef must be in (0, 1], got {clip}; send min(1, max_grad_norm / "
                "global_norm), or 1 when clipping is off",
            )
        async with self._lock_for(job.job_id):
            job = self._current(job, request.step)
            self._check_step_complete(job, request.step, "apply an optimizer step")
            if job.poisoned:
                raise StageError(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"step {request.step} of {job.describe()} cannot be applied: "
                    f"{job.poisoned}; call GradNorm (it abandons the step) and retry it",
                )
            trainer = job.trainer
            lazy = self._failpoints is not None and self._failpoints.skips_step()
            step = _lazy_step if lazy else _step
            version = await self._shards.run(lambda: step(trainer, clip, request.step))
            job.forget_step()
        value = identity.training_step_bytes(clip, version)
        return training_pb2.OptimizerStepResponse(
            step=version, signature=self._sign_scalar("step", job, request.step, value)
        )

    def _check_step_complete(self, job: _Job, step: int, what: str) -> None:
        if job.held:
            raise StageError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"cannot {what}: micro-batches {sorted(job.held)} of step {step} still await "
                f"backward on {job.describe()}",
            )
        missing = sorted(set(range(job.micro_batches)) - job.done)
        if missing:
            abandoned = ""
            if job.abandoned:
                abandoned = f" (the last attempt was abandoned: {job.abandoned})"
            raise StageError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"cannot {what}: micro-batches {missing} of step {step} were not "
                f"backpropagated on {job.describe()}{abandoned}; a step needs all "
                f"{job.micro_batches}",
            )

    # ---- SaveCheckpoint / CloseTraining ---------------------------------------------

    async def _save(
        self, request: training_pb2.SaveCheckpointRequest
    ) -> training_pb2.SaveCheckpointResponse:
        _, job = self._job_for(request.capability, request.job_id, request)
        async with self._lock_for(job.job_id):
            job = self._current(job, request.step)
            if job.held or job.done:
                raise StageError(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"step {request.step} of {job.describe()} is under way (micro-batches "
                    f"{sorted(set(job.held) | job.done)}); checkpoint between "
                    "steps, after OptimizerStep",
                )
            trainer = job.trainer
            data = await self._shards.run(lambda: state_to_bytes(*trainer.state_dict()))
        ref = CheckpointRef(job.job_id, request.step, job.start, job.end)
        try:
            receipt = await self._store.upload(ref, data)  # type: ignore[arg-type]
        except CheckpointTransferError as err:
            raise StageError(err.code, err.message) from err
        log.info("checkpoint of %s uploaded (%d bytes)", ref.describe(), len(data))  # type: ignore[arg-type]
        return training_pb2.SaveCheckpointResponse(
            step=request.step,
            sha256=receipt.sha256,
            total_bytes=receipt.total_bytes,
            consistent=receipt.consistent,
        )

    async def _close(self, request: training_pb2.CloseTrainingRequest) -> common_pb2.Empty:
        self._job_for(request.capability, request.job_id, request)
        async with self._lock_for(request.job_id):
            await self._drop_job(request.job_id)
        log.info("training of job %s closed", request.job_id)
        return common_pb2.Empty()

    async def _acknowledge(
        self, request: stage_pb2.AcknowledgeRequest
    ) -> stage_pb2.AcknowledgeResponse:
        # Not checked for expiry: paying for work done needs no right to ask for more.
        claims = self._claims(
            request.capability, request.session_id, request.HasField("capability"), expiry=False
        )
        return take_acknowledgments(
            self._usage, self._settler, claims, request.usage, training=True
        )

    async def _drop_job(self, job_id: str) -> None:
        job = self._jobs.pop(job_id, None)
        if job is not None:
            await self._shards.run(job.trainer.close)

    async def expire_idle(self) -> list[str]:
        """Drop the jobs idle longer than the TTL (not those with a call under way)."""
        cutoff = time.monotonic() - self.limits.idle_ttl_s
        expired = []
        for job_id, job in list(self._jobs.items()):
            lock = self._lock_for(job_id)
            if job.last_used < cutoff and not lock.locked():
                async with lock:
                    await self._drop_job(job_id)
                expired.append(job_id)
        for job_id in [j for j, lock in self._locks.items() if j not in self._jobs]:
            if not self._locks[job_id].locked():
                del self._locks[job_id]
        if expired:
            log.info("dropped training state of idle jobs: %s", ", ".join(expired))
        return expired

    def _start_expiry(self) -> None:
        if self._expiry_task is None or self._expiry_task.done():
            self._expiry_task = asyncio.get_running_loop().create_task(self._expiry_loop())

    async def _expiry_loop(self) -> None:
        while True:
            await asyncio.sleep(self.limits.expiry_interval_s)
            try:
                await self.expire_idle()
            except Exception:  # the sweeper must survive whatever one job does
                log.exception("idle training sweep failed")
            save_usage(self._usage)

    async def close(self) -> None:
        if self._expiry_task is not None:
            self._expiry_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._expiry_task
        for job_id in list(self._jobs):
            await self._drop_job(job_id)
        save_usage(self._usage)
        await self._settler.close()

    # ---- validation -----------------------------------------------------------------

    def _claims(
        self,
        signed: client_api_pb2.SignedCapability,
        job_id: str,
        present: bool,
        *,
        expiry: bool = True,
    ) -> client_api_pb2.CapabilityClaims:
        if not present:
            raise StageError(
                grpc.StatusCode.UNAUTHENTICATED,
                "the request carries no capability; send the one the coordinator issued for "
                "the job's training session",
            )
        claims = open_capability(self._ctx, signed)
        if expiry:
            check_expiry(claims, self._clock())
        if not _JOB_ID.match(job_id):
            raise StageError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"job_id {job_id[:80]!r} is not a job id (1-128 letters, digits, '.', '_', "
                "':' or '-')",
            )
        if claims.session_id != job_id:
            raise StageError(
                grpc.StatusCode.PERMISSION_DENIED,
                f"the capability is for training session {claims.session_id!r}, the request "
                f"names job {job_id!r}",
            )
        return claims

    def _job_for(
        self,
        signed: client_api_pb2.SignedCapability,
        job_id: str,
        request: object,
    ) -> tuple[client_api_pb2.CapabilityClaims, _Job]:
        present = request.HasField("capability")  # type: ignore[attr-defined]
        claims = self._claims(signed, job_id, present)
        job = self._jobs.get(job_id)
        if job is None:
            raise StageError(
                grpc.StatusCode.NOT_FOUND,
                f"this node holds no training state for job {job_id!r} (never opened here, "
                "closed, or the node restarted); call OpenTraining, restoring the last "
                "consistent checkpoint",
            )
        check_grant(claims, self._ctx.node_id, job.model, job.start, job.end)
        return claims, job

    def _current(self, job: _Job, step: int) -> _Job:
        """Re-read the job under its lock (it may have been re-opened) and check the step."""
        current = self._jobs.get(job.job_id)
        if current is None:
            raise StageError(
                grpc.StatusCode.NOT_FOUND,
                f"the training of job {job.job_id!r} was closed on this node meanwhile",
            )
        if step != current.trainer.version:
            raise StageError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"stale step {step}: {current.describe()} is at version "
                f"{current.trainer.version}; the driver is out of sync (a repeated step, or "
                "a stage restored from another checkpoint): roll every stage back to one "
                "checkpoint with OpenTraining",
            )
        current.last_used = time.monotonic()
        return current

    @staticmethod
    def _check_micro_batch_id(job: _Job, mb: int) -> int:
        if mb >= job.micro_batches:
            raise StageError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"micro_batch {mb} is out of range: the job was opened with "
                f"{job.micro_batches} micro-batches per step (ids 0..{job.micro_batches - 1})",
            )
        return mb

    def _decode_input(
        self,
        job: _Job,
        request: training_pb2.TrainForwardRequest,
        claims: client_api_pb2.CapabilityClaims,
    ) -> torch.Tensor:
        if not request.HasField("input"):
            raise StageError(grpc.StatusCode.INVALID_ARGUMENT, "the request carries no input")
        limits = self.limits
        try:
            if job.is_first:
                array = codec.decode(
                    request.input,
                    allowed=codec.INT_DTYPES,
                    ndim=2,
                    max_elements=limits.max_tokens_per_micro_batch,
                    name="token ids",
                )
            else:
                array = codec.decode(
                    request.input,
                    allowed=frozenset({"float32"}),
                    ndim=3,
                    shape=(None, None, job.config_hidden),
                    max_elements=limits.max_tokens_per_micro_batch * job.config_hidden,
                    name="hidden states (training runs in float32)",
                )
        except codec.TensorError as err:
            raise _tensor_refusal(err, f"{job.describe()} (layer {job.start})") from err
        batch, tokens = int(array.shape[0]), int(array.shape[1])
        if batch > limits.max_batch:
            raise StageError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"a micro-batch of {batch} sequences is larger than this node accepts "
                f"({limits.max_batch}); use more, smaller micro-batches",
            )
        longest = min(job.max_positions, claims.max_tokens or job.max_positions)
        if tokens > longest:
            raise StageError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"sequences of {tokens} tokens exceed the {longest} positions this job may "
                "use (model context and the capability's max_tokens); use a shorter seq_len",
            )
        if job.is_first:
            low, high = int(array.min()), int(array.max())
            if low < 0 or high >= job.vocab:
                bad = low if low < 0 else high
                raise StageError(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"token id {bad} is outside the vocabulary [0, {job.vocab})",
                )
            return torch.from_numpy(array.astype(np.int64))
        return torch.from_numpy(array.copy())

    @staticmethod
    def _decode_labels(
        job: _Job, request: training_pb2.TrainForwardRequest, x: torch.Tensor
    ) -> torch.Tensor | None:
        if not job.is_last:
            if request.HasField("labels"):
                raise StageError(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"only the last stage takes labels; {job.describe()} ends before the "
                    "model's last layer",
                )
            return None
        if not request.HasField("labels"):
            raise StageError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{job.describe()} is the last stage: send the labels (int64 [batch, seq], "
                "-100 = ignored) with every micro-batch",
            )
        try:
            labels = codec.decode(
                request.labels,
                allowed=frozenset({"int64"}),
                ndim=2,
                shape=tuple(x.shape[:2]),
                name="labels",
            )
        except codec.TensorError as err:
            raise _tensor_refusal(err, f"{job.describe()} (labels must match the input)") from err
        valid = (labels == -100) | ((labels >= 0) & (labels < job.vocab))
        if not bool(valid.all()):
            raise StageError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"labels must be token ids in [0, {job.vocab}) or -100 (ignored)",
            )
        if not bool((labels != -100).any()):
            raise StageError(
                grpc.StatusCode.INVALID_ARGUMENT,
                "every label of the micro-batch is -100, so its loss is undefined; send at "
                "least one target token per micro-batch",
            )
        return torch.from_numpy(labels.copy())

    def _decode_grad(
        self, job: _Job, request: training_pb2.TrainBackwardRequest
    ) -> torch.Tensor | None:
        if job.is_last:
            if request.HasField("grad_output"):
                raise StageError(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"{job.describe()} is the last stage: its loss is the root of backward, "
                    "so send no grad_output",
                )
            return None
        if not request.HasField("grad_output"):
            raise StageError(
                grpc.StatusCode.INVALID_ARGUMENT,
                "backward needs grad_output, d(loss)/d(output) of this stage, float32 "
                f"[batch, seq, {job.config_hidden}]",
            )
        try:
            # NaN/inf pass here on purpose: the trainer refuses them with the micro-batch
            # kept pending, so a corrected retry works, and the refusal is counted.
            array = codec.decode(
                request.grad_output,
                allowed=frozenset({"float32"}),
                ndim=3,
                shape=(None, None, job.config_hidden),
                max_elements=self.limits.max_tokens_per_micro_batch * job.config_hidden,
                finite=False,
                name="grad_output (training runs in float32)",
            )
        except codec.TensorError as err:
            raise _tensor_refusal(err, job.describe()) from err
        return torch.from_numpy(array.copy())

    # ---- compute --------------------------------------------------------------------

    async def _compute(self, job: _Job, fn: Callable[[], T]) -> T:
        try:
            return await self._shards.run(fn)  # type: ignore[return-value]
        except NonFiniteGradientError as err:
            job.nonfinite_refusals += 1
            log.warning("%s: %s", job.describe(), err)
            raise StageError(grpc.StatusCode.INVALID_ARGUMENT, str(err)) from err
        except TooManyMicroBatchesError as err:
            raise StageError(grpc.StatusCode.RESOURCE_EXHAUSTED, str(err)) from err
        except (TrainingInputError, ValueError) as err:
            raise StageError(grpc.StatusCode.INVALID_ARGUMENT, str(err)) from err

    def _sign(
        self,
        response: training_pb2.TrainForwardResponse | training_pb2.TrainBackwardResponse,
        pass_name: str,
        job: _Job,
        mb: int,
        payload: bytes,
        *inputs: common_pb2.Tensor | None,
    ) -> None:
        """Sign what this node answers: a signed wrong output is proof against it, and the
        input digest binds the output to what the node was sent (docs/verification.md)."""
        response.input_digest = output_check.tensor_digest(*inputs)
        response.signature = self._ctx.private_key.sign(
            identity.training_payload(
                pass_name,
                job.job_id,
                response.step,
                mb,
                job.start,
                job.end,
                hashlib.sha256(payload).digest(),
                response.input_digest,
            )
        )

    def _lock_for(self, job_id: str) -> asyncio.Lock:
        lock = self._locks.get(job_id)
        if lock is None:
            lock = self._locks[job_id] = asyncio.Lock()
        return lock


def _fp32_copy(shard: LoadedShard, start: int, end: int) -> StageModel:
    """A private fp32 StageModel of layers [start, end): training never touches what the
    shard serves for inference."""
    config = shard.config
    first, last = start == 0, end == shard.num_layers
    weights = shard.full_stage.state_dict()
    names = tensor_names_for_stage(config, start, end, first, last)
    tensors = {n: weights[n].detach().to(torch.float32, copy=True) for n in names}
    return StageModel(
        config, start, end, first, last, tensors, device=shard.device, dtype=torch.float32
    )


def _tensor_refusal(err: codec.TensorError, where: str) -> StageError:
    code = grpc.StatusCode.INVALID_ARGUMENT
    if "exceed the limit" in str(err):
        code = grpc.StatusCode.RESOURCE_EXHAUSTED
    return StageError(code, f"{err} ({where})")


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def build_training_servicer(ctx: AgentContext) -> TrainingStageServicer | None:
    """Plug-in entry point the data plane calls when it starts (see node_agent/plugins.py).

    Trains on the shards of the agent's ShardManager; an agent without a model runtime
    (another shard handler) serves no training, and TrainingStage answers UNIMPLEMENTED."""
    if not isinstance(ctx.shard_handler, ShardManager):
        return None
    return TrainingStageServicer(ctx, ctx.shard_handler)


def _step(trainer: StageTrainer, clip: float, version: int) -> int:
    return trainer.step(clip, version)


def _lazy_step(trainer: StageTrainer, clip: float, version: int) -> int:
    """Failpoint skip_step: answer the next version, keep the weights (a lazy cheat)."""
    params = trainer.trainable_parameters()
    before = {name: p.detach().clone() for name, p in params.items()}
    new_version = trainer.step(clip, version)
    with torch.no_grad():
        for name, param in params.items():
            param.copy_(before[name])
    return new_version
