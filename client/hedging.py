"""Straggler hedging: when a stage call runs past its usual time, ask a replica too.

A decode step waits for every stage in turn, so one slow node (a busy GPU, a congested
link) slows every token. The driver keeps each hop's recent decode times; when a call has
run for `hedge_factor` x their p95 (and at least `hedge_floor_s`), it sends the same step to
an alternate of that stage (first replaying the session's history there, since the
alternate has no KV cache for it) and takes whichever answer comes first. If the hedge
wins, the alternate becomes the hop's primary and the slow node goes to the back of the
alternates; the driver reports the slow call's time so the coordinator's router learns it.

When it helps and when it costs (docs/hedging.md): redundancy pays at low and moderate
load, where a replica is idle anyway (Aktas & Soljanin); at high load every hedge is extra
work on a busy replica and a replay of the whole history, so the factor keeps hedges to
calls that are already far in the tail.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import asdict, dataclass
from typing import Any, Generic, TypeVar

T = TypeVar("T")
H = TypeVar("H")


@dataclass(frozen=True)
class HedgeEvent:
    """One hedged stage call: who was slow, who was asked too, who answered first."""

    step: int
    start: int
    end: int
    slow_node_id: str
    alternate_node_id: str
    winner: str  # "primary" | "alternate"
    hedged_after_ms: float  # how long the primary had run when the hedge went out
    answered_ms: float  # from the primary's request to the first answer
    replayed_tokens: int  # the history the alternate had to run first

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def hedge_delay(
    recent_s: Iterable[float], *, factor: float, floor_s: float, min_samples: int
) -> float | None:
    """Seconds to wait before hedging a call, or None (hedging off, or too few samples)."""
    samples = list(recent_s)
    if factor <= 0 or len(samples) < min_samples:
        return None
    return max(floor_s, factor * percentile(samples, 95.0))


def percentile(values: Iterable[float], q: float) -> float:
    """numpy's default (linear) percentile; np.percentile costs ~0.1 ms, this a few us."""
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100.0
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


@dataclass
class RaceResult(Generic[T, H]):
    value: T
    hedged: bool  # the hedge was sent
    alternate_won: bool
    hedge: H | None  # what start_hedge returned alongside its value (e.g. its stream)
    hedged_after_s: float
    answered_s: float


async def race(
    primary: Awaitable[T],
    start_hedge: Callable[[], Awaitable[tuple[H, T]]],
    delay_s: float,
    *,
    hedge_errors: tuple[type[BaseException], ...] = (Exception,),
    primary_errors: tuple[type[BaseException], ...] = (),
) -> RaceResult[T, H]:
    """Await `primary`; if it has not answered after `delay_s`, also start the hedge and
    return the first success. A primary failure of a type in `primary_errors` lets a
    running hedge still answer; any other primary failure cancels the hedge and raises.
    A failed hedge is ignored (the primary is awaited), unless its error is not one of
    `hedge_errors`: that one is raised. The loser is cancelled.

    The primary runs in the calling task, not a task of its own: nearly every call
    answers before `delay_s`, and a task plus `asyncio.wait` per hop would cost two more
    event-loop passes on every decode step. A timer starts the hedge; a hedge that
    finishes first interrupts the primary by cancelling this task (as `asyncio.timeout`
    does), which is told apart from a cancellation from outside by its count.
    """
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    assert task is not None
    began = time.monotonic()
    hedge: asyncio.Future[tuple[H, T]] | None = None
    hedged_after = 0.0
    primary_running = True
    interrupted = False

    def hedge_done(future: asyncio.Future[tuple[H, T]]) -> None:
        nonlocal interrupted
        if future.cancelled() or not primary_running:
            return
        error = future.exception()
        if error is None or not isinstance(error, hedge_errors):
            interrupted = True
            task.cancel()

    def send_hedge() -> None:
        nonlocal hedge, hedged_after
        hedged_after = time.monotonic() - began
        hedge = asyncio.ensure_future(start_hedge())
        hedge.add_done_callback(hedge_done)

    timer = loop.call_later(delay_s, send_hedge)
    try:
        try:
            value = await primary
        finally:
            primary_running = False
            timer.cancel()
    except asyncio.CancelledError:
        if not interrupted or task.uncancel() > 0:
            if hedge is not None:
                await _cancel(hedge)
            raise  # cancelled from outside
        assert hedge is not None
        outcome, answer = hedge.result()  # a hedge error not in hedge_errors raises here
        return RaceResult(answer, True, True, outcome, hedged_after, time.monotonic() - began)
    except BaseException as error:
        if hedge is None or not isinstance(error, primary_errors):
            if hedge is not None:
                await _cancel(hedge)
            raise
        # The primary failed while the hedge runs: the hedge may still answer.
        try:
            outcome, answer = await hedge
        except hedge_errors:
            raise error from None  # both failed: the primary's error
        return RaceResult(answer, True, True, outcome, hedged_after, time.monotonic() - began)
    if hedge is None:
        return RaceResult(value, False, False, None, 0.0, time.monotonic() - began)
    await _cancel(hedge)  # answered after the primary (or in the same pass): not needed
    return RaceResult(value, True, False, None, hedged_after, time.monotonic() - began)


async def _cancel(future: asyncio.Future[Any]) -> None:
    if future.done():
        if not future.cancelled():
            future.exception()  # retrieved: no "exception was never retrieved" warning
        return
    future.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await future
