"""The node's own gRPC server (the `Stage` service), started before it registers.

The agent registers whatever `node_agent.stage_server.build_stage_servicer(ctx)` returns.
While that module does not exist, a fallback answers `Ping` (so the coordinator's
reachability check and RTT probes work) and refuses model calls with UNAVAILABLE.
Next to it, the `TrainingStage` service from
`node_agent.training_server.build_training_servicer(ctx)`, when that module exists.
"""

from __future__ import annotations

import ipaddress
import logging
import socket

import grpc

from node_agent.context import AgentContext
from node_agent.plugins import load_plugin
from protos import dialing
from protos.dialing import DATA_WINDOW, MESSAGE_LIMITS
from protos.request_parsing import ParseErrorsAreInvalidArgument
from protos.tessera.v1 import common_pb2, stage_pb2, stage_pb2_grpc, training_pb2_grpc

log = logging.getLogger(__name__)

SERVER_OPTIONS = [
    *MESSAGE_LIMITS,
    # gRPC shares ports by default; two agents on one --listen port would then split the
    # traffic between them silently. A busy port must be an error instead.
    ("grpc.so_reuseport", 0),
    *DATA_WINDOW,
]
MAX_PING_PAYLOAD_BYTES = 1024 * 1024


async def answer_ping(
    request: stage_pb2.PingRequest, context: grpc.aio.ServicerContext, node_id: str
) -> stage_pb2.PingResponse:
    """Echo the payload with our id: the coordinator's reachability check and RTT probes."""
    if len(request.payload) > MAX_PING_PAYLOAD_BYTES:
        await context.abort(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"ping payload is {len(request.payload)} bytes; send at most {MAX_PING_PAYLOAD_BYTES}",
        )
    return stage_pb2.PingResponse(payload=request.payload, node_id=node_id)


_NO_MODEL = "this node has no model loaded (its agent runs without a model runtime)"


class NoModelStageServicer(stage_pb2_grpc.StageServicer):
    """Answers Ping; refuses Forward, EndSession, Deliveries and Acknowledge: there is
    nothing to run (and so nothing to acknowledge)."""

    def __init__(self, ctx: AgentContext) -> None:
        self._ctx = ctx

    async def Ping(  # noqa: N802 - gRPC method name
        self, request: stage_pb2.PingRequest, context: grpc.aio.ServicerContext
    ) -> stage_pb2.PingResponse:
        return await answer_ping(request, context, self._ctx.node_id)

    async def Forward(  # noqa: N802 - gRPC method name
        self, request_iterator: object, context: grpc.aio.ServicerContext
    ) -> None:
        await context.abort(grpc.StatusCode.UNAVAILABLE, _NO_MODEL)

    async def EndSession(  # noqa: N802 - gRPC method name
        self, request: stage_pb2.EndSessionRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.Empty:
        await context.abort(grpc.StatusCode.UNAVAILABLE, _NO_MODEL)
        return common_pb2.Empty()  # not reached: abort() raises

    async def Deliveries(  # noqa: N802 - gRPC method name
        self, request: stage_pb2.DeliveriesRequest, context: grpc.aio.ServicerContext
    ) -> None:
        await context.abort(grpc.StatusCode.UNAVAILABLE, _NO_MODEL)

    async def Acknowledge(  # noqa: N802 - gRPC method name
        self, request: stage_pb2.AcknowledgeRequest, context: grpc.aio.ServicerContext
    ) -> stage_pb2.AcknowledgeResponse:
        await context.abort(grpc.StatusCode.UNAVAILABLE, _NO_MODEL)
        return stage_pb2.AcknowledgeResponse()  # not reached: abort() raises


def build_stage_servicer(ctx: AgentContext) -> stage_pb2_grpc.StageServicer:
    servicer = load_plugin("node_agent.stage_server", "build_stage_servicer", ctx)
    if servicer is None:
        log.info("no stage server module: serving Ping only (model calls answer UNAVAILABLE)")
        return NoModelStageServicer(ctx)
    return servicer  # type: ignore[return-value]


def build_training_servicer(ctx: AgentContext) -> training_pb2_grpc.TrainingStageServicer | None:
    servicer = load_plugin("node_agent.training_server", "build_training_servicer", ctx)
    return servicer  # type: ignore[return-value]


class ListenError(OSError):
    """The data plane cannot listen where --listen says (an OSError, as it always was)."""


async def start_server(
    ctx: AgentContext,
    listen: str,
    servicer: stage_pb2_grpc.StageServicer | None = None,
    training: training_pb2_grpc.TrainingStageServicer | None = None,
) -> tuple[grpc.aio.Server, int]:
    """Start the Stage server on `listen` (HOST:PORT, port 0 = any) and return the port.
    Without `servicer`, the one `build_stage_servicer(ctx)` finds; the TrainingStage
    service likewise (`training`, else `build_training_servicer(ctx)`; none: UNIMPLEMENTED).
    The stage servicer is built first: it creates the shard manager both share."""
    server = grpc.aio.server(options=SERVER_OPTIONS, interceptors=[ParseErrorsAreInvalidArgument()])
    stage_pb2_grpc.add_StageServicer_to_server(servicer or build_stage_servicer(ctx), server)
    training = training or build_training_servicer(ctx)
    if training is not None:
        training_pb2_grpc.add_TrainingStageServicer_to_server(training, server)
    try:
        port = server.add_insecure_port(listen)
    except RuntimeError:
        port = 0  # gRPC says no more than "failed to bind"
    if port == 0:
        raise ListenError(
            f"cannot listen on {listen}: the port is in use or the host is not an address of "
            f"this machine; pick another --listen (port 0 picks a free port)"
        )
    await server.start()
    return server, port


def split_host_port(address: str) -> tuple[str, int]:
    """'host:port' or '[v6]:port' -> (host, port). Raises ValueError with a readable message."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"{address!r} is not HOST:PORT (e.g. 127.0.0.1:7070 or [::1]:7070)")
    return host.strip("[]"), int(port)


def join_host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def advertised_address(listen_host: str, port: int, coordinator_address: str) -> str:
    """What to tell the coordinator. A wildcard listen address is no address; use the
    local IP this machine would use to reach the coordinator, which is the one peers on
    the coordinator's side of the network can most likely dial."""
    if not _is_wildcard(listen_host):
        return join_host_port(listen_host, port)
    return join_host_port(_route_source_ip(coordinator_address), port)


def _is_wildcard(host: str) -> bool:
    if host in ("", "*"):
        return True
    try:
        return ipaddress.ip_address(host).is_unspecified
    except ValueError:
        return False


def _route_source_ip(coordinator_address: str) -> str:
    host, port = split_host_port(dialing.host_port(coordinator_address))
    try:
        family, _, _, _, sockaddr = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            # connect() on UDP sends nothing; it only asks the kernel for the route.
            probe.connect(sockaddr)
            return probe.getsockname()[0]
    except OSError as exc:
        log.warning(
            "cannot tell which local address reaches %s (%s); advertising 127.0.0.1, "
            "pass --advertise HOST:PORT",
            coordinator_address,
            exc,
        )
        return "127.0.0.1"
