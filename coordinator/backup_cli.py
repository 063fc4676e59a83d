"""`tessera-coordinator backup`: a consistent copy of a coordinator's state, taken while it
runs.

What a coordinator cannot lose lives in its data dir: the database (nodes, models, the
ledger, jobs), its signing key (nodes and clients trust the coordinator by it), the admin
token, and the content-addressed blobs of models, datasets and checkpoints. The database
is copied with SQLite's online backup API, a consistent snapshot however much the running
coordinator writes meanwhile; the blobs are copied after it, each checked against its
name (they are immutable, so any the snapshot names are still there unless the
coordinator deleted one it no longer used in between, which the copy reports). The copy
is itself a data dir: `serve --data-dir COPY` runs from it, and restoring is stopping the
coordinator and putting the copy's files in its data dir.
"""

from __future__ import annotations

import argparse
import hashlib
import shutil
import sqlite3
import time
from pathlib import Path
from typing import Any

from coordinator.admin_client import CliError
from coordinator.secrets_store import ADMIN_TOKEN_FILE, KEY_FILE

DB_FILE = "coordinator.db"
BLOB_DIRS = ("blobs", "job_blobs")  # the model store's and the jobs component's
_CHUNK_BYTES = 4 << 20
_PAGES_PER_STEP = 4096  # the live database is locked for one step at a time, not the whole copy

EXAMPLES = """\
examples:
  tessera-coordinator backup --data-dir /var/lib/tessera --to /backup/tessera-2026-12-07
  tessera-coordinator backup --data-dir /var/lib/tessera --to /backup/db-only --no-blobs

Restore: stop the coordinator, copy the backup's files into its data dir (or start it with
--data-dir BACKUP), start it. Nodes re-attach by themselves.
"""


def add_parser(subparsers: Any) -> None:
    backup = subparsers.add_parser(
        "backup",
        help="copy the coordinator's state (database, keys, blobs), also while it runs",
        description="Copy a coordinator's data dir into a new folder: the database as a "
        "consistent snapshot (SQLite's online backup), the signing key and admin token, and "
        "every blob, each checked against its sha256. Then audits the copy's ledger. Exits "
        "0 when the copy is whole, 1 when a blob is corrupt or missing or the ledger audit "
        "fails (the copy is kept, and says what), 2 on a usage error.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    backup.add_argument(
        "--data-dir", type=Path, required=True, metavar="DIR", help="the coordinator's data dir"
    )
    backup.add_argument(
        "--db", type=Path, metavar="PATH", help=f"its database (default: DIR/{DB_FILE})"
    )
    backup.add_argument(
        "--to", type=Path, required=True, metavar="DIR",
        help="a new folder for the copy (it must not exist, or be empty)",
    )  # fmt: skip
    backup.add_argument(
        "--no-blobs", action="store_true",
        help="leave the blobs out (they are large; models and datasets can be imported again)",
    )  # fmt: skip
    backup.set_defaults(func=run_backup)


def run_backup(args: argparse.Namespace) -> int:
    source_db = (args.db or args.data_dir / DB_FILE).expanduser()
    if not source_db.is_file():
        raise CliError(
            f"no database at {source_db}: give the coordinator's --data-dir (or --db PATH)"
        )
    target: Path = args.to.expanduser()
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise CliError(f"{target} exists and is not an empty folder: back up into a new one")
    target.mkdir(parents=True, exist_ok=True, mode=0o700)
    started = time.monotonic()
    _snapshot(source_db, target / DB_FILE)
    for name in (KEY_FILE, ADMIN_TOKEN_FILE):
        if (args.data_dir / name).is_file():
            shutil.copy2(args.data_dir / name, target / name)  # keeps mode 0600
    problems: list[str] = []
    copied: set[str] = set()
    copied_bytes = 0
    if not args.no_blobs:
        for folder in BLOB_DIRS:
            copied_bytes += _copy_blobs(args.data_dir / folder, target / folder, copied, problems)
        problems += _missing_blobs(target / DB_FILE, copied)
    print(
        f"backed up {source_db} ({(target / DB_FILE).stat().st_size / 2**20:.1f} MiB) and "
        + ("no blobs (--no-blobs)" if args.no_blobs else
           f"{len(copied)} blobs ({copied_bytes / 2**20:.1f} MiB)")
        + f" into {target} in {time.monotonic() - started:.1f} s"
    )  # fmt: skip
    problems += _audit(target / DB_FILE)
    for problem in problems:
        print(f"PROBLEM: {problem}")
    return 1 if problems else 0


def _snapshot(source: Path, target: Path) -> None:
    try:
        src = sqlite3.connect(source)
        try:
            dst = sqlite3.connect(target)
            try:
                src.backup(dst, pages=_PAGES_PER_STEP)
            finally:
                dst.close()
        finally:
            src.close()
    except sqlite3.DatabaseError as err:
        target.unlink(missing_ok=True)
        raise CliError(f"cannot copy the database {source}: {err}") from None
    target.chmod(0o600)


def _copy_blobs(source: Path, target: Path, copied: set[str], problems: list[str]) -> int:
    """Copy every intact blob, adding its digest to ``copied``; returns the bytes copied."""
    size = 0
    if not source.is_dir():
        return 0
    for prefix in sorted(p for p in source.iterdir() if p.is_dir() and len(p.name) == 2):
        for blob in sorted(prefix.iterdir()):
            (target / prefix.name).mkdir(parents=True, exist_ok=True)
            copy = target / prefix.name / blob.name
            written = _copy_checked(blob, copy, prefix.name + blob.name)
            if written is None:
                problems.append(
                    f"{blob} is corrupt (its bytes do not hash to its name); not copied"
                )
                continue
            copied.add(prefix.name + blob.name)
            size += written
    return size


def _copy_checked(source: Path, target: Path, digest: str) -> int | None:
    """Copy in chunks (one tensor may be gigabytes), hashing; None, and no copy, on a mismatch."""
    hashed, written = hashlib.sha256(), 0
    with source.open("rb") as src, target.open("wb") as dst:
        while chunk := src.read(_CHUNK_BYTES):
            hashed.update(chunk)
            dst.write(chunk)
            written += len(chunk)
    if hashed.hexdigest() != digest:
        target.unlink()
        return None
    return written


def _missing_blobs(db_path: Path, copied: set[str]) -> list[str]:
    """Blobs the database names (every table's `sha256` column) that were not copied."""
    db = sqlite3.connect(db_path)
    try:
        tables = [row[0] for row in db.execute("SELECT name FROM sqlite_master WHERE type='table'")]
        named: set[str] = set()
        for table in tables:
            columns = {row[1] for row in db.execute(f'PRAGMA table_info("{table}")')}
            if "sha256" in columns:
                named |= {row[0] for row in db.execute(f'SELECT DISTINCT sha256 FROM "{table}"')}
    finally:
        db.close()
    return [
        f"blob {digest} is named in the database but missing (deleted while copying, or "
        "already gone from the data dir)"
        for digest in sorted(named - copied)
    ]


def _audit(db_path: Path) -> list[str]:
    from coordinator.db import open_database
    from coordinator.ledger.service import audit_report

    db = open_database(db_path)
    try:
        report = audit_report(db)
    finally:
        db.close()
    print(
        f"ledger of the copy: {report.transactions} transactions, "
        + ("every invariant holds" if report.ok else f"{len(report.violations)} violations")
    )
    return [f"ledger: {violation}" for violation in report.violations]
