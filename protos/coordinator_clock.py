"""The coordinator's clock, for requests that carry the time they were signed.

Signed requests (opening a paid session or a training job, ledger queries) carry their
signing time, and the coordinator refuses a stamp more than a few minutes off its own
clock, so that a captured request cannot be replayed later. Users' and volunteers' PCs are
often minutes or hours off (no NTP, a dual-boot hardware clock), so that refusal carries
the coordinator's time in its trailing metadata: the caller learns its offset and stamps
its next try with the coordinator's time instead of giving up.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import grpc

log = logging.getLogger("tessera.clock")

CLOCK_TRAILER = "tessera-coordinator-unix-ms"
# Anything outside these years is not a clock but a bug or a lie: ignored.
_EARLIEST_MS = 1_577_836_800_000  # 2020-01-01
_LATEST_MS = 4_102_444_800_000  # 2100-01-01
# Offsets below this are what a round trip adds, not a wrong clock.
_NOTICEABLE_MS = 2_000

Trailer = tuple[tuple[str, str], ...]


def clock_trailer(now_ms: int) -> Trailer:
    """The trailing metadata of a refusal of a stale stamp."""
    return ((CLOCK_TRAILER, str(now_ms)),)


def coordinator_ms_in(err: grpc.RpcError) -> int | None:
    """The coordinator's clock in a refusal of a stale stamp (UNAUTHENTICATED with the
    trailer), or None."""
    code = getattr(err, "code", None)
    if not callable(code) or code() != grpc.StatusCode.UNAUTHENTICATED:
        return None
    trailing = getattr(err, "trailing_metadata", None)
    for key, value in (trailing() if callable(trailing) else None) or ():
        if key != CLOCK_TRAILER:
            continue
        try:
            ms = int(value)
        except (TypeError, ValueError):
            return None
        return ms if _EARLIEST_MS <= ms <= _LATEST_MS else None
    return None


@dataclass
class StampClock:
    """This machine's clock, corrected by what the coordinator said of its own."""

    offset_ms: int = 0

    def now_ms(self) -> int:
        return int(time.time() * 1000) + self.offset_ms

    def learn(self, err: grpc.RpcError) -> bool:
        """Take the coordinator's time from a refusal of a stale stamp. True when that
        moved this clock, so a request stamped anew can pass; False when ``err`` is no such
        refusal or this clock already agreed (a retry would be refused alike)."""
        coordinator_ms = coordinator_ms_in(err)
        if coordinator_ms is None:
            return False
        offset_ms = coordinator_ms - int(time.time() * 1000)
        if abs(offset_ms - self.offset_ms) < _NOTICEABLE_MS:
            return False
        self.offset_ms = offset_ms
        log.warning(
            "this machine's clock is %s the coordinator's: signed requests are stamped with "
            "the coordinator's time from now on (set this machine's clock, e.g. turn on "
            "network time, to stop this)",
            _describe(-offset_ms),
        )
        return True


def _describe(ahead_ms: int) -> str:
    seconds = abs(ahead_ms) / 1000
    amount = f"{seconds / 3600:.1f} h" if seconds >= 3600 else f"{seconds:.0f} s"
    return f"{amount} {'ahead of' if ahead_ms > 0 else 'behind'}"
