"""`tessera-coordinator ledger audit` and `credits grant` as a person runs them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from coordinator.db import open_database
from coordinator.ledger import Ledger, NodeQuote, Usage


def cli(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "coordinator.cli", *argv],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_audit_exits_0_on_a_sound_ledger_and_1_on_a_violation(tmp_path: Path):
    path = tmp_path / "coordinator.db"
    db = open_database(path)
    ledger = Ledger(db, challenge_window_ms=0)
    ledger.grant("calice", 1_000, "g1")
    ledger.open_hold("s1", "calice", 500, {"n1": NodeQuote(1000, "op1")}, 10**15, b"k" * 32)
    ledger.settle("s1", [Usage("r1", "n1", 0, 2, 100)])
    db.close()
    sound = cli("ledger", "audit", "--db", str(path))
    assert sound.returncode == 0 and "ledger OK" in sound.stdout, sound.stdout + sound.stderr
    # Credit appears from nowhere: an entry outside any balanced transaction.
    db = open_database(path)
    with db.atomic():
        db.execute("UPDATE ledger_entries SET amount = amount + 7 WHERE account = 'client:calice'")
        db.execute(
            "UPDATE ledger_accounts SET balance = balance + 7 WHERE account = 'client:calice'"
        )
    db.close()
    broken = cli("ledger", "audit", "--db", str(path))
    assert broken.returncode == 1
    assert "VIOLATION: transaction grant:g1 does not balance" in broken.stdout, broken.stdout


def test_grant_refuses_bad_amounts_before_calling_anyone(tmp_path: Path):
    for amount, fragment in [("1.5", "whole number"), ("0", "between 1"), ("-3", "between 1"),
                             (str(2**63), "between 1")]:  # fmt: skip
        result = cli("credits", "grant", "c" + "0" * 23, amount, "--coordinator", "127.0.0.1:1",
                     "--admin-token", "t")  # fmt: skip
        assert result.returncode == 2 and fragment in result.stderr, result.stderr
    missing = cli("ledger", "audit", "--db", str(tmp_path / "nope.db"))
    assert missing.returncode == 2 and "does not exist" in missing.stderr
    assert "coordinator.db" in missing.stderr  # says what to pass instead


def test_stake_deposit_refuses_bad_amounts_and_a_missing_node_key(tmp_path: Path):
    def node_cli(*argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "node_agent.cli", *argv],
                              capture_output=True, text=True, timeout=60)  # fmt: skip

    for amount, fragment in [("1.5", "whole number"), ("0", "between 1"), ("-3", "between 1"),
                             (str(2**63), "between 1")]:  # fmt: skip
        result = node_cli("stake", "deposit", amount, "--coordinator", "127.0.0.1:1",
                          "--data-dir", str(tmp_path))  # fmt: skip
        assert result.returncode == 2 and fragment in result.stderr, result.stderr
    no_key = node_cli("stake", "deposit", "10", "--coordinator", "127.0.0.1:1", "--data-dir",
                      str(tmp_path / "empty"))  # fmt: skip
    assert no_key.returncode != 0 and "no node key" in no_key.stdout + no_key.stderr
    assert not (tmp_path / "empty").exists(), "a stake command never creates a node key"
    helped = node_cli("stake", "deposit", "--help")
    assert helped.returncode == 0 and "tessera-node stake deposit 5000" in helped.stdout
