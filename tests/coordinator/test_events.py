"""The event bus, both backends, and presence through a real Mosquitto broker."""

from __future__ import annotations

import asyncio
import json
import sys
import time

import aiomqtt
import grpc
import pytest
from hypothesis import given
from hypothesis import strategies as st
from paho.mqtt.client import topic_matches_sub
from support.coordinator_harness import Harness, wait_until
from support.mosquitto import MosquittoBroker, require_mosquitto_binary
from support.ports import free_port
from support.procs import ManagedProcess

from coordinator.events import (
    EventBus,
    InProcessBus,
    MqttBus,
    check_pattern,
    parse_mqtt_url,
    topic_matches,
)
from coordinator.node_state import NodeState
from coordinator.presence import PresenceWatcher
from protos.mqtt_url import PASSWORD_ENV, BrokerAddress

# -- topic matching -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("pattern", "topic", "expected"),
    [
        ("tessera/nodes/+/presence", "tessera/nodes/n1/presence", True),
        ("tessera/nodes/+/presence", "tessera/nodes/n1/telemetry", False),
        ("tessera/nodes/+/presence", "tessera/nodes/n1/x/presence", False),
        ("tessera/#", "tessera", True),
        ("tessera/#", "tessera/a/b/c", True),
        ("#", "$SYS/broker/load", False),
        ("+/x", "/x", True),
        ("a/b", "a/b", True),
        ("a/b", "a/b/c", False),
    ],
)
def test_topic_matches(pattern: str, topic: str, expected: bool) -> None:
    assert topic_matches(pattern, topic) is expected


levels = st.lists(st.sampled_from(["a", "b", "", "n1"]), min_size=1, max_size=4)


@given(
    pattern=st.lists(st.sampled_from(["a", "b", "+", "", "n1"]), min_size=1, max_size=4).flatmap(
        lambda p: st.sampled_from([p, [*p, "#"]])
    ),
    topic=levels,
)
def test_topic_matching_agrees_with_paho(pattern: list[str], topic: list[str]) -> None:
    pattern_text, topic_text = "/".join(pattern), "/".join(topic)
    assert topic_matches(pattern_text, topic_text) == topic_matches_sub(pattern_text, topic_text)


@pytest.mark.parametrize("pattern", ["a/#/b", "a/b#", "a+/b"])
def test_bad_patterns_are_refused(pattern: str) -> None:
    with pytest.raises(ValueError, match="bad subscription"):
        check_pattern(pattern)


def test_mqtt_urls(monkeypatch: pytest.MonkeyPatch) -> None:
    assert parse_mqtt_url("mqtt://broker.example:1884") == BrokerAddress("broker.example", 1884)
    assert parse_mqtt_url("mqtt://127.0.0.1") == BrokerAddress("127.0.0.1", 1883)
    # A hosted broker: TLS and a login, the password never printed.
    hosted = parse_mqtt_url("mqtts://tessera:s%3Acret@broker.example")
    assert hosted == BrokerAddress("broker.example", 8883, True, "tessera", "s:cret")
    assert str(hosted) == "mqtts://tessera@broker.example:8883" and "cret" not in repr(hosted)
    # ... or the password from the environment, out of `ps`'s sight.
    monkeypatch.setenv(PASSWORD_ENV, "from-env")
    assert parse_mqtt_url("mqtts://tessera@broker.example").password == "from-env"
    assert parse_mqtt_url("mqtts://tessera:given@broker.example").password == "given"
    for bad in ("http://x:1", "mqtt://", "127.0.0.1:1883", "mqtt://x:99999"):
        with pytest.raises(ValueError, match="mqtt://|bad port"):
            parse_mqtt_url(bad)


# -- in-process bus -------------------------------------------------------------------------------


async def test_in_process_publish_subscribe_with_wildcards() -> None:
    bus = InProcessBus()
    presence = bus.subscribe("tessera/nodes/+/presence")
    everything = bus.subscribe("tessera/#")
    await bus.publish("tessera/nodes/n1/presence", {"state": "online"})
    await bus.publish("tessera/nodes/n1/telemetry", b"raw")

    event = await presence.get(timeout=1)
    assert (event.topic, event.json(), event.retained) == (
        "tessera/nodes/n1/presence", {"state": "online"}, False,
    )  # fmt: skip
    assert [(await everything.get(timeout=1)).topic for _ in range(2)] == [
        "tessera/nodes/n1/presence", "tessera/nodes/n1/telemetry",
    ]  # fmt: skip
    with pytest.raises(asyncio.TimeoutError):
        await presence.get(timeout=0.05)  # the telemetry event did not match
    await bus.close()


async def test_in_process_retained_messages() -> None:
    bus = InProcessBus()
    await bus.publish("tessera/nodes/n1/presence", {"state": "online"}, retain=True)
    await bus.publish("tessera/nodes/n1/presence", {"state": "offline"}, retain=True)
    await bus.publish("tessera/nodes/n2/presence", {"state": "online"}, retain=True)
    await bus.publish("tessera/nodes/n2/presence", b"", retain=True)  # clears it

    late = bus.subscribe("tessera/nodes/+/presence")
    event = await late.get(timeout=1)
    assert event.retained and event.json() == {"state": "offline"}
    with pytest.raises(asyncio.TimeoutError):
        await late.get(timeout=0.05)


async def test_slow_subscriber_loses_oldest_not_the_publisher() -> None:
    bus = InProcessBus()
    sub = bus.subscribe("t/#", maxsize=3)
    for i in range(10):
        bus.publish_nowait("t/x", str(i))
    assert sub.dropped == 7
    assert [(await sub.get(timeout=1)).payload for _ in range(3)] == [b"7", b"8", b"9"]


async def test_closing_a_subscription_ends_iteration() -> None:
    bus = InProcessBus()
    sub = bus.subscribe("t/#")
    bus.publish_nowait("t/1", "x")
    sub.close()
    received = [event async for event in sub]
    assert [e.topic for e in received] == ["t/1"]
    bus.publish_nowait("t/2", "y")  # no subscriber left: nothing breaks


def test_publishing_to_a_wildcard_is_refused() -> None:
    with pytest.raises(ValueError, match="cannot publish"):
        InProcessBus().publish_nowait("tessera/+/x", "y")


# -- MQTT bus against a real broker -------------------------------------------------------------


async def started_bus(url: str, **options) -> MqttBus:
    bus = MqttBus(url, reconnect_max_s=0.5, **options)
    await bus.start()
    await bus.wait_connected(10)
    return bus


@pytest.mark.mqtt
async def test_mqtt_publish_subscribe_and_retained(mosquitto: str) -> None:
    publisher = await started_bus(mosquitto)
    subscriber = await started_bus(mosquitto)
    try:
        live = subscriber.subscribe("tessera/nodes/+/telemetry")
        await live.ready()
        await publisher.publish("tessera/nodes/n1/telemetry", {"utilization": 0.25})
        event = await live.get(timeout=5)
        assert event.topic == "tessera/nodes/n1/telemetry"
        assert event.json() == {"utilization": 0.25} and not event.retained

        await publisher.publish("tessera/nodes/n1/presence", {"state": "online"}, retain=True)
        await wait_until(lambda: not publisher._outbox, what="the retained publish to be sent")
        late = subscriber.subscribe("tessera/nodes/+/presence")
        event = await late.get(timeout=5)
        assert event.retained and event.json() == {"state": "online"}
    finally:
        await publisher.close()
        await subscriber.close()


@pytest.mark.mqtt
async def test_mqtt_bus_survives_a_broker_restart(mosquitto_broker: MosquittoBroker) -> None:
    bus = await started_bus(mosquitto_broker.url)
    try:
        sub = bus.subscribe("tessera/nodes/+/presence")
        await sub.ready()
        await bus.publish("tessera/nodes/n1/presence", {"state": "online"}, retain=True)
        assert (await sub.get(timeout=5)).json() == {"state": "online"}

        mosquitto_broker.restart()  # persistence is off: the broker forgot everything
        await wait_until(lambda: bus.connections >= 2, timeout=15, what="a reconnect")
        await bus.wait_connected(10)
        # Subscriptions are renewed and our retained presence was published again.
        observer = await started_bus(mosquitto_broker.url)
        try:
            retained = observer.subscribe("tessera/nodes/+/presence")
            event = await retained.get(timeout=5)
            assert event.retained and event.json() == {"state": "online"}
        finally:
            await observer.close()
        await bus.publish("tessera/nodes/n2/presence", {"state": "online"})
        events = [await sub.get(timeout=5) for _ in range(2)]
        assert "tessera/nodes/n2/presence" in [e.topic for e in events]
    finally:
        await bus.close()


@pytest.mark.mqtt
async def test_mqtt_bus_waits_for_a_broker_that_is_down_at_start(tmp_path) -> None:
    broker = MosquittoBroker(tmp_path, require_mosquitto_binary())
    bus = MqttBus(broker.url, reconnect_max_s=0.3)
    await bus.start()  # nothing listens yet: must not raise
    bus.publish_nowait("tessera/test", "queued while away")
    try:
        broker.start()
        observer = await started_bus(broker.url)
        try:
            sub = observer.subscribe("tessera/test")
            await sub.ready()
            await bus.wait_connected(15)
            # The queued message may have gone out before the observer subscribed; send one
            # more and expect at least that.
            await bus.publish("tessera/test", "after connect")
            payloads = set()
            while b"after connect" not in payloads:
                payloads.add((await sub.get(timeout=5)).payload)
        finally:
            await observer.close()
    finally:
        await bus.close()
        broker.stop()


# -- presence: the coordinator reacting to what the broker says ---------------------------------

LAST_WILL_CLIENT = """
import json, sys, time
import paho.mqtt.client as mqtt
host, port, node_id = sys.argv[1], int(sys.argv[2]), sys.argv[3]
client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="agent-" + node_id)
topic = f"tessera/nodes/{node_id}/presence"
client.will_set(topic, json.dumps({"state": "offline", "node_id": node_id}), qos=1, retain=True)
client.connect(host, port, keepalive=30)
client.loop_start()
client.publish(topic, json.dumps({"state": "online", "node_id": node_id,
               "ts": int(time.time() * 1000)}), qos=1, retain=True).wait_for_publish()
print("connected", flush=True)
time.sleep(600)
"""


async def sync_point(bus: EventBus, watcher: PresenceWatcher) -> None:
    """Wait until the watcher has handled everything published before this call.

    A non-JSON payload is counted in `watcher.ignored`; events on one connection arrive in
    order, so once the marker is counted, everything before it was handled too.
    """
    before = watcher.ignored
    await bus.publish("tessera/nodes/sync-marker/presence", b"not json")
    await wait_until(lambda: watcher.ignored > before, timeout=10, what="the sync marker")


@pytest.mark.mqtt
async def test_last_will_marks_an_attached_node_offline(
    start_harness, mosquitto: str, tmp_path
) -> None:
    harness: Harness = await start_harness(mqtt_url=mosquitto)
    await harness.ctx.bus.wait_connected(10)
    await harness.coordinator.presence.ready()
    node = await harness.registered_node("mqtt-node", attach=True)

    broker = parse_mqtt_url(mosquitto)
    host, port = broker.host, broker.port
    agent = ManagedProcess(
        [sys.executable, "-c", LAST_WILL_CLIENT, host, str(port), node.node_id],
        tmp_path / "agent.log", name="mqtt agent",
    ).start()  # fmt: skip
    with agent:
        agent.wait_for_line("connected", timeout=15)
        # The agent's own "online" presence changes nothing.
        await sync_point(harness.ctx.bus, harness.coordinator.presence)
        assert harness.state(node.node_id) is NodeState.ONLINE

        agent.kill()  # no DISCONNECT: the broker publishes the last will
        await harness.wait_state(node.node_id, NodeState.OFFLINE, timeout=10)

    with pytest.raises(grpc.aio.AioRpcError) as info:
        await node.call.read()
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "last will" in info.value.details()
    harness.registry.flush()
    reasons = [c.reason for c in harness.registry.repo.events(node.node_id)]
    assert any("last will" in r for r in reasons)


@pytest.mark.mqtt
async def test_own_retained_presence_never_marks_a_node_offline(
    start_harness, mosquitto: str
) -> None:
    harness: Harness = await start_harness(mqtt_url=mosquitto)
    await harness.ctx.bus.wait_connected(10)
    await harness.coordinator.presence.ready()
    node = await harness.registered_node("flappy", attach=True)
    node.call.cancel()  # we publish a retained {"state": "offline"} for it
    await harness.wait_state(node.node_id, NodeState.OFFLINE)
    await node.attach()  # ...and it is back before our own echo comes round
    await sync_point(harness.ctx.bus, harness.coordinator.presence)
    assert harness.state(node.node_id) is NodeState.ONLINE

    # A raw client sees the coordinator's retained presence for the node.
    broker = parse_mqtt_url(mosquitto)
    async with aiomqtt.Client(broker.host, broker.port) as client:
        await client.subscribe(f"tessera/nodes/{node.node_id}/presence")
        message = await asyncio.wait_for(anext(aiter(client.messages)), 5)
        payload = json.loads(message.payload)
        assert payload["state"] == "online" and payload["source"] == "coordinator"


async def test_presence_rules_on_the_in_process_bus(harness: Harness) -> None:
    watcher = harness.coordinator.presence
    bus = harness.ctx.bus
    node = await harness.registered_node("n", attach=True)
    topic = f"tessera/nodes/{node.node_id}/presence"
    started_ms = int(time.time() * 1000)

    # Garbage, a will from before this attach, and a lie about another node change nothing.
    await bus.publish(topic, b"\xff\xfe not json")
    await bus.publish(topic, json.dumps([1, 2, 3]))
    await bus.publish(topic, {"state": "offline", "ts": started_ms - 60_000})
    await bus.publish(topic, {"state": "offline", "node_id": "n-someone-else"})
    await sync_point(bus, watcher)
    assert harness.state(node.node_id) is NodeState.ONLINE
    assert watcher.ignored >= 3

    # Telemetry a node publishes on the bus is folded into its view.
    await bus.publish(f"tessera/nodes/{node.node_id}/telemetry", {"queueLength": 4})

    def queue_length() -> int | None:
        telemetry = harness.registry.node(node.node_id).telemetry
        return None if telemetry is None else telemetry.queue_length

    await wait_until(lambda: queue_length() == 4, what="telemetry from the bus")

    await bus.publish(topic, {"state": "offline", "node_id": node.node_id})
    await harness.wait_state(node.node_id, NodeState.OFFLINE)


async def test_coordinator_serves_while_the_broker_is_down(start_harness) -> None:
    harness: Harness = await start_harness(mqtt_url=f"mqtt://127.0.0.1:{free_port()}")
    node = await harness.registered_node("no-broker", attach=True)
    assert (await node.heartbeat(1)).heartbeat_ack.seq == 1
    assert not harness.ctx.bus.connected
    node.call.cancel()
    await harness.wait_state(node.node_id, NodeState.OFFLINE)
