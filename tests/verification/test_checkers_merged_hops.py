"""Merged hops stay checkable.

A node granted consecutive stages runs them as one hop. No replica granted a single
stage can check that joined span, so under verification the driver joins a run only when
some replica is granted every stage of it (as alternate or checker) and checks the joined
span there; otherwise the stages stay separate hops, each checked on its own.

Real stage servers on loopback; the corrupting node's misbehaviour comes from
TESSERA_FAILPOINTS.
"""

from __future__ import annotations

import pytest
from data_plane.stage_harness import MODEL, reference_greedy, session_grant
from data_plane.test_driver import PROMPT, greedy
from verification.test_checkers_independent_of_billing import move_to_checkers
from verification.test_driver_verification import driver_for, keyed

from client.driver import PipelineDriver
from node_agent import failpoints

NEW_TOKENS = 8


async def test_a_merged_hop_is_checked_by_a_replica_of_the_whole_span_and_caught(
    start_node, keys, checkpoint, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(failpoints.ENV_VAR, "corrupt=0.5,seed=1")
    cheater = await start_node([(0, 4)])
    monkeypatch.delenv(failpoints.ENV_VAR)
    sibling, checker = await start_node([(0, 4)]), await start_node([(0, 4)])
    accounts = {cheater.node_id: "op-c", sibling.node_id: "op-c", checker.node_id: "op-d"}
    # Two stages on the cheater; its sibling is each stage's fail-over, the honest node of
    # another operator each stage's checker only (as in a prefer=cheap route).
    layout = [(0, 2, cheater, [sibling, checker]), (2, 4, cheater, [sibling, checker])]
    grant = move_to_checkers(session_grant(keys, layout), {0: [checker], 1: [checker]})
    grant = keyed(keys, grant, [cheater, sibling, checker], accounts, 1.0)
    driver = driver_for(grant)
    assert [(h.node_id, h.start, h.end) for h in driver.route] == [(cheater.node_id, 0, 4)]

    tokens = await greedy(driver, PROMPT, NEW_TOKENS)

    assert tokens == reference_greedy(checkpoint, PROMPT, NEW_TOKENS)
    stats = driver.verifier.stats
    assert stats.mismatches >= 1 and stats.checked.get(cheater.node_id, 0) >= 1
    assert {pair for pair in stats.pairs if pair[0] == cheater.node_id} == {
        (cheater.node_id, checker.node_id)
    }
    # Caught on its merged span: the cheater's calls were all of layers [0, 4).
    assert {(t.start, t.end) for t in driver.timings if t.node_id == cheater.node_id} == {(0, 4)}
    assert any(f.failed_node_id == cheater.node_id for f in driver.failovers)
    assert {h.node_id for h in driver.route} == {sibling.node_id}
    await driver.close()


async def test_a_run_no_replica_can_check_whole_stays_one_checked_hop_per_stage(
    start_node, keys, checkpoint
) -> None:
    node = await start_node([(0, 4)])
    first, second = await start_node([(0, 2)]), await start_node([(2, 4)])
    accounts = {node.node_id: "op-a", first.node_id: "op-b", second.node_id: "op-c"}
    layout = [(0, 2, node, [first]), (2, 4, node, [second])]
    grant = keyed(keys, session_grant(keys, layout), [node, first, second], accounts, 1.0)
    driver = driver_for(grant)
    assert [(h.start, h.end) for h in driver.route] == [(0, 2), (2, 4)]

    tokens = await greedy(driver, PROMPT, NEW_TOKENS)

    assert tokens == reference_greedy(checkpoint, PROMPT, NEW_TOKENS)
    stats = driver.verifier.stats
    assert set(stats.pairs) == {(node.node_id, first.node_id), (node.node_id, second.node_id)}
    assert stats.mismatches == 0
    await driver.close()

    # Without verification nothing is sampled: the run is merged as before.
    plain = PipelineDriver(session_grant(keys, layout), MODEL)
    assert [(h.start, h.end) for h in plain.route] == [(0, 4)]
    await plain.close()
