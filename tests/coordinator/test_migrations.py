"""Schema migrations: fresh database, idempotent re-open, ordering, rollback on failure."""

from __future__ import annotations

from pathlib import Path

import pytest
import sqlite_utils

from coordinator.db import open_database
from coordinator.jobs.repository import JobRepository
from coordinator.jobs.schema import REPLAN_MIGRATION_NAME as JOBS_REPLAN_MIGRATION
from coordinator.ledger.schema import HELD_MIGRATION_NAME
from coordinator.migrations import MIGRATIONS, Migration, SchemaTooNew, apply_migrations


def versions(db: sqlite_utils.Database) -> list[int]:
    return [r[0] for r in db.execute("SELECT version FROM schema_version ORDER BY version")]


def test_fresh_database_gets_every_migration(tmp_path: Path) -> None:
    db = open_database(tmp_path / "sub" / "c.db")
    assert versions(db) == [m.version for m in MIGRATIONS]
    assert {"nodes", "node_events", "schema_version"} <= set(db.table_names())
    assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert db.execute("PRAGMA busy_timeout").fetchone()[0] >= 1000
    assert db.execute("PRAGMA synchronous").fetchone()[0] == 1  # NORMAL
    db.close()


def test_reopening_is_idempotent(tmp_path: Path) -> None:
    path = tmp_path / "c.db"
    db = open_database(path)
    db["nodes"].insert(
        {"node_id": "n1", "public_key": b"k" * 32, "name": "x", "state": "offline",
         "registered_ms": 1}
    )  # fmt: skip
    db.close()

    db = open_database(path)
    assert apply_migrations(db) == []
    assert versions(db) == [m.version for m in MIGRATIONS]
    assert db["nodes"].count == 1  # data untouched
    db.close()


def test_a_new_migration_applies_once_on_an_existing_database(tmp_path: Path) -> None:
    db = open_database(tmp_path / "c.db")
    newest = MIGRATIONS[-1].version

    def add_ratings(db: sqlite_utils.Database) -> None:
        db["ratings"].create({"node_id": str, "score": float}, pk="node_id")

    extended = [*MIGRATIONS, Migration(newest + 1, "ratings", add_ratings)]
    assert apply_migrations(db, extended) == [newest + 1]
    assert apply_migrations(db, extended) == []
    assert "ratings" in db.table_names()


def test_a_failing_migration_leaves_nothing_behind(tmp_path: Path) -> None:
    db = open_database(tmp_path / "c.db")
    newest = MIGRATIONS[-1].version

    def half_done(db: sqlite_utils.Database) -> None:
        db["half"].create({"id": int}, pk="id")
        raise RuntimeError("disk on fire")

    with pytest.raises(RuntimeError, match="disk on fire"):
        apply_migrations(db, [*MIGRATIONS, Migration(newest + 1, "half", half_done)])
    assert "half" not in db.table_names()
    assert versions(db)[-1] == newest


def test_a_database_from_a_newer_coordinator_is_refused(tmp_path: Path) -> None:
    db = open_database(tmp_path / "c.db")
    db.execute("INSERT INTO schema_version VALUES (999, 'from the future', 0)")
    db.close()
    with pytest.raises(SchemaTooNew, match="999"):
        open_database(tmp_path / "c.db")


@pytest.mark.parametrize("numbers", [[1, 1], [2, 1], [0]])
def test_migration_versions_must_increase(tmp_path: Path, numbers: list[int]) -> None:
    db = sqlite_utils.Database(tmp_path / "x.db")
    bad = [Migration(n, f"m{n}", lambda db: None) for n in numbers]
    with pytest.raises(ValueError, match="increasing"):
        apply_migrations(db, bad)


def test_the_shipped_migrations_are_ordered() -> None:
    numbers = [m.version for m in MIGRATIONS]
    assert numbers == list(range(1, len(numbers) + 1))


def test_jobs_of_an_older_database_get_an_empty_replan_key(tmp_path: Path) -> None:
    # A coordinator upgraded in place: the jobs table gains the column, empty for its rows.
    db = sqlite_utils.Database(tmp_path / "c.db")
    replan = next(m.version for m in MIGRATIONS if m.name == JOBS_REPLAN_MIGRATION)
    older = [m for m in MIGRATIONS if m.version < replan]
    apply_migrations(db, older)
    assert "replan_key" not in db["jobs"].columns_dict
    db.execute("INSERT INTO datasets VALUES ('d', 'd', 1, 1, 0, 0)")
    db.execute(
        "INSERT INTO jobs (id, model, dataset_id, hyper, steps, batch_size, seq_len, "
        "checkpoint_every, output_model, account, state, step, last_loss, tokens_per_s, "
        "checkpoint_step, stages_json, error, session_issued_ms, replans, created_ms, "
        "updated_ms) VALUES ('j', 'm', 'd', x'', 1, 1, 1, 1, '', 'a', 'running', 0, 0, 0, 0, "
        "'[]', '', 5, 1, 0, 0)"
    )
    assert apply_migrations(db) == [m.version for m in MIGRATIONS if m.version >= replan]
    job = JobRepository(db).job("j")
    assert job is not None and job.replan_key == "" and job.replans == 1


def test_usage_paid_before_the_upgrade_holds_no_evidence_of_what_was_held(tmp_path: Path) -> None:
    db = sqlite_utils.Database(tmp_path / "c.db")
    held = next(m.version for m in MIGRATIONS if m.name == HELD_MIGRATION_NAME)
    apply_migrations(db, [m for m in MIGRATIONS if m.version < held])
    db.execute("INSERT INTO ledger_usage_paid VALUES ('s', 'n', 0, 4, 12, 48)")
    assert apply_migrations(db) == [m.version for m in MIGRATIONS if m.version >= held]
    row = db.execute("SELECT tokens, charged, counted, longest, extra_charged "
                     "FROM ledger_usage_paid").fetchone()  # fmt: skip
    assert row == (12, 48, 0, 0, 0)
