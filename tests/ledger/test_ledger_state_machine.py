"""A hypothesis state machine over the ledger: grants, session opens, receipts,
settlements, verification failures, fraud, releases and timeouts interleave at random.

After every step: total credit is conserved exactly (the model below tracks every unit),
no balance but the mint is negative, the escrow equals the holds of open sessions, and the
full audit finds nothing.
"""

from __future__ import annotations

import itertools
import shutil
import tempfile
from pathlib import Path

import hypothesis.strategies as st
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from coordinator.db import open_database
from coordinator.ledger import Ledger, LedgerError, NodeQuote, Usage, audit
from coordinator.ledger.book import ESCROW, MINT, client_account

CLIENTS = ("calice", "cbob")
NODES = {"n1": NodeQuote(1000, "op1"), "n2": NodeQuote(2500, "op2"), "n3": NodeQuote(0, "op1")}
WINDOW_MS = 1000
_dirs = itertools.count()


class LedgerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.tmp = Path(tempfile.mkdtemp(prefix="ledger-sm-"))
        self.db = open_database(self.tmp / f"l{next(_dirs)}.db")
        self.now = 1_000_000
        self.ledger = Ledger(
            self.db, challenge_window_ms=WINDOW_MS, fee_bps=250, clock_ms=lambda: self.now
        )
        self.minted = 0
        self.open: dict[str, int] = {}  # session -> escrow
        self.closed: set[str] = set()
        self.sessions = itertools.count()
        self.requests = itertools.count()

    def teardown(self) -> None:
        self.db.close()
        shutil.rmtree(self.tmp, ignore_errors=True)

    @rule(client=st.sampled_from(CLIENTS), amount=st.integers(1, 10_000), retry=st.booleans())
    def grant(self, client: str, amount: int, retry: bool) -> None:
        request = f"g{next(self.requests)}"
        self.ledger.grant(client, amount, request)
        if retry:  # a retried request never mints twice
            self.ledger.grant(client, amount, request)
        self.minted += amount

    @rule(client=st.sampled_from(CLIENTS), amount=st.integers(1, 5_000))
    def open_session(self, client: str, amount: int) -> None:
        session = f"s{next(self.sessions)}"
        before = self.ledger.balance(client_account(client))
        try:
            self.ledger.open_hold(session, client, amount, NODES, self.now + 5000, b"k" * 32)
        except LedgerError:
            assert before < amount, "a hold the balance covers was refused"
            assert self.ledger.balance(client_account(client)) == before
            return
        assert before >= amount
        self.open[session] = amount

    @precondition(lambda self: self.open)
    @rule(
        data=st.data(),
        tokens=st.lists(st.integers(0, 3_000), min_size=0, max_size=4),
    )
    def settle(self, data: st.DataObject, tokens: list[int]) -> None:
        session = data.draw(st.sampled_from(sorted(self.open)))
        nodes = sorted(NODES)
        usages = [Usage(f"{session}/{i}", nodes[i % 3], 0, 1 + i, t) for i, t in enumerate(tokens)]
        result = self.ledger.settle(session, usages)
        assert result.charged + result.refunded == self.open.pop(session)
        again = self.ledger.settle(session, usages)  # a retried close pays nothing twice
        assert again == result
        self.closed.add(session)

    @rule(node=st.sampled_from(sorted(NODES)), data=st.data())
    def reject_work(self, node: str, data: st.DataObject) -> None:
        sessions = sorted(self.closed | set(self.open)) or ["s-none"]
        self.ledger.work_rejected(node, data.draw(st.sampled_from(sessions)), "mismatch")

    @rule(node=st.sampled_from(sorted(NODES)), evidence=st.integers(0, 5))
    def fraud(self, node: str, evidence: int) -> None:
        self.ledger.fraud_proven(node, NODES[node].operator, f"ev{evidence}")

    @rule(ms=st.integers(0, 3_000))
    def time_passes(self, ms: int) -> None:
        self.now += ms
        self.ledger.release_due()
        for session in self.ledger.expire_holds():
            self.open.pop(session)

    @invariant()
    def conserved_and_consistent(self) -> None:
        result = audit(self.db)
        assert result.ok, result.violations
        assert result.minted == self.minted == -self.ledger.balance(MINT)
        assert self.ledger.balance(ESCROW) == sum(self.open.values())
        negative = self.db.execute(
            "SELECT account, balance FROM ledger_accounts WHERE balance < 0 AND account != 'mint'"
        ).fetchall()
        assert not negative


LedgerMachine.TestCase.settings = settings(
    max_examples=40,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestLedgerStateMachine = LedgerMachine.TestCase
