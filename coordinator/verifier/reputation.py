"""Each node's verification record and the BOINC-style checking probability built on it.

BOINC trusts a host once it has returned enough consecutive validated results, and one
invalid result resets it. Here the record is: consecutive verified results, all verified
results, failures, and canary outcomes. The probability that a driver checks one of a
node's outputs is 1 while the node is new (fewer than ``warmup`` consecutive verified
results), then falls as ``warmup / consecutive`` down to ``p_min``; any failure sends it
back to 1. Failures also make the node more expensive for the router.

Records live in SQLite (table ``node_reputation``, created by the verifier's migration) and
in memory; every change is written through, so a restarted coordinator remembers.
"""

from __future__ import annotations

import time
from dataclasses import astuple, dataclass, fields

import sqlite_utils

from protos.tessera.v1 import node_pb2

TABLE = "node_reputation"
# A node with failures on record costs this much more per failure in the router (capped).
FAILURE_COST = 1.0
MAX_FAILURE_COST = 5


@dataclass(frozen=True)
class Schedule:
    warmup: int = 10
    p_min: float = 0.05
    p_max: float = 1.0

    def probability(self, consecutive: int) -> float:
        if consecutive < self.warmup:
            return self.p_max
        return max(self.p_min, min(self.p_max, self.p_max * self.warmup / max(1, consecutive)))


@dataclass
class Record:
    node_id: str
    consecutive: int = 0
    verified: int = 0
    failures: int = 0
    canary_passed: int = 0
    canary_failed: int = 0
    last_failure_ms: int = 0
    updated_ms: int = 0


def create_tables(db: sqlite_utils.Database) -> None:
    """Migration body: reputation, reported outputs (replay guard), evidence, canaries, risk."""
    db[TABLE].create(
        {
            "node_id": str,
            "consecutive": int,
            "verified": int,
            "failures": int,
            "canary_passed": int,
            "canary_failed": int,
            "last_failure_ms": int,
            "updated_ms": int,
        },
        pk="node_id",
    )
    # One row per node signature ever counted: the same signed output cannot be reported
    # (and so cannot earn trust or blame) twice.
    db["reported_outputs"].create({"signature_sha256": str, "session_id": str, "ts_ms": int},
                                  pk="signature_sha256")  # fmt: skip
    # The proof behind every rejection and ban: the serialized Comparison or canary run.
    db["verification_evidence"].create(
        {
            "evidence_id": str,
            "kind": str,  # "arbitration" | "canary"
            "session_id": str,
            "accused_node_id": str,
            "outcome": str,
            "detail": str,
            "payload": bytes,
            "ts_ms": int,
        },
        pk="evidence_id",
    )
    db["verification_evidence"].create_index(["accused_node_id"])
    db["canary_references"].create(
        {"key": str, "dtype": str, "shape": str, "data": bytes, "agreed_by": str, "ts_ms": int},
        pk="key",
    )
    # Honest errors seen per (device kind, dtype) pair by canaries: the calibration data.
    db["canary_calibration"].create(
        {"pair": str, "comparisons": int, "max_error": float, "tolerance": float,
         "updated_ms": int},
        pk="pair",
    )  # fmt: skip
    db["session_verification"].create(
        {"session_id": str, "calls": int, "checked": int, "mismatches": int, "updated_ms": int},
        pk="session_id",
    )


SLASHED_BANS = "slashed_bans"
SLASHED_BANS_MIGRATION = "verifier: the ban each conviction slashed"


def create_slashed_bans_table(db: sqlite_utils.Database) -> None:
    """Migration body: per node, the ban (by when it began) that a conviction slashed.

    A conviction slashes once per ban; a coordinator that restarts in the middle of a ban
    must still know it did, or a late proof would slash the operator's stake again."""
    db[SLASHED_BANS].create(
        {"node_id": str, "ban_started_ms": int, "evidence_id": str}, pk="node_id"
    )


_COLUMNS = [f.name for f in fields(Record)]
_UPSERT = (
    f"INSERT INTO {TABLE} ({', '.join(_COLUMNS)}) VALUES ({', '.join('?' * len(_COLUMNS))}) "
    "ON CONFLICT(node_id) DO UPDATE SET "
    + ", ".join(f"{column} = excluded.{column}" for column in _COLUMNS[1:])
)


class Reputation:
    def __init__(self, db: sqlite_utils.Database, schedule: Schedule | None = None) -> None:
        self._db = db
        self.schedule = schedule or Schedule()
        self._records: dict[str, Record] = {
            row["node_id"]: Record(**row) for row in db[TABLE].rows
        } if TABLE in db.table_names() else {}  # fmt: skip

    def record(self, node_id: str) -> Record:
        return self._records.get(node_id) or Record(node_id)

    def probability(self, node_id: str) -> float:
        return self.schedule.probability(self.record(node_id).consecutive)

    def trust(self, node_id: str) -> float:
        return 1.0 - self.probability(node_id)

    def router_cost(self, node_id: str) -> float:
        """Multiplier on the node's compute cost in the router: failures make it dearer."""
        return 1.0 + FAILURE_COST * min(self.record(node_id).failures, MAX_FAILURE_COST)

    def verified(self, node_id: str, *, canary: bool = False) -> None:
        record = self._mutable(node_id)
        record.consecutive += 1
        record.verified += 1
        if canary:
            record.canary_passed += 1
        self._save(record)

    def start_over(self, node_id: str) -> None:
        """Checked as a new node is (its run of verified results starts again), with what
        it did, failures included, still on record."""
        record = self._mutable(node_id)
        record.consecutive = 0
        self._save(record)

    def failed(self, node_id: str, *, canary: bool = False) -> None:
        record = self._mutable(node_id)
        record.consecutive = 0
        record.failures += 1
        record.last_failure_ms = int(time.time() * 1000)
        if canary:
            record.canary_failed += 1
        self._save(record)

    def to_proto(self, node_id: str) -> node_pb2.NodeTrust:
        r = self.record(node_id)
        p = self.schedule.probability(r.consecutive)
        return node_pb2.NodeTrust(
            trust=1.0 - p,
            check_probability=p,
            consecutive_verified=r.consecutive,
            verified=r.verified,
            failures=r.failures,
            canary_passed=r.canary_passed,
            canary_failed=r.canary_failed,
        )

    def _mutable(self, node_id: str) -> Record:
        record = self._records.get(node_id)
        if record is None:
            record = self._records[node_id] = Record(node_id)
        return record

    def _save(self, record: Record) -> None:
        record.updated_ms = int(time.time() * 1000)
        # Plain SQL: every verified result writes a row, and sqlite-utils' upsert first
        # reads the schema back (a third of the coordinator's CPU per generated token).
        with self._db.atomic():
            self._db.execute(_UPSERT, astuple(record))
