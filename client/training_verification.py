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

from protos import codec, identity, output_check
from protos.tessera.v1 import client_api_pb2, training_pb2

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


class ForwardMismatch(Exception):
    """A stage's signed forward output disagrees with an independent shadow replica's."""


@dataclass
class ShadowStats:
    checks: int = 0
    mismatches: int = 0
    errors: list[float] = field(default_factory=list)  # relative L2 error of each check


class ShadowChecks:
    """Sampled redundant ForwardTrain on independent "shadow" replicas of some stages.

    A shadow is an ordinary training state, opened on the checker node from the same
    consistent checkpoint as the primary (or fresh, at step 0), so both hold identical
    weights at that version. It only ever runs forward: it never backpropagates or steps,
    so it is only comparable during the step at which it was opened. The driver therefore
    re-opens it after every open/restore and every checkpoint, and samples forward calls
    of those steps (see docs/verification.md for what that does and does not cover).
    """

    def __init__(
        self,
        checkers: dict[int, tuple[str, int, int]],
        probability: float | None,
        seed: int | None = None,
    ) -> None:
        """``probability``: one fraction for every stage, or None for each primary's own
        (given to ``should_check`` from the capability)."""
        if probability is not None and not 0.0 <= probability <= 1.0:
            raise ValueError(f"check probability must be in [0, 1], got {probability}")
        self.checkers = dict(checkers)  # stage index -> (checker node id, start, end)
        self.probability = probability
        self.stats = ShadowStats()
        self.version: dict[int, int] = {}  # stage index -> step its shadow can check
        self._rng = random.Random(seed)

    def opened(self, index: int, step: int) -> None:
        self.version[index] = step

    def drop(self, index: int, why: str) -> None:
        """A checker that fails stops checking; it never fails the primary's job."""
        if self.checkers.pop(index, None) is not None:
            log.warning("shadow check of training stage %d disabled: %s", index, why)
        self.version.pop(index, None)

    def should_check(self, index: int, step: int, node_probability: float) -> bool:
        if index not in self.checkers or self.version.get(index) != step:
            return False
        p = node_probability if self.probability is None else self.probability
        return self._rng.random() < p

    def compare(
        self,
        index: int,
        primary_node: str,
        reply: training_pb2.TrainForwardResponse,
        shadow: training_pb2.TrainForwardResponse,
    ) -> None:
        """Raise ForwardMismatch unless both outputs agree within the fp32 tolerance."""
        self.stats.checks += 1
        tol = output_check.tolerance("cpu", "float32")  # training computes in fp32
        if reply.HasField("output") or shadow.HasField("output"):
            error = output_check.relative_error(
                codec.decode(reply.output, finite=False),
                reply.output.dtype,
                codec.decode(shadow.output, finite=False),
                shadow.output.dtype,
            )
        else:
            scale = max(abs(reply.loss), abs(shadow.loss), 1e-12)
            error = abs(reply.loss - shadow.loss) / scale
            if reply.label_tokens != shadow.label_tokens:
                error = float("inf")
        self.stats.errors.append(error)
        if not error <= tol:
            self.stats.mismatches += 1
            checker = self.checkers[index][0]
            raise ForwardMismatch(
                f"forward output of node {primary_node} differs from the independent "
                f"replica {checker}'s by a relative error of {error:.3g} (tolerance {tol:g})"
            )
