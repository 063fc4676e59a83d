"""Periodic settlement of long sessions from cumulative receipts, and how verification
outcomes interleave with it: rejection before or after a settlement, a conviction before
a session closes, stakes. On a real SQLite file; the audit runs after every test."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from support.ledger_book import audited_ledger

from coordinator.ledger import Ledger, LedgerError, NodeQuote, Usage
from coordinator.ledger.book import (
    ESCROW,
    LATE_SETTLEMENT_MS,
    SLASHED,
    client_account,
    operator_account,
    pending_account,
    stake_account,
)

PRICES = {"n1": NodeQuote(1000, "op1"), "n2": NodeQuote(2000, "op2")}
QUOTE = 10_000


@pytest.fixture
def ledger(tmp_path: Path) -> Iterator[Ledger]:
    with audited_ledger(tmp_path / "coordinator.db", "calice", 100_000) as book:
        book.open_hold("s1", "calice", QUOTE, PRICES, 10**15, b"k" * 32)
        yield book


def receipt(node: str, tokens: int, layers: tuple[int, int] = (0, 3)) -> Usage:
    return Usage(f"{node}/{layers}/{tokens}", node, layers[0], layers[1], tokens)


def test_periodic_settlements_pay_what_each_cumulative_receipt_adds(ledger: Ledger) -> None:
    first = ledger.settle_usage("s1", [receipt("n1", 100), receipt("n2", 50)])  # 300 + 300
    assert (first.charged, first.refunded, first.closed) == (600, 0, False)
    assert ledger.client_balance("calice").escrowed == QUOTE - 600, "the hold shrinks"
    second = ledger.settle_usage("s1", [receipt("n1", 300), receipt("n2", 50)])  # +600
    assert second.charged == 1200
    assert ledger.balance(pending_account("op1")) == 900
    assert ledger.balance(pending_account("op2")) == 300
    assert ledger.balance(ESCROW) == QUOTE - 1200
    final = ledger.settle("s1", [receipt("n1", 400), receipt("n2", 50)])  # +300
    assert (final.charged, final.refunded, final.closed) == (1500, QUOTE - 1500, True)
    assert ledger.balance(client_account("calice")) == 100_000 - 1500
    assert ledger.balance(ESCROW) == 0


def test_a_replayed_older_periodic_receipt_pays_nothing(ledger: Ledger) -> None:
    old, new = receipt("n1", 100), receipt("n1", 200)
    ledger.settle_usage("s1", [old])
    ledger.settle_usage("s1", [new])
    for replay in ([old], [new], [old, receipt("n2", 0)]):
        again = ledger.settle_usage("s1", replay)
        assert again.charged == 600, "a replay moved credit"
    assert ledger.balance(pending_account("op1")) == 600
    # At close too: the old receipt adds nothing, the refund is the rest of the escrow.
    final = ledger.settle("s1", [old])
    assert (final.charged, final.refunded) == (600, QUOTE - 600)


def test_periodic_settlement_never_pays_past_the_escrow(ledger: Ledger) -> None:
    ledger.settle_usage("s1", [receipt("n1", 2000)])  # 6000 of 10000
    capped = ledger.settle_usage("s1", [receipt("n1", 3000), receipt("n2", 1000)])  # +3000 +6000
    assert capped.charged <= QUOTE
    assert ledger.balance(ESCROW) == QUOTE - capped.charged
    final = ledger.settle("s1", [receipt("n1", 5000), receipt("n2", 2000)])
    assert final.charged <= QUOTE and final.charged + final.refunded == QUOTE


def test_periodic_settlement_refuses_unknown_hostile_and_too_late_input(
    ledger: Ledger,
) -> None:
    for usages, code in (
        ([receipt("n-stranger", 10)], grpc.StatusCode.PERMISSION_DENIED),
        ([receipt("n1", 10), receipt("n1", 10)], grpc.StatusCode.INVALID_ARGUMENT),
        ([receipt("n1", -5)], grpc.StatusCode.INVALID_ARGUMENT),
        ([receipt("n1", 2**63)], grpc.StatusCode.INVALID_ARGUMENT),
    ):
        with pytest.raises(LedgerError) as err:
            ledger.settle_usage("s1", usages)
        assert err.value.code == code
    assert ledger.balance(ESCROW) == QUOTE, "a refused settlement moved nothing"
    with pytest.raises(LedgerError) as err:
        ledger.settle_usage("nope", [receipt("n1", 10)])
    assert err.value.code == grpc.StatusCode.NOT_FOUND
    ledger.settle("s1", [receipt("n1", 10)])
    ledger.open_hold("s2", "calice", 500, PRICES, 0, b"k" * 32)
    ledger.expire_holds()
    # Late settlement is taken for LATE_SETTLEMENT_MS after a hold closed, then no more.
    ledger.clock["ms"] += LATE_SETTLEMENT_MS + 1  # type: ignore[attr-defined]
    for hold_id in ("s1", "s2"):
        with pytest.raises(LedgerError) as err:
            ledger.settle_usage(hold_id, [receipt("n1", 20)])
        assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert "no longer be settled" in err.value.message


def test_a_closed_or_expired_hold_pays_late_receipts_from_the_clients_balance(
    ledger: Ledger,
) -> None:
    """A node's own settlement of receipts the client acknowledged may arrive after the
    client's close: they are paid from the client's balance, within the quote."""
    ledger.settle_usage("s1", [receipt("n1", 100)])  # 300
    final = ledger.settle("s1", [receipt("n1", 100)])  # closed at once, refunded 9700
    assert (final.charged, final.refunded) == (300, QUOTE - 300)
    late = ledger.settle_usage("s1", [receipt("n1", 300), receipt("n2", 50)])  # +600 +300
    assert (late.charged, late.refunded, late.closed) == (1200, QUOTE - 1200, True)
    assert ledger.balance(client_account("calice")) == 100_000 - 1200
    assert ledger.balance(pending_account("op1")) == 900
    assert ledger.balance(pending_account("op2")) == 300
    assert ledger.balance(ESCROW) == 0, "the escrow was refunded at close; it is not touched"
    # A replay pays nothing twice; a newer receipt never pays past the quote.
    assert ledger.settle_usage("s1", [receipt("n1", 300)]).charged == 1200
    capped = ledger.settle_usage("s1", [receipt("n1", 10_000)])
    assert (capped.charged, capped.refunded) == (QUOTE, 0)
    # An expired hold likewise, and never past what the client has: it spent the rest.
    ledger.open_hold("s2", "calice", QUOTE, PRICES, 0, b"k" * 32)
    ledger.expire_holds()
    spent = ledger.balance(client_account("calice")) - 150
    ledger.open_hold("elsewhere", "calice", spent, PRICES, 10**15, b"k" * 32)
    assert ledger.balance(client_account("calice")) == 150
    short = ledger.settle_usage("s2", [receipt("n1", 101)])  # 303 due, 150 left
    assert (short.charged, short.refunded) == (150, QUOTE - 150)
    assert ledger.balance(client_account("calice")) == 0
    # What could not be paid is not paid later either (as under the escrow's cap).
    ledger.grant("calice", 1000, "g2")
    assert ledger.settle_usage("s2", [receipt("n1", 101)]).charged == 150


def test_an_expired_hold_refunds_only_what_periodic_settlement_left(ledger: Ledger) -> None:
    ledger.settle_usage("s1", [receipt("n1", 1000)])  # 3000
    ledger.clock["ms"] = 10**16  # type: ignore[attr-defined]
    assert ledger.expire_holds() == ["s1"]
    assert ledger.balance(client_account("calice")) == 100_000 - 3000
    assert ledger.balance(pending_account("op1")) == 3000


def test_rejection_before_settlement_refunds_and_after_claws_back_pending(ledger: Ledger) -> None:
    # Before: n2's work in s1 is rejected first; no settlement pays it, periodic or final.
    assert ledger.work_rejected("n2", "s1", "mismatch") == 0
    ledger.settle_usage("s1", [receipt("n1", 100), receipt("n2", 100)])
    assert ledger.balance(pending_account("op2")) == 0
    # After: n1 was paid periodically, then rejected: its pending share goes back.
    assert ledger.work_rejected("n1", "s1", "mismatch") == 300
    assert ledger.balance(pending_account("op1")) == 0
    final = ledger.settle("s1", [receipt("n1", 200), receipt("n2", 200)])
    assert (final.charged, final.refunded) == (300, QUOTE - 300)
    # The 300 charged came back through the rejection: the client paid nothing.
    assert ledger.balance(client_account("calice")) == 100_000


def test_a_convicted_node_is_not_paid_for_sessions_settled_later(ledger: Ledger) -> None:
    ledger.open_hold("s2", "calice", QUOTE, PRICES, 10**15, b"k" * 32)
    ledger.settle("s2", [receipt("n1", 100)])  # 300 pending for op1
    assert ledger.fraud_proven("n1", "op1", "ev-1") == 300
    final = ledger.settle("s1", [receipt("n1", 100), receipt("n2", 100)])
    assert final.charged == 600, "only n2 is paid"
    assert ledger.balance(pending_account("op1")) == 0
    assert ledger.balance(SLASHED) == 300


def test_a_stake_comes_from_released_earnings_and_fraud_takes_it(ledger: Ledger) -> None:
    ledger.settle("s1", [receipt("n1", 1000)])  # 3000 pending
    with pytest.raises(LedgerError) as err:
        ledger.deposit_stake("op1", 1000, "st1")  # nothing released yet
    assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION
    ledger.clock["ms"] += 10_000  # type: ignore[attr-defined]
    ledger.release_due()
    ledger.deposit_stake("op1", 1000, "st1")
    ledger.deposit_stake("op1", 1000, "st1")  # a retry stakes once
    with pytest.raises(LedgerError) as err:
        ledger.deposit_stake("op1", 5, "st1")
    assert err.value.code == grpc.StatusCode.ALREADY_EXISTS
    assert (ledger.balance(stake_account("op1")), ledger.balance(operator_account("op1"))) == (
        1000,
        2000,
    )
    ledger.open_hold("s2", "calice", QUOTE, PRICES, 10**15, b"k" * 32)
    ledger.settle_usage("s2", [receipt("n1", 100)])  # 300 pending
    assert ledger.fraud_proven("n1", "op1", "ev-1") == 1300
    assert ledger.fraud_proven("n1", "op1", "ev-1") == 1300, "once per evidence"
    assert ledger.balance(stake_account("op1")) == 0
    assert ledger.balance(SLASHED) == 1300
    assert ledger.balance(operator_account("op1")) == 2000, "released earnings stay"


def test_an_old_receipt_replayed_beside_new_work_does_not_reopen_its_key(ledger: Ledger) -> None:
    old, new = receipt("n1", 100), receipt("n1", 200)
    ledger.settle_usage("s1", [old])
    ledger.settle_usage("s1", [new])  # 600 so far
    ledger.settle_usage("s1", [old, receipt("n2", 10)])  # + 60 for n2 only
    again = ledger.settle_usage("s1", [new, receipt("n2", 10)])
    assert again.charged == 660, "the newest receipt was paid twice"


def test_a_training_job_can_hold_and_settle_per_sample_layer(ledger: Ledger) -> None:
    # How training will be wired: a "job:" hold, prices per sample-layer x 1000, samples
    # counted as tokens, paid periodically while the job runs.
    per_sample_layer = {"n1": NodeQuote(7 * 1000, "op1")}
    ledger.open_hold("job:j1", "calice", 5_000, per_sample_layer, 10**15, b"k" * 32)
    step = ledger.settle_usage("job:j1", [Usage("j1/a/10", "n1", 0, 4, 10)])  # 10 x 4 x 7
    assert step.charged == 280
    final = ledger.settle("job:j1", [Usage("j1/a/30", "n1", 0, 4, 30)])
    assert (final.charged, final.refunded) == (840, 5_000 - 840)
