"""The ledger's tables, as one migration appended to coordinator/migrations.py.

Balances are a cached sum of entries, kept in the same transaction as the entries, so a
read never scans history; `audit()` recomputes them from the entries. CHECK constraints
are the last line of defence: only the mint may go below zero.
"""

from __future__ import annotations

import sqlite_utils

MIGRATION_NAME = "ledger: accounts, transactions, entries, holds, earnings, disputes"

_STATEMENTS = (
    """
    CREATE TABLE ledger_accounts (
        account TEXT PRIMARY KEY,
        balance INTEGER NOT NULL DEFAULT 0,
        created_ms INTEGER NOT NULL,
        CHECK (balance >= 0 OR account = 'mint')
    )
    """,
    # txid is the idempotency key ("grant:<request id>", "settle:<session id>", ...);
    # params is the canonical JSON of the request, so a reused key with other
    # parameters is refused instead of silently answered.
    """
    CREATE TABLE ledger_transactions (
        txid TEXT PRIMARY KEY,
        kind TEXT NOT NULL,
        params TEXT NOT NULL,
        created_ms INTEGER NOT NULL
    )
    """,
    """
    CREATE TABLE ledger_entries (
        id INTEGER PRIMARY KEY,
        txid TEXT NOT NULL REFERENCES ledger_transactions(txid),
        account TEXT NOT NULL REFERENCES ledger_accounts(account),
        amount INTEGER NOT NULL CHECK (amount != 0)
    )
    """,
    "CREATE INDEX ledger_entries_txid ON ledger_entries (txid)",
    "CREATE INDEX ledger_entries_account ON ledger_entries (account)",
    """
    CREATE TABLE ledger_holds (
        hold_id TEXT PRIMARY KEY,
        account TEXT NOT NULL,
        amount INTEGER NOT NULL CHECK (amount > 0),
        state TEXT NOT NULL CHECK (state IN ('open', 'settled', 'expired')),
        client_key BLOB NOT NULL,
        prices TEXT NOT NULL,
        created_ms INTEGER NOT NULL,
        expires_ms INTEGER NOT NULL,
        closed_ms INTEGER,
        charged INTEGER NOT NULL DEFAULT 0,
        refunded INTEGER NOT NULL DEFAULT 0,
        fee INTEGER NOT NULL DEFAULT 0
    )
    """,
    "CREATE INDEX ledger_holds_state ON ledger_holds (state, expires_ms)",
    """
    CREATE TABLE ledger_earnings (
        id INTEGER PRIMARY KEY,
        receipt_id TEXT NOT NULL UNIQUE,
        hold_id TEXT NOT NULL REFERENCES ledger_holds(hold_id),
        node_id TEXT NOT NULL,
        operator TEXT NOT NULL,
        amount INTEGER NOT NULL CHECK (amount > 0),
        state TEXT NOT NULL CHECK (state IN ('pending', 'released', 'slashed', 'rejected')),
        settled_ms INTEGER NOT NULL,
        release_after_ms INTEGER NOT NULL,
        closed_ms INTEGER
    )
    """,
    "CREATE INDEX ledger_earnings_state ON ledger_earnings (state, release_after_ms)",
    "CREATE INDEX ledger_earnings_node ON ledger_earnings (node_id, state)",
    """
    CREATE TABLE ledger_disputes (
        node_id TEXT NOT NULL,
        session_id TEXT NOT NULL,
        reason TEXT NOT NULL,
        created_ms INTEGER NOT NULL,
        PRIMARY KEY (node_id, session_id)
    )
    """,
)


def create_ledger_tables(db: sqlite_utils.Database) -> None:
    for statement in _STATEMENTS:
        db.execute(statement)


PERIODIC_MIGRATION_NAME = "ledger: usage paid per receipt key (periodic settlement), convictions"

_PERIODIC_STATEMENTS = (
    # Receipts are cumulative per (session, node, layers): what was paid for so far, so a
    # periodic or final settlement pays only what a newer receipt adds.
    """
    CREATE TABLE ledger_usage_paid (
        hold_id TEXT NOT NULL REFERENCES ledger_holds(hold_id),
        node_id TEXT NOT NULL,
        layer_start INTEGER NOT NULL,
        layer_end INTEGER NOT NULL,
        tokens INTEGER NOT NULL CHECK (tokens >= 0),
        charged INTEGER NOT NULL CHECK (charged >= 0),
        PRIMARY KEY (hold_id, node_id, layer_start, layer_end)
    )
    """,
    # Nodes proven fraudulent: their work in sessions settled later is not paid.
    """
    CREATE TABLE ledger_convictions (
        node_id TEXT PRIMARY KEY,
        evidence_id TEXT NOT NULL,
        created_ms INTEGER NOT NULL
    )
    """,
)


def create_periodic_settlement_tables(db: sqlite_utils.Database) -> None:
    for statement in _PERIODIC_STATEMENTS:
        db.execute(statement)


NONCES_MIGRATION_NAME = "ledger: nonces of signed open requests (replay guard)"


def create_nonce_table(db: sqlite_utils.Database) -> None:
    # A signed open request is accepted once: its nonce is kept while its stamp could still
    # pass the freshness check, so a coordinator restart does not reopen the window.
    db.execute(
        """
        CREATE TABLE ledger_request_nonces (
            nonce BLOB PRIMARY KEY,
            seen_ms INTEGER NOT NULL
        )
        """
    )
    db.execute("CREATE INDEX ledger_request_nonces_seen ON ledger_request_nonces (seen_ms)")


PRIMARIES_MIGRATION_NAME = "ledger: each paid session's primaries at open (billed in full)"


def create_primaries_table(db: sqlite_utils.Database) -> None:
    # The node and layers of each stage's primary when a session opened. Everything such a
    # node computed there was the client's own work (a stage's checks run on other nodes),
    # so its receipts are billed in full whatever billed_tokens the client claims.
    db.execute(
        """
        CREATE TABLE ledger_hold_primaries (
            hold_id TEXT NOT NULL,
            node_id TEXT NOT NULL,
            layer_start INTEGER NOT NULL,
            layer_end INTEGER NOT NULL,
            PRIMARY KEY (hold_id, node_id, layer_start)
        )
        """
    )


HELD_MIGRATION_NAME = "ledger: what each receipt key counted and held (shortfall billing)"


def add_held_columns(db: sqlite_utils.Database) -> None:
    # Per (session, node, layers): the newest receipt's count and longest prefix held, and
    # what its shortfall was charged so far (coordinator/ledger/shortfall.py). A receipt
    # that adds nothing to pay still adds its evidence, so a row may have tokens = 0.
    for column in ("counted", "longest", "extra_charged"):
        db.execute(
            f"ALTER TABLE ledger_usage_paid ADD COLUMN {column} INTEGER NOT NULL DEFAULT 0 "
            f"CHECK ({column} >= 0)"
        )
