"""The Ledger service over real gRPC on an in-process coordinator: admin grants and audits,
signed balance and earnings queries, hostile input, the sweep that releases earnings after
the challenge window, and the verifier's entry points."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from support.coordinator_harness import (
    CHANNEL_OPTIONS,
    Harness,
    good_capabilities,
    harness_settings,
    wait_until,
)

from coordinator.admin_auth import bearer_metadata
from coordinator.ledger import NodeQuote, Usage
from coordinator.server import running_coordinator
from protos import identity
from protos.tessera.v1 import client_api_pb2, common_pb2, ledger_pb2, ledger_pb2_grpc


@pytest.fixture
async def harness(tmp_path: Path) -> AsyncIterator[Harness]:
    settings = harness_settings(tmp_path, challenge_window_s=0.3, ledger_sweep_s=0.05)
    async with running_coordinator(settings) as coordinator:
        channel = grpc.aio.insecure_channel(coordinator.address, options=CHANNEL_OPTIONS)
        async with channel:
            yield Harness(coordinator, channel)


def stub(harness: Harness) -> ledger_pb2_grpc.LedgerStub:
    return ledger_pb2_grpc.LedgerStub(harness.channel)


def admin(harness: Harness) -> tuple[tuple[str, str], ...]:
    return bearer_metadata(harness.ctx.admin_token)


async def expect(code: grpc.StatusCode, call, fragment: str = "") -> None:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await call
    assert err.value.code() == code, err.value.details()
    assert fragment in (err.value.details() or ""), err.value.details()


def client_account() -> tuple[object, str]:
    key = identity.generate_private_key()
    return key, identity.client_account(identity.public_key_bytes(key))


async def test_grants_need_the_admin_token_and_good_input(harness: Harness):
    ledger = stub(harness)
    _, account = client_account()
    grant = ledger_pb2.GrantCreditsRequest(account=account, amount=500, request_id="r1")
    await expect(grpc.StatusCode.UNAUTHENTICATED, ledger.GrantCredits(grant), "credentials")
    await expect(
        grpc.StatusCode.UNAUTHENTICATED,
        ledger.GrantCredits(grant, metadata=bearer_metadata("guess")),
        "wrong admin token",
    )
    bad = [
        (ledger_pb2.GrantCreditsRequest(account="alice", amount=5, request_id="r"), "account id"),
        (ledger_pb2.GrantCreditsRequest(account="x" * 100_000, amount=5, request_id="r"), "client"),
        (ledger_pb2.GrantCreditsRequest(account=account, amount=0, request_id="r"), "between 1"),
        (ledger_pb2.GrantCreditsRequest(account=account, amount=-7, request_id="r"), "between 1"),
        (ledger_pb2.GrantCreditsRequest(account=account, amount=5), "request_id"),
        (ledger_pb2.GrantCreditsRequest(account=account, amount=5, request_id="a b"), "spaces"),
    ]  # fmt: skip
    for request, fragment in bad:
        await expect(
            grpc.StatusCode.INVALID_ARGUMENT,
            ledger.GrantCredits(request, metadata=admin(harness)),
            fragment,
        )
    reply = await ledger.GrantCredits(grant, metadata=admin(harness))
    assert (reply.account, reply.available, reply.escrowed) == (account, 500, 0)
    assert (await ledger.GrantCredits(grant, metadata=admin(harness))).available == 500
    reused = ledger_pb2.GrantCreditsRequest(account=account, amount=900, request_id="r1")
    await expect(
        grpc.StatusCode.ALREADY_EXISTS, ledger.GrantCredits(reused, metadata=admin(harness))
    )
    report = await ledger.Audit(common_pb2.Empty(), metadata=admin(harness))
    assert report.ok and report.minted == 500
    await expect(grpc.StatusCode.UNAUTHENTICATED, ledger.Audit(common_pb2.Empty()))
    # Still serving.
    await harness.client_api.ListNodes(client_api_pb2.ListNodesRequest())


async def test_balance_queries_must_be_signed_fresh_and_for_balance(harness: Harness):
    ledger = stub(harness)
    key, account = client_account()
    await ledger.GrantCredits(
        ledger_pb2.GrantCreditsRequest(account=account, amount=42, request_id="r1"),
        metadata=admin(harness),
    )
    now = int(time.time() * 1000)
    reply = await ledger.GetBalance(identity.sign_ledger_query(key, "balance", now))
    assert (reply.account, reply.available) == (account, 42)
    forged = identity.sign_ledger_query(key, "balance", now)
    forged.public_key = identity.public_key_bytes(identity.generate_private_key())
    await expect(grpc.StatusCode.UNAUTHENTICATED, ledger.GetBalance(forged), "not signed")
    stale = identity.sign_ledger_query(key, "balance", now - 3_600_000)
    await expect(grpc.StatusCode.UNAUTHENTICATED, ledger.GetBalance(stale), "clock")
    wrong_purpose = identity.sign_ledger_query(key, "earnings", now)
    await expect(grpc.StatusCode.UNAUTHENTICATED, ledger.GetBalance(wrong_purpose))
    short = ledger_pb2.SignedQuery(public_key=b"\x01" * 5, unix_ms=now, signature=b"")
    await expect(grpc.StatusCode.INVALID_ARGUMENT, ledger.GetBalance(short), "32-byte")
    huge = ledger_pb2.SignedQuery(public_key=b"\x01" * 1_000_000, unix_ms=now)
    await expect(grpc.StatusCode.INVALID_ARGUMENT, ledger.GetEarnings(huge), "32-byte")


async def test_earnings_wait_out_the_window_then_release_and_hooks_reject_and_slash(
    harness: Harness,
):
    node = await harness.registered_node("earner")
    component = harness.ctx.ledger
    book = component.ledger
    _, account = client_account()
    book.grant(account, 100_000, "g1")
    prices = {node.node_id: NodeQuote(1000, "op-earner"), "n-other": NodeQuote(1000, "op-2")}
    for session in ("s1", "s2", "s3"):
        book.open_hold(session, account, 10_000, prices, 10**15, b"k" * 32)
    book.settle("s1", [Usage("r1", node.node_id, 0, 2, 1000)])  # 2000
    query = identity.sign_ledger_query(node.key, "earnings", int(time.time() * 1000))
    early = await stub(harness).GetEarnings(query)
    assert (early.node_id, early.pending, early.released) == (node.node_id, 2000, 0)
    assert early.next_release_unix_ms > 0
    with pytest.raises(Exception, match="challenge window"):
        (earning_id,) = [r[0] for r in book.db.execute("SELECT id FROM ledger_earnings")]
        book.release(earning_id)

    async def released() -> bool:
        return (await stub(harness).GetEarnings(query)).released == 2000

    await wait_until(released, timeout=5.0, what="the sweep to release after the window")
    # Verification outcomes from the verifier, straight into the component.
    book.settle("s2", [Usage("r2", node.node_id, 0, 2, 500)])  # 1000
    assert component.on_work_rejected(node.node_id, "s2", "output mismatch") == 1000
    book.settle("s3", [Usage("r3", node.node_id, 0, 2, 250)])  # 500
    assert component.on_fraud_proven(node.node_id, "op-earner", "ev-1") == 500
    final = await stub(harness).GetEarnings(query)
    assert (final.released, final.rejected, final.slashed, final.pending) == (2000, 1000, 500, 0)
    report = await stub(harness).Audit(common_pb2.Empty(), metadata=admin(harness))
    assert report.ok, report.violations


async def test_prices_come_from_registration_with_the_coordinator_default(harness: Harness):
    asking = harness.node("asking")
    await asking.register(capabilities=good_capabilities(price_per_1k_token_layers_units=777))
    default = await harness.registered_node("default")
    component = harness.ctx.ledger
    assert component.price_of(asking.node_id) == NodeQuote(777, "alice")
    assert component.price_of(default.node_id) == NodeQuote(0, "alice")  # harness default: free
    assert component.price_of("n-unknown").price == 0


def stake_request(key, amount: int, request_id: str, **override) -> ledger_pb2.StakeRequest:
    purpose = override.pop("purpose", f"stake {amount} {request_id}")
    now = override.pop("unix_ms", int(time.time() * 1000))
    return ledger_pb2.StakeRequest(
        amount=amount,
        request_id=request_id,
        query=identity.sign_ledger_query(key, purpose, now),
    )


async def test_an_operator_stakes_released_earnings_with_its_node_key(harness: Harness):
    node = await harness.registered_node("staker")  # operator account "alice"
    book = harness.ctx.ledger.ledger
    _, account = client_account()
    book.grant(account, 100_000, "g1")
    book.open_hold("s1", account, 10_000, {node.node_id: NodeQuote(1000, "alice")}, 10**15,
                   b"k" * 32)  # fmt: skip
    book.settle("s1", [Usage("r1", node.node_id, 0, 2, 1000)])  # 2000 pending
    ledger = stub(harness)
    early = ledger.DepositStake(stake_request(node.key, 500, "st0"))
    await expect(grpc.StatusCode.FAILED_PRECONDITION, early, "operator:alice")

    async def released() -> bool:
        query = identity.sign_ledger_query(node.key, "earnings", int(time.time() * 1000))
        return (await ledger.GetEarnings(query)).released == 2000

    await wait_until(released, timeout=5.0, what="the earnings to be released")
    reply = await ledger.DepositStake(stake_request(node.key, 500, "st1"))
    assert (reply.account, reply.staked, reply.available) == ("alice", 500, 1500)
    again = await ledger.DepositStake(stake_request(node.key, 500, "st1"))
    assert again.staked == 500, "a retried deposit stakes once"
    # Hostile and malformed deposits change nothing.
    stranger = identity.generate_private_key()
    forged = stake_request(node.key, 500, "st2")
    forged.amount = 1500  # the signature covers 500
    for request, code in (
        (forged, grpc.StatusCode.UNAUTHENTICATED),
        (stake_request(node.key, 500, "st3", purpose="earnings"), grpc.StatusCode.UNAUTHENTICATED),
        (stake_request(node.key, 500, "st4", unix_ms=1), grpc.StatusCode.UNAUTHENTICATED),
        (stake_request(node.key, 0, "st5"), grpc.StatusCode.INVALID_ARGUMENT),
        (stake_request(node.key, -7, "st6"), grpc.StatusCode.INVALID_ARGUMENT),
        (stake_request(node.key, 500, ""), grpc.StatusCode.INVALID_ARGUMENT),
        (stake_request(node.key, 500, "x" * 100_000), grpc.StatusCode.INVALID_ARGUMENT),
        (stake_request(node.key, 10**9, "st7"), grpc.StatusCode.FAILED_PRECONDITION),
        (stake_request(node.key, 500, "st1"), grpc.StatusCode.OK),  # same id, same amount
        (stake_request(node.key, 600, "st1"), grpc.StatusCode.ALREADY_EXISTS),
        (ledger_pb2.StakeRequest(amount=5, request_id="st8"), grpc.StatusCode.INVALID_ARGUMENT),
    ):
        if code == grpc.StatusCode.OK:
            await ledger.DepositStake(request)
            continue
        await expect(code, ledger.DepositStake(request))
    # A stranger's key stakes from its own (empty) operator account, never alice's.
    await expect(grpc.StatusCode.FAILED_PRECONDITION,
                 ledger.DepositStake(stake_request(stranger, 100, "st9")))  # fmt: skip
    assert book.balance("stake:alice") == 500
    # Proven fraud takes the stake with the pending earnings.
    book.open_hold("s2", account, 10_000, {node.node_id: NodeQuote(1000, "alice")}, 10**15,
                   b"k" * 32)  # fmt: skip
    book.settle("s2", [Usage("r2", node.node_id, 0, 2, 100)])  # 200 pending
    assert harness.ctx.ledger.on_fraud_proven(node.node_id, "alice", "ev-1") == 700
    query = identity.sign_ledger_query(node.key, "earnings", int(time.time() * 1000))
    final = await ledger.GetEarnings(query)
    assert (final.staked, final.slashed, final.available) == (0, 200, 1500)
    report = await ledger.Audit(common_pb2.Empty(), metadata=admin(harness))
    assert report.ok, report.violations


def signed_usage(node, client_key, session_id: str, tokens: int, billed: int | None = None):
    body = ledger_pb2.UsageReceipt(
        session_id=session_id, node_id=node.node_id, node_public_key=node.public_key,
        layer_start=0, layer_end=2, tokens=tokens, first_step=1, last_step=tokens,
    ).SerializeToString(deterministic=True)  # fmt: skip
    billed = tokens if billed is None else billed
    return ledger_pb2.SignedUsage(
        receipt=body,
        node_signature=node.key.sign(identity.usage_payload(body)),
        client_signature=client_key.sign(identity.usage_countersign_payload(body, billed)),
        billed_tokens=billed,
    )


async def test_settle_usage_pays_periodically_and_refuses_hostile_receipts(harness: Harness):
    node = await harness.registered_node("worker")
    book = harness.ctx.ledger.ledger
    key, account = client_account()
    book.grant(account, 100_000, "g1")
    client_public = identity.public_key_bytes(key)
    book.open_hold("s1", account, 10_000, {node.node_id: NodeQuote(1000, "alice")}, 10**15,
                   client_public)  # fmt: skip
    ledger = stub(harness)

    def request(*usage) -> ledger_pb2.SettleUsageRequest:
        return ledger_pb2.SettleUsageRequest(session_id="s1", usage=list(usage))

    old = signed_usage(node, key, "s1", 1000)
    first = await ledger.SettleUsage(request(old))
    assert (first.charged, first.refunded, first.closed) == (2000, 0, False)
    newer = signed_usage(node, key, "s1", 1500)
    assert (await ledger.SettleUsage(request(newer))).charged == 3000
    # A hostile replay of the older periodic receipt (or of the same one) pays nothing.
    assert (await ledger.SettleUsage(request(old))).charged == 3000
    assert (await ledger.SettleUsage(request(newer))).charged == 3000
    # The client paid for checks only what it counter-signed as billed.
    checked = signed_usage(node, key, "s1", 2500, billed=2000)
    assert (await ledger.SettleUsage(request(checked))).charged == 4000
    inflated = signed_usage(node, key, "s1", 9000)
    inflated.receipt = ledger_pb2.UsageReceipt(
        session_id="s1", node_id=node.node_id, node_public_key=node.public_key, layer_start=0,
        layer_end=2, tokens=90_000, first_step=1, last_step=9,
    ).SerializeToString()  # fmt: skip
    stranger = identity.generate_private_key()
    over_billed = signed_usage(node, key, "s1", 3000, billed=3001)
    for bad, code in (
        (request(inflated), grpc.StatusCode.UNAUTHENTICATED),
        (request(signed_usage(node, stranger, "s1", 5000)), grpc.StatusCode.UNAUTHENTICATED),
        (request(signed_usage(node, key, "s-other", 5000)), grpc.StatusCode.PERMISSION_DENIED),
        (request(over_billed), grpc.StatusCode.INVALID_ARGUMENT),
        (request(ledger_pb2.SignedUsage(receipt=b"\xff" * 10)), grpc.StatusCode.INVALID_ARGUMENT),
        (request(ledger_pb2.SignedUsage(receipt=b"x" * 5000)), grpc.StatusCode.INVALID_ARGUMENT),
        (request(*[old] * 5000), grpc.StatusCode.RESOURCE_EXHAUSTED),
        (request(old, old), grpc.StatusCode.INVALID_ARGUMENT),
        (ledger_pb2.SettleUsageRequest(session_id="s-none"), grpc.StatusCode.NOT_FOUND),
        (ledger_pb2.SettleUsageRequest(session_id="x" * 100_000), grpc.StatusCode.NOT_FOUND),
    ):
        await expect(code, ledger.SettleUsage(bad))
    assert book.client_balance(account).escrowed == 10_000 - 4000, "the hold shrank, once"
    report = await ledger.Audit(common_pb2.Empty(), metadata=admin(harness))
    assert report.ok, report.violations
