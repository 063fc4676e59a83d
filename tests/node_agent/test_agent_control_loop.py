"""The control loop against a scripted coordinator: commands, reconnects, drains, refusals.
Last, keepalive: against the real coordinator, which sends no routine acks."""

import asyncio
import os
import signal
from pathlib import Path

import grpc
import pytest
from support.procs import start_coordinator, start_node

from coordinator.settings import Settings
from node_agent import __version__
from node_agent import agent as agent_module
from node_agent.agent import AgentConfig, ExitCode, NodeAgent
from node_agent.backoff import Backoff
from node_agent.data_plane import NoModelStageServicer
from protos.tessera.v1 import (
    common_pb2,
    coordinator_pb2,
    node_pb2,
    stage_pb2,
    stage_pb2_grpc,
    training_pb2_grpc,
)


class Sessions:
    """A telemetry source standing in for the stage server's open sessions."""

    def __init__(self) -> None:
        self.active = 0
        self.kv_tokens = 0

    def sample(self) -> node_pb2.Telemetry:
        return node_pb2.Telemetry(active_sessions=self.active, kv_tokens_used=self.kv_tokens)


def make_agent(ctx, coordinator, **overrides) -> NodeAgent:
    config = AgentConfig(
        coordinator=coordinator.address,
        name="test-node",
        account="alice",
        listen="127.0.0.1:0",
        tflops=1.25,
        **overrides,
    )
    # The Ping-only servicer and the default shard handler keep these tests about the
    # control loop, whatever the stage server and shard manager plug-ins do.
    return NodeAgent(
        config, ctx, Backoff(base_s=0.01, cap_s=0.05), stage_servicer=NoModelStageServicer(ctx)
    )


async def stop(agent: NodeAgent, task: asyncio.Task) -> int:
    agent.request_shutdown("test over")
    return await asyncio.wait_for(task, 15)


def command(**kind) -> coordinator_pb2.CoordinatorMessage:
    return coordinator_pb2.CoordinatorMessage(command=coordinator_pb2.Command(**kind))


async def test_registers_with_a_signed_request_and_heartbeats_telemetry(
    agent_ctx, scripted_coordinator, wait_until
) -> None:
    sessions = Sessions()
    sessions.kv_tokens = 77
    agent_ctx.telemetry_sources.append(sessions)
    agent = make_agent(agent_ctx, scripted_coordinator, region="eu-west", price=500)
    task = asyncio.create_task(agent.run())
    await wait_until(lambda: len(scripted_coordinator.of_kind("heartbeat")) >= 3, what="heartbeats")

    (request,) = scripted_coordinator.registrations
    caps = request.capabilities
    assert request.name == "test-node" and request.account == "alice"
    assert caps.device_kind == "cpu" and caps.matmul_tflops == 1.25
    assert caps.region == "eu-west" and caps.price_per_1k_token_layers_units == 500
    assert "float32" in caps.dtypes and caps.agent_version
    assert caps.memory_usable_bytes == agent_ctx.hardware.memory_usable_bytes
    # The data plane was up before registering, and its real port was reported.
    host, port = request.data_address.rsplit(":", 1)
    assert host == "127.0.0.1" and int(port) > 0
    assert agent_ctx.coordinator_public_key == scripted_coordinator.public_key

    beats = [m.heartbeat for m in scripted_coordinator.of_kind("heartbeat")]
    assert [b.seq for b in beats] == sorted({b.seq for b in beats})
    assert all(b.telemetry.kv_tokens_used == 77 for b in beats)
    assert all(b.telemetry.memory_used_bytes > 0 for b in beats)  # the process source
    assert await stop(agent, task) == ExitCode.OK


async def test_the_data_plane_answers_ping_with_the_node_id(
    agent_ctx, scripted_coordinator, wait_until
) -> None:
    agent = make_agent(agent_ctx, scripted_coordinator)
    task = asyncio.create_task(agent.run())
    await wait_until(lambda: scripted_coordinator.registrations, what="registration")
    address = scripted_coordinator.registrations[0].data_address
    async with grpc.aio.insecure_channel(address) as channel:
        stub = stage_pb2_grpc.StageStub(channel)
        pong = await stub.Ping(stage_pb2.PingRequest(payload=b"hi"), timeout=5)
        assert (pong.payload, pong.node_id) == (b"hi", agent_ctx.node_id)
    assert await stop(agent, task) == ExitCode.OK


async def test_assign_without_a_runtime_fails_at_once_and_drop_reports_dropped(
    agent_ctx, scripted_coordinator, wait_until
) -> None:
    agent = make_agent(agent_ctx, scripted_coordinator)
    task = asyncio.create_task(agent.run())
    await wait_until(lambda: scripted_coordinator.attaches == 1, what="attach")
    layers = common_pb2.LayerRange(start=0, end=4)
    scripted_coordinator.to_send.put_nowait(
        command(assign=coordinator_pb2.AssignShard(model="m", layers=layers, num_layers=8))
    )
    await wait_until(lambda: scripted_coordinator.of_kind("shard_status"), what="a shard status")
    (failed,) = [m.shard_status for m in scripted_coordinator.of_kind("shard_status")]
    assert failed.state == node_pb2.SHARD_STATE_FAILED
    assert failed.error == "this agent has no model runtime"
    assert (failed.model, failed.layers) == ("m", layers)

    scripted_coordinator.to_send.put_nowait(
        command(drop=coordinator_pb2.DropShard(model="m", layers=layers))
    )
    await wait_until(
        lambda: len(scripted_coordinator.of_kind("shard_status")) == 2, what="the drop report"
    )
    dropped = scripted_coordinator.of_kind("shard_status")[1].shard_status
    assert dropped.state == node_pb2.SHARD_STATE_DROPPED
    assert await stop(agent, task) == ExitCode.OK


class ReadyHandler:
    """A shard handler that loads instantly; a crash in assign must become FAILED."""

    async def assign(self, cmd, report) -> None:
        if cmd.model == "boom":
            raise RuntimeError("disk full")
        report(node_pb2.ShardStatus(model=cmd.model, layers=cmd.layers,
                                    state=node_pb2.SHARD_STATE_READY))  # fmt: skip

    async def drop(self, cmd) -> None:
        return None


async def test_a_broken_stream_re_registers_and_replays_ready_shards(
    agent_ctx, scripted_coordinator, wait_until
) -> None:
    agent_ctx.shard_handler = ReadyHandler()
    agent = make_agent(agent_ctx, scripted_coordinator)
    task = asyncio.create_task(agent.run())
    await wait_until(lambda: scripted_coordinator.attaches == 1, what="attach")
    layers = common_pb2.LayerRange(start=2, end=6)
    for model in ("m", "boom"):
        scripted_coordinator.to_send.put_nowait(
            command(assign=coordinator_pb2.AssignShard(model=model, layers=layers))
        )
    await wait_until(
        lambda: len(scripted_coordinator.of_kind("shard_status")) == 2, what="two reports"
    )
    by_model = {
        m.shard_status.model: m.shard_status for m in scripted_coordinator.of_kind("shard_status")
    }
    assert by_model["m"].state == node_pb2.SHARD_STATE_READY
    assert by_model["boom"].state == node_pb2.SHARD_STATE_FAILED
    assert "disk full" in by_model["boom"].error

    scripted_coordinator.received.clear()
    scripted_coordinator.break_stream.set()
    await wait_until(lambda: scripted_coordinator.attaches == 2, what="the re-attach")
    assert len(scripted_coordinator.registrations) == 2  # registered again from scratch
    await wait_until(lambda: scripted_coordinator.of_kind("shard_status"), what="the replay")
    replayed = {m.shard_status.model: m.shard_status.state
                for m in scripted_coordinator.of_kind("shard_status")}  # fmt: skip
    assert replayed["m"] == node_pb2.SHARD_STATE_READY
    assert await stop(agent, task) == ExitCode.OK


async def test_sigterm_drains_waits_for_sessions_then_closes_cleanly(
    agent_ctx, scripted_coordinator, wait_until
) -> None:
    sessions = Sessions()
    sessions.active = 2
    agent_ctx.telemetry_sources.append(sessions)
    agent = make_agent(agent_ctx, scripted_coordinator)
    task = asyncio.create_task(agent.run())
    await wait_until(lambda: scripted_coordinator.attaches == 1, what="attach")

    agent.request_shutdown("SIGTERM")
    assert not agent_ctx.accepting_work
    await wait_until(lambda: scripted_coordinator.of_kind("drain"), what="the drain request")
    await wait_until(lambda: agent.coordinator_state == node_pb2.NODE_STATE_DRAINING,
                     what="the coordinator to confirm DRAINING")  # fmt: skip
    # Two sessions are still running: the stream must stay open, heartbeats flowing.
    beats_before = len(scripted_coordinator.of_kind("heartbeat"))
    await wait_until(lambda: len(scripted_coordinator.of_kind("heartbeat")) > beats_before + 2,
                     what="heartbeats during the drain")  # fmt: skip
    assert scripted_coordinator.stream_ends == [] and not task.done()

    sessions.active = 0
    assert await asyncio.wait_for(task, 10) == ExitCode.OK
    assert scripted_coordinator.stream_ends == ["eof"]  # half-closed, not cancelled
    assert scripted_coordinator.attaches == 1


async def test_the_drain_deadline_bounds_the_wait(
    agent_ctx, scripted_coordinator, wait_until
) -> None:
    sessions = Sessions()
    sessions.active = 1  # never finishes
    agent_ctx.telemetry_sources.append(sessions)
    agent = make_agent(agent_ctx, scripted_coordinator, drain_timeout_s=0.3)
    task = asyncio.create_task(agent.run())
    await wait_until(lambda: scripted_coordinator.attaches == 1, what="attach")
    agent.request_shutdown("SIGTERM")
    assert await asyncio.wait_for(task, 10) == ExitCode.OK


async def test_a_drain_command_from_the_coordinator_ends_the_agent(
    agent_ctx, scripted_coordinator, wait_until
) -> None:
    agent = make_agent(agent_ctx, scripted_coordinator)
    task = asyncio.create_task(agent.run())
    await wait_until(lambda: scripted_coordinator.attaches == 1, what="attach")
    scripted_coordinator.to_send.put_nowait(
        command(drain=coordinator_pb2.Drain(reason="maintenance", deadline_ms=1000))
    )
    assert await asyncio.wait_for(task, 10) == ExitCode.OK
    assert scripted_coordinator.stream_ends == ["eof"]
    assert not agent_ctx.accepting_work
    # The coordinator asked: the node does not ask back.
    assert scripted_coordinator.of_kind("drain") == []


@pytest.mark.parametrize(
    "status", [grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.PERMISSION_DENIED]
)
async def test_a_refusal_ends_the_agent_instead_of_retrying_forever(
    agent_ctx, scripted_coordinator, status
) -> None:
    scripted_coordinator.register_error = (status, "name: too silly")
    agent = make_agent(agent_ctx, scripted_coordinator)
    assert await asyncio.wait_for(agent.run(), 15) == ExitCode.REFUSED
    assert len(scripted_coordinator.registrations) == 1


async def test_a_server_that_is_not_a_coordinator_ends_the_agent(agent_ctx, caplog) -> None:
    """--coordinator pointing at another gRPC server (here one serving nothing, as a node's
    data plane would not serve Register): retrying cannot help, so the agent says so."""
    server = grpc.aio.server()
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:

        class Elsewhere:
            address = f"127.0.0.1:{port}"

        agent = make_agent(agent_ctx, Elsewhere)
        assert await asyncio.wait_for(agent.run(), 15) == ExitCode.REFUSED
    finally:
        await server.stop(None)
    assert f"127.0.0.1:{port} does not serve the Tessera coordinator API" in caplog.text
    assert "check --coordinator" in caplog.text


async def test_an_unreachable_coordinator_is_retried_until_shutdown(agent_ctx, wait_until) -> None:
    class Nowhere:
        address = "127.0.0.1:1"  # nothing listens on port 1

    agent = make_agent(agent_ctx, Nowhere)
    task = asyncio.create_task(agent.run())
    await wait_until(lambda: agent.backoff.attempt >= 3, what="three failed attempts")
    assert await stop(agent, task) == ExitCode.OK


# An agent of a coordinator that acked every heartbeat gave up after this much silence
# (the floor of its silence limit); staying attached longer proves the pings took over.
OLD_SILENCE_FLOOR_S = 5.0


@pytest.mark.slow
async def test_a_silent_healthy_stream_stays_attached_and_a_hung_coordinator_is_left(
    agent_ctx, tmp_path: Path, wait_until
) -> None:
    """The real coordinator acks only state changes to an agent with keepalive pings (hello
    keepalive_pings), so a healthy stream can stay silent for good: the agent watches it
    with HTTP/2 keepalive pings instead."""

    def attached() -> bool:
        return agent.coordinator_state == node_pb2.NODE_STATE_ONLINE

    interval_s = 0.2
    beat_every_s = interval_s * Settings(tmp_path, tmp_path).telemetry_every_intervals
    with start_coordinator(tmp_path, heartbeat_interval=interval_s) as coord:
        agent = make_agent(agent_ctx, coord, keepalive_s=2.0)
        task = asyncio.create_task(agent.run())
        try:
            await wait_until(attached, timeout=15, what="attached")
            # Heartbeats flow, the coordinator answers none of them, and the agent stays.
            seq_before = agent._heartbeat_seq
            await asyncio.sleep(OLD_SILENCE_FLOOR_S + 1)
            assert attached() and agent.backoff.attempt == 0
            assert agent._heartbeat_seq - seq_before >= OLD_SILENCE_FLOOR_S / beat_every_s

            # A hung coordinator (stopped, its socket still open) answers no ping: the
            # agent drops the stream within 1.5 keepalive periods and starts reconnecting.
            os.kill(coord.process.pid, signal.SIGSTOP)
            try:
                await wait_until(lambda: agent.backoff.attempt >= 1, timeout=10, what="reconnect")
            finally:
                os.kill(coord.process.pid, signal.SIGCONT)
            await wait_until(attached, timeout=30, what="attached again")
        finally:
            assert await stop(agent, task) == ExitCode.OK


def test_capabilities_expire_by_the_coordinator_s_clock_as_registration_gave_it(
    agent_ctx,
) -> None:
    agent_ctx.local_clock = lambda: 1_000_000.0  # this machine's clock, far behind
    assert agent_ctx.coordinator_time() == 1_000_000.0
    assert agent_ctx.learn_coordinator_clock(1_000_300_000) == 300.0  # 5 min ahead there
    assert agent_ctx.coordinator_time() == 1_000_300.0
    # A coordinator from before RegisterResponse.coordinator_unix_ms says 0: the offset
    # learnt last is kept (none at first: this machine's own clock).
    assert agent_ctx.learn_coordinator_clock(0) == 300.0


def test_a_node_agent_too_old_for_the_coordinator_exits_and_says_how_to_upgrade(
    tmp_path: Path,
) -> None:
    """Real processes: a coordinator that takes node agents from 99.0.0 on, and this
    release's agent. It exits with REFUSED (the systemd unit does not restart that) and
    tells its owner what to do, instead of retrying for ever."""
    with start_coordinator(tmp_path, extra_args=["--min-agent-version", "99.0.0"]) as coord:
        node = start_node(coord.address, tmp_path / "node", "old", wait_registered=False)
        with node:
            assert node.process.wait(timeout=60) == ExitCode.REFUSED
        log = node.process.log_text()
        assert f"this node agent is Tessera {__version__}" in log, log[-2000:]
        assert "takes 99.0.0 or newer" in log and "pip install -U" in log, log[-2000:]
        assert "retrying" not in log, log[-2000:]


async def test_the_training_service_is_closed_when_the_agent_stops(
    agent_ctx, scripted_coordinator, wait_until, monkeypatch
) -> None:
    """Closing it writes the training usage counts and settles what job runners
    acknowledged (node_agent/training_server.py): without it only the idle sweep would."""

    class Recording(training_pb2_grpc.TrainingStageServicer):
        closed = 0

        async def close(self) -> None:
            Recording.closed += 1

    monkeypatch.setattr(agent_module, "build_training_servicer", lambda ctx: Recording())
    agent = make_agent(agent_ctx, scripted_coordinator)
    task = asyncio.create_task(agent.run())
    await wait_until(lambda: scripted_coordinator.registrations, what="registration")
    assert Recording.closed == 0
    assert await stop(agent, task) == ExitCode.OK
    assert Recording.closed == 1
