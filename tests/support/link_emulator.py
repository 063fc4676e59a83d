"""A TCP proxy that makes a loopback link behave like a real network link.

`tc netem` needs root and a kernel module that CI boxes lack, so tests and benches put this
proxy between two endpoints instead. It adds, per direction:

  * one-way delay (so a round trip through the proxy costs 2 x delay_ms),
  * jitter: each chunk's delay varies uniformly in [delay - jitter, delay + jitter],
  * a bandwidth cap: a token bucket in BYTES per second, shared by all connections of the
    link (one bucket per direction, like a real access line),
  * disconnects: `down=True` resets every open connection now and refuses new ones until
    `down=False` (the proxy stops listening: a dead link completes no TCP handshake, so a
    client never gets a connection that opens and then resets under its first call).

Everything can change while the proxy runs. Delay is applied per chunk through a
per-direction queue of release times that never go backwards, so jitter and a delay cut
mid-stream never reorder bytes (TCP would never deliver them out of order either). It is
plain TCP, so it carries gRPC's HTTP/2 unchanged.

From async code:

    async with LinkEmulator("127.0.0.1", server_port, delay_ms=50) as link:
        channel = grpc.aio.insecure_channel(link.address, options=...)
        link.set(down=True)  # the open stream fails with UNAVAILABLE

From sync code (the proxy runs its own event loop on a background thread):

    link = LinkEmulator("127.0.0.1", server_port, delay_ms=50)
    address = link.start_in_thread()
    try:
        ...
        link.set(bandwidth_bps=1_000_000)
    finally:
        link.stop_thread()
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import random
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import EllipsisType, TracebackType

log = logging.getLogger("tessera.link_emulator")

READ_CHUNK = 64 * 1024
# Chunks waiting in one direction of one connection; a full queue stops reading, so a fast
# sender feels back-pressure instead of the proxy buffering without bound.
QUEUE_CHUNKS = 256
# The bucket releases at most this much time's worth of bytes at once, so a capped link
# delivers a steady trickle rather than bursts.
BUCKET_SLICE_S = 0.02
MIN_BUCKET_BYTES = 1024

UPSTREAM = "upstream"  # client -> target
DOWNSTREAM = "downstream"  # target -> client
_EOF = None


@dataclass(frozen=True)
class LinkSettings:
    """The link's state. `bandwidth_bps` is in BYTES per second; None means unlimited."""

    delay_ms: float = 0.0
    jitter_ms: float = 0.0
    bandwidth_bps: float | None = None
    down: bool = False

    def validated(self) -> LinkSettings:
        if not (math.isfinite(self.delay_ms) and self.delay_ms >= 0):
            raise ValueError(f"delay_ms must be a finite number >= 0, got {self.delay_ms!r}")
        if not (math.isfinite(self.jitter_ms) and self.jitter_ms >= 0):
            raise ValueError(f"jitter_ms must be a finite number >= 0, got {self.jitter_ms!r}")
        if self.bandwidth_bps is not None and not (
            math.isfinite(self.bandwidth_bps) and self.bandwidth_bps > 0
        ):
            raise ValueError(
                f"bandwidth_bps is bytes per second and must be > 0 (or None for no cap), "
                f"got {self.bandwidth_bps!r}"
            )
        return self


@dataclass
class LinkStats:
    connections_accepted: int = 0
    connections_refused: int = 0
    connections_reset: int = 0
    chunks: dict[str, int] = dataclasses.field(default_factory=lambda: {UPSTREAM: 0, DOWNSTREAM: 0})
    bytes: dict[str, int] = dataclasses.field(default_factory=lambda: {UPSTREAM: 0, DOWNSTREAM: 0})


class _TokenBucket:
    """Bytes per second, shared by every connection going one way over the link."""

    def __init__(self) -> None:
        self._tokens = 0.0
        self._stamp = time.monotonic()
        self._lock = asyncio.Lock()

    async def take(self, n: int, rate: float | None) -> None:
        if rate is None:
            return
        async with self._lock:  # first come, first served across connections
            burst = max(MIN_BUCKET_BYTES, rate * BUCKET_SLICE_S)
            now = time.monotonic()
            self._tokens = min(burst, self._tokens + (now - self._stamp) * rate)
            self._stamp = now
            self._tokens -= n
            if self._tokens < 0:
                await asyncio.sleep(-self._tokens / rate)


class _Connection:
    """One proxied TCP connection: two one-way pipes with their own release queues."""

    def __init__(
        self,
        link: LinkEmulator,
        client: tuple[asyncio.StreamReader, asyncio.StreamWriter],
        target: tuple[asyncio.StreamReader, asyncio.StreamWriter],
    ) -> None:
        self.link = link
        self.client_reader, self.client_writer = client
        self.target_reader, self.target_writer = target
        self.tasks: list[asyncio.Task[None]] = []

    async def run(self) -> None:
        pipes = [
            (self.client_reader, self.target_writer, UPSTREAM),
            (self.target_reader, self.client_writer, DOWNSTREAM),
        ]
        for reader, writer, direction in pipes:
            queue: asyncio.Queue[tuple[float, bytes] | None] = asyncio.Queue(QUEUE_CHUNKS)
            self.tasks.append(asyncio.create_task(self._read(reader, queue, direction)))
            self.tasks.append(asyncio.create_task(self._write(writer, queue, direction)))
        try:
            done, _ = await asyncio.wait(self.tasks, return_when=asyncio.FIRST_EXCEPTION)
            if any(not t.cancelled() and t.exception() is not None for t in done):
                self.abort()  # one side broke: the other must see it too, as with real TCP
        finally:
            for task in self.tasks:
                task.cancel()
            # Collect what the pipes raised, so nothing is reported as "never retrieved".
            await asyncio.gather(*self.tasks, return_exceptions=True)
            for writer in (self.client_writer, self.target_writer):
                writer.close()

    def abort(self) -> None:
        """Reset both sides now (RST, not FIN), like a cable pulled mid-transfer."""
        for writer in (self.client_writer, self.target_writer):
            writer.transport.abort()
        for task in self.tasks:
            task.cancel()

    async def _read(
        self,
        reader: asyncio.StreamReader,
        queue: asyncio.Queue[tuple[float, bytes] | None],
        direction: str,
    ) -> None:
        last_release = 0.0
        while True:
            data = await reader.read(READ_CHUNK)
            release = max(self.link._release_time(), last_release)  # never overtake
            last_release = release
            if not data:
                await queue.put((release, b""))  # the FIN travels with the same delay
                await queue.put(_EOF)
                return
            self.link.stats.chunks[direction] += 1
            await queue.put((release, data))

    async def _write(
        self,
        writer: asyncio.StreamWriter,
        queue: asyncio.Queue[tuple[float, bytes] | None],
        direction: str,
    ) -> None:
        bucket = self.link._buckets[direction]
        while True:
            item = await queue.get()
            if item is _EOF:
                if writer.can_write_eof():
                    writer.write_eof()  # half-close, so request/response protocols still work
                return
            release, data = item
            wait = release - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            for piece in _slices(data, self.link.settings.bandwidth_bps):
                await bucket.take(len(piece), self.link.settings.bandwidth_bps)
                writer.write(piece)
                await writer.drain()
                self.link.stats.bytes[direction] += len(piece)


def _slices(data: bytes, rate: float | None) -> Iterator[bytes]:
    if not data:
        return
    size = len(data) if rate is None else max(MIN_BUCKET_BYTES, int(rate * BUCKET_SLICE_S))
    view = memoryview(data)
    for start in range(0, len(data), size):
        yield bytes(view[start : start + size])


class LinkEmulator:
    """A delaying, jittering, rate-capping, breakable TCP proxy to target_host:target_port."""

    def __init__(
        self,
        target_host: str,
        target_port: int,
        *,
        delay_ms: float = 0.0,
        jitter_ms: float = 0.0,
        bandwidth_bps: float | None = None,
        down: bool = False,
        listen_host: str = "127.0.0.1",
        seed: int | None = 0,
        name: str | None = None,
    ) -> None:
        self.target = (target_host, int(target_port))
        self.settings = LinkSettings(delay_ms, jitter_ms, bandwidth_bps, down).validated()
        self.listen_host = listen_host
        self.name = name or f"link->{target_host}:{target_port}"
        self.stats = LinkStats()
        self._rng = random.Random(seed)
        self._server: asyncio.base_events.Server | None = None
        self._relisten: asyncio.Task[asyncio.base_events.Server] | None = None
        self._connections: set[_Connection] = set()
        self._handlers: set[asyncio.Task[None]] = set()
        self._buckets = {UPSTREAM: _TokenBucket(), DOWNSTREAM: _TokenBucket()}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self.port: int | None = None

    # ---- public API -------------------------------------------------------------------

    @property
    def address(self) -> str:
        """HOST:PORT to dial instead of the target."""
        if self.port is None:
            raise RuntimeError(f"{self.name} is not started; call start() or start_in_thread()")
        return f"{self.listen_host}:{self.port}"

    def set(
        self,
        *,
        delay_ms: float | None = None,
        jitter_ms: float | None = None,
        bandwidth_bps: float | None | EllipsisType = ...,
        down: bool | None = None,
    ) -> LinkSettings:
        """Change the link now. Safe from the proxy's loop and from any other thread.

        Leave an argument out to keep its value; `bandwidth_bps=None` removes the cap.
        Going down resets every open connection before this returns.
        """
        current = self.settings
        new = LinkSettings(
            current.delay_ms if delay_ms is None else float(delay_ms),
            current.jitter_ms if jitter_ms is None else float(jitter_ms),
            current.bandwidth_bps if bandwidth_bps is ... else bandwidth_bps,
            current.down if down is None else bool(down),
        ).validated()
        self.settings = new  # one attribute store: readers see the old or the new, never half
        if new.down and not current.down:
            log.info("%s: down, resetting %d connection(s)", self.name, len(self._connections))
            self._run_on_loop(self._stop_listening)
            self._run_on_loop(self._abort_all)
        elif current.down and not new.down:
            log.info("%s: up again", self.name)
            self._run_on_loop(self._listen_again)
        return new

    def reset(self) -> None:
        """Reset every open connection now and keep listening: a blip (a NAT rebinding, a
        Wi-Fi hiccup) that a reconnect gets over at once."""
        log.info("%s: resetting %d connection(s)", self.name, len(self._connections))
        self._run_on_loop(self._abort_all)

    def _stop_listening(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None

    def _listen_again(self) -> None:
        """Listen on the same port again (runs on the proxy's loop)."""
        if self._loop is None or self.port is None or self._server is not None:
            return
        family = socket.AF_INET6 if ":" in self.listen_host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((self.listen_host, self.port))
            sock.listen(128)  # connections wait in the backlog until the server accepts
        except OSError as exc:
            sock.close()
            raise RuntimeError(
                f"{self.name}: cannot listen on {self.address} again after an outage: {exc}"
            ) from exc
        sock.setblocking(False)
        self._relisten = self._loop.create_task(asyncio.start_server(self._accept, sock=sock))
        self._relisten.add_done_callback(self._listening_again)

    def _listening_again(self, task: asyncio.Task[asyncio.base_events.Server]) -> None:
        if not task.cancelled() and task.exception() is None:
            self._server = task.result()

    async def start(self) -> str:
        self._loop = asyncio.get_running_loop()
        self._server = await asyncio.start_server(self._accept, self.listen_host, 0)
        self.port = self._server.sockets[0].getsockname()[1]
        if self.settings.down:
            self._stop_listening()
        log.info("%s: listening on %s", self.name, self.address)
        return self.address

    async def stop(self) -> None:
        if self._relisten is not None:
            await asyncio.gather(self._relisten, return_exceptions=True)
            self._relisten = None
        if self._server is not None:
            self._server.close()
        self._abort_all()
        for task in list(self._handlers):
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*self._handlers, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()
            self._server = None

    async def __aenter__(self) -> LinkEmulator:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()

    def start_in_thread(self, timeout: float = 10.0) -> str:
        """Run the proxy on its own event loop in a daemon thread; returns its address."""
        ready = threading.Event()
        failure: list[BaseException] = []
        loop = asyncio.new_event_loop()

        def serve() -> None:
            asyncio.set_event_loop(loop)
            try:
                loop.run_until_complete(self.start())
            except BaseException as exc:  # handed to the caller below
                failure.append(exc)
                ready.set()
                return
            ready.set()
            loop.run_forever()
            loop.run_until_complete(self.stop())
            loop.close()

        self._thread = threading.Thread(target=serve, name=self.name, daemon=True)
        self._thread.start()
        if not ready.wait(timeout):
            raise TimeoutError(f"{self.name} did not start within {timeout} s")
        if failure:
            raise failure[0]
        return self.address

    def stop_thread(self, timeout: float = 10.0) -> None:
        if self._thread is None or self._loop is None:
            return
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout)
        self._thread = None

    def __enter__(self) -> LinkEmulator:
        self.start_in_thread()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop_thread()

    @property
    def open_connections(self) -> int:
        return len(self._connections)

    # ---- internals --------------------------------------------------------------------

    def _release_time(self) -> float:
        s = self.settings
        delay = s.delay_ms
        if s.jitter_ms:
            delay += self._rng.uniform(-s.jitter_ms, s.jitter_ms)
        return time.monotonic() + max(0.0, delay) / 1000.0

    def _run_on_loop(self, fn: Callable[[], None]) -> None:
        loop = self._loop
        if loop is None or not loop.is_running():
            fn()
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            fn()
            return
        done = threading.Event()

        def call() -> None:
            try:
                fn()
            finally:
                done.set()

        loop.call_soon_threadsafe(call)
        if not done.wait(10.0):
            raise TimeoutError(f"{self.name}: the proxy loop did not answer within 10 s")

    def _abort_all(self) -> None:
        for conn in list(self._connections):
            conn.abort()
            self.stats.connections_reset += 1
        self._connections.clear()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        try:
            await self._serve(reader, writer)
        finally:
            self._handlers.discard(task)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.settings.down:
            self.stats.connections_refused += 1
            writer.transport.abort()
            return
        try:
            target = await asyncio.open_connection(*self.target)
        except OSError as exc:
            log.warning("%s: cannot reach %s:%d: %s", self.name, *self.target, exc)
            self.stats.connections_refused += 1
            writer.transport.abort()
            return
        if self.settings.down:  # went down while we were dialing
            self.stats.connections_refused += 1
            writer.transport.abort()
            target[1].transport.abort()
            return
        self.stats.connections_accepted += 1
        conn = _Connection(self, (reader, writer), target)
        self._connections.add(conn)
        try:
            await conn.run()
        finally:
            self._connections.discard(conn)
