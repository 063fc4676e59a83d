"""The event plane: one EventBus interface, an in-process backend and an MQTT backend.

Topics follow MQTT conventions (levels separated by "/", subscriptions may use "+" for one
level and "#" for the rest). Payloads are bytes; dicts are sent as JSON.

    bus = create_bus(None)                       # in-process, no broker needed
    bus = create_bus("mqtt://127.0.0.1:1883")    # Mosquitto, EMQX, HiveMQ...
    await bus.start()
    sub = bus.subscribe("tessera/nodes/+/presence")
    await sub.ready()
    await bus.publish("tessera/nodes/n1/presence", {"state": "online"}, retain=True)
    async for event in sub: ...

Publishing never blocks the caller: the MQTT backend queues (bounded) while the broker is
away and reconnects on its own, and slow subscribers lose their oldest events, not the
publisher's time.
"""

from __future__ import annotations

import abc
import asyncio
import collections
import json
import logging
import random
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from protos.mqtt_url import BrokerAddress, parse_broker_url

log = logging.getLogger(__name__)

DEFAULT_QUEUE = 10_000


@dataclass(frozen=True)
class Event:
    topic: str
    payload: bytes
    # True when the broker (or bus) replayed a stored message to a new subscriber,
    # False for a message published while the subscription existed.
    retained: bool = False

    def json(self) -> Any:
        """The payload parsed as JSON; raises ValueError on anything else."""
        return json.loads(self.payload)


def encode_payload(payload: bytes | str | dict[str, Any] | list[Any]) -> bytes:
    if isinstance(payload, bytes):
        return payload
    if isinstance(payload, str):
        return payload.encode()
    return json.dumps(payload, separators=(",", ":"), sort_keys=True).encode()


def check_topic(topic: str) -> None:
    if not topic or "+" in topic or "#" in topic or "\0" in topic:
        raise ValueError(f"cannot publish to {topic!r}: topics are non-empty, without + or #")


def check_pattern(pattern: str) -> None:
    levels = pattern.split("/")
    for i, level in enumerate(levels):
        if ("#" in level and (level != "#" or i != len(levels) - 1)) or (
            "+" in level and level != "+"
        ):
            raise ValueError(
                f"bad subscription {pattern!r}: '+' must be a whole level and '#' the last one"
            )


def topic_matches(pattern: str, topic: str) -> bool:
    """MQTT matching: '+' is one level, a final '#' is any number of levels (even zero)."""
    if topic.startswith("$") and not pattern.startswith("$"):
        return False  # wildcards never match broker-internal $SYS topics
    pattern_levels = pattern.split("/")
    topic_levels = topic.split("/")
    for i, want in enumerate(pattern_levels):
        if want == "#":
            return True
        if i >= len(topic_levels):
            return False
        if want != "+" and want != topic_levels[i]:
            return False
    return len(pattern_levels) == len(topic_levels)


class Subscription:
    """An async iterator of Events matching `pattern`. close() ends the iteration."""

    _CLOSED = object()

    def __init__(
        self, pattern: str, maxsize: int, on_close: Callable[[Subscription], None]
    ) -> None:
        check_pattern(pattern)
        self.pattern = pattern
        self.dropped = 0
        self._queue: asyncio.Queue[Any] = asyncio.Queue(maxsize=maxsize + 1)
        self._maxsize = maxsize
        self._ready = asyncio.Event()
        self._closed = False
        self._on_close = on_close

    def deliver(self, event: Event) -> None:
        if self._closed:
            return
        if self._queue.qsize() >= self._maxsize:
            self._queue.get_nowait()  # the oldest event goes; the publisher never waits
            self.dropped += 1
            if self.dropped in (1, 1000) or self.dropped % 100_000 == 0:
                log.warning("subscriber of %s is slow: %d events dropped", self.pattern,
                            self.dropped)  # fmt: skip
        self._queue.put_nowait(event)

    async def ready(self, timeout: float = 10.0) -> None:
        """Wait until events published from now on will reach this subscription."""
        await asyncio.wait_for(self._ready.wait(), timeout)

    async def get(self, timeout: float | None = None) -> Event:
        item = await asyncio.wait_for(self._queue.get(), timeout)
        if item is self._CLOSED:
            self._queue.put_nowait(item)
            raise StopAsyncIteration
        return item

    def __aiter__(self) -> Subscription:
        return self

    async def __anext__(self) -> Event:
        return await self.get()

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._on_close(self)
            self._queue.put_nowait(self._CLOSED)

    async def __aenter__(self) -> Subscription:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()


class EventBus(abc.ABC):
    """Publish/subscribe with MQTT topic semantics and retained messages."""

    def __init__(self) -> None:
        self._subscriptions: list[Subscription] = []

    async def start(self) -> None:  # noqa: B027 - most backends need no start-up
        """Begin delivering (connects, for a broker). Safe to publish before it."""

    async def publish(
        self, topic: str, payload: bytes | str | dict[str, Any], retain: bool = False
    ) -> None:
        self.publish_nowait(topic, payload, retain)

    @abc.abstractmethod
    def publish_nowait(
        self, topic: str, payload: bytes | str | dict[str, Any], retain: bool = False
    ) -> None:
        """Publish without waiting; a retained empty payload clears the topic."""

    def subscribe(self, pattern: str, maxsize: int = DEFAULT_QUEUE) -> Subscription:
        sub = Subscription(pattern, maxsize, self._unsubscribe)
        self._subscriptions.append(sub)
        self._on_subscribe(sub)
        return sub

    @abc.abstractmethod
    def _on_subscribe(self, sub: Subscription) -> None: ...

    def _unsubscribe(self, sub: Subscription) -> None:
        if sub in self._subscriptions:
            self._subscriptions.remove(sub)

    def _dispatch(self, event: Event) -> None:
        for sub in self._subscriptions:
            if topic_matches(sub.pattern, event.topic):
                sub.deliver(event)

    async def close(self) -> None:
        for sub in list(self._subscriptions):
            sub.close()


class InProcessBus(EventBus):
    """The default bus: events stay inside the coordinator process."""

    def __init__(self) -> None:
        super().__init__()
        self._retained: dict[str, bytes] = {}

    def publish_nowait(
        self, topic: str, payload: bytes | str | dict[str, Any], retain: bool = False
    ) -> None:
        check_topic(topic)
        data = encode_payload(payload)
        if retain:
            if data:
                self._retained[topic] = data
            else:
                self._retained.pop(topic, None)
        self._dispatch(Event(topic, data, retained=False))

    def _on_subscribe(self, sub: Subscription) -> None:
        for topic, data in self._retained.items():
            if topic_matches(sub.pattern, topic):
                sub.deliver(Event(topic, data, retained=True))
        sub._ready.set()


def parse_mqtt_url(url: str) -> BrokerAddress:
    """mqtt://[USER:PASS@]HOST[:PORT], or mqtts://... over TLS (protos/mqtt_url.py)."""
    if "://" not in url:
        raise ValueError(
            f"{url!r} is not an MQTT URL like mqtt://HOST:PORT or mqtts://HOST:PORT (TLS)"
        )
    return parse_broker_url(url, bare=False)


@dataclass(frozen=True)
class _Outgoing:
    topic: str
    payload: bytes
    retain: bool
    qos: int


class MqttBus(EventBus):
    """The same bus over a real MQTT broker, via aiomqtt.

    The connection lives in a background task that reconnects with capped, jittered
    back-off, so a broker that is down at start-up or restarts later only delays events.
    Retained messages this process published are republished after every reconnect: a
    broker without persistence forgets them when it restarts.
    """

    def __init__(
        self,
        url: str,
        *,
        client_id: str | None = None,
        will: tuple[str, bytes] | None = None,
        keepalive_s: int = 30,
        max_outbox: int = DEFAULT_QUEUE,
        reconnect_min_s: float = 0.1,
        reconnect_max_s: float = 5.0,
    ) -> None:
        super().__init__()
        self.broker = parse_mqtt_url(url)
        self.url = str(self.broker)  # for logs: without the password
        self.client_id = client_id or f"tessera-{secrets.token_hex(6)}"
        self._will = will
        self._keepalive_s = keepalive_s
        self._max_outbox = max_outbox
        self._reconnect = (reconnect_min_s, reconnect_max_s)
        self._outbox: collections.deque[_Outgoing] = collections.deque()
        self._outbox_ready = asyncio.Event()
        self._retained: dict[str, bytes] = {}
        self._client: Any = None
        self._connected = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._closing = False
        self.connections = 0
        self.dropped = 0

    @property
    def connected(self) -> bool:
        return self._connected.is_set()

    async def wait_connected(self, timeout: float = 10.0) -> None:
        await asyncio.wait_for(self._connected.wait(), timeout)

    async def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name=f"mqtt {self.url}")

    def publish_nowait(
        self,
        topic: str,
        payload: bytes | str | dict[str, Any],
        retain: bool = False,
        qos: int = 1,
    ) -> None:
        check_topic(topic)
        data = encode_payload(payload)
        if retain:
            if data:
                self._retained[topic] = data
            else:
                self._retained.pop(topic, None)
        if len(self._outbox) >= self._max_outbox:
            self._outbox.popleft()
            self.dropped += 1
            if self.dropped in (1, 1000) or self.dropped % 100_000 == 0:
                log.warning("MQTT outbox full (broker away?): %d events dropped", self.dropped)
        self._outbox.append(_Outgoing(topic, data, retain, qos))
        self._outbox_ready.set()

    def _on_subscribe(self, sub: Subscription) -> None:
        if self._client is not None and self.connected:
            asyncio.get_running_loop().create_task(self._subscribe_one(self._client, sub))

    async def _subscribe_one(self, client: Any, sub: Subscription) -> None:
        try:
            await client.subscribe(sub.pattern, qos=1)
            sub._ready.set()
        except Exception as exc:  # noqa: BLE001 - the reconnect loop subscribes again
            log.warning("MQTT subscribe to %s failed: %s", sub.pattern, exc)

    def _unsubscribe(self, sub: Subscription) -> None:
        super()._unsubscribe(sub)
        still_wanted = any(s.pattern == sub.pattern for s in self._subscriptions)
        if not still_wanted and self._client is not None and self.connected:
            client = self._client

            async def unsubscribe() -> None:
                try:
                    await client.unsubscribe(sub.pattern)
                except Exception:  # noqa: BLE001 - harmless: we drop unmatched events anyway
                    pass

            asyncio.get_running_loop().create_task(unsubscribe())

    async def _run(self) -> None:
        import aiomqtt  # only MQTT users need it

        delay = self._reconnect[0]
        while not self._closing:
            will = None
            if self._will is not None:
                will = aiomqtt.Will(self._will[0], self._will[1], qos=1, retain=True)
            try:
                async with aiomqtt.Client(
                    self.broker.host,
                    self.broker.port,
                    username=self.broker.username,
                    password=self.broker.password,
                    tls_context=self.broker.tls_context(),
                    identifier=self.client_id,
                    will=will,
                    keepalive=self._keepalive_s,
                    timeout=10,
                ) as client:
                    self.connections += 1
                    log.info("connected to MQTT broker %s as %s", self.url, self.client_id)
                    delay = self._reconnect[0]
                    self._client = client
                    for sub in list(self._subscriptions):
                        await client.subscribe(sub.pattern, qos=1)
                        sub._ready.set()
                    for topic, data in list(self._retained.items()):
                        await client.publish(topic, data, qos=1, retain=True)
                    self._connected.set()
                    await self._pump(client)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - any broker trouble means: retry later
                if not self._closing:
                    log.warning("MQTT broker %s unavailable (%s); retrying in %.1f s",
                                self.url, exc or type(exc).__name__, delay)  # fmt: skip
            finally:
                self._connected.clear()
                self._client = None
            if self._closing:
                break
            await asyncio.sleep(delay * (0.5 + random.random() / 2))
            delay = min(delay * 2, self._reconnect[1])

    async def _pump(self, client: Any) -> None:
        """Send the outbox and receive events until the connection fails."""
        sender = asyncio.create_task(self._send_loop(client))
        receiver = asyncio.create_task(self._receive_loop(client))
        try:
            done, _ = await asyncio.wait({sender, receiver}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (sender, receiver):
                task.cancel()
            await asyncio.gather(sender, receiver, return_exceptions=True)
        for task in done:
            task.result()  # re-raise the connection error

    async def _send_loop(self, client: Any) -> None:
        while True:
            while not self._outbox:
                self._outbox_ready.clear()
                await self._outbox_ready.wait()
            item = self._outbox[0]
            await client.publish(item.topic, item.payload, qos=item.qos, retain=item.retain)
            # Removed only once sent: a message in flight during a disconnect is resent.
            if self._outbox and self._outbox[0] is item:
                self._outbox.popleft()

    async def _receive_loop(self, client: Any) -> None:
        async for message in client.messages:
            payload = message.payload
            if not isinstance(payload, bytes):
                payload = encode_payload(str(payload) if payload is not None else b"")
            self._dispatch(Event(message.topic.value, payload, retained=bool(message.retain)))

    async def close(self) -> None:
        """Send what is queued (briefly), then disconnect."""
        self._closing = True
        if self._task is not None:
            if self.connected:
                deadline = asyncio.get_running_loop().time() + 2.0
                while self._outbox and asyncio.get_running_loop().time() < deadline:
                    await asyncio.sleep(0.01)
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        await super().close()


def create_bus(mqtt_url: str | None, **mqtt_options: Any) -> EventBus:
    return MqttBus(mqtt_url, **mqtt_options) if mqtt_url else InProcessBus()
