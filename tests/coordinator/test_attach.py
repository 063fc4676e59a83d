"""The Attach stream: hello, heartbeats, the state machine, commands, and a broken stream."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from support.coordinator_harness import Harness, wait_until

from coordinator.node_state import NodeState
from coordinator.registry import NodeStateChanged, ShardStatusReported, TelemetryReported
from protos.tessera.v1 import client_api_pb2, common_pb2, coordinator_pb2, node_pb2


def hello(node_id: str, ticket: bytes) -> coordinator_pb2.NodeMessage:
    return coordinator_pb2.NodeMessage(
        hello=coordinator_pb2.AttachHello(node_id=node_id, attach_ticket=ticket)
    )


async def stream_error(call) -> grpc.aio.AioRpcError:
    """Read until the stream fails; return the error."""
    with pytest.raises(grpc.aio.AioRpcError) as info:
        while True:
            message = await call.read()
            assert message is not grpc.aio.EOF, "the stream ended with OK"
    return info.value


async def test_attach_marks_online_and_acks_heartbeats(harness: Harness) -> None:
    node = await harness.registered_node("n1")
    assert harness.state(node.node_id) is NodeState.OFFLINE
    await node.attach()
    assert harness.state(node.node_id) is NodeState.ONLINE

    ack = await node.heartbeat(7)
    assert ack.WhichOneof("kind") == "heartbeat_ack"
    assert ack.heartbeat_ack.seq == 7
    assert ack.heartbeat_ack.state == node_pb2.NODE_STATE_ONLINE


async def test_unknown_node_is_not_found(harness: Harness) -> None:
    call = harness.coordinator_stub.Attach()
    await call.write(hello("n0000000000000000000000", b"t" * 32))
    error = await stream_error(call)
    assert error.code() == grpc.StatusCode.NOT_FOUND
    assert "Register first" in error.details()


async def test_wrong_ticket_is_unauthenticated(harness: Harness) -> None:
    node = await harness.registered_node()
    call = harness.coordinator_stub.Attach()
    await call.write(hello(node.node_id, b"x" * 32))
    error = await stream_error(call)
    assert error.code() == grpc.StatusCode.UNAUTHENTICATED
    assert harness.state(node.node_id) is NodeState.OFFLINE
    await node.attach()  # the right ticket still works


async def test_first_message_must_be_hello(harness: Harness) -> None:
    call = harness.coordinator_stub.Attach()
    await call.write(coordinator_pb2.NodeMessage(heartbeat=coordinator_pb2.Heartbeat(seq=1)))
    error = await stream_error(call)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "hello" in error.details()


async def test_stream_closed_before_hello(harness: Harness) -> None:
    call = harness.coordinator_stub.Attach()
    await call.done_writing()
    error = await stream_error(call)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_second_hello_and_empty_message_are_invalid(harness: Harness) -> None:
    node = await harness.registered_node(attach=True)
    await node.call.write(hello(node.node_id, node.ticket))
    error = await stream_error(node.call)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    await harness.wait_state(node.node_id, NodeState.OFFLINE)

    await node.attach()
    await node.call.write(coordinator_pb2.NodeMessage())
    error = await stream_error(node.call)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "empty" in error.details()


async def test_second_attach_wins_and_old_stream_is_aborted(harness: Harness) -> None:
    node = await harness.registered_node()
    old = await node.attach()
    new = await node.attach()

    error = await stream_error(old)
    assert error.code() == grpc.StatusCode.ABORTED
    assert "newer Attach" in error.details()
    # The newer stream keeps working and the node stays online throughout.
    ack = await node.heartbeat(1, call=new)
    assert ack.heartbeat_ack.seq == 1
    assert harness.state(node.node_id) is NodeState.ONLINE
    assert harness.registry.attached_count == 1


async def test_heartbeats_update_telemetry(harness: Harness) -> None:
    node = await harness.registered_node(attach=True)
    telemetry = node_pb2.Telemetry(
        memory_used_bytes=123, utilization=0.5, queue_length=2, active_sessions=1,
        rtt_ms={"n-peer": 12.5},
    )  # fmt: skip
    await node.heartbeat(1, telemetry)

    view = harness.registry.node(node.node_id)
    assert view.telemetry.memory_used_bytes == 123
    assert view.telemetry.rtt_ms["n-peer"] == 12.5
    listed = await harness.client_api.ListNodes(client_api_pb2.ListNodesRequest())
    assert listed.nodes[0].telemetry.utilization == 0.5


async def test_bad_telemetry_is_invalid_argument(harness: Harness) -> None:
    node = await harness.registered_node(attach=True)
    beat = coordinator_pb2.Heartbeat(seq=1)
    beat.telemetry.utilization = float("nan")
    await node.call.write(coordinator_pb2.NodeMessage(heartbeat=beat))
    error = await stream_error(node.call)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "utilization" in error.details()


async def test_silence_makes_suspect_then_offline(start_harness) -> None:
    harness: Harness = await start_harness(heartbeat_interval_s=0.2, offline_after_s=0.8)
    node = await harness.registered_node(attach=True)
    await harness.wait_state(node.node_id, NodeState.SUSPECT, timeout=3)

    # A heartbeat brings it back.
    ack = await node.heartbeat(1)
    assert ack.heartbeat_ack.state == node_pb2.NODE_STATE_ONLINE

    await harness.wait_state(node.node_id, NodeState.OFFLINE, timeout=3)
    error = await stream_error(node.call)
    assert error.code() == grpc.StatusCode.UNAVAILABLE
    assert "no heartbeat" in error.details()
    harness.registry.flush()
    transitions = [(c.from_state, c.to_state) for c in harness.registry.repo.events(node.node_id)]
    assert transitions == [
        (None, "offline"), ("offline", "online"), ("online", "suspect"), ("suspect", "online"),
        ("online", "suspect"), ("suspect", "offline"),
    ]  # fmt: skip


async def test_steady_heartbeats_keep_a_node_online(start_harness) -> None:
    harness: Harness = await start_harness(heartbeat_interval_s=0.2, offline_after_s=0.8)
    node = await harness.registered_node(attach=True)
    changes = []
    harness.registry.add_listener(
        lambda e: changes.append(e) if isinstance(e, NodeStateChanged) else None
    )
    for seq in range(10):  # 1 s of heartbeats, longer than offline_after
        ack = await node.heartbeat(seq)
        assert ack.heartbeat_ack.state == node_pb2.NODE_STATE_ONLINE
        await asyncio.sleep(0.1)
    assert changes == []


async def test_broken_stream_marks_offline_at_once(harness: Harness) -> None:
    # Heartbeat interval is 60 s: only the broken stream can explain going offline.
    node = await harness.registered_node(attach=True)
    await node.heartbeat(1)
    node.call.cancel()
    await harness.wait_state(node.node_id, NodeState.OFFLINE, timeout=5)
    assert harness.registry.attached_count == 0


async def test_closing_the_stream_marks_offline(harness: Harness) -> None:
    node = await harness.registered_node(attach=True)
    await node.call.done_writing()
    assert await node.call.read() is grpc.aio.EOF
    assert await node.call.code() == grpc.StatusCode.OK
    await harness.wait_state(node.node_id, NodeState.OFFLINE)


async def test_node_drain_request(harness: Harness) -> None:
    node = await harness.registered_node(attach=True)
    drain = coordinator_pb2.DrainRequest(reason="SIGTERM")
    await node.call.write(coordinator_pb2.NodeMessage(drain=drain))
    await harness.wait_state(node.node_id, NodeState.DRAINING)
    # Heartbeats while draining keep it draining.
    ack = await node.heartbeat(2)
    assert ack.heartbeat_ack.state == node_pb2.NODE_STATE_DRAINING
    await node.call.done_writing()
    await harness.wait_state(node.node_id, NodeState.OFFLINE)


async def test_send_command_reaches_the_node(harness: Harness) -> None:
    node = await harness.registered_node(attach=True)
    command = coordinator_pb2.Command(
        assign=coordinator_pb2.AssignShard(
            model="tiny", layers=common_pb2.LayerRange(start=0, end=4), dtype="float32"
        )
    )
    assert await harness.registry.send_command(node.node_id, command) is True
    message = await node.call.read()
    assert message.command.assign.model == "tiny"
    assert message.command.assign.layers.end == 4

    stranger = await harness.registered_node("not-attached")
    assert await harness.registry.send_command(stranger.node_id, command) is False


async def test_shard_status_reaches_view_and_listeners(harness: Harness) -> None:
    node = await harness.registered_node(attach=True)
    events = []
    remove = harness.registry.add_listener(events.append)
    status = node_pb2.ShardStatus(
        model="tiny", layers=common_pb2.LayerRange(start=0, end=4),
        state=node_pb2.SHARD_STATE_READY, progress=1.0,
    )  # fmt: skip
    await node.call.write(coordinator_pb2.NodeMessage(shard_status=status))
    await node.heartbeat(1, node_pb2.Telemetry(queue_length=3))

    view = harness.registry.node(node.node_id)
    assert [s.state for s in view.shards] == [node_pb2.SHARD_STATE_READY]
    shard_events = [e for e in events if isinstance(e, ShardStatusReported)]
    assert shard_events and shard_events[0].status.model == "tiny"
    assert any(isinstance(e, TelemetryReported) and e.telemetry.queue_length == 3 for e in events)

    dropped = node_pb2.ShardStatus()
    dropped.CopyFrom(status)
    dropped.state = node_pb2.SHARD_STATE_DROPPED
    await node.call.write(coordinator_pb2.NodeMessage(shard_status=dropped))
    await node.heartbeat(2)
    assert harness.registry.node(node.node_id).shards == ()

    remove()
    node.call.cancel()
    await harness.wait_state(node.node_id, NodeState.OFFLINE)
    assert not any(isinstance(e, NodeStateChanged) and e.new is NodeState.OFFLINE for e in events)


async def test_bad_shard_status_is_invalid_argument(harness: Harness) -> None:
    node = await harness.registered_node(attach=True)
    status = node_pb2.ShardStatus(model="tiny", layers=common_pb2.LayerRange(start=4, end=2))
    await node.call.write(coordinator_pb2.NodeMessage(shard_status=status))
    error = await stream_error(node.call)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "layers" in error.details()


async def test_state_changes_reach_listeners_db_and_bus(harness: Harness) -> None:
    presence = harness.ctx.bus.subscribe("tessera/nodes/+/presence")
    await presence.ready()
    changes: list[NodeStateChanged] = []
    harness.registry.add_listener(
        lambda e: changes.append(e) if isinstance(e, NodeStateChanged) else None
    )
    node = await harness.registered_node(attach=True)
    node.call.cancel()
    await harness.wait_state(node.node_id, NodeState.OFFLINE)

    assert [(c.old, c.new) for c in changes] == [
        (NodeState.OFFLINE, NodeState.ONLINE),
        (NodeState.ONLINE, NodeState.OFFLINE),
    ]
    harness.registry.flush()
    rows = harness.registry.repo.events(node.node_id)
    assert [(r.from_state, r.to_state) for r in rows] == [
        (None, "offline"), ("offline", "online"), ("online", "offline"),
    ]  # fmt: skip
    published = [await presence.get(timeout=2) for _ in range(2)]
    assert [e.json()["state"] for e in published] == ["online", "offline"]
    assert all(e.topic == f"tessera/nodes/{node.node_id}/presence" for e in published)


async def test_a_failing_listener_does_not_break_the_registry(harness: Harness) -> None:
    def broken(event) -> None:
        raise RuntimeError("listener bug")

    harness.registry.add_listener(broken)
    node = await harness.registered_node(attach=True)
    assert (await node.heartbeat(1)).heartbeat_ack.seq == 1
    assert harness.state(node.node_id) is NodeState.ONLINE


async def test_ban_closes_the_stream(harness: Harness) -> None:
    node = await harness.registered_node(attach=True)
    harness.registry.ban(node.node_id, "cheated on a canary")
    error = await stream_error(node.call)
    assert error.code() == grpc.StatusCode.PERMISSION_DENIED
    assert harness.state(node.node_id) is NodeState.BANNED
    assert not harness.registry.check_ticket(node.node_id, node.ticket)


async def test_many_nodes_attach_concurrently(start_harness) -> None:
    harness: Harness = await start_harness(last_seen_persist_s=0.0)
    nodes = [harness.node(f"n{i}") for i in range(50)]
    await asyncio.gather(*(n.register() for n in nodes))
    await asyncio.gather(*(n.attach() for n in nodes))
    acks = await asyncio.gather(*(n.heartbeat(i) for i, n in enumerate(nodes)))
    assert [a.heartbeat_ack.seq for a in acks] == list(range(50))
    online = harness.registry.nodes(states=[NodeState.ONLINE])
    assert len(online) == 50

    # last_seen reaches SQLite through the batched flush, not per heartbeat.
    def flushed() -> bool:
        rows = dict(harness.ctx.db.execute("SELECT node_id, last_seen_ms FROM nodes").fetchall())
        return all(rows[v.node_id] == v.last_seen_ms for v in online)

    await wait_until(flushed, what="last_seen flushed to the database")


async def test_last_seen_reaches_the_database_only_now_and_then(start_harness) -> None:
    harness: Harness = await start_harness(last_seen_persist_s=3600.0)
    node = await harness.registered_node(attach=True)
    registered_ms = harness.ctx.db.execute(
        "SELECT last_seen_ms FROM nodes WHERE node_id = ?", [node.node_id]
    ).fetchone()[0]
    for seq in range(5):
        await node.heartbeat(seq)
    harness.registry.flush()
    stored = harness.ctx.db.execute(
        "SELECT last_seen_ms FROM nodes WHERE node_id = ?", [node.node_id]
    ).fetchone()[0]
    assert stored == registered_ms  # memory moved on; the disk did not, by design
    assert harness.registry.node(node.node_id).last_seen_ms >= stored


async def test_ack_every_second_heartbeat_but_every_state_change(start_harness) -> None:
    harness: Harness = await start_harness(heartbeat_ack_every=2)
    node = await harness.registered_node(attach=True)

    async def beat(seq: int) -> None:
        await node.call.write(
            coordinator_pb2.NodeMessage(heartbeat=coordinator_pb2.Heartbeat(seq=seq))
        )

    for seq in range(1, 5):
        await beat(seq)
    acks = [await node.call.read() for _ in range(2)]
    assert [a.heartbeat_ack.seq for a in acks] == [2, 4]

    # A state change is acknowledged at once, whatever the count.
    await node.call.write(coordinator_pb2.NodeMessage(drain=coordinator_pb2.DrainRequest()))
    await beat(5)
    ack = await node.call.read()
    assert (ack.heartbeat_ack.seq, ack.heartbeat_ack.state) == (5, node_pb2.NODE_STATE_DRAINING)


def keepalive_hello(node) -> coordinator_pb2.NodeMessage:
    return coordinator_pb2.NodeMessage(
        hello=coordinator_pb2.AttachHello(
            node_id=node.node_id, attach_ticket=node.ticket, keepalive_pings=True
        )
    )


async def test_a_node_with_keepalive_pings_is_acked_only_on_state_changes(
    harness: Harness,
) -> None:
    node = await harness.registered_node()
    call = harness.coordinator_stub.Attach()
    await call.write(keepalive_hello(node))
    welcome = (await call.read()).welcome
    assert welcome.acks_on_state_change_only  # the node may rely on it
    settings = harness.registry.settings
    assert welcome.telemetry_interval_ms == int(settings.telemetry_interval_s * 1000)
    assert welcome.telemetry_interval_ms > welcome.heartbeat_interval_ms

    before = harness.registry.heartbeats
    for seq in range(1, 6):
        await call.write(coordinator_pb2.NodeMessage(heartbeat=coordinator_pb2.Heartbeat(seq=seq)))
    await wait_until(lambda: harness.registry.heartbeats == before + 5, what="5 heartbeats")
    assert harness.registry.node(node.node_id).state is NodeState.ONLINE

    # None of them was acked: the next message is the ack of the state change.
    await call.write(coordinator_pb2.NodeMessage(drain=coordinator_pb2.DrainRequest()))
    await call.write(coordinator_pb2.NodeMessage(heartbeat=coordinator_pb2.Heartbeat(seq=6)))
    ack = await call.read()
    assert (ack.heartbeat_ack.seq, ack.heartbeat_ack.state) == (6, node_pb2.NODE_STATE_DRAINING)


async def test_older_nodes_keep_acks_and_the_heartbeat_interval(harness: Harness) -> None:
    node = await harness.registered_node()
    call = harness.coordinator_stub.Attach()
    await call.write(hello(node.node_id, node.ticket))
    welcome = (await call.read()).welcome
    assert not welcome.acks_on_state_change_only and welcome.telemetry_interval_ms == 0


async def test_a_keepalive_node_is_judged_by_its_own_heartbeat_pace(start_harness) -> None:
    harness: Harness = await start_harness(
        heartbeat_interval_s=0.1, offline_after_s=0.4, telemetry_every_intervals=10
    )
    legacy = await harness.registered_node("legacy", attach=True)
    node = await harness.registered_node("pinged")
    call = harness.coordinator_stub.Attach()
    await call.write(keepalive_hello(node))
    await call.read()
    state = harness.state

    # An older node is suspect after 0.15 s of silence and offline after 0.4 s; this one
    # heartbeats every 1 s, so it is suspect after 1.5 s and offline after 4 s.
    await wait_until(lambda: state(legacy.node_id) is NodeState.OFFLINE, what="legacy offline")
    assert state(node.node_id) is NodeState.ONLINE
    await wait_until(lambda: state(node.node_id) is NodeState.SUSPECT, what="suspect")
    await wait_until(lambda: state(node.node_id) is NodeState.OFFLINE, what="offline")
    error = await stream_error(call)
    assert error.code() == grpc.StatusCode.UNAVAILABLE and "no heartbeat" in error.details()
