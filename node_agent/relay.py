"""Push pipeline ("relay") machinery of the stage server: deliveries and outgoing links.

A call with ``relay_to`` is computed here and its output is sent on to the next hop by
this node instead of travelling back to the client first. Two things make that work:

* ``DeliveryHub``: per session, the one ``Deliveries`` stream the client holds at this
  node. The answers of relayed calls (or why they failed) go there. Every buffer is
  bounded (count and bytes, per subscriber and for the whole node): a client that does
  not read loses its subscription (RESOURCE_EXHAUSTED), the node never grows without
  bound.
* ``RelayLinks``: one outgoing node->node ``Stage.Forward`` stream per (session, next
  address), opened lazily on a channel per address. A writer task per stream sends the
  queued requests one at a time (gRPC forbids overlapping writes on a stream), so a
  relay never delays this node's own answer; a reader task notices when the stream ends.
  A broken link is dropped and reopened by the next relay.

This module knows nothing of models: the stage server validates, computes and signs.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import grpc

from protos.dialing import DATA_WINDOW
from protos.tessera.v1 import client_api_pb2, stage_pb2, stage_pb2_grpc

log = logging.getLogger(__name__)

MAX_RELAY_HOPS = 16


@dataclass(frozen=True)
class RelayLimits:
    max_hops: int = MAX_RELAY_HOPS
    # Deliveries: one subscription per session (a replaced one may linger while its last
    # write drains, so at most two per session), buffers bounded per subscriber and in all.
    max_subscriptions: int = 256
    delivery_buffer: int = 256
    delivery_buffer_bytes: int = 64 << 20
    deliveries_total_bytes: int = 512 << 20
    # Outgoing links: requests queued per link, and queued bytes over all links.
    link_queue: int = 256
    links_total_bytes: int = 512 << 20
    # A write to the next node that takes longer (a peer that accepted the connection but
    # neither reads nor answers) ends the link: the relaying handler, which writes at once
    # when the link is idle, must never hang on it.
    write_timeout_s: float = 5.0
    # The first write of a link also waits for the connection to the next node, which a
    # firewall that drops packets never lets happen. Its relaying call answers only after
    # it, so it gets less time: a handshake takes a few round trips, and a hand-off that
    # fails costs only the client sending the step on itself (relay_failed).
    first_write_timeout_s: float = 1.0


class SubscriptionEnded(Exception):
    """The subscription was ended with an error status (e.g. its buffer overflowed)."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class Subscriber:
    """One ``Deliveries`` stream: a bounded buffer the handler drains with ``next``."""

    def __init__(self, hub: DeliveryHub, session_id: str, now: float) -> None:
        self._hub = hub
        self.session_id = session_id
        self._items: deque[tuple[stage_pb2.Delivery, int]] = deque()
        self._bytes = 0
        self._wake = asyncio.Event()
        self.ended = False
        self._error: SubscriptionEnded | None = None
        self.last_activity = now

    @property
    def buffered(self) -> int:
        return len(self._items)

    def put(self, delivery: stage_pb2.Delivery, size: int) -> None:
        self._items.append((delivery, size))
        self._bytes += size
        self._hub.buffered_bytes += size
        self._wake.set()

    def take_over(self, older: Subscriber) -> None:
        """What ``older`` (being replaced) has not sent yet is this one's to send."""
        self._items, older._items = older._items, deque()
        self._bytes, older._bytes = older._bytes, 0
        if self._items:
            self._wake.set()

    def end(self, error: SubscriptionEnded | None = None) -> None:
        """Stop the stream; what is still buffered is dropped (nobody will read it)."""
        if self.ended:
            return
        self.ended = True
        self._error = error
        self._hub.buffered_bytes -= self._bytes
        self._items.clear()
        self._bytes = 0
        self._wake.set()

    async def next(self) -> stage_pb2.Delivery | None:
        """The next delivery; None once ended cleanly; raises SubscriptionEnded on error."""
        while True:
            if self._items:
                delivery, size = self._items.popleft()
                self._bytes -= size
                self._hub.buffered_bytes -= size
                return delivery
            if self.ended:
                if self._error is not None:
                    raise self._error
                return None
            self._wake.clear()
            await self._wake.wait()


class DeliveryHub:
    """The session's current subscriber at this node, and the node-wide bounds."""

    def __init__(self, limits: RelayLimits, clock: Callable[[], float] = time.monotonic) -> None:
        self.limits = limits
        self._clock = clock
        self._current: dict[str, Subscriber] = {}
        # Handlers still running per session: the current one and replaced ones whose
        # last write has not drained yet (a client that stopped reading).
        self._live: dict[str, int] = {}
        self.buffered_bytes = 0

    def subscribers(self) -> int:
        return len(self._current)

    def subscribe(self, session_id: str, max_sessions: int) -> Subscriber | str:
        """A new subscriber replacing the session's current one, or why not (a message)."""
        live = self._live.get(session_id, 0)
        if session_id not in self._current and len(self._live) >= max_sessions:
            return (
                f"this node already holds {len(self._live)} delivery subscriptions, its "
                "limit; end unused sessions or use another replica"
            )
        if live >= 2:
            return (
                f"session {session_id!r} already has {live} delivery streams here (a replaced "
                "one has not finished: its client does not read); cancel it first"
            )
        subscriber = Subscriber(self, session_id, self._clock())
        old = self._current.get(session_id)
        if old is not None:
            subscriber.take_over(old)  # e.g. a client that reconnected loses nothing
            old.end()  # replaced: that stream ends cleanly
        self._current[session_id] = subscriber
        self._live[session_id] = live + 1
        return subscriber

    def release(self, subscriber: Subscriber) -> None:
        """The subscriber's handler has returned."""
        subscriber.end()
        session_id = subscriber.session_id
        if self._current.get(session_id) is subscriber:
            del self._current[session_id]
        left = self._live.get(session_id, 1) - 1
        if left > 0:
            self._live[session_id] = left
        else:
            self._live.pop(session_id, None)

    def deliver(self, session_id: str, delivery: stage_pb2.Delivery) -> bool:
        """Queue ``delivery`` for the session's subscriber; False when there is none (or it
        was just ended because its client does not read)."""
        subscriber = self._current.get(session_id)
        if subscriber is None or subscriber.ended:
            return False
        limits = self.limits
        size = delivery.ByteSize()
        # An empty buffer always takes one more: each subscriber can make progress.
        if subscriber.buffered and (
            subscriber.buffered >= limits.delivery_buffer
            or subscriber._bytes + size > limits.delivery_buffer_bytes
            or self.buffered_bytes + size > limits.deliveries_total_bytes
        ):
            first = subscriber._items[0][0].step
            log.warning(
                "deliveries of session %s are not being read (%d buffered); ending the "
                "subscription",
                session_id,
                subscriber.buffered,
            )
            subscriber.end(
                SubscriptionEnded(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"{subscriber.buffered} deliveries ({subscriber._bytes} bytes) waited "
                    "unread at this node, its limit; they (steps "
                    f"{first}..{delivery.step}) were dropped. Read the Deliveries stream as "
                    "fast as answers come, and subscribe again",
                )
            )
            del self._current[session_id]
            return False
        subscriber.put(delivery, size)
        subscriber.last_activity = self._clock()
        return True

    def end_session(self, session_id: str) -> None:
        subscriber = self._current.pop(session_id, None)
        if subscriber is not None:
            subscriber.end()

    def sweep(self, live_sessions: set[str], idle_s: float) -> list[str]:
        """End subscriptions of sessions with no cache here that have been idle ``idle_s``
        (a session that expired, or one subscribed but never used)."""
        now = self._clock()
        ended = [
            s
            for s, sub in self._current.items()
            if s not in live_sessions and now - sub.last_activity >= idle_s
        ]
        for session_id in ended:
            self.end_session(session_id)
        return ended

    def close(self) -> None:
        for session_id in list(self._current):
            self.end_session(session_id)


# ---- outgoing links ---------------------------------------------------------------------


def _capability_key(signed: client_api_pb2.SignedCapability) -> bytes:
    return signed.signature + signed.claims


class _Link:
    """One outgoing Forward stream of a session to one address."""

    def __init__(
        self,
        links: RelayLinks,
        session_id: str,
        address: str,
        call: grpc.aio.StreamStreamCall,
    ) -> None:
        self._links = links
        self.session_id = session_id
        self.address = address
        self.call = call
        self.queue: deque[tuple[stage_pb2.ForwardRequest, client_api_pb2.SignedCapability, int]]
        self.queue = deque()
        self.queued_bytes = 0
        self._wake = asyncio.Event()
        self._sent_capability: bytes | None = None
        self.closed = False
        # A write is under way (the writer task's, or one made at once by ``send``): gRPC
        # allows one at a time on a stream.
        self.writing = False
        loop = asyncio.get_running_loop()
        name = f"relay {session_id} -> {address}"
        self._writer = loop.create_task(self._write_loop(), name=name + " writer")
        self._reader = loop.create_task(self._read_loop(), name=name + " reader")

    def push(
        self, request: stage_pb2.ForwardRequest, signed: client_api_pb2.SignedCapability, size: int
    ) -> None:
        self.queue.append((request, signed, size))
        self.queued_bytes += size
        self._links.queued_bytes += size
        self._wake.set()

    async def write_now(
        self, request: stage_pb2.ForwardRequest, signed: client_api_pb2.SignedCapability
    ) -> str | None:
        """Write at once, in the caller's task: the link is idle (nothing queued, no write
        under way). Waking the writer task instead costs the next hop a pass of this
        node's event loop, behind whatever the caller does next (signing, answering).
        Why it failed, or None."""
        try:
            await self._write(request, signed)
        except asyncio.CancelledError:
            raise
        except Exception as err:  # the stream broke: drop it, the next relay reopens one
            reason = f"sending failed: {_describe(err)}"
            self._links.drop(self, reason)
            return reason
        return None

    async def _write(
        self, request: stage_pb2.ForwardRequest, signed: client_api_pb2.SignedCapability
    ) -> None:
        # The capability goes on this stream's first message, and again whenever the
        # session's changed (a reroute): the next node checks every stream.
        key = _capability_key(signed)
        limits = self._links.limits
        first = self._sent_capability is None
        timeout_s = limits.first_write_timeout_s if first else limits.write_timeout_s
        if key != self._sent_capability:
            request.capability.CopyFrom(signed)
            self._sent_capability = key
        self.writing = True
        try:
            async with asyncio.timeout(timeout_s):
                await self.call.write(request)
        finally:
            self.writing = False
            if self.queue:
                self._wake.set()

    async def _write_loop(self) -> None:
        try:
            while not self.closed:
                if not self.queue:
                    self._wake.clear()
                    await self._wake.wait()
                    continue
                if self.writing:  # ``write_now`` is writing; it wakes us when done
                    self._wake.clear()
                    await self._wake.wait()
                    continue
                request, signed, size = self.queue.popleft()
                self.queued_bytes -= size
                self._links.queued_bytes -= size
                await self._write(request, signed)
        except asyncio.CancelledError:
            self._cancelled("sending")
            raise
        except Exception as err:  # the stream broke: drop it, the next relay reopens one
            self._links.drop(self, f"sending failed: {_describe(err)}")

    async def _read_loop(self) -> None:
        try:
            while True:
                response = await self.call.read()
                if response is grpc.aio.EOF:
                    self._links.drop(self, "the next node ended the stream")
                    return
                # Relayed calls are answered on the session's Deliveries stream there.
                log.debug("unexpected answer on relay link to %s; ignored", self.address)
        except asyncio.CancelledError:
            self._cancelled("reading")
            raise
        except Exception as err:
            self._links.drop(self, _describe(err))

    def _cancelled(self, doing: str) -> None:
        # close() sets `closed` before it cancels these tasks; otherwise the call itself
        # was cancelled underneath (its channel closed): the link is of no more use.
        if not self.closed:
            self._links.drop(self, f"the call was cancelled while {doing}")

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self._links.queued_bytes -= self.queued_bytes
        self.queue.clear()
        self.queued_bytes = 0
        current = asyncio.current_task()
        for task in (self._writer, self._reader):
            if task is not current:
                task.cancel()
        self.call.cancel()


def _describe(err: BaseException) -> str:
    if isinstance(err, grpc.aio.AioRpcError):
        return f"{err.code().name}: {err.details()}"
    if isinstance(err, TimeoutError):
        return "the next node took nothing within the write timeout"
    return f"{type(err).__name__}: {err}"


class RelayLinks:
    """Outgoing node->node streams, per (session, address), on a channel per address."""

    def __init__(self, channel_options: Sequence[tuple[str, int]], limits: RelayLimits) -> None:
        self._options = [*channel_options, *DATA_WINDOW]
        self.limits = limits
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._links: dict[tuple[str, str], _Link] = {}
        self._closing: set[asyncio.Task[None]] = set()  # channel closes under way
        self.queued_bytes = 0

    def links(self) -> list[tuple[str, str]]:
        return list(self._links)

    async def send(
        self,
        address: str,
        request: stage_pb2.ForwardRequest,
        signed: client_api_pb2.SignedCapability,
    ) -> str | None:
        """Send ``request`` to ``address`` on the session's link (opened if needed): at
        once when the link is idle, else queued behind its backlog, never waiting for that.
        Why it is known lost already (the write failed, or the link's backlog is full), or
        None; a queued request that is lost later is noticed by the client's deadline."""
        key = (request.session_id, address)
        link = self._links.get(key)
        if link is None or link.closed:
            channel = self._channels.get(address)
            if channel is None:
                channel = self._channels[address] = grpc.aio.insecure_channel(
                    address, options=self._options
                )
            call = stage_pb2_grpc.StageStub(channel).Forward()
            link = self._links[key] = _Link(self, request.session_id, address, call)
            log.debug("relay link %s -> %s opened", request.session_id, address)
        if not link.queue and not link.writing:
            return await link.write_now(request, signed)
        size = request.ByteSize()
        limits = self.limits
        if link.queue and (
            len(link.queue) >= limits.link_queue
            or self.queued_bytes + size > limits.links_total_bytes
        ):
            # The next node does not keep up (or its connection hangs): this step is lost,
            # which the relaying call's answer tells the client, who sends it itself.
            reason = f"the link to {address} has {len(link.queue)} requests waiting"
            log.warning("relay of %s: %s; dropped step %d", request.session_id, reason,
                        request.step)  # fmt: skip
            return reason
        link.push(request, signed, size)
        return None

    def drop(self, link: _Link, reason: str) -> None:
        if link.closed:
            return
        if self._links.get((link.session_id, link.address)) is link:
            del self._links[(link.session_id, link.address)]
        lost = len(link.queue)
        link.close()
        log.warning(
            "relay link %s -> %s dropped (%s)%s; the next relay reopens it",
            link.session_id,
            link.address,
            reason,
            f", {lost} queued requests lost" if lost else "",
        )

    def end_sessions(self, session_ids: Iterable[str]) -> None:
        ending = set(session_ids)
        for key in [k for k in self._links if k[0] in ending]:
            self._links.pop(key).close()

    def keep_only(self, live_sessions: set[str]) -> None:
        """Close the links of sessions this node no longer holds, and idle channels."""
        self.end_sessions({s for s, _ in self._links if s not in live_sessions})
        used = {address for _, address in self._links}
        for address in [a for a in self._channels if a not in used]:
            task = asyncio.get_running_loop().create_task(self._channels.pop(address).close())
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)

    async def close(self) -> None:
        for link in list(self._links.values()):
            link.close()
        self._links.clear()
        channels, self._channels = list(self._channels.values()), {}
        for channel in channels:
            with contextlib.suppress(Exception):
                await channel.close()
