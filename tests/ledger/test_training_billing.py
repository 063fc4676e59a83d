"""Training jobs are billed like inference sessions (docs/ledger.md, "Jobs"): the job's
quote (steps x batch_size x layers x each stage node's price per sample-layer) is escrowed
from the paying client when its session first opens; counter-signed cumulative receipts
settle at checkpoints (ReportStep) and at the end (FinishJob), and the rest is refunded.

A real in-process coordinator (ledger and jobs components) with three priced stage nodes
that speak the control protocol; the receipts are signed here with the nodes' keys.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

import grpc
import numpy as np
import pytest
from jobs.jobs_harness import JobsCoordinator, jc, start_jobs, tiny_model  # noqa: F401
from jobs.test_training_checkers import report_failure
from support.hostile import refused

from client import billing
from coordinator.ledger.audit import audit
from coordinator.ledger.book import Ledger
from protos import identity
from protos.tessera.v1 import client_api_pb2, jobs_pb2, ledger_pb2, ledger_pb2_grpc

PRICES = (3, 5, 7)  # credit units per sample-layer, one node per stage
STEPS, BATCH = 6, 4
TOKENS = np.arange(400, dtype=np.int32) % 50


async def _code(call: Awaitable[object]) -> grpc.StatusCode:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await call
    return err.value.code()


@pytest.fixture
async def market(
    start_jobs: Callable[..., Awaitable[JobsCoordinator]],  # noqa: F811 - the fixture
) -> JobsCoordinator:
    served = await start_jobs(nodes=0, replicas=1)
    for index, price in enumerate(PRICES):
        await served.add_node(f"n{index}", price_per_sample_layer_units=price)
    await served.ready(replicas=1)
    return served


def _ledger(served: JobsCoordinator) -> Ledger:
    return served.coordinator.ctx.ledger.ledger


def _open_request(job_id: str, key=None, max_price: int = 0):
    request = jobs_pb2.OpenTrainingSessionRequest(job_id=job_id, max_price=max_price)
    if key is not None:
        billing.sign_open_training(request, key, int(time.time() * 1000))
    return request


def _receipt(node_key, job_id: str, start: int, end: int, samples: int, step: int = 0):
    """As a training node signs it: its whole count is its longest (no prefix is held)."""
    public = identity.public_key_bytes(node_key)
    receipt = ledger_pb2.UsageReceipt(
        session_id=job_id, node_id=identity.node_id(public), node_public_key=public,
        layer_start=start, layer_end=end, tokens=samples, first_step=0, last_step=step,
        longest=samples,
    ).SerializeToString(deterministic=True)  # fmt: skip
    return ledger_pb2.SignedUsage(
        receipt=receipt, node_signature=node_key.sign(identity.usage_payload(receipt))
    )


def _countersigned(usage: ledger_pb2.SignedUsage, client_key, billed: int):
    signed = ledger_pb2.SignedUsage()
    signed.CopyFrom(usage)
    signed.billed_tokens = billed
    signed.client_signature = client_key.sign(
        identity.usage_countersign_payload(usage.receipt, billed)
    )
    return signed


async def _job(served: JobsCoordinator) -> jobs_pb2.JobInfo:
    dataset = await served.upload(TOKENS)
    return await served.submit(dataset.id, steps=STEPS, batch_size=BATCH)


def _funded(served: JobsCoordinator, amount: int):
    key = identity.generate_private_key()
    _ledger(served).grant(billing.account_of(key), amount, f"g-{time.monotonic_ns()}")
    return key


async def test_a_priced_job_escrows_its_quote_and_settles_from_countersigned_receipts(
    market: JobsCoordinator,
) -> None:
    job = await _job(market)
    # Unsigned: the job costs money, so it does not open (and stays queued).
    code = await _code(market.stub.OpenTrainingSession(_open_request(job.job_id)))
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    assert (await market.stub.GetJob(jobs_pb2.JobRef(job_id=job.job_id))).state == (
        jobs_pb2.JOB_STATE_QUEUED
    )
    client = _funded(market, 10_000_000)
    session = await market.stub.OpenTrainingSession(_open_request(job.job_id, client))
    ledger = _ledger(market)
    by_node = {n.node_id: n for n in market.nodes}
    price = {n.node_id: p for n, p in zip(market.nodes, PRICES, strict=True)}
    layers = {h.node_id: h.layers.end - h.layers.start for h in session.hops}
    quote = STEPS * BATCH * sum(layers[n] * price[n] for n in layers)
    assert session.quote.amount == quote > 0
    assert session.quote.account == billing.account_of(client)
    assert ledger.client_balance(billing.account_of(client)).escrowed == quote

    hops = list(session.hops)
    receipts = {
        h.node_id: _receipt(by_node[h.node_id].key, job.job_id, h.layers.start, h.layers.end, 8)
        for h in hops
    }
    # Checkpoint settlement on step 0's report: 8 samples per stage so far.
    report = jobs_pb2.ReportStepRequest(
        job_id=job.job_id, capability=session.capability, step=0, loss=1.0,
        usage=[_countersigned(r, client, 8) for r in receipts.values()],
    )  # fmt: skip
    await market.stub.ReportStep(report)
    periodic = 8 * sum(layers[n] * price[n] for n in layers)
    assert ledger.hold(f"job:{job.job_id}")["charged"] == periodic
    # An inflated receipt the client never counter-signed refuses the finish; nothing moves.
    inflated = _receipt(
        by_node[hops[0].node_id].key, job.job_id, hops[0].layers.start, hops[0].layers.end, 999
    )
    bad = jobs_pb2.FinishJobRequest(
        job_id=job.job_id, capability=session.capability, state=jobs_pb2.JOB_STATE_FAILED,
        usage=[inflated],
    )  # fmt: skip
    assert await _code(market.stub.FinishJob(bad)) == grpc.StatusCode.UNAUTHENTICATED
    assert ledger.hold(f"job:{job.job_id}")["state"] == "open"
    # Billed beyond what the node's receipt claims: refused too.
    over = _countersigned(receipts[hops[0].node_id], client, 9)
    bad.ClearField("usage")
    bad.usage.append(over)
    assert await _code(market.stub.FinishJob(bad)) == grpc.StatusCode.INVALID_ARGUMENT

    # The job fails after 12 samples per stage: those are paid, the rest is refunded.
    final = [
        _countersigned(
            _receipt(by_node[h.node_id].key, job.job_id, h.layers.start, h.layers.end, 12),
            client, 12,
        )
        for h in hops
    ]  # fmt: skip
    done = jobs_pb2.FinishJobRequest(
        job_id=job.job_id, capability=session.capability, state=jobs_pb2.JOB_STATE_FAILED,
        usage=final,
    )  # fmt: skip
    info = await market.stub.FinishJob(done)
    assert info.state == jobs_pb2.JOB_STATE_FAILED
    charged = 12 * sum(layers[n] * price[n] for n in layers)
    hold = ledger.hold(f"job:{job.job_id}")
    assert (hold["state"], hold["charged"], hold["refunded"]) == (
        "settled", charged, quote - charged,
    )  # fmt: skip
    balance = ledger.client_balance(billing.account_of(client))
    assert (balance.available, balance.escrowed) == (10_000_000 - charged, 0)
    for node_id in layers:
        assert ledger.earnings(node_id).pending == 12 * layers[node_id] * price[node_id]
    result = audit(market.coordinator.ctx.db)
    assert result.ok, result.violations


async def test_a_client_cannot_start_a_job_past_its_balance_or_budget(
    market: JobsCoordinator,
) -> None:
    job = await _job(market)
    poor = _funded(market, 10)
    call = market.stub.OpenTrainingSession(_open_request(job.job_id, poor))
    assert await _code(call) == grpc.StatusCode.FAILED_PRECONDITION
    rich = _funded(market, 10_000_000)
    call = market.stub.OpenTrainingSession(_open_request(job.job_id, rich, max_price=5))
    assert await _code(call) == grpc.StatusCode.FAILED_PRECONDITION
    forged = _open_request(job.job_id, rich)
    forged.max_price = 10**9  # changed after signing
    assert await _code(market.stub.OpenTrainingSession(forged)) == grpc.StatusCode.UNAUTHENTICATED
    short_key = _open_request(job.job_id)
    short_key.client_public_key = b"k" * 5
    call = market.stub.OpenTrainingSession(short_key)
    assert await _code(call) == grpc.StatusCode.INVALID_ARGUMENT
    info = await market.stub.GetJob(jobs_pb2.JobRef(job_id=job.job_id))
    assert info.state == jobs_pb2.JOB_STATE_QUEUED
    assert _ledger(market).client_balance(billing.account_of(poor)).available == 10
    assert audit(market.coordinator.ctx.db).ok


async def test_a_job_whose_escrow_expired_does_not_run_unpaid(market: JobsCoordinator) -> None:
    job = await _job(market)
    client = _funded(market, 10_000_000)
    session = await market.stub.OpenTrainingSession(_open_request(job.job_id, client))
    ledger = _ledger(market)
    # Paused longer than the hold lives: the sweep refunds it.
    assert ledger.expire_holds(now_ms=2**62) == [f"job:{job.job_id}"]
    balance = ledger.client_balance(billing.account_of(client))
    assert (balance.available, balance.escrowed) == (10_000_000, 0)
    call = market.stub.OpenTrainingSession(_open_request(job.job_id, client))
    assert await _code(call) == grpc.StatusCode.FAILED_PRECONDITION
    assert session.quote.amount > 0 and audit(market.coordinator.ctx.db).ok


async def test_only_the_paying_client_can_open_a_paid_job_again(market: JobsCoordinator) -> None:
    """OpenTrainingSession supersedes the job's driver, so on a job whose escrow is open only
    the key that escrowed it may call it: a stranger (signed with its own funded key, or
    unsigned) taking over would cut the owner's driver off and run the owner's paid job."""
    job = await _job(market)
    owner = _funded(market, 10_000_000)
    first = _open_request(job.job_id, owner)
    session = await market.stub.OpenTrainingSession(first)
    stranger = _funded(market, 10_000_000)
    details = await refused(
        market.stub.OpenTrainingSession(_open_request(job.job_id, stranger)),
        grpc.StatusCode.PERMISSION_DENIED,
        billing.account_of(owner),
    )
    assert "client key" in details
    await refused(
        market.stub.OpenTrainingSession(_open_request(job.job_id)),
        grpc.StatusCode.PERMISSION_DENIED,
        billing.account_of(owner),
    )
    # The owner's key with the request altered after signing, or a stale stamp: refused.
    altered = _open_request(job.job_id, owner)
    altered.max_price = 1
    await refused(
        market.stub.OpenTrainingSession(altered), grpc.StatusCode.UNAUTHENTICATED, "not signed"
    )
    stale = jobs_pb2.OpenTrainingSessionRequest(job_id=job.job_id)
    billing.sign_open_training(stale, owner, int(time.time() * 1000))
    stale.request_unix_ms -= 3_600_000
    stale.client_signature = owner.sign(identity.open_training_payload(stale))
    await refused(market.stub.OpenTrainingSession(stale), grpc.StatusCode.UNAUTHENTICATED, "clock")
    # The owner's own signed open, captured and sent again: accepted once only, or a
    # stranger who saw it could take the job over while its stamp is fresh.
    await refused(market.stub.OpenTrainingSession(first), grpc.StatusCode.ALREADY_EXISTS, "replay")

    # Nothing moved: the owner's driver still drives, nobody else paid or was charged.
    ledger = _ledger(market)
    assert ledger.client_balance(billing.account_of(stranger)).escrowed == 0
    report = jobs_pb2.ReportStepRequest(
        job_id=job.job_id, capability=session.capability, step=0, loss=1.0
    )
    await market.stub.ReportStep(report)
    # Still serving: the owner resumes its own job, on the same escrow.
    resumed = await market.stub.OpenTrainingSession(_open_request(job.job_id, owner))
    assert resumed.quote.amount == session.quote.amount
    assert ledger.client_balance(billing.account_of(owner)).escrowed == session.quote.amount
    assert audit(market.coordinator.ctx.db).ok


async def test_a_free_job_needs_no_key(jc: JobsCoordinator) -> None:  # noqa: F811
    job = await _job(jc)
    session = await jc.stub.OpenTrainingSession(_open_request(job.job_id))
    assert session.quote.amount == 0 and session.hops
    assert _ledger(jc).hold(f"job:{job.job_id}") is None


async def test_a_job_with_an_owner_opens_only_for_its_owner_even_when_free(
    jc: JobsCoordinator,  # noqa: F811
) -> None:
    """Job ids are listed for all to see, and a new session cuts the job's runner off: a job
    submitted with a client key (the client always sends one when it has a key) opens only
    for an open that key signed, once per signed request."""
    owner, stranger = identity.generate_private_key(), identity.generate_private_key()
    dataset = await jc.upload(TOKENS)
    job = await jc.submit(
        dataset.id, steps=STEPS, batch_size=BATCH,
        owner_public_key=identity.public_key_bytes(owner),
    )  # fmt: skip
    for request in (_open_request(job.job_id, stranger), _open_request(job.job_id)):
        await refused(
            jc.stub.OpenTrainingSession(request),
            grpc.StatusCode.PERMISSION_DENIED,
            billing.account_of(owner),
        )
    # The owner's key named but the request signed by another: refused as unsigned.
    forged = _open_request(job.job_id, stranger)
    forged.client_public_key = identity.public_key_bytes(owner)
    await refused(
        jc.stub.OpenTrainingSession(forged), grpc.StatusCode.UNAUTHENTICATED, "not signed"
    )
    first = _open_request(job.job_id, owner)
    session = await jc.stub.OpenTrainingSession(first)
    assert session.quote.amount == 0 and session.hops  # free: nothing escrowed
    await refused(jc.stub.OpenTrainingSession(first), grpc.StatusCode.ALREADY_EXISTS, "replay")
    # The owner resumes with a new signed open; the first runner's capability is superseded.
    resumed = await jc.stub.OpenTrainingSession(_open_request(job.job_id, owner))
    assert resumed.capability.signature != session.capability.signature
    # An owner key of the wrong size is refused at submit.
    await refused(
        jc.submit(dataset.id, steps=STEPS, batch_size=BATCH, owner_public_key=b"k" * 5),
        grpc.StatusCode.INVALID_ARGUMENT,
        "owner_public_key",
    )


async def test_nodes_without_a_training_price_get_the_coordinators_default(
    start_jobs: Callable[..., Awaitable[JobsCoordinator]],  # noqa: F811 - the fixture
) -> None:
    served = await start_jobs(nodes=0, replicas=1, default_training_price_units=2)
    for index, price in enumerate((0, 5, 0)):  # two nodes ask nothing: they get the default
        await served.add_node(f"n{index}", price_per_sample_layer_units=price)
    await served.ready(replicas=1)
    job = await _job(served)
    client = _funded(served, 10_000_000)
    session = await served.stub.OpenTrainingSession(_open_request(job.job_id, client))
    price = {n.node_id: p or 2 for n, p in zip(served.nodes, (0, 5, 0), strict=True)}
    layers = {h.node_id: h.layers.end - h.layers.start for h in session.hops}
    assert session.quote.amount == STEPS * BATCH * sum(layers[n] * price[n] for n in layers)
    assert _ledger(served).hold(f"job:{job.job_id}") is not None


async def test_a_paid_job_gives_its_nodes_a_credit_and_they_settle_its_receipts_themselves(
    market: JobsCoordinator,
) -> None:
    """The capability of a paid job names the client key and the coordinator's credit
    (`serve --training-usage-credit`, 256 samples by default); its stage nodes settle the
    runner's acknowledged receipts with Ledger.SettleUsage under the job id, and their
    receipts are billed whole even where the runner bills them as checks."""
    job = await _job(market)
    client = _funded(market, 10_000_000)
    session = await market.stub.OpenTrainingSession(_open_request(job.job_id, client))
    claims = _claims(session)
    assert claims.client_public_key == identity.public_key_bytes(client)
    assert claims.usage_credit == 256
    by_node = {n.node_id: n for n in market.nodes}
    price = {n.node_id: p for n, p in zip(market.nodes, PRICES, strict=True)}
    ledger = ledger_pb2_grpc.LedgerStub(market.channel)
    first, *_ = session.hops
    layers = first.layers.end - first.layers.start
    receipt = _receipt(by_node[first.node_id].key, job.job_id, first.layers.start,
                       first.layers.end, 8)  # fmt: skip
    # The runner calls all 8 samples checks (billed 0): the stage node is paid for 8.
    settled = await ledger.SettleUsage(
        ledger_pb2.SettleUsageRequest(
            session_id=job.job_id, usage=[_countersigned(receipt, client, 0)]
        )
    )
    assert settled.charged == 8 * layers * price[first.node_id]
    assert _ledger(market).hold(f"job:{job.job_id}")["charged"] == settled.charged
    # The same receipt again pays nothing; one not counter-signed by the payer is refused.
    again = ledger_pb2.SettleUsageRequest(
        session_id=job.job_id, usage=[_countersigned(receipt, client, 8)]
    )
    assert (await ledger.SettleUsage(again)).charged == settled.charged
    forged = ledger_pb2.SettleUsageRequest(
        session_id=job.job_id,
        usage=[_countersigned(receipt, identity.generate_private_key(), 8)],
    )
    await refused(ledger.SettleUsage(forged), grpc.StatusCode.UNAUTHENTICATED, "not counter-signed")
    # The job ends without its runner's receipts: the hold is settled, the rest refunded.
    # A node's settlement that arrives after it is still paid, from the client's balance.
    done = jobs_pb2.FinishJobRequest(
        job_id=job.job_id, capability=session.capability, state=jobs_pb2.JOB_STATE_FAILED
    )
    await market.stub.FinishJob(done)
    assert _ledger(market).hold(f"job:{job.job_id}")["state"] == "settled"
    assert (await ledger.SettleUsage(again)).charged == settled.charged
    newer = _receipt(by_node[first.node_id].key, job.job_id, first.layers.start,
                     first.layers.end, 12)  # fmt: skip
    late = await ledger.SettleUsage(
        ledger_pb2.SettleUsageRequest(
            session_id=job.job_id, usage=[_countersigned(newer, client, 12)]
        )
    )
    assert late.closed and late.charged == 12 * layers * price[first.node_id]
    hold = _ledger(market).hold(f"job:{job.job_id}")
    assert hold["charged"] + hold["refunded"] == hold["amount"]
    result = audit(market.coordinator.ctx.db)
    assert result.ok, result.violations


async def test_a_free_job_gives_no_credit(jc: JobsCoordinator) -> None:  # noqa: F811
    dataset = await jc.upload(TOKENS)
    job = await jc.submit(dataset.id, steps=2, batch_size=2)
    session = await jc.stub.OpenTrainingSession(_open_request(job.job_id))
    claims = _claims(session)
    assert (claims.client_public_key, claims.usage_credit) == (b"", 0)


def _claims(session: jobs_pb2.TrainingSession) -> client_api_pb2.CapabilityClaims:
    return client_api_pb2.CapabilityClaims.FromString(session.capability.claims)


async def _opened_with_checkers(
    start_jobs: Callable[..., Awaitable[JobsCoordinator]],  # noqa: F811 - the fixture
) -> tuple[JobsCoordinator, jobs_pb2.JobInfo, object, jobs_pb2.TrainingSession]:
    """A paid job opened on six nodes of six operators (3 per sample-layer), two stages:
    checkers are needed and possible. (served, job, client key, session)"""
    served = await start_jobs(nodes=0)
    for index in range(6):
        await served.add_node(f"n{index}", f"op{index}", price_per_sample_layer_units=3)
    await served.ready(replicas=2)
    await served.all_ready()
    job = await _job(served)
    client = _funded(served, 10_000_000)
    session = await served.stub.OpenTrainingSession(_open_request(job.job_id, client))
    return served, job, client, session


async def test_a_first_stage_node_never_checks_the_job_it_is_billed_whole_for(
    start_jobs: Callable[..., Awaitable[JobsCoordinator]],  # noqa: F811 - the fixture
) -> None:
    """Its receipts of the job are billed in full (a client cannot call its work checks),
    so its shadow samples there would be billed as work: after it fails and its cool-down
    is over, it is still never the job's checker."""
    served, job, client, session = await _opened_with_checkers(start_jobs)
    first = {h.node_id for h in session.hops}
    assert session.checkers and not first & {c.node_id for c in session.checkers}
    for stage in range(2):
        request = jobs_pb2.StageFailureRequest(
            job_id=job.job_id, capability=session.capability, stage=stage,
            node_id=session.hops[stage].node_id, cause="test",
        )  # fmt: skip
        session = await report_failure(served, request)
        served.jobs.manager._failed.clear()  # the failed node's cool-down is over
        assert session.checkers and not first & {c.node_id for c in session.checkers}


async def test_a_runner_that_trains_a_stage_on_its_checker_pays_for_those_samples(
    start_jobs: Callable[..., Awaitable[JobsCoordinator]],  # noqa: F811 - the fixture
) -> None:
    """The stage's node computed 2 samples (billed whole, as a first stage node's are);
    its checker, which a runner may call like the stage, computed 12, and the runner billed
    them all as checks. A lockstep shadow computes only what its stage's node computes, so
    the job pays for the 10 more, to the checker, when it ends (docs/ledger.md,
    "Shortfall"). The other stage's node, billed what it computed, pays as ever."""
    served, job, client, session = await _opened_with_checkers(start_jobs)
    keys = {n.node_id: n.key for n in served.nodes}
    checker = session.checkers[0]
    stage = next(h for h in session.hops if h.layers == checker.layers)
    start, end = checker.layers.start, checker.layers.end
    usage = [
        _countersigned(_receipt(keys[stage.node_id], job.job_id, start, end, 2), client, 0),
        _countersigned(_receipt(keys[checker.node_id], job.job_id, start, end, 12), client, 0),
    ]
    for other in session.hops:
        if other.node_id != stage.node_id:
            s, e = other.layers.start, other.layers.end
            usage.append(_countersigned(_receipt(keys[other.node_id], job.job_id, s, e, 12),
                                        client, 12))  # fmt: skip
    ledger = ledger_pb2_grpc.LedgerStub(served.channel)
    periodic = await ledger.SettleUsage(
        ledger_pb2.SettleUsageRequest(session_id=job.job_id, usage=usage)
    )
    layers = end - start
    honest = 2 * layers * 3 + sum(
        12 * (h.layers.end - h.layers.start) * 3 for h in session.hops if h != stage
    )
    assert periodic.charged == honest, "a periodic settlement reckons no shortfall"
    done = jobs_pb2.FinishJobRequest(
        job_id=job.job_id, capability=session.capability, state=jobs_pb2.JOB_STATE_FAILED
    )
    await served.stub.FinishJob(done)
    hold = _ledger(served).hold(f"job:{job.job_id}")
    assert hold["state"] == "settled" and hold["charged"] == honest + 10 * layers * 3
    earned = _ledger(served).earnings(checker.node_id)
    assert earned.pending == 10 * layers * 3
    result = audit(served.coordinator.ctx.db)
    assert result.ok, result.violations
