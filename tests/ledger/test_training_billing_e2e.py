"""A paid training job end to end with real processes: a coordinator and three node
agents with training prices, one stage each. The job's quote is escrowed from the client
when it opens, the stage nodes sign cumulative sample receipts on their forward replies,
the runner counter-signs them and settles at every checkpoint and at the end, and exactly
steps x batch_size x layers x price moves to each operator (docs/ledger.md, "Jobs").

The coordinator gives each node a credit of CREDIT samples (`serve
--training-usage-credit`): the runner acknowledges the nodes' receipts as it goes, which
the nodes settle themselves, so a runner that dies without reporting has still paid for
what they computed.
"""

from __future__ import annotations

import asyncio
import sqlite3
import time
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
# Samples a node runs forward past the runner's last acknowledgment: less than one step's
# batch, so the runner acknowledges (and the nodes settle) as the job goes.
CREDIT = 3
SPEC = TrainSpec(
    steps=4, batch_size=4, seq_len=16, lr=3e-3, micro_batches=2, checkpoint_every=2, seed=5
)


@pytest.fixture(scope="module")
def market(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalSwarm]:
    checkpoint = make_market_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny")
    with running_market(
        tmp_path_factory.mktemp("market"),
        checkpoint,
        training_prices=TRAINING_PRICES,
        coordinator_args=("--training-usage-credit", str(CREDIT)),
        node_env={name: {"TESSERA_SETTLE_EVERY_S": "0.3"} for name in TRAINING_PRICES},
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
    # The runner settled at each of its two checkpoints; the nodes may have settled the
    # receipts it acknowledged in between (each is paid once: the shares above are exact).
    assert periodic >= 2, "settled at each of the two checkpoints"
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
    same (before, it signed none of them, and the nodes were not paid for the rest of the
    job); the job's first stage nodes are billed whole, so every sample they computed is
    paid, within the escrow."""
    key = funded_client(market)
    data = counting_dataset()
    job_id = _submit(market, key, data)
    run_until_killed(_DIES_AFTER_STEP_3, market.address, market.workdir / "client.key", job_id)
    amount, charged, _, state = _hold(market, job_id)
    # The checkpoint at step 2 was settled, and the nodes settled what the runner
    # acknowledged after it.
    assert state == "open" and amount > charged >= amount // 2, (amount, charged)
    final = _run(market, key, job_id, data)
    assert final.step == SPEC.steps
    # Each node computed 5 steps' samples (the dead runner's step 2 was redone) against a
    # quote of 4: the whole escrow is paid out and no more, nothing twice. The nodes
    # settle on their own, so the cap falls on whichever settles last (docs/ledger.md: a
    # job that redoes steps may use its escrow before its last samples).
    computed = _shares(market, final, (SPEC.steps + 1) * SPEC.batch_size)
    paid = paid_by_node(market, f"job:{job_id}")
    assert paid.keys() == computed.keys()
    assert all(0 < paid[n] <= computed[n] for n in paid), (paid, computed)
    _, charged, refunded, state = _hold(market, job_id)
    # Shares scaled to the escrow left round down: at most a unit per node goes back.
    assert state == "settled" and charged == sum(paid.values())
    assert charged + refunded == amount and refunded < len(paid), (charged, refunded)
    audit = audit_cli(market)
    assert audit.returncode == 0 and "ledger OK" in audit.stdout, audit.stdout


# The same runner, for a job that checkpoints (and so settles) only at its end.
SETTLES_AT_THE_END = TrainSpec(
    steps=4, batch_size=4, seq_len=16, lr=3e-3, micro_batches=2, checkpoint_every=0, seed=5
)


def test_a_runner_that_dies_before_it_ever_settles_has_paid_the_nodes_it_acknowledged(market):
    """Killed after its step 3 of 4, the runner never sent a receipt to the coordinator.
    Each node settled what the runner acknowledged: all but at most its credit (plus the
    micro-batch that crossed it) of the 12 samples it ran forward."""
    key = funded_client(market)
    data = counting_dataset()

    async def submit() -> str:
        async with AsyncClient(market.address, key=key) as client:
            info, _ = await client.submit_training(MODEL, data, SETTLES_AT_THE_END)
            return info.job_id

    job_id = asyncio.run(submit())
    run_until_killed(_DIES_AFTER_STEP_3, market.address, market.workdir / "client.key", job_id)
    micro_batch = SETTLES_AT_THE_END.batch_size // SETTLES_AT_THE_END.micro_batches
    at_least = 3 * SETTLES_AT_THE_END.batch_size - CREDIT - micro_batch
    price_by_node = {p.node_id: TRAINING_PRICES[p.name] for p in market.processes if p.node_id}
    with sqlite3.connect(market.coordinator_dir / "coordinator.db") as db:
        query = (
            "SELECT node_id, layer_end - layer_start FROM ledger_hold_primaries WHERE hold_id = ?"
        )
        layers_by_node = dict(db.execute(query, [f"job:{job_id}"]).fetchall())
    assert len(layers_by_node) == 3, "the job's three first stage nodes are billed whole"
    owed = {n: at_least * layers * price_by_node[n] for n, layers in layers_by_node.items()}
    paid: dict[str, int] = {}
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        paid = paid_by_node(market, f"job:{job_id}")
        if len(paid) == 3 and all(paid[n] >= owed[n] for n in owed):
            break
        time.sleep(0.2)
    assert paid.keys() == owed.keys() and all(paid[n] >= owed[n] for n in owed), (paid, owed)
    amount, charged, refunded, state = _hold(market, job_id)
    assert state == "open" and refunded == 0 and charged == sum(paid.values()) < amount
    # A new runner finishes the job; nothing is paid twice and the escrow still caps.
    final = _run(market, key, job_id, data)
    assert final.step == SETTLES_AT_THE_END.steps
    amount, charged, refunded, state = _hold(market, job_id)
    assert state == "settled" and charged + refunded == amount
    audit = audit_cli(market)
    assert audit.returncode == 0 and "ledger OK" in audit.stdout, audit.stdout
