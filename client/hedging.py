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
    A failed hedge is ignored (the primary is awaited). The loser is cancelled.
    """
    began = time.monotonic()
    first = asyncio.ensure_future(primary)
    try:
        done, _ = await asyncio.wait({first}, timeout=delay_s)
        if done:
            return RaceResult(first.result(), False, False, None, 0.0, time.monotonic() - began)
        hedged_after = time.monotonic() - began
        second = asyncio.ensure_future(start_hedge())
        try:
            pending: set[asyncio.Future[Any]] = {first, second}
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                if second in done and second.exception() is None:
                    hedge, value = second.result()
                    return RaceResult(
                        value, True, True, hedge, hedged_after, time.monotonic() - began
                    )
                if first in done:
                    error = first.exception()
                    if error is None:
                        return RaceResult(
                            first.result(), True, False, None, hedged_after,
                            time.monotonic() - began,
                        )  # fmt: skip
                    if not isinstance(error, primary_errors) or second.done():
                        raise error
                if second in done and not isinstance(second.exception(), hedge_errors):
                    raise second.exception()  # type: ignore[misc]
            raise first.exception()  # type: ignore[misc]  # both failed: the primary's error
        finally:
            await _cancel(second)
    finally:
        await _cancel(first)


async def _cancel(future: asyncio.Future[Any]) -> None:
    if future.done():
        if not future.cancelled():
            future.exception()  # retrieved: no "exception was never retrieved" warning
        return
    future.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await future
