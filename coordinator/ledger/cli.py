"""`tessera-coordinator credits grant` and `tessera-coordinator ledger audit`."""

from __future__ import annotations

import argparse
import uuid
from pathlib import Path
from typing import Any

from coordinator.admin_client import (
    CliError,
    add_connection_arguments,
    bearer_metadata,
    open_channel,
    resolve_address,
    resolve_admin_token,
)
from protos.tessera.v1 import common_pb2, ledger_pb2, ledger_pb2_grpc

RPC_TIMEOUT_S = 30.0


def _amount(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a whole number of credit units (no decimals: units are the "
            "smallest denomination)"
        ) from None
    if not 0 < value < 1 << 63:
        raise argparse.ArgumentTypeError(f"must be between 1 and 2^63-1, got {value}")
    return value


def add_parser(subparsers: Any) -> None:
    credits = subparsers.add_parser(
        "credits",
        help="mint credit into client accounts (admin)",
        description="Credit for clients. There is no real-money rail: an operator grants it.",
    )
    actions = credits.add_subparsers(dest="credits_command", required=True, metavar="ACTION")
    grant = actions.add_parser(
        "grant",
        help="mint AMOUNT credit units into a client account (admin)",
        description="Mint credit into a client account. Retrying with the same --request-id "
        "grants once, so a grant that timed out can be repeated safely.",
        epilog="example:\n  tessera-coordinator credits grant c1f0e2d3c4b5a69788796a5 50000 "
        "--data-dir /var/lib/tessera\n\nThe client's account id is printed by `tessera balance` "
        "on its machine.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    grant.add_argument("account", metavar="ACCOUNT", help="client account id (c + 23 hex)")
    grant.add_argument("amount", metavar="AMOUNT", type=_amount, help="credit units, > 0")
    grant.add_argument(
        "--request-id",
        default=None,
        help="idempotency key (default: a fresh random one; reuse it to retry)",
    )
    add_connection_arguments(grant)
    grant.set_defaults(func=run_grant)

    ledger = subparsers.add_parser(
        "ledger",
        help="check the credit ledger",
        description="Look after the credit ledger.",
    )
    ledger_actions = ledger.add_subparsers(dest="ledger_command", required=True, metavar="ACTION")
    audit = ledger_actions.add_parser(
        "audit",
        help="check every ledger invariant; exit 1 on a violation",
        description="Check that credit is conserved, every transaction balances, no account "
        "is negative, escrow equals the open holds, pending earnings match, and nothing was "
        "settled or released twice. Exits 0 when all hold, 1 otherwise. With --db it reads "
        "the database file directly (the coordinator may be stopped).",
        epilog="examples:\n  tessera-coordinator ledger audit --data-dir /var/lib/tessera\n"
        "  tessera-coordinator ledger audit --db /var/lib/tessera/coordinator.db",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    audit.add_argument("--db", type=Path, metavar="PATH", help="audit this database file")
    add_connection_arguments(audit)
    audit.set_defaults(func=run_audit)


def run_grant(args: argparse.Namespace) -> int:
    token = resolve_admin_token(args)
    request = ledger_pb2.GrantCreditsRequest(
        account=args.account, amount=args.amount, request_id=args.request_id or uuid.uuid4().hex
    )
    with open_channel(resolve_address(args)) as channel:
        balance = ledger_pb2_grpc.LedgerStub(channel).GrantCredits(
            request, metadata=bearer_metadata(token), timeout=RPC_TIMEOUT_S
        )
    print(
        f"granted {args.amount} to {balance.account}: {balance.available} available, "
        f"{balance.escrowed} in escrow (request id {request.request_id})"
    )
    return 0


def run_audit(args: argparse.Namespace) -> int:
    if args.db is not None:
        if not args.db.exists():
            raise CliError(
                f"{args.db} does not exist: pass the coordinator's database, which `serve` "
                "keeps at DATA_DIR/coordinator.db, or leave --db out to audit a running "
                "coordinator (--data-dir or --coordinator)"
            )
        from coordinator.db import open_database
        from coordinator.ledger.service import audit_report

        db = open_database(args.db)
        try:
            report = audit_report(db)
        finally:
            db.close()
    else:
        token = resolve_admin_token(args)
        with open_channel(resolve_address(args)) as channel:
            report = ledger_pb2_grpc.LedgerStub(channel).Audit(
                common_pb2.Empty(), metadata=bearer_metadata(token), timeout=RPC_TIMEOUT_S
            )
    print(
        f"{report.transactions} transactions, {report.minted} minted, {report.escrowed} in "
        f"escrow over {report.open_holds} open holds"
    )
    if report.ok:
        print("ledger OK: every invariant holds")
        return 0
    for violation in report.violations:
        print(f"VIOLATION: {violation}")
    return 1
