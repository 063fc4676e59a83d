"""Reading blobs of the jobs store off the event loop, chunk by chunk."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from coordinator.model_store.blob_store import BlobStore


async def read_blob(blobs: BlobStore, sha256: str, chunk_bytes: int) -> AsyncIterator[bytes]:
    """The blob's bytes in chunks; FileNotFoundError when the store lost it."""
    handle = await asyncio.to_thread(blobs.path(sha256).open, "rb")
    try:
        while data := await asyncio.to_thread(handle.read, chunk_bytes):
            yield data
    finally:
        handle.close()
