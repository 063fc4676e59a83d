"""The marketplace's credit ledger: double-entry accounts in SQLite, escrow holds,
settlement from signed receipts, a challenge window before payout, and slashing.

See docs/ledger.md for the accounts, the invariants and the commands.
"""

from __future__ import annotations

from coordinator.ledger.amounts import LedgerError
from coordinator.ledger.audit import AuditResult, audit
from coordinator.ledger.book import Ledger, NodeQuote, SettlementResult, Usage

__all__ = [
    "AuditResult",
    "Ledger",
    "LedgerError",
    "NodeQuote",
    "SettlementResult",
    "Usage",
    "audit",
]
