"""Hostile input for the endpoint tests, and the check every refusal of it must pass."""

from __future__ import annotations

import grpc
import pytest
from google.protobuf.descriptor import MethodDescriptor, ServiceDescriptor


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


def _shape(method: MethodDescriptor) -> str:
    """The name of the channel's callable for ``method``: unary_unary, stream_stream..."""
    return (
        ("stream" if method.client_streaming else "unary")
        + "_"
        + ("stream" if method.server_streaming else "unary")
    )


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
            call = getattr(channel, _shape(method))(path, request_serializer=None)
            request = iter([GARBAGE]) if method.client_streaming else GARBAGE
            details = await refused(
                call(request, metadata=metadata, timeout=10),
                grpc.StatusCode.INVALID_ARGUMENT,
                "not a valid protobuf message",
            )
            assert "Unexpected" not in details, (path, details)


def varint(value: int) -> bytes:
    """``value`` as a protobuf varint."""
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def unknown_field(number: int, payload: bytes) -> bytes:
    """A length-delimited field numbered ``number``, which the message does not define:
    protobuf parses and ignores it."""
    return varint(number << 3 | 2) + varint(len(payload)) + payload


def oversized_message(limit: int) -> bytes:
    """One message of more than ``limit`` bytes that any message type parses: an unknown
    field numbered past every field the protos define."""
    return unknown_field(9999, b"x" * (limit + 10))


def methods_of(services: list[ServiceDescriptor]) -> list[MethodDescriptor]:
    """Every method of ``services``, for tests parametrized one method at a time."""
    return [method for service in services for method in service.methods]


def method_id(method: MethodDescriptor) -> str:
    return f"{method.containing_service.name}.{method.name}"


async def method_refuses_oversized(
    channel: grpc.aio.Channel,
    method: MethodDescriptor,
    limit: int,
    metadata: tuple[tuple[str, str], ...] = (),
) -> None:
    """Send ``method`` (in its call shape) one message over ``limit`` bytes, which the
    channel must allow sending: it must answer RESOURCE_EXHAUSTED before any servicer reads
    it, saying how large the message was."""
    path = f"/{method.containing_service.full_name}/{method.name}"
    call = getattr(channel, _shape(method))(path, request_serializer=None)
    message = oversized_message(limit)
    request = iter([message]) if method.client_streaming else message
    await refused(
        call(request, metadata=metadata, timeout=10),
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        "larger than max",
    )
