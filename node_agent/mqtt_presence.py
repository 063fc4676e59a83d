"""Presence and telemetry on the MQTT event plane (`--mqtt URL`).

The broker holds a retained presence message per node and a last will of "offline", so a
node that vanishes (power cut, kill -9) is reported by the broker itself. MQTT is a
convenience: trouble with the broker is logged and retried, and never stops the agent.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable

import aiomqtt
from google.protobuf import json_format

from node_agent.backoff import Backoff
from protos.mqtt_url import BrokerAddress, parse_broker_url
from protos.tessera.v1 import node_pb2

__all__ = ["BrokerAddress", "MqttPresence", "parse_broker_url"]

log = logging.getLogger(__name__)

KEEPALIVE_S = 15
_CLOSE_TIMEOUT_S = 3.0


def presence_topic(node_id: str) -> str:
    return f"tessera/nodes/{node_id}/presence"


def telemetry_topic(node_id: str) -> str:
    return f"tessera/nodes/{node_id}/telemetry"


def presence_payload(node_id: str, state: str, ts_s: float | None) -> bytes:
    body: dict[str, object] = {"state": state, "node_id": node_id}
    if ts_s is not None:
        body["ts"] = int(ts_s * 1000)
    return json.dumps(body).encode()


def telemetry_payload(telemetry: node_pb2.Telemetry) -> bytes:
    """The JSON mapping of `Telemetry`, with every field present and numbers as numbers."""
    body = json_format.MessageToDict(
        telemetry,
        preserving_proto_field_name=True,
        always_print_fields_with_no_presence=True,
        unquote_int64_if_possible=True,
    )
    return json.dumps(body).encode()


class MqttPresence:
    """Runs as a background task: `run()`; feed it with `set_state` / `publish_telemetry`."""

    def __init__(
        self,
        broker: BrokerAddress,
        node_id: str,
        backoff: Backoff,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._broker = broker
        self._node_id = node_id
        self._backoff = backoff
        # Stamps presence: Unix seconds by the coordinator's clock, which compares the
        # stamp with when the node's Attach stream began to tell a stale "offline" from a
        # current one (a node whose own clock is hours off would fool it).
        self._clock = clock
        self._state = "online"
        # Every transition is published in order (draining, then offline), not only the
        # latest: watchers learn that the node left gracefully.
        self._pending_states: list[str] = ["online"]
        self._telemetry: node_pb2.Telemetry | None = None
        self._closing = False
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Start publishing; once only (the agent calls it at every registration)."""
        if self._task is None:
            self._task = asyncio.create_task(self.run(), name="mqtt-presence")

    def set_state(self, state: str) -> None:
        if state != self._state:
            self._state = state
            self._pending_states.append(state)
            self._wake.set()

    def publish_telemetry(self, telemetry: node_pb2.Telemetry) -> None:
        # Only the newest sample matters; a backlog after an outage would be stale.
        self._telemetry = telemetry
        self._wake.set()

    async def close(self) -> None:
        """Publish `offline` (retained) and disconnect cleanly, within a few seconds."""
        self._closing = True
        self.set_state("offline")
        self._wake.set()
        if self._task is None:
            return
        try:
            await asyncio.wait_for(asyncio.shield(self._task), _CLOSE_TIMEOUT_S)
        except TimeoutError:
            log.warning("MQTT broker %s did not take the offline message in time", self._broker)
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def run(self) -> None:
        while True:
            try:
                await self._session()
                return
            except aiomqtt.MqttError as exc:
                if self._closing:
                    return
                delay = self._backoff.next_delay()
                log.warning(
                    "MQTT broker %s: %s; presence and telemetry paused, retrying in %.1fs",
                    self._broker,
                    exc,
                    delay,
                )
                await asyncio.sleep(delay)

    def _client(self) -> aiomqtt.Client:
        topic = presence_topic(self._node_id)
        return aiomqtt.Client(
            self._broker.host,
            self._broker.port,
            username=self._broker.username,
            password=self._broker.password,
            identifier=f"tessera-node-{self._node_id}",
            # ts is left out: it would be the connect time, not the time the node vanished.
            will=aiomqtt.Will(
                topic, presence_payload(self._node_id, "offline", ts_s=None), 1, True
            ),
            keepalive=KEEPALIVE_S,
            timeout=10,
            tls_context=self._broker.tls_context(),
        )

    async def _session(self) -> None:
        async with self._client() as client:
            self._backoff.reset()
            log.info("connected to MQTT broker %s as %s", self._broker, self._node_id)
            if not self._pending_states:
                self._pending_states.append(self._state)  # a new connection re-asserts it
            while True:
                while self._pending_states:
                    await client.publish(
                        presence_topic(self._node_id),
                        presence_payload(self._node_id, self._pending_states[0], self._clock()),
                        qos=1,
                        retain=True,
                    )
                    self._pending_states.pop(0)
                if self._telemetry is not None and not self._closing:
                    telemetry, self._telemetry = self._telemetry, None
                    await client.publish(
                        telemetry_topic(self._node_id), telemetry_payload(telemetry), qos=0
                    )
                if self._closing and not self._pending_states:
                    return
                await self._wake.wait()
                self._wake.clear()
