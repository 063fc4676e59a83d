"""Acknowledging the nodes' usage receipts as a paid session goes (Stage.Acknowledge).

In a paid session each node computes at most the session's credit (token positions x
batch, ``CapabilityClaims.usage_credit``) on a layer range past the newest receipt the
client counter-signed and handed back to it; the node settles those receipts with the
coordinator itself. So a client that withholds its receipts gets little work unpaid, and
a node is paid even if its client dies before it settles.

Acknowledgments stay off the token's path: once a quarter of the credit is owed on a
(node, layers) the newest receipt goes back in a task of its own, and the node answers
in a round trip while the pipeline runs. Only when half of it is owed before a call (a
big prefill chunk, a replay, a checker's catch-up: many positions in one call) does the
call wait for the acknowledgment first, so that no node ever reaches its credit and
refuses an honest client. When the session ends every node is handed its newest receipt,
so its own settlement covers the whole session even if the client's close is lost.

A paid training job is held to its receipts the same way, in samples run forward
(TrainingStage.Acknowledge, with the job id for the session): client/training_driver.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Protocol

import grpc
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from client.billing import UsageBook
from client.channels import ChannelPool
from protos.tessera.v1 import client_api_pb2, stage_pb2, stage_pb2_grpc, training_pb2_grpc

log = logging.getLogger(__name__)

ACKNOWLEDGE_TIMEOUT_S = 10.0
# A session that makes no call for this long (its caller paused) acknowledges what it owes:
# a node counts a client's idle sessions' unacknowledged work against its other sessions
# after 30 s (node_agent/receipts.py, RESIDUE_IDLE_S).
IDLE_ACK_S = 5.0
# How long a call, and the end of a session, wait for acknowledgments: a healthy node takes
# one in a round trip, and a hung one must not hold the pipeline up longer than its own
# deadlines would (the call then goes, and a refusal fails over like any other).
WAIT_S = 2.0

_Key = tuple[str, int, int]  # node id, layer start, layer end


class Reachable(Protocol):
    """A node of the pipeline: a session's HopRecord or a job's TrainingHop."""

    @property
    def node_id(self) -> str: ...
    @property
    def address(self) -> str: ...


# The Acknowledge of the node's service: Stage for sessions, TrainingStage for jobs.
AcknowledgeRpc = Callable[..., Awaitable[stage_pb2.AcknowledgeResponse]]


def stage_rpc(channel: grpc.aio.Channel) -> AcknowledgeRpc:
    return stage_pb2_grpc.StageStub(channel).Acknowledge


def training_rpc(channel: grpc.aio.Channel) -> AcknowledgeRpc:
    return training_pb2_grpc.TrainingStageStub(channel).Acknowledge


class Acknowledger:
    def __init__(
        self,
        session_id: str,
        credit: int,
        key: Ed25519PrivateKey,
        book: UsageBook,
        channels: ChannelPool,
        capability: Callable[[], client_api_pb2.SignedCapability],
        rpc: Callable[[grpc.aio.Channel], AcknowledgeRpc] = stage_rpc,
    ) -> None:
        """``session_id``: the session's, or a training job's id (its receipts name it)."""
        self.session_id = session_id
        self.credit = credit
        self._key = key
        self._book = book
        self._channels = channels
        self._capability = capability  # the session's newest (reroutes renew it)
        self._rpc = rpc
        self._running: dict[_Key, asyncio.Task[bool]] = {}
        self._idle: dict[_Key, asyncio.TimerHandle] = {}  # acknowledges a paused session
        self._hops: dict[_Key, Reachable] = {}  # where each (node, layers) is reached
        self.sent = 0  # acknowledgments the nodes took
        self.failed = 0  # and those that failed (the node may then refuse a call)

    def noted(self, hop: Reachable, start: int, end: int) -> None:
        """A receipt of this node came in: acknowledge it if a quarter of the credit is owed,
        else once no other comes for IDLE_ACK_S."""
        where = (hop.node_id, start, end)
        self._hops[where] = hop
        timer = self._idle.pop(where, None)
        if timer is not None:
            timer.cancel()
        if self._book.owed(hop.node_id, start, end) >= max(1, self.credit // 4):
            self._start(hop, start, end)
        else:
            self._idle[where] = asyncio.get_running_loop().call_later(
                IDLE_ACK_S, self._acknowledge_idle, where
            )

    def _acknowledge_idle(self, where: _Key) -> None:
        self._idle.pop(where, None)
        if self._book.owed(*where) > 0:
            self._start(self._hops[where], where[1], where[2])

    async def ready(self, hops: Iterable[tuple[Reachable, int, int]]) -> None:
        """Before calls to these (node, layers): wait for the acknowledgment of any of them
        that owes half its credit or more."""
        waits = [
            self._start(hop, start, end)
            for hop, start, end in hops
            if self._book.owed(hop.node_id, start, end) >= max(1, self.credit // 2)
        ]
        if waits:
            # Never an error: a node that took no acknowledgment refuses the call, and the
            # driver then acknowledges again (settle_up) or fails it over.
            await asyncio.wait(waits, timeout=WAIT_S)

    async def settle_up(self, hop: Reachable, start: int, end: int) -> bool:
        """After the node refused a call for want of an acknowledgment (one lost on the
        way, or not there yet): hand it the newest receipt now. Whether it took it, so
        that the call may go to it again instead of failing over."""
        task = self._running.get((hop.node_id, start, end))
        if task is not None and not task.done():
            await asyncio.wait([task], timeout=WAIT_S)  # it may carry an older receipt
        task = self._start(hop, start, end)
        await asyncio.wait([task], timeout=WAIT_S)
        return task.done() and not task.cancelled() and task.result()

    def _start(self, hop: Reachable, start: int, end: int) -> asyncio.Task[bool]:
        where = (hop.node_id, start, end)
        self._hops[where] = hop
        task = self._running.get(where)
        if task is None or task.done():
            task = self._running[where] = asyncio.get_running_loop().create_task(
                self._acknowledge(hop, start, end), name=f"acknowledge {hop.node_id}"
            )
        return task

    async def _acknowledge(self, hop: Reachable, start: int, end: int) -> bool:
        """Whether the node took its newest receipt."""
        signed = self._book.countersign_one(self.session_id, hop.node_id, start, end, self._key)
        if signed is None:
            return False  # the client disagrees with the node's count: it is not paid for it
        usage, tokens = signed
        request = stage_pb2.AcknowledgeRequest(
            session_id=self.session_id, capability=self._capability(), usage=[usage]
        )
        acknowledge = self._rpc(self._channels.get(hop.address))
        began = time.monotonic()
        try:
            await acknowledge(request, timeout=ACKNOWLEDGE_TIMEOUT_S)
        except grpc.aio.AioRpcError as err:
            self.failed += 1
            log.warning(
                "node %s did not take the acknowledgment of its receipt on layers [%d, %d) "
                "(%s: %s); it may refuse this session's next call there",
                hop.node_id, start, end, err.code().name, err.details(),
            )  # fmt: skip
            return False
        self.sent += 1
        self._book.acknowledged(hop.node_id, start, end, tokens)
        log.debug(
            "acknowledged %d tokens of node %s on layers [%d, %d) in %.1f ms",
            tokens, hop.node_id, start, end, (time.monotonic() - began) * 1000,
        )  # fmt: skip
        return True

    async def close(self) -> None:
        """Hand every node the newest receipt it is owed for, and wait for those a little:
        a node is then paid for the whole session by its own settlement, even if the
        client's close never reaches the coordinator."""
        for timer in self._idle.values():
            timer.cancel()
        self._idle.clear()
        running = [t for t in self._running.values() if not t.done()]
        if running:  # these may hand over older receipts: then the newest, below
            await asyncio.wait(running, timeout=WAIT_S)
        for node_id, start, end in list(self._hops):
            if self._book.owed(node_id, start, end) > 0:
                self._start(self._hops[(node_id, start, end)], start, end)
        running = [t for t in self._running.values() if not t.done()]
        if running:
            await asyncio.wait(running, timeout=WAIT_S)
        for task in running:
            task.cancel()
        for task in running:
            with contextlib.suppress(asyncio.CancelledError):
                await task
