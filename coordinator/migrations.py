"""Versioned schema migrations, applied in order, each in its own transaction.

Adding a migration is one line in MIGRATIONS, e.g.
    Migration(2, "model store", model_store.schema.apply),
where `apply(db: sqlite_utils.Database) -> None` creates or alters tables. Versions must be
strictly increasing; a migration never changes once released (write a new one instead).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import sqlite_utils

from coordinator.jobs.schema import DATASET_USE_MIGRATION_NAME as JOBS_DATASET_USE_MIGRATION
from coordinator.jobs.schema import MIGRATION_NAME as JOBS_MIGRATION
from coordinator.jobs.schema import OWNER_MIGRATION_NAME as JOBS_OWNER_MIGRATION
from coordinator.jobs.schema import REPLAN_MIGRATION_NAME as JOBS_REPLAN_MIGRATION
from coordinator.jobs.schema import (
    add_dataset_used_ms,
    add_job_owner,
    add_replan_key,
    create_jobs_tables,
)
from coordinator.ledger.schema import HELD_MIGRATION_NAME as LEDGER_HELD_MIGRATION
from coordinator.ledger.schema import MIGRATION_NAME as LEDGER_MIGRATION
from coordinator.ledger.schema import NONCES_MIGRATION_NAME as LEDGER_NONCES_MIGRATION
from coordinator.ledger.schema import PERIODIC_MIGRATION_NAME as LEDGER_PERIODIC_MIGRATION
from coordinator.ledger.schema import PRIMARIES_MIGRATION_NAME as LEDGER_PRIMARIES_MIGRATION
from coordinator.ledger.schema import (
    add_held_columns,
    create_ledger_tables,
    create_nonce_table,
    create_periodic_settlement_tables,
    create_primaries_table,
)
from coordinator.model_store.schema import MIGRATION_NAME as MODEL_STORE_MIGRATION
from coordinator.model_store.schema import create_model_store_tables
from coordinator.plan_store import MEASUREMENTS_MIGRATION_NAME as MEASUREMENTS_MIGRATION
from coordinator.plan_store import MIGRATION_NAME as PLAN_STORE_MIGRATION
from coordinator.plan_store import create_measurements_table, create_plan_table
from coordinator.verifier.reputation import SLASHED_BANS_MIGRATION, create_slashed_bans_table
from coordinator.verifier.reputation import create_tables as create_verifier_tables


@dataclass(frozen=True)
class Migration:
    version: int
    name: str
    apply: Callable[[sqlite_utils.Database], None]


class SchemaTooNew(RuntimeError):
    """The database was written by a newer coordinator than this one."""


def _nodes_and_events(db: sqlite_utils.Database) -> None:
    db["nodes"].create(
        {
            "node_id": str,
            "public_key": bytes,
            "name": str,
            "account": str,
            # The full Capabilities proto; the columns after it are copies for SQL queries.
            "capabilities": bytes,
            "device_kind": str,
            "device_name": str,
            "device_count": int,
            "memory_usable_bytes": int,
            "matmul_tflops": float,
            "region": str,
            "data_address": str,
            "state": str,
            "registered_ms": int,
            "last_seen_ms": int,
            "state_changed_ms": int,
            "reachable": int,
        },
        pk="node_id",
        not_null={"public_key", "name", "state", "registered_ms"},
    )
    db["nodes"].create_index(["state"])
    db["node_events"].create(
        {
            "id": int,
            "node_id": str,
            "ts_ms": int,
            "from_state": str,
            "to_state": str,
            "reason": str,
        },
        pk="id",
        not_null={"node_id", "ts_ms", "to_state"},
    )
    db["node_events"].create_index(["node_id", "ts_ms"])


MIGRATIONS: list[Migration] = [
    Migration(1, "nodes and node events", _nodes_and_events),
    Migration(2, MODEL_STORE_MIGRATION, create_model_store_tables),
    Migration(3, LEDGER_MIGRATION, create_ledger_tables),
    Migration(4, JOBS_MIGRATION, create_jobs_tables),
    Migration(5, "verifier: reputation, evidence, canaries", create_verifier_tables),
    Migration(6, LEDGER_PERIODIC_MIGRATION, create_periodic_settlement_tables),
    Migration(7, LEDGER_NONCES_MIGRATION, create_nonce_table),
    Migration(8, JOBS_OWNER_MIGRATION, add_job_owner),
    Migration(9, JOBS_REPLAN_MIGRATION, add_replan_key),
    Migration(10, SLASHED_BANS_MIGRATION, create_slashed_bans_table),
    Migration(11, JOBS_DATASET_USE_MIGRATION, add_dataset_used_ms),
    Migration(12, PLAN_STORE_MIGRATION, create_plan_table),
    Migration(13, MEASUREMENTS_MIGRATION, create_measurements_table),
    Migration(14, LEDGER_PRIMARIES_MIGRATION, create_primaries_table),
    Migration(15, LEDGER_HELD_MIGRATION, add_held_columns),
]


def current_version(db: sqlite_utils.Database) -> int:
    if "schema_version" not in db.table_names():
        return 0
    row = db.execute("SELECT MAX(version) FROM schema_version").fetchone()
    return int(row[0] or 0)


def apply_migrations(
    db: sqlite_utils.Database, migrations: list[Migration] | None = None
) -> list[int]:
    """Bring `db` up to the newest schema; returns the versions applied now (often none)."""
    migrations = MIGRATIONS if migrations is None else migrations
    versions = [m.version for m in migrations]
    if versions != sorted(set(versions)) or (versions and versions[0] < 1):
        raise ValueError(f"migration versions must be unique, increasing and >= 1: {versions}")
    with db.atomic():
        db.execute(
            "CREATE TABLE IF NOT EXISTS schema_version ("
            "version INTEGER PRIMARY KEY, name TEXT NOT NULL, applied_ms INTEGER NOT NULL)"
        )
    have = current_version(db)
    newest = versions[-1] if versions else 0
    if have > newest:
        raise SchemaTooNew(
            f"the database has schema version {have}, but this coordinator knows only up to "
            f"{newest}; run a newer tessera-coordinator, or restore a backup"
        )
    applied = []
    for migration in migrations:
        if migration.version <= have:
            continue
        with db.atomic():
            migration.apply(db)
            db.execute(
                "INSERT INTO schema_version (version, name, applied_ms) VALUES (?, ?, ?)",
                [migration.version, migration.name, int(time.time() * 1000)],
            )
        applied.append(migration.version)
    return applied
