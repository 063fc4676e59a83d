"""The marketplace end to end with real processes: a coordinator and three priced node
agents on loopback, credits granted with the admin CLI, generations paid from escrow by
receipts both sides signed, earnings released after the challenge window, and kill -9 of
the coordinator inside settlement (failpoints) with a restart on the same database.
"""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.checkpoints import make_checkpoint

from client import billing
from client.api import Client, GenerationResult
from client.local_swarm import LocalSwarm
from coordinator.ledger.failpoints import ENV as FAILPOINT_ENV

pytestmark = pytest.mark.slow

MODEL = "tiny-llama"
PROMPT = [1, 5, 9, 23, 42, 7, 11]
NEW_TOKENS = 8
PRICES = {"alpha": 1000, "bravo": 2500, "charlie": 4000}  # credit units per 1k token-layers
GRANT = 1_000_000
WINDOW_S = 2.0


def run_cli(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        [sys.executable, "-m", *argv], capture_output=True, text=True, timeout=120
    )
    if check and result.returncode != 0:
        raise AssertionError(
            f"{argv} exited {result.returncode}:\n{result.stdout}\n{result.stderr}"
        )
    return result


def wait_for(predicate, what: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(
        tmp_path_factory.mktemp("ckpt") / "tiny", "llama", num_layers=6, hidden_size=64,
        intermediate_size=128, num_heads=4, num_kv_heads=2, vocab_size=96, seed=7,
    )  # fmt: skip


@pytest.fixture(scope="module")
def market(tmp_path_factory: pytest.TempPathFactory, checkpoint: Path) -> Iterator[LocalSwarm]:
    work = tmp_path_factory.mktemp("market")
    args = ["--min-stages", "3", "--replicas", "1", "--heartbeat-interval", "1",
            "--challenge-window", str(WINDOW_S)]  # fmt: skip
    with pytest.MonkeyPatch.context() as env, LocalSwarm(work, coordinator_args=args) as swarm:
        # Nodes re-attach quickly after the coordinator restarts.
        env.setenv("TESSERA_BACKOFF_BASE_S", "0.2")
        env.setenv("TESSERA_BACKOFF_CAP_S", "1.0")
        swarm.start_coordinator()
        nodes = [
            swarm.start_node(name, ["--price", str(price), "--account", f"op-{name}"])
            for name, price in PRICES.items()
        ]
        swarm.wait_registered(nodes)
        swarm.add_model(checkpoint, MODEL)
        yield swarm


@pytest.fixture(scope="module")
def client_key(market: LocalSwarm):
    path = market.workdir / "client.key"
    key = billing.load_key(path, create=True)
    account = billing.account_of(key)
    run_cli("coordinator.cli", "credits", "grant", account, str(GRANT), "--request-id", "g1",
            "--data-dir", str(market.coordinator_dir))  # fmt: skip
    # The same request id again: granted once.
    run_cli("coordinator.cli", "credits", "grant", account, str(GRANT), "--request-id", "g1",
            "--data-dir", str(market.coordinator_dir))  # fmt: skip
    return key


def available(client: Client) -> bool:
    info = {m.name: m for m in client.models()}.get(MODEL)
    return bool(info and info.available)


def price_of(market: LocalSwarm, node_id: str) -> int:
    return PRICES[market.node(node_id).name]


def expected_shares(market: LocalSwarm, result: GenerationResult) -> dict[str, int]:
    """Per node: tokens it was sent x its layers x its price / 1000 (no fail-overs here)."""
    assert not result.failovers
    tokens = len(PROMPT) + len(result.token_ids) - 1  # the last token is never fed back
    shares: dict[str, int] = {}
    for hop in result.route:
        charge = tokens * (hop.end - hop.start) * price_of(market, hop.node_id) // 1000
        shares[hop.node_id] = shares.get(hop.node_id, 0) + charge
    return shares


def balance_cli(market: LocalSwarm) -> dict:
    out = run_cli("client.cli", "balance", "--coordinator", market.address,
                  "--key", str(market.workdir / "client.key"), "--json").stdout  # fmt: skip
    return json.loads(out)


def earnings_cli(market: LocalSwarm, node_id: str) -> dict:
    name = market.node(node_id).name
    out = run_cli("node_agent.cli", "earnings", "--coordinator", market.address,
                  "--data-dir", str(market.workdir / "nodes" / name), "--json").stdout  # fmt: skip
    return json.loads(out)


def audit_cli(market: LocalSwarm, *where: str) -> subprocess.CompletedProcess[str]:
    where = where or ("--data-dir", str(market.coordinator_dir))
    return run_cli("coordinator.cli", "ledger", "audit", *where, check=False)


def generate(market: LocalSwarm, key) -> GenerationResult:
    with Client(market.address, key=key) as client:
        wait_for(lambda: available(client), "the model to be served")
        return client.generate_all(
            MODEL, token_ids=PROMPT, max_new_tokens=NEW_TOKENS, stop_at_eos=False
        )


def test_a_paid_generation_moves_exactly_its_usage_to_the_operators(market, client_key):
    before = {p.node_id: earnings_cli(market, p.node_id) for p in market.processes if p.node_id}
    result = generate(market, client_key)
    shares = expected_shares(market, result)
    charged = sum(shares.values())
    settlement = result.settlement
    assert settlement is not None and result.quote > 0
    assert (settlement.escrowed, settlement.charged) == (result.quote, charged)
    assert settlement.refunded == result.quote - charged
    balance = balance_cli(market)
    assert (int(balance["available"]), int(balance["escrowed"])) == (GRANT - charged, 0)
    # Pending during the challenge window, then released to the operators, exactly.
    for node_id, share in shares.items():
        earned = earnings_cli(market, node_id)
        assert int(earned["pending"]) + int(earned["released"]) == share

    def released() -> bool:
        return all(int(earnings_cli(market, n)["released"]) == share for n, share in shares.items())

    wait_for(released, "earnings to be released after the window", 30)
    assert all(int(e["released"]) == 0 for e in before.values()), "nothing paid before"
    audit = audit_cli(market)
    assert audit.returncode == 0 and "ledger OK" in audit.stdout, audit.stdout


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
    shares = expected_shares(market, result)
    with Client(address, key=client_key) as client:
        settlement = client.settle(result)
        again = client.settle(result)
    assert settlement is not None and settlement == again
    assert settlement.charged == sum(shares.values())
    assert settlement.refunded == result.quote - settlement.charged
    balance = balance_cli(market)
    assert int(balance["available"]) == balance_before - settlement.charged
    assert int(balance["escrowed"]) == 0
    with sqlite3.connect(db_path) as db:
        paid = dict(
            db.execute(
                "SELECT node_id, SUM(amount) FROM ledger_earnings WHERE hold_id = ? "
                "GROUP BY node_id",
                [result.session_id],
            ).fetchall()
        )
    assert paid == shares, "each node paid its share exactly once"
    audit = audit_cli(market)
    assert audit.returncode == 0 and "ledger OK" in audit.stdout, audit.stdout
