"""A node the coordinator cannot dial back gets no shards, until it can: real processes.

A fourth node agent advertises an address that nobody answers on yet: a link emulator
(tests/support/link_emulator.py) in front of the node's real data-plane port, started
down, stands for a closed port or a NAT. Clients could not reach that node, so placing
shards on it would only make every session through it fail over. The coordinator dials
it again every second here (`--reachability-recheck 1`); once the link is up it answers,
and placement gives it shards like any other node. A placed node whose line goes down later
leaves placement once a driver reports it and the coordinator's own dial fails. With the
relay (`--relay-host`), a node nobody can dial serves through a tunnel it dials out.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from support.checkpoints import TINY_SHAPE, make_checkpoint, transformers_greedy
from support.link_emulator import LinkEmulator
from support.ports import free_port, free_port_range
from support.tls_files import write_tls_files
from support.waiting import wait_for

from client.api import Client
from client.local_swarm import LocalProcess, LocalSwarm
from protos.dialing import CA_ENV
from protos.tessera.v1 import client_api_pb2, client_api_pb2_grpc, node_pb2

pytestmark = pytest.mark.slow

MODEL = "tiny-llama"
PROMPT = [1, 5, 9, 23, 42, 7, 11]
NEW_TOKENS = 12
NODES = ("alpha", "bravo", "charlie")


@pytest.fixture
def swarm(tmp_path: Path) -> Iterator[tuple[LocalSwarm, Path]]:
    checkpoint = make_checkpoint(tmp_path / "tiny", "llama", num_layers=6, **TINY_SHAPE, seed=7)
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


def serves(client: Client, node_id: str) -> bool:
    return any(st.state == node_pb2.SHARD_STATE_READY for st in shards(client, node_id))


def reachable(client: Client, node_id: str) -> bool:
    return {n.node_id: n for n in client.nodes()}[node_id].reachable


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
            wait_for(lambda: serves(client, echo.node_id), "the node to be placed", 90)
            assert reachable(client, echo.node_id)
            assert "answers at" in s.coordinator.log_text()
            result = client.generate_all(
                MODEL, token_ids=PROMPT, max_new_tokens=NEW_TOKENS, stop_at_eos=False
            )
            assert result.token_ids == reference
    finally:
        link.stop_thread()


def granted(client_channel: grpc.Channel) -> client_api_pb2.SessionGrant:
    return client_api_pb2_grpc.ClientApiStub(client_channel).OpenSession(
        client_api_pb2.OpenSessionRequest(model=MODEL, max_length=32), timeout=30
    )


def grants(grant: client_api_pb2.SessionGrant) -> set[str]:
    claims = client_api_pb2.CapabilityClaims.FromString(grant.capability.claims)
    return {g.node_id for g in claims.grants}


def granted_once(client_channel: grpc.Channel) -> client_api_pb2.SessionGrant:
    """What a new session is granted (the session is closed again at once)."""
    grant = granted(client_channel)
    client_api_pb2_grpc.ClientApiStub(client_channel).CloseSession(
        client_api_pb2.CloseSessionRequest(
            session_id=grant.session_id, capability=grant.capability
        ),
        timeout=30,
    )
    return grant


def routed_now(client_channel: grpc.Channel) -> set[str]:
    """The nodes a new session is granted."""
    return grants(granted_once(client_channel))


def routed_addresses(client_channel: grpc.Channel) -> set[str]:
    """The addresses a new session is granted; none while no node serves the model."""
    try:
        grant = granted_once(client_channel)
    except grpc.RpcError as err:
        if err.code() == grpc.StatusCode.UNAVAILABLE:  # type: ignore[attr-defined]
            return set()
        raise
    claims = client_api_pb2.CapabilityClaims.FromString(grant.capability.claims)
    return {g.address for g in claims.grants}


def report_unreachable(
    client_channel: grpc.Channel, grant: client_api_pb2.SessionGrant, node_id: str
) -> None:
    """What a driver that could not connect to ``node_id`` says with its step times."""
    client_api_pb2_grpc.ClientApiStub(client_channel).ReportStepTimes(
        client_api_pb2.StepTimesReport(
            session_id=grant.session_id,
            capability=grant.capability,
            unreachable_node_ids=[node_id],
        ),
        timeout=30,
    )


def test_a_node_clients_cannot_reach_any_more_leaves_placement_until_it_answers(swarm) -> None:
    # Its line goes down while its own Attach stream (which it dialed out) stays up, as when
    # a router's port forwarding is lost: only the clients notice.
    s, _ = swarm
    port = free_port()
    link = LinkEmulator("127.0.0.1", port, name="echo's line")
    advertised = link.start_in_thread()
    try:
        echo = s.start_node("echo", ["--listen", f"127.0.0.1:{port}", "--advertise", advertised])
        s.wait_registered([echo])
        with Client(s.address) as client, grpc.insecure_channel(s.address) as channel:
            wait_for(lambda: serves(client, echo.node_id), "echo to be placed", 90)
            grant = granted(channel)
            assert echo.node_id in grants(grant)
            link.set(down=True)
            report_unreachable(channel, grant, echo.node_id)
            # The coordinator dials it back itself, and takes it out of placement.
            wait_for(lambda: not reachable(client, echo.node_id), "the dial back to fail", 30)
            wait_for(lambda: echo.node_id not in routed_now(channel), "new routes without it")
            assert {n.node_id: n for n in client.nodes()}[echo.node_id].state == (
                node_pb2.NODE_STATE_ONLINE
            )

            link.set(down=False)
            wait_for(lambda: reachable(client, echo.node_id), "the node to answer again", 30)
            wait_for(lambda: echo.node_id in routed_now(channel), "routes with it again", 90)
    finally:
        link.stop_thread()


@contextlib.contextmanager
def one_node_swarm(
    tmp_path: Path, checkpoint: Path, port: int, advertised: str, args: list[str]
) -> Iterator[tuple[LocalSwarm, LocalProcess]]:
    """A coordinator run with ``args`` and one node, echo, that listens on ``port`` and
    advertises ``advertised`` (a link emulator in front of that port), with the model."""
    with LocalSwarm(tmp_path / "swarm", coordinator_args=args) as s:
        s.start_coordinator()
        echo = s.start_node("echo", ["--listen", f"127.0.0.1:{port}", "--advertise", advertised])
        s.wait_registered([echo])
        s.add_model(checkpoint, MODEL)
        yield s, echo


@pytest.mark.parametrize("tls", [False, True], ids=["plain", "coordinator-over-tls"])
def test_a_node_nobody_can_dial_serves_through_the_relay(
    tmp_path: Path, tls: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The only node advertises an address nobody answers on (a NAT). The coordinator runs
    # the relay (--relay-host): the node dials out a tunnel, the relay gives it a port of
    # its own, and every session reaches the node through it. With the coordinator over
    # TLS the tunnel is a TLS stream to the coordinator's port like the node's others.
    checkpoint = make_checkpoint(tmp_path / "tiny", "llama", num_layers=6, **TINY_SHAPE, seed=7)
    (reference,) = transformers_greedy(checkpoint, [PROMPT], NEW_TOKENS)
    port = free_port()
    nat = LinkEmulator("127.0.0.1", port, down=True, name="behind NAT")
    advertised = nat.start_in_thread()
    low, high = free_port_range(8)
    args = ["--replicas", "1", "--heartbeat-interval", "1", "--relay-host", "127.0.0.1",
            "--relay-bind", "127.0.0.1", "--relay-ports", f"{low}-{high}"]  # fmt: skip
    if tls:
        files = write_tls_files(tmp_path / "tls")
        monkeypatch.setenv(CA_ENV, str(files.ca))
        args += ["--tls-cert", str(files.cert), "--tls-key", str(files.key)]
    try:
        with one_node_swarm(tmp_path, checkpoint, port, advertised, args) as (s, echo):
            assert s.address.startswith("grpcs://") == tls
            with Client(s.address) as client:
                wait_for(lambda: serves(client, echo.node_id), "the node to be placed", 90)
                assert not reachable(client, echo.node_id)
                result = client.generate_all(
                    MODEL, token_ids=PROMPT, max_new_tokens=NEW_TOKENS, stop_at_eos=False
                )
            assert result.token_ids == reference and not result.failovers
            # Every hop went to the relay's port for the node, never to its own address.
            relayed = {h.address for h in result.route}
            assert len(relayed) == 1 and advertised not in relayed
            assert low <= int(relayed.pop().rsplit(":", 1)[1]) <= high  # --relay-ports
            assert "reachable at" in s.coordinator.log_text()
            assert "through the relay at" in echo.log_text()
            assert nat.stats.connections_accepted == 0
    finally:
        nat.stop_thread()


def test_a_node_clients_cannot_reach_any_more_serves_through_the_relay(tmp_path: Path) -> None:
    # The only node loses its port forwarding after it was placed. The coordinator runs the
    # relay: once its dial-back fails, it tells the node, which opens a tunnel, and sessions
    # reach the node through the relay. The port comes back: the node is dialed directly
    # again and closes its tunnel.
    checkpoint = make_checkpoint(tmp_path / "tiny", "llama", num_layers=6, **TINY_SHAPE, seed=7)
    (reference,) = transformers_greedy(checkpoint, [PROMPT], NEW_TOKENS)
    port = free_port()
    link = LinkEmulator("127.0.0.1", port, name="echo's line")
    advertised = link.start_in_thread()
    args = ["--replicas", "1", "--heartbeat-interval", "1", "--reachability-recheck", "1",
            "--relay-host", "127.0.0.1"]  # fmt: skip

    def served_at(client: Client) -> set[str]:
        result = client.generate_all(
            MODEL, token_ids=PROMPT, max_new_tokens=NEW_TOKENS, stop_at_eos=False
        )
        assert result.token_ids == reference
        return {h.address for h in result.route}

    try:
        with one_node_swarm(tmp_path, checkpoint, port, advertised, args) as (s, echo):
            with Client(s.address) as client, grpc.insecure_channel(s.address) as channel:
                wait_for(lambda: serves(client, echo.node_id), "echo to be placed", 90)
                assert reachable(client, echo.node_id)
                assert served_at(client) == {advertised}
                link.set(down=True)
                report_unreachable(channel, granted(channel), echo.node_id)
                wait_for(lambda: not reachable(client, echo.node_id), "the dial back to fail", 30)
                wait_for(
                    lambda: routed_addresses(channel) - {advertised}, "routes through the relay", 60
                )
                relayed = served_at(client)
                assert advertised not in relayed and len(relayed) == 1
                assert "through the coordinator's relay from now on" in echo.log_text()
                accepted = link.stats.connections_accepted

                link.set(down=False)  # the port forwarding is back
                wait_for(lambda: reachable(client, echo.node_id), "the node to answer again", 30)
                wait_for(lambda: routed_addresses(channel) == {advertised}, "direct routes", 60)
                assert served_at(client) == {advertised}
                assert link.stats.connections_accepted > accepted
                wait_for(lambda: "relay: the tunnel of node" in s.coordinator.log_text(),
                         "the node to close its tunnel", 30)  # fmt: skip
    finally:
        link.stop_thread()
