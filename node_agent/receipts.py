"""Usage receipts: what this node has computed for each (session, layers), signed.

Every Forward answer carries the newest cumulative receipt for its session and layers:
token positions x batch processed so far (replays included), and the first and last step.
The client's driver counter-signs the last one it agrees with, and the coordinator pays
only for receipts both sides signed (protos.identity.usage_payload). Cumulative receipts
mean a lost answer loses nothing: the next one covers it.

The counts are kept in the node's data dir too (``save``, a few seconds apart and when the
node stops), so that a node restarted in the middle of a session goes on counting from
where it was. Were it to start again at 0, its receipts would claim less than the
coordinator already paid for that (session, layers), and it would be paid nothing until
its count caught up.

In a paid session the client also acknowledges receipts as it goes (Stage.Acknowledge:
the node's own receipt, counter-signed): ``owed`` is what the node computed past the
newest acknowledged one, which the stage server keeps under the session's credit, so a
client that withholds its receipts gets little work unpaid (docs/ledger.md).

The credit is per session, so a client could take it again and again in short sessions
that it never acknowledges. ``residue`` is what a client's other sessions left
unacknowledged here once they ended or went idle: past the credit, the node serves that
client's sessions no more until it acknowledges them, or the residue is old enough that
their holds can no longer be settled anyway.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from google.protobuf.message import DecodeError

from protos import identity
from protos.tessera.v1 import ledger_pb2

log = logging.getLogger(__name__)

# Counters of sessions that never said EndSession are dropped oldest first past this many;
# their last receipts are already with the client.
MAX_TRACKED = 65_536
# Only the counts of this many sessions, the most recently active, are written to disk: a
# write every few seconds must stay small. An older session counts from 0 after a restart.
MAX_SAVED = 4096
# A paid session counts towards its client's residue once it ended (EndSession) or made no
# call for this long: an honest client acknowledges a session's receipts as it ends, and
# its paused sessions within a few seconds (client/acknowledgments.py).
RESIDUE_IDLE_S = 30.0
# ... and stops counting once it made no call for this long: the coordinator settles a
# closed or expired session for 15 minutes, so past that its receipts cannot be paid any
# more, and an honest client that crashed is not shut out for good.
RESIDUE_TTL_S = 900.0


@dataclass
class _Tally:
    tokens: int
    first_step: int
    last_step: int
    acknowledged: int = 0  # the tokens of the newest receipt the client counter-signed
    # Not saved: a restarted node counts no residue for the sessions it had before.
    client: bytes = b""  # the key of a paid session's client
    ended: bool = False  # EndSession came while some of it was not acknowledged
    active_s: float = 0.0  # the meter's clock at its last call
    # The longest prefix held after a call, x batch (UsageReceipt.longest); kept on disk
    # after the other counts, being the newest of them.
    longest: int = 0

    def row(self) -> list[int]:
        return [self.tokens, self.first_step, self.last_step, self.acknowledged, self.longest]


class ReceiptRefused(ValueError):
    """An acknowledgment that acknowledges nothing: malformed, or for another session,
    node or layer range."""


class ReceiptForged(ReceiptRefused):
    """A signature that does not verify: not this node's receipt, or not counter-signed by
    the session's client key."""


class UsageMeter:
    def __init__(
        self,
        private_key: Ed25519PrivateKey,
        max_tracked: int = MAX_TRACKED,
        path: Path | None = None,
        clock: Callable[[], float] = time.monotonic,
        *,
        whole_counts: bool = False,
    ) -> None:
        """``whole_counts``: calls keep no prefix (training micro-batches), so a receipt's
        ``longest`` is its whole count: a stage's lockstep shadow only ever computes the
        samples its primary computes, so the most any node counted on a layer is work the
        job needed there once (what the ledger bills at the least, docs/ledger.md)."""
        self._key = private_key
        self._clock = clock
        self._whole_counts = whole_counts
        # client key -> the (session, layers) of its paid sessions counted here
        self._by_client: dict[bytes, set[tuple[str, int, int]]] = {}
        self._public = identity.public_key_bytes(private_key)
        self._node_id = identity.node_id(self._public)
        self._max = max_tracked
        self._tallies: OrderedDict[tuple[str, int, int], _Tally] = OrderedDict()
        self._path = path
        self._dirty = False
        if path is not None:
            self._load(path)

    def record(
        self,
        session_id: str,
        layer_start: int,
        layer_end: int,
        step: int,
        tokens: int,
        client: bytes = b"",
        longest: int = 0,
    ) -> ledger_pb2.SignedUsage:
        """Count `tokens` computed at `step` (for `client`, the key of a paid session's
        client), after which the node holds a prefix of `longest` positions x batch (0:
        calls that keep none); returns the signed cumulative receipt."""
        key = (session_id, layer_start, layer_end)
        tally = self._tallies.get(key)
        if tally is None:
            tally = self._tallies[key] = _Tally(0, step, step)
            while len(self._tallies) > self._max:
                self._drop(*self._tallies.popitem(last=False))
        else:
            self._tallies.move_to_end(key)
        if client and not tally.client:
            tally.client = client
            self._by_client.setdefault(client, set()).add(key)
        tally.active_s = self._clock()
        tally.tokens += tokens
        # Never past the count, which the client and the ledger would refuse: a tally
        # dropped while its cache lived (past MAX_TRACKED) counts again from 0.
        tally.longest = (
            tally.tokens if self._whole_counts else min(max(tally.longest, longest), tally.tokens)
        )
        self._dirty = True
        tally.first_step = min(tally.first_step, step)
        tally.last_step = max(tally.last_step, step)
        receipt = ledger_pb2.UsageReceipt(
            session_id=session_id,
            node_id=self._node_id,
            node_public_key=self._public,
            layer_start=layer_start,
            layer_end=layer_end,
            tokens=tally.tokens,
            first_step=tally.first_step,
            last_step=tally.last_step,
            longest=tally.longest,
        ).SerializeToString(deterministic=True)
        return ledger_pb2.SignedUsage(
            receipt=receipt, node_signature=self._key.sign(identity.usage_payload(receipt))
        )

    def acknowledge(
        self, session_id: str, signed: ledger_pb2.SignedUsage, client_key: bytes
    ) -> tuple[ledger_pb2.UsageReceipt, int]:
        """Take the client's counter-signature of one of this node's receipts of
        ``session_id``; returns the receipt and the tokens now acknowledged on its layers.
        Raises ReceiptRefused (ReceiptForged for a signature that does not verify)."""
        receipt = ledger_pb2.UsageReceipt()
        try:
            receipt.ParseFromString(signed.receipt)
        except DecodeError:
            raise ReceiptRefused("the receipt is not a UsageReceipt") from None
        if receipt.session_id != session_id:
            raise ReceiptRefused(
                f"the receipt is for session {receipt.session_id[:64]!r}, not {session_id!r}"
            )
        if receipt.node_id != self._node_id or receipt.node_public_key != self._public:
            raise ReceiptForged(f"the receipt is not this node's ({self._node_id})")
        if not identity.verify(self._public, signed.node_signature, identity.usage_payload(
            signed.receipt
        )):  # fmt: skip
            raise ReceiptForged("the receipt's node signature is not this node's")
        if not identity.verify(
            client_key,
            signed.client_signature,
            identity.usage_countersign_payload(signed.receipt, signed.billed_tokens),
        ):
            raise ReceiptForged(
                "the receipt is not counter-signed by the session's client key (over the "
                "receipt and its billed_tokens)"
            )
        if signed.billed_tokens > receipt.tokens:
            raise ReceiptRefused(
                f"{signed.billed_tokens} billed tokens, but the receipt counts {receipt.tokens}"
            )
        key = (session_id, receipt.layer_start, receipt.layer_end)
        tally = self._tallies.get(key)
        if tally is None:  # forgotten (ended, or past MAX_TRACKED): nothing left to owe
            return receipt, receipt.tokens
        if receipt.tokens > tally.acknowledged:
            tally.acknowledged = min(receipt.tokens, tally.tokens)
            self._dirty = True
        acknowledged = tally.acknowledged
        if tally.ended and acknowledged == tally.tokens:  # its last receipt came after the end
            self._drop(key, self._tallies.pop(key))
        return receipt, acknowledged

    def owed(self, session_id: str, layer_start: int, layer_end: int) -> int:
        """Tokens computed for the session on these layers past the newest acknowledged
        receipt (0 for a session this node does not count)."""
        tally = self._tallies.get((session_id, layer_start, layer_end))
        return 0 if tally is None else tally.tokens - tally.acknowledged

    def residue(self, client: bytes, session_id: str) -> int:
        """What ``client``'s paid sessions other than ``session_id`` computed here and left
        unacknowledged, counting those that ended or idled RESIDUE_IDLE_S, in the last
        RESIDUE_TTL_S."""
        now = self._clock()
        total = 0
        for key in list(self._by_client.get(client, ())):
            tally = self._tallies.get(key)
            if tally is None:
                self._by_client[client].discard(key)
                continue
            idle = now - tally.active_s
            if idle >= RESIDUE_TTL_S and tally.ended:  # can no longer be paid: forgotten
                self._drop(key, self._tallies.pop(key))
                self._dirty = True
                continue
            if key[0] == session_id or idle >= RESIDUE_TTL_S:
                continue
            if tally.ended or idle >= RESIDUE_IDLE_S:
                total += tally.tokens - tally.acknowledged
        return total

    def forget(self, session_id: str) -> None:
        """The session ended. A paid one's counts stay while some of it is unacknowledged
        (its last receipts may still come, and until then they are its client's residue)."""
        for key in [k for k in self._tallies if k[0] == session_id]:
            tally = self._tallies[key]
            if tally.client and tally.acknowledged < tally.tokens:
                tally.ended = True
                continue
            self._drop(key, self._tallies.pop(key))
            self._dirty = True

    def _drop(self, key: tuple[str, int, int], tally: _Tally) -> None:
        """A tally left the meter: it no longer counts for its client."""
        if tally.client:
            keys = self._by_client.get(tally.client)
            if keys is not None:
                keys.discard(key)
                if not keys:
                    del self._by_client[tally.client]

    def save(self) -> None:
        """Write the counts to the meter's file if they changed (atomically: a node killed
        while writing keeps the previous file)."""
        if self._path is None or not self._dirty:
            return
        recent = itertools.islice(reversed(self._tallies.items()), MAX_SAVED)
        rows = [[*key, *tally.row()] for key, tally in recent][::-1]
        self._path.parent.mkdir(parents=True, exist_ok=True)
        partial = self._path.with_suffix(".partial")
        partial.write_text(json.dumps(rows, separators=(",", ":")))
        os.replace(partial, self._path)
        self._dirty = False

    def _load(self, path: Path) -> None:
        try:
            rows = json.loads(path.read_text())
            for session_id, start, end, *counts in rows[-self._max :]:
                # Six columns before acknowledgments were counted (then none were made),
                # seven before the longest prefix was.
                if len(counts) not in (3, 4, 5):
                    raise ValueError(f"the row of session {session_id!r} has the wrong length")
                if not all(isinstance(v, int) and v >= 0 for v in (start, end, *counts)):
                    raise ValueError(f"a count of session {session_id!r} is not a whole number")
                tally = _Tally(*counts[:4])
                tally.longest = counts[4] if len(counts) == 5 else 0
                if tally.acknowledged > tally.tokens or tally.longest > tally.tokens:
                    raise ValueError(
                        f"session {session_id!r} acknowledges, or held, more than it counts"
                    )
                self._tallies[(str(session_id), start, end)] = tally
        except FileNotFoundError:
            return
        except (OSError, ValueError, TypeError) as err:  # JSONDecodeError is a ValueError
            self._tallies.clear()
            log.warning("usage counts in %s are unreadable (%s); counting from 0", path, err)


def save_usage(meter: UsageMeter) -> None:
    """``meter.save()``, logged instead of raised: a full disk must not stop the node."""
    try:
        meter.save()
    except OSError as err:
        log.warning("could not keep the usage counts (%s); a restart would count from 0", err)
