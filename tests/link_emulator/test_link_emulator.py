"""The link emulator adds the delay, jitter, bandwidth cap and outages it is asked for."""

from __future__ import annotations

import asyncio
import json
import statistics
import struct
import time
from collections.abc import AsyncIterator

import grpc
import pytest
from support.link_emulator import DOWNSTREAM, UPSTREAM, LinkEmulator

from protos import codec

pytestmark = pytest.mark.timeout(60)

GRPC_OPTIONS = [
    ("grpc.max_receive_message_length", codec.MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", codec.MAX_MESSAGE_BYTES),
]
# After an outage the channel reconnects within a fraction of a second instead of grpc's
# default 1 s+ backoff; the outage itself is what the tests look at.
SERVICE = "tessera.test.Echo"
# A connection that completed its handshake just as the link went down is reset under the
# first call sent on it ("Stream removed (sendmsg: Broken pipe)"), and gRPC never retries a
# call it has sent. A real client retries that (Tessera's driver fails over); here a retry
# policy for UNAVAILABLE on Ping does it, so the check is the channel's recovery, not the
# luck of the race.
RETRY_PING = json.dumps(
    {
        "methodConfig": [
            {
                "name": [{"service": SERVICE, "method": "Ping"}],
                "retryPolicy": {
                    "maxAttempts": 4,
                    "initialBackoff": "0.1s",
                    "maxBackoff": "0.3s",
                    "backoffMultiplier": 2,
                    "retryableStatusCodes": ["UNAVAILABLE"],
                },
            }
        ]
    }
)
FAST_RECONNECT = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 300),
    ("grpc.enable_retries", 1),
    ("grpc.service_config", RETRY_PING),
]


# ---- servers behind the link -------------------------------------------------------------


async def _echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except ConnectionError:
        pass
    finally:
        writer.close()


@pytest.fixture
async def echo_port() -> AsyncIterator[int]:
    server = await asyncio.start_server(_echo, "127.0.0.1", 0)
    yield server.sockets[0].getsockname()[1]
    server.close()


async def _roundtrip(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> float:
    start = time.monotonic()
    writer.write(b"ping")
    await writer.drain()
    await reader.readexactly(4)
    return time.monotonic() - start


def _grpc_echo_handlers() -> grpc.GenericRpcHandler:
    async def ping(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        return request

    async def chat(
        requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[bytes]:
        async for request in requests:
            yield request

    return grpc.method_handlers_generic_handler(
        SERVICE,
        {
            "Ping": grpc.unary_unary_rpc_method_handler(ping),
            "Chat": grpc.stream_stream_rpc_method_handler(chat),
        },
    )


@pytest.fixture
async def grpc_port() -> AsyncIterator[int]:
    server = grpc.aio.server(options=GRPC_OPTIONS)
    server.add_generic_rpc_handlers((_grpc_echo_handlers(),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    yield port
    await server.stop(grace=None)


# ---- raw TCP -------------------------------------------------------------------------------


async def test_round_trip_costs_twice_the_one_way_delay(echo_port):
    async with LinkEmulator("127.0.0.1", echo_port, delay_ms=40) as link:
        reader, writer = await asyncio.open_connection("127.0.0.1", link.port)
        rtts = [await _roundtrip(reader, writer) for _ in range(5)]
        writer.close()
    assert min(rtts) >= 0.080, rtts
    assert statistics.median(rtts) < 0.080 + 0.060, rtts


async def test_without_settings_the_link_adds_almost_nothing(echo_port):
    async with LinkEmulator("127.0.0.1", echo_port) as link:
        reader, writer = await asyncio.open_connection("127.0.0.1", link.port)
        rtts = [await _roundtrip(reader, writer) for _ in range(5)]
        writer.close()
    assert statistics.median(rtts) < 0.020, rtts


async def test_bandwidth_cap_is_met_within_30_percent():
    received = asyncio.get_running_loop().create_future()
    size = 400_000

    async def sink(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readexactly(size)
        received.set_result(time.monotonic())
        writer.close()

    server = await asyncio.start_server(sink, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    rate = 800_000  # bytes per second -> 0.5 s for the payload
    async with LinkEmulator("127.0.0.1", port, bandwidth_bps=rate) as link:
        _, writer = await asyncio.open_connection("127.0.0.1", link.port)
        start = time.monotonic()
        writer.write(b"x" * size)
        await writer.drain()
        done = await asyncio.wait_for(received, 10)
        writer.close()
    server.close()
    measured = size / (done - start)
    assert 0.7 * rate <= measured <= 1.3 * rate, f"{measured:.0f} B/s through a {rate} B/s cap"
    assert link.stats.bytes[UPSTREAM] == size


async def test_jitter_never_reorders_bytes(echo_port):
    count = 300
    async with LinkEmulator("127.0.0.1", echo_port, delay_ms=4, jitter_ms=4, seed=7) as link:
        reader, writer = await asyncio.open_connection("127.0.0.1", link.port)
        sent = b"".join(struct.pack(">I", i) for i in range(count))

        async def send() -> None:
            for i in range(count):
                writer.write(struct.pack(">I", i))
                await writer.drain()
                await asyncio.sleep(0.0005)  # separate reads at the proxy, so chunks could swap

        sender = asyncio.create_task(send())
        echoed = await asyncio.wait_for(reader.readexactly(len(sent)), 20)
        await sender
        writer.close()
        chunks = link.stats.chunks[UPSTREAM]
    assert chunks >= 50, f"only {chunks} chunks: the test could not have caught a reordering"
    assert echoed == sent


async def test_delay_change_takes_effect_mid_stream(echo_port):
    async with LinkEmulator("127.0.0.1", echo_port, delay_ms=5) as link:
        reader, writer = await asyncio.open_connection("127.0.0.1", link.port)
        fast = [await _roundtrip(reader, writer) for _ in range(3)]
        link.set(delay_ms=60)
        slow = [await _roundtrip(reader, writer) for _ in range(3)]
        link.set(delay_ms=5)
        await _roundtrip(reader, writer)  # the last slow chunk may still be queued
        fast_again = [await _roundtrip(reader, writer) for _ in range(3)]
        writer.close()
    assert max(fast) < 0.060 and max(fast_again) < 0.060, (fast, fast_again)
    assert min(slow) >= 0.120, slow


async def test_settings_are_validated(echo_port):
    async with LinkEmulator("127.0.0.1", echo_port) as link:
        link.set(delay_ms=40, jitter_ms=5, bandwidth_bps=1_000_000)
        before = link.settings
        with pytest.raises(ValueError, match="delay_ms"):
            link.set(delay_ms=-1)
        with pytest.raises(ValueError, match="bytes per second"):
            link.set(bandwidth_bps=0)
        with pytest.raises(ValueError, match="bytes per second"):
            link.set(delay_ms=10, bandwidth_bps=0)  # one bad value refuses the whole change
        assert link.settings == before  # a rejected change leaves the link as it was


async def test_unreachable_target_closes_the_client_and_the_proxy_keeps_serving(echo_port):
    probe = await asyncio.start_server(_echo, "127.0.0.1", 0)
    dead_port = probe.sockets[0].getsockname()[1]
    probe.close()
    await probe.wait_closed()
    async with LinkEmulator("127.0.0.1", dead_port) as link:
        reader, writer = await asyncio.open_connection("127.0.0.1", link.port)
        with pytest.raises((asyncio.IncompleteReadError, ConnectionError)):
            await asyncio.wait_for(reader.readexactly(1), 5)
        writer.close()
        assert link.stats.connections_refused == 1
        # point a new link at a live server: the emulator class itself is unharmed
    async with LinkEmulator("127.0.0.1", echo_port) as link:
        reader, writer = await asyncio.open_connection("127.0.0.1", link.port)
        assert await _roundtrip(reader, writer) < 1.0
        writer.close()


# ---- gRPC (HTTP/2) -----------------------------------------------------------------------


def _chat(channel: grpc.aio.Channel) -> grpc.aio.StreamStreamCall:
    return channel.stream_stream(f"/{SERVICE}/Chat")()


async def _chat_rtt(call: grpc.aio.StreamStreamCall) -> float:
    start = time.monotonic()
    await call.write(b"x" * 64)
    assert await asyncio.wait_for(call.read(), 10) == b"x" * 64
    return time.monotonic() - start


async def test_grpc_stream_feels_the_delay_and_its_changes(grpc_port):
    async with LinkEmulator("127.0.0.1", grpc_port, delay_ms=10) as link:
        async with grpc.aio.insecure_channel(link.address, options=GRPC_OPTIONS) as channel:
            call = _chat(channel)
            await _chat_rtt(call)  # connection setup
            before = [await _chat_rtt(call) for _ in range(3)]
            link.set(delay_ms=80)
            after = [await _chat_rtt(call) for _ in range(3)]
            await call.done_writing()
    assert min(before) >= 0.020 and max(before) < 0.080, before
    assert min(after) >= 0.160, after


async def test_outage_breaks_an_open_grpc_stream_and_recovery_works(grpc_port):
    async with LinkEmulator("127.0.0.1", grpc_port, delay_ms=2) as link:
        options = GRPC_OPTIONS + FAST_RECONNECT
        async with grpc.aio.insecure_channel(link.address, options=options) as channel:
            call = _chat(channel)
            await _chat_rtt(call)
            link.set(down=True)
            # The open stream ends with UNAVAILABLE: what a driver sees when a node vanishes.
            assert await asyncio.wait_for(call.code(), 10) == grpc.StatusCode.UNAVAILABLE
            with pytest.raises(grpc.aio.AioRpcError):
                await call.read()

            ping = channel.unary_unary(f"/{SERVICE}/Ping")
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await ping(b"hello", timeout=1.0)
            assert refused.value.code() in (
                grpc.StatusCode.UNAVAILABLE,
                grpc.StatusCode.DEADLINE_EXCEEDED,
            )
            assert link.open_connections == 0
            with pytest.raises(ConnectionRefusedError):  # no TCP handshake on a dead link
                await asyncio.open_connection("127.0.0.1", link.port)

            link.set(down=False)
            assert await ping(b"hello", timeout=10.0, wait_for_ready=True) == b"hello"
            call = _chat(channel)
            assert await _chat_rtt(call) < 1.0
            await call.done_writing()
    assert link.stats.connections_reset >= 1


def test_thread_mode_serves_sync_grpc_code(grpc_port_in_thread):
    port = grpc_port_in_thread
    link = LinkEmulator("127.0.0.1", port, delay_ms=30)
    address = link.start_in_thread()
    try:
        options = GRPC_OPTIONS + FAST_RECONNECT
        with grpc.insecure_channel(address, options=options) as channel:
            ping = channel.unary_unary(f"/{SERVICE}/Ping")
            assert ping(b"a", timeout=10) == b"a"
            start = time.monotonic()
            assert ping(b"b", timeout=10) == b"b"
            assert time.monotonic() - start >= 0.060
            link.set(down=True)  # from this (foreign) thread
            with pytest.raises(grpc.RpcError) as err:
                ping(b"c", timeout=2)
            assert err.value.code() in (
                grpc.StatusCode.UNAVAILABLE,
                grpc.StatusCode.DEADLINE_EXCEEDED,
            )
            link.set(down=False, delay_ms=0)
            assert ping(b"d", timeout=10, wait_for_ready=True) == b"d"
        assert link.stats.bytes[DOWNSTREAM] > 0
    finally:
        link.stop_thread()


@pytest.fixture
def grpc_port_in_thread():
    """A sync gRPC server, so the sync test needs no event loop of its own."""
    from concurrent import futures

    def ping(request: bytes, context: grpc.ServicerContext) -> bytes:
        return request

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), options=GRPC_OPTIONS)
    server.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                SERVICE, {"Ping": grpc.unary_unary_rpc_method_handler(ping)}
            ),
        )
    )
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield port
    server.stop(grace=None)
