"""The model's last hop's signed answers that an audit may still compare, under a budget.

Every other hop's output is the next hop's input, which the route history keeps anyway;
the last hop's logits go nowhere after sampling. An audit of that hop (client/verification.py,
protos/logit_probes.py) needs the primary's row to compare a checker's catch-up with, and
the exact signed bytes as evidence if they disagree, so the verifier keeps each unchecked
row until an audit has compared it. A row costs vocab x 4 bytes (1 MiB at a 262k
vocabulary), so at most ``budget_bytes`` are kept, oldest dropped first: a step whose row
was dropped before any catch-up reached it simply goes unaudited.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable

import numpy as np

from protos import codec
from protos.tessera.v1 import common_pb2

KEPT_LOGITS_BYTES = 64 << 20


class KeptLogits:
    def __init__(self, budget_bytes: int = KEPT_LOGITS_BYTES) -> None:
        self.budget_bytes = budget_bytes
        self._rows: OrderedDict[Hashable, common_pb2.Tensor] = OrderedDict()
        self._bytes = 0
        self.dropped = 0  # rows let go for the budget before an audit compared them

    def __len__(self) -> int:
        return len(self._rows)

    @property
    def bytes(self) -> int:
        return self._bytes

    def keep(self, key: Hashable, tensor: common_pb2.Tensor) -> None:
        self.pop(key)
        self._rows[key] = tensor
        self._bytes += len(tensor.data)
        while self._bytes > self.budget_bytes and self._rows:
            _, old = self._rows.popitem(last=False)
            self._bytes -= len(old.data)
            self.dropped += 1

    def tensor(self, key: Hashable) -> common_pb2.Tensor | None:
        return self._rows.get(key)

    def row(self, key: Hashable) -> np.ndarray | None:
        """The kept logits as one float32 row over the vocabulary."""
        tensor = self._rows.get(key)
        if tensor is None:
            return None
        return codec.decode(tensor, finite=False).astype(np.float32).reshape(-1)

    def pop(self, key: Hashable) -> None:
        old = self._rows.pop(key, None)
        if old is not None:
            self._bytes -= len(old.data)
