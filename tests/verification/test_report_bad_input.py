"""Verification reports over real gRPC against an in-process coordinator: hostile input.

Forged, unsigned and replayed reports are refused with the right status, the process
keeps serving, and no report can get an honest node blamed: only outputs a node really
signed, on an input history that hashes to what it signed, count as evidence.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
import numpy as np
import pytest
from support.coordinator_harness import Harness

from coordinator.verifier.evidence import MAX_COMPARISONS, MAX_MISMATCHES
from coordinator.verifier.service import FraudProven, WorkRejected
from protos import codec, identity, output_check
from protos.tessera.v1 import (
    client_api_pb2,
    common_pb2,
    verification_pb2,
    verification_pb2_grpc,
)

LAYERS = (0, 4)
PREFIX = np.array([[5, 6, 7]], dtype=np.int64)
INPUT = np.array([[8]], dtype=np.int64)


@dataclass
class Node:
    name: str
    account: str
    key: object = field(default_factory=identity.generate_private_key)

    @property
    def public_key(self) -> bytes:
        return identity.public_key_bytes(self.key)  # type: ignore[arg-type]

    @property
    def node_id(self) -> str:
        return identity.node_id(self.public_key)

    def sign(
        self,
        session_id: str,
        step: int,
        output: np.ndarray,
        digest: bytes | None = None,
        layers: tuple[int, int] = LAYERS,
    ) -> verification_pb2.SignedOutput:
        tensor = codec.encode(output.astype(np.float32))
        digest = digest or output_check.prefix_digest([(PREFIX, "int64"), (INPUT, "int64")])
        out_hash = hashlib.sha256(tensor.data).digest()
        payload = identity.output_payload(session_id, step, *layers, out_hash, input_digest=digest)
        return verification_pb2.SignedOutput(
            node_id=self.node_id,
            step=step,
            layers=common_pb2.LayerRange(start=layers[0], end=layers[1]),
            input_digest=digest,
            output_sha256=out_hash,
            signature=self.key.sign(payload),  # type: ignore[attr-defined]
            output=tensor,
        )


@dataclass
class Session:
    harness: Harness
    session_id: str
    capability: client_api_pb2.SignedCapability
    stub: verification_pb2_grpc.VerificationStub

    async def report(self, *comparisons: verification_pb2.Comparison, **kw: object) -> object:
        request = verification_pb2.VerificationReport(
            session_id=kw.pop("session_id", self.session_id),  # type: ignore[arg-type]
            capability=kw.pop("capability", self.capability),  # type: ignore[arg-type]
            comparisons=comparisons,
            **kw,  # type: ignore[arg-type]
        )
        return await self.stub.Report(request, timeout=30)


def open_session(harness: Harness, nodes: list[Node], session_id: str = "s-test") -> Session:
    now = int(time.time() * 1000)
    claims = client_api_pb2.CapabilityClaims(
        session_id=session_id,
        model="tiny",
        grants=[
            client_api_pb2.Hop(
                node_id=n.node_id,
                layers=common_pb2.LayerRange(start=LAYERS[0], end=LAYERS[1]),
                public_key=n.public_key,
                account=n.account,
                device_kind="cpu",
                compute_dtype="float32",
            )
            for n in nodes
        ],
        issued_unix_ms=now,
        expires_unix_ms=now + 600_000,
        max_tokens=64,
    )
    capability = identity.sign_capability(harness.ctx.signing_key, claims)
    stub = verification_pb2_grpc.VerificationStub(harness.channel)
    return Session(harness, session_id, capability, stub)


def agreement(session: Session, a: Node, b: Node, step: int) -> verification_pb2.Comparison:
    out = np.full((1, 1, 8), 0.5, dtype=np.float32)
    primary, checker = a.sign(session.session_id, step, out), b.sign(session.session_id, step, out)
    primary.ClearField("output")
    checker.ClearField("output")
    return verification_pb2.Comparison(primary=primary, checker=checker, agreed=True)


def mismatch(
    session: Session, a: Node, b: Node, step: int, *, prefix: np.ndarray = PREFIX
) -> verification_pb2.Comparison:
    rng = np.random.default_rng(step)
    return verification_pb2.Comparison(
        primary=a.sign(session.session_id, step, rng.normal(size=(1, 1, 8))),
        checker=b.sign(session.session_id, step, rng.normal(size=(1, 1, 8))),
        agreed=False,
        prefix=[codec.encode(prefix, "int64")],
        input=codec.encode(INPUT, "int64"),
    )


@pytest.fixture
async def setup(start_harness) -> tuple[Harness, Session, dict[str, Node], list[object]]:
    harness = await start_harness(canary_interval_s=0.0)
    nodes = {
        "x": Node("x", "op-x"),
        "y": Node("y", "op-y"),
        "y2": Node("y2", "op-y"),  # same operator as y
    }
    session = open_session(harness, list(nodes.values()))
    events: list[object] = []
    harness.ctx.verifier.add_listener(events.append)
    return harness, session, nodes, events


async def expect(code: grpc.StatusCode, call: Callable[[], object], match: str) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call()  # type: ignore[misc]
    assert info.value.code() == code, info.value.details()
    assert match in (info.value.details() or ""), info.value.details()


async def test_an_honest_agreement_counts_once(setup) -> None:
    harness, session, nodes, _ = setup
    x, y = nodes["x"], nodes["y"]
    comparison = agreement(session, x, y, 1)
    calls = [verification_pb2.NodeCalls(node_id=x.node_id, calls=10, checked=1)]
    verdict = await session.report(comparison, calls=calls)
    assert verdict.risk.calls == 10 and verdict.risk.checked == 1
    assert verdict.risk.detection_probability == pytest.approx(1 - (1 - 0.1 * 0.05) ** 10)
    reputation = harness.ctx.verifier.reputation
    assert reputation.record(x.node_id).consecutive == 1
    # The same signed outputs again: a replay, refused, and nothing counted twice.
    await expect(grpc.StatusCode.ALREADY_EXISTS, lambda: session.report(comparison), "already")
    assert reputation.record(x.node_id).consecutive == 1
    risk = await session.stub.GetSessionRisk(
        verification_pb2.SessionRiskRequest(
            session_id=session.session_id, capability=session.capability
        )
    )
    assert risk.calls == 10


async def test_forged_capabilities_are_refused(setup) -> None:
    _, session, nodes, _ = setup
    comparison = agreement(session, nodes["x"], nodes["y"], 1)
    stranger = identity.generate_private_key()
    forged = identity.sign_capability(
        stranger, client_api_pb2.CapabilityClaims.FromString(session.capability.claims)
    )
    await expect(
        grpc.StatusCode.UNAUTHENTICATED,
        lambda: session.report(comparison, capability=forged),
        "not signed by this coordinator",
    )
    await expect(
        grpc.StatusCode.PERMISSION_DENIED,
        lambda: session.report(comparison, session_id="s-other"),
        "another session",
    )
    garbage = client_api_pb2.SignedCapability(claims=b"\xff" * 40, signature=b"\x00" * 64)
    await expect(
        grpc.StatusCode.UNAUTHENTICATED,
        lambda: session.report(comparison, capability=garbage),
        "not signed",
    )


async def test_unsigned_and_forged_outputs_are_refused(setup) -> None:
    harness, session, nodes, events = setup
    x, y = nodes["x"], nodes["y"]
    unsigned = agreement(session, x, y, 2)
    unsigned.primary.signature = b""
    await expect(grpc.StatusCode.PERMISSION_DENIED, lambda: session.report(unsigned), "forged")
    # y signs an output in x's name: it does not verify with x's key.
    framed = mismatch(session, x, y, 3)
    fake = y.sign(session.session_id, 3, np.zeros((1, 1, 8)))
    fake.node_id = x.node_id
    framed.primary.CopyFrom(fake)
    await expect(grpc.StatusCode.PERMISSION_DENIED, lambda: session.report(framed), "forged")
    # A node the session never granted.
    outsider = Node("o", "op-o")
    await expect(
        grpc.StatusCode.PERMISSION_DENIED,
        lambda: session.report(agreement(session, outsider, y, 4)),
        "not granted",
    )
    assert harness.ctx.verifier.reputation.record(x.node_id).failures == 0
    assert not events


async def test_a_rival_cannot_get_an_honest_node_banned(setup) -> None:
    harness, session, nodes, events = setup
    x, y = nodes["x"], nodes["y"]
    # y claims x computed on another history than the one x signed for.
    lie = mismatch(session, x, y, 5, prefix=np.array([[1, 2, 3]], dtype=np.int64))
    await expect(grpc.StatusCode.INVALID_ARGUMENT, lambda: session.report(lie), "does not hash")
    # y alters x's output after x signed it.
    altered = mismatch(session, x, y, 6)
    altered.primary.output.CopyFrom(codec.encode(np.ones((1, 1, 8), dtype=np.float32)))
    await expect(grpc.StatusCode.INVALID_ARGUMENT, lambda: session.report(altered), "does not hash")
    # A genuine disagreement between x's and y's own signed outputs, but nobody
    # independent can arbitrate: no one is banned on y's word.
    verdict = await session.report(mismatch(session, x, y, 7))
    assert verdict.verdicts[0].outcome == verification_pb2.Verdict.UNRESOLVED
    assert not [e for e in events if isinstance(e, FraudProven)]
    assert [e for e in events if isinstance(e, WorkRejected)][0].node_id == x.node_id
    assert harness.state(x.node_id) is None  # never registered here, certainly not banned


async def test_nodes_of_one_operator_cannot_vouch_for_each_other(setup) -> None:
    harness, session, nodes, _ = setup
    await expect(
        grpc.StatusCode.INVALID_ARGUMENT,
        lambda: session.report(agreement(session, nodes["y"], nodes["y2"], 8)),
        "one operator",
    )
    assert harness.ctx.verifier.reputation.record(nodes["y"].node_id).verified == 0


async def test_malformed_and_oversized_reports(setup) -> None:
    _, session, nodes, _ = setup
    x, y = nodes["x"], nodes["y"]
    same = agreement(session, x, y, 9)
    same.checker.CopyFrom(same.primary)
    await expect(grpc.StatusCode.INVALID_ARGUMENT, lambda: session.report(same), "two different")
    short = agreement(session, x, y, 10)
    short.primary.input_digest = b"abc"
    await expect(grpc.StatusCode.INVALID_ARGUMENT, lambda: session.report(short), "32 bytes")
    garbage = mismatch(session, x, y, 11)
    garbage.prefix[0].CopyFrom(common_pb2.Tensor(dtype="int64", shape=[1, 3], data=b"\x00"))
    await expect(grpc.StatusCode.INVALID_ARGUMENT, lambda: session.report(garbage), "bytes")
    too_many = [agreement(session, x, y, 100)] * (MAX_COMPARISONS + 1)
    await expect(grpc.StatusCode.RESOURCE_EXHAUSTED, lambda: session.report(*too_many), "at most")
    mismatches = [mismatch(session, x, y, 200 + i) for i in range(MAX_MISMATCHES + 1)]
    await expect(grpc.StatusCode.RESOURCE_EXHAUSTED, lambda: session.report(*mismatches), "at most")
    bad_counts = [verification_pb2.NodeCalls(node_id=x.node_id, calls=1, checked=5)]
    await expect(
        grpc.StatusCode.INVALID_ARGUMENT,
        lambda: session.report(calls=bad_counts),
        "checked of",
    )
    # Still serving, and a good report still lands.
    verdict = await session.report(agreement(session, x, y, 12))
    assert not verdict.verdicts
