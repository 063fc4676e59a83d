"""Shortfall billing end to end (docs/ledger.md, "Shortfall"), with real processes: one
stage of the whole model on three priced nodes (`--min-stages 1 --replicas 3`), each
settling what it was acknowledged every 0.3 s.

- An honest client, whose calls the other two nodes check, pays exactly its primary's
  share: checks are not billed, and the rule finds nothing short.
- A client that sends the stage's work to an alternate, or to a checker (a replica left
  out of its route, priced too), and signs every receipt as a check, still pays for every
  position that node held: it closes at once with nothing to pay, and the node's own
  settlement bills the shortfall from its balance (within its quote: a checker may cost
  more than the route it was granted).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from support.market import (
    NEW_TOKENS,
    PRICES,
    PROMPT,
    audit_cli,
    bill_nothing,
    coordinator_rows,
    expected_shares,
    funded_client,
    generate,
    paid_by_node,
    serves,
    settling_market,
    wait_for,
)

from client.api import AsyncClient, Client
from client.local_swarm import LocalSwarm

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def market(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalSwarm]:
    one_stage = ("--min-stages", "1", "--replicas", "3")
    with settling_market(tmp_path_factory, layout=one_stage) as swarm:
        with Client(swarm.address) as client:  # every replica, so that calls are checked
            wait_for(lambda: sum(serves(client, n.node_id) for n in client.nodes()) == 3,
                     "all three nodes to load the model", timeout_s=60)  # fmt: skip
        yield swarm


def held(market: LocalSwarm, session_id: str) -> dict[str, int]:
    """Per node, the longest prefix its settled receipts held in the session."""
    return dict(coordinator_rows(
        market,
        "SELECT node_id, longest FROM ledger_usage_paid WHERE hold_id = ? AND longest > 0",
        [session_id],
    ))  # fmt: skip


def test_an_honest_client_pays_its_primary_and_nothing_for_checks(market):
    result = generate(market, funded_client(market, "honest"))
    assert not result.failovers and result.settlement is not None
    shares = expected_shares(market, result, nodes=1)
    assert result.settlement.charged == sum(shares.values())
    # New nodes are checked on every call: a checker held the prefix too, and settles its
    # receipts (billed 0) after the close. None of it is short.
    assert result.verification is not None and result.verification.checked
    wait_for(lambda: len(held(market, result.session_id)) >= 2,
             "a checker to settle its receipts", timeout_s=30)  # fmt: skip
    assert paid_by_node(market, result.session_id) == shares
    assert f"{result.session_id}: its receipts billed less" not in market.coordinator.log_text()


@pytest.mark.parametrize("elsewhere", ["alternates", "checkers"])
def test_work_sent_off_the_primary_and_billed_as_checks_is_paid_for(
    market, monkeypatch: pytest.MonkeyPatch, elsewhere: str
):
    opened = AsyncClient._call_stamped

    async def route_elsewhere(self, what, method, request):  # noqa: ANN001, ANN202
        grant = await opened(self, what, method, request)
        if what == "opening a session":
            for stage in grant.stages:
                spare = getattr(stage, elsewhere)
                assert spare, f"no {elsewhere} in {stage}"
                stage.primary.CopyFrom(spare[0])
                del stage.alternates[:], stage.checkers[:]  # nothing checks it either
        return grant

    monkeypatch.setattr(AsyncClient, "_call_stamped", route_elsewhere)
    bill_nothing(monkeypatch)
    # A cheap route keeps no alternate dearer than its primary: those replicas check it.
    prefer = "cheap" if elsewhere == "checkers" else ""
    result = generate(market, funded_client(market, elsewhere), prefer=prefer)
    assert not result.failovers and result.settlement is not None
    assert result.settlement.charged == 0, "its close carried nothing to pay"
    shares = expected_shares(market, result, nodes=1)
    if elsewhere == "checkers":
        # The quote is the cheap route's, and the checker costs more: the client pays its
        # whole quote, more than the route it was granted would have cost, never past it.
        (node_id, share), *_ = shares.items()
        honest = (len(PROMPT) + NEW_TOKENS - 1) * 6 * min(PRICES.values()) // 1000
        assert honest < result.quote < share
        shares = {node_id: result.quote}
    wait_for(lambda: paid_by_node(market, result.session_id) == shares,
             "the node's settlement to bill the shortfall", timeout_s=30)  # fmt: skip
    # The operator is told, in the coordinator's log.
    warned = f"{result.session_id}: its receipts billed less than the longest prefixes"
    assert warned in market.coordinator.log_text()
    audit = audit_cli(market)
    assert audit.returncode == 0 and "ledger OK" in audit.stdout, audit.stdout
