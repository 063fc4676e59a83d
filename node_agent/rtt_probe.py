"""Round trips to the peers this node may hand hidden states to, for the coordinator's router.

The coordinator sends a `ProbePeers` command listing them (the holders of neighbouring
layers); the prober pings each one's Stage.Ping every `interval_s` and keeps a moving
average per peer, which the agent's telemetry carries up the Attach stream as `rtt_ms`.
A peer that does not answer keeps its last average until it is dropped from the list:
a missing sample is not a round trip, and the coordinator already learns of dead nodes.

Pings are tiny and spread over the interval, so probing 16 peers every few seconds costs
nothing measurable next to a single decode step.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterable

import grpc

from protos.tessera.v1 import coordinator_pb2, node_pb2, stage_pb2, stage_pb2_grpc

log = logging.getLogger(__name__)

DEFAULT_INTERVAL_S = 2.0
PING_TIMEOUT_S = 2.0
ALPHA = 0.3  # weight of the newest ping in the average
MAX_PEERS = 32  # a hostile or buggy command cannot make the node dial the world


class RttProber:
    """A telemetry source: `sample()` returns the per-peer averages; `run()` measures them."""

    def __init__(
        self,
        channel_options: list[tuple[str, int]] | None = None,
        *,
        interval_s: float = DEFAULT_INTERVAL_S,
    ) -> None:
        self._options = channel_options or []
        self.interval_s = interval_s
        self._peers: dict[str, str] = {}  # node id -> stage address
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._rtt_ms: dict[str, float] = {}
        self._changed = asyncio.Event()

    def set_peers(self, peers: Iterable[coordinator_pb2.Peer]) -> None:
        """Replace the list (a ProbePeers command); peers no longer listed are forgotten."""
        wanted = {p.node_id: p.address for p in peers if p.node_id and p.address}
        if len(wanted) > MAX_PEERS:
            log.warning("asked to probe %d peers; probing the first %d", len(wanted), MAX_PEERS)
            wanted = dict(sorted(wanted.items())[:MAX_PEERS])
        for node_id in set(self._rtt_ms) - set(wanted):
            del self._rtt_ms[node_id]
        for node_id, address in list(self._peers.items()):
            if wanted.get(node_id) != address:
                self._close(address)
        self._peers = wanted
        log.info("probing round trips to %d peer(s)", len(wanted))
        self._changed.set()

    def sample(self) -> node_pb2.Telemetry:
        return node_pb2.Telemetry(rtt_ms={p: round(ms, 3) for p, ms in self._rtt_ms.items()})

    def rtt_ms(self, node_id: str) -> float | None:
        return self._rtt_ms.get(node_id)

    async def run(self) -> None:
        try:
            while True:
                await self.probe_once()
                self._changed.clear()
                # A new peer list is probed at once, not an interval later.
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self.interval_s):
                        await self._changed.wait()
        finally:
            await self.close()

    async def probe_once(self) -> None:
        peers = list(self._peers.items())
        if peers:
            await asyncio.gather(*(self._ping(node_id, address) for node_id, address in peers))

    async def close(self) -> None:
        for address in list(self._channels):
            self._close(address)

    async def _ping(self, node_id: str, address: str) -> None:
        channel = self._channels.get(address)
        fresh = channel is None
        if channel is None:
            channel = grpc.aio.insecure_channel(address, options=self._options)
            self._channels[address] = channel
        stub = stage_pb2_grpc.StageStub(channel)
        request = stage_pb2.PingRequest(payload=b"rtt")
        try:
            if fresh:  # the first call also connects: its time is not a round trip
                await stub.Ping(request, timeout=PING_TIMEOUT_S)
            started = time.monotonic()
            reply = await stub.Ping(request, timeout=PING_TIMEOUT_S)
        except grpc.aio.AioRpcError as err:
            log.debug("ping to peer %s at %s: %s", node_id, address, err.code().name)
            return
        ms = (time.monotonic() - started) * 1000.0
        if reply.node_id != node_id or self._peers.get(node_id) != address:
            return  # another node now listens there, or the list changed meanwhile
        previous = self._rtt_ms.get(node_id)
        self._rtt_ms[node_id] = ms if previous is None else previous + ALPHA * (ms - previous)

    def _close(self, address: str) -> None:
        channel = self._channels.pop(address, None)
        if channel is not None:
            # close() is a coroutine; the prober's loop owns it.
            asyncio.get_running_loop().create_task(channel.close())
