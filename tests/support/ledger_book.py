"""A ledger on a real SQLite file with a clock a test moves by hand, audited when done."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

from coordinator.db import open_database
from coordinator.ledger import Ledger, audit


@contextlib.contextmanager
def audited_ledger(path: Path, client: str, grant: int) -> Iterator[Ledger]:
    """A Ledger whose ``clock["ms"]`` is the time (1,000,000 at first; a 10 s challenge
    window), with ``grant`` credits for ``client``; every invariant holds at the end."""
    db = open_database(path)
    clock = {"ms": 1_000_000}
    book = Ledger(db, challenge_window_ms=10_000, clock_ms=lambda: clock["ms"])
    book.clock = clock  # type: ignore[attr-defined]
    book.grant(client, grant, "g1")
    yield book
    result = audit(db)
    assert result.ok, result.violations
    db.close()
