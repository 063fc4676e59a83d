"""A node the coordinator cannot dial back gets no shards, until it can: real processes.

A fourth node agent advertises an address that nobody answers on yet: a link emulator
(tests/support/link_emulator.py) in front of the node's real data-plane port, started
down, stands for a closed port or a NAT. Clients could not reach that node, so placing
shards on it would only make every session through it fail over. The coordinator dials
it again every second here (`--reachability-recheck 1`); once the link is up it answers,
and placement gives it shards like any other node.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from support.checkpoints import TINY_SHAPE, make_checkpoint, transformers_greedy
from support.link_emulator import LinkEmulator
from support.ports import free_port
from support.waiting import wait_for

from client.api import Client
from client.local_swarm import LocalSwarm
from protos.tessera.v1 import node_pb2

pytestmark = pytest.mark.slow

MODEL = "tiny-llama"
PROMPT = [1, 5, 9, 23, 42, 7, 11]
NEW_TOKENS = 12
NODES = ("alpha", "bravo", "charlie")


@pytest.fixture
def swarm(tmp_path: Path) -> Iterator[tuple[LocalSwarm, Path]]:
    checkpoint = make_checkpoint(
        tmp_path / "tiny", "llama", num_layers=6, **TINY_SHAPE, seed=7
    )
    with LocalSwarm(
        tmp_path / "swarm",
        coordinator_args=[
            "--min-stages", "3", "--replicas", "2", "--heartbeat-interval", "1",
            "--reachability-recheck", "1",
        ],
    ) as s:  # fmt: skip
        s.start_coordinator()
        nodes = [s.start_node(name) for name in NODES]
        s.wait_registered(nodes)
        s.add_model(checkpoint, MODEL)
        yield s, checkpoint


def shards(client: Client, node_id: str) -> list[node_pb2.ShardStatus]:
    return list({n.node_id: n for n in client.nodes()}[node_id].shards)


def test_an_unreachable_node_gets_shards_only_once_it_answers(swarm) -> None:
    s, checkpoint = swarm
    (reference,) = transformers_greedy(checkpoint, [PROMPT], NEW_TOKENS)
    port = free_port()
    link = LinkEmulator("127.0.0.1", port, down=True, name="closed port")
    advertised = link.start_in_thread()
    try:
        echo = s.start_node("echo", ["--listen", f"127.0.0.1:{port}", "--advertise", advertised])
        s.wait_registered([echo])
        with Client(s.address) as client:
            info = {n.node_id: n for n in client.nodes()}[echo.node_id]
            assert info.data_address == advertised and not info.reachable
            # The others serve the model with two replicas of every layer; the unreachable
            # node is re-dialed every second and stays without a shard.
            wait_for(
                lambda: min({m.name: m for m in client.models()}[MODEL].ready_replicas) >= 2,
                "two ready replicas on the reachable nodes",
                90,
            )
            for _ in range(3):
                assert shards(client, echo.node_id) == []
                assert link.stats.connections_accepted == 0  # nothing got through the port
                result = client.generate_all(
                    MODEL, token_ids=PROMPT, max_new_tokens=NEW_TOKENS, stop_at_eos=False
                )
                assert result.token_ids == reference and not result.failovers
                assert echo.node_id not in {h.node_id for h in result.route}
            assert "could not dial back" in s.coordinator.log_text()  # the operator is told

            link.set(down=False)  # the operator opened the port
            wait_for(
                lambda: any(
                    st.state == node_pb2.SHARD_STATE_READY for st in shards(client, echo.node_id)
                ),
                "the node to be placed once it answers",
                90,
            )
            assert {n.node_id: n for n in client.nodes()}[echo.node_id].reachable
            assert "answers at" in s.coordinator.log_text()
            result = client.generate_all(
                MODEL, token_ids=PROMPT, max_new_tokens=NEW_TOKENS, stop_at_eos=False
            )
            assert result.token_ids == reference
    finally:
        link.stop_thread()
