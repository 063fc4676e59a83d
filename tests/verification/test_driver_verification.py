"""The driver's side of verification, over real stage servers on loopback.

No coordinator here (the stand-in key signs capabilities), so a mismatch cannot be
arbitrated: the driver must then refuse the primary's output and fail over, which still
keeps greedy output equal to the whole model's.
"""

from __future__ import annotations

import random
import time

import pytest
from data_plane.stage_harness import (
    MODEL,
    CoordinatorKeys,
    StageNode,
    reference_greedy,
    session_grant,
)
from data_plane.test_driver import PROMPT, HangingServicer, greedy

from client.channels import ChannelPool
from client.driver import DriverConfig, PipelineDriver
from client.verification import StageVerifier
from node_agent import failpoints
from node_agent.stage_server import StageServicer
from protos import identity
from protos.tessera.v1 import client_api_pb2

NEW_TOKENS = 8


def keyed(
    keys: CoordinatorKeys,
    grant: client_api_pb2.SessionGrant,
    nodes: list[StageNode],
    accounts: dict[str, str],
    probability: float,
) -> client_api_pb2.SessionGrant:
    """The grant with what a real coordinator adds for verification, signed again."""
    by_id = {n.node_id: n for n in nodes}
    claims = client_api_pb2.CapabilityClaims.FromString(grant.capability.claims)
    for hop in claims.grants:
        hop.public_key = by_id[hop.node_id].public_key
        hop.account = accounts.get(hop.node_id, "")
        hop.device_kind, hop.compute_dtype = "cpu", "float32"
        hop.check_probability = probability
    grant.capability.CopyFrom(identity.sign_capability(keys.key, claims))
    return grant


def driver_for(grant: client_api_pb2.SessionGrant) -> PipelineDriver:
    channels = ChannelPool()
    verifier = StageVerifier(grant.session_id, channels, rng=random.Random(1))
    return PipelineDriver(grant, MODEL, channels=channels, verifier=verifier)


class UnsignedServicer(StageServicer):
    """Answers correctly but without a signature."""

    async def _forward_one(self, request, stream):
        response = await super()._forward_one(request, stream)
        response.signature = b""
        return response


async def test_an_unsigned_reply_is_a_failure_of_that_node(start_node, keys, checkpoint) -> None:
    a = await start_node([(0, 2)])
    b = await start_node([(2, 4)], servicer_class=UnsignedServicer)
    b_alt = await start_node([(2, 4)])
    grant = keyed(
        keys, session_grant(keys, [(0, 2, a, []), (2, 4, b, [b_alt])]), [a, b, b_alt], {}, 0.0
    )
    driver = driver_for(grant)
    tokens = await greedy(driver, PROMPT, NEW_TOKENS)
    assert tokens == reference_greedy(checkpoint, PROMPT, NEW_TOKENS)
    [event] = driver.failovers
    assert event.failed_node_id == b.node_id and "unsigned" in event.reason
    await driver.close()


async def test_a_corrupting_primary_is_caught_and_its_output_never_used(
    start_node, keys, checkpoint, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(failpoints.ENV_VAR, "corrupt=0.3,seed=1")
    cheater = await start_node([(0, 4)])
    monkeypatch.delenv(failpoints.ENV_VAR)
    honest = [await start_node([(0, 4)]) for _ in range(2)]
    accounts = {cheater.node_id: "op-c", honest[0].node_id: "op-a", honest[1].node_id: "op-b"}
    grant = keyed(
        keys, session_grant(keys, [(0, 4, cheater, honest)]), [cheater, *honest], accounts, 1.0
    )
    driver = driver_for(grant)
    tokens = await greedy(driver, PROMPT, NEW_TOKENS)
    assert tokens == reference_greedy(checkpoint, PROMPT, NEW_TOKENS)
    stats = driver.verifier.stats
    assert stats.mismatches >= 1
    assert any(f.failed_node_id == cheater.node_id for f in driver.failovers)
    assert cheater.node_id not in {h.node_id for h in driver.route}
    await driver.close()


async def test_a_check_that_fails_after_the_next_stage_ran_re_runs_that_stage(
    start_node, keys, checkpoint, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Checks settle at the end of the step, so the second stage has already run on the
    # cheater's output (and cached it) when the mismatch comes in: the driver must fail
    # the first stage over and run the second again from the corrected hidden states.
    monkeypatch.setenv(failpoints.ENV_VAR, "corrupt=0.3,seed=1")
    cheater = await start_node([(0, 2)])
    monkeypatch.delenv(failpoints.ENV_VAR)
    honest = [await start_node([(0, 2)]) for _ in range(2)]
    second = await start_node([(2, 4)])
    nodes = [cheater, *honest, second]
    accounts = {n.node_id: f"op-{i}" for i, n in enumerate(nodes)}
    layout = [(0, 2, cheater, honest), (2, 4, second, [])]
    grant = keyed(keys, session_grant(keys, layout), nodes, accounts, 1.0)
    driver = driver_for(grant)
    tokens = await greedy(driver, PROMPT, NEW_TOKENS)
    assert tokens == reference_greedy(checkpoint, PROMPT, NEW_TOKENS)
    assert driver.verifier.stats.mismatches >= 1
    [event] = [f for f in driver.failovers if f.failed_node_id == cheater.node_id]
    assert cheater.node_id not in {h.node_id for h in driver.route}
    # The second stage answered the rejected step and then the redo of it.
    redone = [t for t in driver.timings if t.node_id == second.node_id and t.step > event.step]
    assert redone and not redone[0].replay
    await driver.close()


async def test_nodes_of_one_operator_never_check_each_other(start_node, keys) -> None:
    primary, sibling, stranger = [await start_node([(0, 4)]) for _ in range(3)]
    accounts = {primary.node_id: "op-x", sibling.node_id: "op-x", stranger.node_id: "op-y"}
    grant = keyed(
        keys,
        session_grant(keys, [(0, 4, primary, [sibling, stranger])]),
        [primary, sibling, stranger],
        accounts,
        1.0,
    )
    driver = driver_for(grant)
    await greedy(driver, PROMPT, NEW_TOKENS)
    pairs = driver.verifier.stats.pairs
    assert pairs and set(pairs) == {(primary.node_id, stranger.node_id)}
    await driver.close()

    # With only a sibling to ask, nothing is checked at all.
    alone = keyed(
        keys, session_grant(keys, [(0, 4, primary, [sibling])]), [primary, sibling], accounts, 1.0
    )
    driver = driver_for(alone)
    await greedy(driver, PROMPT, NEW_TOKENS)
    assert driver.verifier.stats.pairs == [] and not driver.verifier.stats.checked
    await driver.close()


async def test_checkers_catch_up_on_skipped_positions_without_false_alarms(
    start_node, keys, checkpoint
) -> None:
    # Half the calls are checked, at random: each checker's cache falls behind between
    # its checks and must catch up from the driver's history (hidden states for the
    # second stage) before it can answer the very call the primary answered.
    first = [await start_node([(0, 2)]) for _ in range(3)]
    second = [await start_node([(2, 4)]) for _ in range(3)]
    nodes = [*first, *second]
    accounts = {n.node_id: f"op-{i}" for i, n in enumerate(nodes)}
    layout = [(0, 2, first[0], first[1:]), (2, 4, second[0], second[1:])]
    grant = keyed(keys, session_grant(keys, layout), nodes, accounts, 0.5)
    driver = driver_for(grant)
    tokens = await greedy(driver, PROMPT, 12)
    assert tokens == reference_greedy(checkpoint, PROMPT, 12)
    stats = driver.verifier.stats
    assert stats.mismatches == 0 and not driver.failovers
    checked = sum(stats.checked.values())
    calls = sum(stats.calls.values())
    assert 0 < checked < calls, (checked, calls)
    # The checkers' work is counted: the checked calls themselves (both spans hold 2
    # layers; a step's call has the prompt's positions at step 0, one later), and the
    # catch-ups on top of them.
    positions = {t.step: t.tokens for t in driver.timings}
    checked_work = sum(positions[step] * 2 for step in stats.check_steps)
    assert stats.catch_up_layer_tokens > 0
    assert stats.checker_layer_tokens == checked_work + stats.catch_up_layer_tokens
    # Every catch-up is an audit too: the steps it replayed that had no check of their own
    # were compared with what their primaries signed, and all of them agreed.
    assert stats.audited_layer_tokens > 0 and not stats.findings
    await driver.close()


async def test_a_checker_that_dies_mid_session_costs_only_its_checks(
    start_node, keys, checkpoint
) -> None:
    primary, checker = await start_node([(0, 4)]), await start_node([(0, 4)])
    accounts = {primary.node_id: "op-a", checker.node_id: "op-b"}
    grant = keyed(
        keys, session_grant(keys, [(0, 4, primary, [checker])]), [primary, checker], accounts, 1.0
    )
    driver = driver_for(grant)
    tokens = await greedy(
        driver, PROMPT, NEW_TOKENS, after_step={3: lambda: checker.server.stop(0)}
    )
    assert tokens == reference_greedy(checkpoint, PROMPT, NEW_TOKENS)
    assert not driver.failovers, "a checker's failure is not the primary's"
    stats = driver.verifier.stats
    assert 0 < stats.checked[primary.node_id] < stats.calls[primary.node_id]
    await driver.close()


@pytest.mark.parametrize("hedge", [True, False], ids=["hedged", "failed-over"])
async def test_a_node_the_driver_left_checks_no_other_span(start_node, keys, checkpoint, hedge):
    # P is the first stage's primary and the second stage's only checker; every call is
    # checked. P hangs after step 4 (a PC gone to sleep): the driver leaves it for Q, by a
    # hedge or at the straggler deadline. The second stage had drawn P as its checker, and
    # each check there would hold its token for the whole patience (5 s here), then give
    # P up: P is dropped as a checker the moment the driver leaves it.
    p = await start_node([(0, 4)], servicer_class=HangingServicer)
    q, r = await start_node([(0, 2)]), await start_node([(2, 4)])
    accounts = {p.node_id: "op-a", q.node_id: "op-b", r.node_id: "op-c"}
    layout = [(0, 2, p, [q]), (2, 4, r, [p])]
    grant = keyed(keys, session_grant(keys, layout), [p, q, r], accounts, 1.0)
    channels = ChannelPool()
    config = DriverConfig(deadline_floor_s=1.5, min_samples=2, hedge_factor=3.0 if hedge else 0.0,
                          hedge_floor_s=0.1)  # fmt: skip
    verifier = StageVerifier(grant.session_id, channels, rng=random.Random(1),
                             patience_floor_s=5.0)  # fmt: skip
    driver = PipelineDriver(grant, MODEL, channels=channels, verifier=verifier, config=config)

    async def hang() -> None:
        p.servicer.hang_after = p.servicer.calls

    started = time.monotonic()
    tokens = await greedy(driver, PROMPT, NEW_TOKENS, after_step={4: hang})
    elapsed = time.monotonic() - started
    assert tokens == reference_greedy(checkpoint, PROMPT, NEW_TOKENS)
    left = [h.slow_node_id for h in driver.hedges] + [f.failed_node_id for f in driver.failovers]
    assert left == [p.node_id]
    stats = verifier.stats
    assert stats.checked[r.node_id] >= 4  # by P, until it hung
    assert not stats.late, "a check was drawn on the node the driver had left"
    assert elapsed < 5.0, f"{elapsed:.1f} s: a check waited out its patience"
    await driver.close()
