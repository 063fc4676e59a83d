"""The node agent as a real process against a real coordinator (and a real Mosquitto)."""

import asyncio
import json
import os
import re
import signal
import time
from pathlib import Path

import aiomqtt
import grpc
import pytest
from support.mosquitto import mosquitto, mosquitto_broker  # noqa: F401
from support.procs import start_coordinator, start_node

from coordinator.server import running_coordinator
from coordinator.settings import Settings
from node_agent import failpoints
from node_agent.mqtt_presence import parse_broker_url, presence_topic, telemetry_topic
from protos import codec
from protos.tessera.v1 import (
    admin_pb2,
    admin_pb2_grpc,
    client_api_pb2,
    client_api_pb2_grpc,
    node_pb2,
    stage_pb2,
    stage_pb2_grpc,
)

pytestmark = pytest.mark.slow

FAST = {"TESSERA_BACKOFF_BASE_S": "0.05", "TESSERA_BACKOFF_CAP_S": "0.5"}
NODE_ARGS = ["--listen", "127.0.0.1:0", "--benchmark-s", "0.05"]
OPTIONS = [
    ("grpc.max_receive_message_length", codec.MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", codec.MAX_MESSAGE_BYTES),
]


async def list_nodes(address: str) -> dict[str, node_pb2.NodeInfo]:
    async with grpc.aio.insecure_channel(address, options=OPTIONS) as channel:
        stub = client_api_pb2_grpc.ClientApiStub(channel)
        reply = await stub.ListNodes(
            client_api_pb2.ListNodesRequest(include_offline=True), timeout=5
        )
    return {node.node_id: node for node in reply.nodes}


async def wait_for_state(address: str, node_id: str, state: int, timeout: float = 20.0):
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    seen = None
    while loop.time() < deadline:
        try:
            seen = (await list_nodes(address)).get(node_id)
        except grpc.aio.AioRpcError:
            seen = None  # the coordinator may be restarting
        if seen is not None and seen.state == state:
            return seen
        await asyncio.sleep(0.05)
    got = node_pb2.NodeState.Name(seen.state) if seen else "not listed"
    raise AssertionError(f"{node_id} did not become {node_pb2.NodeState.Name(state)}: {got}")


async def test_register_list_ping_restart_and_sigterm(tmp_path: Path) -> None:
    coord = start_coordinator(tmp_path, heartbeat_interval=0.5)
    with coord:
        node = start_node(coord.address, tmp_path / "n1", "n1", NODE_ARGS, env=FAST)
        with node:
            info = await wait_for_state(coord.address, node.node_id, node_pb2.NODE_STATE_ONLINE)
            assert info.name == "n1"
            assert info.capabilities.device_kind == "cpu"
            assert info.capabilities.matmul_tflops > 0
            assert "float32" in info.capabilities.dtypes
            assert info.data_address.startswith("127.0.0.1:")

            # The data plane the node advertised answers, with the node's own id.
            async with grpc.aio.insecure_channel(info.data_address, options=OPTIONS) as ch:
                pong = await stage_pb2_grpc.StageStub(ch).Ping(
                    stage_pb2.PingRequest(payload=b"rtt"), timeout=5
                )
            assert pong.node_id == node.node_id

            # The coordinator crashes and comes back on the same address and database.
            coord.kill()
            since = node.process.log_offset()
            node.process.wait_for_line("not attached to coordinator", since=since)
            coord = start_coordinator(
                tmp_path, data_dir=coord.data_dir, listen=coord.address, heartbeat_interval=0.5
            )
            again = node.process.wait_for_line(r"registered as (\S+)", since=since)
            assert again.group(1) == node.node_id
            await wait_for_state(coord.address, node.node_id, node_pb2.NODE_STATE_ONLINE)
            assert list(await list_nodes(coord.address)) == [node.node_id]

            # SIGTERM: draining (confirmed by the coordinator), then a clean exit.
            since = node.process.log_offset()
            node.process.send_signal(signal.SIGTERM)
            assert node.process.wait(timeout=30) == 0
            log = node.process.log_text()[since:]
            assert re.search(r"coordinator state: ONLINE -> DRAINING", log), log
            assert log.index("DRAINING") < log.index("closed the stream")
            await wait_for_state(coord.address, node.node_id, node_pb2.NODE_STATE_OFFLINE)

        # Same data dir, same key, same id.
        node = start_node(coord.address, tmp_path / "n1", "n1", NODE_ARGS, env=FAST)
        with node:
            assert node.node_id == info.node_id
            await wait_for_state(coord.address, node.node_id, node_pb2.NODE_STATE_ONLINE)
            assert node.process.terminate() == 0
        coord.kill()


async def test_an_admin_drain_makes_the_node_leave_cleanly(tmp_path: Path) -> None:
    with start_coordinator(tmp_path, heartbeat_interval=0.5) as coord:
        with start_node(coord.address, tmp_path / "n1", "n1", NODE_ARGS, env=FAST) as node:
            await wait_for_state(coord.address, node.node_id, node_pb2.NODE_STATE_ONLINE)
            async with grpc.aio.insecure_channel(coord.address, options=OPTIONS) as channel:
                await admin_pb2_grpc.AdminStub(channel).DrainNode(
                    admin_pb2.DrainNodeRequest(node_id=node.node_id, reason="maintenance"),
                    metadata=(("authorization", f"Bearer {coord.admin_token}"),),
                    timeout=5,
                )
            assert node.process.wait(timeout=30) == 0
            assert "asks this node to drain (maintenance)" in node.process.log_text()
            await wait_for_state(coord.address, node.node_id, node_pb2.NODE_STATE_OFFLINE)


async def test_a_hung_node_is_offline_once_it_leaves_a_ping_unanswered(tmp_path: Path) -> None:
    # Heartbeats 20 s apart: within the test only the coordinator's keepalive pings (every
    # quiet 0.5 s, answered within 5 s) can find the node hung.
    settings = Settings(
        db_path=tmp_path / "c.db", data_dir=tmp_path / "c", heartbeat_interval_s=0.5,
        offline_after_s=1.5, telemetry_every_intervals=40,
    )  # fmt: skip
    async with running_coordinator(settings) as coordinator:
        address = coordinator.address
        # In a thread: start_node waits for the node to register, with this loop serving.
        node = await asyncio.to_thread(start_node, address, tmp_path / "n1", "n1", NODE_ARGS,
                                       env=FAST)  # fmt: skip
        with node:
            await wait_for_state(address, node.node_id, node_pb2.NODE_STATE_ONLINE)
            assert "keepalive pings in between" in node.process.log_text()
            os.kill(node.process.pid, signal.SIGSTOP)  # alive to TCP, deaf to pings
            try:
                await wait_for_state(address, node.node_id, node_pb2.NODE_STATE_OFFLINE, 12)
            finally:
                os.kill(node.process.pid, signal.SIGCONT)


@pytest.mark.mqtt
async def test_mqtt_presence_telemetry_and_last_will(tmp_path: Path, mosquitto: str) -> None:  # noqa: F811
    broker = parse_broker_url(mosquitto)
    messages: list[tuple[str, dict]] = []
    subscribed = asyncio.Event()

    async def subscribe() -> None:
        async with aiomqtt.Client(broker.host, broker.port) as client:
            await client.subscribe("tessera/nodes/#", qos=1)
            subscribed.set()
            async for message in client.messages:
                messages.append((str(message.topic), json.loads(message.payload)))

    async def wait_for(predicate, what: str, timeout: float = 20.0) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while not predicate():
            assert loop.time() < deadline, f"no {what}; got {messages}"
            await asyncio.sleep(0.05)

    subscriber = asyncio.create_task(subscribe())
    try:
        await asyncio.wait_for(subscribed.wait(), 10)
        with start_coordinator(tmp_path, heartbeat_interval=0.3) as coord:
            args = [*NODE_ARGS, "--mqtt", mosquitto]
            # Its clock two hours ahead: presence is stamped by the coordinator's clock,
            # which the coordinator compares with when the node attached.
            env = {**FAST, failpoints.ENV_VAR: "clock_skew_s=7200"}
            with start_node(coord.address, tmp_path / "n1", "n1", args, env=env) as node:
                presence, telemetry = presence_topic(node.node_id), telemetry_topic(node.node_id)

                def states() -> list[str]:
                    return [m["state"] for t, m in messages if t == presence]

                await wait_for(lambda: "online" in states(), "online presence")
                online = next(m for t, m in messages if t == presence)
                assert abs(online["ts"] - time.time() * 1000) < 60_000, online
                await wait_for(lambda: any(t == telemetry for t, _ in messages), "telemetry")
                sample = next(m for t, m in messages if t == telemetry)
                assert sample["memory_used_bytes"] > 0

                node.kill()  # no goodbye: only the broker's last will can tell
                await wait_for(lambda: states()[-1:] == ["offline"], "the last will")
                will = [m for t, m in messages if t == presence][-1]
                assert will == {"state": "offline", "node_id": node.node_id}
    finally:
        subscriber.cancel()
        await asyncio.gather(subscriber, return_exceptions=True)
