"""The control loop: register with the coordinator, stay attached, obey its commands.

    GetChallenge -> Register (signed) -> Attach: hello, then a heartbeat every interval
                                        <- welcome, heartbeat_ack, command(drain|assign|drop|probe)

Whenever the coordinator is unreachable, restarts or the stream breaks, the agent waits
(exponential back-off, full jitter) and registers again from scratch: a restarted
coordinator may have lost every ticket. A drain (SIGTERM/SIGINT, or a `drain` command)
stops new work, lets running sessions finish, closes the stream and ends the process.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Coroutine
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

import grpc

from node_agent import __version__, telemetry
from node_agent.backoff import Backoff
from node_agent.context import AgentContext
from node_agent.data_plane import (
    advertised_address,
    build_stage_servicer,
    build_training_servicer,
    split_host_port,
    start_server,
)
from node_agent.mqtt_presence import MqttPresence
from node_agent.nat_tunnel import NatTunnel
from node_agent.rtt_probe import RttProber
from protos import dialing, identity
from protos.dialing import DIAL_OPTIONS
from protos.tessera.v1 import coordinator_pb2, coordinator_pb2_grpc, node_pb2, stage_pb2_grpc

log = logging.getLogger(__name__)

CHANNEL_OPTIONS = DIAL_OPTIONS
# A coordinator that acks only state changes leaves the stream silent for good, so silence
# says nothing: HTTP/2 keepalive pings, answered by the coordinator's gRPC core without
# waking its Python code, tell a live coordinator from a dead or hung one. A ping every
# 10 s, unanswered for 5 s, finds a lost coordinator as fast as 3 silent 5-s intervals did.
# (The coordinator's own pings, which this channel answers, show it alive as well.)
_KEEPALIVE_S = 10.0
_CHALLENGE_TIMEOUT_S = 10.0
# Register may dial our data address back before it answers, so it gets longer.
_REGISTER_TIMEOUT_S = 30.0
# A clock further off than this from the coordinator's is worth telling the owner about.
CLOCK_WARNING_S = 60.0
_WELCOME_TIMEOUT_S = 10.0
_DEFAULT_HEARTBEAT_S = 5.0
# After a drain request, how long to wait for the coordinator to confirm DRAINING
# before closing anyway: the confirmation makes the order draining -> offline certain.
_DRAIN_ACK_TIMEOUT_S = 3.0
_CLOSE_TIMEOUT_S = 3.0
_IDLE_POLL_S = 0.2


class ExitCode(IntEnum):
    OK = 0
    ERROR = 1
    USAGE = 2  # bad flags or local set-up: fix the command line or the data dir
    REFUSED = 3  # the coordinator refuses this node for good (banned, invalid capabilities)


# Statuses after which retrying the same request cannot succeed.
_PERMANENT = {
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.UNIMPLEMENTED,
}


class StreamLost(Exception):
    """The Attach stream ended or went silent; the message says why."""


class Refused(Exception):
    """The coordinator will not take this node; retrying does not help."""


@dataclass(frozen=True)
class AgentConfig:
    coordinator: str  # HOST:PORT
    name: str
    account: str = ""
    region: str = ""
    price: int = 0  # credit units per 1,000 token-layers; 0 = the coordinator's default
    training_price: int = 0  # credit units per sample-layer; 0 = the coordinator's default
    listen: str = "0.0.0.0:0"
    advertise: str | None = None
    heartbeat_s: float | None = None  # None: the coordinator's interval
    drain_timeout_s: float = 120.0  # the longest a SIGTERM waits for running sessions
    tflops: float = 0.0
    bandwidth_gbps: float = 0.0  # measured memory bandwidth, 0 = not measured
    max_memory_bytes: int = 0  # the owner's cap (--max-memory-gb), 0 = none
    keepalive_s: float = _KEEPALIVE_S  # ping the coordinator this often; half of it to answer


@dataclass
class _Leave:
    reason: str
    deadline_s: float
    self_initiated: bool  # the node asks to leave (signal), vs the coordinator told it to


def state_name(state: int) -> str:
    return node_pb2.NodeState.Name(state).removeprefix("NODE_STATE_")


def describe_rpc_error(exc: grpc.aio.AioRpcError) -> str:
    details = exc.details() or ""
    # gRPC's connection errors are long and nested; the first clause is the useful one.
    text = f"{exc.code().name}: {details.split(';')[0].strip()}"
    if exc.code() == grpc.StatusCode.ABORTED:
        # A newer Attach for the same node id wins, and only the same key gives that id.
        text += " (another agent with this node's key attached: is node.key copied elsewhere?)"
    return text


class NodeAgent:
    def __init__(
        self,
        config: AgentConfig,
        ctx: AgentContext,
        backoff: Backoff,
        mqtt: MqttPresence | None = None,
        stage_servicer: stage_pb2_grpc.StageServicer | None = None,
    ) -> None:
        """`stage_servicer` None: the stage server plug-in's, else the Ping-only fallback."""
        self.config = config
        self._stage_servicer = stage_servicer
        self.ctx = ctx
        self.backoff = backoff
        self.mqtt = mqtt
        self.data_address = ""
        self.coordinator_state = node_pb2.NODE_STATE_UNSPECIFIED
        self._leave: _Leave | None = None
        self._leave_event = asyncio.Event()
        self._force_event = asyncio.Event()  # a second signal: stop waiting for sessions
        self._outgoing: asyncio.Queue[coordinator_pb2.NodeMessage | None] | None = None
        self._draining_acked = asyncio.Event()
        self._shard_reports: dict[tuple[str, int, int], node_pb2.ShardStatus] = {}
        self._command_tasks: set[asyncio.Task[None]] = set()
        self._heartbeat_seq = 0
        # Round trips to the peers the coordinator names (ProbePeers), in every telemetry.
        self.rtt_probe = RttProber(CHANNEL_OPTIONS)
        ctx.telemetry_sources.append(self.rtt_probe)
        # Open while the coordinator cannot dial the data plane: its relay carries it.
        self.tunnel: NatTunnel | None = None
        self._tunnel_task: asyncio.Task[None] | None = None
        self._data_plane = ("127.0.0.1", 0)  # where the tunnel reaches the data plane

    # ----- public -------------------------------------------------------------------

    def request_shutdown(self, reason: str) -> None:
        """Drain and exit (SIGTERM/SIGINT). A second call stops waiting for sessions."""
        if self._leave is not None:
            log.warning("%s again: leaving now without waiting for running sessions", reason)
            self._force_event.set()
            return
        log.info("%s: draining, then leaving", reason)
        self._begin_leave(_Leave(reason, self.config.drain_timeout_s, self_initiated=True))

    async def run(self) -> int:
        # Kept, to close when the agent stops: they write the usage counts and settle what
        # clients acknowledged (node_agent/stage_server.py, training_server.py). The stage
        # servicer first: it creates the shard manager both share.
        servicer = self._stage_servicer or build_stage_servicer(self.ctx)
        training = build_training_servicer(self.ctx)
        server, port = await start_server(self.ctx, self.config.listen, servicer, training)
        listen_host, _ = split_host_port(self.config.listen)
        local = "127.0.0.1" if listen_host in ("", "0.0.0.0", "::", "[::]") else listen_host
        self._data_plane = (local, port)
        self.data_address = self.config.advertise or advertised_address(
            listen_host, port, self.config.coordinator
        )
        log.info(
            "data plane listening on %s:%d, advertised as %s", listen_host, port, self.data_address
        )
        probing = asyncio.create_task(self.rtt_probe.run(), name="rtt probe")
        channel = dialing.aio_channel(
            self.config.coordinator, CHANNEL_OPTIONS + keepalive_options(self.config)
        )
        try:
            return await self._control_loop(coordinator_pb2_grpc.CoordinatorStub(channel))
        finally:
            probing.cancel()
            await asyncio.gather(probing, return_exceptions=True)
            self._keep_tunnel(reachable=True)  # stops it
            await self._cancel_commands()
            await _close_quietly(self.ctx.shard_handler)
            if self.mqtt is not None:
                await self.mqtt.close()
            await channel.close()
            await server.stop(grace=1.0)
            await _close_quietly(servicer)
            await _close_quietly(training)
            log.info("node agent stopped")

    # ----- the loop -----------------------------------------------------------------

    async def _control_loop(self, stub: coordinator_pb2_grpc.CoordinatorStub) -> int:
        while self._leave is None:
            try:
                registration = await self._register(stub)
                if self._leave is not None:
                    break
                await self._attach(stub, registration)
                if self._leave is not None:
                    return ExitCode.OK  # _attach drained and closed the stream
                reason = "the coordinator ended the stream"
            except Refused as exc:
                log.error("%s", exc)
                return ExitCode.REFUSED
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                    log.error(
                        "%s does not serve the Tessera coordinator API (%s); check --coordinator",
                        self.config.coordinator,
                        describe_rpc_error(exc),
                    )
                    return ExitCode.REFUSED
                if exc.code() in _PERMANENT:
                    log.error(
                        "the coordinator at %s refuses this node: %s",
                        self.config.coordinator,
                        describe_rpc_error(exc),
                    )
                    return ExitCode.REFUSED
                reason = describe_rpc_error(exc)
                reason += dialing.tls_hint(self.config.coordinator, exc.details() or "")
            except (StreamLost, TimeoutError) as exc:
                reason = str(exc) or "timed out"
            if self._leave is not None:
                break
            self.coordinator_state = node_pb2.NODE_STATE_UNSPECIFIED
            delay = self.backoff.next_delay()
            log.warning(
                "not attached to coordinator %s (%s); retrying in %.2fs",
                self.config.coordinator,
                reason,
                delay,
            )
            with contextlib.suppress(TimeoutError, asyncio.TimeoutError):
                await asyncio.wait_for(self._leave_event.wait(), delay)
        # Asked to leave while not attached: clients may still be mid-session on the data
        # plane (it works without the coordinator), so let them finish.
        await self._finish_running_work()
        return ExitCode.OK

    async def _register(
        self, stub: coordinator_pb2_grpc.CoordinatorStub
    ) -> coordinator_pb2.RegisterResponse:
        public_key = identity.public_key_bytes(self.ctx.private_key)
        challenge = await stub.GetChallenge(
            coordinator_pb2.ChallengeRequest(public_key=public_key), timeout=_CHALLENGE_TIMEOUT_S
        )
        request = coordinator_pb2.RegisterRequest(
            public_key=public_key,
            nonce=challenge.nonce,
            name=self.config.name,
            account=self.config.account,
            capabilities=self.capabilities(),
            data_address=self.data_address,
        )
        identity.sign_register(self.ctx.private_key, request)
        try:
            response = await stub.Register(request, timeout=_REGISTER_TIMEOUT_S)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.FAILED_PRECONDITION:  # a release too old for it
                raise Refused(
                    f"the coordinator at {self.config.coordinator} does not take this node: "
                    f"{exc.details()}"
                ) from None
            raise
        if response.node_id != self.ctx.node_id:
            raise Refused(
                f"the coordinator assigned id {response.node_id}, but this key's id is "
                f"{self.ctx.node_id}; it does not speak this protocol version"
            )
        self.ctx.coordinator_public_key = response.coordinator_public_key
        self.ctx.attach_ticket = response.attach_ticket
        offset = self.ctx.learn_coordinator_clock(response.coordinator_unix_ms)
        if self.mqtt is not None:
            # Online once the coordinator took it, stamped by the coordinator's clock.
            self.mqtt.start()
        if abs(offset) > CLOCK_WARNING_S:
            log.warning(
                "this machine's clock is %.0f s %s the coordinator's; the node checks "
                "capabilities on the coordinator's clock, but set this clock right (enable "
                "NTP time sync): its logs' times disagree with the coordinator's",
                abs(offset),
                "behind" if offset > 0 else "ahead of",
            )
        hw = self.ctx.hardware
        log.info(
            "registered as %s (name=%s, device=%s %s, tflops=%.3f, %.0f GB/s, usable=%.1f GiB, "
            "data=%s)",
            response.node_id,
            self.config.name,
            hw.torch_device,
            hw.device_name,
            self.config.tflops,
            self.config.bandwidth_gbps,
            hw.memory_usable_bytes / 2**30,
            self.data_address,
        )
        if not response.reachable:
            log.warning(
                "the coordinator could not dial back %s, so clients cannot reach this node "
                "directly; open that port or pass --advertise with an address it can reach "
                "(meanwhile it asks the coordinator's relay to carry its data plane)",
                self.data_address,
            )
        self._keep_tunnel(response.reachable)
        if response.mqtt_url and self.mqtt is None:
            log.info(
                "the coordinator publishes events on %s; add --mqtt %s to announce this "
                "node's presence there too",
                response.mqtt_url,
                response.mqtt_url,
            )
        return response

    def _keep_tunnel(self, reachable: bool) -> None:
        """A relay tunnel while the coordinator cannot dial this node; none once it can."""
        running = self._tunnel_task is not None and not self._tunnel_task.done()
        if reachable:
            if running:
                self._tunnel_task.cancel()  # type: ignore[union-attr]
            self._tunnel_task = None
            return
        if not running:
            self.tunnel = NatTunnel(self.ctx, *self._data_plane)
            self._tunnel_task = asyncio.create_task(self.tunnel.run(), name="relay tunnel")

    def capabilities(self) -> node_pb2.Capabilities:
        hw = self.ctx.hardware
        return node_pb2.Capabilities(
            device_kind=hw.device_kind,
            device_name=hw.device_name,
            device_count=hw.device_count,
            memory_total_bytes=hw.memory_total_bytes,
            memory_usable_bytes=hw.memory_usable_bytes,
            compute_capability=hw.compute_capability,
            cpu_cores=hw.cpu_cores,
            ram_bytes=hw.ram_bytes,
            matmul_tflops=self.config.tflops,
            memory_bandwidth_gbps=self.config.bandwidth_gbps,
            region=self.config.region,
            price_per_1k_token_layers_units=self.config.price,
            price_per_sample_layer_units=self.config.training_price,
            limits=node_pb2.OwnerLimits(
                max_memory_bytes=self.config.max_memory_bytes, max_sessions=self.ctx.max_sessions
            ),
            agent_version=__version__,
            dtypes=list(hw.dtypes),
        )

    # ----- one Attach stream --------------------------------------------------------

    async def _attach(
        self,
        stub: coordinator_pb2_grpc.CoordinatorStub,
        registration: coordinator_pb2.RegisterResponse,
    ) -> None:
        """Run one Attach stream. Returns after a drain; raises when the stream is lost."""
        outgoing: asyncio.Queue[coordinator_pb2.NodeMessage | None] = asyncio.Queue()
        call = stub.Attach(_until_none(outgoing))
        outgoing.put_nowait(
            coordinator_pb2.NodeMessage(
                hello=coordinator_pb2.AttachHello(
                    node_id=self.ctx.node_id,
                    attach_ticket=registration.attach_ticket,
                    keepalive_pings=True,
                )
            )
        )
        try:
            first = await asyncio.wait_for(call.read(), _WELCOME_TIMEOUT_S)
            if first is grpc.aio.EOF:
                raise StreamLost(f"the coordinator ended the stream at hello ({await call.code()})")
            if not first.HasField("welcome"):
                raise StreamLost(f"expected welcome, got {first.WhichOneof('kind')}")
            interval_s = self._heartbeat_interval(first.welcome, registration)
            self._set_coordinator_state(first.welcome.state)
            log.info(
                "attached to coordinator %s; heartbeat every %.1fs%s",
                self.config.coordinator,
                interval_s,
                ", keepalive pings in between" if first.welcome.acks_on_state_change_only else "",
            )
            self.backoff.reset()
            self._outgoing = outgoing
            self._replay_shard_reports()
            silence_limit_s: float | None = None  # keepalive pings watch the stream
            if not first.welcome.acks_on_state_change_only:
                # An older coordinator acks every heartbeat: its silence means trouble.
                silence_limit_s = max(3 * interval_s, registration.offline_after_ms / 1000, 5.0)
            await self._attached(call, outgoing, interval_s, silence_limit_s)
        finally:
            self._outgoing = None
            # Ending the request generator lets gRPC's consumer task finish on its own;
            # cancelling the call under a generator parked in queue.get() leaks that task.
            outgoing.put_nowait(None)
            await asyncio.sleep(0)
            call.cancel()

    async def _attached(
        self,
        call: grpc.aio.StreamStreamCall,
        outgoing: asyncio.Queue[coordinator_pb2.NodeMessage | None],
        interval_s: float,
        silence_limit_s: float | None,
    ) -> None:
        last_heard = [time.monotonic()]
        reader = asyncio.create_task(self._read_loop(call, last_heard), name="attach-reader")
        beater = asyncio.create_task(
            self._heartbeat_loop(outgoing, interval_s, silence_limit_s, last_heard),
            name="heartbeats",
        )
        leave = asyncio.create_task(self._leave_event.wait(), name="leave-wait")
        try:
            done, _ = await asyncio.wait(
                {reader, beater, leave}, return_when=asyncio.FIRST_COMPLETED
            )
            if leave not in done:
                for task in done:
                    task.result()  # raises StreamLost / AioRpcError: the caller reconnects
                raise StreamLost("the coordinator ended the stream")
            await self._drain_attached(outgoing, reader)
        finally:
            for task in (reader, beater, leave):
                task.cancel()
            await asyncio.gather(reader, beater, leave, return_exceptions=True)

    async def _drain_attached(
        self,
        outgoing: asyncio.Queue[coordinator_pb2.NodeMessage | None],
        reader: asyncio.Task[None],
    ) -> None:
        assert self._leave is not None
        if self._leave.self_initiated:
            outgoing.put_nowait(
                coordinator_pb2.NodeMessage(
                    drain=coordinator_pb2.DrainRequest(reason=self._leave.reason)
                )
            )
            self._send_heartbeat(outgoing)
            try:
                await asyncio.wait_for(self._draining_acked.wait(), _DRAIN_ACK_TIMEOUT_S)
            except TimeoutError:
                log.warning("the coordinator did not confirm the drain; closing anyway")
        await self._finish_running_work()
        outgoing.put_nowait(None)  # half-close: the coordinator sees a clean goodbye
        with contextlib.suppress(Exception):
            await asyncio.wait_for(asyncio.shield(reader), _CLOSE_TIMEOUT_S)
        log.info("closed the stream to coordinator %s", self.config.coordinator)

    async def _read_loop(self, call: grpc.aio.StreamStreamCall, last_heard: list[float]) -> None:
        while True:
            message = await call.read()
            if message is grpc.aio.EOF:
                if self._leave is not None:
                    return
                code = await call.code()
                details = await call.details()
                raise StreamLost(f"the coordinator ended the stream ({code.name}: {details})")
            last_heard[0] = time.monotonic()
            kind = message.WhichOneof("kind")
            if kind == "heartbeat_ack":
                self._set_coordinator_state(message.heartbeat_ack.state)
            elif kind == "command":
                self._on_command(message.command)
            elif kind == "welcome":
                self._set_coordinator_state(message.welcome.state)

    async def _heartbeat_loop(
        self,
        outgoing: asyncio.Queue[coordinator_pb2.NodeMessage | None],
        interval_s: float,
        silence_limit_s: float | None,
        last_heard: list[float],
    ) -> None:
        while True:
            self._send_heartbeat(outgoing)
            await asyncio.sleep(interval_s)
            silent_for = time.monotonic() - last_heard[0]
            if silence_limit_s is not None and silent_for > silence_limit_s:
                raise StreamLost(f"no word from the coordinator for {silent_for:.1f}s")

    def _send_heartbeat(self, outgoing: asyncio.Queue[coordinator_pb2.NodeMessage | None]) -> None:
        sample = telemetry.merge(self.ctx.telemetry_sources)
        self._heartbeat_seq += 1
        outgoing.put_nowait(
            coordinator_pb2.NodeMessage(
                heartbeat=coordinator_pb2.Heartbeat(
                    seq=self._heartbeat_seq,
                    sent_unix_ms=int(time.time() * 1000),
                    telemetry=sample,
                )
            )
        )
        if self.mqtt is not None:
            self.mqtt.publish_telemetry(sample)

    def _heartbeat_interval(
        self, welcome: coordinator_pb2.Welcome, registration: coordinator_pb2.RegisterResponse
    ) -> float:
        if self.config.heartbeat_s is not None:
            return self.config.heartbeat_s
        ms = (
            welcome.telemetry_interval_ms
            or welcome.heartbeat_interval_ms
            or registration.heartbeat_interval_ms
        )
        return ms / 1000 if ms else _DEFAULT_HEARTBEAT_S

    def _set_coordinator_state(self, state: int) -> None:
        if state == node_pb2.NODE_STATE_DRAINING:
            self._draining_acked.set()
        if state == self.coordinator_state or state == node_pb2.NODE_STATE_UNSPECIFIED:
            return
        before = self.coordinator_state
        self.coordinator_state = state
        if before == node_pb2.NODE_STATE_UNSPECIFIED:
            log.info("coordinator state: %s", state_name(state))
        else:
            log.info("coordinator state: %s -> %s", state_name(before), state_name(state))

    # ----- commands -----------------------------------------------------------------

    def _on_command(self, command: coordinator_pb2.Command) -> None:
        kind = command.WhichOneof("kind")
        if kind == "drain":
            deadline_s = command.drain.deadline_ms / 1000 or self.config.drain_timeout_s
            log.info(
                "the coordinator asks this node to drain (%s); finishing within %.0fs",
                command.drain.reason or "no reason given",
                deadline_s,
            )
            self._begin_leave(
                _Leave(command.drain.reason or "drain command", deadline_s, self_initiated=False)
            )
        elif kind == "assign":
            cmd = command.assign
            log.info(
                "assigned %s layers [%d, %d) in %s (kv budget %d tokens)",
                cmd.model,
                cmd.layers.start,
                cmd.layers.end,
                cmd.dtype or "default dtype",
                cmd.kv_tokens_budget,
            )
            self._spawn(self._run_assign(cmd), f"assign {cmd.model}")
        elif kind == "drop":
            cmd = command.drop
            log.info("dropping %s layers [%d, %d)", cmd.model, cmd.layers.start, cmd.layers.end)
            self._spawn(self._run_drop(cmd), f"drop {cmd.model}")
        elif kind == "probe":
            self.rtt_probe.set_peers(command.probe.peers)
        elif kind == "reachability":
            if command.reachability.reachable:
                log.info("the coordinator reaches this node's data plane again")
            else:
                log.warning(
                    "the coordinator can no longer dial this node's data plane at %s; clients "
                    "reach it through the coordinator's relay from now on (check the port "
                    "forwarding or firewall to be dialed directly again)",
                    self.data_address,
                )
            self._keep_tunnel(command.reachability.reachable)
        else:
            log.warning("ignoring a command this agent does not know (%s); upgrade it", kind)

    def _spawn(self, coro: Coroutine[Any, Any, None], name: str) -> None:
        task = asyncio.create_task(coro, name=name)
        self._command_tasks.add(task)
        task.add_done_callback(self._command_tasks.discard)

    async def _run_assign(self, cmd: coordinator_pb2.AssignShard) -> None:
        def failed(error: str) -> None:
            self.report(
                node_pb2.ShardStatus(
                    model=cmd.model,
                    layers=cmd.layers,
                    state=node_pb2.SHARD_STATE_FAILED,
                    error=error,
                )
            )

        if self._leave is not None:
            failed("the node is draining")
            return
        try:
            await self.ctx.shard_handler.assign(cmd, self.report)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.exception(
                "loading %s layers [%d, %d) failed", cmd.model, cmd.layers.start, cmd.layers.end
            )
            failed(f"{type(exc).__name__}: {exc}")

    async def _run_drop(self, cmd: coordinator_pb2.DropShard) -> None:
        try:
            await self.ctx.shard_handler.drop(cmd)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception(
                "dropping %s layers [%d, %d) failed", cmd.model, cmd.layers.start, cmd.layers.end
            )
            return
        self.report(
            node_pb2.ShardStatus(
                model=cmd.model, layers=cmd.layers, state=node_pb2.SHARD_STATE_DROPPED
            )
        )

    def report(self, status: node_pb2.ShardStatus) -> None:
        """Send a ShardStatus up the stream; also kept, and sent again after a reconnect
        so a restarted coordinator learns which shards this node holds."""
        key = (status.model, status.layers.start, status.layers.end)
        if status.state == node_pb2.SHARD_STATE_DROPPED:
            self._shard_reports.pop(key, None)
        else:
            self._shard_reports[key] = status
        if status.state in (node_pb2.SHARD_STATE_READY, node_pb2.SHARD_STATE_FAILED):
            log.info(
                "shard %s layers [%d, %d): %s%s",
                status.model,
                status.layers.start,
                status.layers.end,
                node_pb2.ShardState.Name(status.state).removeprefix("SHARD_STATE_"),
                f" ({status.error})" if status.error else "",
            )
        if self._outgoing is not None:
            self._outgoing.put_nowait(coordinator_pb2.NodeMessage(shard_status=status))

    def _replay_shard_reports(self) -> None:
        assert self._outgoing is not None
        for status in self._shard_reports.values():
            self._outgoing.put_nowait(coordinator_pb2.NodeMessage(shard_status=status))

    async def _cancel_commands(self) -> None:
        tasks = list(self._command_tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # ----- leaving ------------------------------------------------------------------

    def _begin_leave(self, leave: _Leave) -> None:
        if self._leave is not None:
            return
        self._leave = leave
        self.ctx.stop_accepting_work()
        if self.mqtt is not None:
            self.mqtt.set_state("draining")
        self._leave_event.set()

    async def _finish_running_work(self) -> None:
        """Wait until no session runs, up to the drain deadline or a second signal."""
        assert self._leave is not None
        deadline = time.monotonic() + self._leave.deadline_s
        announced = False
        while not self._force_event.is_set():
            sample = telemetry.merge(self.ctx.telemetry_sources)
            if telemetry.is_idle(sample):
                return
            if time.monotonic() >= deadline:
                log.warning(
                    "drain deadline passed with %d session(s) still open; leaving anyway",
                    sample.active_sessions,
                )
                return
            if not announced:
                log.info(
                    "waiting up to %.0fs for %d running session(s), %d queued",
                    self._leave.deadline_s,
                    sample.active_sessions,
                    sample.queue_length,
                )
                announced = True
            with contextlib.suppress(TimeoutError, asyncio.TimeoutError):
                await asyncio.wait_for(self._force_event.wait(), _IDLE_POLL_S)


def keepalive_options(config: AgentConfig) -> list[tuple[str, int]]:
    """gRPC channel options that ping the coordinator every `config.keepalive_s` and drop
    the connection (so the Attach stream fails and the agent reconnects) when a ping goes
    unanswered for half of that."""
    answer_ms = int(config.keepalive_s * 500)
    return [
        ("grpc.keepalive_time_ms", int(config.keepalive_s * 1000)),
        ("grpc.keepalive_timeout_ms", answer_ms),
        # gRPC core (1.85) times pings out after this one, 1 minute by default, not after
        # keepalive_timeout_ms: without it a hung coordinator went unnoticed.
        ("grpc.http2.ping_timeout_ms", answer_ms),
        ("grpc.keepalive_permit_without_calls", 1),
        # Pings keep going while the node sends nothing (e.g. between reconnects).
        ("grpc.http2.max_pings_without_data", 0),
    ]


async def _until_none(
    queue: asyncio.Queue[coordinator_pb2.NodeMessage | None],
) -> AsyncIterator[coordinator_pb2.NodeMessage]:
    while (message := await queue.get()) is not None:
        yield message


async def _close_quietly(handler: object) -> None:
    """Call the optional close() (sync or async) of the shard handler or a data-plane service:
    frees memory and files, keeps what must outlive the process."""
    close = getattr(handler, "close", None)
    if close is None:
        return
    try:
        result = close()
        if asyncio.iscoroutine(result):
            await result
    except Exception:
        log.exception("closing the %s failed", type(handler).__name__)
