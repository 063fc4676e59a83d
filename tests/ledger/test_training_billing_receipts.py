"""Training usage receipts against real training stage servers (docs/ledger.md, "Jobs"):
every forward reply carries the node's cumulative, signed count of samples for (job,
layers); the driver counter-signs no more than it sent, and the coordinator's checks
accept exactly that. Steps redone after a rollback are computed again and billed again
(the rule: the client pays for samples computed)."""

from __future__ import annotations

import grpc
import pytest
from data_plane.stage_harness import CoordinatorKeys
from training.conftest import checkpoint, few_threads, keys, start_node, store  # noqa: F401
from training.training_harness import SPLIT, counting_batch, hyper, training_capability

from client.training_driver import TrainingDriver
from coordinator.ledger.amounts import LedgerError
from coordinator.ledger.receipts import verify_usage
from protos import identity
from protos.tessera.v1 import ledger_pb2

JOB = "job-bill"
BATCH = 4  # counting_batch's default


def _claim(node_key, start: int, end: int, samples: int) -> ledger_pb2.SignedUsage:
    """A receipt the node signs for `samples` of this job's layers [start, end)."""
    public = identity.public_key_bytes(node_key)
    raw = ledger_pb2.UsageReceipt(
        session_id=JOB, node_id=identity.node_id(public), node_public_key=public,
        layer_start=start, layer_end=end, tokens=samples, first_step=0, last_step=3,
    ).SerializeToString(deterministic=True)  # fmt: skip
    return ledger_pb2.SignedUsage(
        receipt=raw, node_signature=node_key.sign(identity.usage_payload(raw))
    )


async def test_redone_steps_are_billed_and_inflated_receipts_are_not_signed(
    start_node,  # noqa: F811 - the fixture
    keys: CoordinatorKeys,  # noqa: F811 - the fixture
    store,  # noqa: F811 - the fixture
) -> None:
    h = hyper("lora")
    store.stages[JOB] = set(SPLIT)
    nodes = [await start_node([span]) for span in SPLIT]
    cap = training_capability(
        keys, JOB, [(n, s, e) for n, (s, e) in zip(nodes, SPLIT, strict=True)]
    )
    driver = TrainingDriver(
        job_id=JOB, model="tiny-train", hyper=h, capability=cap,
        hops=[n.hop(s, e) for n, (s, e) in zip(nodes, SPLIT, strict=True)],
    )  # fmt: skip
    client = identity.generate_private_key()
    try:
        await driver.open()
        for step in range(2):
            await driver.train_step(step, *counting_batch(step))
        digests = await driver.save_checkpoint(2)
        for step in (2, 3):
            await driver.train_step(step, *counting_batch(step))
        # Roll back to the checkpoint and redo steps 2 and 3: six steps computed in all.
        assert await driver.open(restore_step=2, restore_sha256=digests) == 2
        for step in (2, 3):
            await driver.train_step(step, *counting_batch(step))
    finally:
        await driver.close()

    signed = driver.usage.countersign(JOB, client)
    usages = verify_usage(JOB, signed, identity.public_key_bytes(client))
    assert sorted((u.node_id, u.layer_start, u.layer_end, u.tokens) for u in usages) == sorted(
        (n.node_id, s, e, 6 * BATCH) for n, (s, e) in zip(nodes, SPLIT, strict=True)
    )
    # A node that inflates its count: the driver does not counter-sign it, and an
    # unsigned one does not pass the coordinator.
    first = nodes[0]
    inflated = _claim(first.ctx.private_key, *SPLIT[0], 6 * BATCH + 5)
    driver.usage.received(first.node_id, *SPLIT[0], inflated)
    assert first.node_id not in {
        u.node_id for u in verify_usage(JOB, driver.usage.countersign(JOB, client),
                                        identity.public_key_bytes(client))
    }  # fmt: skip
    with pytest.raises(LedgerError) as err:
        verify_usage(JOB, [inflated], identity.public_key_bytes(client))
    assert err.value.code == grpc.StatusCode.UNAUTHENTICATED
