"""Listens on the event bus for what nodes publish about themselves.

A node agent started with --mqtt keeps a last will `{"state": "offline"}` on
tessera/nodes/{id}/presence, so the broker announces a node that vanished even while its
TCP stream to us has not noticed yet. Telemetry the node publishes there is folded into
the registry too. (The registry itself publishes every state change on the same presence
topic, marked "source": "coordinator"; those echoes are ignored here.)
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from google.protobuf import json_format

from coordinator.events import Event, EventBus, Subscription
from coordinator.registry import Registry
from protos.tessera.v1 import node_pb2

log = logging.getLogger(__name__)

PRESENCE_PATTERN = "tessera/nodes/+/presence"
TELEMETRY_PATTERN = "tessera/nodes/+/telemetry"
COORDINATOR_SOURCE = "coordinator"


def _node_id_of(topic: str) -> str:
    return topic.split("/")[2]


class PresenceWatcher:
    def __init__(self, bus: EventBus, registry: Registry) -> None:
        self.bus = bus
        self.registry = registry
        self.ignored = 0
        self._subs: list[Subscription] = []
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        presence = self.bus.subscribe(PRESENCE_PATTERN)
        telemetry = self.bus.subscribe(TELEMETRY_PATTERN)
        self._subs = [presence, telemetry]
        self._tasks = [
            asyncio.create_task(self._consume(presence, self._on_presence), name="presence"),
            asyncio.create_task(self._consume(telemetry, self._on_telemetry), name="telemetry"),
        ]

    async def ready(self, timeout: float = 10.0) -> None:
        for sub in self._subs:
            await sub.ready(timeout)

    async def stop(self) -> None:
        for sub in self._subs:
            sub.close()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _consume(self, sub: Subscription, handle: Any) -> None:
        async for event in sub:
            try:
                handle(event)
            except Exception:
                log.exception("could not handle the event on %s", event.topic)

    def _parse(self, event: Event) -> dict[str, Any] | None:
        try:
            payload = event.json()
        except ValueError:
            self.ignored += 1
            log.warning("ignoring a non-JSON payload on %s (%d bytes)", event.topic,
                        len(event.payload))  # fmt: skip
            return None
        if not isinstance(payload, dict):
            self.ignored += 1
            log.warning("ignoring a payload on %s that is not a JSON object", event.topic)
            return None
        return payload

    def _on_presence(self, event: Event) -> None:
        # A retained message is history (replayed on subscribe), not something happening now.
        if event.retained:
            return
        payload = self._parse(event)
        if payload is None or payload.get("source") == COORDINATOR_SOURCE:
            return
        node_id = _node_id_of(event.topic)
        if payload.get("node_id", node_id) != node_id:
            log.warning("ignoring presence on %s that claims to be about %r", event.topic,
                        payload.get("node_id"))  # fmt: skip
            return
        if payload.get("state") != "offline":
            return
        ts = payload.get("ts")
        ts_ms = int(ts) if isinstance(ts, (int, float)) and not isinstance(ts, bool) else None
        if self.registry.mark_offline_by_broker(node_id, ts_ms):
            log.info("node %s went offline according to the event broker", node_id)

    def _on_telemetry(self, event: Event) -> None:
        if event.retained:
            return
        payload = self._parse(event)
        if payload is None:
            return
        telemetry = node_pb2.Telemetry()
        try:
            json_format.ParseDict(payload, telemetry, ignore_unknown_fields=True)
        except json_format.ParseError as exc:
            log.debug("ignoring malformed telemetry on %s: %s", event.topic, exc)
            return
        self.registry.on_broker_telemetry(_node_id_of(event.topic), telemetry)
