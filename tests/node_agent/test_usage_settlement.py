"""The node's own settlement of acknowledged receipts (node_agent/usage_settlement.py),
against a gRPC Ledger on loopback whose answers the test scripts: the newest receipt per
layer range goes, a coordinator that cannot be reached is tried again with what is
newest by then, and a session the coordinator refuses for good is dropped.
(tests/ledger/test_acknowledged_usage_e2e.py runs it against the real coordinator.)"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import pytest
from support.coordinator_harness import wait_until

from node_agent.usage_settlement import SETTLE_EVERY_ENV, UsageSettler, settle_every_s
from protos.tessera.v1 import ledger_pb2, ledger_pb2_grpc


class ScriptedLedger(ledger_pb2_grpc.LedgerServicer):
    def __init__(self) -> None:
        self.requests: list[ledger_pb2.SettleUsageRequest] = []
        self.refuse: list[grpc.StatusCode] = []  # answers to come, in order; then OK

    async def SettleUsage(self, request, context):  # noqa: N802
        self.requests.append(request)
        if self.refuse:
            await context.abort(self.refuse.pop(0), "scripted")
        return ledger_pb2.Settlement(session_id=request.session_id, charged=1)


@pytest.fixture
async def ledger() -> AsyncIterator[tuple[ScriptedLedger, str]]:
    server = grpc.aio.server()
    servicer = ScriptedLedger()
    ledger_pb2_grpc.add_LedgerServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    yield servicer, f"127.0.0.1:{port}"
    await server.stop(0)


def receipt(session: str, start: int, end: int, tokens: int) -> ledger_pb2.UsageReceipt:
    return ledger_pb2.UsageReceipt(
        session_id=session, layer_start=start, layer_end=end, tokens=tokens
    )


def signed(r: ledger_pb2.UsageReceipt) -> ledger_pb2.SignedUsage:
    return ledger_pb2.SignedUsage(receipt=r.SerializeToString(), billed_tokens=r.tokens)


def tokens_sent(request: ledger_pb2.SettleUsageRequest) -> list[int]:
    return sorted(ledger_pb2.UsageReceipt.FromString(u.receipt).tokens for u in request.usage)


async def test_the_newest_receipt_per_layer_range_is_settled_and_retried_when_unreachable(
    ledger,
) -> None:
    servicer, address = ledger
    settler = UsageSettler(address, [], every_s=0.05)
    servicer.refuse = [grpc.StatusCode.UNAVAILABLE]
    try:
        for tokens in (4, 9, 6):  # 6 arrives late: older than 9, never sent
            r = receipt("s1", 0, 2, tokens)
            settler.add(r, signed(r))
        other = receipt("s1", 2, 4, 5)
        settler.add(other, signed(other))
        await wait_until(lambda: len(settler.settled) == 1, 10.0, "a settlement")
        # The first try met UNAVAILABLE; the second sent the same newest receipts.
        assert [tokens_sent(r) for r in servicer.requests] == [[5, 9], [5, 9]]
        # Once settled, nothing is sent again until something new is acknowledged.
        await asyncio.sleep(0.2)
        assert len(servicer.requests) == 2
        newer = receipt("s1", 0, 2, 12)
        settler.add(newer, signed(newer))
        await wait_until(lambda: len(settler.settled) == 2, 10.0, "the second settlement")
        assert tokens_sent(servicer.requests[-1]) == [12]
    finally:
        await settler.close()


async def test_a_session_the_coordinator_refuses_for_good_is_dropped(ledger) -> None:
    servicer, address = ledger
    settler = UsageSettler(address, [], every_s=0.05)
    servicer.refuse = [grpc.StatusCode.FAILED_PRECONDITION]  # closed: its client settled
    try:
        r = receipt("s-closed", 0, 2, 3)
        settler.add(r, signed(r))
        await wait_until(lambda: len(servicer.requests) == 1, 10.0, "the refused settlement")
        await asyncio.sleep(0.3)
        assert len(servicer.requests) == 1 and not settler.settled
    finally:
        await settler.close()


async def test_what_waits_is_settled_once_more_when_the_node_stops(ledger) -> None:
    servicer, address = ledger
    settler = UsageSettler(address, [], every_s=3600)
    r = receipt("s1", 0, 2, 3)
    settler.add(r, signed(r))
    await settler.close()
    assert [tokens_sent(r) for r in servicer.requests] == [[3]]


def test_the_interval_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SETTLE_EVERY_ENV, "0.5")
    assert settle_every_s() == 0.5
    for bad in ("soon", "0", "-1", "inf", "nan"):
        monkeypatch.setenv(SETTLE_EVERY_ENV, bad)
        assert settle_every_s() == 10.0
