"""Every invariant of the ledger, checked from the raw entries (not the cached balances).

An empty list of violations means: each transaction balances to zero, every cached
balance equals the sum of its entries, no account but the mint is negative, the escrow
equals the open holds, each operator's pending account equals its pending earnings, the
mint equals what was granted, and no hold or earning was settled, released or slashed
twice.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import sqlite_utils

from coordinator.ledger.book import ESCROW, MINT


@dataclass
class AuditResult:
    violations: list[str] = field(default_factory=list)
    transactions: int = 0
    minted: int = 0
    escrowed: int = 0
    open_holds: int = 0

    @property
    def ok(self) -> bool:
        return not self.violations


def _rows(db: sqlite_utils.Database, sql: str, params: list[object] | None = None) -> list:
    return db.execute(sql, params or []).fetchall()


def audit(db: sqlite_utils.Database) -> AuditResult:
    result = AuditResult()
    bad = result.violations
    # One read transaction: a concurrent writer cannot make a consistent ledger look torn.
    with db.atomic():
        result.transactions = int(_rows(db, "SELECT COUNT(*) FROM ledger_transactions")[0][0])
        for txid, total in _rows(
            db, "SELECT txid, SUM(amount) FROM ledger_entries GROUP BY txid HAVING SUM(amount) != 0"
        ):
            bad.append(f"transaction {txid} does not balance: its entries sum to {total}")
        (orphans,) = _rows(
            db,
            "SELECT COUNT(*) FROM ledger_entries e LEFT JOIN ledger_transactions t "
            "ON t.txid = e.txid WHERE t.txid IS NULL",
        )[0]
        if orphans:
            bad.append(f"{orphans} entries belong to no transaction")
        sums = dict(_rows(db, "SELECT account, SUM(amount) FROM ledger_entries GROUP BY account"))
        cached = dict(_rows(db, "SELECT account, balance FROM ledger_accounts"))
        for account in sorted(set(sums) | set(cached)):
            if sums.get(account, 0) != cached.get(account, 0):
                bad.append(
                    f"account {account}: cached balance {cached.get(account, 0)} but its "
                    f"entries sum to {sums.get(account, 0)}"
                )
            if account != MINT and sums.get(account, 0) < 0:
                bad.append(f"account {account} is negative: {sums[account]}")
        if sum(sums.values()) != 0:
            bad.append(f"credit is not conserved: all accounts sum to {sum(sums.values())}")
        (granted,) = _rows(
            db,
            "SELECT COALESCE(SUM(e.amount), 0) FROM ledger_entries e JOIN ledger_transactions t "
            "ON t.txid = e.txid WHERE t.kind = 'grant' AND e.account != ?",
            [MINT],
        )[0]
        result.minted = -sums.get(MINT, 0)
        if result.minted != granted:
            bad.append(f"the mint issued {result.minted} but grants total {granted}")
        open_count, open_sum = _rows(
            db,
            "SELECT COUNT(*), COALESCE(SUM(amount - charged), 0) FROM ledger_holds "
            "WHERE state = 'open'",
        )[0]
        result.open_holds = int(open_count)
        result.escrowed = sums.get(ESCROW, 0)
        if result.escrowed != open_sum:
            bad.append(f"escrow holds {result.escrowed} but open holds total {open_sum}")
        pending = dict(
            _rows(
                db,
                "SELECT 'pending:' || operator, SUM(amount) FROM ledger_earnings "
                "WHERE state = 'pending' GROUP BY operator",
            )
        )
        for account in sorted(set(pending) | {a for a in sums if a.startswith("pending:")}):
            if sums.get(account, 0) != pending.get(account, 0):
                bad.append(
                    f"{account} holds {sums.get(account, 0)} but its pending earnings total "
                    f"{pending.get(account, 0)}"
                )
        _check_once(db, bad)
    return result


def _check_once(db: sqlite_utils.Database, bad: list[str]) -> None:
    """No double settlement: each closed hold has exactly one closing transaction, each
    closed earning exactly one, and each hold's charge equals what its earnings and fee
    took."""
    for hold_id, amount, charged, refunded in _rows(
        db, "SELECT hold_id, amount, charged, refunded FROM ledger_holds WHERE state != 'open'"
    ):
        if charged + refunded != amount:
            bad.append(f"hold {hold_id} escrowed {amount} but charged {charged} and refunded "
                       f"{refunded}")  # fmt: skip
    for hold_id, state in _rows(
        db, "SELECT hold_id, state FROM ledger_holds WHERE state != 'open'"
    ):
        kind = "settle" if state == "settled" else "expire"
        (count,) = _rows(
            db, "SELECT COUNT(*) FROM ledger_transactions WHERE txid = ?", [f"{kind}:{hold_id}"]
        )[0]
        if count != 1:
            bad.append(f"hold {hold_id} is {state} but has {count} {kind} transactions")
    for hold_id, charged, fee in _rows(db, "SELECT hold_id, charged, fee FROM ledger_holds"):
        (paid,) = _rows(
            db,
            "SELECT COALESCE(SUM(amount), 0) FROM ledger_earnings WHERE hold_id = ?",
            [hold_id],
        )[0]
        if paid + fee != charged:
            bad.append(f"hold {hold_id} charged {charged} but its earnings and fee total "
                       f"{paid + fee}")  # fmt: skip
    prefix = {"released": "release", "rejected": "reject"}
    for earning_id, state in _rows(
        db, "SELECT id, state FROM ledger_earnings WHERE state IN ('released', 'rejected')"
    ):
        txid = f"{prefix[state]}:{earning_id}"
        (count,) = _rows(db, "SELECT COUNT(*) FROM ledger_transactions WHERE txid = ?", [txid])[0]
        if count != 1:
            bad.append(f"earning {earning_id} is {state} but has {count} such transactions")
    for txid, count in _rows(
        db,
        "SELECT txid, COUNT(*) FROM ledger_entries GROUP BY txid, account HAVING COUNT(*) > 1",
    ):
        bad.append(f"transaction {txid} posts {count} times to one account")
