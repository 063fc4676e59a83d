"""The model store's only SQL: which models exist and which blob each tensor lives in.

Kept narrow (plain records in, plain records out) so another backend can replace it.
Every call is synchronous and short; callers run them on the event loop thread, which
also keeps sqlite's one-thread-per-connection rule.
"""

from __future__ import annotations

import functools
import json
import sqlite3
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from coordinator.model_store.schema import batches, connection_of
from protos.model_family import declared_max_positions

_MODEL_COLUMNS = (
    "name, architecture, num_layers, hidden_size, vocab_size, total_bytes, config_json, "
    "manifest_sha256, added_ms"
)


@dataclass(frozen=True)
class ModelRecord:
    name: str
    architecture: str
    num_layers: int
    hidden_size: int
    vocab_size: int
    total_bytes: int
    config_json: str
    manifest_sha256: str
    added_ms: int
    has_tokenizer: bool

    @functools.cached_property
    def max_positions(self) -> int:
        """Prompt and generated tokens a session of this model may hold."""
        return declared_max_positions(json.loads(self.config_json), self.architecture)


@dataclass(frozen=True)
class TensorRecord:
    name: str
    sha256: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    layer: int


class ModelCatalog:
    def __init__(self, db: Any) -> None:
        self._conn = connection_of(db)

    def exists(self, name: str) -> bool:
        row = self._conn.execute("SELECT 1 FROM models WHERE name = ?", (name,)).fetchone()
        return row is not None

    def get(self, name: str) -> ModelRecord | None:
        row = self._conn.execute(
            f"SELECT {_MODEL_COLUMNS}, length(tokenizer_json) > 0 FROM models WHERE name = ?",
            (name,),
        ).fetchone()
        return _model(row) if row else None

    def list(self) -> list[ModelRecord]:
        rows = self._conn.execute(
            f"SELECT {_MODEL_COLUMNS}, length(tokenizer_json) > 0 FROM models ORDER BY name"
        ).fetchall()
        return [_model(row) for row in rows]

    def tokenizer_json(self, name: str) -> bytes:
        row = self._conn.execute(
            "SELECT tokenizer_json FROM models WHERE name = ?", (name,)
        ).fetchone()
        return bytes(row[0]) if row else b""

    def tensors(self, name: str) -> list[TensorRecord]:
        rows = self._conn.execute(
            "SELECT name, sha256, dtype, shape_json, nbytes, layer FROM model_tensors "
            "WHERE model = ? ORDER BY position",
            (name,),
        ).fetchall()
        return [TensorRecord(r[0], r[1], r[2], tuple(json.loads(r[3])), r[4], r[5]) for r in rows]

    def blob_sizes(self, name: str, digests: Iterable[str]) -> dict[str, int]:
        """The subset of `digests` that belong to model `name`, with their sizes."""
        wanted = list(dict.fromkeys(digests))
        found: dict[str, int] = {}
        for batch in batches(wanted):
            marks = ",".join("?" * len(batch))
            rows = self._conn.execute(
                f"SELECT DISTINCT sha256, nbytes FROM model_tensors "
                f"WHERE model = ? AND sha256 IN ({marks})",
                (name, *batch),
            ).fetchall()
            found.update({row[0]: row[1] for row in rows})
        return found

    def referenced(self, digests: Iterable[str]) -> set[str]:
        """Which of `digests` some model still uses."""
        wanted = list(dict.fromkeys(digests))
        used: set[str] = set()
        for batch in batches(wanted):
            marks = ",".join("?" * len(batch))
            rows = self._conn.execute(
                f"SELECT DISTINCT sha256 FROM model_tensors WHERE sha256 IN ({marks})", batch
            ).fetchall()
            used.update(row[0] for row in rows)
        return used

    def put(
        self, model: ModelRecord, tokenizer_json: bytes, tensors: list[TensorRecord]
    ) -> set[str]:
        """Insert or replace a model atomically; returns the digests the old version used."""
        with _transaction(self._conn):
            old = self._delete(model.name)
            self._conn.execute(
                f"INSERT INTO models ({_MODEL_COLUMNS}, tokenizer_json) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    model.name,
                    model.architecture,
                    model.num_layers,
                    model.hidden_size,
                    model.vocab_size,
                    model.total_bytes,
                    model.config_json,
                    model.manifest_sha256,
                    model.added_ms,
                    tokenizer_json,
                ),
            )
            self._conn.executemany(
                "INSERT INTO model_tensors "
                "(model, position, name, sha256, dtype, shape_json, nbytes, layer) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                [
                    (
                        model.name,
                        i,
                        t.name,
                        t.sha256,
                        t.dtype,
                        json.dumps(list(t.shape)),
                        t.nbytes,
                        t.layer,
                    )
                    for i, t in enumerate(tensors)
                ],
            )
        return old

    def remove(self, name: str) -> set[str] | None:
        """Delete a model; returns the digests it used, or None if there was no such model."""
        with _transaction(self._conn):
            if not self.exists(name):
                return None
            return self._delete(name)

    def all_digests(self) -> set[str]:
        rows = self._conn.execute("SELECT DISTINCT sha256 FROM model_tensors").fetchall()
        return {row[0] for row in rows}

    def _delete(self, name: str) -> set[str]:
        rows = self._conn.execute(
            "SELECT DISTINCT sha256 FROM model_tensors WHERE model = ?", (name,)
        ).fetchall()
        # Explicit deletes: ON DELETE CASCADE only works where PRAGMA foreign_keys is on.
        self._conn.execute("DELETE FROM model_tensors WHERE model = ?", (name,))
        self._conn.execute("DELETE FROM models WHERE name = ?", (name,))
        return {row[0] for row in rows}


@contextmanager
def _transaction(conn: sqlite3.Connection) -> Iterator[None]:
    # A savepoint rather than `with conn:`: it is atomic whether the shared connection runs
    # in autocommit mode or inside a transaction some other component opened.
    conn.execute("SAVEPOINT model_store")
    try:
        yield
    except BaseException:
        conn.execute("ROLLBACK TO model_store")
        conn.execute("RELEASE model_store")
        raise
    conn.execute("RELEASE model_store")


def _model(row: tuple[Any, ...]) -> ModelRecord:
    return ModelRecord(*row[:9], has_tokenizer=bool(row[9]))
