"""Checking what a verification report claims before anything is believed.

Only signed node outputs are evidence. A comparison is accepted when both outputs carry a
valid signature of a node the session's capability grants those layers, with the key the
coordinator itself put in that capability; both nodes computed on the same input prefix
(equal signed input digests); and the two nodes belong to different operators. A mismatch
must also carry both outputs (matching their signed hashes) and the input prefix (hashing
to the signed input digest), and the outputs must really differ beyond the tolerance.
Whatever fails here is refused with a status and a message, and changes nothing.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import grpc
import numpy as np

from coordinator.refusal import Refusal
from protos import codec, identity, output_check
from protos.tessera.v1 import client_api_pb2, common_pb2, verification_pb2

MAX_COMPARISONS = 4096
MAX_AUDITS = 4096
MAX_MISMATCHES = 4
MAX_NODE_CALLS = 1024
DIGEST_BYTES = output_check.DIGEST_BYTES


class ReportError(Refusal):
    """A verification report refused, with the gRPC status its caller gets."""


@dataclass(frozen=True)
class Mismatch:
    """A validated mismatch: everything the arbiter needs, decoded."""

    comparison: verification_pb2.Comparison
    primary: client_api_pb2.Hop
    checker: client_api_pb2.Hop
    primary_output: np.ndarray
    checker_output: np.ndarray
    error: float
    tolerance: float


def signature_key(signature: bytes) -> str:
    return hashlib.sha256(signature).hexdigest()


def evidence_id(comparison: verification_pb2.Comparison) -> str:
    return hashlib.sha256(comparison.primary.signature + comparison.checker.signature).hexdigest()


def check_limits(report: verification_pb2.VerificationReport) -> None:
    if len(report.comparisons) > MAX_COMPARISONS:
        raise ReportError(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"{len(report.comparisons)} comparisons in one report; send at most "
            f"{MAX_COMPARISONS} per report",
        )
    if len(report.audits) > MAX_AUDITS:
        raise ReportError(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"{len(report.audits)} audits in one report; send at most {MAX_AUDITS} per report",
        )
    mismatches = sum(not c.agreed for c in report.comparisons)
    if mismatches > MAX_MISMATCHES:
        raise ReportError(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"{mismatches} mismatches in one report; send at most {MAX_MISMATCHES}",
        )
    if len(report.calls) > MAX_NODE_CALLS:
        raise ReportError(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"call counts for {len(report.calls)} nodes; a session has at most {MAX_NODE_CALLS}",
        )
    for entry in report.calls:
        if entry.checked > entry.calls:
            raise ReportError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"node {entry.node_id[:64]!r}: {entry.checked} checked of {entry.calls} calls",
            )


def check_comparison(
    claims: client_api_pb2.CapabilityClaims, comparison: verification_pb2.Comparison
) -> tuple[client_api_pb2.Hop, client_api_pb2.Hop]:
    """The two nodes' grants, once both signatures and the pairing are proven sound."""
    p, c = comparison.primary, comparison.checker
    if not p.node_id or not c.node_id or p.node_id == c.node_id:
        raise ReportError(
            grpc.StatusCode.INVALID_ARGUMENT,
            "a comparison needs two different nodes (primary and checker)",
        )
    if (p.layers.start, p.layers.end) != (c.layers.start, c.layers.end) or p.step != c.step:
        raise ReportError(
            grpc.StatusCode.INVALID_ARGUMENT,
            "the two outputs of a comparison must be for the same step and layers",
        )
    _check_digests(p, c)
    if p.input_digest != c.input_digest:
        raise ReportError(
            grpc.StatusCode.INVALID_ARGUMENT,
            "the two nodes signed for different input histories; their outputs are not comparable",
        )
    return _signed_pair(claims, p, c)


def check_audit(
    claims: client_api_pb2.CapabilityClaims, audit: verification_pb2.AuditAgreement
) -> None:
    """An audit's two signed answers are sound: two nodes of different operators, the
    same layers, the checker's catch-up no earlier than the primary's step, and both
    signatures those of nodes the session's capability grants these layers."""
    p, c = audit.primary, audit.checker
    if not p.node_id or not c.node_id or p.node_id == c.node_id:
        raise ReportError(
            grpc.StatusCode.INVALID_ARGUMENT,
            "an audit needs two different nodes (primary and checker)",
        )
    if (p.layers.start, p.layers.end) != (c.layers.start, c.layers.end) or c.step < p.step:
        raise ReportError(
            grpc.StatusCode.INVALID_ARGUMENT,
            "an audit's catch-up answer must be for the primary's layers, at its step or later",
        )
    _check_digests(p, c)
    _signed_pair(claims, p, c)


def _check_digests(*outputs: verification_pb2.SignedOutput) -> None:
    for signed in outputs:
        if len(signed.input_digest) != DIGEST_BYTES or len(signed.output_sha256) != DIGEST_BYTES:
            raise ReportError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"node {signed.node_id[:64]!r}: input and output digests have 32 bytes each",
            )


def _signed_pair(
    claims: client_api_pb2.CapabilityClaims,
    p: verification_pb2.SignedOutput,
    c: verification_pb2.SignedOutput,
) -> tuple[client_api_pb2.Hop, client_api_pb2.Hop]:
    """Both nodes' grants, once both signatures verify and the nodes are independent."""
    grants = [_grant(claims, signed) for signed in (p, c)]
    for signed, grant in zip((p, c), grants, strict=True):
        payload = identity.output_payload(
            claims.session_id,
            signed.step,
            signed.layers.start,
            signed.layers.end,
            signed.output_sha256,
            input_digest=signed.input_digest,
        )
        # A checker's catch-up answer comes with every step it audits: verified once.
        if not identity.verify_repeated(grant.public_key, signed.signature, payload):
            raise ReportError(
                grpc.StatusCode.PERMISSION_DENIED,
                f"the signature of node {signed.node_id} does not verify for this session, "
                "step and layers: the evidence is forged or corrupted",
            )
    if grants[0].account and grants[0].account == grants[1].account:
        raise ReportError(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"nodes {p.node_id} and {c.node_id} belong to one operator ({grants[0].account!r}); "
            "they cannot check each other",
        )
    return grants[0], grants[1]


def check_mismatch(
    comparison: verification_pb2.Comparison,
    primary: client_api_pb2.Hop,
    checker: client_api_pb2.Hop,
) -> Mismatch:
    outputs = []
    for signed in (comparison.primary, comparison.checker):
        if not signed.HasField("output"):
            raise ReportError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"a mismatch must carry node {signed.node_id}'s output",
            )
        if hashlib.sha256(signed.output.data).digest() != signed.output_sha256:
            raise ReportError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"node {signed.node_id}'s output does not hash to what it signed",
            )
        outputs.append(_decode(signed.output, f"node {signed.node_id}'s output"))
    if not comparison.HasField("input"):
        raise ReportError(
            grpc.StatusCode.INVALID_ARGUMENT, "a mismatch must carry the compared call's input"
        )
    tensors = [*comparison.prefix, comparison.input]
    chunks = [(_decode(t, "an input chunk"), t.dtype) for t in tensors]
    if not all(a.ndim >= 2 and a.shape[0] == chunks[0][0].shape[0] for a, _ in chunks):
        raise ReportError(
            grpc.StatusCode.INVALID_ARGUMENT,
            "input chunks must be [batch, tokens, ...] with one batch size",
        )
    if output_check.prefix_digest(chunks) != comparison.primary.input_digest:
        raise ReportError(
            grpc.StatusCode.INVALID_ARGUMENT,
            "the input prefix does not hash to the digest both nodes signed: it is not the "
            "history they computed on",
        )
    p_out, c_out = comparison.primary.output, comparison.checker.output
    error = output_check.relative_error(outputs[0], p_out.dtype, outputs[1], c_out.dtype)
    layers = comparison.primary.layers
    tolerance = output_check.pair_tolerance(
        (primary.device_kind, primary.compute_dtype),
        (checker.device_kind, checker.compute_dtype),
        layers=layers.end - layers.start,
    )
    if error <= tolerance:
        raise ReportError(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"the two outputs agree within the tolerance ({error:.3g} <= {tolerance:.3g}); "
            "report it as an agreement",
        )
    return Mismatch(comparison, primary, checker, outputs[0], outputs[1], error, tolerance)


def _grant(
    claims: client_api_pb2.CapabilityClaims, signed: verification_pb2.SignedOutput
) -> client_api_pb2.Hop:
    start, end = signed.layers.start, signed.layers.end
    # A merged hop's span is granted as consecutive stages: together they must cover it
    # without a gap (as the node itself requires before it computes).
    mine = sorted(
        (g for g in claims.grants if g.node_id == signed.node_id and g.public_key),
        key=lambda g: g.layers.start,
    )
    covered = start
    for grant in mine:
        if grant.layers.start <= covered < grant.layers.end:
            covered = grant.layers.end
    if mine and start < end <= covered:
        return mine[0]
    raise ReportError(
        grpc.StatusCode.PERMISSION_DENIED,
        f"node {signed.node_id[:64]!r} was not granted layers [{start}, {end}) in this session",
    )


def _decode(tensor: common_pb2.Tensor, name: str) -> np.ndarray:
    try:
        return codec.decode(tensor, finite=False, name=name)
    except codec.TensorError as err:
        raise ReportError(grpc.StatusCode.INVALID_ARGUMENT, str(err)) from err
