"""A cheating node in a real market: it claims ten times the tokens it computed, with its
real key. The client's driver refuses to counter-sign, so that node is not paid, the
client keeps that share, and the honest nodes are paid exactly."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from support.market import (
    audit_cli,
    balance_cli,
    expected_shares,
    funded_client,
    generate,
    make_market_checkpoint,
    paid_by_node,
    running_market,
)

from client.local_swarm import LocalSwarm

pytestmark = pytest.mark.slow

CHEATER = "bravo"


@pytest.fixture(scope="module")
def market(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalSwarm]:
    checkpoint = make_market_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny")
    scripts = {CHEATER: Path(__file__).with_name("inflating_node.py")}
    with running_market(tmp_path_factory.mktemp("market"), checkpoint, scripts) as swarm:
        yield swarm


def test_a_node_that_inflates_its_receipts_is_not_paid_and_the_client_keeps_its_share(market):
    key = funded_client(market)
    balance_before = int(balance_cli(market)["available"])
    result = generate(market, key)
    shares = expected_shares(market, result, nodes=3)
    cheater = next(p.node_id for p in market.processes if p.name == CHEATER)
    assert cheater in shares, "the route goes through the cheating node"
    honest = {n: s for n, s in shares.items() if n != cheater}
    assert result.settlement is not None
    assert result.settlement.charged == sum(honest.values())
    assert result.settlement.refunded == result.quote - sum(honest.values())
    assert int(balance_cli(market)["available"]) == balance_before - sum(honest.values())
    assert paid_by_node(market, result.session_id) == honest
    audit = audit_cli(market)
    assert audit.returncode == 0 and "ledger OK" in audit.stdout, audit.stdout
