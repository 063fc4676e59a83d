"""SQLite storage of the registry, behind a narrow repository class.

Only NodeRepository knows SQL about nodes, so a PostgreSQL backend can replace it without
touching the registry. The hot path (last_seen on every heartbeat) never writes per call:
the registry hands `write_batch` everything that changed since the last flush.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import sqlite_utils

from coordinator.migrations import apply_migrations

log = logging.getLogger(__name__)

BUSY_TIMEOUT_MS = 5000


def open_database(path: Path | str) -> sqlite_utils.Database:
    """Open (creating if needed) the coordinator database and migrate it to the newest schema."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    db = sqlite_utils.Database(path)
    db.enable_wal()
    # NORMAL in WAL mode: a commit survives a process crash (kill -9); only an OS crash or
    # power cut can lose the last transactions, which is fine for presence data.
    db.execute("PRAGMA synchronous=NORMAL")
    db.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
    db.execute("PRAGMA foreign_keys=ON")
    applied = apply_migrations(db)
    if applied:
        log.info("database %s migrated to schema version %d", path, applied[-1])
    return db


@dataclass
class NodeRecord:
    node_id: str
    public_key: bytes
    name: str
    account: str
    capabilities: bytes  # serialized tessera.v1.Capabilities
    device_kind: str
    device_name: str
    device_count: int
    memory_usable_bytes: int
    matmul_tflops: float
    region: str
    data_address: str
    state: str
    registered_ms: int
    last_seen_ms: int
    state_changed_ms: int
    reachable: bool


@dataclass(frozen=True)
class StateChange:
    """One row of node_events."""

    node_id: str
    ts_ms: int
    from_state: str | None
    to_state: str
    reason: str


_NODE_COLUMNS = [
    "node_id", "public_key", "name", "account", "capabilities", "device_kind", "device_name",
    "device_count", "memory_usable_bytes", "matmul_tflops", "region", "data_address", "state",
    "registered_ms", "last_seen_ms", "state_changed_ms", "reachable",
]  # fmt: skip


class NodeRepository:
    def __init__(self, db: sqlite_utils.Database) -> None:
        self.db = db

    def load_nodes(self) -> list[NodeRecord]:
        rows = self.db.execute(f"SELECT {', '.join(_NODE_COLUMNS)} FROM nodes").fetchall()
        records = []
        for row in rows:
            values = dict(zip(_NODE_COLUMNS, row, strict=True))
            values["reachable"] = bool(values["reachable"])
            for key in ("account", "device_kind", "device_name", "region", "data_address"):
                values[key] = values[key] or ""
            for key in ("device_count", "memory_usable_bytes", "last_seen_ms", "state_changed_ms"):
                values[key] = values[key] or 0
            values["matmul_tflops"] = values["matmul_tflops"] or 0.0
            values["capabilities"] = values["capabilities"] or b""
            records.append(NodeRecord(**values))
        return records

    def save_registration(self, record: NodeRecord, change: StateChange | None) -> None:
        """Insert or update a node's registration row, durably, before the node hears back."""
        values = [getattr(record, c) for c in _NODE_COLUMNS]
        values[_NODE_COLUMNS.index("reachable")] = int(record.reachable)
        placeholders = ", ".join("?" for _ in _NODE_COLUMNS)
        updates = ", ".join(f"{c}=excluded.{c}" for c in _NODE_COLUMNS if c != "node_id")
        with self.db.atomic():
            self.db.execute(
                f"INSERT INTO nodes ({', '.join(_NODE_COLUMNS)}) VALUES ({placeholders}) "
                f"ON CONFLICT(node_id) DO UPDATE SET {updates}",
                values,
            )
            if change is not None:
                self._insert_changes([change])

    def write_batch(self, last_seen: dict[str, int], changes: Iterable[StateChange]) -> None:
        """Persist everything that changed since the last flush in one transaction."""
        changes = list(changes)
        if not last_seen and not changes:
            return
        with self.db.atomic():
            if last_seen:
                self.db.conn.executemany(
                    "UPDATE nodes SET last_seen_ms = ? WHERE node_id = ?",
                    [(ms, node_id) for node_id, ms in last_seen.items()],
                )
            if changes:
                self.db.conn.executemany(
                    "UPDATE nodes SET state = ?, state_changed_ms = ? WHERE node_id = ?",
                    [(c.to_state, c.ts_ms, c.node_id) for c in changes],
                )
                self._insert_changes(changes)

    def _insert_changes(self, changes: list[StateChange]) -> None:
        self.db.conn.executemany(
            "INSERT INTO node_events (node_id, ts_ms, from_state, to_state, reason) "
            "VALUES (?, ?, ?, ?, ?)",
            [(c.node_id, c.ts_ms, c.from_state, c.to_state, c.reason) for c in changes],
        )

    def last_reasons(self) -> dict[str, str]:
        """Each node's newest state change's reason."""
        rows = self.db.execute(
            "SELECT node_id, reason FROM node_events WHERE id IN "
            "(SELECT MAX(id) FROM node_events GROUP BY node_id)"
        ).fetchall()
        return {node_id: reason or "" for node_id, reason in rows}

    def events(self, node_id: str | None = None, limit: int = 1000) -> list[StateChange]:
        """The newest state changes last; of one node, or of all."""
        where, params = ("WHERE node_id = ?", [node_id]) if node_id else ("", [])
        rows = self.db.execute(
            "SELECT node_id, ts_ms, from_state, to_state, reason FROM node_events "
            f"{where} ORDER BY id DESC LIMIT ?",
            [*params, limit],
        ).fetchall()
        return [StateChange(*row) for row in reversed(rows)]
