"""The event plane on a broker that wants TLS and a login, as hosted brokers (HiveMQ Cloud,
EMQX Cloud) do: a real Mosquitto with a certificate from a private CA and a password file.

The coordinator's bus and a node agent's presence both reach it with
`mqtts://USER[:PASS]@HOST:PORT` and `$TESSERA_CA_CERT`; a wrong password or an untrusted
certificate keeps them out, and no log line carries the password.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from support.coordinator_cli import run_main
from support.mosquitto import MosquittoBroker, require_mosquitto_binary
from support.tls_files import TlsFiles, write_tls_files

from coordinator.events import MqttBus
from node_agent.backoff import Backoff
from node_agent.cli import build_parser as node_parser
from node_agent.mqtt_presence import MqttPresence
from protos.dialing import CA_ENV
from protos.mqtt_url import PASSWORD_ENV, parse_broker_url

pytestmark = pytest.mark.mqtt
USER, PASSWORD = "tessera", "hunter2-but-longer"
NODE = "ntls00000000000000000000"


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory) -> TlsFiles:
    return write_tls_files(tmp_path_factory.mktemp("broker-tls"))


@pytest.fixture
async def broker(tmp_path: Path, tls: TlsFiles) -> AsyncIterator[MosquittoBroker]:
    work = tmp_path / "broker"
    work.mkdir()
    secured = MosquittoBroker(
        work, require_mosquitto_binary(), tls=(tls.cert, tls.key), login=(USER, PASSWORD)
    )
    secured.start()
    try:
        yield secured
    finally:
        secured.stop()


async def _bus(url: str) -> MqttBus:
    bus = MqttBus(url, reconnect_min_s=0.05, reconnect_max_s=0.2)
    await bus.start()
    return bus


async def test_coordinator_and_node_reach_a_tls_broker_with_a_login(
    broker: MosquittoBroker, tls: TlsFiles, monkeypatch: pytest.MonkeyPatch, caplog
) -> None:
    monkeypatch.setenv(CA_ENV, str(tls.ca))
    assert broker.url.startswith("mqtts://")
    coordinator = await _bus(broker.url)
    # The node's password from the environment, as its systemd unit would give it.
    monkeypatch.setenv(PASSWORD_ENV, PASSWORD)
    node_url = f"mqtts://{USER}@127.0.0.1:{broker.port}"
    presence = MqttPresence(parse_broker_url(node_url), NODE, Backoff(0.05, 0.2))
    try:
        await coordinator.wait_connected(10)
        seen = coordinator.subscribe(f"tessera/nodes/{NODE}/presence")
        await seen.ready()
        presence.start()
        presence.set_state("online")
        event = await seen.get(timeout=10)
        assert event.json()["state"] == "online"
    finally:
        await presence.close()
        await coordinator.close()
    assert str(coordinator.broker) == f"mqtts://{USER}@127.0.0.1:{broker.port}"
    assert PASSWORD not in caplog.text


@pytest.mark.parametrize("wrong", ["password", "ca"])
async def test_a_wrong_password_or_an_untrusted_certificate_keeps_the_bus_out(
    broker: MosquittoBroker,
    tls: TlsFiles,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog,
    wrong: str,
) -> None:
    caplog.set_level(logging.WARNING, logger="coordinator.events")
    url = broker.url
    if wrong == "password":
        monkeypatch.setenv(CA_ENV, str(tls.ca))
        url = url.replace(PASSWORD, "not-" + PASSWORD)
    else:
        monkeypatch.setenv(CA_ENV, str(write_tls_files(tmp_path / "other", ca_name="Other").ca))
    bus = await _bus(url)
    try:
        for _ in range(50):
            if "unavailable" in caplog.text:
                break
            await asyncio.sleep(0.1)
        assert not bus.connected and bus.connections == 0
        said = caplog.text
        assert "unavailable" in said and PASSWORD not in said, said
        expected = "not authori" if wrong == "password" else "certificate verify failed"
        assert expected in said.lower(), said
    finally:
        await bus.close()


def test_a_ca_file_that_is_not_one_is_a_usage_error_at_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    """Both programs check $TESSERA_CA_CERT for an mqtts:// broker before they start, rather
    than failing every connection later."""
    monkeypatch.setenv(CA_ENV, str(tmp_path / "missing.pem"))
    serve = ["serve", "--data-dir", str(tmp_path), "--listen", "127.0.0.1:0"]
    code, _, err = run_main([*serve, "--mqtt", "mqtts://u@broker:8883"], capsys)
    assert code == 2 and CA_ENV in err and "not a readable PEM certificate" in err
    with pytest.raises(SystemExit) as exited:
        node_parser().parse_args(
            ["join", "--coordinator", "h:1", "--name", "n", "--mqtt", "mqtts://u@broker:8883"]
        )
    assert exited.value.code == 2
    assert "not a readable PEM certificate" in capsys.readouterr().err
    plain = ["join", "--coordinator", "h:1", "--name", "n", "--mqtt", "mqtt://broker:1883"]
    assert node_parser().parse_args(plain).mqtt == "mqtt://broker:1883"  # never reads it
