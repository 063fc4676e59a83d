"""The training driver: pipelines micro-batches through a job's stage nodes.

One optimizer step splits the batch ``[B, T]`` into ``hyper.micro_batches`` micro-batches.
Each micro-batch walks forward through the stages (token ids to the first, hidden states
between them, labels to the last, which answers with the loss), then backward in reverse
(the last stage starts from its loss, each stage returns the gradient of its input).

Schedule: 1F1B with a window of ``max(2, stages)`` micro-batches in flight. A micro-batch
starts its backward as soon as its forward reaches the loss, and a new micro-batch enters
the pipeline only when one has finished its backward. Stages overlap (the first stage
runs micro-batch k+1 forward while later stages work on k), with the same bubble as
GPipe, but a stage never holds more than ``window`` micro-batches of activations, however
many micro-batches a step has: GPipe would hold all of them, which on a volunteer's GPU
means smaller batches or recomputation. See docs/training.md.

After the last backward, every stage reports its squared gradient norm; the driver sums
them into the global norm, computes one clip coefficient and sends it with OptimizerStep
to every stage. A stage that fails raises ``StageFailed`` (the caller re-plans, then
``replace_hop`` and ``open(restore_step=...)``), or its subclass ``StageOutOfSync`` when
the node is alive but out of step (restore without re-planning); a stage that refuses the
request itself raises ``RequestRejected``. Every ForwardTrain / BackwardTrain reply must
carry the granted node's signature (client/training_verification.py); one that does not
is a ``StageFailed`` of that node. numpy only: the client never imports torch.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
import numpy as np
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from client.acknowledgments import Acknowledger, training_rpc
from client.billing import UsageBook
from client.channels import ChannelPool
from client.driver import CLIENT_FAULT_CODES
from client.errors import RequestRejected, TesseraError
from client.training_deadlines import StepDeadlines
from client.training_verification import (
    KIND,
    BadTrainingSignature,
    ShadowChecks,
    ShadowMismatch,
    TrainingReplyChecker,
    full_answer,
    logged_call,
)
from protos import codec, identity, usage_credit
from protos.tessera.v1 import (
    client_api_pb2,
    common_pb2,
    training_pb2,
    training_pb2_grpc,
    verification_pb2,
)

log = logging.getLogger(__name__)

T = TypeVar("T")
IGNORE_INDEX = -100
Outcome = verification_pb2.Verdict.Outcome
# Reports a dispute to the coordinator's verifier and returns its verdict.
DisputeReporter = Callable[[verification_pb2.TrainingDispute], Awaitable[verification_pb2.Verdict]]


@dataclass(frozen=True)
class TrainingHop:
    """One stage of the training pipeline."""

    node_id: str
    address: str  # HOST:PORT of the node's data plane
    start: int  # layer range [start, end)
    end: int

    @property
    def span(self) -> str:
        return f"[{self.start}, {self.end})"


@dataclass(frozen=True)
class StepResult:
    step: int  # the step that was applied (version before the step)
    loss: float  # mean over the batch's counted labels
    grad_norm: float  # global norm before clipping
    tokens: int  # label tokens in the batch
    stage_ms: list[float]  # per-stage compute time of this step (sum over micro-batches)
    wall_s: float


class StageFailed(TesseraError):
    """A stage node failed; the caller re-plans the stage and restores every stage.

    ``restore_at_most``: set when a redundant check proved the node's recent work wrong:
    the newest checkpoint step that is not suspect (the node uploaded the later ones)."""

    def __init__(
        self, index: int, node_id: str, cause: str, restore_at_most: int | None = None
    ) -> None:
        super().__init__(f"training stage {index} on node {node_id} failed: {cause}")
        self.index = index
        self.node_id = node_id
        self.cause = cause
        self.restore_at_most = restore_at_most


class StageOutOfSync(StageFailed):
    """The node is alive but its training state does not match the driver's (a stale or
    repeated step, a step poisoned by NaN/inf gradients). Re-planning is not needed:
    ``open(restore_step=...)`` on every stage rolls them back to one checkpoint."""


class NonFiniteGradients(TesseraError):
    """A stage refused NaN/inf gradients; the step was abandoned on every stage, so
    nothing was applied and the same step can be retried (e.g. with another batch)."""


@dataclass(frozen=True)
class TrainingDriverConfig:
    # The cold timeout: a node's first calls may compile kernels or load weights, and a
    # restore downloads a checkpoint. It also caps the deadlines below.
    rpc_timeout_s: float = 300.0
    close_timeout_s: float = 5.0
    # Once a node has answered a kind of step call twice, the next such call gets
    # max(floor, factor x its slowest recent answer): a node that hangs with its connection
    # open costs a re-plan within seconds, not the cold timeout (client/training_deadlines.py).
    step_deadline_floor_s: float = 30.0
    step_deadline_factor: float = 8.0


class TrainingDriver:
    """Drives one job's training pipeline. Use from one event loop; calls must not overlap."""

    def __init__(
        self,
        *,
        job_id: str,
        model: str,
        hops: list[TrainingHop],
        capability: client_api_pb2.SignedCapability,
        hyper: training_pb2.TrainingHyper,
        channels: ChannelPool | None = None,
        config: TrainingDriverConfig | None = None,
        checkers: list[TrainingHop] | None = None,
        check_probability: float | None = None,
        check_seed: int | None = None,
        usage: UsageBook | None = None,
        disputes: DisputeReporter | None = None,
        key: Ed25519PrivateKey | None = None,
    ) -> None:
        """``checkers``: independent replicas (another node, of another operator, granted
        by the capability) of some stages' layers. In a sampled fraction of checkpoint
        intervals a checker trains a shadow of its stage in lockstep and every answer is
        compared (client/training_verification.py). The fraction is
        ``check_probability``, or when None each primary node's own ``check_probability``
        from the capability (set by the coordinator from its trust). ``disputes``: where a
        mismatch goes for arbitration (the coordinator's ReportTrainingDispute); without
        it a mismatch always fails the primary. ``key``: the paying client's, which
        acknowledges the nodes' receipts as the job goes when the capability gives them a
        credit (client/acknowledgments.py)."""
        _check_hops(hops)
        if hyper.micro_batches < 1:
            raise ValueError(f"hyper.micro_batches must be >= 1, got {hyper.micro_batches}")
        self.job_id = job_id
        self.model = model
        self.hops = list(hops)
        self.hyper = hyper
        self.config = config or TrainingDriverConfig()
        self.deadlines = StepDeadlines(
            self.config.rpc_timeout_s,
            self.config.step_deadline_floor_s,
            self.config.step_deadline_factor,
        )
        self._capability = capability
        # Samples sent to each (node, layers) and the nodes' signed receipts: the job runner
        # counter-signs them for the coordinator (client/billing.py). Shared across the
        # drivers of one run so the counts stay cumulative like the nodes' receipts.
        self.usage = usage if usage is not None else UsageBook()
        # Every ForwardTrain / BackwardTrain reply must be signed by the granted node.
        self.signatures = TrainingReplyChecker(capability)
        self._checkers = _checker_stages(hops, checkers or [])
        self.shadows = ShadowChecks(
            {i: (h.node_id, h.start, h.end) for i, h in self._checkers.items()},
            check_probability,
            check_seed,
        )
        self._disputes = disputes
        self.verdicts: list[verification_pb2.Verdict] = []
        # Agreed lockstep checks not reported yet (the job runner sends them in batches).
        self.agreements: list[verification_pb2.TrainingAgreement] = []
        self._owns_channels = channels is None
        self._channels = channels or ChannelPool()
        self._version: int | None = None  # unknown until open()
        self.acks = self._acknowledger(key)

    def _acknowledger(self, key: Ed25519PrivateKey | None) -> Acknowledger | None:
        """In a paid job each node runs at most the capability's credit of samples past the
        receipts this client acknowledged: acknowledge as the job goes."""
        claims = client_api_pb2.CapabilityClaims()
        claims.ParseFromString(self._capability.claims)
        if key is None or not claims.usage_credit or not claims.client_public_key:
            return None
        if claims.client_public_key != identity.public_key_bytes(key):
            log.warning(
                "job %s is paid by another client key than this runner's: its nodes will "
                "refuse work past %d unacknowledged samples", self.job_id, claims.usage_credit,
            )  # fmt: skip
            return None
        return Acknowledger(
            self.job_id,
            claims.usage_credit,
            key,
            self.usage,
            self._channels,
            lambda: self._capability,
            rpc=training_rpc,
        )

    @property
    def version(self) -> int | None:
        """The step every stage is at (None before ``open``)."""
        return self._version

    @property
    def window(self) -> int:
        """Micro-batches in flight at once (1F1B warm-up depth, at least 2)."""
        return min(self.hyper.micro_batches, max(2, len(self.hops)))

    # ---- lifecycle ------------------------------------------------------------------

    async def open(
        self,
        *,
        restore_step: int = 0,
        restore_sha256: dict[tuple[int, int], str] | None = None,
    ) -> int:
        """Open (or re-open, which rolls back) every stage; returns the common step."""
        restore_sha256 = restore_sha256 or {}
        if restore_step:
            missing = [h.span for h in self.hops if (h.start, h.end) not in restore_sha256]
            if missing:
                raise ValueError(
                    f"restoring step {restore_step} needs the sha256 of every stage's "
                    f"checkpoint; none given for layers {', '.join(missing)}"
                )
        self._version = None

        async def open_one(index: int, hop: TrainingHop) -> int:
            request = self._open_request(hop, restore_step, restore_sha256)
            reply = await self._call(index, "OpenTraining", request)
            return reply.step

        steps = await self._all(open_one)
        if len(set(steps)) != 1:
            raise StageOutOfSync(
                0, self.hops[0].node_id, f"stages opened at different steps {steps}"
            )
        self._version = steps[0]
        # Every stage rolled back: no shadow can continue, each is drawn afresh.
        await self._start_intervals(steps[0], restore_sha256, rolled_back=True)
        return steps[0]

    def _open_request(
        self, hop: TrainingHop, restore_step: int, restore_sha256: dict[tuple[int, int], str]
    ) -> training_pb2.OpenTrainingRequest:
        return training_pb2.OpenTrainingRequest(
            capability=self._capability,
            job_id=self.job_id,
            model=self.model,
            layers=common_pb2.LayerRange(start=hop.start, end=hop.end),
            hyper=self.hyper,
            restore_step=restore_step,
            restore_sha256=restore_sha256.get((hop.start, hop.end), "") if restore_step else "",
        )

    async def _start_intervals(
        self, step: int, parts: dict[tuple[int, int], str], *, rolled_back: bool
    ) -> None:
        """A checkpoint interval begins at ``step``: draw, per checked stage, whether its
        shadow trains in lockstep through it (with the primary's probability; the primary
        cannot tell), and (re-)open the shadows that must start from this checkpoint."""

        async def open_shadow(index: int) -> None:
            hop = self._checkers[index]
            try:
                reply = await self._call_hop(
                    index, hop, "OpenTraining", self._open_request(hop, step, parts)
                )
            except (StageFailed, RequestRejected) as err:
                self.shadows.drop(index, str(err))
                return
            if reply.step == step:
                self.shadows.opened(index, step)
            else:
                self.shadows.drop(index, f"its shadow opened at step {reply.step}, not {step}")

        reopen = []
        for index in list(self.shadows.shadows):
            primary = self.hops[index].node_id
            sampled = self.shadows.sample(self.signatures.check_probability.get(primary, 1.0))
            hop = self.hops[index]
            sha256 = parts.get((hop.start, hop.end), "") if step else ""
            if self.shadows.start_interval(
                index, step, sampled, rolled_back=rolled_back, sha256=sha256
            ):
                reopen.append(index)
        await asyncio.gather(*(open_shadow(i) for i in reopen))

    def set_checkers(self, checkers: list[TrainingHop]) -> None:
        """A new session's checkers (after a re-plan); they start at the next ``open``."""
        self._checkers = _checker_stages(self.hops, checkers)
        self.shadows.replace({i: (h.node_id, h.start, h.end) for i, h in self._checkers.items()})

    async def close(self) -> None:
        """Hand the nodes their last receipts, free the training state on every stage (best
        effort) and close channels."""
        if self.acks is not None:
            await self.acks.close()
        request = training_pb2.CloseTrainingRequest(capability=self._capability, job_id=self.job_id)

        async def close_one(hop: TrainingHop) -> None:
            stub = training_pb2_grpc.TrainingStageStub(self._channels.get(hop.address))
            try:
                await stub.CloseTraining(request, timeout=self.config.close_timeout_s)
            except grpc.aio.AioRpcError as err:
                log.debug("CloseTraining on %s: %s", hop.node_id, err.code().name)

        await asyncio.gather(*(close_one(hop) for hop in self.hops))
        if self._owns_channels:
            await self._channels.close()

    def replace_hop(
        self, index: int, hop: TrainingHop, capability: client_api_pb2.SignedCapability
    ) -> None:
        """Put ``hop`` in place of stage ``index`` (same layers); call ``open`` next."""
        if not 0 <= index < len(self.hops):
            raise ValueError(f"stage index {index} is out of range [0, {len(self.hops)})")
        old = self.hops[index]
        if (hop.start, hop.end) != (old.start, old.end):
            raise ValueError(
                f"the replacement covers layers {hop.span}, stage {index} covers {old.span}"
            )
        self.hops[index] = hop
        self._capability = capability
        self.signatures.update(capability)
        for checked, checker in list(self._checkers.items()):
            if checker.node_id == hop.node_id:
                self._checkers.pop(checked)
                self.shadows.drop(checked, f"node {hop.node_id} now runs stage {index} itself")
        self._version = None

    # ---- one optimizer step ---------------------------------------------------------

    async def train_step(self, step: int, input_ids: np.ndarray, labels: np.ndarray) -> StepResult:
        """Forward and backward every micro-batch, clip globally, step every stage."""
        if self._version is None:
            raise ValueError("call open() before train_step()")
        if step != self._version:
            raise ValueError(f"the stages are at step {self._version}, not {step}")
        micro_batches = self._split(input_ids, labels)
        began = time.perf_counter()
        stage_ms = [0.0] * len(self.hops)
        losses: list[tuple[float, int]] = [(0.0, 0)] * len(micro_batches)
        window = asyncio.Semaphore(self.window)

        async def one(mb: int) -> None:
            async with window:
                tokens, targets = micro_batches[mb]
                losses[mb] = await self._forward(step, mb, tokens, targets, stage_ms)
                await self._backward(step, mb, stage_ms)

        await _all_or_cancel([one(mb) for mb in range(len(micro_batches))])
        self.shadows.passes_done(step)
        total_sq_norm = await self._global_sq_norm(step)
        clip = clip_coefficient(total_sq_norm, self.hyper.max_grad_norm)

        async def step_one(index: int, hop: TrainingHop) -> int:
            request = training_pb2.OptimizerStepRequest(
                capability=self._capability, job_id=self.job_id, step=step, clip_coef=clip
            )
            # A lockstep shadow applies the very same clip coefficient.
            reply, shadow = await self._pair(index, "OptimizerStep", request, step, "step")
            self._check_signature(index, self.signatures.optimizer_step, request, reply)
            if shadow is not None:
                await self._checked(index, KIND.OPTIMIZER_STEP, request, reply, shadow, None)
                if shadow.step == step + 1:
                    self.shadows.stepped(index, step)
                else:
                    self.shadows.drop(index, f"its shadow stepped to {shadow.step}")
            return reply.step

        versions = await self._all(step_one)
        if set(versions) != {step + 1}:
            self._version = None
            raise StageOutOfSync(
                0, self.hops[0].node_id, f"stages answered versions {versions}, not {step + 1}"
            )
        self._version = step + 1
        counted = sum(n for _, n in losses)
        return StepResult(
            step=step,
            loss=sum(loss * n for loss, n in losses) / counted,
            grad_norm=math.sqrt(total_sq_norm),
            tokens=counted,
            stage_ms=stage_ms,
            wall_s=time.perf_counter() - began,
        )

    async def save_checkpoint(self, step: int) -> dict[tuple[int, int], str]:
        """Every stage uploads its state at ``step``; returns layers -> sha256."""
        if step != self._version:
            raise ValueError(f"the stages are at step {self._version}, not {step}")

        async def save_one(index: int, hop: TrainingHop) -> str:
            request = training_pb2.SaveCheckpointRequest(
                capability=self._capability, job_id=self.job_id, step=step
            )
            reply = await self._call(index, "SaveCheckpoint", request)
            return reply.sha256

        digests = await self._all(save_one)
        parts = {(h.start, h.end): d for h, d in zip(self.hops, digests, strict=True)}
        # A new checkpoint interval: shadows are drawn again (a lockstep shadow never
        # uploads: the stage's checkpoint is the primary's).
        await self._start_intervals(step, parts, rolled_back=False)
        return parts

    # ---- the walk -------------------------------------------------------------------

    async def _forward(
        self, step: int, mb: int, tokens: np.ndarray, labels: np.ndarray, stage_ms: list[float]
    ) -> tuple[float, int]:
        x = codec.encode(tokens, "int64")
        last = len(self.hops) - 1
        for index in range(len(self.hops)):
            request = training_pb2.TrainForwardRequest(
                capability=self._capability, job_id=self.job_id, step=step, micro_batch=mb
            )
            request.input.CopyFrom(x)
            if index == last:
                request.labels.CopyFrom(codec.encode(labels, "int64"))
            hop = self.hops[index]
            await self._acknowledged_before(index, step)
            self.usage.sent(hop.node_id, hop.start, hop.end, int(tokens.shape[0]))
            reply, shadow = await self._pair(index, "ForwardTrain", request, step, "forward")
            self._check_signature(index, self.signatures.forward, request, reply)
            self._received(hop, reply.usage)
            if shadow is not None:
                compare = self.shadows.compare
                await self._checked(index, KIND.FORWARD, request, reply, shadow, compare)
            stage_ms[index] += reply.compute_ms
            if index == last:
                return reply.loss, reply.label_tokens
            x = reply.output
        raise AssertionError("unreachable: the last stage answers with the loss")

    async def _backward(self, step: int, mb: int, stage_ms: list[float]) -> None:
        grad: common_pb2.Tensor | None = None
        for index in reversed(range(len(self.hops))):
            request = training_pb2.TrainBackwardRequest(
                capability=self._capability, job_id=self.job_id, step=step, micro_batch=mb
            )
            if grad is not None:
                request.grad_output.CopyFrom(grad)
            reply, shadow = await self._pair(index, "BackwardTrain", request, step, "backward")
            self._check_signature(index, self.signatures.backward, request, reply)
            if shadow is not None:
                compare = self.shadows.compare
                await self._checked(index, KIND.BACKWARD, request, reply, shadow, compare)
            stage_ms[index] += reply.compute_ms
            grad = reply.grad_input if reply.HasField("grad_input") else None

    async def _global_sq_norm(self, step: int) -> float:
        async def norm_one(index: int, hop: TrainingHop) -> training_pb2.GradNormResponse:
            request = training_pb2.GradNormRequest(
                capability=self._capability, job_id=self.job_id, step=step
            )
            reply, shadow = await self._pair(index, "GradNorm", request, step, "norm")
            self._check_signature(index, self.signatures.norm, request, reply)
            if shadow is not None:
                compare = self.shadows.compare
                await self._checked(index, KIND.NORM, request, reply, shadow, compare)
            return reply

        replies = await self._all(norm_one)
        refused = [self.hops[i].node_id for i, r in enumerate(replies) if not r.finite]
        if refused:
            raise NonFiniteGradients(
                f"step {step}: NaN/inf gradients on node(s) {', '.join(refused)}; the step was "
                "abandoned and nothing was applied. Retry it, or lower the learning rate"
            )
        # A sum of fp64 per-stage sums: the norm one process would compute, to rounding.
        return sum(r.sq_norm for r in replies)

    # ---- calls ----------------------------------------------------------------------

    async def _all(self, fn: Callable[[int, TrainingHop], Awaitable[T]]) -> list[T]:
        return await _all_or_cancel([fn(i, hop) for i, hop in enumerate(self.hops)])

    def _check_signature(
        self,
        index: int,
        check: Callable[..., None],
        request: Any,
        reply: Any,
        hop: TrainingHop | None = None,
    ) -> None:
        """An unsigned or wrongly signed reply is a failure of its node: re-plan it."""
        hop = hop or self.hops[index]
        try:
            check(hop.node_id, hop.start, hop.end, self.job_id, request, reply)
        except BadTrainingSignature as err:
            log.warning("training stage %d on %s: %s", index, hop.node_id, err)
            raise StageFailed(index, hop.node_id, f"bad signature: {err}") from err

    async def _pair(
        self, index: int, method: str, request: Any, step: int, kind: str
    ) -> tuple[Any, Any]:
        """Call stage ``index``; when its shadow is active for this call, send it the very
        same request at the same time. Returns (primary reply, shadow reply or None)."""
        if self.shadows.active(index, step, kind) is None:
            return await self._call(index, method, request), None
        shadow = asyncio.ensure_future(self._shadow_call(index, method, request))
        began = time.monotonic()
        try:
            primary = await self._call(index, method, request)
        except BaseException:
            await _cancelled(shadow)
            raise
        # A shadow that lags far behind the primary stops checking rather than hold the job.
        patience = self.deadlines.patience(time.monotonic() - began)
        done, _ = await asyncio.wait({shadow}, timeout=patience)
        if not done:
            await _cancelled(shadow)
            checker = self._checkers[index].node_id
            self.shadows.drop(
                index, f"checker {checker} did not answer {method} within {patience:.1f} s "
                "of the primary"
            )  # fmt: skip
            return primary, None
        return primary, shadow.result()

    async def _shadow_call(self, index: int, method: str, request: Any) -> Any:
        """The shadow's answer, or None when it failed (then it stops checking: a checker
        never fails the primary's job)."""
        hop = self._checkers[index]
        signatures = self.signatures
        signed = {
            "ForwardTrain": signatures.forward,
            "BackwardTrain": signatures.backward,
            "GradNorm": signatures.norm,
            "OptimizerStep": signatures.optimizer_step,
        }
        if method == "ForwardTrain":
            samples = int(request.input.shape[0]) if request.input.shape else 0
            self.usage.checked(hop.node_id, hop.start, hop.end, samples)
        try:
            reply = await self._call_hop(index, hop, method, request)
            self._check_signature(index, signed[method], request, reply, hop)
        except (StageFailed, RequestRejected) as err:
            self.shadows.drop(index, str(err))
            return None
        if method == "ForwardTrain":
            self._received(hop, reply.usage)
        return reply

    async def _acknowledged_before(self, index: int, step: int) -> None:
        """Before a forward of stage ``index`` (and of its shadow, when one runs): wait for
        the acknowledgment of a node that is owed half its credit."""
        if self.acks is None:
            return
        hops = [self.hops[index]]
        if self.shadows.active(index, step, "forward") is not None:
            hops.append(self._checkers[index])
        await self.acks.ready((h, h.start, h.end) for h in hops)

    def _received(self, hop: TrainingHop, usage: Any) -> None:
        """Book a forward reply's receipt, and acknowledge it when a quarter of the credit
        is owed (off the step's path)."""
        self.usage.received(hop.node_id, hop.start, hop.end, usage)
        if self.acks is not None:
            self.acks.noted(hop, hop.start, hop.end)

    async def _checked(
        self,
        index: int,
        kind: int,
        request: Any,
        reply: Any,
        shadow: Any,
        compare: Callable[..., None] | None,
    ) -> None:
        """Log the call both nodes answered (a dispute's evidence), then compare. On a
        disagreement the coordinator arbitrates: a convicted checker is dropped and the
        primary's answer stands; otherwise the primary fails, and the job re-plans the
        stage and restores a checkpoint the shadow still vouches for."""
        state = self.shadows.shadows.get(index)
        if state is None or state.disputed:
            return  # dropped meanwhile, or one dispute of this stage is being arbitrated
        checker, primary = self._checkers[index], self.hops[index]
        call = logged_call(kind, request, (primary.node_id, reply), (checker.node_id, shadow))
        state.log.append(call)
        if compare is None:
            return
        try:
            compare(index, primary.node_id, kind, reply, shadow)
        except ShadowMismatch as err:
            log.warning("training stage %d: %s", index, err)
            state.disputed = True
            verdict = await self._dispute(index, state.anchor, state.anchor_sha256, reply, shadow)
            if verdict is not None and verdict.outcome == Outcome.CHECKER_WRONG:
                self.shadows.drop(index, f"the arbiter proved checker {checker.node_id} wrong")
                return
            judged = f" ({verdict.detail})" if verdict is not None else ""
            raise StageFailed(
                index,
                primary.node_id,
                f"redundant check failed: {err}{judged}",
                err.restore_at_most,
            ) from err
        if kind == KIND.FORWARD and request.micro_batch == self.hyper.micro_batches - 1:
            # One agreement per checked step and stage earns both nodes trust.
            self.agreements.append(
                verification_pb2.TrainingAgreement(
                    kind=call.kind,
                    step=call.step,
                    micro_batch=call.micro_batch,
                    layers=common_pb2.LayerRange(start=primary.start, end=primary.end),
                    primary=call.primary,
                    checker=call.checker,
                )  # fmt: skip
            )

    async def _dispute(
        self, index: int, anchor: int, anchor_sha256: str, reply: Any, shadow: Any
    ) -> verification_pb2.Verdict | None:
        """Report the disagreement with every call since the checkpoint both nodes
        started from; None without a reporter or when the coordinator cannot answer."""
        state = self.shadows.shadows.get(index)
        if self._disputes is None or state is None:
            return None
        hop, checker = self.hops[index], self._checkers[index]
        dispute = verification_pb2.TrainingDispute(
            job_id=self.job_id,
            capability=self._capability,
            layers=common_pb2.LayerRange(start=hop.start, end=hop.end),
            primary_node_id=hop.node_id,
            checker_node_id=checker.node_id,
            restore_step=anchor,
            restore_sha256=anchor_sha256,
            calls=state.log,
            primary_answer=full_answer(reply),
            checker_answer=full_answer(shadow),
        )
        try:
            verdict = await self._disputes(dispute)
        except (grpc.aio.AioRpcError, TesseraError) as err:
            log.warning("training stage %d: the dispute was not arbitrated: %s", index, err)
            return None
        log.warning(
            "training stage %d: arbitration: %s (%s)",
            index, Outcome.Name(verdict.outcome), verdict.detail,
        )  # fmt: skip
        self.verdicts.append(verdict)
        return verdict

    async def _call(self, index: int, method: str, request: object) -> Any:
        return await self._call_hop(index, self.hops[index], method, request)

    async def _call_hop(
        self, index: int, hop: TrainingHop, method: str, request: object, *, resumed: bool = False
    ) -> Any:
        stub = training_pb2_grpc.TrainingStageStub(self._channels.get(hop.address))
        timeout = self.deadlines.timeout(hop.node_id, method)
        began = time.monotonic()
        try:
            reply = await getattr(stub, method)(request, timeout=timeout)
        except grpc.aio.AioRpcError as err:
            code, details = err.code(), err.details() or ""
            if (
                code == grpc.StatusCode.FAILED_PRECONDITION
                and usage_credit.is_refusal(details)
                and self.acks is not None
                and not resumed
                and await self.acks.settle_up(hop, hop.start, hop.end)
            ):
                # Refused for want of an acknowledgment (one lost on the way, or not there
                # yet), which the node has now taken: the same call again, not a re-sync.
                log.info("%s on %s waited for an acknowledgment; sent again", method, hop.node_id)
                return await self._call_hop(index, hop, method, request, resumed=True)
            if code == grpc.StatusCode.FAILED_PRECONDITION and usage_credit.is_residue_refusal(
                details
            ):  # the node serves this client nothing for now: re-plan, not re-sync
                raise StageFailed(index, hop.node_id, f"{method}: {details}") from err
            if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                details = f"no answer within {timeout:.1f} s ({details})"
            if code in CLIENT_FAULT_CODES:
                raise RequestRejected(hop.node_id, hop.span, code, details) from err
            if code == grpc.StatusCode.FAILED_PRECONDITION:
                raise StageOutOfSync(index, hop.node_id, f"{method}: {details}") from err
            raise StageFailed(index, hop.node_id, f"{method}: {code.name}: {details}") from err
        self.deadlines.answered(hop.node_id, method, time.monotonic() - began)
        return reply

    def _split(
        self, input_ids: np.ndarray, labels: np.ndarray
    ) -> list[tuple[np.ndarray, np.ndarray]]:
        ids, targets = np.asarray(input_ids), np.asarray(labels)
        for name, array in (("input_ids", ids), ("labels", targets)):
            if array.ndim != 2 or not np.issubdtype(array.dtype, np.integer):
                raise ValueError(
                    f"{name} must be integers [batch, seq], got {array.dtype} {list(array.shape)}"
                )
        if ids.shape != targets.shape:
            raise ValueError(f"labels {list(targets.shape)} must match input_ids {list(ids.shape)}")
        count = self.hyper.micro_batches
        if ids.shape[0] % count:
            raise ValueError(
                f"a batch of {ids.shape[0]} sequences does not split into {count} equal "
                "micro-batches; use a batch size that is a multiple of micro_batches"
            )
        parts = zip(
            np.split(ids.astype(np.int64), count),
            np.split(targets.astype(np.int64), count),
            strict=True,
        )
        result = list(parts)
        empty = [i for i, (_, t) in enumerate(result) if not (t != IGNORE_INDEX).any()]
        if empty:
            raise ValueError(
                f"micro-batches {empty} have no label to learn from (all {IGNORE_INDEX})"
            )
        return result


def clip_coefficient(total_sq_norm: float, max_norm: float) -> float:
    """The scale global-norm clipping applies, exactly as torch's clip_grad_norm_ does
    (and node_agent.runtime.training.clip_scale, which a one-process run uses)."""
    if max_norm <= 0:
        return 1.0
    return min(1.0, max_norm / (math.sqrt(total_sq_norm) + 1e-6))


async def _all_or_cancel(coros: list[Awaitable[T]]) -> list[T]:
    """Run together; on the first failure cancel the rest and raise that failure."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


async def _cancelled(task: asyncio.Future[Any]) -> None:
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


def _checker_stages(hops: list[TrainingHop], checkers: list[TrainingHop]) -> dict[int, TrainingHop]:
    """Stage index -> its checker; a checker must cover one stage's layers exactly and
    must not be a node of the pipeline (it would check itself, or hold two states)."""
    spans = {(h.start, h.end): i for i, h in enumerate(hops)}
    pipeline = {h.node_id for h in hops}
    stages: dict[int, TrainingHop] = {}
    for checker in checkers:
        index = spans.get((checker.start, checker.end))
        if index is None:
            raise ValueError(f"checker {checker.node_id} covers {checker.span}, no stage's layers")
        if checker.node_id in pipeline:
            raise ValueError(f"checker {checker.node_id} is a node of the pipeline itself")
        if index in stages:
            raise ValueError(f"two checkers for stage {index} {checker.span}")
        stages[index] = checker
    return stages


def _check_hops(hops: list[TrainingHop]) -> None:
    if not hops:
        raise ValueError("a training pipeline needs at least one hop")
    if hops[0].start != 0:
        raise ValueError(f"the first hop must start at layer 0, not {hops[0].start}")
    for before, after in zip(hops, hops[1:], strict=False):
        if after.start != before.end:
            raise ValueError(
                f"hops must tile the layers: {before.span} is followed by {after.span}"
            )
    empty = [h.span for h in hops if h.start >= h.end]
    if empty:
        raise ValueError(f"hops with no layers: {', '.join(empty)}")
