"""Audits of a fail-over's replay: the replacement recomputes every position of the failed
node's span, and the client compares those outputs with what the failed node signed.

Real stage servers on loopback. No check is ever drawn (the draws are scripted), so a step
the primary corrupted can only be seen by the replay that follows its death. The primary of
layers [0, 2) stops (its server goes away) after a few tokens; the driver fails over to the
span's one replica and replays the history there. The verification report goes to an
arbiter built from the coordinator's own parts, which runs the doubted step on a fourth,
honest node (tests/verification/test_catch_up_audits.py, ``arbiter``).
"""

from __future__ import annotations

import pytest
from data_plane.stage_harness import MODEL, CoordinatorKeys, StageNode, reference_greedy
from data_plane.stage_harness import session_grant as grant_for
from data_plane.test_driver import PROMPT, greedy
from verification.test_catch_up_audits import Armed, CorruptsOneCall, arbiter, assert_proven
from verification.test_driver_verification import keyed

from client.channels import ChannelPool
from client.driver import PipelineDriver
from client.errors import OutputTainted
from client.verification import StageVerifier
from coordinator.verifier import evidence
from protos.tessera.v1 import verification_pb2

NEW_TOKENS = 10
STOP_AFTER_TOKEN = 5  # the primary answered the prompt and 5 decode steps by then
PRIMARY_CALLS = 1 + STOP_AFTER_TOKEN


async def replay_swarm(
    start_node,
    keys: CoordinatorKeys,
    *,
    corrupts: int | None = None,
    one_operator: bool = False,
) -> tuple[
    PipelineDriver,
    StageNode,
    StageNode,
    list[evidence.Mismatch],
    list[verification_pb2.VerificationReport],
]:
    """Layers [0, 2) on a primary (corrupting its ``corrupts``-th output) with one replica,
    [2, 4) on a lone node, and an arbiter of [0, 2) outside the session. With
    ``one_operator`` the primary and its replica belong to the same account."""
    primary, replica, lone, judge = [
        await start_node([(0, 2)]),
        await start_node([(0, 2)]),
        await start_node([(2, 4)]),
        await start_node([(0, 2)]),
    ]
    if corrupts is not None:
        primary.servicer._failpoints = CorruptsOneCall(corrupts)
    nodes = [primary, replica, lone]
    accounts = {primary.node_id: "op-a", replica.node_id: "op-b", lone.node_id: "op-c"}
    if one_operator:
        accounts[replica.node_id] = "op-a"
    grant = keyed(
        keys, grant_for(keys, [(0, 2, primary, [replica]), (2, 4, lone, [])]), nodes, accounts, 0.5
    )
    mismatches: list[evidence.Mismatch] = []
    reports: list[verification_pb2.VerificationReport] = []
    channels = ChannelPool()
    verifier = StageVerifier(
        grant.session_id, channels, arbiter(keys, judge, mismatches, reports), rng=Armed()
    )
    driver = PipelineDriver(grant, MODEL, channels=channels, verifier=verifier)
    return driver, primary, replica, mismatches, reports


async def generate_through_a_death(driver: PipelineDriver, primary: StageNode) -> list[int]:
    tokens = await greedy(
        driver, PROMPT, NEW_TOKENS, after_step={STOP_AFTER_TOKEN: lambda: primary.server.stop(0)}
    )
    [event] = driver.failovers
    assert event.failed_node_id == primary.node_id
    return tokens


async def test_the_replay_vouches_for_every_step_the_dead_node_signed(
    start_node, keys, checkpoint
) -> None:
    driver, primary, replica, mismatches, reports = await replay_swarm(start_node, keys)

    tokens = await generate_through_a_death(driver, primary)
    assert tokens == reference_greedy(checkpoint, PROMPT, NEW_TOKENS)
    stats = driver.verifier.stats
    assert stats.check_steps == []  # no check was drawn: all of this came from the replay
    # Every call the dead node answered was compared once, over its two layers.
    assert stats.audited == {primary.node_id: PRIMARY_CALLS}
    assert stats.audited_layer_tokens == (len(PROMPT) + STOP_AFTER_TOKEN) * 2
    await driver.verifier.finish()
    assert not stats.findings and not mismatches
    # Each went to the coordinator as an agreement the arbiter's evidence checks accepted
    # (they raise otherwise): the dead node's signed step, vouched for by the replacement.
    audits = [a for r in reports for a in r.audits]
    assert len(audits) == PRIMARY_CALLS
    assert {a.primary.node_id for a in audits} == {primary.node_id}
    assert {a.checker.node_id for a in audits} == {replica.node_id}
    assert len({a.primary.step for a in audits}) == PRIMARY_CALLS
    await driver.close()


async def test_a_step_the_dead_node_corrupted_unchecked_is_proven_wrong_after_its_replay(
    start_node, keys
) -> None:
    # Call 3 is the second decode step: position len(PROMPT) + 1, never checked.
    driver, primary, replica, mismatches, _ = await replay_swarm(start_node, keys, corrupts=3)
    corrupted = len(PROMPT) + 1

    await generate_through_a_death(driver, primary)
    stats = driver.verifier.stats
    # Doubted while the replacement serves the pipeline: it runs the step again only when
    # the session ends (now it would roll back the cache the pipeline uses).
    assert not mismatches and not stats.findings
    assert stats.audited == {primary.node_id: PRIMARY_CALLS - 1}
    assert driver.route[0].node_id == replica.node_id
    await driver.verifier.finish()
    with pytest.raises(OutputTainted) as raised:
        driver.raise_if_tainted(len(PROMPT))
    assert raised.value.position == corrupted
    mismatch = assert_proven(raised, stats, mismatches, primary, (0, 2), corrupted)
    assert mismatch.comparison.checker.node_id == replica.node_id
    await driver.close()


async def test_a_replacement_of_the_same_operator_vouches_for_nothing(
    start_node, keys, checkpoint
) -> None:
    driver, primary, _, mismatches, reports = await replay_swarm(
        start_node, keys, corrupts=3, one_operator=True
    )

    await generate_through_a_death(driver, primary)
    await driver.verifier.finish()
    stats = driver.verifier.stats
    # One account runs both: the replay neither vouches for the dead node's steps nor
    # accuses it (a known limit: nothing independent saw the corrupted step).
    assert stats.audited == {} and stats.audited_layer_tokens == 0
    assert not stats.findings and not mismatches
    assert not [a for r in reports for a in r.audits]
    driver.raise_if_tainted(len(PROMPT))
    await driver.close()
