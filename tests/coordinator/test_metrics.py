"""`serve --metrics-listen`: Prometheus' text format over a real HTTP connection, the state
it reports, and what it does with requests that are not a scrape."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import pytest
from support.coordinator_cli import run_main
from support.coordinator_harness import harness_settings

from coordinator.metrics import MAX_HEAD_BYTES
from coordinator.server import running_coordinator

SAMPLE = re.compile(r"^([a-z_]+)(\{[^}]*\})? (\S+)$")


async def _exchange(address: str, request: bytes, read_timeout: float = 15.0) -> tuple[int, str]:
    host, port = address.rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(request)
        await writer.drain()
        answer = await asyncio.wait_for(reader.read(), read_timeout)
    finally:
        writer.close()
    if not answer:
        return 0, ""
    head, _, body = answer.decode().partition("\r\n\r\n")
    return int(head.split(" ")[1]), body


def _samples(text: str) -> dict[str, float]:
    samples = {}
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        match = SAMPLE.match(line)
        assert match, f"not a Prometheus sample line: {line!r}"
        samples[match.group(1) + (match.group(2) or "")] = float(match.group(3))
    return samples


async def test_a_scrape_reports_nodes_by_state(tmp_path: Path) -> None:
    settings = harness_settings(tmp_path, metrics_listen="127.0.0.1:0")
    async with running_coordinator(settings) as coordinator:
        address = coordinator.metrics_address
        assert re.fullmatch(r"127\.0\.0\.1:\d+", address)
        status, body = await _exchange(address, b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        assert status == 200
        samples = _samples(body)
        assert samples['tessera_nodes{state="online"}'] == 0
        assert set(samples) >= {f'tessera_nodes{{state="{s}"}}' for s in ("offline", "banned")}
        assert samples["process_resident_memory_bytes"] > 1e6
        assert "# TYPE tessera_nodes gauge" in body


async def test_requests_that_are_not_a_scrape_get_a_clear_status(tmp_path: Path) -> None:
    settings = harness_settings(tmp_path, metrics_listen="127.0.0.1:0")
    async with running_coordinator(settings) as coordinator:
        address = coordinator.metrics_address
        cases = {
            b"GET / HTTP/1.1\r\n\r\n": (404, "/metrics"),
            b"POST /metrics HTTP/1.1\r\n\r\n": (405, "GET /metrics"),
            b"\x16\x03\x01 not http at all\r\n\r\n": (400, "request line"),
            b"GET /metrics\r\n\r\n": (400, "request line"),
            b"GET /metrics HTTP/1.1\r\nX: " + b"y" * (MAX_HEAD_BYTES * 4): (431, "over"),
        }
        for request, (status, words) in cases.items():
            got, body = await _exchange(address, request)
            assert (got, words in body) == (status, True), (request[:40], got, body)
        # A request cut short: the connection ends; one never finished: closed after 5 s.
        assert await _exchange(address, b"GET /metr") in ((0, ""), (400, "incomplete request\n"))
        # Still answering.
        status, _ = await _exchange(address, b"GET /metrics?x=1 HTTP/1.0\r\n\r\n")
        assert status == 200


async def test_a_silent_connection_is_closed(tmp_path: Path) -> None:
    settings = harness_settings(tmp_path, metrics_listen="127.0.0.1:0")
    async with running_coordinator(settings) as coordinator:
        host, port = coordinator.metrics_address.rsplit(":", 1)
        reader, writer = await asyncio.open_connection(host, int(port))
        try:
            assert await asyncio.wait_for(reader.read(), 15) == b""  # closed, unanswered
        finally:
            writer.close()


def test_a_taken_port_is_a_clear_startup_error(tmp_path: Path, capsys) -> None:
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code, _, err = run_main(
            ["serve", "--data-dir", str(tmp_path), "--listen", "127.0.0.1:0",
             "--metrics-listen", f"127.0.0.1:{port}"],
            capsys,
        )  # fmt: skip
    assert code == 2 and "cannot serve metrics on" in err and "--metrics-listen" in err


@pytest.mark.parametrize("bad", ["nohost", "127.0.0.1:99999"])
def test_a_bad_metrics_address_is_refused(bad: str, capsys) -> None:
    code, _, err = run_main(["serve", "--db", "x.db", "--metrics-listen", bad], capsys)
    assert code == 2 and "HOST:PORT" in err
