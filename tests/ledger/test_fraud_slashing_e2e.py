"""A node that computes WRONG outputs, in a real priced market: three node agents each
serving the whole model, every output checked (warm-up), canaries off. Bravo is the
cheapest and the client prefers cheap routes (so it is the primary); it works honestly
for two sessions (it earns, stakes part of its released earnings, and has earnings
pending), then turns bad with the real
TESSERA_FAILPOINTS=corrupt=1.0. The driver's check disagrees, the coordinator's arbiter
(the third operator's node) proves the fraud, and the ledger:

- slashes bravo's pending earnings and its whole stake;
- does not pay bravo's receipt of the bad session (the client keeps that share);
- pays the honest node that took over its receipt (replays included; the escrow of a
  cheap route caps it) after the challenge window; checks and arbitration are
  verification work, never billed;
- and `tessera-coordinator ledger audit` passes.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.market import (
    GRANT,
    NEW_TOKENS,
    PROMPT,
    audit_cli,
    balance_cli,
    earnings_cli,
    funded_client,
    generate,
    idle,
    make_market_checkpoint,
    paid_by_node,
    running_market,
    serves,
    stake_cli,
    wait_for,
)

from client.api import Client
from client.local_swarm import LocalSwarm
from node_agent.failpoints import ENV_VAR
from protos.tessera.v1 import ledger_pb2, verification_pb2

pytestmark = pytest.mark.slow

CHEATER = "bravo"
WINDOW_S = 12.0  # the second session's earnings are pending at the fraud (1.5 s after it here)
LAYERS = 6
TOKENS = len(PROMPT) + NEW_TOKENS - 1  # what one primary computes for one generation
STAKE = 150
# Bravo undercuts everyone and the client prefers cheap routes, so bravo is the primary (a
# cheater wants work). Claiming a faster benchmark would not do: measured traffic replaces
# a claim (tests/e2e/test_measured_speed_e2e.py). The dearer nodes are not billed
# alternates of a cheap route, but they are still granted as its checkers.
PRICES = {"alpha": 3000, "bravo": 2500, "charlie": 4000}


@pytest.fixture(scope="module")
def market(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalSwarm]:
    checkpoint = make_market_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny")
    work = tmp_path_factory.mktemp("market")
    env = {CHEATER: {ENV_VAR: "corrupt=1.0,seed=5",
                     "TESSERA_TEST_CHEAT_TRIGGER": str(work / "cheat-now")}}  # fmt: skip
    scripts = {CHEATER: Path(__file__).with_name("turncoat_node.py")}
    with running_market(
        work, checkpoint, scripts,
        layout=("--min-stages", "1", "--replicas", "3"), window_s=WINDOW_S,
        coordinator_args=("--verify-warmup", "100000", "--canary-interval", "0"),
        node_env=env, prices=PRICES,
    ) as swarm:  # fmt: skip
        yield swarm


def wait_until_idle(market: LocalSwarm) -> None:
    # The route is cheapest first only while no node carries load from the last session.
    with Client(market.address) as client:
        wait_for(lambda: idle(client), "every node's heartbeat to report no session")


def charge(name: str, tokens: int = TOKENS) -> int:
    return tokens * LAYERS * PRICES[name] // 1000


def test_a_node_proven_wrong_is_slashed_and_the_client_refunded(market: LocalSwarm) -> None:
    key = funded_client(market)
    names = {p.node_id: p.name for p in market.processes if p.node_id}
    cheater = next(n for n, name in names.items() if name == CHEATER)
    honest_share = charge(CHEATER)

    # Every node serves the model before the first session, so the route (cheapest first)
    # and its checkers (the dearer replicas) are the same for every session.
    with Client(market.address) as client:
        for node_id in names:
            wait_for(lambda n=node_id: serves(client, n), f"{names[node_id]} to serve the model")

    # 1. Bravo honest: it is the primary, checked on every call, paid its receipt.
    first = generate(market, key, prefer="cheap")
    assert [h.node_id for h in first.route] == [cheater] and not first.failovers
    assert first.verification is not None and sum(first.verification.checked.values()) > 0
    assert first.settlement is not None and first.settlement.charged == honest_share
    wait_for(lambda: int(earnings_cli(market, cheater)["released"]) == honest_share,
             "bravo's first earnings to be released", 60)  # fmt: skip
    staked = stake_cli(market, cheater, STAKE, "stake-1")
    again = stake_cli(market, cheater, STAKE, "stake-1")  # a retried deposit stakes once
    assert int(staked["staked"]) == int(again["staked"]) == STAKE
    assert int(again["available"]) == honest_share - STAKE

    # 2. Still honest: these earnings are pending when it turns bad.
    wait_until_idle(market)
    second = generate(market, key, prefer="cheap")
    assert [h.node_id for h in second.route] == [cheater]
    assert second.settlement is not None and second.settlement.charged == honest_share
    assert int(earnings_cli(market, cheater)["pending"]) == honest_share

    # 3. Bravo now signs wrong outputs. Its first one is checked, arbitrated, convicted.
    (market.workdir / "cheat-now").touch()
    balance_before = int(balance_cli(market)["available"])
    wait_until_idle(market)
    bad = generate(market, key, prefer="cheap")
    assert [h.node_id for h in bad.initial_route] == [cheater]
    assert bad.verification is not None
    outcomes = [v.outcome for v in bad.verification.verdicts]
    assert verification_pb2.Verdict.PRIMARY_WRONG in outcomes, outcomes
    assert len(bad.failovers) == 1 and bad.failovers[0].failed_node_id == cheater
    [hop] = bad.route
    taker = names[hop.node_id]
    assert taker != CHEATER
    # The close carried bravo's receipt of the bad prefill, counter-signed: it is refused
    # by the ledger (rejected work), so the client pays only the honest node. Checks are
    # deferred: bravo may have run decode steps past its prefill before the conviction
    # came in (the rollback discarded them); the client sent those, so they are counted.
    [rollback] = bad.rollbacks
    assert (rollback.position, rollback.rejected_node_id) == (0, cheater)
    receipts = {
        ledger_pb2.UsageReceipt.FromString(u.receipt).node_id: u.billed_tokens
        for u in bad.close_request.usage
    }
    sent_to_cheater = len(PROMPT) + rollback.discarded_positions
    assert receipts == {cheater: sent_to_cheater, hop.node_id: TOKENS}
    # The taker is dearer than bravo, and a cheap route's escrow holds bravo's price: the
    # escrow caps what the fail-over can cost the client.
    taken = min(charge(taker), bad.quote)
    assert bad.settlement is not None
    assert (bad.settlement.charged, bad.settlement.refunded) == (taken, bad.quote - taken)
    assert int(balance_cli(market)["available"]) == balance_before - taken
    assert paid_by_node(market, bad.session_id) == {hop.node_id: taken}

    # Slashed: bravo's pending earnings and its whole stake.
    earned = earnings_cli(market, cheater)
    assert (int(earned["pending"]), int(earned["slashed"])) == (0, honest_share)
    assert int(earned["staked"]) == 0
    assert int(earned["released"]) == honest_share
    assert int(earned["available"]) == honest_share - STAKE
    with sqlite3.connect(market.coordinator_dir / "coordinator.db") as db:
        (slashed,) = db.execute(
            "SELECT balance FROM ledger_accounts WHERE account = 'slashed'"
        ).fetchone()
    assert slashed == honest_share + STAKE
    assert f"FRAUD PROVEN: node {cheater}" in market.coordinator.log_text()

    # After the window the honest node has exactly its receipt; nothing else moved.
    wait_for(lambda: int(earnings_cli(market, hop.node_id)["released"]) == taken,
             "the honest node's earnings to be released", 60)  # fmt: skip
    for node_id, name in names.items():
        if node_id not in (cheater, hop.node_id):
            earned = earnings_cli(market, node_id)
            assert int(earned["released"]) + int(earned["pending"]) == 0, (name, earned)
    balance = balance_cli(market)
    assert int(balance["available"]) == GRANT - 2 * honest_share - taken
    assert int(balance["escrowed"]) == 0
    audit = audit_cli(market)
    assert audit.returncode == 0 and "ledger OK" in audit.stdout, audit.stdout
