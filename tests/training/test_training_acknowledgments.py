"""A paid training job's credit at a node, and TrainingStage.Acknowledge (docs/ledger.md,
"Jobs"), against real training stage servers on loopback.

A node runs at most the job's credit of samples forward on its layers past the newest
receipt the runner counter-signed and handed back; a runner that withholds its receipts is
refused there, and its job's state is left as it was. Every malformed, forged or
misdirected acknowledgment gets the right status, acknowledges nothing, and the node goes
on serving. The tessera driver acknowledges as it goes and is never re-synced for it.
"""

from __future__ import annotations

from typing import Any

import grpc
import pytest
from data_plane.stage_harness import CoordinatorKeys
from training.test_training_rpcs import forward, open_request, refused, stub
from training.training_harness import SPLIT, TrainingNode, counting_batch, hyper

from client.acknowledgments import Acknowledger
from client.training_driver import StageFailed, StageOutOfSync, TrainingDriver
from node_agent import receipts
from protos import codec, identity, usage_credit
from protos.tessera.v1 import client_api_pb2, ledger_pb2, stage_pb2, training_pb2_grpc

JOB = "job-1"
CREDIT = 4  # samples; each forward here runs 2
CLIENT = identity.generate_private_key()


def paid(
    keys: CoordinatorKeys,
    grants: list[tuple[TrainingNode, int, int]],
    job: str = JOB,
    **options: Any,
) -> client_api_pb2.SignedCapability:
    """A paid job's capability: the test's client key, a credit of CREDIT samples."""
    options.setdefault("client_key", identity.public_key_bytes(CLIENT))
    options.setdefault("usage_credit", CREDIT)
    return keys.capability(
        job, [(n.node_id, s, e) for n, s, e in grants], model="tiny-train", **options
    )


def countersign(
    usage: ledger_pb2.SignedUsage, billed: int | None = None, key: Any = None
) -> ledger_pb2.SignedUsage:
    receipt = ledger_pb2.UsageReceipt.FromString(usage.receipt)
    billed = receipt.tokens if billed is None else billed
    return ledger_pb2.SignedUsage(
        receipt=usage.receipt,
        node_signature=usage.node_signature,
        client_signature=(key or CLIENT).sign(
            identity.usage_countersign_payload(usage.receipt, billed)
        ),
        billed_tokens=billed,
    )


def acknowledge(
    node_stub: training_pb2_grpc.TrainingStageStub,
    cap: client_api_pb2.SignedCapability | None,
    *usage: ledger_pb2.SignedUsage,
    job: str = JOB,
) -> Any:
    request = stage_pb2.AcknowledgeRequest(session_id=job, usage=list(usage))
    if cap is not None:
        request.capability.CopyFrom(cap)
    return node_stub.Acknowledge(request, timeout=10)


def first_stage_forward(cap: Any, mb: int, job: str = JOB) -> Any:
    tokens, _ = counting_batch(0, batch=2, seq=8)
    return forward(cap, codec.encode(tokens, "int64"), mb=mb, job=job)


async def test_a_runner_that_withholds_its_receipts_gets_no_more_than_its_credit(
    start_node, keys: CoordinatorKeys
) -> None:
    node = await start_node([(0, 2)])
    cap = paid(keys, [(node, 0, 2)])
    node_stub, channel = stub(node)
    try:
        await node_stub.OpenTraining(open_request(cap, 0, 2, hyper=hyper("full", micro_batches=4)))
        answers = [await node_stub.ForwardTrain(first_stage_forward(cap, mb)) for mb in (0, 1)]
        newest = ledger_pb2.UsageReceipt.FromString(answers[-1].usage.receipt)
        assert newest.tokens == CREDIT
        details = await refused(
            node_stub.ForwardTrain(first_stage_forward(cap, 2)),
            grpc.StatusCode.FAILED_PRECONDITION,
            f"computed {CREDIT} samples on layers [0, 2) of job {JOB}",
            "TrainingStage.Acknowledge",
            f"job's credit is {CREDIT}",
        )
        assert usage_credit.is_refusal(details)  # what the driver reads to acknowledge
        # Billed as a check or not, the node's own receipt counter-signed acknowledges it.
        taken = await acknowledge(node_stub, cap, countersign(answers[-1].usage, billed=0))
        assert list(taken.acknowledged_tokens) == [CREDIT]
        # The refused micro-batch left no trace: it runs now, once.
        again = await node_stub.ForwardTrain(first_stage_forward(cap, 2))
        assert ledger_pb2.UsageReceipt.FromString(again.usage.receipt).tokens == CREDIT + 2
        # An older receipt never lowers what was acknowledged.
        stale = await acknowledge(node_stub, cap, countersign(answers[0].usage))
        assert list(stale.acknowledged_tokens) == [CREDIT]
        # An expired capability still pays for the work done: acknowledging needs no right
        # to ask for more.
        expired = paid(keys, [(node, 0, 2)], ttl_s=-1)
        await refused(
            node_stub.ForwardTrain(first_stage_forward(expired, 3)),
            grpc.StatusCode.UNAUTHENTICATED,
            "expired",
        )
        later = await acknowledge(node_stub, expired, countersign(again.usage))
        assert list(later.acknowledged_tokens) == [CREDIT + 2]
        await node_stub.ForwardTrain(first_stage_forward(cap, 3))
    finally:
        await channel.close()


async def test_hostile_training_acknowledgments_are_refused_and_the_node_goes_on_serving(
    start_node, keys: CoordinatorKeys
) -> None:
    node, other = await start_node([(0, 2)]), await start_node([(0, 2)])
    cap = paid(keys, [(node, 0, 2), (other, 0, 2)])
    node_stub, channel = stub(node)
    other_stub, other_channel = stub(other)
    try:
        for s in (node_stub, other_stub):
            await s.OpenTraining(open_request(cap, 0, 2, hyper=hyper("full", micro_batches=4)))
        mine = (await node_stub.ForwardTrain(first_stage_forward(cap, 0))).usage
        theirs = (await other_stub.ForwardTrain(first_stage_forward(cap, 0))).usage
        # The node's own receipt of another job of this client.
        job2 = paid(keys, [(node, 0, 2)], job="job-2")
        await node_stub.OpenTraining(
            open_request(job2, 0, 2, job_id="job-2", hyper=hyper("full", micro_batches=4))
        )
        elsewhere = (await node_stub.ForwardTrain(first_stage_forward(job2, 0, "job-2"))).usage
        free = keys.capability(JOB, [(node.node_id, 0, 2)], model="tiny-train")
        stranger = identity.generate_private_key()
        cases: list[tuple[Any, grpc.StatusCode, str]] = [
            (acknowledge(node_stub, None, countersign(mine)), grpc.StatusCode.UNAUTHENTICATED,
             "carries no capability"),
            (acknowledge(node_stub, job2, countersign(mine)), grpc.StatusCode.PERMISSION_DENIED,
             "names job 'job-1'"),
            (acknowledge(node_stub, cap, countersign(mine), job="../etc"),
             grpc.StatusCode.INVALID_ARGUMENT, "is not a job id"),
            (acknowledge(node_stub, free, countersign(mine)), grpc.StatusCode.FAILED_PRECONDITION,
             "is free"),
            (acknowledge(node_stub, cap), grpc.StatusCode.INVALID_ARGUMENT, "0 receipts"),
            (acknowledge(node_stub, cap, *[countersign(mine)] * 65),
             grpc.StatusCode.INVALID_ARGUMENT, "65 receipts"),
            (acknowledge(node_stub, cap, ledger_pb2.SignedUsage(receipt=b"x" * 2000)),
             grpc.StatusCode.INVALID_ARGUMENT, "at most 1024"),
            (acknowledge(node_stub, cap, ledger_pb2.SignedUsage(receipt=b"\xff\xff")),
             grpc.StatusCode.INVALID_ARGUMENT, "not a UsageReceipt"),
            (acknowledge(node_stub, cap, countersign(mine, key=stranger)),
             grpc.StatusCode.UNAUTHENTICATED, "not counter-signed by the session's client key"),
            (acknowledge(node_stub, cap, countersign(mine, billed=3)),
             grpc.StatusCode.INVALID_ARGUMENT, "3 billed tokens, but the receipt counts 2"),
            (acknowledge(node_stub, cap, countersign(theirs)), grpc.StatusCode.UNAUTHENTICATED,
             "not this node's"),
            (acknowledge(node_stub, cap, countersign(elsewhere)),
             grpc.StatusCode.INVALID_ARGUMENT, "for session 'job-2'"),
        ]  # fmt: skip
        for call, code, words in cases:
            await refused(call, code, words)
        # Nothing was acknowledged: at the credit the node still refuses, then takes the
        # honest acknowledgment and serves.
        newest = (await node_stub.ForwardTrain(first_stage_forward(cap, 1))).usage
        await refused(
            node_stub.ForwardTrain(first_stage_forward(cap, 2)),
            grpc.StatusCode.FAILED_PRECONDITION,
            "has not acknowledged",
        )
        taken = await acknowledge(node_stub, cap, countersign(newest))
        assert list(taken.acknowledged_tokens) == [CREDIT]
        await node_stub.ForwardTrain(first_stage_forward(cap, 2))
    finally:
        await channel.close()
        await other_channel.close()


@pytest.mark.parametrize("when", ["alongside", "when-refused"])
async def test_an_honest_training_driver_acknowledges_as_it_goes_and_is_never_resynced(
    start_node, keys: CoordinatorKeys, when: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A credit of less than a step's batch: the driver acknowledges alongside the
    pipeline, waits before a forward only when half of it is owed, and, when
    acknowledgments get lost (none sent until refused), acknowledges and sends the refused
    forward to the same node again: no StageOutOfSync, no rollback."""
    if when == "when-refused":
        monkeypatch.setattr(Acknowledger, "noted", lambda *_: None)

        async def never_before(self: Acknowledger, hops: Any) -> None:
            return None

        monkeypatch.setattr(Acknowledger, "ready", never_before)
    nodes = [await start_node([span]) for span in SPLIT]
    grants = [(n, s, e) for n, (s, e) in zip(nodes, SPLIT, strict=True)]
    driver = TrainingDriver(
        job_id=JOB,
        model="tiny-train",
        hops=[n.hop(s, e) for n, s, e in grants],
        capability=paid(keys, grants),
        hyper=hyper("full", micro_batches=2),
        key=CLIENT,
    )
    assert driver.acks is not None and driver.acks.credit == CREDIT
    steps = 3
    try:
        await driver.open()
        for step in range(steps):
            await driver.train_step(step, *counting_batch(step))  # 4 samples a step
        assert driver.acks.failed == 0 and driver.acks.sent >= steps
        samples = steps * 4
        for node, (start, end) in zip(nodes, SPLIT, strict=True):
            owed = node.training._usage.owed(JOB, start, end)
            # Under the credit, or at it (then only a refusal brought the acknowledgment).
            assert owed <= (CREDIT if when == "when-refused" else CREDIT - 1), owed
        await driver.close()
        # The end of the job's run hands each node its newest receipt: what it waits to
        # settle (its coordinator stand-in has no ledger) is the whole run.
        for node, (start, end) in zip(nodes, SPLIT, strict=True):
            waiting = node.training._settler._pending[JOB][(start, end)][0]
            assert waiting == samples
            assert node.training._usage.owed(JOB, start, end) == 0
    finally:
        await driver.close()


async def test_a_node_that_serves_the_client_nothing_for_now_fails_its_stage(
    start_node, keys: CoordinatorKeys, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another job of the client left the credit unacknowledged on the node (and idled):
    the node refuses this job's forward until it is acknowledged, which a re-sync there
    would not change, so the driver fails the stage (the runner re-plans it elsewhere)."""
    monkeypatch.setattr(receipts, "RESIDUE_IDLE_S", 0.0)
    node = await start_node([(0, 2)])
    earlier = paid(keys, [(node, 0, 2)], job="job-earlier")
    node_stub, channel = stub(node)
    try:
        four = hyper("full", micro_batches=4)
        await node_stub.OpenTraining(open_request(earlier, 0, 2, job_id="job-earlier", hyper=four))
        for mb in (0, 1):  # the credit's worth, never acknowledged
            await node_stub.ForwardTrain(first_stage_forward(earlier, mb, "job-earlier"))
    finally:
        await channel.close()
    last = await start_node([(2, 4)])
    driver = TrainingDriver(
        job_id=JOB,
        model="tiny-train",
        hops=[node.hop(0, 2), last.hop(2, 4)],
        capability=paid(keys, [(node, 0, 2), (last, 2, 4)]),
        hyper=hyper("full", micro_batches=2),
        key=CLIENT,
    )
    try:
        await driver.open()
        with pytest.raises(StageFailed) as failed:
            await driver.train_step(0, *counting_batch(0, batch=2, seq=8))
        assert not isinstance(failed.value, StageOutOfSync)
        assert failed.value.index == 0 and failed.value.node_id == node.node_id
        assert "other jobs on this node ended or idled" in str(failed.value)
    finally:
        await driver.close()
