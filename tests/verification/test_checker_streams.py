"""One call at a time on a checker's stream, whatever gets cancelled or handed over.

Checks and catch-ups for one checker share its Forward stream and take turns on it. A
check cancelled while queued (a rollback or a failed primary makes later checks moot)
must not let the work behind it start while the work before it still has a call on the
stream: two overlapping calls on one gRPC stream fail (GRPC_CALL_ERROR_TOO_MANY_OPERATIONS)
or read each other's answers, and a check that never gets its answer holds a token back
for the whole check timeout.
"""

from __future__ import annotations

import asyncio

import pytest

from client.channels import ChannelPool
from client.records import HopRecord
from client.route_history import RouteHistory, Span
from client.verification import (
    CheckerServes,
    NodeRejected,
    PendingCheck,
    StageVerifier,
    _CheckerStream,
)
from protos.tessera.v1 import common_pb2, stage_pb2

CHECKER = HopRecord("checker-1", "127.0.0.1:1", 0, 2)
SPAN = Span(0, 2)
HISTORY = RouteHistory([SPAN])


class FakeCall:
    """Stands in for a stream's gRPC call: only whether it was cancelled matters here."""

    def __init__(self) -> None:
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


async def test_work_behind_a_cancelled_queued_check_waits_for_the_work_before_it() -> None:
    verifier = StageVerifier("s-1", ChannelPool())
    order: list[str] = []
    started, release = asyncio.Event(), asyncio.Event()

    async def first() -> None:
        order.append("first starts")
        started.set()
        await release.wait()
        order.append("first ends")

    async def moot() -> None:
        order.append("moot")

    async def third() -> None:
        order.append("third")

    a = verifier._queue(CHECKER, SPAN, first)
    await started.wait()
    b = verifier._queue(CHECKER, SPAN, moot)
    c = verifier._queue(CHECKER, SPAN, third)
    b.cancel()
    await asyncio.sleep(0.05)
    assert order == ["first starts"]  # third waits for first, not for the cancelled one
    release.set()
    await asyncio.gather(a, c)
    assert order == ["first starts", "first ends", "third"]
    assert b.cancelled()


async def test_a_check_cancelled_mid_call_closes_its_stream_and_a_queued_one_does_not() -> None:
    verifier = StageVerifier("s-2", ChannelPool())
    call = FakeCall()
    verifier._streams[CHECKER.node_id] = _CheckerStream(CHECKER.address, call)  # type: ignore[arg-type]
    started = asyncio.Event()

    async def waits_for_an_answer() -> None:
        started.set()
        await asyncio.sleep(60)

    running = verifier._queue(CHECKER, SPAN, waits_for_an_answer)
    queued = verifier._queue(CHECKER, SPAN, waits_for_an_answer)
    await started.wait()
    queued.cancel()
    await asyncio.sleep(0.05)
    assert not call.cancelled  # the running call's stream is left alone
    assert CHECKER.node_id in verifier._streams
    running.cancel()
    await asyncio.sleep(0.05)
    assert call.cancelled  # its answer may still come: nobody may read it as theirs
    assert CHECKER.node_id not in verifier._streams


async def test_work_for_a_span_its_checker_now_serves_is_dropped_once_the_running_ends() -> None:
    # A fail-over made the checker the span's node in the pipeline: the check work of that
    # span queued for it would roll back the pipeline's cache there, so it is dropped; the
    # work it runs now is waited for before the pipeline replays on that cache.
    verifier = StageVerifier("s-3", ChannelPool())
    order: list[str] = []
    started, release = asyncio.Event(), asyncio.Event()

    async def running() -> None:
        order.append("running starts")
        started.set()
        await release.wait()
        order.append("running ends")

    async def queued(name: str) -> None:
        order.append(name)

    a = verifier._queue(CHECKER, SPAN, running)
    await started.wait()
    same = verifier._queue(CHECKER, SPAN, lambda: queued("same span"))
    other = verifier._queue(CHECKER, Span(2, 4), lambda: queued("other span"))
    handing_over = asyncio.ensure_future(verifier.serving(CHECKER.node_id, SPAN))
    await asyncio.sleep(0.05)
    assert not handing_over.done()  # the running work's call must land first
    release.set()
    await handing_over
    assert order[:2] == ["running starts", "running ends"]
    outcomes = await asyncio.gather(a, same, other, return_exceptions=True)
    assert isinstance(outcomes[1], CheckerServes)
    assert order == ["running starts", "running ends", "other span"]


class ReadingCall(FakeCall):
    """A call whose answer never comes; cancelled, its read raises CancelledError as a
    grpc.aio call cancelled locally does (though no task was cancelled)."""

    def __init__(self) -> None:
        super().__init__()
        self._gone = asyncio.Event()

    def cancel(self) -> None:
        super().cancel()
        self._gone.set()

    async def write(self, message: object) -> None:
        pass

    async def read(self) -> object:
        await self._gone.wait()
        raise asyncio.CancelledError()


async def test_a_stream_closed_under_running_work_fails_that_check_not_the_generation() -> None:
    verifier = StageVerifier("s-4", ChannelPool())
    call = ReadingCall()
    verifier._streams[CHECKER.node_id] = _CheckerStream(CHECKER.address, call)  # type: ignore[arg-type]
    message = stage_pb2.ForwardRequest(
        input=common_pb2.Tensor(dtype="float32", shape=[1, 1, 8]),
        layers=common_pb2.LayerRange(start=0, end=2),
    )
    work = verifier._queue(CHECKER, SPAN, lambda: verifier._send(CHECKER, [message], checks=1))
    await asyncio.sleep(0.05)
    verifier._close_stream(CHECKER.node_id)  # what another check's failure does
    with pytest.raises(NodeRejected, match="was closed"):
        await work
    assert not work.cancelled()


async def test_a_failed_checks_late_cleanup_leaves_the_stream_of_newer_work_alone() -> None:
    # A check failed and its work ended; newer work for the same checker has opened a new
    # stream by the time the driver settles the failed check.
    verifier = StageVerifier("s-5", ChannelPool())
    failed = asyncio.get_running_loop().create_future()
    failed.set_exception(NodeRejected("checker checker-1 did not answer"))
    started = asyncio.Event()

    async def newer() -> None:
        verifier._streams[CHECKER.node_id] = _CheckerStream(CHECKER.address, ReadingCall())  # type: ignore[arg-type]
        started.set()
        await asyncio.sleep(60)

    running = verifier._queue(CHECKER, Span(2, 4), newer)
    await started.wait()
    hop = HopRecord("primary-1", "127.0.0.1:2", 0, 2)
    pending = PendingCheck(verifier, CHECKER, failed)  # type: ignore[arg-type]
    await verifier.settle(
        hop, stage_pb2.ForwardRequest(), stage_pb2.ForwardResponse(), None, pending
    )  # type: ignore[arg-type]
    assert CHECKER.node_id in verifier._streams  # the newer work still has its stream
    running.cancel()
    await asyncio.sleep(0.05)
    assert CHECKER.node_id not in verifier._streams


def decode_call(position: int) -> stage_pb2.ForwardRequest:
    request = stage_pb2.ForwardRequest(start_pos=position)
    request.layers.start, request.layers.end = SPAN.start, SPAN.end
    request.input.shape.extend([1, 1])
    return request


def test_a_checks_patience_scales_with_the_primarys_time_and_the_checkers_catch_up() -> None:
    verifier = StageVerifier("s-6", ChannelPool(), patience_floor_s=1.0, patience_factor=8.0)
    call = decode_call(99)  # position 99: the checker needs 100 positions to check it
    verifier._synced[(CHECKER.node_id, SPAN)] = 99
    # In step with the call: the factor times the primary's time, or the floor.
    assert verifier._patience(CHECKER, call, wall_s=0.5) == pytest.approx(4.0)
    assert verifier._patience(CHECKER, call, wall_s=0.01) == pytest.approx(1.0)
    # 9 positions behind: each counted as costly as the call itself.
    verifier._synced[(CHECKER.node_id, SPAN)] = 90
    assert verifier._patience(CHECKER, call, wall_s=0.05) == pytest.approx(8 * 0.05 * 10)
    # A checker with no cache yet catches up on the whole history, within the timeout.
    del verifier._synced[(CHECKER.node_id, SPAN)]
    assert verifier._patience(CHECKER, call, wall_s=0.05) == pytest.approx(40.0)
    assert verifier._patience(CHECKER, call, wall_s=0.5) == pytest.approx(120.0)


async def test_settling_a_check_past_its_deadline_gives_its_checker_up() -> None:
    verifier = StageVerifier("s-7", ChannelPool())
    never = asyncio.Event()

    async def hung() -> stage_pb2.ForwardResponse:
        await never.wait()
        raise AssertionError("unreachable")

    pending = PendingCheck(verifier, CHECKER, verifier._queue(CHECKER, SPAN, hung))
    assert not pending.ready()  # no deadline yet: settling would wait for the answer
    pending.deadline = 0.0
    assert pending.ready()
    primary = HopRecord("primary-1", "127.0.0.1:2", 0, 2)
    await verifier.settle(primary, decode_call(5), stage_pb2.ForwardResponse(), HISTORY, pending)
    await asyncio.sleep(0)
    assert pending.task.cancelled()
    assert verifier.stats.late == {CHECKER.node_id: 1}
    assert CHECKER.node_id in verifier._unfit_checkers  # drawn no more in the session
