"""The RTT prober pings the peers the coordinator names and reports averages in telemetry.

Real Stage servers on loopback (the fallback servicer answers Ping with its node id); one
sits behind a link emulator with 40 ms each way, so its RTT must show it.
"""

from __future__ import annotations

from types import SimpleNamespace

import grpc
import pytest
from support.link_emulator import LinkEmulator

from node_agent.data_plane import SERVER_OPTIONS, NoModelStageServicer
from node_agent.rtt_probe import MAX_PEERS, RttProber
from protos.tessera.v1 import coordinator_pb2, stage_pb2_grpc

pytestmark = pytest.mark.timeout(60)


async def stage_server(node_id: str) -> tuple[grpc.aio.Server, int]:
    server = grpc.aio.server(options=SERVER_OPTIONS)
    # Ping reads only the node id of the agent's context.
    servicer = NoModelStageServicer(SimpleNamespace(node_id=node_id))  # type: ignore[arg-type]
    stage_pb2_grpc.add_StageServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, port


def peer(node_id: str, address: str) -> coordinator_pb2.Peer:
    return coordinator_pb2.Peer(node_id=node_id, address=address)


async def test_rtts_follow_the_links_and_the_peer_list():
    near, near_port = await stage_server("near")
    far, far_port = await stage_server("far")
    prober = RttProber()
    try:
        async with LinkEmulator("127.0.0.1", far_port, delay_ms=40) as link:
            prober.set_peers(
                [
                    peer("near", f"127.0.0.1:{near_port}"),
                    peer("far", link.address),
                    # Something else answers at this address: its pings do not count.
                    peer("impostor", f"127.0.0.1:{near_port}"),
                    peer("gone", "127.0.0.1:1"),  # nothing listens: no sample, no error
                ]
            )
            for _ in range(3):
                await prober.probe_once()
            rtt = dict(prober.sample().rtt_ms)
            assert set(rtt) == {"near", "far"}
            assert rtt["far"] >= 80.0 and rtt["near"] < 40.0, rtt
            # A new list forgets the peers no longer on it.
            prober.set_peers([peer("near", f"127.0.0.1:{near_port}")])
            assert set(prober.sample().rtt_ms) == {"near"}
    finally:
        await prober.close()
        await near.stop(None)
        await far.stop(None)


async def test_a_huge_peer_list_is_cut_to_the_limit():
    prober = RttProber()
    prober.set_peers([peer(f"n{i:03d}", f"127.0.0.1:{1000 + i}") for i in range(500)])
    assert len(prober._peers) == MAX_PEERS
    prober.set_peers([peer("", "127.0.0.1:1"), peer("x", "")])  # malformed entries
    assert prober._peers == {}
    await prober.close()
