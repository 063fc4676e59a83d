"""`tessera-node earnings`: what this node has earned, proven with its own key."""

from __future__ import annotations

import argparse
import time
from datetime import datetime
from pathlib import Path

import grpc

from node_agent import identity
from node_agent.agent import CHANNEL_OPTIONS
from node_agent.data_dir import default_data_dir
from protos import identity as wire_identity
from protos.tessera.v1 import ledger_pb2_grpc

RPC_TIMEOUT_S = 15.0

EPILOG = """\
example:
  tessera-node earnings --coordinator swarm.example.org:50051 --data-dir ~/.tessera-node

pending:  settled work inside the challenge window (verification can still reject it)
released: paid out to the operator account
slashed:  taken after proven fraud
rejected: refunded to clients after a verification failure
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
    earnings.add_argument(
        "--coordinator", required=True, metavar="HOST:PORT", help="the coordinator's address"
    )
    earnings.add_argument(
        "--data-dir",
        type=Path,
        default=default_data_dir(),
        help="the node's data directory, which holds its key (default: %(default)s)",
    )
    earnings.add_argument("--json", action="store_true", help="print JSON for scripts")
    earnings.set_defaults(log_level="WARNING")


def run(args: argparse.Namespace) -> int:
    if not identity.key_path(args.data_dir).exists():
        raise identity.IdentityError(
            f"no node key in {args.data_dir}: pass the --data-dir this node joined with"
        )
    key = identity.load_or_create_key(args.data_dir)
    query = wire_identity.sign_ledger_query(key, "earnings", int(time.time() * 1000))
    with grpc.insecure_channel(args.coordinator, options=CHANNEL_OPTIONS) as channel:
        try:
            reply = ledger_pb2_grpc.LedgerStub(channel).GetEarnings(query, timeout=RPC_TIMEOUT_S)
        except grpc.RpcError as err:
            print(f"tessera-node: the coordinator answered {err.code().name}: {err.details()}")
            return 1
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
    ):
        print(f"  {label:<9} {value:>16} credit units")
    if reply.next_release_unix_ms:
        when = datetime.fromtimestamp(reply.next_release_unix_ms / 1000).isoformat(" ", "seconds")
        print(f"  next release after {when}")
    return 0
