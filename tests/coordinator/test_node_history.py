"""Reliability from history: departures and time online per node (coordinator/reliability.py),
as the planner gets them from a real coordinator, across its restarts, and the ledger's
price beside them."""

from __future__ import annotations

import contextlib
from pathlib import Path

import grpc
import pytest
from support.coordinator_harness import (
    CHANNEL_OPTIONS,
    FakeNode,
    good_capabilities,
    harness_settings,
    wait_until,
)

from coordinator.node_state import RESTART_REASON, SHUTDOWN_REASON, NodeState
from coordinator.planner import PRIOR_LEAVE_RATE_PER_H
from coordinator.reliability import NodeHistory, leave_rate_per_h
from coordinator.server import running_coordinator
from protos.tessera.v1 import client_api_pb2, client_api_pb2_grpc

HOUR_MS = 3_600_000


def test_the_estimate_starts_at_the_prior_and_follows_the_history():
    assert leave_rate_per_h(0, 0.0) == pytest.approx(PRIOR_LEAVE_RATE_PER_H)
    # Five departures in an hour online: (5 + 1) / (1 + 1 / prior) an hour.
    assert leave_rate_per_h(5, 3600.0) == pytest.approx(6 / (1 + 1 / PRIOR_LEAVE_RATE_PER_H))
    # A day online without leaving: the estimate falls as the node stays.
    assert leave_rate_per_h(0, 86_400.0) == pytest.approx(1 / (24 + 1 / PRIOR_LEAVE_RATE_PER_H))
    assert leave_rate_per_h(0, 86_400.0) < PRIOR_LEAVE_RATE_PER_H / 15
    assert leave_rate_per_h(0, -5.0) == leave_rate_per_h(0, 0.0)  # clock skew is no credit


def test_departures_and_time_online_from_state_changes():
    history = NodeHistory()
    assert history.leave_rate_per_h("ghost", 0) == PRIOR_LEAVE_RATE_PER_H
    t = 0
    for _ in range(3):  # online for 10 minutes, then gone, three times
        history.observe("a", NodeState.ONLINE.value, t)
        history.observe("a", NodeState.SUSPECT.value, t + 300_000)  # still connected
        history.observe("a", NodeState.OFFLINE.value, t + 600_000, "the stream broke")
        t += HOUR_MS
    history.observe("b", NodeState.ONLINE.value, 0)
    history.observe("b", NodeState.DRAINING.value, 2 * HOUR_MS)
    history.observe("b", NodeState.BANNED.value, 3 * HOUR_MS, "proven fraud")
    assert history.departures("a") == 3 and history.departures("b") == 1
    assert history.leave_rate_per_h("a", t) == pytest.approx(leave_rate_per_h(3, 1800.0))
    assert history.leave_rate_per_h("b", t) == pytest.approx(leave_rate_per_h(1, 3 * 3600.0))
    # The current session counts up to now.
    history.observe("c", NodeState.ONLINE.value, 0)
    assert history.leave_rate_per_h("c", 5 * HOUR_MS) == pytest.approx(
        leave_rate_per_h(0, 5 * 3600)
    )


def test_the_coordinators_own_outages_are_not_departures():
    history = NodeHistory()
    history.observe("a", NodeState.ONLINE.value, 0)
    history.observe("a", NodeState.OFFLINE.value, HOUR_MS, SHUTDOWN_REASON)
    history.observe("a", NodeState.ONLINE.value, 2 * HOUR_MS)
    history.observe("a", NodeState.SUSPECT.value, 3 * HOUR_MS)
    # A crash: the coordinator marks the node offline when it is back, hours later; the
    # node's time online counts to the last change the coordinator saw.
    history.observe("a", NodeState.OFFLINE.value, 9 * HOUR_MS, RESTART_REASON)
    assert history.departures("a") == 0
    assert history.leave_rate_per_h("a", 10 * HOUR_MS) == pytest.approx(
        leave_rate_per_h(0, 2 * 3600)
    )


async def _connect(address: str) -> grpc.aio.Channel:
    return grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)


async def test_a_coordinator_gives_the_planner_history_and_price_and_keeps_them_across_restarts(
    tmp_path: Path,
):
    settings = harness_settings(tmp_path)
    async with contextlib.AsyncExitStack() as stack:
        coordinator = await stack.enter_async_context(running_coordinator(settings))
        channel = await _connect(coordinator.address)
        stack.push_async_callback(channel.close)
        registry, placement = coordinator.ctx.registry, coordinator.ctx.planner
        flapper, steady = FakeNode(channel, "flapper"), FakeNode(channel, "steady")
        await flapper.register(capabilities=good_capabilities(price_per_1k_token_layers_units=7))
        await steady.register()
        await steady.attach()
        for _ in range(3):  # the flapper's agent comes and goes
            await flapper.attach()
            flapper.call.cancel()
            await wait_until(
                lambda: registry.node(flapper.node_id).state is NodeState.OFFLINE,
                what="the flapper to go offline",
            )
        await flapper.attach()
        flapping = placement.leave_rate_of(flapper.node_id)
        assert flapping == pytest.approx(leave_rate_per_h(3, 0.0), rel=1e-3)
        assert placement.leave_rate_of(steady.node_id) < PRIOR_LEAVE_RATE_PER_H
        assert placement.price_of(flapper.node_id) == 7.0
        assert placement.price_of(steady.node_id) == settings.default_price_units
        # Operators see it too (tessera nodes, tessera-coordinator nodes list).
        listing = await client_api_pb2_grpc.ClientApiStub(channel).ListNodes(
            client_api_pb2.ListNodesRequest()
        )
        shown = {n.node_id: n.reliability for n in listing.nodes}
        assert shown[flapper.node_id].departures == 3
        assert shown[flapper.node_id].leave_rate_per_h == pytest.approx(flapping, rel=1e-3)
        assert shown[steady.node_id].departures == 0 and shown[steady.node_id].hours_online > 0
    # A new coordinator on the same database (the stop above ended every stream: not the
    # nodes' departures) reads the history back.
    async with running_coordinator(settings) as coordinator:
        placement = coordinator.ctx.planner
        assert placement.leave_rate_of(flapper.node_id) == pytest.approx(
            leave_rate_per_h(3, 0.0), rel=1e-3
        )
        assert placement.leave_rate_of(steady.node_id) < PRIOR_LEAVE_RATE_PER_H
