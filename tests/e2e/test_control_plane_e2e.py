"""The control plane with real processes: three node agents, kill -9 of a node and of the
coordinator, SIGTERM drain. Heartbeats are 0.5 s so failures show quickly."""

from __future__ import annotations

import re
import signal
import time

import pytest

from client.api import Client
from client.local_swarm import LocalSwarm
from protos.tessera.v1 import node_pb2

pytestmark = pytest.mark.slow

HEARTBEAT_S = 0.5
NAMES = ("n1", "n2", "n3")


def states(client: Client) -> dict[str, int]:
    return {n.node_id: n.state for n in client.nodes(include_offline=True)}


def wait_state(client: Client, node_id: str, state: int, timeout_s: float) -> float:
    """Seconds until node_id reached state; fails after timeout_s."""
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        if states(client).get(node_id) == state:
            return time.monotonic() - start
        time.sleep(0.02)
    got = node_pb2.NodeState.Name(states(client).get(node_id, 0))
    raise AssertionError(f"{node_id} not {node_pb2.NodeState.Name(state)} in {timeout_s}s: {got}")


def test_three_nodes_kill_9_restart_and_drain(tmp_path):
    args = ["--heartbeat-interval", str(HEARTBEAT_S)]
    with LocalSwarm(tmp_path, coordinator_args=args) as swarm:
        address = swarm.start_coordinator()
        nodes = [swarm.start_node(name) for name in NAMES]
        swarm.wait_registered(nodes)
        ids = [p.node_id for p in nodes]
        assert len(set(ids)) == 3, "distinct ids"
        with Client(address) as client:
            for node_id in ids:
                wait_state(client, node_id, node_pb2.NODE_STATE_ONLINE, 30)

            # kill -9 of a node: offline within two heartbeat intervals.
            nodes[0].kill9()
            took = wait_state(client, ids[0], node_pb2.NODE_STATE_OFFLINE, 10)
            assert took <= 2 * HEARTBEAT_S, f"offline after {took:.2f}s"

            # kill -9 of the coordinator, restart on the same database and address.
            swarm.coordinator.kill9()
        restarted = [swarm.start_node("n1")]
        swarm.start_coordinator(listen=address)
        swarm.wait_registered(restarted)
        assert restarted[0].node_id == ids[0], "the same key keeps the same id"
        with Client(address) as client:
            for node_id in ids:
                wait_state(client, node_id, node_pb2.NODE_STATE_ONLINE, 60)
            listed = [n.node_id for n in client.nodes(include_offline=True)]
            assert sorted(listed) == sorted(ids), "every node known once, none duplicated"

            # SIGTERM: the node drains, then goes offline, and exits cleanly.
            leaving = nodes[2]
            leaving.popen.send_signal(signal.SIGTERM)
            assert leaving.popen.wait(timeout=60) == 0
            log = leaving.log_text()
            assert re.search(r"DRAINING", log), log[-2000:]
            wait_state(client, ids[2], node_pb2.NODE_STATE_OFFLINE, 10)
