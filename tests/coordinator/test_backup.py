"""`tessera-coordinator backup`: a copy taken while a real coordinator runs, that a
coordinator then runs from with the same models, ledger and identity; and what it says
about a corrupt blob or a wrong target."""

from __future__ import annotations

import stat
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from support.checkpoints import TINY_SHAPE, make_checkpoint
from support.procs import REPO_ROOT, CoordinatorProcess, start_coordinator

pytestmark = pytest.mark.slow
ACCOUNT = "c" + "0123456789abcdef0123456"


def cli(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "coordinator.cli", *map(str, args)],
        capture_output=True, text=True, timeout=120, cwd=REPO_ROOT,
    )  # fmt: skip


@contextmanager
def serving_a_model(tmp_path: Path) -> Iterator[CoordinatorProcess]:
    """A real coordinator process that holds model "tiny" (imported by the admin CLI)."""
    checkpoint = make_checkpoint(tmp_path / "tiny", "llama", num_layers=2, **TINY_SHAPE)
    with start_coordinator(tmp_path) as running:
        added = cli("models", "add", checkpoint, "--name", "tiny", "--data-dir", running.data_dir)
        assert added.returncode == 0, added.stderr
        yield running


def test_a_backup_taken_while_it_runs_runs_a_coordinator(tmp_path: Path) -> None:
    with serving_a_model(tmp_path) as running:
        data = running.data_dir
        granted = cli("credits", "grant", ACCOUNT, "500", "--data-dir", data)
        assert granted.returncode == 0, granted.stderr
        copy = tmp_path / "backup"
        taken = cli("backup", "--data-dir", data, "--to", copy)
        assert taken.returncode == 0, taken.stdout + taken.stderr
        assert "blobs (" in taken.stdout and "every invariant holds" in taken.stdout
        assert "PROBLEM" not in taken.stdout
        running.terminate()
    for secret in ("coordinator.key", "admin.token"):
        assert (copy / secret).read_bytes() == (data / secret).read_bytes()
        assert stat.S_IMODE((copy / secret).stat().st_mode) == 0o600
    assert stat.S_IMODE(copy.stat().st_mode) == 0o700

    with start_coordinator(tmp_path, data_dir=copy) as restored:
        listed = cli("models", "list", "--data-dir", restored.data_dir)
        assert listed.returncode == 0 and "tiny" in listed.stdout, listed.stderr
        audited = cli("ledger", "audit", "--data-dir", restored.data_dir)
        assert audited.returncode == 0 and "500 minted" in audited.stdout, audited.stdout


def test_a_corrupt_blob_and_a_wrong_target_are_said(tmp_path: Path) -> None:
    with serving_a_model(tmp_path) as running:
        data = running.data_dir
        blob = next(
            p for p in (data / "blobs").rglob("*") if p.is_file() and p.parent.name != "incoming"
        )
        damaged = bytearray(blob.read_bytes())
        damaged[0] ^= 1
        blob.write_bytes(bytes(damaged))

        taken = cli("backup", "--data-dir", data, "--to", tmp_path / "copy")
        assert taken.returncode == 1
        digest = blob.parent.name + blob.name
        assert f"PROBLEM: {blob} is corrupt" in taken.stdout
        assert f"PROBLEM: blob {digest} is named in the database but missing" in taken.stdout
        assert not (tmp_path / "copy" / "blobs" / blob.parent.name / blob.name).exists()

        again = cli("backup", "--data-dir", data, "--to", tmp_path / "copy")
        assert again.returncode == 2 and "not an empty folder" in again.stderr
        nowhere = cli("backup", "--data-dir", tmp_path / "nothing", "--to", tmp_path / "c2")
        assert nowhere.returncode == 2 and "no database at" in nowhere.stderr
        assert not (tmp_path / "c2").exists()
