"""Shared plumbing for admin subcommands (`nodes ...`, `models ...`) that call a running
coordinator: where it is, which admin token to send, a channel with the right limits.

    def add_parser(subparsers):                  # in your own *_cli.py module
        p = subparsers.add_parser("things", ...)
        add_connection_arguments(p)
        p.set_defaults(func=run)

    def run(args) -> int:
        address = resolve_address(args); token = resolve_admin_token(args)
        with open_channel(address) as channel:
            stub.Call(request, metadata=bearer_metadata(token), timeout=10)

Raise CliError for a problem the user must fix; main() prints it and exits with status 2.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import grpc

from coordinator.admin_auth import bearer_metadata
from coordinator.secrets_store import ADDRESS_FILE, ADMIN_TOKEN_FILE
from protos import dialing
from protos.dialing import DIAL_OPTIONS, dialable

DATA_DIR_ENV = "TESSERA_COORDINATOR_DATA_DIR"
CHANNEL_OPTIONS = DIAL_OPTIONS

__all__ = [
    "CHANNEL_OPTIONS",
    "CliError",
    "add_connection_arguments",
    "bearer_metadata",
    "open_channel",
    "resolve_address",
    "resolve_admin_token",
]


class CliError(Exception):
    """A mistake the user can fix; printed without a traceback."""


def coordinator_address(text: str) -> str:
    """HOST:PORT to dial. gRPC would take "localhost" as port 443 and "http://h:1" as a host
    name, and fail later with a resolver message that names neither mistake."""
    if not dialable(text):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not HOST:PORT or grpcs://HOST:PORT; give the address "
            "`tessera-coordinator serve` logs as 'serving on HOST:PORT' (or --data-dir DIR of "
            "the coordinator instead)"
        )
    return text


def add_connection_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("reaching the coordinator")
    group.add_argument(
        "--coordinator",
        metavar="HOST:PORT",
        type=coordinator_address,
        help="address of the running coordinator (default: read DATA_DIR/coordinator.addr)",
    )
    group.add_argument(
        "--data-dir",
        type=Path,
        metavar="DIR",
        default=os.environ.get(DATA_DIR_ENV) or None,
        help=f"the coordinator's data directory, for its address and admin token "
        f"(default: ${DATA_DIR_ENV})",
    )
    group.add_argument(
        "--admin-token",
        metavar="TOKEN",
        help="admin token (default: read DATA_DIR/admin.token)",
    )


def _read_from_data_dir(args: argparse.Namespace, filename: str, flag: str) -> str:
    if args.data_dir is None:
        raise CliError(f"pass {flag}, or --data-dir DIR of the coordinator (it holds {filename})")
    path = Path(args.data_dir) / filename
    try:
        value = path.read_text().strip()
    except FileNotFoundError:
        raise CliError(
            f"{path} does not exist: is `tessera-coordinator serve` running with "
            f"--data-dir {args.data_dir}? Or pass {flag}"
        ) from None
    except PermissionError:
        raise CliError(f"cannot read {path}: run as the user that runs the coordinator") from None
    except OSError as err:  # e.g. --data-dir names a file
        raise CliError(
            f"cannot read {path} ({err.strerror}): --data-dir must be the coordinator's data "
            f"directory; or pass {flag}"
        ) from None
    if not value:
        raise CliError(f"{path} is empty")
    return value


def resolve_address(args: argparse.Namespace) -> str:
    return args.coordinator or _read_from_data_dir(args, ADDRESS_FILE, "--coordinator HOST:PORT")


def resolve_admin_token(args: argparse.Namespace) -> str:
    return args.admin_token or _read_from_data_dir(args, ADMIN_TOKEN_FILE, "--admin-token TOKEN")


def open_channel(address: str) -> grpc.Channel:
    try:
        return dialing.sync_channel(address, CHANNEL_OPTIONS)
    except ValueError as err:  # $TESSERA_CA_CERT names no readable certificate
        raise CliError(str(err)) from None
