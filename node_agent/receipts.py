"""Usage receipts: what this node has computed for each (session, layers), signed.

Every Forward answer carries the newest cumulative receipt for its session and layers:
token positions x batch processed so far (replays included), and the first and last step.
The client's driver counter-signs the last one it agrees with, and the coordinator pays
only for receipts both sides signed (protos.identity.usage_payload). Cumulative receipts
mean a lost answer loses nothing: the next one covers it.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from protos import identity
from protos.tessera.v1 import ledger_pb2

# Counters of sessions that never said EndSession are dropped oldest first past this many;
# their last receipts are already with the client.
MAX_TRACKED = 65_536


@dataclass
class _Tally:
    tokens: int
    first_step: int
    last_step: int


class UsageMeter:
    def __init__(self, private_key: Ed25519PrivateKey, max_tracked: int = MAX_TRACKED) -> None:
        self._key = private_key
        self._public = identity.public_key_bytes(private_key)
        self._node_id = identity.node_id(self._public)
        self._max = max_tracked
        self._tallies: OrderedDict[tuple[str, int, int], _Tally] = OrderedDict()

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
