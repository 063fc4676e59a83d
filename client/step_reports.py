"""Reports the driver's own timings of stage calls to the coordinator (ReportStepTimes).

They are the coordinator's measured speed of each node: a node's self-reported benchmark
is only a prior until real traffic has been timed on the client's clock, so a node cannot
make itself look faster than it is. Reports are batched (every `every` calls and at close),
sent in the background so a decode step never waits on the coordinator, and best effort: a
report that fails is dropped, never retried into a growing backlog. A node the driver could
not connect to goes out at once: the coordinator dials it back, and places no shards on a
node that clients cannot reach.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import grpc

from protos.tessera.v1 import client_api_pb2, common_pb2

log = logging.getLogger(__name__)

MAX_BATCH = 256  # the coordinator's limit per report (coordinator/sessions.py)
# The coordinator's limit per entry (MAX_STEP_WALL_MS there): one entry out of range
# refuses the whole report, so a longer lower bound goes out as this.
MAX_WALL_MS = 600_000.0

SendReport = Callable[[client_api_pb2.StepTimesReport], Awaitable[client_api_pb2.StepTimesAck]]


class StepReporter:
    def __init__(
        self,
        session_id: str,
        capability: Callable[[], client_api_pb2.SignedCapability],
        send: SendReport,
        *,
        every: int = 16,
    ) -> None:
        self._session_id = session_id
        self._capability = capability  # the latest one: a reroute replaces it
        self._send = send
        self.every = max(1, min(every, MAX_BATCH))
        self._pending: list[client_api_pb2.StepTime] = []
        self._unreachable: set[str] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self.sent = 0  # entries the coordinator accepted

    def add(self, node_id: str, start: int, end: int, tokens: int, wall_ms: float) -> None:
        if not wall_ms > 0:  # an unmeasurably short call (or NaN) says nothing
            return
        wall_ms = min(wall_ms, MAX_WALL_MS)
        self._pending.append(
            client_api_pb2.StepTime(
                node_id=node_id,
                layers=common_pb2.LayerRange(start=start, end=end),
                tokens=tokens,
                wall_ms=wall_ms,
            )
        )
        if len(self._pending) >= self.every:
            self._flush_soon()

    def unreachable(self, node_id: str) -> None:
        """The driver could not connect to this node: the coordinator hears of it at once
        (it dials the node back itself before it acts on it)."""
        self._unreachable.add(node_id)
        self._flush_soon()

    def _flush_soon(self) -> None:
        task = asyncio.get_running_loop().create_task(self._flush())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        """Send what is left and wait for the reports in flight."""
        await self._flush()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _flush(self) -> None:
        batch, self._pending = self._pending[:MAX_BATCH], self._pending[MAX_BATCH:]
        unreachable, self._unreachable = sorted(self._unreachable), set()
        if not batch and not unreachable:
            return
        report = client_api_pb2.StepTimesReport(
            session_id=self._session_id,
            capability=self._capability(),
            steps=batch,
            unreachable_node_ids=unreachable,
        )
        try:
            ack = await self._send(report)
        except grpc.aio.AioRpcError as err:
            # UNIMPLEMENTED: an older coordinator. Others: it will learn from the next one.
            log.info("step times not reported (%s: %s)", err.code().name, err.details())
            return
        self.sent += ack.accepted
