"""The jobs component's only SQL: datasets, jobs, loss history and checkpoint parts.

Kept narrow (plain records in, plain records out) so another backend can replace it. Calls
are synchronous and short and run on the event loop thread, like the model catalog's.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any

from coordinator.model_store.schema import batches, connection_of


@dataclass(frozen=True)
class ShardRecord:
    sha256: str
    num_tokens: int


@dataclass(frozen=True)
class DatasetRecord:
    id: str
    name: str
    num_tokens: int
    max_token_id: int
    example_len: int
    created_ms: int
    shards: tuple[ShardRecord, ...] = ()


@dataclass(frozen=True)
class StageRecord:
    start: int
    end: int
    node_id: str = ""
    address: str = ""

    def to_json(self) -> dict[str, Any]:
        return {"start": self.start, "end": self.end, "node_id": self.node_id,
                "address": self.address}  # fmt: skip


@dataclass(frozen=True)
class JobRecord:
    id: str
    model: str
    dataset_id: str
    hyper: bytes  # serialized tessera.v1.TrainingHyper
    steps: int
    batch_size: int
    seq_len: int
    checkpoint_every: int
    output_model: str
    account: str
    state: str  # queued | running | paused | failed | done
    step: int = 0
    last_loss: float = 0.0
    tokens_per_s: float = 0.0
    checkpoint_step: int = 0
    stages: tuple[StageRecord, ...] = ()
    error: str = ""
    session_issued_ms: int = 0
    replans: int = 0
    created_ms: int = 0
    updated_ms: int = 0
    owner_key: bytes = b""  # the client key that may open the job's sessions (b"": anyone)
    # The stage failure the last re-plan answered (``replan_key``), so that the driver's
    # retry of a report whose answer it lost gets that answer again ("": none).
    replan_key: str = ""

    def with_(self, **changes: Any) -> JobRecord:
        return replace(self, **changes)


@dataclass(frozen=True)
class CheckpointPartRecord:
    step: int
    start: int
    end: int
    sha256: str
    total_bytes: int
    node_id: str


@dataclass
class LossRecord:
    step: int
    loss: float
    grad_norm: float = 0.0
    tokens_per_s: float = 0.0
    stage_ms: list[float] = field(default_factory=list)


_JOB_COLUMNS = (
    "id", "model", "dataset_id", "hyper", "steps", "batch_size", "seq_len",
    "checkpoint_every", "output_model", "account", "state", "step", "last_loss",
    "tokens_per_s", "checkpoint_step", "stages_json", "error", "session_issued_ms",
    "replans", "created_ms", "updated_ms", "owner_key", "replan_key",
)  # fmt: skip


class JobRepository:
    def __init__(self, db: Any) -> None:
        self._conn = connection_of(db)

    # ---- datasets ---------------------------------------------------------------------

    def dataset(self, dataset_id: str) -> DatasetRecord | None:
        row = self._conn.execute(
            "SELECT id, name, num_tokens, max_token_id, example_len, created_ms FROM datasets "
            "WHERE id = ?",
            (dataset_id,),
        ).fetchone()
        if row is None:
            return None
        shards = self._conn.execute(
            "SELECT sha256, num_tokens FROM dataset_shards WHERE dataset_id = ? ORDER BY position",
            (dataset_id,),
        ).fetchall()
        return DatasetRecord(*row, shards=tuple(ShardRecord(s, n) for s, n in shards))

    def put_dataset(self, record: DatasetRecord) -> None:
        with _transaction(self._conn):
            self._conn.execute(
                "INSERT OR IGNORE INTO datasets "
                "(id, name, num_tokens, max_token_id, example_len, created_ms) "
                "VALUES (?, ?, ?, ?, ?, ?)",
                (record.id, record.name, record.num_tokens, record.max_token_id,
                 record.example_len, record.created_ms),
            )  # fmt: skip
            self.touch_dataset(record.id, record.created_ms)
            self._conn.executemany(
                "INSERT OR IGNORE INTO dataset_shards (dataset_id, position, sha256, num_tokens) "
                "VALUES (?, ?, ?, ?)",
                [(record.id, i, s.sha256, s.num_tokens) for i, s in enumerate(record.shards)],
            )

    def touch_dataset(self, dataset_id: str, now_ms: int) -> None:
        """The dataset was uploaded or looked up: a job may be about to use it."""
        # In a transaction of its own: a bare write would open one that nothing commits.
        with _transaction(self._conn):
            self._conn.execute(
                "UPDATE datasets SET used_ms = MAX(used_ms, ?) WHERE id = ?", (now_ms, dataset_id)
            )

    def delete_unused_datasets(self, before_ms: int) -> list[str]:
        """Delete every dataset that no job uses and that was last uploaded or looked up
        before ``before_ms``; returns their ids. Their blobs go with the next collection."""
        with _transaction(self._conn):
            ids = [
                row[0]
                for row in self._conn.execute(
                    "SELECT id FROM datasets WHERE MAX(created_ms, used_ms) < ? "
                    "AND NOT EXISTS (SELECT 1 FROM jobs WHERE jobs.dataset_id = datasets.id)",
                    (before_ms,),
                )
            ]
            self._delete(ids, [("dataset_shards", "dataset_id"), ("datasets", "id")])
        return ids

    def _delete(self, ids: list[str], rows: list[tuple[str, str]]) -> None:
        """Delete the rows whose (table, column) holds one of ``ids``, in that order."""
        for batch in batches(ids):
            marks = ",".join("?" * len(batch))
            for table, column in rows:
                self._conn.execute(f"DELETE FROM {table} WHERE {column} IN ({marks})", batch)

    # ---- jobs -------------------------------------------------------------------------

    def delete_finished_jobs(self, before_ms: int) -> list[str]:
        """Delete every job that is done or failed, or queued and never opened, and was
        last updated before ``before_ms``, with its losses and checkpoint records; returns
        their ids. The blobs go with the next collection, the datasets with the next
        dataset sweep."""
        with _transaction(self._conn):
            ids = [
                row[0]
                for row in self._conn.execute(
                    "SELECT id FROM jobs WHERE state IN ('done', 'failed', 'queued') "
                    "AND updated_ms < ?",
                    (before_ms,),
                )
            ]
            self._delete(
                ids, [("job_losses", "job_id"), ("job_checkpoints", "job_id"), ("jobs", "id")]
            )
        return ids

    def job(self, job_id: str) -> JobRecord | None:
        row = self._conn.execute(
            f"SELECT {', '.join(_JOB_COLUMNS)} FROM jobs WHERE id = ?", (job_id,)
        ).fetchone()
        return _job(row) if row else None

    def jobs(self, limit: int) -> list[JobRecord]:
        rows = self._conn.execute(
            f"SELECT {', '.join(_JOB_COLUMNS)} FROM jobs ORDER BY created_ms DESC, id LIMIT ?",
            (limit,),
        ).fetchall()
        return [_job(row) for row in rows]

    def state_counts(self) -> dict[str, int]:
        rows = self._conn.execute("SELECT state, COUNT(*) FROM jobs GROUP BY state").fetchall()
        return {state: count for state, count in rows}

    def jobs_in_states(self, states: tuple[str, ...]) -> list[JobRecord]:
        marks = ",".join("?" * len(states))
        rows = self._conn.execute(
            f"SELECT {', '.join(_JOB_COLUMNS)} FROM jobs WHERE state IN ({marks})", states
        ).fetchall()
        return [_job(row) for row in rows]

    def put_job(self, job: JobRecord) -> None:
        values = [getattr(job, c) for c in _JOB_COLUMNS if c != "stages_json"]
        values.insert(_JOB_COLUMNS.index("stages_json"), _stages_json(job.stages))
        marks = ",".join("?" * len(_JOB_COLUMNS))
        # An upsert, not INSERT OR REPLACE: a replace deletes the row first, and the
        # foreign keys would cascade that delete to the job's losses and checkpoints.
        updates = ", ".join(f"{c} = excluded.{c}" for c in _JOB_COLUMNS if c != "id")
        with _transaction(self._conn):
            self._conn.execute(
                f"INSERT INTO jobs ({', '.join(_JOB_COLUMNS)}) VALUES ({marks}) "
                f"ON CONFLICT(id) DO UPDATE SET {updates}",
                values,
            )

    def put_loss(self, job_id: str, loss: LossRecord, ts_ms: int) -> None:
        with _transaction(self._conn):
            self._conn.execute(
                "INSERT OR REPLACE INTO job_losses "
                "(job_id, step, loss, grad_norm, tokens_per_s, stage_ms_json, ts_ms) "
                "VALUES (?, ?, ?, ?, ?, ?, ?)",
                (job_id, loss.step, loss.loss, loss.grad_norm, loss.tokens_per_s,
                 json.dumps(loss.stage_ms), ts_ms),
            )  # fmt: skip

    def losses(self, job_id: str) -> list[LossRecord]:
        rows = self._conn.execute(
            "SELECT step, loss, grad_norm, tokens_per_s, stage_ms_json FROM job_losses "
            "WHERE job_id = ? ORDER BY step",
            (job_id,),
        ).fetchall()
        return [LossRecord(r[0], r[1], r[2], r[3], json.loads(r[4])) for r in rows]

    # ---- checkpoints ------------------------------------------------------------------

    def put_checkpoint_part(self, job_id: str, part: CheckpointPartRecord, ts_ms: int) -> None:
        with _transaction(self._conn):
            self._conn.execute(
                "INSERT OR REPLACE INTO job_checkpoints "
                "(job_id, step, start, end, sha256, total_bytes, node_id, uploaded_ms) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (job_id, part.step, part.start, part.end, part.sha256, part.total_bytes,
                 part.node_id, ts_ms),
            )  # fmt: skip

    def checkpoint_parts(self, job_id: str, step: int) -> list[CheckpointPartRecord]:
        rows = self._conn.execute(
            "SELECT step, start, end, sha256, total_bytes, node_id FROM job_checkpoints "
            "WHERE job_id = ? AND step = ? ORDER BY start",
            (job_id, step),
        ).fetchall()
        return [CheckpointPartRecord(*row) for row in rows]

    def checkpoint_steps_after(self, job_id: str, step: int) -> set[int]:
        rows = self._conn.execute(
            "SELECT DISTINCT step FROM job_checkpoints WHERE job_id = ? AND step > ?",
            (job_id, step),
        ).fetchall()
        return {row[0] for row in rows}

    def drop_checkpoints_except(self, job_id: str, keep_steps: set[int]) -> None:
        marks = ",".join("?" * len(keep_steps)) or "NULL"
        with _transaction(self._conn):
            self._conn.execute(
                f"DELETE FROM job_checkpoints WHERE job_id = ? AND step NOT IN ({marks})",
                (job_id, *sorted(keep_steps)),
            )

    def referenced_blobs(self) -> set[str]:
        rows = self._conn.execute(
            "SELECT sha256 FROM job_checkpoints UNION SELECT sha256 FROM dataset_shards"
        ).fetchall()
        return {row[0] for row in rows}


def _stages_json(stages: tuple[StageRecord, ...]) -> str:
    return json.dumps([s.to_json() for s in stages])


def _job(row: tuple[Any, ...]) -> JobRecord:
    values = dict(zip(_JOB_COLUMNS, row, strict=True))
    stages = tuple(StageRecord(**s) for s in json.loads(values.pop("stages_json")))
    values["hyper"] = bytes(values["hyper"])
    values["owner_key"] = bytes(values["owner_key"])
    return JobRecord(**values, stages=stages)


@contextmanager
def _transaction(conn: sqlite3.Connection) -> Iterator[None]:
    conn.execute("SAVEPOINT jobs")
    try:
        yield
    except BaseException:
        conn.execute("ROLLBACK TO jobs")
        conn.execute("RELEASE jobs")
        raise
    conn.execute("RELEASE jobs")
