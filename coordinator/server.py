"""Assembles a running coordinator: database, keys, event bus, registry, gRPC server.

    async with running_coordinator(settings) as coordinator:
        print(coordinator.address)       # HOST:PORT actually bound (port 0 -> a free one)
        ...                              # stops gracefully on exit

`serve(settings)` runs one until SIGTERM/SIGINT; it is what `tessera-coordinator serve` runs.

Optional parts plug in through COMPONENTS: (context attribute, "module:builder"). The
builder is called with the context (awaited if async) and its result set on the context, in
the listed order; a component with `async start()` / `async stop()` runs with the server.
A module that is not installed is skipped, and its RPCs answer UNIMPLEMENTED.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import importlib
import inspect
import logging
import signal
import sqlite3
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import grpc

from coordinator import db as database
from coordinator import secrets_store
from coordinator.addresses import split_host_port
from coordinator.context import CoordinatorContext
from coordinator.events import EventBus, MqttBus, create_bus
from coordinator.health import HealthServicer, add_health, serving, stopping
from coordinator.metrics import MetricsEndpoint
from coordinator.node_state import SHUTDOWN_REASON
from coordinator.presence import PresenceWatcher
from coordinator.registry import Registry
from coordinator.services import (
    AdminService,
    ClientApiService,
    CoordinatorService,
    LedgerService,
    VerificationService,
)
from coordinator.settings import Settings
from coordinator.tls import ServerTls, TlsFileError, dial_host, load_server_tls
from protos import identity
from protos.dialing import MESSAGE_LIMITS, TLS_SCHEME
from protos.request_parsing import ParseErrorsAreInvalidArgument
from protos.tessera.v1 import (
    admin_pb2_grpc,
    client_api_pb2_grpc,
    coordinator_pb2_grpc,
    ledger_pb2_grpc,
    verification_pb2_grpc,
)

log = logging.getLogger(__name__)

SERVER_OPTIONS = [
    *MESSAGE_LIMITS,
    # Two coordinators on one port would split the nodes between two registries: refuse.
    ("grpc.so_reuseport", 0),
    # Let agents ping us, to watch us and to keep NATs open (server_options pings them).
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 5_000),
    ("grpc.http2.max_ping_strikes", 0),
]
# A ping answer may take this long at least, however short the heartbeat interval: a busy
# machine must not lose every connection to one slow answer.
MIN_PING_ANSWER_MS = 5_000


def server_options(settings: Settings) -> list[tuple[str, int]]:
    """SERVER_OPTIONS plus keepalive: every connection gets an HTTP/2 ping as rarely as
    finding a dead peer within `offline_after` allows (every 10 s, answered within 5 s, at
    the defaults), and one left unanswered is closed, which ends its Attach stream, so the
    node is offline at once. For agents that send heartbeats only every few intervals,
    these pings are the liveness in between, answered by gRPC's core on both sides without
    waking Python. Each ping still costs the coordinator a few syscalls and thread
    wake-ups, hence as rare as possible, and no bandwidth-probing (BDP) pings at all."""
    interval_ms = int(settings.heartbeat_interval_s * 1000)
    offline_ms = int(settings.offline_after * 1000)
    ping_every_ms = max(offline_ms - MIN_PING_ANSWER_MS, interval_ms)
    answer_ms = max(offline_ms - ping_every_ms, MIN_PING_ANSWER_MS)
    return SERVER_OPTIONS + [
        ("grpc.keepalive_time_ms", ping_every_ms),
        ("grpc.keepalive_timeout_ms", answer_ms),
        ("grpc.http2.ping_timeout_ms", answer_ms),  # what gRPC 1.85 times keepalive out by
        ("grpc.http2.max_pings_without_data", 0),  # we send no data to quiet nodes
        # gRPC pings every connection that sends us data to size its receive window: one
        # ping per heartbeat. A fixed 4 MiB window instead keeps uploads (AddModel) fast.
        ("grpc.http2.bdp_probe", 0),
        ("grpc.http2.lookahead_bytes", 4 << 20),
    ]


GC_GEN0_THRESHOLD = 20_000
COMPONENTS: tuple[tuple[str, str], ...] = (
    ("model_store", "coordinator.model_store:ModelStore.from_context"),
    ("ledger", "coordinator.ledger.service:build"),
    ("sessions", "coordinator.inference:build"),
    ("relay", "coordinator.nat_relay:build"),
    ("jobs", "coordinator.jobs.service:build"),
    ("verifier", "coordinator.verifier:build"),
)
COORDINATOR_PRESENCE_TOPIC = "tessera/coordinator/presence"


class StartupError(RuntimeError):
    """The coordinator cannot start; the message says what to change."""


def _load_builder(target: str) -> Any:
    """The callable named by "module:attribute.path", or None if the module isn't installed."""
    module_name, _, path = target.partition(":")
    try:
        builder: Any = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name == module_name:
            return None
        raise
    for attribute in path.split("."):
        builder = getattr(builder, attribute)
    return builder


async def _build_components(ctx: CoordinatorContext) -> list[Any]:
    built = []
    for name, target in COMPONENTS:
        if getattr(ctx, name) is not None:
            built.append(getattr(ctx, name))
            continue
        build = _load_builder(target)
        if build is None:
            log.debug("no %s component installed (%s)", name, target)
            continue
        component = build(ctx)
        if inspect.isawaitable(component):
            component = await component
        setattr(ctx, name, component)
        built.append(component)
        log.info("%s: %s", name, type(component).__name__)
    return built


def build_context(settings: Settings, bus: EventBus | None = None) -> CoordinatorContext:
    try:
        settings.data_dir.mkdir(parents=True, exist_ok=True)
        db = database.open_database(settings.db_path)
    except (OSError, sqlite3.Error) as err:
        if isinstance(err, (FileExistsError, NotADirectoryError)):
            reason: object = f"{err.filename} is a file, not a directory"
        else:
            reason = err.strerror if isinstance(err, OSError) and err.strerror else err
        raise StartupError(
            f"cannot keep the coordinator's state in {settings.data_dir} (database "
            f"{settings.db_path}): {reason}; give --db a file in a directory this user can write"
        ) from None
    signing_key = secrets_store.load_or_create_signing_key(settings.data_dir)
    admin_token = secrets_store.load_or_create_admin_token(settings.data_dir)
    if bus is None:
        # With a broker, it tells everyone if we vanish without saying goodbye.
        bus = create_bus(
            settings.mqtt_url, will=(COORDINATOR_PRESENCE_TOPIC, b'{"state":"offline"}')
        )
    registry = Registry(
        database.NodeRepository(db), settings, bus, identity.public_key_bytes(signing_key)
    )
    return CoordinatorContext(
        settings=settings,
        db=db,
        registry=registry,
        bus=bus,
        signing_key=signing_key,
        admin_token=admin_token,
        data_dir=settings.data_dir,
    )


def build_server(ctx: CoordinatorContext) -> grpc.aio.Server:
    server = grpc.aio.server(
        options=server_options(ctx.settings), interceptors=[ParseErrorsAreInvalidArgument()]
    )
    coordinator_pb2_grpc.add_CoordinatorServicer_to_server(CoordinatorService(ctx), server)
    client_api_pb2_grpc.add_ClientApiServicer_to_server(ClientApiService(ctx), server)
    admin_pb2_grpc.add_AdminServicer_to_server(AdminService(ctx), server)
    ledger_pb2_grpc.add_LedgerServicer_to_server(LedgerService(ctx), server)
    for name, _ in COMPONENTS:  # components that bring services of their own (jobs)
        component = getattr(ctx, name, None)
        if hasattr(component, "add_to_server"):
            component.add_to_server(server)
    verification_pb2_grpc.add_VerificationServicer_to_server(VerificationService(ctx), server)
    return server


@dataclass
class RunningCoordinator:
    ctx: CoordinatorContext
    server: grpc.aio.Server
    address: str
    presence: PresenceWatcher
    components: list[Any] = field(default_factory=list)
    metrics_address: str = ""  # HOST:PORT of /metrics, with --metrics-listen


@contextlib.asynccontextmanager
async def running_coordinator(
    settings: Settings, bus: EventBus | None = None
) -> AsyncIterator[RunningCoordinator]:
    """A started coordinator; stopped gracefully (streams ended, state flushed) on exit."""
    ctx = build_context(settings, bus)
    components: list[Any] = []
    started: list[Any] = []
    server: grpc.aio.Server | None = None
    health: HealthServicer | None = None
    metrics: MetricsEndpoint | None = None
    presence = PresenceWatcher(ctx.bus, ctx.registry)
    try:
        host, _ = split_host_port(settings.listen)
        tls = _server_tls(settings)
        components = await _build_components(ctx)
        await ctx.registry.start()
        await ctx.bus.start()
        await presence.start()
        for component in components:
            if hasattr(component, "start"):
                await component.start()
                started.append(component)
        server = build_server(ctx)
        health = add_health(server)
        try:
            if tls is None:
                port = server.add_insecure_port(settings.listen)
            else:
                port = server.add_secure_port(settings.listen, tls.credentials)
        except RuntimeError as exc:
            # gRPC says only "Failed to bind": the port may be taken, or the host may not
            # be an address of this machine (a typo, or another machine's address).
            raise StartupError(
                f"cannot listen on {settings.listen} ({exc}); is another process using that "
                "port, or is the host not an address of this machine? Pick another --listen "
                "(0.0.0.0:PORT for every interface), or port 0 for any free port"
            ) from exc
        await server.start()
        await serving(health)
        if settings.metrics_listen is not None:
            metrics = MetricsEndpoint(ctx, settings.metrics_listen)
            try:
                await metrics.start()
            except OSError as exc:
                raise StartupError(
                    f"cannot serve metrics on {settings.metrics_listen} ({exc.strerror}); pick "
                    "another --metrics-listen, or port 0 for any free port"
                ) from exc
        address = f"{host}:{port}" if tls is None else f"{TLS_SCHEME}{dial_host(host, tls)}:{port}"
        ctx.bus.publish_nowait(
            COORDINATOR_PRESENCE_TOPIC, {"state": "online", "address": address}, retain=True
        )
        yield RunningCoordinator(
            ctx, server, address, presence, components, metrics.address if metrics else ""
        )
    finally:
        if health is not None:
            await stopping(health)
        if metrics is not None:
            await metrics.stop()
        await _shutdown(ctx, server, presence, started)


def _server_tls(settings: Settings) -> ServerTls | None:
    if settings.tls_cert is None or settings.tls_key is None:
        return None
    try:
        return load_server_tls(settings.tls_cert, settings.tls_key)
    except TlsFileError as exc:
        raise StartupError(str(exc)) from None


async def _shutdown(
    ctx: CoordinatorContext,
    server: grpc.aio.Server | None,
    presence: PresenceWatcher,
    started: list[Any],
) -> None:
    with contextlib.suppress(Exception):
        ctx.bus.publish_nowait(COORDINATOR_PRESENCE_TOPIC, {"state": "offline"}, retain=True)
    if server is not None:
        # Attach streams never end on their own: end them so the grace period is not spent
        # waiting for them, and nodes reconnect as soon as we are back.
        ctx.registry.end_all_streams(grpc.StatusCode.UNAVAILABLE, SHUTDOWN_REASON)
        await server.stop(ctx.settings.shutdown_grace_s)
    for component in reversed(started):
        try:
            await component.stop()
        except Exception:
            log.exception("stopping %s failed", type(component).__name__)
    await presence.stop()
    await ctx.registry.stop()
    await ctx.bus.close()
    if ctx.db.conn.in_transaction:
        # Every write commits in a transaction of its own; one left open is a bug, and
        # closing now would lose every write made since it opened.
        log.error("a database transaction was left open; committing it before closing")
        ctx.db.conn.commit()
    ctx.db.close()


def tune_garbage_collector() -> None:
    """Fewer, larger young-generation collections: every heartbeat allocates a few short-lived
    objects (messages, futures), and the default threshold of 700 made the collector a
    visible share of the heartbeat path. Everything alive after start-up is frozen out of
    collection altogether."""
    gc.collect()
    gc.freeze()
    _, gen1, gen2 = gc.get_threshold()
    gc.set_threshold(GC_GEN0_THRESHOLD, gen1, gen2)


async def serve(settings: Settings) -> None:
    """Run until SIGTERM or SIGINT, then stop gracefully."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError):  # Windows has no signal handlers
            loop.add_signal_handler(sig, stop.set)
    async with running_coordinator(settings) as coordinator:
        secrets_store.write_address(settings.data_dir, coordinator.address)
        if isinstance(coordinator.ctx.bus, MqttBus):
            log.info("event bus: MQTT broker %s", coordinator.ctx.bus.url)
        log.info(
            "serving on %s (db %s, data dir %s, heartbeat every %g s, offline after %g s)",
            coordinator.address, settings.db_path, settings.data_dir,
            settings.heartbeat_interval_s, settings.offline_after,
        )  # fmt: skip
        tune_garbage_collector()
        await stop.wait()
        log.info("stopping: ending node streams and flushing state")
    log.info("stopped")
