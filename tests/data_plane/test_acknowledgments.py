"""A paid session's credit at a node, and Stage.Acknowledge (docs/ledger.md,
"Acknowledgments"), against a real stage server on loopback.

The node computes at most the session's credit (token positions x batch) on a layer range
past the newest receipt the client counter-signed and handed back; a client that
withholds its receipts is refused there. Every malformed, forged or misdirected
acknowledgment gets the right status, acknowledges nothing, and the node goes on serving.
"""

from __future__ import annotations

import asyncio

import grpc
import numpy as np
import pytest
from data_plane.stage_harness import (
    MODEL,
    NUM_LAYERS,
    CoordinatorKeys,
    reference_greedy,
    session_grant,
)
from data_plane.test_stage_server import PROMPT, Session, logits_of
from support.hostile import refused

from client import acknowledgments
from client.acknowledgments import Acknowledger
from client.channels import ChannelPool
from client.driver import PipelineDriver
from node_agent.receipts import UsageMeter
from protos import codec, identity, usage_credit
from protos.tessera.v1 import client_api_pb2, ledger_pb2, stage_pb2, stage_pb2_grpc

CREDIT = 8


class PaidSession(Session):
    """A raw stream of a paid session whose client key the test holds."""

    client = identity.generate_private_key()

    def capability(self, **options) -> client_api_pb2.SignedCapability:
        options.setdefault("client_key", identity.public_key_bytes(self.client))
        options.setdefault("usage_credit", CREDIT)
        return super().capability(**options)

    def countersign(
        self, usage: ledger_pb2.SignedUsage, billed: int | None = None, key=None
    ) -> ledger_pb2.SignedUsage:
        receipt = ledger_pb2.UsageReceipt.FromString(usage.receipt)
        billed = receipt.tokens if billed is None else billed
        signer = key or self.client
        return ledger_pb2.SignedUsage(
            receipt=usage.receipt,
            node_signature=usage.node_signature,
            client_signature=signer.sign(identity.usage_countersign_payload(usage.receipt, billed)),
            billed_tokens=billed,
        )

    def acknowledge(self, *usage: ledger_pb2.SignedUsage, capability=None):  # noqa: ANN201
        stub = stage_pb2_grpc.StageStub(self.channel)
        request = stage_pb2.AcknowledgeRequest(
            session_id=self.session_id,
            capability=capability or self.capability(),
            usage=list(usage),
        )
        return stub.Acknowledge(request, timeout=10)


def acknowledging_driver(keys: CoordinatorKeys, stages, client, credit: int):  # noqa: ANN001, ANN201
    """A driver of a paid session over ``stages`` (session_grant's), that acknowledges."""
    grant = session_grant(
        keys, stages, client_key=identity.public_key_bytes(client), usage_credit=credit
    )
    driver = PipelineDriver(grant, MODEL)
    channels = ChannelPool()
    driver.acks = Acknowledger(
        grant.session_id, credit, client, driver.usage, channels, lambda: driver.capability
    )
    return driver, channels, grant


async def paid_pipeline(start_node, keys: CoordinatorKeys, credit: int):  # noqa: ANN001, ANN201
    """Two nodes in a paid session of a fresh client key, and a driver that acknowledges."""
    first, second = await start_node([(0, 2)]), await start_node([(2, NUM_LAYERS)])
    stages = [(0, 2, first, []), (2, NUM_LAYERS, second, [])]
    driver, channels, grant = acknowledging_driver(
        keys, stages, identity.generate_private_key(), credit
    )
    return driver, channels, (first, second), grant


def next_token(response: stage_pb2.ForwardResponse) -> int:
    return int(np.argmax(logits_of(response)[0, -1]))


async def test_a_client_that_withholds_its_receipts_gets_no_more_than_its_credit(
    start_node, keys: CoordinatorKeys
) -> None:
    node = await start_node([(0, NUM_LAYERS)])
    session = PaidSession.open(node, keys, "s-paid")
    try:
        # 5 prompt positions, then one a step: below the credit of 8 the node computes.
        answer = await session.tokens(PROMPT, 0)
        position = len(PROMPT)
        while position < CREDIT:
            answer = await session.tokens([next_token(answer)], position)
            position += 1
        owed = ledger_pb2.UsageReceipt.FromString(answer.usage.receipt).tokens
        assert owed == CREDIT
        # At the credit: refused, with what to do, until the client acknowledges.
        details = await refused(
            session.tokens([next_token(answer)], position),
            grpc.StatusCode.FAILED_PRECONDITION,
            f"computed {CREDIT} token positions",
        )
        assert "Stage.Acknowledge" in details and "credit is 8" in details
        await session.close()

        # A new stream of the same session acknowledges the newest receipt: served again.
        session = PaidSession.open(node, keys, "s-paid")
        taken = await session.acknowledge(session.countersign(answer.usage, billed=5))
        assert list(taken.acknowledged_tokens) == [CREDIT]
        again = await session.tokens([next_token(answer)], position)
        assert again.cache_length == position + 1
        # An older receipt acknowledges nothing new (it never lowers what was taken).
        older = await session.acknowledge(session.countersign(again.usage))
        assert list(older.acknowledged_tokens) == [CREDIT + 1]
        stale = await session.acknowledge(session.countersign(answer.usage))
        assert list(stale.acknowledged_tokens) == [CREDIT + 1]
    finally:
        await session.close()


async def test_a_free_session_has_no_credit_and_nothing_to_acknowledge(
    start_node, keys: CoordinatorKeys
) -> None:
    node = await start_node([(0, NUM_LAYERS)])
    session = Session.open(node, keys, "s-free")
    try:
        answer = await session.tokens(PROMPT, 0)
        for position in range(len(PROMPT), len(PROMPT) + CREDIT):
            answer = await session.tokens([next_token(answer)], position)
        paid = PaidSession.open(node, keys, "s-free")
        await refused(
            paid.acknowledge(paid.countersign(answer.usage), capability=session.capability()),
            grpc.StatusCode.FAILED_PRECONDITION,
            "is free",
        )
        await paid.close()
    finally:
        await session.close()


async def test_hostile_acknowledgments_are_refused_and_the_node_goes_on_serving(
    start_node, keys: CoordinatorKeys
) -> None:
    node = await start_node([(0, NUM_LAYERS)])
    other = await start_node([(0, NUM_LAYERS)])
    session = PaidSession.open(node, keys, "s-paid")
    elsewhere = PaidSession.open(other, keys, "s-paid")
    try:
        answer = await session.tokens(PROMPT, 0)
        foreign = await elsewhere.tokens(PROMPT, 0)  # the same session's, at another node
        good = session.countersign(answer.usage)
        stub = stage_pb2_grpc.StageStub(session.channel)

        def bare(**fields) -> stage_pb2.AcknowledgeRequest:
            return stage_pb2.AcknowledgeRequest(session_id="s-paid", **fields)

        # Who may acknowledge: the session's capability, signed by the coordinator.
        await refused(stub.Acknowledge(bare(usage=[good])), grpc.StatusCode.UNAUTHENTICATED,
                      "must carry the session's capability")  # fmt: skip
        forged = session.capability(key=identity.generate_private_key())
        await refused(session.acknowledge(good, capability=forged),
                      grpc.StatusCode.UNAUTHENTICATED, "signature")  # fmt: skip
        await refused(
            stub.Acknowledge(stage_pb2.AcknowledgeRequest(
                session_id="x" * 100_000, capability=session.capability(), usage=[good]
            )),
            grpc.StatusCode.PERMISSION_DENIED, "not",
        )  # fmt: skip
        # Over the 64 MiB message limit: refused by gRPC before the servicer sees it.
        await refused(
            stub.Acknowledge(stage_pb2.AcknowledgeRequest(
                session_id="x" * (codec.MAX_MESSAGE_BYTES + 10), capability=session.capability(),
            )),
            grpc.StatusCode.RESOURCE_EXHAUSTED, "larger than max",
        )  # fmt: skip
        # How many: one to 64 receipts, each at most 1 KiB.
        await refused(session.acknowledge(), grpc.StatusCode.INVALID_ARGUMENT, "0 receipts")
        await refused(session.acknowledge(*[good] * 65), grpc.StatusCode.INVALID_ARGUMENT,
                      "65 receipts")  # fmt: skip
        oversized = ledger_pb2.SignedUsage(receipt=b"\x0a" + b"x" * 5000)
        await refused(session.acknowledge(oversized), grpc.StatusCode.INVALID_ARGUMENT,
                      "at most 1024")  # fmt: skip
        garbage = ledger_pb2.SignedUsage(receipt=b"\xff\xff\xff\xff")
        await refused(session.acknowledge(garbage), grpc.StatusCode.INVALID_ARGUMENT,
                      "not a UsageReceipt")  # fmt: skip
        # What: this node's own receipt, of this session, counter-signed by its client key.
        await refused(session.acknowledge(session.countersign(foreign.usage)),
                      grpc.StatusCode.UNAUTHENTICATED, "not this node's")  # fmt: skip
        stranger = identity.generate_private_key()
        await refused(session.acknowledge(session.countersign(answer.usage, key=stranger)),
                      grpc.StatusCode.UNAUTHENTICATED, "client key")  # fmt: skip
        inflated = session.countersign(answer.usage, billed=len(PROMPT) + 1)
        await refused(session.acknowledge(inflated), grpc.StatusCode.INVALID_ARGUMENT,
                      "billed tokens")  # fmt: skip
        tampered = ledger_pb2.UsageReceipt.FromString(answer.usage.receipt)
        tampered.tokens = 1  # a lower count under the node's own signature of the real one
        lowered = ledger_pb2.SignedUsage(
            receipt=tampered.SerializeToString(), node_signature=answer.usage.node_signature
        )
        await refused(session.acknowledge(session.countersign(lowered)),
                      grpc.StatusCode.UNAUTHENTICATED, "node signature")  # fmt: skip
        other_session = PaidSession.open(node, keys, "s-other")
        await refused(other_session.acknowledge(good), grpc.StatusCode.INVALID_ARGUMENT,
                      "for session 's-paid'")  # fmt: skip
        await other_session.close()

        # Nothing was acknowledged by any of them, and the session goes on.
        taken = await session.acknowledge(good)
        assert list(taken.acknowledged_tokens) == [len(PROMPT)]
        step = await session.tokens([next_token(answer)], len(PROMPT))
        assert step.cache_length == len(PROMPT) + 1
    finally:
        await session.close()
        await elsewhere.close()


@pytest.mark.parametrize("push", [True, False], ids=["pushed", "hop-by-hop"])
@pytest.mark.parametrize("when", ["alongside", "before-calls", "when-refused"])
async def test_an_honest_driver_acknowledges_as_it_goes_and_is_never_failed_over(
    start_node,
    keys: CoordinatorKeys,
    checkpoint,
    push: bool,
    when: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A credit smaller than the prompt: the prefill alone owes more than half of it, so the
    # first decode step waits for its acknowledgment; the later ones go out alongside the
    # pipeline. Without those (a slow link would have them land late), the wait before each
    # call that would otherwise reach the credit is what keeps the client from refusal.
    # Without that too (an acknowledgment lost on the way), a refused step is acknowledged
    # and sent to the same node again: no stage here has another node to fail over to.
    if when != "alongside":
        monkeypatch.setattr(Acknowledger, "noted", lambda *_: None)
    if when == "when-refused":

        async def never_before(self, hops) -> None:  # noqa: ANN001
            return None

        monkeypatch.setattr(Acknowledger, "ready", never_before)
    credit = 4
    driver, channels, (first, second), grant = await paid_pipeline(start_node, keys, credit)
    if not push:
        driver.push_off = "hop by hop, for this test"
    tokens: list[int] = []
    try:
        logits = await driver.step(PROMPT, last_only=True)
        for _ in range(12):
            tokens.append(int(np.argmax(logits[0])))
            logits = await driver.step([tokens[-1]], last_only=True)
        assert tokens == reference_greedy(checkpoint, PROMPT, 12)
        if when == "when-refused":  # the same node again each time, never a replay
            assert driver.failovers and {e.via for e in driver.failovers} == {"resume"}
            assert all(e.replacement_node_ids == (e.failed_node_id,) for e in driver.failovers)
        else:
            assert not driver.failovers, driver.failovers
        assert driver.acks.sent >= 12 // credit and driver.acks.failed == 0
        # What each node still counts unacknowledged stays under the credit (or reaches it,
        # and no further, where only a refusal brings the acknowledgment).
        most = credit if when == "when-refused" else credit - 1
        for node, (start, end) in ((first, (0, 2)), (second, (2, NUM_LAYERS))):
            assert node.servicer._usage.owed(grant.session_id, start, end) <= most
        await driver.close()
        # The end of the session hands each node its newest receipt: what it settles
        # (its coordinator is unreachable here, so it waits) is the whole session.
        for node, (start, end) in ((first, (0, 2)), (second, (2, NUM_LAYERS))):
            waiting = node.servicer._settler._pending[grant.session_id][(start, end)][0]
            assert waiting == len(PROMPT) + 12
            assert driver.usage.owed(node.node_id, start, end) == 0
    finally:
        await driver.close()
        await channels.close()


def test_acknowledgments_survive_a_restart_of_the_node(tmp_path) -> None:
    key, client = identity.generate_private_key(), identity.generate_private_key()
    path = tmp_path / "usage.json"
    meter = UsageMeter(key, path=path)
    receipt = meter.record("s1", 0, 2, step=1, tokens=10)
    meter.record("s1", 0, 2, step=2, tokens=1)
    countersigned = ledger_pb2.SignedUsage(
        receipt=receipt.receipt,
        node_signature=receipt.node_signature,
        client_signature=client.sign(identity.usage_countersign_payload(receipt.receipt, 10)),
        billed_tokens=10,
    )
    meter.acknowledge("s1", countersigned, identity.public_key_bytes(client))
    assert meter.owed("s1", 0, 2) == 1
    meter.save()
    assert UsageMeter(key, path=path).owed("s1", 0, 2) == 1
    # A file written before acknowledgments were counted (six columns) reads as none made.
    path.write_text('[["s1", 0, 2, 11, 1, 2]]')
    assert UsageMeter(key, path=path).owed("s1", 0, 2) == 11


async def test_a_client_cannot_take_the_credit_again_in_a_new_session(
    start_node, keys: CoordinatorKeys
) -> None:
    """A session ended with its credit's worth unacknowledged: the client's next session
    on this node is refused until it acknowledges those receipts; other clients are not."""
    node = await start_node([(0, NUM_LAYERS)])
    first = PaidSession.open(node, keys, "s-short")
    try:
        answer = await first.tokens(PROMPT, 0)
        position = len(PROMPT)
        while position < CREDIT:  # just under the credit, never acknowledged
            answer = await first.tokens([next_token(answer)], position)
            position += 1
        end = stage_pb2.EndSessionRequest(session_id="s-short", capability=first.capability())
        await stage_pb2_grpc.StageStub(first.channel).EndSession(end, timeout=10)
    finally:
        await first.close()
    again = PaidSession.open(node, keys, "s-again")
    stranger = PaidSession.open(node, keys, "s-stranger")
    stranger.client = identity.generate_private_key()
    try:
        details = await refused(
            again.tokens(PROMPT, 0),
            grpc.StatusCode.FAILED_PRECONDITION,
            f"{CREDIT} token positions, and a client's credit is {CREDIT}",
        )
        assert "other sessions on this node ended or idled" in details
        assert not usage_credit.is_refusal(details), "acknowledging s-again would not lift it"
        assert (await stranger.tokens(PROMPT, 0)).cache_length == len(PROMPT)
        # The ended session's last receipt, acknowledged late (as its client's close does).
        late = PaidSession.open(node, keys, "s-short")
        try:
            taken = await late.acknowledge(late.countersign(answer.usage))
        finally:
            await late.close()
        assert list(taken.acknowledged_tokens) == [CREDIT]
        await again.close()
        again = PaidSession.open(node, keys, "s-again")
        assert (await again.tokens(PROMPT, 0)).cache_length == len(PROMPT)
    finally:
        await again.close()
        await stranger.close()


async def test_a_paused_session_acknowledges_what_it_owes(
    start_node, keys: CoordinatorKeys, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Below a quarter of the credit nothing is acknowledged alongside; once the session
    makes no call for IDLE_ACK_S (its caller paused), it acknowledges all it owes, so that
    its nodes never count it against the client's other sessions."""
    monkeypatch.setattr(acknowledgments, "IDLE_ACK_S", 0.2)
    driver, channels, (first, second), grant = await paid_pipeline(start_node, keys, 64)
    spans = ((first, (0, 2)), (second, (2, NUM_LAYERS)))
    try:
        logits = await driver.step(PROMPT, last_only=True)
        for _ in range(3):
            logits = await driver.step([int(np.argmax(logits[0]))], last_only=True)
        owed = [n.servicer._usage.owed(grant.session_id, *span) for n, span in spans]
        assert owed == [len(PROMPT) + 3] * 2 and driver.acks.sent == 0
        deadline = asyncio.get_running_loop().time() + 5
        while driver.acks.sent < 2 and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)
        assert [n.servicer._usage.owed(grant.session_id, *span) for n, span in spans] == [0, 0]
    finally:
        await driver.close()
        await channels.close()


async def test_a_node_that_serves_the_client_nothing_for_now_is_failed_over_at_once(
    start_node, keys: CoordinatorKeys, checkpoint
) -> None:
    """Its refusal for the client's residue is not lifted by a replay there, nor by an
    acknowledgment of this session: the driver goes to the alternate."""
    credit = 4
    client = identity.generate_private_key()
    owing, spare = await start_node([(0, 2)]), await start_node([(0, 2)])
    last = await start_node([(2, NUM_LAYERS)])
    earlier = PaidSession.open(owing, keys, "s-earlier")
    earlier.client = client
    grants = [(owing.node_id, 0, 2)]
    try:
        answer = await earlier.tokens(
            PROMPT, 0, end=2, capability=earlier.capability(grants=grants)
        )
        assert ledger_pb2.UsageReceipt.FromString(answer.usage.receipt).tokens >= credit
        end = stage_pb2.EndSessionRequest(
            session_id="s-earlier", capability=earlier.capability(grants=grants)
        )
        await stage_pb2_grpc.StageStub(earlier.channel).EndSession(end, timeout=10)
    finally:
        await earlier.close()
    stages = [(0, 2, owing, [spare]), (2, NUM_LAYERS, last, [])]
    driver, channels, _ = acknowledging_driver(keys, stages, client, credit)
    try:
        logits = await driver.step(PROMPT, last_only=True)
        assert int(np.argmax(logits[0])) == reference_greedy(checkpoint, PROMPT, 1)[0]
        (event,) = driver.failovers
        assert (event.failed_node_id, event.via) == (owing.node_id, "alternate"), event
        assert "other sessions on this node ended or idled" in event.reason
    finally:
        await driver.close()
        await channels.close()
