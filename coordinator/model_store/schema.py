"""The model store's tables, as one migration for coordinator/migrations.py.

`models` holds one row per imported model; `model_tensors` one row per tensor with its
content address. Blobs need no refcount table: a blob is referenced while some row of
`model_tensors` names its sha256 (indexed), which cannot drift out of sync.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from typing import Any

MIGRATION_NAME = "model store: models and model_tensors"

_STATEMENTS = (
    """
    CREATE TABLE IF NOT EXISTS models (
        name TEXT PRIMARY KEY,
        architecture TEXT NOT NULL,
        num_layers INTEGER NOT NULL,
        hidden_size INTEGER NOT NULL,
        vocab_size INTEGER NOT NULL,
        total_bytes INTEGER NOT NULL,
        config_json TEXT NOT NULL,
        tokenizer_json BLOB NOT NULL,
        manifest_sha256 TEXT NOT NULL,
        added_ms INTEGER NOT NULL
    )
    """,
    """
    CREATE TABLE IF NOT EXISTS model_tensors (
        model TEXT NOT NULL REFERENCES models(name) ON DELETE CASCADE,
        position INTEGER NOT NULL,
        name TEXT NOT NULL,
        sha256 TEXT NOT NULL,
        dtype TEXT NOT NULL,
        shape_json TEXT NOT NULL,
        nbytes INTEGER NOT NULL,
        layer INTEGER NOT NULL,
        PRIMARY KEY (model, name)
    )
    """,
    "CREATE INDEX IF NOT EXISTS model_tensors_by_sha256 ON model_tensors(sha256)",
    "CREATE UNIQUE INDEX IF NOT EXISTS model_tensors_by_position ON model_tensors(model, position)",
)


def batches(items: list[str], size: int = 500) -> Iterator[list[str]]:
    """``items`` in lists of at most ``size``: SQLite caps the parameters of a statement."""
    for start in range(0, len(items), size):
        yield items[start : start + size]


def connection_of(db: Any) -> sqlite3.Connection:
    """Accept a sqlite3 connection or anything wrapping one as `.conn` (sqlite_utils)."""
    return db if isinstance(db, sqlite3.Connection) else db.conn


def create_model_store_tables(db: Any) -> None:
    """Migration: create the model store's tables (idempotent)."""
    conn = connection_of(db)
    for statement in _STATEMENTS:
        conn.execute(statement)
