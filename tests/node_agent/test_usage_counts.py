"""A node's usage counts outlive the node: kept in its data dir, a few seconds apart and
when it stops, so that a node restarted in the middle of a session counts on from where it
was, and its receipts still claim more than the coordinator already paid."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from node_agent import receipts
from node_agent.receipts import UsageMeter, save_usage
from protos import identity
from protos.tessera.v1 import ledger_pb2


def tokens_of(signed: ledger_pb2.SignedUsage, public: bytes) -> tuple[int, int, int]:
    assert identity.verify(public, signed.node_signature, identity.usage_payload(signed.receipt))
    receipt = ledger_pb2.UsageReceipt.FromString(signed.receipt)
    return receipt.tokens, receipt.first_step, receipt.last_step


def test_a_restarted_meter_counts_on_from_its_saved_counts(tmp_path: Path) -> None:
    key = identity.generate_private_key()
    public = identity.public_key_bytes(key)
    path = tmp_path / "usage" / "inference.json"
    meter = UsageMeter(key, path=path)
    meter.record("s-1", 0, 4, 0, 10)
    meter.record("s-1", 0, 4, 1, 1)
    meter.record("s-2", 4, 8, 3, 5)
    meter.record("s-3", 0, 4, 0, 7)
    meter.forget("s-3")  # the session ended: its count goes
    meter.save()

    again = UsageMeter(key, path=path)
    assert tokens_of(again.record("s-1", 0, 4, 2, 1), public) == (12, 0, 2)
    assert tokens_of(again.record("s-2", 4, 8, 4, 1), public) == (6, 3, 4)
    assert tokens_of(again.record("s-3", 0, 4, 5, 1), public) == (1, 5, 5)
    # Nothing new since the last save: the file is not written again.
    again.save()
    written = path.stat().st_mtime_ns
    again.save()
    assert path.stat().st_mtime_ns == written and not path.with_suffix(".partial").exists()


@pytest.mark.parametrize(
    "content",
    [
        "{not json",
        '{"s": 1}',
        '[["s", 0, 4, -3, 0, 0]]',
        '[["s", 0, 4, 1.5, 0, 0]]',
        "[[1, 2]]",
        '[["s", 0, 4, 3, 0, 0, 9]]',  # more acknowledged than counted
        '[["s", 0, 4, 3, 0, 0, 1, 4]]',  # a longer prefix held than counted
        '[["s", 0, 4, 3, 0, 0, 1, 1, 1]]',
    ],
)
def test_unreadable_counts_start_again_at_zero_and_are_written_anew(
    tmp_path: Path, content: str, caplog: pytest.LogCaptureFixture
) -> None:
    key = identity.generate_private_key()
    path = tmp_path / "usage.json"
    path.write_text(content)
    with caplog.at_level(logging.WARNING):
        meter = UsageMeter(key, path=path)
    assert "unreadable" in caplog.text and "counting from 0" in caplog.text
    assert tokens_of(meter.record("s", 0, 4, 0, 3), identity.public_key_bytes(key))[0] == 3
    meter.save()
    assert json.loads(path.read_text()) == [["s", 0, 4, 3, 0, 0, 0, 0]]  # none acknowledged


def test_receipts_say_the_longest_prefix_held_and_keep_it_across_a_restart(
    tmp_path: Path,
) -> None:
    """UsageReceipt.longest, which the ledger bills each layer for at the least: the
    longest prefix after any call (a rollback holds less, and lowers nothing), never past
    what the node counted. Counts saved before it existed load with none held."""
    key = identity.generate_private_key()
    path = tmp_path / "usage.json"
    meter = UsageMeter(key, path=path)

    def longest(signed: ledger_pb2.SignedUsage) -> int:
        return ledger_pb2.UsageReceipt.FromString(signed.receipt).longest

    assert longest(meter.record("s", 0, 4, 0, 7, longest=7)) == 7  # the prompt
    assert longest(meter.record("s", 0, 4, 1, 1, longest=8)) == 8
    assert longest(meter.record("s", 0, 4, 2, 1, longest=5)) == 8  # rolled back to 4
    assert longest(meter.record("s", 0, 4, 3, 1, longest=500)) == 10  # never past the count
    assert longest(meter.record("t", 4, 8, 0, 3)) == 0  # no prefix held
    meter.save()
    assert longest(UsageMeter(key, path=path).record("s", 0, 4, 4, 1, longest=6)) == 10
    path.write_text('[["old", 0, 4, 5, 0, 1, 2]]')  # a node of the release before
    assert longest(UsageMeter(key, path=path).record("old", 0, 4, 2, 1, longest=6)) == 6
    # A training node's micro-batches keep no prefix: its whole count is its longest.
    training = UsageMeter(key, whole_counts=True)
    assert longest(training.record("job", 0, 4, 1, 8)) == 8
    assert longest(training.record("job", 0, 4, 2, 8)) == 16


def test_a_count_that_cannot_be_saved_is_logged_and_the_node_goes_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    blocked = tmp_path / "file"
    blocked.write_text("")
    meter = UsageMeter(identity.generate_private_key(), path=blocked / "usage.json")
    meter.record("s", 0, 4, 0, 3)
    with caplog.at_level(logging.WARNING):
        save_usage(meter)  # its directory is a file: OSError, logged, not raised
    assert "could not keep the usage counts" in caplog.text


def test_only_the_most_recently_active_counts_are_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(receipts, "MAX_SAVED", 2)
    key = identity.generate_private_key()
    path = tmp_path / "usage.json"
    meter = UsageMeter(key, path=path)
    for session in ("a", "b", "c"):
        meter.record(session, 0, 4, 0, 1)
    meter.record("a", 0, 4, 1, 1)  # "a" is active again, "b" the oldest now
    meter.save()
    assert json.loads(path.read_text()) == [["c", 0, 4, 1, 0, 0, 0, 0], ["a", 0, 4, 2, 0, 1, 0, 0]]


def test_a_clients_ended_or_idle_sessions_left_unacknowledged_are_its_residue() -> None:
    """What a paid session left unacknowledged counts against its client's other sessions
    once it ended or idled RESIDUE_IDLE_S, and no more after RESIDUE_TTL_S (its hold can
    no longer be settled then)."""
    now = [0.0]
    key, client, other = (identity.generate_private_key() for _ in range(3))
    alice, bob = identity.public_key_bytes(client), identity.public_key_bytes(other)
    meter = UsageMeter(key, clock=lambda: now[0])

    def countersigned(signed: ledger_pb2.SignedUsage) -> ledger_pb2.SignedUsage:
        tokens = ledger_pb2.UsageReceipt.FromString(signed.receipt).tokens
        signature = client.sign(identity.usage_countersign_payload(signed.receipt, tokens))
        return ledger_pb2.SignedUsage(
            receipt=signed.receipt, node_signature=signed.node_signature,
            client_signature=signature, billed_tokens=tokens,
        )  # fmt: skip

    first = meter.record("s-1", 0, 4, 0, 7, alice)
    meter.record("s-1", 4, 8, 0, 3, alice)
    meter.record("s-free", 0, 4, 0, 50)  # a free session: nobody's residue
    meter.record("s-bob", 0, 4, 0, 40, bob)
    assert meter.residue(alice, "s-2") == 0, "s-1 is live"
    meter.forget("s-1")  # EndSession, with 10 positions unacknowledged
    assert meter.residue(alice, "s-2") == 10 and meter.residue(alice, "s-1") == 0
    assert meter.residue(bob, "s-3") == 0
    # Its last receipt on [0, 4) comes after the end: that range leaves the meter.
    meter.acknowledge("s-1", countersigned(first), alice)
    assert meter.residue(alice, "s-2") == 3
    assert meter.owed("s-1", 0, 4) == 0
    # A live session that idles counts too, until its work is too old to be paid.
    now[0] = receipts.RESIDUE_IDLE_S
    assert meter.residue(bob, "s-3") == 40 and meter.residue(bob, "s-bob") == 0
    now[0] = receipts.RESIDUE_TTL_S
    assert meter.residue(alice, "s-2") == 0 and meter.residue(bob, "s-3") == 0
    assert meter.owed("s-1", 4, 8) == 0, "the ended session's old counts were dropped"
    assert meter.owed("s-bob", 0, 4) == 40, "a live session's count stays"
