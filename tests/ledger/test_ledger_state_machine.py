"""A hypothesis state machine over the ledger: grants, session opens, receipts, periodic
and final settlements (with replays of older receipts), verification failures before and
after settlement, fraud, stakes, releases and timeouts interleave at random.

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
from coordinator.ledger.book import ESCROW, MINT, client_account, operator_account

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
        self.open: dict[str, int] = {}  # session -> escrow left (the hold shrinks)
        self.quoted: dict[str, int] = {}  # session -> escrow at open
        self.closed: set[str] = set()
        self.refunded: dict[str, int] = {}  # closed session -> what is left of its quote
        # Cumulative receipts sent so far per session, oldest first, for replays.
        self.receipts: dict[str, list[Usage]] = {}
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
        self.open[session] = self.quoted[session] = amount
        self.receipts[session] = []

    def _usages(self, session: str, added: list[int]) -> list[Usage]:
        """Cumulative receipts: each (node, layers) key has at least its last tokens."""
        last = {(u.node_id, u.layer_end): u.tokens for u in self.receipts[session]}
        nodes = sorted(NODES)
        usages = []
        for i, more in enumerate(added):
            node, end = nodes[i % 3], 1 + i
            tokens = last.get((node, end), 0) + more
            usages.append(Usage(f"{session}/{i}/{tokens}", node, 0, end, tokens))
        self.receipts[session] += usages
        return usages

    @precondition(lambda self: self.open)
    @rule(data=st.data(), added=st.lists(st.integers(0, 200), min_size=0, max_size=4))
    def settle_periodically(self, data: st.DataObject, added: list[int]) -> None:
        session = data.draw(st.sampled_from(sorted(self.open)))
        result = self.ledger.settle_usage(session, self._usages(session, added))
        assert not result.closed and result.refunded == 0
        assert result.charged <= self.quoted[session], "charged past the quote"
        self.open[session] = self.quoted[session] - result.charged

    @precondition(lambda self: any(self.receipts[s] for s in self.open))
    @rule(data=st.data())
    def replay_an_older_receipt(self, data: st.DataObject) -> None:
        session = data.draw(st.sampled_from(sorted(s for s in self.open if self.receipts[s])))
        newest = {(u.node_id, u.layer_end): u for u in self.receipts[session]}
        stale = [u for u in self.receipts[session] if u not in newest.values()]
        old = data.draw(st.sampled_from(stale or self.receipts[session]))
        before = self.ledger.balance(ESCROW)
        result = self.ledger.settle_usage(session, [old])  # cumulative: adds nothing
        assert self.ledger.balance(ESCROW) == before
        assert result.charged == self.quoted[session] - self.open[session]
        # With new work of another (node, layers) in the same settlement, it still adds
        # nothing (the new receipt is paid, the old one is not paid again).
        tokens = 1 + sum(1 for u in self.receipts[session] if u.layer_start == 5)
        fresh = Usage(f"{session}/fresh/{tokens}", "n2", 5, 6, tokens)
        self.receipts[session].append(fresh)
        result = self.ledger.settle_usage(session, [old, fresh])
        self.open[session] = self.quoted[session] - result.charged
        before = self.ledger.balance(ESCROW)
        # ... and the newest receipts, sent again after it, add nothing either.
        newest = {(u.node_id, u.layer_end): u for u in self.receipts[session]}
        self.ledger.settle_usage(session, list(newest.values()))
        assert self.ledger.balance(ESCROW) == before, "a replay made a receipt pay twice"

    @precondition(lambda self: self.open)
    @rule(data=st.data(), added=st.lists(st.integers(0, 3_000), min_size=0, max_size=4))
    def settle(self, data: st.DataObject, added: list[int]) -> None:
        session = data.draw(st.sampled_from(sorted(self.open)))
        usages = self._usages(session, added)
        result = self.ledger.settle(session, usages)
        assert result.closed and result.charged + result.refunded == self.quoted[session]
        again = self.ledger.settle(session, usages)  # a retried close pays nothing twice
        assert again == result
        del self.open[session]
        self.closed.add(session)
        self.refunded[session] = result.refunded
        if result.refunded and data.draw(st.booleans()):  # a node's settlement right after
            self._settle_late(
                session, data.draw(st.lists(st.integers(0, 200), min_size=1, max_size=4))
            )

    @precondition(lambda self: any(self.refunded.values()))
    @rule(data=st.data(), added=st.lists(st.integers(0, 200), min_size=1, max_size=4))
    def settle_late(self, data: st.DataObject, added: list[int]) -> None:
        """A node's settlement after the close (or the expiry): paid from the client's
        balance, never past the quote or below a zero balance (the invariants)."""
        session = data.draw(st.sampled_from(sorted(s for s, r in self.refunded.items() if r)))
        self._settle_late(session, added)

    def _settle_late(self, session: str, added: list[int]) -> None:
        result = self.ledger.settle_usage(session, self._usages(session, added))
        assert result.closed and result.charged + result.refunded == self.quoted[session]
        assert result.refunded <= self.refunded[session], "a late settlement refunded"
        self.refunded[session] = result.refunded

    # Verification outcomes land before, between or after settlements of the session.
    @rule(node=st.sampled_from(sorted(NODES)), data=st.data())
    def reject_work(self, node: str, data: st.DataObject) -> None:
        sessions = sorted(self.closed | set(self.open)) or ["s-none"]
        self.ledger.work_rejected(node, data.draw(st.sampled_from(sessions)), "mismatch")

    @rule(node=st.sampled_from(sorted(NODES)), evidence=st.integers(0, 5))
    def fraud(self, node: str, evidence: int) -> None:
        self.ledger.fraud_proven(node, NODES[node].operator, f"ev{evidence}")

    @rule(operator=st.sampled_from(["op1", "op2"]), amount=st.integers(1, 3_000))
    def stake(self, operator: str, amount: int) -> None:
        released = self.ledger.balance(operator_account(operator))
        try:
            self.ledger.deposit_stake(operator, amount, f"st{next(self.requests)}")
        except LedgerError:
            assert released < amount, "a stake the released earnings cover was refused"
            return
        assert self.ledger.balance(operator_account(operator)) == released - amount

    @rule(ms=st.integers(0, 3_000))
    def time_passes(self, ms: int) -> None:
        self.now += ms
        self.ledger.release_due()
        for session in self.ledger.expire_holds():
            self.refunded[session] = self.open.pop(session)
            self.closed.add(session)

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
