"""`tessera-coordinator`: run the coordinator, and administer a running one.

Subcommand groups live in their own modules, each exposing `add_parser(subparsers)` that
adds its parser(s) and sets `func=handler(args) -> exit status`; list them in
SUBCOMMAND_MODULES. A module that is not installed is skipped.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import logging
import math
import os
import sqlite3
import sys
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import grpc

from coordinator import agent_versions
from coordinator.admin_client import CliError, resolve_address
from coordinator.agent_versions import MIN_AGENT_VERSION
from coordinator.events import parse_mqtt_url
from coordinator.settings import Settings

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
DB_FILE = "coordinator.db"  # in --data-dir, when --db is not given
LOCK_FILE = "coordinator.lock"
SUBCOMMAND_MODULES = (
    "coordinator.nodes_cli",
    "coordinator.models_cli",
    "coordinator.ledger.cli",
    "coordinator.backup_cli",
)

EPILOG = """\
examples:
  # try it out: state in ./tessera-state, nodes and clients on this machine only
  tessera-coordinator serve --data-dir ./tessera-state

  # run a coordinator on all interfaces, state in /var/lib/tessera
  tessera-coordinator serve --listen 0.0.0.0:7000 --db /var/lib/tessera/coordinator.db

  # on the internet: over TLS (nodes and clients dial grpcs://coord.example.org:7000),
  # with Prometheus metrics for a local scraper (deploy/README.md: the systemd unit)
  tessera-coordinator serve --listen 0.0.0.0:7000 --data-dir /var/lib/tessera \\
      --tls-cert /etc/tessera/tls/fullchain.pem --tls-key /etc/tessera/tls/privkey.pem \\
      --metrics-listen 127.0.0.1:9464

  # with an MQTT broker for presence and telemetry (see deploy/mosquitto.conf); a hosted
  # one over TLS with a login: mqtts://USER@HOST:8883, password in $TESSERA_MQTT_PASSWORD
  tessera-coordinator serve --listen 0.0.0.0:7000 --db state/coordinator.db \\
      --mqtt mqtt://127.0.0.1:1883

  # on the same machine: list nodes, drain one
  tessera-coordinator nodes list --data-dir /var/lib/tessera
  tessera-coordinator nodes drain NODE_ID --data-dir /var/lib/tessera
"""


def configure_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format=LOG_FORMAT, stream=sys.stderr, force=True)


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text}")
    return value


def _port_range(text: str) -> tuple[int, int]:
    low, sep, high = text.partition("-")
    if not (sep and low.strip().isdigit() and high.strip().isdigit()):
        raise argparse.ArgumentTypeError(f"{text!r} is not a port range LOW-HIGH, e.g. 41000-41999")
    first, last = int(low), int(high)
    if not 1 <= first <= last <= 65535:
        raise argparse.ArgumentTypeError(
            f"{text!r}: a range needs 1 <= LOW <= HIGH <= 65535 (e.g. 41000-41999)"
        )
    return first, last


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if not 0 <= value < 1 << 63:
        raise argparse.ArgumentTypeError(f"must be between 0 and 2^63-1, got {value}")
    return value


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0.0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}")
    return value


def _probability(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a probability in [0, 1], got {text!r}")
    return value


def _release(text: str) -> str:
    if agent_versions.release(text) is None:
        raise argparse.ArgumentTypeError(f"expected a release like 0.3.1, got {text!r}")
    return text


def _listen_address(text: str) -> str:
    from coordinator.addresses import split_host_port

    try:
        split_host_port(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _mqtt_url(text: str) -> str:
    try:
        parse_mqtt_url(text).tls_context()  # a bad $TESSERA_CA_CERT is a usage error too
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _add_serve_parser(subparsers: Any) -> None:
    serve_parser = subparsers.add_parser(
        "serve",
        help="run the coordinator",
        description="Run the coordinator: node registry, model store, sessions. Logs "
        "'serving on HOST:PORT' (grpcs://HOST:PORT with TLS) when ready and writes that address to "
        "DATA_DIR/coordinator.addr. "
        "The admin token is created in DATA_DIR/admin.token (mode 0600) on first start.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    serve_parser.add_argument(
        "--listen", type=_listen_address, default="127.0.0.1:7000", metavar="HOST:PORT",
        help="where to accept nodes and clients; port 0 picks a free port (default: "
        "%(default)s, where `tessera` looks by default; use 0.0.0.0:PORT to accept other "
        "machines)",
    )  # fmt: skip
    serve_parser.add_argument(
        "--tls-cert", type=Path, metavar="PEM",
        help="serve over TLS with this certificate chain (server certificate first; its "
        "names must include the host nodes and clients dial). They then dial "
        "grpcs://HOST:PORT; a private CA's or self-signed certificate must be in their "
        "TESSERA_CA_CERT. Needs --tls-key (default: plain gRPC, for a private network)",
    )  # fmt: skip
    serve_parser.add_argument(
        "--tls-key", type=Path, metavar="PEM",
        help="the certificate's private key, unencrypted, readable only by the coordinator",
    )  # fmt: skip
    serve_parser.add_argument(
        "--db", type=Path, metavar="PATH",
        help="SQLite database file (created if missing); nodes survive restarts through it "
        f"(default: DATA_DIR/{DB_FILE}; give --db or --data-dir)",
    )  # fmt: skip
    serve_parser.add_argument(
        "--data-dir", type=Path, metavar="DIR",
        help="keys, admin token, address file, model blobs (default: the database's folder)",
    )  # fmt: skip
    serve_parser.add_argument(
        "--mqtt", type=_mqtt_url, metavar="URL",
        help="publish presence through this MQTT broker, e.g. mqtt://127.0.0.1:1883, or "
        "mqtts://USER@broker.example.org:8883 for TLS and a login, the password in "
        "$TESSERA_MQTT_PASSWORD (default: an in-process event bus, no broker needed)",
    )  # fmt: skip
    serve_parser.add_argument(
        "--metrics-listen", type=_listen_address, metavar="HOST:PORT",
        help="serve Prometheus metrics at http://HOST:PORT/metrics (nodes by state, each "
        "model's availability and fewest ready replicas); plain HTTP: keep it off the "
        "internet, e.g. 127.0.0.1:9464 (default: off)",
    )  # fmt: skip
    serve_parser.add_argument(
        "--heartbeat-interval", type=_positive_seconds, default=5.0, metavar="S",
        help="how often nodes send heartbeats (default: %(default)s s); a node silent for "
        "1.5 intervals becomes 'suspect'",
    )  # fmt: skip
    serve_parser.add_argument(
        "--offline-after",
        type=_positive_seconds,
        metavar="S",
        help="silence after which a node is offline (default: 3 heartbeat intervals)",
    )
    serve_parser.add_argument(
        "--relay-host", metavar="HOST",
        help="relay nodes that cannot be dialed (behind NAT) through this host: each gets "
        "a port here that clients dial (give the host or IP clients reach this machine at; "
        "default: no relay, and such nodes get no shards)",
    )  # fmt: skip
    serve_parser.add_argument(
        "--relay-ports", type=_port_range, metavar="LOW-HIGH",
        help="take relayed nodes' ports from this range only, e.g. 41000-41999: the range "
        "to open in a firewall, one port per relayed node (default: any free port)",
    )  # fmt: skip
    serve_parser.add_argument(
        "--relay-bind", metavar="HOST",
        help="listen for relayed nodes' clients on this address (default: the --relay-host): "
        "0.0.0.0 on a machine whose public address is not on any of its interfaces, such "
        "as a cloud VM behind 1:1 NAT",
    )  # fmt: skip
    serve_parser.add_argument(
        "--reachability-recheck", type=_positive_seconds, default=30.0, metavar="S",
        help="a node whose data address this coordinator cannot dial back gets no shards "
        "(clients could not reach it either); it is dialed again this often "
        "(default: %(default)s s)",
    )  # fmt: skip
    serve_parser.add_argument(
        "--heartbeat-ack-every", type=int, choices=[1, 2], default=1, metavar="N",
        help="acknowledge every Nth heartbeat, and every state change at once (default: "
        "%(default)s). 2 halves the acks the coordinator writes, about a third of its CPU per "
        "heartbeat; node agents accept up to 3 silent intervals",
    )  # fmt: skip
    serve_parser.add_argument(
        "--min-agent-version", type=_release, default=MIN_AGENT_VERSION, metavar="X.Y.Z",
        help="refuse node agents older than this release, with a message that tells their "
        "owners to upgrade (default: %(default)s, the oldest that speaks this protocol); "
        "raise it to keep out a release with a known flaw",
    )  # fmt: skip
    serve_parser.add_argument(
        "--replicas", type=_positive_int, default=2, metavar="R",
        help="keep at least R ready replicas of every layer when capacity allows, so a node "
        "can die mid-generation without a stall for re-loading (default: %(default)s)",
    )  # fmt: skip
    serve_parser.add_argument(
        "--min-stages", type=_positive_int, default=1, metavar="K",
        help="split every model into at least K pipeline stages even when one node could "
        "hold more (default: %(default)s: as few stages as memory allows)",
    )  # fmt: skip
    serve_parser.add_argument(
        "--reattach-grace", type=_non_negative_float, default=45.0, metavar="S",
        help="after a restart, wait up to S seconds for the nodes that were online before it "
        "to come back before moving any shard, so a restart re-downloads nothing (nodes "
        "reconnect within 30 s; sessions are served from what they hold meanwhile; "
        "default: %(default)s)",
    )  # fmt: skip
    serve_parser.add_argument(
        "--max-token-latency", type=_non_negative_float, default=0.0, metavar="MS",
        help="plan for served tokens/s within this time per token: pipelines the planner "
        "estimates slower are not formed, their nodes become replicas (default: 0, no "
        "bound; with min-stages > 1 the layout ignores it)",
    )  # fmt: skip
    serve_parser.add_argument(
        "--max-token-price", type=_non_negative_float, default=0.0, metavar="UNITS",
        help="plan for served tokens/s within this price per 1,000 tokens through the whole "
        "model (credit units; a pipeline costs its members' layers x their prices): dearer "
        "pipelines are not formed, their nodes become replicas (default: 0, no bound)",
    )  # fmt: skip
    serve_parser.add_argument(
        "--kv-tokens", type=_positive_int, default=4096, metavar="N",
        help="KV-cache tokens each shard reserves for its sessions (default: %(default)s)",
    )  # fmt: skip
    serve_parser.add_argument(
        "--dataset-ttl", type=_non_negative_float, default=24.0, metavar="HOURS",
        help="delete a training dataset that no job uses this long after it was last "
        "uploaded or looked up, with its blobs (default: %(default)s; 0 keeps them forever). "
        "Anyone who can reach the coordinator may upload one",
    )  # fmt: skip
    serve_parser.add_argument(
        "--job-retention", type=_non_negative_float, default=30.0, metavar="DAYS",
        help="delete a training job that is done or failed, with its losses and checkpoints, "
        "this long after it ended, and one still queued this long after it was submitted "
        "(default: %(default)s; 0 keeps them forever); the model it exported stays",
    )  # fmt: skip
    serve_parser.add_argument(
        "--default-price", type=_non_negative_int, default=0, metavar="UNITS",
        help="credit units per 1,000 token-layers for nodes that ask no price of their own "
        "(default: %(default)s = free)",
    )  # fmt: skip
    serve_parser.add_argument(
        "--default-training-price", type=_non_negative_int, default=0, metavar="UNITS",
        help="credit units per sample-layer of training for nodes that ask no training "
        "price of their own (default: %(default)s = free)",
    )  # fmt: skip
    serve_parser.add_argument(
        "--challenge-window", type=_positive_seconds, default=3600.0, metavar="S",
        help="how long settled earnings stay pending, so verification can still reject the "
        "work, before they are paid out (default: %(default)s s)",
    )  # fmt: skip
    serve_parser.add_argument(
        "--fee-bps", type=_non_negative_int, default=0, metavar="BPS",
        help="the coordinator's cut of each settlement in basis points, 0..10000 "
        "(default: %(default)s)",
    )  # fmt: skip
    serve_parser.add_argument(
        "--usage-credit", type=_non_negative_int, default=1024, metavar="TOKENS",
        help="in a paid session, how many token positions a node computes on its layers past "
        "the newest usage receipt the client acknowledged before it refuses the session's next "
        "call there: what a client that withholds its receipts gets unpaid, per node and "
        "session (0: no acknowledgments, the client settles alone; default: %(default)s)",
    )  # fmt: skip
    serve_parser.add_argument(
        "--training-usage-credit", type=_non_negative_int, default=256, metavar="SAMPLES",
        help="the same for a paid training job: how many samples a stage node runs forward "
        "past the newest receipt the job's runner acknowledged (0: no acknowledgments, the "
        "runner settles at its checkpoints alone; default: %(default)s)",
    )  # fmt: skip
    serve_parser.add_argument(
        "--verify-warmup", type=_positive_int, default=10, metavar="N",
        help="a node's outputs are all checked until it has N consecutive verified results; "
        "then the checking probability falls as N/results (default: %(default)s)",
    )  # fmt: skip
    serve_parser.add_argument(
        "--verify-min-probability", type=_probability, default=0.05, metavar="P",
        help="the checking probability never falls below P (default: %(default)s)",
    )  # fmt: skip
    serve_parser.add_argument(
        "--canary-interval", type=_non_negative_float, default=60.0, metavar="S",
        help="send every ready node a canary spot-check about every S seconds; 0 turns "
        "canaries off (default: %(default)s)",
    )  # fmt: skip
    serve_parser.set_defaults(func=_run_serve, command_parser=serve_parser)


def _run_serve(args: argparse.Namespace) -> int:
    if args.db is None and args.data_dir is None:
        args.command_parser.error(
            f"serve needs --data-dir DIR (its state goes there, the database in DIR/{DB_FILE}) "
            "or --db PATH"
        )
    if args.relay_host is None and (args.relay_ports or args.relay_bind):
        args.command_parser.error(
            "--relay-ports and --relay-bind shape the relay, which runs only with "
            "--relay-host HOST (the address clients reach this machine at)"
        )
    if (args.tls_cert is None) != (args.tls_key is None):
        args.command_parser.error(
            "TLS needs both --tls-cert PEM (the certificate chain) and --tls-key PEM (its key)"
        )
    db_path = (args.db or args.data_dir / DB_FILE).expanduser().resolve()
    data_dir = (args.data_dir or db_path.parent).expanduser().resolve()
    settings = Settings(
        db_path=db_path,
        data_dir=data_dir,
        listen=args.listen,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        mqtt_url=args.mqtt,
        metrics_listen=args.metrics_listen,
        heartbeat_interval_s=args.heartbeat_interval,
        offline_after_s=args.offline_after,
        reachability_recheck_s=args.reachability_recheck,
        relay_host=args.relay_host,
        relay_bind=args.relay_bind,
        relay_ports=args.relay_ports,
        heartbeat_ack_every=args.heartbeat_ack_every,
        replicas=args.replicas,
        min_stages=args.min_stages,
        reattach_grace_s=args.reattach_grace,
        min_agent_version=args.min_agent_version,
        max_token_latency_ms=args.max_token_latency,
        max_token_price_units=args.max_token_price,
        kv_tokens_per_shard=args.kv_tokens,
        dataset_ttl_s=args.dataset_ttl * 3600,
        job_retention_s=args.job_retention * 86400,
        default_price_units=args.default_price,
        default_training_price_units=args.default_training_price,
        challenge_window_s=args.challenge_window,
        fee_bps=args.fee_bps,
        usage_credit_tokens=args.usage_credit,
        training_usage_credit_samples=args.training_usage_credit,
        verify_warmup=args.verify_warmup,
        verify_min_probability=args.verify_min_probability,
        canary_interval_s=args.canary_interval,
    )
    if settings.fee_bps > 10_000:
        raise CliError(f"--fee-bps is at most 10000 (all of it), got {settings.fee_bps}")
    if settings.offline_after <= settings.suspect_after:
        raise CliError(
            f"--offline-after ({settings.offline_after:g} s) must be longer than 1.5 heartbeat "
            f"intervals ({settings.suspect_after:g} s)"
        )
    # Imported here: admin subcommands start faster without the server's dependencies.
    from coordinator.server import StartupError, serve

    with ExitStack() as held:
        _prepare_data_dir(data_dir, "--data-dir" if args.data_dir else "--db")
        # Both: two coordinators may share a data dir with two databases, or the reverse.
        held.enter_context(_exclusive(data_dir / LOCK_FILE, f"data dir {data_dir}", "--data-dir"))
        db_lock = db_path.with_name(db_path.name + ".lock")
        held.enter_context(_exclusive(db_lock, f"database {db_path}", "--db"))
        try:
            asyncio.run(serve(settings))
        except StartupError as exc:
            raise CliError(str(exc)) from None
    return 0


def _prepare_data_dir(data_dir: Path, flag: str) -> None:
    try:
        data_dir.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        if isinstance(err, (FileExistsError, NotADirectoryError)):
            reason = f"{err.filename} is a file, not a directory"
        else:
            reason = err.strerror or str(err)
        what = "a directory" if flag == "--data-dir" else "a file in a directory"
        raise CliError(
            f"cannot keep the coordinator's state in {data_dir}: {reason}; give {flag} {what} "
            "this user can write"
        ) from None


@contextmanager
def _exclusive(path: Path, what: str, flag: str) -> Iterator[None]:
    """Hold an exclusive lock on `path` (next to `what`, which `flag` names) while the
    coordinator runs.

    A second coordinator on the same state would mark the first one's nodes offline as it
    starts ("coordinator restarted"), write the same database and overwrite
    coordinator.addr, so admin commands would reach whichever started last. The OS drops
    the lock when the process dies, kill -9 included, so it never goes stale.
    """
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    except OSError as err:
        raise CliError(
            f"cannot create the lock file {path} ({err.strerror or err}); give {flag} a place "
            "this user can write"
        ) from None
    try:
        try:
            _lock_exclusive(fd)
        except OSError:
            os.lseek(fd, 0, os.SEEK_SET)
            holder = os.read(fd, 32).decode(errors="replace").strip() or "unknown"
            raise CliError(
                f"another coordinator (pid {holder}) is already using the {what}; stop it "
                "first, or give this one its own --data-dir and --db"
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        yield
    finally:
        os.close(fd)


def _lock_exclusive(fd: int) -> None:
    if sys.platform == "win32":
        import msvcrt

        msvcrt.locking(fd, msvcrt.LK_NBLCK, 1)
    else:
        import fcntl

        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tessera-coordinator",
        description="The Tessera coordinator: registers community GPU nodes, shards models "
        "across them and routes inference sessions.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        type=str.upper, help="log verbosity, on stderr (default: %(default)s)",
    )  # fmt: skip
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_serve_parser(subparsers)
    for module_name in SUBCOMMAND_MODULES:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name == module_name:
                continue  # that part is not installed
            raise
        module.add_parser(subparsers)
    # `serve --log-level X` reads more naturally than `--log-level X serve`: accept both.
    for choice in subparsers.choices.values():
        _add_log_level(choice)
    return parser


def _add_log_level(parser: argparse.ArgumentParser) -> None:
    if any("--log-level" in action.option_strings for action in parser._actions):
        return
    parser.add_argument(
        "--log-level", choices=["DEBUG", "INFO", "WARNING", "ERROR"], type=str.upper,
        default=argparse.SUPPRESS, help="log verbosity (default: INFO)",
    )  # fmt: skip
    sub_actions = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    for action in sub_actions:
        for child in action.choices.values():
            _add_log_level(child)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    configure_logging(args.log_level)
    try:
        return int(args.func(args) or 0)
    except CliError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except grpc.RpcError as exc:
        print(f"error: {_rpc_problem(exc, args)}", file=sys.stderr)
        return 1
    except sqlite3.DatabaseError as exc:
        # `ledger audit --db FILE` reads the file itself: a file that is no SQLite database
        # (or another program's) fails in the first query.
        where = getattr(args, "db", None) or "the database"
        print(
            f"error: cannot read {where} ({exc}); give --db the coordinator's database file",
            file=sys.stderr,
        )
        return 2
    except KeyboardInterrupt:
        return 130


def _rpc_problem(exc: grpc.RpcError, args: argparse.Namespace) -> str:
    code = exc.code() if hasattr(exc, "code") else None
    details = exc.details() if hasattr(exc, "details") else str(exc)
    try:
        address = resolve_address(args)
    except (AttributeError, CliError):
        address = "the coordinator"
    if code == grpc.StatusCode.UNAVAILABLE:
        return (
            f"cannot reach the coordinator at {address} ({details}); is `tessera-coordinator "
            "serve` running there? Pass its address as --coordinator HOST:PORT, or its "
            "--data-dir"
        )
    if code == grpc.StatusCode.UNIMPLEMENTED:
        # A node's data-plane port, or another server: "Method not found!" names no cause.
        return (
            f"the server at {address} does not answer as a Tessera coordinator ({details}); "
            "check --coordinator: it must be the address `serve` logs as 'serving on "
            "HOST:PORT', not a node's"
        )
    return f"the coordinator answered {getattr(code, 'name', code)}: {details}"


if __name__ == "__main__":
    sys.exit(main())
