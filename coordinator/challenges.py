"""Single-use registration nonces, bound to the public key they were issued for."""

from __future__ import annotations

import hmac
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

NONCE_BYTES = 32


class ChallengeRejected(Exception):
    """The nonce cannot be used; str() says why (unknown, expired, foreign, reused)."""


@dataclass(frozen=True)
class _Pending:
    public_key: bytes
    expires_at: float  # on the store's monotonic clock


class ChallengeStore:
    """Outstanding nonces, oldest first.

    Bounded: when `max_pending` nonces are outstanding, the oldest is forgotten, so a flood
    of GetChallenge calls costs at most `max_pending` entries of memory. A nonce is removed
    when it is used, so a replay finds nothing.
    """

    def __init__(
        self,
        ttl_s: float = 60.0,
        max_pending: int = 100_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.ttl_s = ttl_s
        self.max_pending = max_pending
        self._clock = clock
        self._pending: OrderedDict[bytes, _Pending] = OrderedDict()

    def __len__(self) -> int:
        return len(self._pending)

    def issue(self, public_key: bytes) -> tuple[bytes, float]:
        """A fresh nonce for `public_key` and its lifetime in seconds."""
        now = self._clock()
        self._drop_expired(now)
        while len(self._pending) >= self.max_pending:
            self._pending.popitem(last=False)
        nonce = secrets.token_bytes(NONCE_BYTES)
        self._pending[nonce] = _Pending(public_key, now + self.ttl_s)
        return nonce, self.ttl_s

    def check(self, nonce: bytes, public_key: bytes) -> None:
        """Raise ChallengeRejected unless `nonce` is outstanding, fresh and for `public_key`."""
        pending = self._pending.get(nonce)
        if pending is None:
            raise ChallengeRejected(
                "unknown or already used nonce; ask GetChallenge for a fresh one"
            )
        if self._clock() > pending.expires_at:
            del self._pending[nonce]
            raise ChallengeRejected(
                f"the nonce expired (valid {self.ttl_s:g} s); ask GetChallenge for a fresh one"
            )
        if not hmac.compare_digest(pending.public_key, public_key):
            raise ChallengeRejected("the nonce was issued for a different public key")

    def consume(self, nonce: bytes) -> None:
        self._pending.pop(nonce, None)

    def _drop_expired(self, now: float) -> None:
        # Entries are in issue order with one TTL, so expired ones are all at the front.
        while self._pending:
            nonce, pending = next(iter(self._pending.items()))
            if pending.expires_at >= now:
                break
            del self._pending[nonce]
