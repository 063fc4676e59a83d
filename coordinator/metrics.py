"""Prometheus metrics over plain HTTP (`serve --metrics-listen HOST:PORT`, off by default).

`GET /metrics` answers in Prometheus' text format (0.0.4) what an operator alerts on: nodes
by state, each model's availability and its fewest ready replicas of any layer, training
jobs by state, the coordinator's resident memory. The page is made on the event loop, the
one thread that reads the coordinator's state, from a tiny HTTP/1.1 server on asyncio (no
web framework):
one request per connection, a request head of at most 8 KiB read within 5 s, anything
else answered 400, 404, 405 or 431 and closed. Keep the port off the internet (a
firewall, or a 127.0.0.1 listen address that a local Prometheus scrapes).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Iterable

from coordinator.addresses import split_host_port
from coordinator.context import CoordinatorContext
from coordinator.jobs.manager import STATES as JOB_STATES
from coordinator.node_state import NodeState
from protos.tessera.v1 import common_pb2

log = logging.getLogger(__name__)

MAX_HEAD_BYTES = 8192
READ_TIMEOUT_S = 5.0
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _family(name: str, kind: str, help_text: str, samples: Iterable[tuple[str, float]]) -> str:
    lines = [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
    lines += [f"{name}{labels} {value:g}" for labels, value in samples]
    return "\n".join(lines) + "\n"


async def render(ctx: CoordinatorContext) -> str:
    nodes = ctx.registry.nodes()
    families = [
        _family(
            "tessera_nodes",
            "gauge",
            "Registered nodes by state.",
            [
                (f'{{state="{state.value}"}}', sum(n.state is state for n in nodes))
                for state in NodeState
            ],
        )
    ]
    store = getattr(ctx, "model_store", None)
    if store is not None:
        models = (await store.list_models(common_pb2.Empty(), None)).models
        families.append(
            _family(
                "tessera_model_available",
                "gauge",
                "1 when every layer of the model has a ready replica, else 0.",
                [(f'{{model="{_label(m.name)}"}}', float(m.available)) for m in models],
            )
        )
        families.append(
            _family(
                "tessera_model_ready_replicas_min",
                "gauge",
                "The fewest ready replicas of any layer of the model.",
                [
                    (f'{{model="{_label(m.name)}"}}', min(m.ready_replicas, default=0))
                    for m in models
                ],
            )
        )
    jobs = getattr(ctx, "jobs", None)
    if jobs is not None:
        counts = jobs.repo.state_counts()
        families.append(
            _family(
                "tessera_jobs",
                "gauge",
                "Training jobs by state (kept until --job-retention after they end).",
                [(f'{{state="{state}"}}', counts.get(state, 0)) for state in JOB_STATES],
            )
        )
    rss = _resident_bytes()
    if rss is not None:
        families.append(
            _family(
                "process_resident_memory_bytes",
                "gauge",
                "Resident memory of the coordinator process.",
                [("", rss)],
            )
        )
    return "".join(families)


def _resident_bytes() -> int | None:
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None  # not Linux


class MetricsEndpoint:
    def __init__(self, ctx: CoordinatorContext, listen: str) -> None:
        self.ctx = ctx
        self.listen = listen
        self.address = ""
        self._server: asyncio.Server | None = None

    async def start(self) -> str:
        host, port = split_host_port(self.listen)
        self._server = await asyncio.start_server(
            self._serve, host.strip("[]"), port, limit=MAX_HEAD_BYTES
        )
        bound = self._server.sockets[0].getsockname()[1]
        self.address = f"{host}:{bound}"
        log.info("metrics on http://%s/metrics", self.address)
        return self.address

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await self._server.wait_closed()
            self._server = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            status, body = await self._answer(reader)
            content_type = CONTENT_TYPE if status == "200 OK" else "text/plain; charset=utf-8"
            data = body.encode()
            writer.write(
                f"HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\n"
                f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n".encode()
                + data
            )
            await writer.drain()
        except (ConnectionError, TimeoutError):
            pass  # the scraper went away, or never finished its request
        except Exception:
            log.exception("metrics: answering a request failed")
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def _answer(self, reader: asyncio.StreamReader) -> tuple[str, str]:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), READ_TIMEOUT_S)
        except asyncio.LimitOverrunError:
            return (
                "431 Request Header Fields Too Large",
                f"request head over {MAX_HEAD_BYTES} bytes\n",
            )
        except asyncio.IncompleteReadError:
            return "400 Bad Request", "incomplete request\n"
        parts = head.split(b"\r\n", 1)[0].decode("latin-1").split(" ")
        if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
            return "400 Bad Request", "expected a request line like: GET /metrics HTTP/1.1\n"
        method, path = parts[0], parts[1].split("?", 1)[0]
        if path != "/metrics":
            return "404 Not Found", "the metrics are at /metrics\n"
        if method != "GET":
            return "405 Method Not Allowed", "GET /metrics\n"
        return "200 OK", await render(self.ctx)
