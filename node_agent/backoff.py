"""Exponential back-off with full jitter, for reconnecting to the coordinator.

Full jitter (a uniform draw between 0 and the exponential ceiling) spreads out a whole
swarm that lost its coordinator at the same moment, so the restarted coordinator is not
hit by every node at once.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass, field

DEFAULT_BASE_S = 0.5
DEFAULT_CAP_S = 30.0
# Tests and the local swarm launcher shorten the waits through these.
BASE_ENV = "TESSERA_BACKOFF_BASE_S"
CAP_ENV = "TESSERA_BACKOFF_CAP_S"


@dataclass
class Backoff:
    base_s: float = DEFAULT_BASE_S
    cap_s: float = DEFAULT_CAP_S
    rng: random.Random = field(default_factory=random.Random)
    attempt: int = 0

    def __post_init__(self) -> None:
        if self.base_s <= 0 or self.cap_s < self.base_s:
            raise ValueError(f"back-off needs 0 < base ({self.base_s}) <= cap ({self.cap_s})")

    def ceiling(self) -> float:
        """The longest the next wait can be."""
        # Exponents beyond 63 only overflow; the cap has long been reached by then.
        return min(self.cap_s, self.base_s * 2 ** min(self.attempt, 63))

    def next_delay(self) -> float:
        delay = self.rng.uniform(0.0, self.ceiling())
        self.attempt += 1
        return delay

    def reset(self) -> None:
        """Call after a success, so the next outage starts with short waits again."""
        self.attempt = 0


def from_env(base_s: float | None = None, cap_s: float | None = None) -> Backoff:
    """Explicit values win, then the environment, then the defaults."""
    base = base_s if base_s is not None else float(os.environ.get(BASE_ENV, DEFAULT_BASE_S))
    cap = cap_s if cap_s is not None else float(os.environ.get(CAP_ENV, DEFAULT_CAP_S))
    return Backoff(base_s=base, cap_s=max(cap, base))
