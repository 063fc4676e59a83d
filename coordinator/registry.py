"""The node registry: who is registered, who is attached, and in which state.

The live table is in memory and authoritative while the coordinator runs; SQLite mirrors it.
Registrations are written before the node hears back. Heartbeats only touch memory: their
last_seen times, and every state change, reach SQLite in one batch per flush interval, so
10,000 nodes heartbeating cost a handful of writes per second, not thousands.

State machine (every change is a node_events row, a presence event and a listener call):

    (registered) -> offline --attach--> online <--heartbeat-- suspect
    online --silent 1.5 intervals--> suspect
    online/suspect/draining --silent `offline_after`, or stream gone--> offline
    online/suspect --drain (node or admin)--> draining
    any --ban--> banned (final; registering again is refused)

Agents with keepalive pings (AttachHello.keepalive_pings) heartbeat only every
`telemetry_every_intervals` intervals, and their silences are judged in those units; our
pings, answered by gRPC's core, show them alive in between, and one left unanswered closes
the connection, so the stream is gone and the node offline at once.

Other parts use: nodes(), node(), send_command(), add_listener(), check_ticket(), ban().
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import math
import secrets
import sqlite3
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import grpc

from coordinator import agent_versions
from coordinator.challenges import ChallengeRejected, ChallengeStore
from coordinator.db import NodeRecord, NodeRepository, StateChange
from coordinator.events import EventBus
from coordinator.node_state import CONNECTED, RESTART_REASON, NodeState
from coordinator.refusal import Refusal
from coordinator.settings import Settings
from coordinator.validation import MAX_STRING_CHARS, InvalidField, validate_registration
from protos import identity
from protos.dialing import DIAL_OPTIONS
from protos.quoting import shown
from protos.tessera.v1 import (
    coordinator_pb2,
    node_pb2,
    stage_pb2,
    stage_pb2_grpc,
)

log = logging.getLogger(__name__)

TICKET_BYTES = 32
MAX_RTT_ENTRIES = 1024
MAX_SHARDS_PER_NODE = 256
DRAIN_DEADLINE_MS = 60_000
# State changes are rare and matter after a crash: they reach SQLite within this delay
# (bursts, e.g. thousands of nodes re-attaching, still share one transaction).
STATE_FLUSH_DELAY_S = 0.01


def now_ms() -> int:
    return int(time.time() * 1000)


def presence_topic(node_id: str) -> str:
    return f"tessera/nodes/{node_id}/presence"


def telemetry_topic(node_id: str) -> str:
    return f"tessera/nodes/{node_id}/telemetry"


class RegistryError(Refusal):
    """A request the registry refuses; `code` is the gRPC status to answer with."""


# -- what listeners receive -----------------------------------------------------------------------
@dataclass(frozen=True)
class NodeStateChanged:
    node_id: str
    old: NodeState | None
    new: NodeState
    reason: str
    ts_ms: int


@dataclass(frozen=True)
class ShardStatusReported:
    node_id: str
    status: node_pb2.ShardStatus


@dataclass(frozen=True)
class TelemetryReported:
    node_id: str
    telemetry: node_pb2.Telemetry


RegistryEvent = NodeStateChanged | ShardStatusReported | TelemetryReported
Listener = Callable[[RegistryEvent], Any]


@dataclass(frozen=True)
class NodeView:
    """A snapshot of one node. The proto fields are shared with the registry: don't mutate."""

    node_id: str
    name: str
    account: str
    capabilities: node_pb2.Capabilities
    state: NodeState
    data_address: str
    reachable: bool
    telemetry: node_pb2.Telemetry | None
    last_seen_ms: int
    registered_ms: int
    state_changed_ms: int
    shards: tuple[node_pb2.ShardStatus, ...]
    state_reason: str = ""

    def to_proto(self) -> node_pb2.NodeInfo:
        info = node_pb2.NodeInfo(
            node_id=self.node_id,
            name=self.name,
            account=self.account,
            state=self.state.to_proto(),
            capabilities=self.capabilities,
            registered_unix_ms=self.registered_ms,
            last_seen_unix_ms=self.last_seen_ms,
            state_changed_unix_ms=self.state_changed_ms,
            data_address=self.data_address,
            shards=self.shards,
            reachable=self.reachable,
            state_reason=self.state_reason,
        )
        if self.telemetry is not None:
            info.telemetry.CopyFrom(self.telemetry)
        return info


class AttachSession:
    """One open Attach stream. Writes are serialized: acks and commands share the stream."""

    def __init__(
        self,
        node: _LiveNode,
        context: grpc.aio.ServicerContext,
        settings: Settings,
        keepalive_pings: bool = False,
    ) -> None:
        self.node = node
        self.context = context
        self.task = asyncio.current_task()
        self.started_ms = now_ms()
        self.ended: tuple[grpc.StatusCode, str] | None = None
        # What the node last heard from us about its state, and heartbeats since then.
        self.acked_state = node.state
        self.unacked = 0
        # The node's connection carries keepalive pings: no routine acks, and heartbeats
        # (telemetry) only every few intervals, so its silences are judged by that pace.
        self.keepalive_pings = keepalive_pings
        if keepalive_pings:
            self.heartbeat_interval_s = settings.telemetry_interval_s
            self.suspect_after = settings.suspect_after * settings.telemetry_every_intervals
            self.offline_after = settings.offline_after * settings.telemetry_every_intervals
        else:
            self.heartbeat_interval_s = settings.heartbeat_interval_s
            self.suspect_after = settings.suspect_after
            self.offline_after = settings.offline_after
        self._write_lock = asyncio.Lock()

    async def send(self, message: coordinator_pb2.CoordinatorMessage) -> None:
        async with self._write_lock:
            await self.context.write(message)

    def end(self, code: grpc.StatusCode, details: str) -> None:
        """Close the stream from outside its handler; the handler answers with `code`."""
        if self.ended is None:
            self.ended = (code, details)
            if self.task is not None and not self.task.done():
                self.task.cancel()


class _LiveNode:
    __slots__ = (
        "node_id", "public_key", "name", "account", "capabilities", "data_address", "reachable",
        "state", "registered_ms", "last_seen_ms", "last_seen_mono", "state_changed_ms",
        "telemetry", "shards", "ticket", "attach", "persisted_last_seen_ms", "state_reason",
    )  # fmt: skip

    def __init__(self, record: NodeRecord, capabilities: node_pb2.Capabilities) -> None:
        self.node_id = record.node_id
        self.public_key = record.public_key
        self.name = record.name
        self.account = record.account
        self.capabilities = capabilities
        self.data_address = record.data_address
        self.reachable = record.reachable
        self.state = NodeState(record.state)
        self.registered_ms = record.registered_ms
        self.last_seen_ms = record.last_seen_ms
        self.persisted_last_seen_ms = record.last_seen_ms
        self.last_seen_mono = time.monotonic()
        self.state_changed_ms = record.state_changed_ms
        self.state_reason = ""  # the newest node_events row's, once loaded or changed
        self.telemetry: node_pb2.Telemetry | None = None
        self.shards: dict[tuple[str, int, int], node_pb2.ShardStatus] = {}
        self.ticket: bytes | None = None
        self.attach: AttachSession | None = None

    def view(self) -> NodeView:
        return NodeView(
            node_id=self.node_id,
            name=self.name,
            account=self.account,
            capabilities=self.capabilities,
            state=self.state,
            data_address=self.data_address,
            reachable=self.reachable,
            telemetry=self.telemetry,
            last_seen_ms=self.last_seen_ms,
            registered_ms=self.registered_ms,
            state_changed_ms=self.state_changed_ms,
            shards=tuple(self.shards.values()),
            state_reason=self.state_reason,
        )


def validate_telemetry(telemetry: node_pb2.Telemetry) -> None:
    utilization = telemetry.utilization
    if not 0 <= utilization <= 1:  # also false for NaN
        raise InvalidField("heartbeat.telemetry.utilization", "must be between 0 and 1")
    rtt_ms = telemetry.rtt_ms
    if not len(rtt_ms):  # the common case; iterating an empty proto map is not free
        return
    if len(rtt_ms) > MAX_RTT_ENTRIES:
        raise InvalidField("heartbeat.telemetry.rtt_ms", f"more than {MAX_RTT_ENTRIES} peers")
    for peer, rtt in rtt_ms.items():
        if len(peer) > 64 or not 0 <= rtt < math.inf:
            raise InvalidField("heartbeat.telemetry.rtt_ms", f"bad entry {peer[:64]!r}: {rtt}")


def validate_shard_status(status: node_pb2.ShardStatus) -> None:
    if not status.model or len(status.model) > MAX_STRING_CHARS:
        raise InvalidField("shard_status.model", "must be a model name of 1-256 characters")
    if status.layers.start >= status.layers.end:
        raise InvalidField("shard_status.layers", "start must be below end")
    if not math.isfinite(status.progress) or not 0 <= status.progress <= 1:
        raise InvalidField("shard_status.progress", "must be between 0 and 1")


class Registry:
    def __init__(
        self,
        repo: NodeRepository,
        settings: Settings,
        bus: EventBus,
        coordinator_public_key: bytes,
        challenges: ChallengeStore | None = None,
    ) -> None:
        self.repo = repo
        self.settings = settings
        self.bus = bus
        self.coordinator_public_key = coordinator_public_key
        self.challenges = challenges or ChallengeStore(
            settings.challenge_ttl_s, settings.max_pending_challenges
        )
        self._nodes: dict[str, _LiveNode] = {}
        self._attached: dict[str, AttachSession] = {}
        self._listeners: list[Listener] = []
        self._dirty_last_seen: set[_LiveNode] = set()
        self._persist_last_seen_ms = int(settings.last_seen_persist_s * 1000)
        self._pending_changes: list[StateChange] = []
        self._tasks: list[asyncio.Task[None]] = []
        self._state_flush: asyncio.TimerHandle | None = None
        self.heartbeats = 0
        # Nodes that were connected when this coordinator last stopped (found at start):
        # placement waits a while for them to re-attach before it re-plans.
        self.returning: list[str] = []

    # -- lifecycle ------------------------------------------------------------------------------
    async def start(self) -> None:
        """Load every known node; whoever was connected before a restart is offline now."""
        for record in self.repo.load_nodes():
            caps = node_pb2.Capabilities()
            caps.ParseFromString(record.capabilities)
            self._nodes[record.node_id] = _LiveNode(record, caps)
        for node_id, reason in self.repo.last_reasons().items():
            if node_id in self._nodes:
                self._nodes[node_id].state_reason = reason
        for node in self._nodes.values():
            if node.state in CONNECTED:
                self._set_state(node, NodeState.OFFLINE, RESTART_REASON)
                self.returning.append(node.node_id)
        self.flush()
        log.info("registry loaded %d known nodes", len(self._nodes))
        self._tasks = [
            asyncio.create_task(self._flush_loop(), name="registry flush"),
            asyncio.create_task(self._watchdog_loop(), name="registry watchdog"),
        ]

    async def stop(self) -> None:
        if self._state_flush is not None:
            self._state_flush.cancel()
            self._state_flush = None
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        self.flush()

    def flush(self) -> None:
        """Write batched last_seen times and state changes to SQLite now."""
        dirty, self._dirty_last_seen = self._dirty_last_seen, set()
        changes, self._pending_changes = self._pending_changes, []
        last_seen = {}
        for node in dirty:
            last_seen[node.node_id] = node.persisted_last_seen_ms = node.last_seen_ms
        try:
            self.repo.write_batch(last_seen, changes)
        except Exception:
            # Keep them for the next flush: a locked or full disk must not lose events.
            self._dirty_last_seen |= dirty
            self._pending_changes[:0] = changes
            raise

    def _schedule_state_flush(self) -> None:
        if self._state_flush is not None:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # not serving yet: start() and stop() flush explicitly
        self._state_flush = loop.call_later(STATE_FLUSH_DELAY_S, self._flush_states)

    def _flush_states(self) -> None:
        self._state_flush = None
        try:
            self.flush()
        except Exception:
            log.exception("could not write node state changes to the database; will retry")

    async def _flush_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.flush_interval_s)
            try:
                self.flush()
            except Exception:
                log.exception("could not write node state to the database; will retry")

    async def _watchdog_loop(self) -> None:
        """Judges the silence between heartbeats, each session by its own pace.

        A node whose connection went dead is not found here: its stream breaks (TCP, or
        our keepalive pings going unanswered) and close_attach marks it offline at once.
        This finds nodes whose connection lives on but whose agent stopped heartbeating.
        """
        settings = self.settings
        tick = min(max(min(settings.suspect_after, settings.offline_after) / 4, 0.02), 1.0)
        while True:
            await asyncio.sleep(tick)
            now = time.monotonic()
            for session in list(self._attached.values()):
                node = session.node
                silent = now - node.last_seen_mono
                if silent < session.suspect_after:
                    continue  # the common case, kept cheap: this loop visits every node
                if silent >= session.offline_after:
                    reason = f"no heartbeat for {silent:.1f} s"
                    self._set_state(node, NodeState.OFFLINE, reason)
                    session.end(grpc.StatusCode.UNAVAILABLE, reason + "; attach again")
                elif node.state is NodeState.ONLINE:
                    self._set_state(node, NodeState.SUSPECT, f"no heartbeat for {silent:.1f} s")

    # -- queries for other parts ----------------------------------------------------------------
    def nodes(self, states: Iterable[NodeState] | None = None) -> list[NodeView]:
        wanted = None if states is None else frozenset(states)
        return [n.view() for n in self._nodes.values() if wanted is None or n.state in wanted]

    def node(self, node_id: str) -> NodeView | None:
        node = self._nodes.get(node_id)
        return None if node is None else node.view()

    def __len__(self) -> int:
        return len(self._nodes)

    @property
    def attached_count(self) -> int:
        return len(self._attached)

    def check_ticket(self, node_id: str, ticket: bytes) -> bool:
        """True if `ticket` is the attach ticket of the node's latest registration."""
        node = self._nodes.get(node_id)
        if node is None or node.ticket is None or node.state is NodeState.BANNED:
            return False
        return hmac.compare_digest(node.ticket, ticket)

    def add_listener(self, listener: Listener) -> Callable[[], None]:
        """Call `listener(event)` for every registry event; returns a function to remove it.

        Listeners run inline on the event loop: they must be quick and must not block.
        """
        self._listeners.append(listener)
        return lambda: self._listeners.remove(listener) if listener in self._listeners else None

    def _notify(self, event: RegistryEvent) -> None:
        for listener in self._listeners:
            try:
                listener(event)
            except Exception:
                log.exception("registry listener %r failed on %r", listener, event)

    def _set_state(self, node: _LiveNode, new: NodeState, reason: str) -> None:
        old = node.state
        if old is new:
            return
        ts = now_ms()
        node.state = new
        node.state_changed_ms = ts
        node.state_reason = reason
        self._pending_changes.append(StateChange(node.node_id, ts, old.value, new.value, reason))
        self._schedule_state_flush()
        log.info("node %s (%s): %s -> %s: %s", node.node_id, node.name, old.value, new.value,
                 reason)  # fmt: skip
        self.bus.publish_nowait(
            presence_topic(node.node_id),
            {"state": new.value, "ts": ts, "node_id": node.node_id, "source": "coordinator",
             "reason": reason},
            retain=True,
        )  # fmt: skip
        self._notify(NodeStateChanged(node.node_id, old, new, reason, ts))

    # -- registration ---------------------------------------------------------------------------
    def issue_challenge(self, public_key: bytes) -> tuple[bytes, int]:
        if len(public_key) != identity.PUBLIC_KEY_BYTES:
            raise RegistryError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"public_key must be a raw {identity.PUBLIC_KEY_BYTES}-byte Ed25519 key, "
                f"got {len(public_key)} bytes",
            )
        nonce, ttl_s = self.challenges.issue(public_key)
        return nonce, now_ms() + int(ttl_s * 1000)

    async def register(
        self, request: coordinator_pb2.RegisterRequest
    ) -> coordinator_pb2.RegisterResponse:
        public_key = request.public_key
        if len(public_key) != identity.PUBLIC_KEY_BYTES:
            raise RegistryError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"public_key must be a raw {identity.PUBLIC_KEY_BYTES}-byte Ed25519 key",
            )
        try:
            self.challenges.check(request.nonce, public_key)
        except ChallengeRejected as exc:
            raise RegistryError(grpc.StatusCode.UNAUTHENTICATED, str(exc)) from None
        if not request.signature:
            raise RegistryError(
                grpc.StatusCode.UNAUTHENTICATED,
                "missing signature: sign protos.identity.register_payload(request) with the "
                "node key",
            )
        if not identity.verify(public_key, request.signature, identity.register_payload(request)):
            raise RegistryError(
                grpc.StatusCode.UNAUTHENTICATED,
                "the signature does not verify against public_key over "
                "protos.identity.register_payload(request)",
            )
        self.challenges.consume(request.nonce)
        try:
            validate_registration(request)
        except InvalidField as exc:
            raise RegistryError(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
        node_id = identity.node_id(public_key)
        if self._is_banned(node_id):
            raise RegistryError(grpc.StatusCode.PERMISSION_DENIED, f"node {node_id} is banned")
        # After the ban: upgrading would not help a banned node.
        too_old = agent_versions.refusal(
            request.capabilities.agent_version, self.settings.min_agent_version
        )
        if too_old is not None:
            raise RegistryError(grpc.StatusCode.FAILED_PRECONDITION, too_old)

        reachable = False
        if request.data_address:
            reachable = await self._probe_reachability(request.data_address, node_id)
            if self._is_banned(node_id):  # banned while we were dialing
                raise RegistryError(grpc.StatusCode.PERMISSION_DENIED, f"node {node_id} is banned")

        ts = now_ms()
        caps = request.capabilities
        node = self._nodes.get(node_id)
        change = None
        if node is None:
            record = NodeRecord(
                node_id=node_id, public_key=public_key, name=request.name,
                account=request.account, capabilities=b"", device_kind="", device_name="",
                device_count=0, memory_usable_bytes=0, matmul_tflops=0.0, region="",
                data_address="", state=NodeState.OFFLINE.value, registered_ms=ts,
                last_seen_ms=ts, state_changed_ms=ts, reachable=False,
            )  # fmt: skip
            node = _LiveNode(record, caps)
            change = StateChange(node_id, ts, None, NodeState.OFFLINE.value, "registered")
        node.name = request.name
        node.account = request.account
        node.capabilities = caps
        node.data_address = request.data_address
        node.reachable = reachable
        node.last_seen_ms = node.persisted_last_seen_ms = ts
        node.last_seen_mono = time.monotonic()
        try:
            self.repo.save_registration(self._record(node), change)
        except sqlite3.Error as exc:
            log.error("could not store the registration of %s: %s", node_id, exc)
            raise RegistryError(
                grpc.StatusCode.UNAVAILABLE,
                "the coordinator could not store the registration right now; try again",
            ) from None
        self._nodes[node_id] = node
        node.ticket = secrets.token_bytes(TICKET_BYTES)
        log.info(
            "registered node %s (name=%s, account=%s, device=%s %s, tflops=%.2f, "
            "data address=%s, reachable=%s)",
            node_id, node.name, node.account or "-", caps.device_kind, caps.device_name,
            caps.matmul_tflops, node.data_address or "-", reachable,
        )  # fmt: skip
        return coordinator_pb2.RegisterResponse(
            node_id=node_id,
            coordinator_public_key=self.coordinator_public_key,
            attach_ticket=node.ticket,
            heartbeat_interval_ms=int(self.settings.heartbeat_interval_s * 1000),
            offline_after_ms=int(self.settings.offline_after * 1000),
            mqtt_url=self.settings.mqtt_url or "",
            reachable=reachable,
            coordinator_unix_ms=now_ms(),
        )

    def _is_banned(self, node_id: str) -> bool:
        node = self._nodes.get(node_id)
        return node is not None and node.state is NodeState.BANNED

    @staticmethod
    def _record(node: _LiveNode) -> NodeRecord:
        caps = node.capabilities
        return NodeRecord(
            node_id=node.node_id,
            public_key=node.public_key,
            name=node.name,
            account=node.account,
            capabilities=caps.SerializeToString(deterministic=True),
            device_kind=caps.device_kind,
            device_name=caps.device_name,
            device_count=caps.device_count,
            memory_usable_bytes=caps.memory_usable_bytes,
            matmul_tflops=caps.matmul_tflops,
            region=caps.region,
            data_address=node.data_address,
            state=node.state.value,
            registered_ms=node.registered_ms,
            last_seen_ms=node.last_seen_ms,
            state_changed_ms=node.state_changed_ms,
            reachable=node.reachable,
        )

    async def recheck_reachability(self, node_id: str, *, again: bool = False) -> bool:
        """Dial a node that was not reachable at its registration again (``again``: even
        one that was, which a client could not reach); True when it answers."""
        node = self._nodes.get(node_id)
        if node is None or not node.data_address:
            return False
        if again or not node.reachable:
            node.reachable = await self._probe_reachability(node.data_address, node_id)
        return node.reachable

    async def _probe_reachability(self, address: str, node_id: str) -> bool:
        """Dial the node's stage server back: can clients reach it directly?"""
        payload = secrets.token_bytes(16)
        try:
            async with grpc.aio.insecure_channel(address, options=DIAL_OPTIONS) as channel:
                reply = await stage_pb2_grpc.StageStub(channel).Ping(
                    stage_pb2.PingRequest(payload=payload),
                    timeout=self.settings.reachability_timeout_s,
                )
        except Exception as exc:  # noqa: BLE001 - any failure just means "not reachable"
            why = exc.code().name if isinstance(exc, grpc.aio.AioRpcError) else type(exc).__name__
            log.info("node %s: data address %s is not reachable (%s)", node_id, address, why)
            return False
        if reply.payload != payload or reply.node_id != node_id:
            log.warning("node %s: %s answered Ping as %r; not counting it reachable", node_id,
                        address, reply.node_id)  # fmt: skip
            return False
        return True

    # -- attach ---------------------------------------------------------------------------------
    def open_attach(
        self, hello: coordinator_pb2.AttachHello, context: grpc.aio.ServicerContext
    ) -> AttachSession:
        node = self._nodes.get(hello.node_id)
        if node is None:
            raise RegistryError(
                grpc.StatusCode.NOT_FOUND,
                f"unknown node id {hello.node_id[:64]!r}: call Register first",
            )
        if node.state is NodeState.BANNED:
            raise RegistryError(grpc.StatusCode.PERMISSION_DENIED, f"node {node.node_id} is banned")
        if node.ticket is None or not hmac.compare_digest(node.ticket, hello.attach_ticket):
            raise RegistryError(
                grpc.StatusCode.UNAUTHENTICATED,
                "the attach ticket does not match this node's latest registration; register again",
            )
        session = AttachSession(node, context, self.settings, hello.keepalive_pings)
        # A new stream starts from what the node reports on it: a restarted agent may hold
        # nothing, and a reconnecting one re-sends the status of every shard it has.
        node.shards.clear()
        previous = node.attach
        node.attach = session
        self._attached[node.node_id] = session
        if previous is not None:
            previous.end(
                grpc.StatusCode.ABORTED, "a newer Attach stream for this node replaced this one"
            )
        self._touch(node)
        self._set_state(node, NodeState.ONLINE, "attached")
        return session

    def close_attach(self, session: AttachSession, reason: str) -> None:
        """The stream is over: unless a newer one replaced it, the node is offline."""
        node = session.node
        if node.attach is not session:
            return
        node.attach = None
        self._attached.pop(node.node_id, None)
        if node.state is not NodeState.BANNED:
            self._set_state(node, NodeState.OFFLINE, reason)

    def welcome(self, session: AttachSession) -> coordinator_pb2.CoordinatorMessage:
        node = session.node
        session.acked_state = node.state
        return coordinator_pb2.CoordinatorMessage(
            welcome=coordinator_pb2.Welcome(
                node_id=node.node_id,
                state=node.state.to_proto(),
                heartbeat_interval_ms=int(self.settings.heartbeat_interval_s * 1000),
                acks_on_state_change_only=session.keepalive_pings,
                telemetry_interval_ms=(
                    int(session.heartbeat_interval_s * 1000) if session.keepalive_pings else 0
                ),
            )
        )

    def _touch(self, node: _LiveNode) -> None:
        node.last_seen_mono = time.monotonic()
        node.last_seen_ms = ms = now_ms()
        # last_seen on disk is informational (after a restart every node is offline anyway),
        # so it is refreshed only every `last_seen_persist_s`, not with every heartbeat.
        if ms - node.persisted_last_seen_ms >= self._persist_last_seen_ms:
            self._dirty_last_seen.add(node)

    def on_heartbeat(
        self, session: AttachSession, heartbeat: coordinator_pb2.Heartbeat
    ) -> coordinator_pb2.CoordinatorMessage | None:
        """The hot path: memory only, no I/O. Returns the ack to send, if one is due.

        An ack always goes out when the node's state changed since the last thing it heard
        from us (a drain, suspect -> online). Otherwise a node with keepalive pings gets
        none (its pings watch the stream), and an older one every `heartbeat_ack_every`-th.
        Each ack is a gRPC write, a large share of the coordinator's cost per heartbeat.
        """
        node = session.node
        self._touch(node)
        self.heartbeats += 1
        if heartbeat.HasField("telemetry"):
            try:
                validate_telemetry(heartbeat.telemetry)
            except InvalidField as exc:
                raise RegistryError(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
            node.telemetry = heartbeat.telemetry
            if self._listeners:
                self._notify(TelemetryReported(node.node_id, heartbeat.telemetry))
        if node.state is NodeState.SUSPECT:
            self._set_state(node, NodeState.ONLINE, "heartbeats resumed")
        if node.state is session.acked_state:
            if session.keepalive_pings:
                return None
            session.unacked += 1
            if session.unacked < self.settings.heartbeat_ack_every:
                return None
        session.unacked = 0
        session.acked_state = node.state
        return coordinator_pb2.CoordinatorMessage(
            heartbeat_ack=coordinator_pb2.HeartbeatAck(
                seq=heartbeat.seq, state=node.state.to_proto()
            )
        )

    def on_drain_request(
        self, session: AttachSession, request: coordinator_pb2.DrainRequest
    ) -> None:
        node = session.node
        self._touch(node)
        if node.state in (NodeState.ONLINE, NodeState.SUSPECT):
            # The node's free text goes into the log, the database and the event bus: quoted
            # and cut, so control characters and line breaks cannot forge log lines.
            reason = shown(request.reason, 200) if request.reason else "no reason given"
            self._set_state(node, NodeState.DRAINING, f"node asked to drain: {reason}")

    def on_shard_status(self, session: AttachSession, status: node_pb2.ShardStatus) -> None:
        try:
            validate_shard_status(status)
        except InvalidField as exc:
            raise RegistryError(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
        node = session.node
        self._touch(node)
        key = (status.model, status.layers.start, status.layers.end)
        if status.state == node_pb2.SHARD_STATE_DROPPED:
            node.shards.pop(key, None)
        elif key in node.shards or len(node.shards) < MAX_SHARDS_PER_NODE:
            if len(status.error) > 1024:
                status.error = status.error[:1024] + "..."
            node.shards[key] = status
        else:
            raise RegistryError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"a node may report at most {MAX_SHARDS_PER_NODE} shards",
            )
        self._notify(ShardStatusReported(node.node_id, status))

    # -- commands -------------------------------------------------------------------------------
    async def send_command(self, node_id: str, command: coordinator_pb2.Command) -> bool:
        """Send a command down the node's Attach stream; False if it is not attached."""
        session = self._attached.get(node_id)
        if session is None or session.ended is not None:
            return False
        try:
            await session.send(coordinator_pb2.CoordinatorMessage(command=command))
        except Exception as exc:  # noqa: BLE001 - a stream that broke under us: not sent
            log.info("could not send %s to node %s: %s", command.WhichOneof("kind"), node_id, exc)
            return False
        return True

    def _operator_target(self, node_id: str, action: str) -> _LiveNode:
        """The node an operator's request names (drain, ban, unban)."""
        if not node_id:
            raise RegistryError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"name the node to {action}: node_id is empty (`tessera-coordinator nodes "
                "list --all` shows the ids)",
            )
        node = self._nodes.get(node_id)
        if node is None:
            raise RegistryError(grpc.StatusCode.NOT_FOUND, f"unknown node id {node_id[:64]!r}")
        return node

    async def drain(self, node_id: str, reason: str) -> str:
        """Ask an attached node to finish its work and leave (admin request); returns the
        reason as the node was told it (at most 200 characters)."""
        node = self._operator_target(node_id, "drain")
        if node.state not in CONNECTED:
            raise RegistryError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"node {node_id} is {node.state.value}; only a connected node can drain",
            )
        reason = reason[:200] or "operator request"
        command = coordinator_pb2.Command(
            drain=coordinator_pb2.Drain(reason=reason, deadline_ms=DRAIN_DEADLINE_MS)
        )
        if not await self.send_command(node_id, command):
            raise RegistryError(
                grpc.StatusCode.UNAVAILABLE, f"node {node_id} disconnected before the drain"
            )
        if node.state in (NodeState.ONLINE, NodeState.SUSPECT):
            # Logged and stored: quoted, so line breaks cannot forge log lines.
            self._set_state(node, NodeState.DRAINING, f"admin asked to drain: {shown(reason)}")
        return reason

    def operator_ban(self, node_id: str, reason: str) -> str:
        """An operator bans a node (admin request): as ``ban``, and refused for a node
        banned already, so that the reason on record stays the first one. Returns the
        reason as recorded."""
        node = self._operator_target(node_id, "ban")
        if node.state is NodeState.BANNED:
            raise RegistryError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"node {node_id} is banned already (`tessera-coordinator nodes list --all`)",
            )
        recorded = f"by an operator: {shown(reason[:200] or 'no reason given')}"
        self.ban(node_id, recorded)
        return recorded

    def unban(self, node_id: str, reason: str) -> str:
        """Lift a ban (admin request): the node is offline, and may register again. What
        it did stays on record (its failures in the verifier's reputation, so it is checked
        as a new node is). Returns the reason as recorded."""
        node = self._operator_target(node_id, "unban")
        if node.state is not NodeState.BANNED:
            raise RegistryError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"node {node_id} is {node.state.value}, not banned: there is no ban to lift",
            )
        recorded = f"ban lifted by an operator: {shown(reason[:200] or 'no reason given')}"
        self._set_state(node, NodeState.OFFLINE, recorded)
        return recorded

    def ban(self, node_id: str, reason: str) -> None:
        """Final: the node's stream is closed and its key may not register again."""
        node = self._nodes.get(node_id)
        if node is None:
            raise RegistryError(grpc.StatusCode.NOT_FOUND, f"unknown node id {node_id[:64]!r}")
        self._set_state(node, NodeState.BANNED, reason)
        node.ticket = None
        session = self._attached.pop(node_id, None)
        node.attach = None
        if session is not None:
            session.end(grpc.StatusCode.PERMISSION_DENIED, f"node banned: {reason}")

    def end_all_streams(self, code: grpc.StatusCode, details: str) -> None:
        for session in list(self._attached.values()):
            session.end(code, details)

    def mark_offline_by_broker(self, node_id: str, ts_ms: int | None) -> bool:
        """The event broker reported the node gone (its MQTT last will).

        A will that was set before the current Attach stream began belongs to an earlier
        run of the node, so it is ignored. Returns True if the node was marked offline.
        """
        session = self._attached.get(node_id)
        if session is None:
            return False
        if ts_ms is not None and ts_ms < session.started_ms:
            log.info("ignoring an offline presence for node %s from before its current attach",
                     node_id)  # fmt: skip
            return False
        reason = "the event broker reported the node gone (MQTT last will)"
        self._set_state(session.node, NodeState.OFFLINE, reason)
        session.end(grpc.StatusCode.UNAVAILABLE, reason + "; attach again")
        return True

    def on_broker_telemetry(self, node_id: str, telemetry: node_pb2.Telemetry) -> None:
        node = self._nodes.get(node_id)
        if node is None or node.state not in CONNECTED:
            return
        try:
            validate_telemetry(telemetry)
        except InvalidField as exc:
            log.debug("ignoring telemetry of %s from the broker: %s", node_id, exc)
            return
        node.telemetry = telemetry
        if self._listeners:
            self._notify(TelemetryReported(node_id, telemetry))
