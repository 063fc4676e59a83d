"""Reputation: the BOINC-style schedule, persistence, router weight, and convictions."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import grpc
import pytest
from support.coordinator_harness import Harness, harness_settings, state_of

from coordinator.db import open_database
from coordinator.node_state import NodeState
from coordinator.placement import Placement, PlacementNode
from coordinator.planner import Shard
from coordinator.server import running_coordinator
from coordinator.verifier.reputation import Reputation, Schedule
from coordinator.verifier.service import FraudProven, WorkRejected
from protos.tessera.v1 import node_pb2


def test_checking_falls_with_verified_results_and_resets_on_failure(tmp_path: Path) -> None:
    reputation = Reputation(open_database(tmp_path / "c.db"), Schedule(warmup=10, p_min=0.05))
    assert reputation.probability("n1") == 1.0  # a new node: every output checked
    for _ in range(9):
        reputation.verified("n1")
    assert reputation.probability("n1") == 1.0
    for _ in range(11):
        reputation.verified("n1")
    assert reputation.probability("n1") == pytest.approx(10 / 20)
    for _ in range(1000):
        reputation.verified("n1")
    assert reputation.probability("n1") == 0.05  # the floor
    reputation.failed("n1")
    assert reputation.probability("n1") == 1.0  # back to maximum after any failure
    assert reputation.record("n1").verified == 1020
    assert reputation.router_cost("n1") == 2.0 and reputation.router_cost("n2") == 1.0


def test_records_survive_a_restart(tmp_path: Path) -> None:
    db = open_database(tmp_path / "c.db")
    reputation = Reputation(db)
    reputation.verified("n1", canary=True)
    reputation.failed("n2", canary=True)
    db.close()
    again = Reputation(open_database(tmp_path / "c.db"))
    assert again.record("n1").canary_passed == 1 and again.record("n1").consecutive == 1
    assert again.record("n2").canary_failed == 1 and again.record("n2").failures == 1
    trust = again.to_proto("n1")
    assert trust.verified == 1 and trust.trust == pytest.approx(0.0)


async def _noop(node_id: str, command: object) -> bool:
    return True


async def test_failures_make_a_node_dearer_for_the_router() -> None:
    placement = Placement(_noop, replicas=1)
    caps = node_pb2.Capabilities(matmul_tflops=10.0, memory_usable_bytes=1 << 34)
    for node_id in ("good", "bad"):
        placement.node_up(PlacementNode(node_id, f"{node_id}:1", caps))
        placement._state[(node_id, Shard("m", 0, 4))] = node_pb2.SHARD_STATE_READY
    placement.trust_cost = lambda node_id: 3.0 if node_id == "bad" else 1.0
    holders = {h.node_id: h for h in placement.ready_holders("m")}
    assert holders["bad"].ms_per_layer == pytest.approx(3 * holders["good"].ms_per_layer)


async def test_a_conviction_bans_the_node_and_tells_the_listeners(start_harness) -> None:
    harness = await start_harness(canary_interval_s=0.0)
    node = await harness.registered_node("cheat", attach=True)
    verifier = harness.ctx.verifier
    events: list[object] = []
    unsubscribe = verifier.add_listener(events.append)
    evidence = verifier.convict(
        node.node_id, "op-c", "s-1", "arbitration", "wrong output", b"proof", "e" * 64
    )
    await harness.wait_state(node.node_id, NodeState.BANNED)
    assert events == [
        WorkRejected(node.node_id, "s-1", "wrong output"),
        FraudProven(node.node_id, "op-c", evidence, "wrong output"),
    ]
    row = harness.ctx.db["verification_evidence"].get(evidence)
    assert row["accused_node_id"] == node.node_id and row["payload"] == b"proof"
    # Convicted again (a second canary of the same round): no second ban, no second slash.
    verifier.convict(node.node_id, "op-c", "s-2", "canary", "again", b"x", "f" * 64)
    assert [type(e) for e in events[2:]] == [WorkRejected]
    unsubscribe()
    verifier.convict(node.node_id, "op-c", "s-3", "canary", "after", b"y", "0" * 64)
    assert len(events) == 3, "an unsubscribed listener hears nothing"


async def test_proof_against_a_node_an_operator_banned_still_slashes(start_harness) -> None:
    """An operator's ban slashes nothing; proof of wrong work that comes in afterwards (a
    check that was under way) does, once."""
    harness = await start_harness(canary_interval_s=0.0)
    node = await harness.registered_node("cheat", attach=True)
    verifier = harness.ctx.verifier
    events: list[object] = []
    verifier.add_listener(events.append)
    harness.ctx.registry.operator_ban(node.node_id, "spams sessions")
    evidence = verifier.convict(
        node.node_id, "op-c", "s-1", "arbitration", "wrong output", b"proof", "e" * 64
    )
    assert events == [
        WorkRejected(node.node_id, "s-1", "wrong output"),
        FraudProven(node.node_id, "op-c", evidence, "wrong output"),
    ]
    verifier.convict(node.node_id, "op-c", "s-2", "canary", "again", b"x", "f" * 64)
    assert [type(e) for e in events[2:]] == [WorkRejected]  # one slashing a ban
    assert harness.state(node.node_id) is NodeState.BANNED


async def test_one_slashing_a_ban_holds_across_a_coordinator_restart(tmp_path: Path) -> None:
    """A proof that comes in after a restart, of a node banned and slashed before it, is
    recorded but slashes nothing more: the operator's stake may hold new deposits by now."""
    settings = harness_settings(tmp_path / "coordinator", canary_interval_s=0.0)

    def slashes(ctx: Any) -> list[str]:
        rows = ctx.db.execute("SELECT txid FROM ledger_transactions WHERE kind = 'slash'")
        return [r[0] for r in rows]

    async with running_coordinator(settings) as coordinator:
        async with grpc.aio.insecure_channel(coordinator.address) as channel:
            harness = Harness(coordinator, channel)
            node = await harness.registered_node("cheat", attach=True)
            evidence = harness.ctx.verifier.convict(
                node.node_id, "op-c", "s-1", "arbitration", "wrong output", b"proof", "e" * 64
            )
            await harness.wait_state(node.node_id, NodeState.BANNED)
            assert slashes(harness.ctx) == [f"slash:{evidence}"]
    async with running_coordinator(settings) as coordinator:
        verifier = coordinator.ctx.verifier
        events: list[object] = []
        verifier.add_listener(events.append)
        assert state_of(coordinator, node.node_id) is NodeState.BANNED
        late = verifier.convict(node.node_id, "op-c", "s-2", "canary", "late", b"x", "f" * 64)
        assert events == [WorkRejected(node.node_id, "s-2", "late")], "slashed a ban twice"
        assert slashes(coordinator.ctx) == [f"slash:{evidence}"]
        assert coordinator.ctx.db["verification_evidence"].get(late)["session_id"] == "s-2"
