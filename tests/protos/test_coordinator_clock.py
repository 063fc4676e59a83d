"""protos/coordinator_clock.py: reading the coordinator's time off a refusal of a stale
stamp, over a real gRPC server, and what a caller learns from it."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import grpc
import pytest
from support.wrong_clock import set_clock_off

from protos import coordinator_clock
from protos.coordinator_clock import CLOCK_TRAILER, StampClock, coordinator_ms_in

HOUR_MS = 3_600_000
METHOD = "/test.Clock/Call"


@pytest.fixture
async def refusing() -> AsyncIterator[tuple[grpc.aio.Channel, list[tuple]]]:
    """A server whose one method aborts with the status and trailer the test queues."""
    answers: list[tuple] = []

    async def call(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        code, trailer = answers.pop(0)
        await context.abort(code, "refused", trailing_metadata=trailer)
        return b""

    handler = grpc.method_handlers_generic_handler(
        "test.Clock", {"Call": grpc.unary_unary_rpc_method_handler(call)}
    )
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield channel, answers
    finally:
        await channel.close()
        await server.stop(None)


async def refusal(refusing, code: grpc.StatusCode, trailer: tuple) -> grpc.aio.AioRpcError:
    channel, answers = refusing
    answers.append((code, trailer))
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await channel.unary_unary(METHOD)(b"")
    return err.value


async def test_a_stale_stamp_refusal_carries_the_coordinators_clock(refusing):
    now_ms = int(time.time() * 1000)
    err = await refusal(
        refusing, grpc.StatusCode.UNAUTHENTICATED, coordinator_clock.clock_trailer(now_ms)
    )
    assert coordinator_ms_in(err) == now_ms


@pytest.mark.parametrize(
    "code, trailer",
    [
        # Another refusal that happens to carry the trailer: not about the stamp.
        (grpc.StatusCode.PERMISSION_DENIED, ((CLOCK_TRAILER, "1800000000000"),)),
        (grpc.StatusCode.UNAUTHENTICATED, ()),  # an older coordinator: no trailer
        (grpc.StatusCode.UNAUTHENTICATED, ((CLOCK_TRAILER, "soon"),)),
        (grpc.StatusCode.UNAUTHENTICATED, ((CLOCK_TRAILER, "-5"),)),
        (grpc.StatusCode.UNAUTHENTICATED, ((CLOCK_TRAILER, str(10**20)),)),  # year 3 billion
        (grpc.StatusCode.UNAUTHENTICATED, (("x-other", "1800000000000"),)),
    ],
)
async def test_no_clock_is_read_off_other_refusals_or_nonsense(refusing, code, trailer):
    err = await refusal(refusing, code, trailer)
    assert coordinator_ms_in(err) is None
    clock = StampClock()
    assert not clock.learn(err) and clock.offset_ms == 0


async def test_a_clock_hours_ahead_learns_the_offset_once_and_warns(refusing, caplog, monkeypatch):
    coordinator_ms = int(time.time() * 1000)
    set_clock_off(monkeypatch, 2 * HOUR_MS / 1000)
    clock = StampClock()
    assert clock.now_ms() - coordinator_ms > HOUR_MS
    err = await refusal(
        refusing, grpc.StatusCode.UNAUTHENTICATED, coordinator_clock.clock_trailer(coordinator_ms)
    )
    with caplog.at_level("WARNING", logger="tessera.clock"):
        assert clock.learn(err)
    assert abs(clock.now_ms() - coordinator_ms) < 2_000
    assert "2.0 h ahead of the coordinator's" in caplog.text
    # The same refusal again: this clock agrees with it already, so a retry would be
    # refused alike: no second try.
    assert not clock.learn(err)


async def test_a_clock_seconds_behind_is_described_in_seconds(refusing, caplog):
    err = await refusal(
        refusing,
        grpc.StatusCode.UNAUTHENTICATED,
        coordinator_clock.clock_trailer(int(time.time() * 1000) + 400_000),
    )
    with caplog.at_level("WARNING", logger="tessera.clock"):
        assert StampClock().learn(err)
    assert "400 s behind the coordinator's" in caplog.text
