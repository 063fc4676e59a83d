"""Verification checks do not depend on what the client pays for.

With ``prefer=cheap`` the billed route drops alternates dearer than their primary; the
coordinator still grants them as verification-only ``checkers`` of the stage (checks are
not billed), and the driver samples checks from them, but never fails over to them.

Coordinator side: the real session manager, placement, router and ledger (SQLite), as in
tests/ledger. Driver side: real stage servers on loopback, a corrupting node from
TESSERA_FAILPOINTS.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from data_plane.stage_harness import StageNode, reference_greedy, session_grant
from data_plane.test_driver import PROMPT, greedy
from ledger.test_billing_sessions import Node, World, expected_quote
from verification.test_driver_verification import driver_for, keyed

from coordinator.ledger import audit
from coordinator.sessions import Sessions
from node_agent import failpoints
from protos import identity
from protos.tessera.v1 import client_api_pb2

NEW_TOKENS = 8


def move_to_checkers(
    grant: client_api_pb2.SessionGrant, checkers: dict[int, list[StageNode]]
) -> client_api_pb2.SessionGrant:
    """The grant with those replicas (granted as alternates by session_grant) turned into
    the stages' verification-only checkers, as the coordinator sends a cheap route."""
    for index, nodes in checkers.items():
        stage = grant.stages[index]
        ids = {n.node_id for n in nodes}
        stage.checkers.extend(h for h in stage.alternates if h.node_id in ids)
        kept = [h for h in stage.alternates if h.node_id not in ids]
        del stage.alternates[:]
        stage.alternates.extend(kept)
    return grant


@pytest.fixture
async def verified_world(tmp_path: Path) -> World:
    """The ledger tests' world (6 priced nodes, 2 replicas of every layer), with the
    verifier's hop details: each node its own operator account and key."""
    world = World(tmp_path, [Node(1000 * (i + 1), 1.0 + i) for i in range(6)])

    def details(hop: client_api_pb2.Hop) -> None:
        hop.public_key = world.nodes[hop.node_id].public
        hop.account = f"op-{hop.node_id[:6]}"
        hop.check_probability = 0.5

    info = client_api_pb2.ModelInfo(name="m", num_layers=6, hidden_size=64, vocab_size=100)
    world.sessions = Sessions(
        identity.generate_private_key(), world.placement, lambda n: info if n == "m" else None,
        lambda: ["m"], billing=world.billing, hop_details=details,
    )  # fmt: skip
    await world.ready()
    yield world
    assert audit(world.db).ok, audit(world.db).violations
    world.db.close()


async def test_a_cheap_route_still_grants_the_trimmed_replicas_as_unbilled_checkers(
    verified_world: World,
) -> None:
    world = verified_world
    world.ledger.grant(world.account, 10_000_000, "g1")
    grant = world.sessions.open_session(world.request(prefer="cheap"))
    claims = client_api_pb2.CapabilityClaims.FromString(grant.capability.claims)
    granted = {(g.node_id, g.layers.start, g.layers.end) for g in claims.grants}
    holders = world.placement.ready_holders("m")
    dearer_checkers = 0
    for stage in grant.stages:
        start, end = stage.layers.start, stage.layers.end
        primary = stage.primary.node_id
        billed = {primary, *(a.node_id for a in stage.alternates)}
        checkers = [c.node_id for c in stage.checkers]
        # Every ready replica of the stage's layers can be asked to check it.
        covering = {h.node_id for h in holders if h.start <= start and end <= h.end}
        assert covering - billed == set(checkers)
        assert not billed & set(checkers), "a checker is never a fail-over alternate"
        for checker in stage.checkers:
            assert (checker.node_id, start, end) in granted  # the node will accept its checks
            assert checker.public_key and checker.account != stage.primary.account
            if world.nodes[checker.node_id].price > world.nodes[primary].price:
                dearer_checkers += 1
    assert dearer_checkers, "prefer=cheap trimmed no dearer replica: the test shows nothing"
    # The quote is the billed route's alone: checks are not billed.
    assert grant.quote.amount == expected_quote(grant, world.nodes)


async def test_a_cheap_cheater_with_no_independent_alternate_is_still_checked_and_caught(
    start_node, keys, checkpoint, monkeypatch: pytest.MonkeyPatch
) -> None:
    # One operator runs two cheap nodes, one of them corrupting; a dearer honest node of
    # another operator was trimmed from the billed route. The sibling is the only
    # fail-over, and one operator's nodes never check each other: only the checker can.
    monkeypatch.setenv(failpoints.ENV_VAR, "corrupt=0.5,seed=1")
    cheater = await start_node([(0, 4)])
    monkeypatch.delenv(failpoints.ENV_VAR)
    sibling, dear = await start_node([(0, 4)]), await start_node([(0, 4)])
    accounts = {cheater.node_id: "op-c", sibling.node_id: "op-c", dear.node_id: "op-d"}
    layout = [(0, 4, cheater, [sibling, dear])]
    grant = move_to_checkers(session_grant(keys, layout), {0: [dear]})
    grant = keyed(keys, grant, [cheater, sibling, dear], accounts, 1.0)
    driver = driver_for(grant)

    tokens = await greedy(driver, PROMPT, NEW_TOKENS)

    assert tokens == reference_greedy(checkpoint, PROMPT, NEW_TOKENS)
    stats = driver.verifier.stats
    assert stats.mismatches >= 1
    assert {checker for _, checker in stats.pairs} == {dear.node_id}
    assert any(f.failed_node_id == cheater.node_id for f in driver.failovers)
    # The checker only checked: every call the client paid for went to the billed nodes.
    assert {t.node_id for t in driver.timings} <= {cheater.node_id, sibling.node_id}
    assert [h.node_id for h in driver.route] == [sibling.node_id]
    await driver.close()
