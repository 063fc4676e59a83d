"""The jobs tables, as one migration for coordinator/migrations.py.

`datasets` + `dataset_shards`: token datasets by content address; `jobs`: one row per
training job; `job_losses`: the loss history (a step redone after a rollback replaces its
row); `job_checkpoints`: one row per (job, step, stage) part a node uploaded. A step's
checkpoint is consistent when every stage of the job's layout has a row for it.
"""

from __future__ import annotations

from typing import Any

from coordinator.model_store.schema import connection_of

MIGRATION_NAME = "jobs: datasets, jobs, losses and checkpoints"
OWNER_MIGRATION_NAME = "jobs: the client key that owns a job"
REPLAN_MIGRATION_NAME = "jobs: the failure the last re-plan answered"
DATASET_USE_MIGRATION_NAME = "jobs: when each dataset was last uploaded or looked up"

_STATEMENTS = (
    """
    CREATE TABLE IF NOT EXISTS datasets (
        id TEXT PRIMARY KEY,
        name TEXT NOT NULL,
        num_tokens INTEGER NOT NULL,
        max_token_id INTEGER NOT NULL,
        example_len INTEGER NOT NULL,
        created_ms INTEGER NOT NULL
    )
    """,
    """
    CREATE TABLE IF NOT EXISTS dataset_shards (
        dataset_id TEXT NOT NULL REFERENCES datasets(id) ON DELETE CASCADE,
        position INTEGER NOT NULL,
        sha256 TEXT NOT NULL,
        num_tokens INTEGER NOT NULL,
        PRIMARY KEY (dataset_id, position)
    )
    """,
    "CREATE INDEX IF NOT EXISTS dataset_shards_by_sha256 ON dataset_shards(sha256)",
    """
    CREATE TABLE IF NOT EXISTS jobs (
        id TEXT PRIMARY KEY,
        model TEXT NOT NULL,
        dataset_id TEXT NOT NULL REFERENCES datasets(id),
        hyper BLOB NOT NULL,
        steps INTEGER NOT NULL,
        batch_size INTEGER NOT NULL,
        seq_len INTEGER NOT NULL,
        checkpoint_every INTEGER NOT NULL,
        output_model TEXT NOT NULL,
        account TEXT NOT NULL,
        state TEXT NOT NULL,
        step INTEGER NOT NULL,
        last_loss REAL NOT NULL,
        tokens_per_s REAL NOT NULL,
        checkpoint_step INTEGER NOT NULL,
        stages_json TEXT NOT NULL,
        error TEXT NOT NULL,
        session_issued_ms INTEGER NOT NULL,
        replans INTEGER NOT NULL,
        created_ms INTEGER NOT NULL,
        updated_ms INTEGER NOT NULL
    )
    """,
    "CREATE INDEX IF NOT EXISTS jobs_by_created ON jobs(created_ms)",
    """
    CREATE TABLE IF NOT EXISTS job_losses (
        job_id TEXT NOT NULL REFERENCES jobs(id) ON DELETE CASCADE,
        step INTEGER NOT NULL,
        loss REAL NOT NULL,
        grad_norm REAL NOT NULL,
        tokens_per_s REAL NOT NULL,
        stage_ms_json TEXT NOT NULL,
        ts_ms INTEGER NOT NULL,
        PRIMARY KEY (job_id, step)
    )
    """,
    """
    CREATE TABLE IF NOT EXISTS job_checkpoints (
        job_id TEXT NOT NULL REFERENCES jobs(id) ON DELETE CASCADE,
        step INTEGER NOT NULL,
        start INTEGER NOT NULL,
        end INTEGER NOT NULL,
        sha256 TEXT NOT NULL,
        total_bytes INTEGER NOT NULL,
        node_id TEXT NOT NULL,
        uploaded_ms INTEGER NOT NULL,
        PRIMARY KEY (job_id, step, start, end)
    )
    """,
    "CREATE INDEX IF NOT EXISTS job_checkpoints_by_sha256 ON job_checkpoints(sha256)",
)


def create_jobs_tables(db: Any) -> None:
    """Migration: create the jobs tables (idempotent)."""
    conn = connection_of(db)
    for statement in _STATEMENTS:
        conn.execute(statement)


def add_job_owner(db: Any) -> None:
    # Empty for the jobs submitted before: nobody owns them, as before.
    connection_of(db).execute("ALTER TABLE jobs ADD COLUMN owner_key BLOB NOT NULL DEFAULT x''")


def add_replan_key(db: Any) -> None:
    # Empty for the jobs re-planned before: a repeated report of that re-plan is refused,
    # as before.
    connection_of(db).execute("ALTER TABLE jobs ADD COLUMN replan_key TEXT NOT NULL DEFAULT ''")


def add_dataset_used_ms(db: Any) -> None:
    # A dataset no job uses is deleted some time after it was last uploaded or looked up
    # (Settings.dataset_ttl_s); those stored before count from their upload.
    connection_of(db).execute("ALTER TABLE datasets ADD COLUMN used_ms INTEGER NOT NULL DEFAULT 0")
