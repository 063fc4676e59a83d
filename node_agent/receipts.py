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
"""

from __future__ import annotations

import itertools
import json
import logging
import os
from collections import OrderedDict
from dataclasses import astuple, dataclass
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from protos import identity
from protos.tessera.v1 import ledger_pb2

log = logging.getLogger(__name__)

# Counters of sessions that never said EndSession are dropped oldest first past this many;
# their last receipts are already with the client.
MAX_TRACKED = 65_536
# Only the counts of this many sessions, the most recently active, are written to disk: a
# write every few seconds must stay small. An older session counts from 0 after a restart.
MAX_SAVED = 4096


@dataclass
class _Tally:
    tokens: int
    first_step: int
    last_step: int


class UsageMeter:
    def __init__(
        self,
        private_key: Ed25519PrivateKey,
        max_tracked: int = MAX_TRACKED,
        path: Path | None = None,
    ) -> None:
        self._key = private_key
        self._public = identity.public_key_bytes(private_key)
        self._node_id = identity.node_id(self._public)
        self._max = max_tracked
        self._tallies: OrderedDict[tuple[str, int, int], _Tally] = OrderedDict()
        self._path = path
        self._dirty = False
        if path is not None:
            self._load(path)

    def record(
        self, session_id: str, layer_start: int, layer_end: int, step: int, tokens: int
    ) -> ledger_pb2.SignedUsage:
        """Count `tokens` computed at `step`; returns the signed cumulative receipt."""
        key = (session_id, layer_start, layer_end)
        tally = self._tallies.get(key)
        if tally is None:
            tally = self._tallies[key] = _Tally(0, step, step)
            while len(self._tallies) > self._max:
                self._tallies.popitem(last=False)
        else:
            self._tallies.move_to_end(key)
        tally.tokens += tokens
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
        ).SerializeToString(deterministic=True)
        return ledger_pb2.SignedUsage(
            receipt=receipt, node_signature=self._key.sign(identity.usage_payload(receipt))
        )

    def forget(self, session_id: str) -> None:
        for key in [k for k in self._tallies if k[0] == session_id]:
            del self._tallies[key]
            self._dirty = True

    def save(self) -> None:
        """Write the counts to the meter's file if they changed (atomically: a node killed
        while writing keeps the previous file)."""
        if self._path is None or not self._dirty:
            return
        recent = itertools.islice(reversed(self._tallies.items()), MAX_SAVED)
        rows = [[*key, *astuple(tally)] for key, tally in recent][::-1]
        self._path.parent.mkdir(parents=True, exist_ok=True)
        partial = self._path.with_suffix(".partial")
        partial.write_text(json.dumps(rows, separators=(",", ":")))
        os.replace(partial, self._path)
        self._dirty = False

    def _load(self, path: Path) -> None:
        try:
            rows = json.loads(path.read_text())
            for session_id, start, end, tokens, first, last in rows[-self._max :]:
                counts = (start, end, tokens, first, last)
                if not all(isinstance(v, int) and v >= 0 for v in counts):
                    raise ValueError(f"a count of session {session_id!r} is not a whole number")
                self._tallies[(str(session_id), start, end)] = _Tally(tokens, first, last)
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
