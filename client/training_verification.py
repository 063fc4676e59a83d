"""Driver-side checks of training replies: every ForwardTrain and BackwardTrain answer
must be signed by the node the coordinator granted that stage.

The key comes from the job session's capability (each grant carries the node's
``public_key``, filled in by the coordinator's verifier), so it is as trustworthy as the
coordinator's own signature. The node signs ``protos.identity.training_payload``: the
pass, job, step, micro-batch, layers, the digest of the tensors it was sent and the
sha256 of what it answers. A reply that is unsigned, signed by another key, signed over
another input or another output is a failure of that node: the driver raises
``StageFailed`` and the job runner re-plans the stage, exactly as if the node had died.
A *signed* reply that is wrong is proof against its node (see docs/verification.md for
what is and is not checked yet).
"""

from __future__ import annotations

import hashlib
import logging
import random
from dataclasses import dataclass, field
from typing import Any

from protos import identity, output_check, training_answers
from protos.tessera.v1 import client_api_pb2, training_pb2, verification_pb2
from protos.training_answers import KIND

log = logging.getLogger(__name__)


class BadTrainingSignature(Exception):
    """The reply cannot be attributed to the granted node; the message says why."""


class TrainingReplyChecker:
    """Checks the signatures of one job's training replies against its capability."""

    def __init__(self, capability: client_api_pb2.SignedCapability) -> None:
        self._keys: dict[str, bytes] = {}
        self.keyed = False
        self.checked = 0
        self.update(capability)

    def update(self, capability: client_api_pb2.SignedCapability) -> None:
        """Read the node keys of a (new) session capability, e.g. after a re-plan."""
        claims = client_api_pb2.CapabilityClaims()
        claims.ParseFromString(capability.claims)
        self._keys = {g.node_id: bytes(g.public_key) for g in claims.grants}
        # The coordinator's per-node check probability (its reputation: 1 for a new or
        # recently failed node, falling as verified results accumulate).
        self.check_probability = {g.node_id: g.check_probability for g in claims.grants}
        self.keyed = any(self._keys.values())
        if not self.keyed:
            # A coordinator without a verifier component grants no keys: nothing to check
            # against. Say so loudly rather than pretend the replies were verified.
            log.warning("the job's capability carries no node keys: training replies go unverified")

    def forward(
        self,
        node_id: str,
        start: int,
        end: int,
        job_id: str,
        request: training_pb2.TrainForwardRequest,
        reply: training_pb2.TrainForwardResponse,
    ) -> None:
        if reply.HasField("output"):
            payload = reply.output.data
        else:
            payload = identity.training_loss_bytes(reply.loss, reply.label_tokens)
        labels = request.labels if request.HasField("labels") else None
        sent = output_check.tensor_digest(request.input, labels)
        self._check("forward", node_id, start, end, job_id, request, reply, payload, sent)

    def backward(
        self,
        node_id: str,
        start: int,
        end: int,
        job_id: str,
        request: training_pb2.TrainBackwardRequest,
        reply: training_pb2.TrainBackwardResponse,
    ) -> None:
        grad = request.grad_output if request.HasField("grad_output") else None
        sent = output_check.tensor_digest(grad)
        self._check(
            "backward", node_id, start, end, job_id, request, reply, reply.grad_input.data, sent
        )

    def norm(
        self,
        node_id: str,
        start: int,
        end: int,
        job_id: str,
        request: training_pb2.GradNormRequest,
        reply: training_pb2.GradNormResponse,
    ) -> None:
        value = identity.training_norm_bytes(reply.sq_norm, reply.finite)
        self._check_scalar("norm", node_id, start, end, job_id, request.step, reply, value)

    def optimizer_step(
        self,
        node_id: str,
        start: int,
        end: int,
        job_id: str,
        request: training_pb2.OptimizerStepRequest,
        reply: training_pb2.OptimizerStepResponse,
    ) -> None:
        value = identity.training_step_bytes(request.clip_coef, reply.step)
        self._check_scalar("step", node_id, start, end, job_id, request.step, reply, value)

    def _check_scalar(
        self,
        pass_name: str,
        node_id: str,
        start: int,
        end: int,
        job_id: str,
        step: int,
        reply: training_pb2.GradNormResponse | training_pb2.OptimizerStepResponse,
        value: bytes,
    ) -> None:
        if not self.keyed:
            return
        key = self._keys.get(node_id, b"")
        if not key:
            raise BadTrainingSignature(f"the job's capability carries no key for node {node_id}")
        signed = identity.training_payload(
            pass_name, job_id, step, 0, start, end, hashlib.sha256(value).digest(), b""
        )
        if not reply.signature or not identity.verify(key, reply.signature, signed):
            raise BadTrainingSignature(
                f"node {node_id} sent a {pass_name} reply that is unsigned or whose "
                "signature does not verify"
            )
        self.checked += 1

    def _check(
        self,
        pass_name: str,
        node_id: str,
        start: int,
        end: int,
        job_id: str,
        request: training_pb2.TrainForwardRequest | training_pb2.TrainBackwardRequest,
        reply: training_pb2.TrainForwardResponse | training_pb2.TrainBackwardResponse,
        payload: bytes,
        sent_digest: bytes,
    ) -> None:
        if not self.keyed:
            return
        key = self._keys.get(node_id, b"")
        if not key:
            raise BadTrainingSignature(f"the job's capability carries no key for node {node_id}")
        if not reply.signature:
            raise BadTrainingSignature(f"node {node_id} sent an unsigned {pass_name} reply")
        if reply.step != request.step or reply.micro_batch != request.micro_batch:
            raise BadTrainingSignature(
                f"node {node_id} answered step {reply.step} micro-batch {reply.micro_batch} "
                f"to a {pass_name} of step {request.step} micro-batch {request.micro_batch}"
            )
        if reply.input_digest != sent_digest:
            # The node signed over another input than the one this driver sent.
            raise BadTrainingSignature(
                f"node {node_id} signed its {pass_name} reply over another input"
            )
        output_sha256 = hashlib.sha256(payload).digest()
        signed = identity.training_payload(
            pass_name, job_id, request.step, request.micro_batch, start, end,
            output_sha256, sent_digest,
        )  # fmt: skip
        if not identity.verify(key, reply.signature, signed):
            raise BadTrainingSignature(
                f"node {node_id} sent a {pass_name} reply whose signature does not verify"
            )
        self.checked += 1


class ShadowMismatch(Exception):
    """A stage's signed answer disagrees with its lockstep shadow's.

    ``restore_at_most``: the newest checkpoint step still vouched for. A shadow that kept
    its own weights across checkpoints shows that the checkpoints the primary uploaded
    since the shadow's anchor may carry the primary's tampering (a skipped or wrong
    optimizer step right before a checkpoint), so the job must not restore a newer one.
    """

    def __init__(self, message: str, restore_at_most: int) -> None:
        super().__init__(message)
        self.restore_at_most = restore_at_most


@dataclass
class ShadowStats:
    checks: int = 0  # compared answers (forward, backward, gradient norm)
    mismatches: int = 0
    intervals: int = 0  # checkpoint intervals a shadow trained in lockstep
    reopened: int = 0  # shadows (re-)opened from a checkpoint or fresh
    errors: list[float] = field(default_factory=list)  # relative error of each check


# What a shadow does in the current checkpoint interval.
OFF = "off"  # nothing: not sampled (or dropped)
LOCKSTEP = "lockstep"  # every call of the stage: forward, backward, GradNorm, OptimizerStep
FORWARD = "forward"  # only the forwards of one step (right after a lockstep interval)


@dataclass
class Shadow:
    node_id: str
    start: int
    end: int
    mode: str = OFF
    version: int = -1  # the step the shadow's own training state is at
    anchor: int = 0  # the checkpoint step its state descends from (checked since)
    continued: bool = False  # kept its own weights into this interval (not re-opened)
    interval_start: int = 0
    interval_sha256: str = ""  # of the stage's checkpoint part the interval starts at
    anchor_sha256: str = ""  # of the checkpoint part at ``anchor`` ("" at step 0)
    # Every call both nodes answered since ``anchor``, signed: a dispute's evidence.
    log: list[verification_pb2.TrainingCall] = field(default_factory=list)
    disputed: bool = False  # a mismatch is being arbitrated: no more calls, one dispute


class ShadowChecks:
    """Sampled lockstep training on independent "shadow" replicas of some stages.

    Per checkpoint interval and per stage with a checker, the driver draws (with the
    primary's check probability; the primary cannot see the draw) whether the shadow
    trains in lockstep through the interval: it gets the very same ForwardTrain,
    BackwardTrain, GradNorm and OptimizerStep (same clip coefficient) as the primary, and
    every answer is compared. A shadow that stays in lockstep across a checkpoint keeps
    its own weights; otherwise it re-opens from the checkpoint at the next sampled
    interval. After a sampled interval that the next does not continue, the shadow still
    checks the forwards of the next step, which catches a wrong or skipped optimizer step
    at the end of the interval. See docs/verification.md.
    """

    def __init__(
        self,
        checkers: dict[int, tuple[str, int, int]],
        probability: float | None,
        seed: int | None = None,
    ) -> None:
        """``probability``: one fraction for every stage, or None for each primary's own
        (given to ``sample`` from the capability)."""
        if probability is not None and not 0.0 <= probability <= 1.0:
            raise ValueError(f"check probability must be in [0, 1], got {probability}")
        self.probability = probability
        self.stats = ShadowStats()
        self._rng = random.Random(seed)
        self.shadows: dict[int, Shadow] = {}
        self.replace(checkers)

    @property
    def checkers(self) -> dict[int, tuple[str, int, int]]:
        return {i: (s.node_id, s.start, s.end) for i, s in self.shadows.items()}

    def replace(self, checkers: dict[int, tuple[str, int, int]]) -> None:
        """A new session's checkers: every shadow starts over (opened at the next open)."""
        self.shadows = {i: Shadow(*c) for i, c in checkers.items()}

    def drop(self, index: int, why: str) -> None:
        """A checker that fails stops checking; it never fails the primary's job."""
        if self.shadows.pop(index, None) is not None:
            log.warning("shadow check of training stage %d disabled: %s", index, why)

    def sample(self, node_probability: float) -> bool:
        p = node_probability if self.probability is None else self.probability
        return self._rng.random() < p

    def start_interval(
        self, index: int, step: int, sampled: bool, *, rolled_back: bool, sha256: str = ""
    ) -> bool:
        """A checkpoint interval begins at ``step`` (the stage's part: ``sha256``); True
        when the caller must (re-)open the shadow from that checkpoint (then ``opened``)."""
        shadow = self.shadows[index]
        shadow.interval_sha256 = sha256
        continuing = not rolled_back and shadow.mode == LOCKSTEP and shadow.version == step
        shadow.continued = continuing
        shadow.interval_start = step
        if sampled:
            self.stats.intervals += 1
            if continuing:
                return False  # keeps its own weights: never the primary's upload
            shadow.mode = OFF
            return True
        shadow.mode = FORWARD if continuing else OFF
        return False

    def opened(self, index: int, step: int) -> None:
        shadow = self.shadows[index]
        shadow.mode, shadow.version, shadow.anchor = LOCKSTEP, step, step
        shadow.anchor_sha256 = shadow.interval_sha256
        shadow.log, shadow.disputed = [], False
        self.stats.reopened += 1

    def active(self, index: int, step: int, kind: str) -> Shadow | None:
        """The shadow that takes this call of stage ``index`` at ``step``, if any."""
        shadow = self.shadows.get(index)
        if shadow is None or shadow.version != step or shadow.disputed:
            return None
        if shadow.mode == LOCKSTEP or (shadow.mode == FORWARD and kind == "forward"):
            return shadow
        return None

    def passes_done(self, step: int) -> None:
        """Every forward and backward of ``step`` agreed: a continued shadow now vouches
        for the checkpoint its interval began at; a forward-only shadow stops."""
        for shadow in self.shadows.values():
            if shadow.version != step or not shadow.continued:
                continue
            if shadow.interval_start == step:
                shadow.anchor, shadow.anchor_sha256 = step, shadow.interval_sha256
                shadow.log = [c for c in shadow.log if c.step >= step]
            if shadow.mode == FORWARD:
                shadow.mode = OFF

    def stepped(self, index: int, step: int) -> None:
        shadow = self.shadows.get(index)
        if shadow is not None and shadow.mode == LOCKSTEP and shadow.version == step:
            shadow.version = step + 1

    # ---- comparisons ---------------------------------------------------------------

    def compare(
        self, index: int, primary_node: str, kind: int, reply: TrainingReply, shadow: TrainingReply
    ) -> None:
        """Raise ShadowMismatch unless both answers agree within the fp32 tolerance."""
        mine, theirs = full_answer(reply), full_answer(shadow)
        if kind == KIND.BACKWARD and not (mine.HasField("output") or theirs.HasField("output")):
            return  # the first stage answers no input gradient: nothing to compare
        what = {
            KIND.FORWARD: "forward output" if mine.HasField("output") else "loss",
            KIND.BACKWARD: "input gradient",
            KIND.NORM: "squared gradient norm",
        }[kind]
        self._judge(index, primary_node, what, training_answers.answer_error(kind, mine, theirs))

    def _judge(self, index: int, primary_node: str, what: str, error: float) -> None:
        """Raise ShadowMismatch unless the error is within the fp32 tolerance."""
        self.stats.checks += 1
        self.stats.errors.append(error)
        tol = training_answers.tolerance()
        if error <= tol:
            return
        self.stats.mismatches += 1
        shadow = self.shadows[index]
        raise ShadowMismatch(
            f"{what} of node {primary_node} differs from the independent replica "
            f"{shadow.node_id}'s by a relative error of {error:.3g} (tolerance {tol:g})",
            shadow.anchor,
        )


# ---- evidence for the coordinator ---------------------------------------------------------

TrainingReply = training_answers.TrainingReply


def answer_bytes(kind: int, request: object, reply: TrainingReply) -> bytes:
    """The bytes a node's signature hashes for this answer (see the node's _sign)."""
    if kind == KIND.OPTIMIZER_STEP:
        assert isinstance(request, training_pb2.OptimizerStepRequest)
        return identity.training_step_bytes(request.clip_coef, reply.step)
    return training_answers.answer_bytes(kind, full_answer(reply))


def signed_reply(
    node_id: str, kind: int, request: object, reply: TrainingReply
) -> verification_pb2.SignedTrainingReply:
    return verification_pb2.SignedTrainingReply(
        node_id=node_id,
        input_digest=getattr(reply, "input_digest", b""),
        output_sha256=hashlib.sha256(answer_bytes(kind, request, reply)).digest(),
        signature=reply.signature,
    )


def logged_call(
    kind: int,
    request: Any,
    primary: tuple[str, TrainingReply],
    checker: tuple[str, TrainingReply],
) -> verification_pb2.TrainingCall:
    """One call both nodes answered, with what each signed: an entry of a dispute's log."""
    call = verification_pb2.TrainingCall(
        kind=kind,  # type: ignore[arg-type]
        step=request.step,
        primary=signed_reply(primary[0], kind, request, primary[1]),
        checker=signed_reply(checker[0], kind, request, checker[1]),
    )
    if kind == KIND.FORWARD:
        call.micro_batch = request.micro_batch
        call.input.CopyFrom(request.input)
        if request.HasField("labels"):
            call.labels.CopyFrom(request.labels)
    elif kind == KIND.BACKWARD:
        call.micro_batch = request.micro_batch
        if request.HasField("grad_output"):
            call.input.CopyFrom(request.grad_output)
    elif kind == KIND.OPTIMIZER_STEP:
        call.clip_coef = request.clip_coef
    return call


full_answer = training_answers.answer_of  # the coordinator builds arbiters' the same way
