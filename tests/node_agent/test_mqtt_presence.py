"""Presence and telemetry on a real Mosquitto, including broker outages."""

import asyncio
import json

import aiomqtt
import pytest
from support.mosquitto import mosquitto, mosquitto_broker  # noqa: F401

from node_agent.backoff import Backoff
from node_agent.mqtt_presence import (
    MqttPresence,
    parse_broker_url,
    presence_topic,
    telemetry_topic,
)
from protos.tessera.v1 import node_pb2

pytestmark = pytest.mark.mqtt
NODE = "ntest0000000000000000000"


class Subscriber:
    """A raw aiomqtt client that collects every message on tessera/nodes/#."""

    def __init__(self, url: str) -> None:
        self.broker = parse_broker_url(url)
        self.messages: list[tuple[str, dict]] = []
        self._task: asyncio.Task | None = None
        self._ready = asyncio.Event()

    async def __aenter__(self) -> "Subscriber":
        self._task = asyncio.create_task(self._run())
        await asyncio.wait_for(self._ready.wait(), 10)
        return self

    async def __aexit__(self, *exc) -> None:
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)

    async def _run(self) -> None:
        async with aiomqtt.Client(self.broker.host, self.broker.port) as client:
            await client.subscribe("tessera/nodes/#", qos=1)
            self._ready.set()
            async for message in client.messages:
                self.messages.append((str(message.topic), json.loads(message.payload)))

    def states(self) -> list[str]:
        return [m["state"] for t, m in self.messages if t == presence_topic(NODE)]

    def telemetry(self) -> list[dict]:
        return [m for t, m in self.messages if t == telemetry_topic(NODE)]


def test_broker_urls() -> None:
    assert parse_broker_url("mqtt://127.0.0.1:1884").port == 1884
    assert parse_broker_url("broker.example").port == 1883
    tls = parse_broker_url("mqtts://u%40x:p@broker.example")
    assert (tls.tls, tls.port, tls.username, tls.password) == (True, 8883, "u@x", "p")
    for bad in ("http://x", "mqtt://", "mqtt://h:notaport"):
        with pytest.raises(ValueError, match="mqtt"):
            parse_broker_url(bad)


async def test_online_telemetry_draining_offline(mosquitto, wait_until) -> None:  # noqa: F811
    async with Subscriber(mosquitto) as sub:
        presence = MqttPresence(parse_broker_url(mosquitto), NODE, Backoff(0.05, 0.2))
        presence.start()
        await wait_until(lambda: sub.states() == ["online"], what="online")
        presence.publish_telemetry(node_pb2.Telemetry(memory_used_bytes=123, active_sessions=2))
        await wait_until(lambda: sub.telemetry(), what="telemetry")
        sample = sub.telemetry()[0]
        assert sample["memory_used_bytes"] == 123 and sample["active_sessions"] == 2
        assert sample["queue_length"] == 0  # every field is present
        presence.set_state("draining")
        await presence.close()
        await wait_until(lambda: sub.states() == ["online", "draining", "offline"], what="offline")
    online = next(m for t, m in sub.messages if t == presence_topic(NODE))
    assert online["node_id"] == NODE and online["ts"] > 0


async def test_presence_is_retained_for_late_subscribers(mosquitto, wait_until) -> None:  # noqa: F811
    presence = MqttPresence(parse_broker_url(mosquitto), NODE, Backoff(0.05, 0.2))
    presence.start()
    async with Subscriber(mosquitto) as first:
        await wait_until(lambda: first.states() == ["online"], what="online")
    async with Subscriber(mosquitto) as late:
        await wait_until(lambda: late.states() == ["online"], what="the retained online")
    await presence.close()


async def test_a_broker_outage_is_survived_and_presence_restored(
    mosquitto_broker,  # noqa: F811
    wait_until,
) -> None:
    mosquitto_broker.stop()
    presence = MqttPresence(parse_broker_url(mosquitto_broker.url), NODE, Backoff(0.05, 0.2))
    presence.start()
    # No broker: the task keeps retrying instead of dying.
    await wait_until(lambda: presence._backoff.attempt >= 2, what="retries")
    assert not presence._task.done()
    mosquitto_broker.start()  # persistence is off: the broker starts empty
    async with Subscriber(mosquitto_broker.url) as sub:
        await wait_until(lambda: sub.states() == ["online"], what="online after the outage")
    await presence.close()


async def test_close_without_a_broker_returns_promptly() -> None:
    presence = MqttPresence(parse_broker_url("mqtt://127.0.0.1:1"), NODE, Backoff(0.05, 0.2))
    presence.start()
    await asyncio.wait_for(presence.close(), 10)
    assert presence._task.done()
