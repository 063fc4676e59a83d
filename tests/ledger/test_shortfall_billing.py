"""Shortfall billing (coordinator/ledger/shortfall.py, docs/ledger.md "Shortfall"): on every
layer the client pays at least for the longest prefix any node held there, whatever its
receipts bill. The rule alone, then the ledger applying it at a close, at a late
settlement and at an expiry, on a real SQLite file (the audit runs after every test)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from support.ledger_book import audited_ledger

from coordinator.ledger import Ledger, NodeQuote, Usage
from coordinator.ledger.book import (
    ESCROW,
    client_account,
    pending_account,
)
from coordinator.ledger.shortfall import Held, shortfalls

# ---- the rule ---------------------------------------------------------------------------


def test_an_honest_session_is_never_short() -> None:
    # The primary billed every position it computed (replays included); the checker held
    # a prefix the pipeline computed first, and billed nothing.
    rows = [
        Held("primary", 0, 4, billed=30, counted=30, longest=28),
        Held("checker", 0, 4, billed=0, counted=40, longest=28),  # caught up twice
    ]
    assert shortfalls(rows) == {}


def test_work_sent_to_an_alternate_and_billed_as_checks_is_billed_to_it() -> None:
    rows = [
        Held("primary", 0, 4, billed=5, counted=5, longest=5),  # served the prompt only
        Held("alternate", 0, 4, billed=0, counted=28, longest=25),
        Held("checker", 0, 4, billed=0, counted=10, longest=10),
    ]
    # 25 positions held, 5 billed: 20 on each of 4 layers, to the longest prefix.
    assert shortfalls(rows) == {("alternate", 0, 4): 80}


def test_a_shortfall_goes_to_the_longest_prefixes_first_up_to_what_each_counted() -> None:
    rows = [
        Held("a", 0, 2, billed=0, counted=6, longest=6),
        Held("b", 0, 2, billed=1, counted=9, longest=9),
    ]
    # Held 9, billed 1: b takes 8 (all it counted unbilled); nothing is left for a.
    assert shortfalls(rows) == {("b", 0, 2): 16}
    rows = [
        Held("a", 0, 2, billed=0, counted=6, longest=6),
        Held("b", 0, 2, billed=7, counted=9, longest=9),
        Held("c", 0, 2, billed=0, counted=1, longest=0),
    ]
    # Held 9, billed 7: b has 2 unbilled, which covers it.
    assert shortfalls(rows) == {("b", 0, 2): 4}


def test_layer_ranges_that_do_not_line_up_are_billed_layer_by_layer() -> None:
    rows = [
        Held("merged", 0, 4, billed=10, counted=10, longest=10),  # two stages as one hop
        Held("x", 2, 6, billed=0, counted=10, longest=10),  # served [4, 6) unbilled
    ]
    # [2, 4) was billed by the merged hop; [4, 6) by nobody: 10 positions x 2 layers.
    assert shortfalls(rows) == {("x", 2, 6): 20}
    # A node's receipts without a prefix (training) are never short.
    assert shortfalls([Held("t", 0, 4, billed=0, counted=50, longest=0)]) == {}
    assert shortfalls([]) == {}


# ---- the ledger -------------------------------------------------------------------------

PRICES = {
    "primary": NodeQuote(1000, "op1"),
    "alternate": NodeQuote(2000, "op2"),
    "checker": NodeQuote(3000, "op3"),
}
QUOTE = 100_000


@pytest.fixture
def ledger(tmp_path: Path) -> Iterator[Ledger]:
    with audited_ledger(tmp_path / "coordinator.db", "calice", 1_000_000) as book:
        book.open_hold(
            "s1", "calice", QUOTE, PRICES, 10**9, b"k" * 32, primaries=[("primary", 0, 4)]
        )
        yield book


def usage(node: str, billed: int, counted: int, longest: int) -> Usage:
    return Usage(f"{node}/{counted}/{billed}", node, 0, 4, billed, counted, longest)


def test_a_close_bills_an_alternates_work_that_the_client_called_checks(ledger: Ledger) -> None:
    # The alternate's receipt billed nothing; it held 25 positions on 4 layers, and the
    # primary (billed in full, as ever) only 5. 20 x 4 x 2000 / 1000 = 160 to op2.
    closed = ledger.settle("s1", [usage("primary", 0, 5, 5), usage("alternate", 0, 28, 25)])
    assert closed.charged == 5 * 4 * 1000 // 1000 + 160 and closed.shortfall == 160
    assert closed.refunded == QUOTE - closed.charged
    assert ledger.balance(pending_account("op2")) == 160
    assert ledger.balance(client_account("calice")) == 1_000_000 - closed.charged


def test_an_honest_close_pays_exactly_what_its_receipts_bill(ledger: Ledger) -> None:
    closed = ledger.settle("s1", [usage("primary", 30, 30, 28), usage("checker", 0, 40, 28)])
    assert closed.charged == 30 * 4 * 1000 // 1000 and closed.shortfall == 0
    assert ledger.balance(pending_account("op3")) == 0


def test_receipts_the_nodes_settle_after_the_close_are_billed_late(ledger: Ledger) -> None:
    """The client closes at once with no receipt (refunded in full); the alternate then
    settles what the client acknowledged, billed 0: the shortfall comes from the client's
    balance. A replay of it adds nothing; a newer receipt adds its growth."""
    assert ledger.settle("s1", []).charged == 0
    late = ledger.settle_usage("s1", [usage("alternate", 0, 12, 12)])
    assert (late.charged, late.closed, late.shortfall) == (12 * 4 * 2, True, 96)
    assert ledger.balance(client_account("calice")) == 1_000_000 - 96
    assert ledger.settle_usage("s1", [usage("alternate", 0, 12, 12)]).charged == 96
    assert ledger.settle_usage("s1", [usage("alternate", 0, 20, 20)]).charged == 160
    assert ledger.balance(pending_account("op2")) == 160
    # Never past the quote: 25 x 4 x 2 = 200 due, 100 quoted.
    ledger.open_hold("s2", "calice", 100, PRICES, 10**9, b"k" * 32)
    ledger.settle("s2", [])
    capped = ledger.settle_usage("s2", [usage("alternate", 0, 28, 25)])
    assert (capped.charged, capped.refunded) == (100, 0)
    assert ledger.balance(client_account("calice")) == 1_000_000 - 160 - 100


def test_a_hold_that_expires_pays_the_shortfall_of_what_its_nodes_settled(
    ledger: Ledger,
) -> None:
    """A client that never closes: its nodes settled their receipts (billed 0) while the
    session was open, which paid nothing; the expiry bills the shortfall from the escrow
    and refunds the rest."""
    ledger.settle_usage("s1", [usage("alternate", 0, 20, 20), usage("checker", 0, 20, 20)])
    assert ledger.hold("s1")["charged"] == 0  # type: ignore[index]
    assert ledger.usage_settled("s1") == [], "their counts are kept, but nothing was settled"
    ledger.clock["ms"] = 10**10  # type: ignore[attr-defined]
    assert ledger.expire_holds() == ["s1"]
    # 20 positions held on 4 layers, none billed: to the alternate, whose id sorts first.
    hold = ledger.hold("s1")
    assert hold is not None and hold["state"] == "expired"
    assert (hold["charged"], hold["refunded"]) == (160, QUOTE - 160)
    assert ledger.balance(pending_account("op2")) == 160
    assert ledger.balance(pending_account("op3")) == 0
    assert ledger.balance(client_account("calice")) == 1_000_000 - 160
    assert ledger.balance(ESCROW) == 0
    assert ledger.expire_holds() == []


def test_a_shortfall_never_pays_rejected_work_nor_past_the_quote(ledger: Ledger) -> None:
    ledger.work_rejected("alternate", "s1", "wrong output")
    closed = ledger.settle("s1", [usage("alternate", 0, 28, 25)])
    assert closed.charged == 0 and ledger.balance(pending_account("op2")) == 0
    ledger.open_hold("s2", "calice", 100, PRICES, 10**9, b"k" * 32)
    capped = ledger.settle("s2", [usage("alternate", 0, 28, 25)])  # 200 due, 100 held
    assert (capped.charged, capped.refunded) == (100, 0)


def test_what_a_session_paid_before_the_upgrade_counts_as_billed(ledger: Ledger) -> None:
    """A session open across the coordinator's upgrade: its rows paid before counts were
    kept have counted = longest = 0 (the migration's defaults). What they billed still
    counts, so nothing is short."""
    ledger.settle_usage("s1", [usage("primary", 20, 20, 0)])
    ledger.db.execute("UPDATE ledger_usage_paid SET counted = 0, longest = 0")
    closed = ledger.settle("s1", [usage("alternate", 0, 20, 20)])  # it checked them all
    assert closed.charged == 20 * 4
    assert ledger.balance(pending_account("op2")) == 0
