"""`tessera-node`: lend this machine's GPU (or CPU) to a Tessera swarm."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import signal
import socket
import sys
from collections.abc import Sequence
from pathlib import Path

from node_agent import (
    __version__,
    backoff,
    data_plane,
    earnings_cli,
    failpoints,
    hardware_probe,
    identity,
)
from node_agent.agent import CHANNEL_OPTIONS, AgentConfig, ExitCode, NodeAgent
from node_agent.context import AgentContext
from node_agent.data_dir import DataDirBusyError, DataDirLock, default_data_dir
from node_agent.matmul_benchmark import (
    DEFAULT_BUDGET_S,
    measure_bandwidth_gbps,
    measure_tflops,
)
from node_agent.mqtt_presence import MqttPresence, parse_broker_url
from node_agent.plugins import load_plugin
from node_agent.shard_handler import ShardHandler
from node_agent.telemetry import ProcessTelemetry
from protos import identity as wire_identity

log = logging.getLogger("node_agent")

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

_EPILOG = """\
examples:
  # join a swarm with the GPU this PC has, keeping 4 GiB of it for yourself
  tessera-node join --coordinator swarm.example.org:7000 --name my-3090 --max-memory-gb 20

  # a CPU-only node on loopback, for trying things out next to a local coordinator
  tessera-node join --coordinator 127.0.0.1:7000 --name cpu-1 --device cpu \\
      --listen 127.0.0.1:0 --data-dir /tmp/tessera-cpu-1

  # also announce presence and telemetry on the swarm's MQTT broker
  tessera-node join --coordinator 127.0.0.1:7000 --name box --mqtt mqtt://127.0.0.1:1883

  # what would this machine report? (device, memory, measured TFLOPS, node id)
  tessera-node probe

The node dials out to the coordinator, so control needs no port forwarding. Clients
reach its data plane on --listen; behind NAT, forward that port (fix it, e.g.
--listen 0.0.0.0:7070) or set --advertise to the address others can dial.
SIGTERM or Ctrl-C drains: no new sessions, running ones finish (up to
--drain-timeout-s), then the node leaves; a second Ctrl-C leaves at once.
Exit codes: 0 left cleanly, 1 unexpected error, 2 bad flags or local set-up,
3 the coordinator refuses this node (banned, or invalid capabilities).

On an NVIDIA GPU the node computes in bf16 (fp16 before Ampere) and decodes through CUDA
graphs, several times faster than eager PyTorch at batch 1; TESSERA_CUDA_GRAPHS=0 in its
environment turns them off. fp32 stays full fp32: TF32 would fail verification.
"""


def _address(text: str) -> str:
    try:
        data_plane.split_host_port(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc
    return text


def _number(text: str, kind: type[float] | type[int] = float) -> float:
    try:
        value = kind(text)
    except ValueError:
        what = "a whole number" if kind is int else "a number"
        raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
    if value != value or value in (float("inf"), float("-inf")):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    return value


def _positive_float(text: str) -> float:
    value = _number(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be more than 0, got {text}")
    return value


def _non_negative_float(text: str) -> float:
    value = _number(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {text}")
    return value


def _non_negative_int(text: str) -> int:
    value = int(_number(text, int))
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {text}")
    if value >= 1 << 63:  # the coordinator stores prices and counts as 64-bit integers
        raise argparse.ArgumentTypeError(f"must be below 2^63, got {text}")
    return value


def _mqtt_url(text: str) -> str:
    try:
        parse_broker_url(text).tls_context()  # a bad $TESSERA_CA_CERT is a usage error too
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc
    return text


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tessera-node",
        description="Lend this machine's GPU (or CPU) to a Tessera swarm: register with a "
        "coordinator, serve the model layers it assigns, and get paid for verified work.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"tessera-node {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--data-dir",
        type=Path,
        default=default_data_dir(),
        metavar="DIR",
        help="where the node keeps its key (node.key = its identity) and shard cache "
        "(default: %(default)s)",
    )
    common.add_argument(
        "--device",
        default="auto",
        help="auto (first CUDA GPU, else Apple MPS, else CPU), cpu, cuda, cuda:N or mps "
        "(default: %(default)s)",
    )
    common.add_argument(
        "--max-memory-gb",
        type=_positive_float,
        metavar="GB",
        help="the most device memory the swarm may use (default: all but some headroom)",
    )
    common.add_argument(
        "--benchmark-s",
        type=_positive_float,
        default=DEFAULT_BUDGET_S,
        metavar="S",
        help="how long each start-up benchmark (matmul, memory copy) runs (default: %(default)s)",
    )
    common.add_argument(
        "--log-level",
        default="INFO",
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="log verbosity, on stderr (default: %(default)s)",
    )

    join = commands.add_parser(
        "join",
        parents=[common],
        help="register with a coordinator and serve until stopped",
        description="Register this machine with a coordinator and serve the work it assigns "
        "until SIGTERM/Ctrl-C (which drains first).",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    join.add_argument(
        "--coordinator",
        required=True,
        type=earnings_cli.coordinator_address,
        metavar="HOST:PORT",
        help="the coordinator's address, as `tessera-coordinator serve` logs it ('serving on "
        "HOST:PORT'); grpcs://HOST:PORT for one served over TLS, whose certificate is checked "
        "against the system's roots or the private CA in $TESSERA_CA_CERT",
    )
    join.add_argument(
        "--name",
        default=socket.gethostname(),
        help="a name for this node that people will see (default: the host name, %(default)s)",
    )
    join.add_argument(
        "--account",
        default="",
        help="operator account that gets paid (default: the node's own id, one account per node)",
    )
    join.add_argument("--region", default="", help="free-form region, e.g. eu-west")
    join.add_argument(
        "--price",
        type=_non_negative_int,
        default=0,
        metavar="UNITS",
        help="asking price for inference, in credit units per 1,000 token-layers "
        "(default: %(default)s = the coordinator's default price)",
    )
    join.add_argument(
        "--training-price",
        type=_non_negative_int,
        default=0,
        metavar="UNITS",
        help="asking price for training, in credit units per sample-layer (default: "
        "%(default)s = the coordinator's default)",
    )
    join.add_argument(
        "--max-sessions",
        type=_non_negative_int,
        default=0,
        metavar="N",
        help="the most client sessions at once (default: 0 = no cap)",
    )
    join.add_argument(
        "--listen",
        type=_address,
        default="0.0.0.0:0",
        metavar="HOST:PORT",
        help="where the data plane (Stage service) listens; port 0 picks a free one. "
        "The default serves every interface, since clients on other machines must reach "
        "it; use 127.0.0.1:0 for a loopback-only swarm (default: %(default)s)",
    )
    join.add_argument(
        "--advertise",
        type=_address,
        metavar="HOST:PORT",
        help="the data-plane address to tell the coordinator (default: the --listen port on "
        "the local address that routes to the coordinator)",
    )
    join.add_argument(
        "--mqtt",
        type=_mqtt_url,
        metavar="URL",
        help="also publish presence (with a last will) and telemetry to this MQTT broker, "
        "e.g. mqtt://127.0.0.1:1883, or mqtts://USER@broker.example.org:8883 for TLS and a "
        "login, the password in $TESSERA_MQTT_PASSWORD",
    )
    join.add_argument(
        "--heartbeat-s",
        type=_positive_float,
        metavar="S",
        help="heartbeat interval (default: the one the coordinator asks for)",
    )
    join.add_argument(
        "--drain-timeout-s",
        type=_non_negative_float,
        default=120.0,
        metavar="S",
        help="on SIGTERM, how long to let running sessions finish (default: %(default)s)",
    )
    # Tests and the local swarm launcher reconnect faster than a real node should.
    join.add_argument("--backoff-base-s", type=_positive_float, help=argparse.SUPPRESS)
    join.add_argument("--backoff-cap-s", type=_positive_float, help=argparse.SUPPRESS)

    commands.add_parser(
        "probe",
        parents=[common],
        help="print what this machine would report (device, memory, TFLOPS, node id) as JSON",
        description="Probe the device and run the benchmark, print the result as JSON, and "
        "exit. Creates nothing: the node id is shown only if the data dir has a key.",
        epilog="examples:\n  tessera-node probe\n"
        "  tessera-node probe --device cpu --benchmark-s 2   # a steadier CPU measurement",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    earnings_cli.add_parser(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level, format=LOG_FORMAT, stream=sys.stderr)
    try:
        if args.command == "probe":
            return _probe(args)
        if args.command in earnings_cli.COMMANDS:
            return earnings_cli.run(args)
        return _join(args)
    except (identity.IdentityError, DataDirBusyError, hardware_probe.DeviceError) as exc:
        log.error("%s", exc)
        return ExitCode.USAGE
    except data_plane.ListenError as exc:
        # Its own message says what to change (--listen); it is no data-dir problem.
        log.error("%s", exc)
        return ExitCode.USAGE
    except OSError as exc:  # the data dir is a file, read-only, on a full disk, ...
        if isinstance(exc, (FileExistsError, NotADirectoryError)):
            reason = f"{exc.filename} is a file, not a directory"
        else:
            reason = f"{exc.strerror or exc} ({exc.filename})" if exc.filename else str(exc)
        log.error(
            "cannot use the data directory %s: %s; give --data-dir a directory this user can write",
            args.data_dir,
            reason,
        )
        return ExitCode.USAGE


def _benchmarks(hw: hardware_probe.HardwareInfo, budget_s: float) -> tuple[float, float]:
    """(matmul TFLOPS, memory GB/s) on the node's device; the copy converges in half the
    time the matmul needs."""
    return (
        measure_tflops(hw.torch_device, budget_s),
        measure_bandwidth_gbps(hw.torch_device, budget_s / 2),
    )


def _probe(args: argparse.Namespace) -> int:
    hw = hardware_probe.probe(args.device, args.max_memory_gb)
    key_file = identity.key_path(args.data_dir)
    node_id = ""
    if key_file.exists():
        node_id = wire_identity.node_id(
            wire_identity.public_key_bytes(identity.load_or_create_key(args.data_dir))
        )
    tflops, bandwidth = _benchmarks(hw, args.benchmark_s)
    report = {
        "node_id": node_id,
        "data_dir": str(args.data_dir),
        **dataclasses.asdict(hw),
        "matmul_tflops": round(tflops, 4),
        "memory_bandwidth_gbps": round(bandwidth, 1),
        "agent_version": __version__,
    }
    print(json.dumps(report, indent=2))
    return ExitCode.OK


def _join(args: argparse.Namespace) -> int:
    with DataDirLock(args.data_dir):
        key = identity.load_or_create_key(args.data_dir)
        node_id = wire_identity.node_id(wire_identity.public_key_bytes(key))
        hw = hardware_probe.probe(args.device, args.max_memory_gb)
        if hw.device_kind == "cuda":
            # Imported here: the runtime loads torch (2-3 s), which --help and the stake
            # and earnings commands never need.
            from node_agent.runtime.dtypes import pin_full_fp32

            pin_full_fp32()  # before the benchmark: torch reads the override at its first matmul
        log.info(
            "node %s on %s (%s): %.1f GiB usable of %.1f GiB, dtypes %s",
            node_id,
            hw.torch_device,
            hw.device_name,
            hw.memory_usable_bytes / 2**30,
            hw.memory_total_bytes / 2**30,
            ",".join(hw.dtypes),
        )
        tflops, bandwidth = _benchmarks(hw, args.benchmark_s)
        log.info(
            "benchmark: %.3f TFLOPS (matmul), %.0f GB/s (memory) on %s",
            tflops,
            bandwidth,
            hw.torch_device,
        )
        lie = failpoints.benchmark_factor()  # 1.0 unless a test makes the node lie
        tflops, bandwidth = tflops * lie, bandwidth * lie
        config = AgentConfig(
            coordinator=args.coordinator,
            name=args.name,
            account=args.account,
            region=args.region,
            price=args.price,
            training_price=args.training_price,
            listen=args.listen,
            advertise=args.advertise,
            heartbeat_s=args.heartbeat_s,
            drain_timeout_s=args.drain_timeout_s,
            tflops=tflops,
            bandwidth_gbps=bandwidth,
            max_memory_bytes=int((args.max_memory_gb or 0) * hardware_probe.GIB),
        )
        ctx = AgentContext(
            node_id=node_id,
            private_key=key,
            data_dir=args.data_dir,
            hardware=hw,
            coordinator_address=args.coordinator,
            channel_options=list(CHANNEL_OPTIONS),
            max_sessions=args.max_sessions,
            telemetry_sources=[ProcessTelemetry(hw.torch_device)],
            local_clock=failpoints.local_clock(),  # time.time unless a test skews it
        )
        return asyncio.run(_run(config, ctx, args))


async def _run(config: AgentConfig, ctx: AgentContext, args: argparse.Namespace) -> int:
    handler = load_plugin("node_agent.shard_manager", "build_shard_handler", ctx)
    if handler is None:
        log.info("no shard manager module: assignments will be answered FAILED")
    elif not isinstance(handler, ShardHandler):
        raise TypeError(f"build_shard_handler returned {handler!r}, which has no assign/drop")
    else:
        ctx.shard_handler = handler
    mqtt = None
    if args.mqtt:
        mqtt = MqttPresence(
            parse_broker_url(args.mqtt), ctx.node_id, backoff.from_env(), ctx.coordinator_time
        )
    agent = NodeAgent(config, ctx, backoff.from_env(args.backoff_base_s, args.backoff_cap_s), mqtt)
    _install_signal_handlers(agent)
    return await agent.run()


def _install_signal_handlers(agent: NodeAgent) -> None:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        if signal.getsignal(sig) == signal.SIG_IGN:
            # Started in the background of a script (or nohup): the parent that chose to
            # ignore Ctrl-C for us will send SIGTERM itself when it is time to stop.
            continue
        try:
            loop.add_signal_handler(sig, agent.request_shutdown, sig.name)
        except NotImplementedError:  # Windows: no loop signal handlers
            signal.signal(
                sig,
                lambda signum, _frame: loop.call_soon_threadsafe(
                    agent.request_shutdown, signal.Signals(signum).name
                ),
            )


if __name__ == "__main__":
    sys.exit(main())
