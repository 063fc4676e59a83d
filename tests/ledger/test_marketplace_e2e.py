"""The marketplace end to end with real processes: a coordinator and three priced node
agents on loopback, credits granted with the admin CLI, generations paid from escrow by
receipts both sides signed, earnings released after the challenge window, and kill -9 of
the coordinator inside settlement (failpoints) with a restart on the same database.
"""

from __future__ import annotations

import json
import re
import sqlite3
from collections.abc import Iterator

import grpc
import pytest
from support.market import (
    GRANT,
    audit_cli,
    balance_cli,
    earnings_cli,
    expected_shares,
    funded_client,
    generate,
    kill_paying_client,
    make_market_checkpoint,
    paid_by_node,
    run_cli,
    running_market,
    wait_for,
)
from support.wrong_clock import set_clock_off

from client import cli as client_cli
from client.api import Client
from client.local_swarm import LocalSwarm
from coordinator.ledger.failpoints import ENV as FAILPOINT_ENV
from node_agent import cli as node_cli
from protos.tessera.v1 import ledger_pb2, ledger_pb2_grpc

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def market(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalSwarm]:
    checkpoint = make_market_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny")
    with running_market(tmp_path_factory.mktemp("market"), checkpoint) as swarm:
        yield swarm


@pytest.fixture(scope="module")
def client_key(market: LocalSwarm):
    return funded_client(market)


def test_a_paid_generation_moves_exactly_its_usage_to_the_operators(market, client_key):
    before = {p.node_id: earnings_cli(market, p.node_id) for p in market.processes if p.node_id}
    result = generate(market, client_key)
    shares = expected_shares(market, result, nodes=3)
    charged = sum(shares.values())
    settlement = result.settlement
    assert settlement is not None and result.quote > 0
    assert (settlement.escrowed, settlement.charged) == (result.quote, charged)
    assert settlement.refunded == result.quote - charged
    balance = balance_cli(market)
    assert (int(balance["available"]), int(balance["escrowed"])) == (GRANT - charged, 0)
    text = run_cli("client.cli", "balance", "--coordinator", market.address,
                   "--key", str(market.workdir / "client.key")).stdout  # fmt: skip
    assert text.splitlines() == [
        f"account   {balance['account']}",
        f"available {GRANT - charged} credit units",
        "escrowed  0 credit units (held for open sessions)",
    ]
    # Pending during the challenge window, then released to the operators, exactly.
    for node_id, share in shares.items():
        earned = earnings_cli(market, node_id)
        assert int(earned["pending"]) + int(earned["released"]) == share

    def released() -> bool:
        return all(int(earnings_cli(market, n)["released"]) == share for n, share in shares.items())

    wait_for(released, "earnings to be released after the window", 30)
    # What an operator reads without --json.
    node_id, share = next(iter(shares.items()))
    name = market.node(node_id).name
    text = run_cli("node_agent.cli", "earnings", "--coordinator", market.address,
                   "--data-dir", str(market.workdir / "nodes" / name)).stdout  # fmt: skip
    assert text.startswith(f"node {node_id} (operator account ")
    assert re.search(rf"^  released +{share} credit units$", text, re.MULTILINE), text
    for label in ("pending", "slashed", "rejected", "staked", "available"):
        assert re.search(rf"^  {label} +\d+ credit units$", text, re.MULTILINE), text
    assert all(int(e["released"]) == 0 for e in before.values()), "nothing paid before"
    audit = audit_cli(market)
    assert audit.returncode == 0 and "ledger OK" in audit.stdout, audit.stdout


def test_a_long_session_settles_periodically_then_closes_for_the_same_total(market, client_key):
    balance_before = int(balance_cli(market)["available"])
    result = generate(market, client_key, settle_every=3)
    shares = expected_shares(market, result, nodes=3)
    # Every 3 tokens the client sent its counter-signed receipts: the operators were paid
    # as the session went, the hold shrank, and the close paid only the rest.
    assert len(result.periodic) == 2
    charged = [p.charged for p in result.periodic]
    assert 0 < charged[0] < charged[1] < sum(shares.values())
    assert not any(p.closed for p in result.periodic)
    settlement = result.settlement
    assert settlement is not None and settlement.closed
    assert (settlement.charged, settlement.refunded) == (
        sum(shares.values()),
        result.quote - sum(shares.values()),
    )
    assert paid_by_node(market, result.session_id) == shares
    assert int(balance_cli(market)["available"]) == balance_before - sum(shares.values())
    # The final receipts replayed as a (late) settlement of the closed session pay nothing
    # twice.
    replay = ledger_pb2.SettleUsageRequest(
        session_id=result.session_id, usage=result.close_request.usage
    )
    with grpc.insecure_channel(market.address) as channel:
        again = ledger_pb2_grpc.LedgerStub(channel).SettleUsage(replay, timeout=30)
    assert (again.charged, again.refunded, again.closed) == (
        settlement.charged, settlement.refunded, True,
    )  # fmt: skip
    assert paid_by_node(market, result.session_id) == shares
    audit = audit_cli(market)
    assert audit.returncode == 0 and "ledger OK" in audit.stdout, audit.stdout


def test_a_client_and_an_operator_whose_clocks_are_hours_off_still_pay_and_read(
    market, client_key, monkeypatch, capsys
):
    """A PC whose clock is hours off (no network time, a dual-boot hardware clock): the
    coordinator refuses its signed requests' stamps as stale, with its own time in the
    refusal, and the next try is stamped by that time. Here the client and the CLIs run in
    this process, whose clock is set wrong; the coordinator's is right."""
    balance_before = int(balance_cli(market)["available"])
    set_clock_off(monkeypatch, 3 * 3600)
    result = generate(market, client_key)
    shares = expected_shares(market, result, nodes=3)
    assert result.settlement is not None
    assert result.settlement.charged == sum(shares.values())
    assert paid_by_node(market, result.session_id) == shares
    key_path = str(market.workdir / "client.key")
    assert client_cli.main(["balance", "--coordinator", market.address, "--key", key_path,
                            "--json"]) == 0  # fmt: skip
    balance = json.loads(capsys.readouterr().out)
    assert int(balance["available"]) == balance_before - result.settlement.charged
    # An operator's clock two hours behind reads what the right clock reads.
    set_clock_off(monkeypatch, -2 * 3600)
    node_id = next(iter(shares))
    name = market.node(node_id).name
    assert node_cli.main(["earnings", "--coordinator", market.address, "--data-dir",
                          str(market.workdir / "nodes" / name), "--json"]) == 0  # fmt: skip
    skewed, right = json.loads(capsys.readouterr().out), earnings_cli(market, node_id)
    assert (skewed["node_id"], skewed["account"]) == (right["node_id"], right["account"])

    def earned(reply: dict) -> int:  # pending turns into released meanwhile
        return int(reply["pending"]) + int(reply["released"])

    assert earned(skewed) == earned(right) >= shares[node_id]


@pytest.mark.parametrize("failpoint", ["settle:mid", "settle:before-commit", "settle:after-commit"])
def test_kill_9_inside_settlement_then_restart_pays_exactly_once(market, client_key, failpoint):
    address = market.address
    market.coordinator.kill9()
    with pytest.MonkeyPatch.context() as env:
        env.setenv(FAILPOINT_ENV, failpoint)
        market.start_coordinator(listen=address)
    balance_before = int(balance_cli(market)["available"])
    result = generate(market, client_key)
    # The close reached the failpoint: the coordinator died there, the client saw no answer.
    wait_for(lambda: not market.coordinator.alive(), "the coordinator to die at the failpoint", 30)
    assert market.coordinator.popen.returncode == -9
    assert result.settlement is None and result.close_request is not None
    # Offline audit of the database the dead process left behind.
    db_path = market.coordinator_dir / "coordinator.db"
    audit = audit_cli(market, "--db", str(db_path))
    assert audit.returncode == 0, audit.stdout
    with sqlite3.connect(db_path) as db:
        (state,) = db.execute(
            "SELECT state FROM ledger_holds WHERE hold_id = ?", [result.session_id]
        ).fetchone()
    assert state == ("settled" if failpoint == "settle:after-commit" else "open")

    market.start_coordinator(listen=address)
    # The restarts kept the 3-stage layout: a restarted coordinator starts from its saved
    # plans and waits for its nodes to re-attach, in whatever order, before it re-plans.
    shares = expected_shares(market, result, nodes=3)
    with Client(address, key=client_key) as client:
        settlement = client.settle(result)
        again = client.settle(result)
    assert settlement is not None and settlement == again
    assert settlement.charged == sum(shares.values())
    assert settlement.refunded == result.quote - settlement.charged
    balance = balance_cli(market)
    assert int(balance["available"]) == balance_before - settlement.charged
    assert int(balance["escrowed"]) == 0
    paid = paid_by_node(market, result.session_id)
    assert paid == shares, "each node paid its share exactly once"
    audit = audit_cli(market)
    assert audit.returncode == 0 and "ledger OK" in audit.stdout, audit.stdout


def test_a_paying_client_that_dies_before_its_close_has_paid_for_what_it_settled(
    market, client_key
):
    """Runs last: it leaves its session's hold open, as a dead client does, until it
    expires. Periodic settlement (on by default, every 256 tokens; every 3 here) paid the
    nodes for all the client's tokens up to its last settlement; before it, a client that
    died paid nothing at all."""
    session_id = kill_paying_client(market, settle_every=3)
    with sqlite3.connect(market.coordinator_dir / "coordinator.db") as db:
        amount, charged, state = db.execute(
            "SELECT amount, charged, state FROM ledger_holds WHERE hold_id = ?", [session_id]
        ).fetchone()
    assert state == "open" and 0 < charged < amount
    paid = paid_by_node(market, session_id)
    assert paid and all(share > 0 for share in paid.values()), paid  # each node of its route
    assert sum(paid.values()) == charged
    audit = audit_cli(market)
    assert audit.returncode == 0 and "ledger OK" in audit.stdout, audit.stdout
