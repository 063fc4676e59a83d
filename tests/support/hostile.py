"""Hostile input for the endpoint tests, and the check every refusal of it must pass."""

from __future__ import annotations

import grpc
import pytest
from google.protobuf.descriptor import ServiceDescriptor


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


GARBAGE = b"\xff\xff\xff"  # no protobuf message of any type parses from these bytes


async def every_method_refuses_garbage(
    channel: grpc.aio.Channel,
    services: list[ServiceDescriptor],
    metadata: tuple[tuple[str, str], ...] = (),
) -> None:
    """Send bytes no protobuf parses to every method of ``services``, in the call shape of
    each: every one must answer INVALID_ARGUMENT saying what is wrong (not UNKNOWN)."""
    for service in services:
        for method in service.methods:
            path = f"/{service.full_name}/{method.name}"
            shape = ("stream" if method.client_streaming else "unary") + "_" + (
                "stream" if method.server_streaming else "unary"
            )
            call = getattr(channel, shape)(path, request_serializer=None)
            request = iter([GARBAGE]) if method.client_streaming else GARBAGE
            details = await refused(
                call(request, metadata=metadata, timeout=10),
                grpc.StatusCode.INVALID_ARGUMENT,
                "not a valid protobuf message",
            )
            assert "Unexpected" not in details, (path, details)
