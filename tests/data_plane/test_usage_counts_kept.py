"""A stage node keeps its usage counts in its data dir while it serves and when it stops
(node_agent/receipts.py): what a restart reads back is what its last receipts said."""

from __future__ import annotations

import json

from data_plane.stage_harness import MODEL, NUM_LAYERS, session_grant
from support.coordinator_harness import wait_until

from client.driver import PipelineDriver
from node_agent.stage_server import USAGE_FILE, StageLimits
from protos import identity
from protos.tessera.v1 import ledger_pb2

PROMPT = [1, 5, 9, 13, 20]


def counted(driver: PipelineDriver) -> dict[tuple[str, int, int], int]:
    """(session, start, end) -> tokens, by the node's newest receipt the client holds."""
    found = {}
    for usage in driver.usage.countersign(driver.session_id, identity.generate_private_key()):
        receipt = ledger_pb2.UsageReceipt.FromString(usage.receipt)
        found[(receipt.session_id, receipt.layer_start, receipt.layer_end)] = receipt.tokens
    return found


def on_disk(path) -> dict[tuple[str, int, int], int]:  # noqa: ANN001
    if not path.exists():
        return {}
    return {(s, a, b): tokens for s, a, b, tokens, *_ in json.loads(path.read_text())}


async def test_a_serving_node_keeps_its_counts_and_writes_them_when_it_stops(
    start_node, keys
) -> None:
    node = await start_node([(0, NUM_LAYERS)], limits=StageLimits(expiry_interval_s=0.05))
    path = node.ctx.data_dir / USAGE_FILE
    driver = PipelineDriver(session_grant(keys, [(0, NUM_LAYERS, node, [])]), MODEL)
    try:
        await driver.step(PROMPT, last_only=True)
        await driver.step([7], last_only=True)
        # Written while it serves, by a sweep after the count changed.
        await wait_until(lambda: on_disk(path) == counted(driver), 10.0, "the counts on disk")
        assert on_disk(path) == {(driver.session_id, 0, NUM_LAYERS): len(PROMPT) + 1}
        await driver.step([3], last_only=True)
        # Stopped in the middle of the session: what the last sweep missed is written too.
        await node.stop()
        assert on_disk(path) == counted(driver) == {(driver.session_id, 0, NUM_LAYERS): 7}
    finally:
        await driver.close()
