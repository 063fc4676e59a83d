"""The ledger's rules, one at a time, on a real SQLite file: bad amounts, spending past a
balance, idempotency, the challenge window, rejected work and slashing."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from coordinator.db import open_database
from coordinator.ledger import Ledger, LedgerError, NodeQuote, Usage, audit
from coordinator.ledger.amounts import INT64_MAX
from coordinator.ledger.book import FEE, SLASHED, client_account, operator_account

PRICES = {"n1": NodeQuote(1000, "op1"), "n2": NodeQuote(2000, "op2")}


class Clock:
    def __init__(self) -> None:
        self.ms = 1_000_000

    def __call__(self) -> int:
        return self.ms


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def ledger(tmp_path: Path, clock: Clock) -> Ledger:
    db = open_database(tmp_path / "coordinator.db")
    yield Ledger(db, challenge_window_ms=10_000, clock_ms=clock)
    assert audit(db).ok, audit(db).violations
    db.close()


def test_a_nonce_is_accepted_once_while_it_could_be_fresh_even_across_a_restart(
    tmp_path: Path, ledger: Ledger, clock: Clock
) -> None:
    assert ledger.first_use(b"n" * 16, keep_ms=600_000)
    assert not ledger.first_use(b"n" * 16, keep_ms=600_000)
    assert ledger.first_use(b"m" * 16, keep_ms=600_000)
    # A restarted coordinator reads the same file: the replay is still refused.
    clock.ms += 599_000
    again = open_database(tmp_path / "coordinator.db")
    assert not Ledger(again, clock_ms=clock).first_use(b"n" * 16, keep_ms=600_000)
    again.close()
    # Past the window the stamp of any request that used it is stale, so it is dropped.
    clock.ms += 2_000
    assert ledger.first_use(b"n" * 16, keep_ms=600_000)
    (kept,) = ledger.db.execute("SELECT COUNT(*) FROM ledger_request_nonces").fetchone()
    assert kept == 1


@pytest.mark.parametrize("amount", [0, -1, -(2**63), 2**63, 2**80, 1.5, True, "5", None])
def test_grants_refuse_amounts_that_are_not_positive_int64(ledger: Ledger, amount: object) -> None:
    with pytest.raises(LedgerError) as err:
        ledger.grant("calice", amount, "r1")  # type: ignore[arg-type]
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert ledger.balance(client_account("calice")) == 0


def test_a_balance_cannot_overflow(ledger: Ledger) -> None:
    ledger.grant("calice", INT64_MAX, "r1")
    with pytest.raises(LedgerError) as err:
        ledger.grant("calice", 1, "r2")
    assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert ledger.balance(client_account("calice")) == INT64_MAX


def test_a_retried_grant_mints_once_and_a_reused_id_is_refused(ledger: Ledger) -> None:
    assert ledger.grant("calice", 500, "r1") == 500
    assert ledger.grant("calice", 500, "r1") == 500
    with pytest.raises(LedgerError) as err:
        ledger.grant("calice", 900, "r1")
    assert err.value.code == grpc.StatusCode.ALREADY_EXISTS


def test_a_client_cannot_escrow_past_its_balance(ledger: Ledger) -> None:
    ledger.grant("calice", 100, "r1")
    with pytest.raises(LedgerError) as err:
        ledger.open_hold("s1", "calice", 101, PRICES, 10**15, b"k" * 32)
    assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "100 credit units available" in err.value.message
    ledger.open_hold("s2", "calice", 100, PRICES, 10**15, b"k" * 32)
    with pytest.raises(LedgerError):
        ledger.open_hold("s3", "calice", 1, PRICES, 10**15, b"k" * 32)
    assert ledger.client_balance("calice").escrowed == 100


def test_settlement_pays_receipts_refunds_the_rest_and_is_idempotent(ledger: Ledger) -> None:
    ledger.grant("calice", 10_000, "r1")
    ledger.open_hold("s1", "calice", 1_000, PRICES, 10**15, b"k" * 32)
    usages = [Usage("a", "n1", 0, 3, 100), Usage("b", "n2", 3, 6, 50)]
    result = ledger.settle("s1", usages)
    # 100 tokens x 3 layers x 1000/1k = 300; 50 x 3 x 2000/1k = 300
    assert (result.charged, result.refunded) == (600, 400)
    assert ledger.settle("s1", usages) == result
    assert ledger.settle("s1", []) == result, "a retry with other receipts changes nothing"
    assert ledger.client_balance("calice").available == 9_400
    assert ledger.earnings("n1").pending == 300 and ledger.earnings("n2").pending == 300


def test_usage_past_the_escrow_is_scaled_to_the_quote(ledger: Ledger) -> None:
    ledger.grant("calice", 10_000, "r1")
    ledger.open_hold("s1", "calice", 100, PRICES, 10**15, b"k" * 32)
    result = ledger.settle("s1", [Usage("a", "n1", 0, 3, 1000), Usage("b", "n2", 3, 6, 1000)])
    # Worth 3,000 and 6,000 at the quoted prices: each node gets its share of the 100 held,
    # rounded down (33 and 66), and the client gets back what rounding left.
    assert (result.charged, result.refunded) == (99, 1)
    assert ledger.earnings("n1").pending == 33 and ledger.earnings("n2").pending == 66


def test_settlement_refuses_unknown_nodes_duplicate_and_overflowing_receipts(
    ledger: Ledger,
) -> None:
    ledger.grant("calice", 10_000, "r1")
    ledger.open_hold("s1", "calice", 1_000, PRICES, 10**15, b"k" * 32)
    bad = [
        ([Usage("a", "n9", 0, 3, 10)], grpc.StatusCode.PERMISSION_DENIED),
        (
            [Usage("a", "n1", 0, 3, 10), Usage("a", "n1", 0, 3, 10)],
            grpc.StatusCode.INVALID_ARGUMENT,
        ),
        ([Usage("a", "n1", 0, 3, -5)], grpc.StatusCode.INVALID_ARGUMENT),
        ([Usage("a", "n1", 0, 3, 2**62)], grpc.StatusCode.INVALID_ARGUMENT),
    ]
    for usages, code in bad:
        with pytest.raises(LedgerError) as err:
            ledger.settle("s1", usages)
        assert err.value.code == code, usages
    assert ledger.client_balance("calice").escrowed == 1_000, "a refused close keeps the hold"


def test_a_receipt_is_paid_once_across_sessions(ledger: Ledger) -> None:
    ledger.grant("calice", 10_000, "r1")
    ledger.open_hold("s1", "calice", 1_000, PRICES, 10**15, b"k" * 32)
    ledger.open_hold("s2", "calice", 1_000, PRICES, 10**15, b"k" * 32)
    ledger.settle("s1", [Usage("same", "n1", 0, 3, 10)])
    with pytest.raises(LedgerError) as err:
        ledger.settle("s2", [Usage("same", "n1", 0, 3, 10)])
    assert err.value.code == grpc.StatusCode.ALREADY_EXISTS
    assert ledger.hold("s2")["state"] == "open"


def test_an_operator_cannot_release_early(ledger: Ledger, clock: Clock) -> None:
    ledger.grant("calice", 10_000, "r1")
    ledger.open_hold("s1", "calice", 1_000, PRICES, 10**15, b"k" * 32)
    ledger.settle("s1", [Usage("a", "n1", 0, 3, 100)])
    (earning_id,) = [r[0] for r in ledger.db.execute("SELECT id FROM ledger_earnings")]
    with pytest.raises(LedgerError) as err:
        ledger.release(earning_id)
    assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert ledger.release_due() == 0
    clock.ms += 10_000
    assert ledger.release_due() == 1
    assert ledger.balance(operator_account("op1")) == 300
    assert ledger.earnings("n1").released == 300


def test_rejected_work_is_refunded_and_never_released(ledger: Ledger, clock: Clock) -> None:
    ledger.grant("calice", 10_000, "r1")
    ledger.open_hold("s1", "calice", 1_000, PRICES, 10**15, b"k" * 32)
    ledger.settle("s1", [Usage("a", "n1", 0, 3, 100), Usage("b", "n2", 3, 6, 50)])
    assert ledger.work_rejected("n2", "s1", "output mismatch") == 300
    assert ledger.work_rejected("n2", "s1", "output mismatch") == 0
    clock.ms += 10_000
    ledger.release_due()
    assert ledger.earnings("n2").rejected == 300 and ledger.earnings("n2").released == 0
    assert ledger.client_balance("calice").available == 10_000 - 300


def test_work_rejected_before_settlement_is_not_paid(ledger: Ledger) -> None:
    ledger.grant("calice", 10_000, "r1")
    ledger.open_hold("s1", "calice", 1_000, PRICES, 10**15, b"k" * 32)
    ledger.work_rejected("n1", "s1", "canary failed")
    result = ledger.settle("s1", [Usage("a", "n1", 0, 3, 100), Usage("b", "n2", 3, 6, 50)])
    assert (result.charged, result.refunded) == (300, 700)
    assert ledger.earnings("n1").pending == 0


def test_fraud_slashes_pending_earnings_and_stake_once(ledger: Ledger, clock: Clock) -> None:
    ledger.grant("calice", 10_000, "r1")
    ledger.open_hold("s1", "calice", 1_000, PRICES, 10**15, b"k" * 32)
    ledger.settle("s1", [Usage("a", "n1", 0, 3, 100)])
    clock.ms += 10_000
    ledger.release_due()
    ledger.deposit_stake("op1", 200, "stake-1")
    ledger.open_hold("s2", "calice", 1_000, PRICES, 10**15, b"k" * 32)
    ledger.settle("s2", [Usage("b", "n1", 0, 3, 50)])
    assert ledger.fraud_proven("n1", "op1", "ev-1") == 150 + 200
    assert ledger.fraud_proven("n1", "op1", "ev-1") == 350
    assert ledger.balance(SLASHED) == 350
    assert ledger.earnings("n1").slashed == 150
    assert ledger.balance(operator_account("op1")) == 100, "released earnings stay"


def test_fees_go_to_the_fee_account(tmp_path: Path, clock: Clock) -> None:
    db = open_database(tmp_path / "fee.db")
    ledger = Ledger(db, challenge_window_ms=0, fee_bps=1000, clock_ms=clock)
    ledger.grant("calice", 10_000, "r1")
    ledger.open_hold("s1", "calice", 1_000, PRICES, 10**15, b"k" * 32)
    result = ledger.settle("s1", [Usage("a", "n1", 0, 3, 100)])
    assert result.fee == 30 and ledger.balance(FEE) == 30
    assert ledger.earnings("n1").pending == 270
    assert audit(db).ok


def test_holds_expire_back_to_the_client(ledger: Ledger, clock: Clock) -> None:
    ledger.grant("calice", 1_000, "r1")
    ledger.open_hold("s1", "calice", 600, PRICES, clock.ms + 5, b"k" * 32)
    clock.ms += 5
    assert ledger.expire_holds() == ["s1"]
    assert ledger.client_balance("calice").available == 1_000
    with pytest.raises(LedgerError) as err:
        ledger.settle("s1", [Usage("a", "n1", 0, 3, 100)])
    assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION


def test_audit_finds_a_tampered_balance(ledger: Ledger) -> None:
    ledger.grant("calice", 1_000, "r1")
    ledger.db.execute("UPDATE ledger_accounts SET balance = 5000 WHERE account = 'client:calice'")
    result = audit(ledger.db)
    assert not result.ok and any("client:calice" in v for v in result.violations)
    ledger.db.execute("UPDATE ledger_accounts SET balance = 1000 WHERE account = 'client:calice'")
