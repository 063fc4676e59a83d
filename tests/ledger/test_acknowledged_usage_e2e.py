"""Acknowledgments end to end, with real processes: a coordinator that gives paid sessions
a credit of 4 token positions per node (`serve --usage-credit 4`) and three priced node
agents that settle what they were acknowledged every 0.3 s (docs/ledger.md,
"Acknowledgments").

- An honest paying client acknowledges as it goes: it is never refused, and pays exactly
  what it would without a credit.
- A client that withholds its receipts is refused once it owes a node its credit.
- A client that bills all its receipts as checks pays the stages' primaries in full.
- A paying client killed before it ever settles (no periodic settlement, no close) has
  still paid for what it acknowledged: the nodes settled it themselves.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator

import pytest
from support.market import (
    MODEL,
    NEW_TOKENS,
    PROMPT,
    audit_cli,
    available,
    bill_nothing,
    expected_shares,
    funded_client,
    generate,
    kill_paying_client,
    paid_by_node,
    price_of,
    settling_market,
    wait_for,
)

from client.api import AsyncClient, Client
from client.errors import TesseraError
from client.local_swarm import LocalSwarm

pytestmark = pytest.mark.slow

CREDIT = 4


@pytest.fixture(scope="module")
def market(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalSwarm]:
    with settling_market(
        tmp_path_factory, coordinator_args=("--usage-credit", str(CREDIT))
    ) as swarm:
        yield swarm


@pytest.fixture(scope="module")
def client_key(market: LocalSwarm):
    return funded_client(market)


def test_an_honest_client_acknowledges_as_it_goes_and_pays_exactly_its_usage(market, client_key):
    result = generate(market, client_key)
    assert len(result.token_ids) == NEW_TOKENS and not result.failovers, result.failovers
    assert result.settlement is not None and result.settlement.closed
    shares = expected_shares(market, result, nodes=3)
    assert paid_by_node(market, result.session_id) == shares  # no more, no less
    assert result.settlement.charged == sum(shares.values())


def test_a_client_that_withholds_its_receipts_is_refused_at_its_credit(
    market, client_key, monkeypatch: pytest.MonkeyPatch
):
    # The client library with its acknowledgments taken out, as a freeloader would run it.
    # Its own account: the nodes then serve that account nothing more (the session's
    # residue, below).
    monkeypatch.setattr(AsyncClient, "_hold_to_credit", lambda *_: None)
    got: list[int] = []
    freeloader = funded_client(market, "freeloader")
    with Client(market.address, key=freeloader, settle_every=0) as client:
        wait_for(lambda: available(client), "the model to be served")
        with pytest.raises(TesseraError) as refused:
            for token in client.generate(
                MODEL, token_ids=PROMPT, max_new_tokens=NEW_TOKENS, stop_at_eos=False
            ):
                got.append(token.id)
        result = client.last_run
    # The prompt's 7 positions are more than the credit: its first token, and no more. The
    # node refused the next call; no other node serves its layers.
    assert len(got) <= 1, got
    assert "that the client has not acknowledged" in str(refused.value), refused.value
    assert "FAILED_PRECONDITION" in str(refused.value)
    assert result is not None and len(result.token_ids) <= 1
    # Nor does it get the credit again in a new session: the one it left unacknowledged
    # ended, and counts against its next ones on that node. Other clients are served.
    with Client(market.address, key=freeloader, settle_every=0) as client:
        with pytest.raises(TesseraError) as again:
            for token in client.generate(MODEL, token_ids=PROMPT, max_new_tokens=NEW_TOKENS):
                got.append(token.id)
    assert "other sessions on this node ended or idled" in str(again.value), again.value
    assert len(got) <= 1, got


@pytest.mark.parametrize("close", ["never", "at-once"])
def test_a_client_that_bills_everything_as_checks_still_pays_the_stages_primaries(
    market, client_key, monkeypatch: pytest.MonkeyPatch, close: str
):
    """A client that acknowledges its receipts but bills nothing on them ("those were all
    checks"), and never closes, or closes at once (its close carries no receipt and
    refunds the whole escrow, before the nodes settle): the nodes settle what it
    acknowledged, after its close from its balance, and the ledger bills each stage's
    primary at open its whole count, which the client signed (its stage's checks ran
    elsewhere). Every node of the route here is a primary: each is paid for every
    position of the generation it acknowledged."""

    async def never_closes(self, request):  # noqa: ANN001, ANN202
        return None

    bill_nothing(monkeypatch)
    if close == "never":
        monkeypatch.setattr(AsyncClient, "_end_session", never_closes)
    result = generate(market, client_key)
    assert len(result.token_ids) == NEW_TOKENS and not result.failovers
    if close == "at-once":
        assert result.settlement is not None and result.settlement.closed
    shares = expected_shares(market, result, nodes=3)  # every position, every stage
    wait_for(lambda: paid_by_node(market, result.session_id) == shares,
             "the nodes' settlements to bill the primaries in full", timeout_s=30)  # fmt: skip


def test_a_client_killed_before_it_settles_has_paid_what_it_acknowledged(market, client_key):
    """Without the nodes' own settlement this client would have paid nothing: it never
    sent a receipt to the coordinator (test_marketplace_e2e's dying client settles
    periodically). Each node of its route is paid at least for all but its credit's worth
    of the 13 positions it ran (7 prompt, 6 fed back)."""
    session_id = kill_paying_client(market, settle_every=0)
    positions = len(PROMPT) + 6
    layers = 2  # three stages of the 6-layer model

    def settled_by_nodes() -> dict[str, int] | None:
        paid = paid_by_node(market, session_id)
        floor = {n: (positions - CREDIT) * layers * price_of(market, n) // 1000 for n in paid}
        return paid if len(paid) == 3 and all(paid[n] >= floor[n] for n in paid) else None

    wait_for(settled_by_nodes, "the nodes to settle the acknowledged receipts", timeout_s=30)
    paid = paid_by_node(market, session_id)
    for node_id, share in paid.items():  # and never more than the positions it ran
        assert share <= positions * layers * price_of(market, node_id) // 1000
    with sqlite3.connect(market.coordinator_dir / "coordinator.db") as db:
        amount, charged, state = db.execute(
            "SELECT amount, charged, state FROM ledger_holds WHERE hold_id = ?", [session_id]
        ).fetchone()
    assert state == "open" and charged == sum(paid.values()) and charged < amount
    audit = audit_cli(market)
    assert audit.returncode == 0 and "ledger OK" in audit.stdout, audit.stdout
