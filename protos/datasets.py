"""What client and coordinator must agree on about token datasets.

A dataset travels as shards of int32 little-endian token ids. Its id is a sha256 over the
shard list and example length, so the client can ask whether the coordinator already has
it (GetDataset) before sending a byte, and the coordinator recomputes it from the header.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

TOKEN_DTYPE = "<i4"
TOKEN_BYTES = 4
_DOMAIN = b"tessera/v1/dataset\n"


def dataset_id(shards: Iterable[tuple[str, int]], example_len: int) -> str:
    """sha256 over (shard sha256, shard tokens) in order, and the example length."""
    digest = hashlib.sha256(_DOMAIN)
    digest.update(f"example_len={example_len}\n".encode())
    for sha256, num_tokens in shards:
        digest.update(f"{sha256}\t{num_tokens}\n".encode())
    return digest.hexdigest()
