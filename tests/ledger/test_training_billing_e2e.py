"""A paid training job end to end with real processes: a coordinator and three node
agents with training prices, one stage each. The job's quote is escrowed from the client
when it opens, the stage nodes sign cumulative sample receipts on their forward replies,
the runner counter-signs them and settles at every checkpoint and at the end, and exactly
steps x batch_size x layers x price moves to each operator (docs/ledger.md, "Jobs").
"""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import Iterator

import pytest
from support.datasets import counting_dataset
from support.market import (
    GRANT,
    audit_cli,
    balance_cli,
    funded_client,
    make_market_checkpoint,
    paid_by_node,
    running_market,
)
from support.procs import run_until_killed
from support.wrong_clock import set_clock_off

from client.api import AsyncClient
from client.datasets import TokenDataset
from client.errors import TesseraError
from client.jobs import TrainSpec
from client.local_swarm import LocalSwarm

pytestmark = pytest.mark.slow

MODEL = "tiny-llama"
TRAINING_PRICES = {"alpha": 2, "bravo": 3, "charlie": 5}  # credit units per sample-layer
SPEC = TrainSpec(
    steps=4, batch_size=4, seq_len=16, lr=3e-3, micro_batches=2, checkpoint_every=2, seed=5
)


@pytest.fixture(scope="module")
def market(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalSwarm]:
    checkpoint = make_market_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny")
    with running_market(
        tmp_path_factory.mktemp("market"), checkpoint, training_prices=TRAINING_PRICES
    ) as swarm:
        yield swarm


class Interrupt(TesseraError):
    pass


def _submit(market: LocalSwarm, key, data: TokenDataset) -> str:
    async def main() -> str:
        async with AsyncClient(market.address, key=key) as client:
            info, _ = await client.submit_training(MODEL, data, SPEC)
            return info.job_id

    return asyncio.run(main())


def _run(market: LocalSwarm, key, job_id: str, data: TokenDataset, stop_at: int = 0):
    def hook(step: int) -> None:
        if step == stop_at:
            raise Interrupt(f"stopped at step {step}")

    async def main():
        async with AsyncClient(market.address, key=key) as client:
            return await client.run_job(job_id, dataset=data, after_step=hook)

    return asyncio.run(main())


def _hold(market: LocalSwarm, job_id: str) -> tuple[int, int, int, str]:
    with sqlite3.connect(market.coordinator_dir / "coordinator.db") as db:
        return db.execute(
            "SELECT amount, charged, refunded, state FROM ledger_holds WHERE hold_id = ?",
            [f"job:{job_id}"],
        ).fetchone()


def _shares(market: LocalSwarm, final, samples: int) -> dict[str, int]:
    price_by_node = {p.node_id: TRAINING_PRICES[p.name] for p in market.processes if p.node_id}
    shares = {
        s.node_id: samples * (s.layers.end - s.layers.start) * price_by_node[s.node_id]
        for s in final.stages
    }
    assert len(shares) == 3, f"one node per stage: {final.stages}"
    return shares


def test_a_paid_training_job_moves_exactly_its_samples_to_the_operators(market):
    key = funded_client(market)
    data = counting_dataset()
    balance_before = int(balance_cli(market)["available"])
    job_id = _submit(market, key, data)
    final = _run(market, key, job_id, data)
    assert final.step == SPEC.steps and final.replans == 0
    shares = _shares(market, final, SPEC.steps * SPEC.batch_size)
    quote = sum(shares.values())  # no step was redone, so the whole quote was used
    assert paid_by_node(market, f"job:{job_id}") == shares
    assert _hold(market, job_id) == (quote, quote, 0, "settled")
    with sqlite3.connect(market.coordinator_dir / "coordinator.db") as db:
        (periodic,) = db.execute(
            "SELECT COUNT(*) FROM ledger_transactions WHERE txid LIKE ?", [f"usage:job:{job_id}:%"]
        ).fetchone()
    assert periodic == 2, "settled at each of the two checkpoints"
    balance = balance_cli(market)
    assert (int(balance["available"]), int(balance["escrowed"])) == (balance_before - quote, 0)
    assert balance_before == GRANT
    audit = audit_cli(market)
    assert audit.returncode == 0 and "ledger OK" in audit.stdout, audit.stdout


def test_a_paused_job_keeps_its_escrow_and_a_resumed_runner_pays_the_rest(market):
    key = funded_client(market)  # the same key and grant as the first test: granted once
    data = counting_dataset()
    balance_before = int(balance_cli(market)["available"])
    job_id = _submit(market, key, data)
    with pytest.raises(Interrupt):
        _run(market, key, job_id, data, stop_at=2)
    # Paused after the checkpoint at step 2: half the samples paid, the rest still held.
    amount, charged, refunded, state = _hold(market, job_id)
    assert state == "open" and refunded == 0 and charged * 2 == amount
    assert int(balance_cli(market)["escrowed"]) == amount - charged
    # A new runner (`tessera train --resume`) counts what was settled and pays the rest.
    final = _run(market, key, job_id, data)
    assert final.step == SPEC.steps
    shares = _shares(market, final, SPEC.steps * SPEC.batch_size)
    assert paid_by_node(market, f"job:{job_id}") == shares
    assert amount == sum(shares.values())
    assert _hold(market, job_id) == (amount, amount, 0, "settled")
    balance = balance_cli(market)
    assert (int(balance["available"]), int(balance["escrowed"])) == (balance_before - amount, 0)
    audit = audit_cli(market)
    assert audit.returncode == 0 and "ledger OK" in audit.stdout, audit.stdout


def test_a_runner_whose_clock_is_hours_behind_still_opens_and_pays_its_job(market, monkeypatch):
    """The signed open is stamped by this process's clock, three hours behind the
    coordinator's: refused as stale once, then stamped by the coordinator's time."""
    key = funded_client(market)
    data = counting_dataset()
    job_id = _submit(market, key, data)
    set_clock_off(monkeypatch, -3 * 3600)
    final = _run(market, key, job_id, data)
    assert final.step == SPEC.steps
    shares = _shares(market, final, SPEC.steps * SPEC.batch_size)
    assert paid_by_node(market, f"job:{job_id}") == shares
    quote = sum(shares.values())
    assert _hold(market, job_id) == (quote, quote, 0, "settled")


# A runner that dies unannounced (kill -9) after the job's step 3: after the checkpoint at
# step 2 was settled, and after it computed step 2's samples, which it never settles.
_DIES_AFTER_STEP_3 = """
import asyncio, os, signal, sys
from pathlib import Path
from client import billing
from client.api import AsyncClient
from support.datasets import counting_dataset

address, key_path, job_id = sys.argv[1:]

def hook(step):
    if step == 3:
        os.kill(os.getpid(), signal.SIGKILL)

async def main():
    key = billing.load_key(Path(key_path))
    async with AsyncClient(address, key=key) as client:
        await client.run_job(job_id, dataset=counting_dataset(), after_step=hook)

asyncio.run(main())
"""


def test_after_a_runner_dies_unannounced_the_next_one_pays_the_nodes_for_its_own_work(market):
    """The nodes' cumulative receipts then also count what the dead runner had them compute
    after its last settlement, which the new runner cannot check. It signs them all the
    same and pays for what it can vouch for (the settled samples and its own): before, it
    signed none of them, and the nodes were not paid for the rest of the job."""
    key = funded_client(market)
    data = counting_dataset()
    job_id = _submit(market, key, data)
    run_until_killed(_DIES_AFTER_STEP_3, market.address, market.workdir / "client.key", job_id)
    amount, charged, _, state = _hold(market, job_id)
    assert state == "open" and charged * 2 == amount, "the checkpoint at step 2 was settled"
    final = _run(market, key, job_id, data)
    assert final.step == SPEC.steps
    # Every sample of the job is paid once: the dead runner's step 2 was redone (and is
    # paid once), its unsettled computation is not paid.
    shares = _shares(market, final, SPEC.steps * SPEC.batch_size)
    assert paid_by_node(market, f"job:{job_id}") == shares
    assert _hold(market, job_id) == (amount, amount, 0, "settled")
    audit = audit_cli(market)
    assert audit.returncode == 0 and "ledger OK" in audit.stdout, audit.stdout
