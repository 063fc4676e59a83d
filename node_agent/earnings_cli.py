"""`tessera-node earnings` and `tessera-node stake deposit`: what this node has earned, and
moving released earnings into a slashable stake, both proven with the node's own key."""

from __future__ import annotations

import argparse
import sys
import uuid
from datetime import datetime
from pathlib import Path
from typing import Any

import grpc

from node_agent import identity
from node_agent.agent import CHANNEL_OPTIONS
from node_agent.data_dir import default_data_dir
from protos import dialing
from protos import identity as wire_identity
from protos.coordinator_clock import StampClock
from protos.dialing import dialable
from protos.tessera.v1 import ledger_pb2, ledger_pb2_grpc

RPC_TIMEOUT_S = 15.0
COMMANDS = ("earnings", "stake")

EPILOG = """\
example:
  tessera-node earnings --coordinator swarm.example.org:7000 --data-dir ~/.tessera-node

pending:  settled work inside the challenge window (verification can still reject it)
released: paid out to the operator account
slashed:  taken after proven fraud
rejected: refunded to clients after a verification failure
staked:   the operator's stake (tessera-node stake deposit), taken on proven fraud
available: released credit of the operator account, which may be staked
"""

STAKE_EPILOG = """\
example:
  tessera-node stake deposit 5000 --coordinator swarm.example.org:7000 --data-dir ~/.tessera-node

The amount comes out of the operator account's released earnings (see `tessera-node
earnings`). A stake shows clients this operator has something to lose: proven fraud by
any of its nodes moves the whole stake to the slashing account. Retrying with the same
--request-id stakes once.
"""


def add_parser(commands: argparse._SubParsersAction) -> None:
    earnings = commands.add_parser(
        "earnings",
        help="show this node's pending, released and slashed earnings",
        description="Ask the coordinator what this node has earned. The request is signed "
        "with the node key in --data-dir, so only this node can read it.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_common(earnings)
    stake = commands.add_parser(
        "stake",
        help="deposit released earnings as a slashable stake",
        description="Move credit from this node's operator account (released earnings) into "
        "its stake. The request is signed with the node key in --data-dir.",
        epilog=STAKE_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    actions = stake.add_subparsers(dest="stake_command", required=True, metavar="ACTION")
    deposit = actions.add_parser(
        "deposit",
        help="stake AMOUNT credit units",
        description="Stake AMOUNT credit units from the operator's released earnings.",
        epilog=STAKE_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    deposit.add_argument("amount", metavar="AMOUNT", type=_amount, help="credit units, > 0")
    deposit.add_argument(
        "--request-id",
        default=None,
        help="idempotency key (default: a fresh random one; reuse it to retry)",
    )
    _add_common(deposit)


def coordinator_address(text: str) -> str:
    """HOST:PORT to dial (port 1-65535), for join, earnings and stake. gRPC would read
    "localhost" as port 443 and fail later with a message that names no flag."""
    if not dialable(text):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not HOST:PORT or grpcs://HOST:PORT; give the coordinator's address "
            "as `tessera-coordinator serve` logs it ('serving on HOST:PORT'), e.g. "
            "127.0.0.1:7000, [::1]:7000 or grpcs://coord.example.org:7000"
        )
    if dialing.uses_tls(text):
        try:
            dialing.channel_credentials()  # a bad $TESSERA_CA_CERT: say so now, not per call
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _add_common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--coordinator",
        required=True,
        type=coordinator_address,
        metavar="HOST:PORT",
        help="the coordinator's address (grpcs://HOST:PORT over TLS)",
    )
    parser.add_argument(
        "--data-dir",
        type=Path,
        default=default_data_dir(),
        metavar="DIR",
        help="the node's data directory, which holds its key (default: %(default)s)",
    )
    parser.add_argument("--json", action="store_true", help="print JSON for scripts")
    parser.set_defaults(log_level="WARNING")


def _amount(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a whole number of credit units (units are the smallest "
            "denomination: no decimals)"
        ) from None
    if not 0 < value < 1 << 63:
        raise argparse.ArgumentTypeError(f"must be between 1 and 2^63-1, got {value}")
    return value


def run(args: argparse.Namespace) -> int:
    if not identity.key_path(args.data_dir).exists():
        raise identity.IdentityError(
            f"no node key in {args.data_dir}: pass the --data-dir this node joined with"
        )
    key = identity.load_or_create_key(args.data_dir)
    request_id = args.request_id or uuid.uuid4().hex if args.command == "stake" else ""
    clock = StampClock()
    with dialing.sync_channel(args.coordinator, CHANNEL_OPTIONS) as channel:
        stub = ledger_pb2_grpc.LedgerStub(channel)

        def ask() -> Any:
            now_ms = clock.now_ms()
            if args.command == "stake":
                # The signature covers the amount and the request id (coordinator's
                # ledger.service.stake_purpose): nobody can replay it for another amount.
                purpose = f"stake {args.amount} {request_id}"
                request = ledger_pb2.StakeRequest(
                    amount=args.amount,
                    request_id=request_id,
                    query=wire_identity.sign_ledger_query(key, purpose, now_ms),
                )
                return stub.DepositStake(request, timeout=RPC_TIMEOUT_S)
            query = wire_identity.sign_ledger_query(key, "earnings", now_ms)
            return stub.GetEarnings(query, timeout=RPC_TIMEOUT_S)

        try:
            try:
                reply = ask()
            except grpc.RpcError as err:
                if not clock.learn(err):  # not a stamp refused as stale: nothing to retry
                    raise
                reply = ask()
        except grpc.RpcError as err:
            # On stderr: with --json, stdout is for the answer alone.
            print(f"tessera-node: {_problem(err, args.coordinator)}", file=sys.stderr)
            return 1
    if args.command == "stake" and not args.json:
        print(f"staked {args.amount} credit units (request id {request_id})")
    if args.json:
        from google.protobuf import json_format

        print(json_format.MessageToJson(reply, preserving_proto_field_name=True,
                                        always_print_fields_with_no_presence=True))  # fmt: skip
        return 0
    print(f"node {reply.node_id} (operator account {reply.account})")
    for label, value in (
        ("pending", reply.pending),
        ("released", reply.released),
        ("slashed", reply.slashed),
        ("rejected", reply.rejected),
        ("staked", reply.staked),
        ("available", reply.available),
    ):
        print(f"  {label:<9} {value:>16} credit units")
    if reply.next_release_unix_ms:
        when = datetime.fromtimestamp(reply.next_release_unix_ms / 1000).isoformat(" ", "seconds")
        print(f"  next release after {when}")
    return 0


def _problem(err: grpc.RpcError, address: str) -> str:
    code, details = err.code(), err.details()  # type: ignore[attr-defined]
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        return (
            f"cannot reach the coordinator at {address} ({details}); is it running, and is "
            f"--coordinator its address?{dialing.tls_hint(address, details or '')}"
        )
    if code == grpc.StatusCode.UNIMPLEMENTED:
        # A node's data-plane port, or another server: "Method not found!" names no cause.
        return (
            f"the server at {address} does not answer as a Tessera coordinator ({details}); "
            "check --coordinator: it must be the coordinator's address, not a node's"
        )
    return f"the coordinator answered {code.name}: {details}"
