"""Hostile input for the endpoint tests, and the check every refusal of it must pass."""

from __future__ import annotations

import grpc
import pytest


def huge(prefix: str) -> str:
    """100 KB of id or name, with the control characters a log line or a terminal could be
    fooled by."""
    return prefix + "\x00\r\n\x1b[2J" + "x" * 100_000


async def refused(call: object, code: grpc.StatusCode, words: str) -> str:
    """Run a unary call (await it) or a streaming one (read it to the end) that must fail
    with ``code``, with short details (error details travel in gRPC metadata, which a
    client refuses past 16 KiB) that contain ``words``; returns the details."""
    with pytest.raises(grpc.aio.AioRpcError) as err:
        if hasattr(call, "__aiter__"):
            _ = [item async for item in call]  # type: ignore[attr-defined]
        else:
            await call  # type: ignore[misc]
    details = err.value.details() or ""
    assert err.value.code() == code, details[:300]
    assert len(details) < 500, f"{len(details)} characters of details: {details[:300]}"
    assert words in details, details
    return details
