"""A write left outside a transaction opens one that nothing commits; the coordinator
commits it when it stops, with an error in its log, rather than lose every write since."""

from __future__ import annotations

import logging
import sqlite3
from pathlib import Path

import pytest
from support.coordinator_harness import harness_settings

from coordinator.server import running_coordinator


async def test_a_transaction_left_open_is_committed_at_shutdown_and_logged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    settings = harness_settings(tmp_path)
    with caplog.at_level(logging.ERROR):
        async with running_coordinator(settings) as coordinator:
            conn = coordinator.ctx.db.conn
            conn.execute("CREATE TABLE IF NOT EXISTS scratch (x INTEGER)")
            conn.commit()
            conn.execute("INSERT INTO scratch VALUES (7)")  # the bug: no transaction of its own
            assert conn.in_transaction
            with sqlite3.connect(settings.db_path) as other:
                assert other.execute("SELECT x FROM scratch").fetchall() == []
    assert "a database transaction was left open" in caplog.text
    with sqlite3.connect(settings.db_path) as other:
        assert other.execute("SELECT x FROM scratch").fetchall() == [(7,)]
