"""The client's end of the push pipeline: one ``Stage.Deliveries`` subscription per node.

In a pushed step the client sends token ids to the first stage only, with the rest of the
route in ``relay_to``; each node hands its output straight to the next one, and every node
after the first answers on the subscription the client holds there. A node's answer
therefore reaches the client in one transit, while the hidden states travel on between
nodes without waiting for the client.

A subscription is only useful once the node has registered it, so each one waits for the
node's response headers, which it sends once the subscription is in place, before a step
relies on it. An answer nobody waits for yet is kept, the newest ``EARLY_ANSWERS`` of
them: a ring (client/driver.py) starts a step before the client asks for it, so its
answers may come first.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

import grpc

from client.channels import ChannelPool
from protos.tessera.v1 import client_api_pb2, stage_pb2, stage_pb2_grpc

log = logging.getLogger(__name__)

Key = tuple[int, int, int]  # (step, layer start, layer end)
# A relayed call's signed answer and when it arrived (time.monotonic()).
Answer = tuple[stage_pb2.ForwardResponse, float]
# Answers kept per subscription before anyone waits for them: a ring runs ahead of the
# client by a step or two; a stale answer (of a step done another way) ages out.
EARLY_ANSWERS = 32
# Told of each answer that came and that nobody took (node id, (step, start, end)): work
# the node did, which its usage receipt counts (client/driver.py counts a ring's).
Unclaimed = Callable[[str, Key], None]


class DeliveryLost(Exception):
    """A relayed call's answer will not come on this subscription."""

    def __init__(self, reason: str, code: grpc.StatusCode | None = None, node_id: str = "") -> None:
        super().__init__(reason)
        self.code = code
        self.node_id = node_id


class Subscription:
    """The answers one node sends for this session's relayed calls."""

    def __init__(
        self,
        node_id: str,
        address: str,
        channels: ChannelPool,
        session_id: str,
        capability: client_api_pb2.SignedCapability,
        on_unclaimed: Unclaimed | None = None,
    ) -> None:
        self.node_id = node_id
        self._on_unclaimed = on_unclaimed
        self.address = address
        stub = stage_pb2_grpc.StageStub(channels.get(address))
        self._call = stub.Deliveries(
            stage_pb2.DeliveriesRequest(session_id=session_id, capability=capability)
        )
        self._waiting: dict[Key, asyncio.Future[Answer]] = {}
        # Deliveries that came before anyone waited for them, oldest first.
        self._early: dict[Key, Answer | DeliveryLost] = {}
        # Done when the node's headers came: the subscription is in place.
        self._ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._ended: DeliveryLost | None = None
        self._reader = asyncio.ensure_future(self._read())

    @property
    def usable(self) -> bool:
        return self._ended is None

    async def ready(self, timeout_s: float) -> None:
        """Wait for the node's acknowledgement; raises DeliveryLost without one."""
        if self._ready.done():
            self._ready.result()  # raises the reason it ended before the acknowledgement
            return
        try:
            async with asyncio.timeout(timeout_s):
                await asyncio.shield(self._ready)
        except TimeoutError:
            reason = (
                f"node {self.node_id} did not acknowledge the subscription within {timeout_s:.1f} s"
            )
            raise DeliveryLost(reason, node_id=self.node_id) from None

    def expect(self, step: int, start: int, end: int) -> asyncio.Future[Answer]:
        """A future for the answer of the relayed call (step, layers); register it before
        the call can arrive."""
        future: asyncio.Future[Answer] = asyncio.get_running_loop().create_future()
        key = (step, start, end)
        early = self._early.pop(key, None)
        if early is not None:
            _settle(future, early)
        elif self._ended is not None:
            future.set_exception(self._ended)
        else:
            self._waiting[key] = future
        return future

    def forget(self, step: int, start: int, end: int) -> None:
        """Stop waiting for an answer (the step went on without it)."""
        self._unclaim((step, start, end))
        future = self._waiting.pop((step, start, end), None)
        if future is not None and not future.done():
            future.cancel()

    def release_early(self) -> None:
        """Nobody will take the answers kept so far: report them as unclaimed now."""
        for key in list(self._early):
            self._unclaim(key)

    def close(self) -> None:
        self.release_early()
        self._call.cancel()
        self._reader.cancel()
        self._end(DeliveryLost(f"the subscription at node {self.node_id} was closed",
                               node_id=self.node_id))  # fmt: skip

    async def _read(self) -> None:
        try:
            await self._call.initial_metadata()
            if self._call.done():  # refused: headers and status came together
                code = await self._call.code()
                details = await self._call.details()
                self._end(DeliveryLost(f"subscription at node {self.node_id}: {code.name}: "
                                       f"{details}", code, self.node_id))  # fmt: skip
                return
            if not self._ready.done():
                self._ready.set_result(None)
            async for delivery in self._call:
                self._on(delivery)
            self._end(DeliveryLost(f"node {self.node_id} ended the subscription",
                                   node_id=self.node_id))  # fmt: skip
        except asyncio.CancelledError:
            raise
        except grpc.aio.AioRpcError as err:
            self._end(
                DeliveryLost(
                    f"subscription at node {self.node_id}: {err.code().name}: {err.details()}",
                    err.code(),
                    self.node_id,
                )  # fmt: skip
            )
        except Exception as err:  # a broken stream surfaces in several shapes
            self._end(DeliveryLost(f"subscription at node {self.node_id} broke: {err}",
                                   node_id=self.node_id))  # fmt: skip

    def _on(self, delivery: stage_pb2.Delivery) -> None:
        key = (delivery.step, delivery.layers.start, delivery.layers.end)
        outcome: Answer | DeliveryLost
        if delivery.HasField("response"):
            outcome = (delivery.response, time.monotonic())
        else:
            code = _status(delivery.error_code)
            outcome = DeliveryLost(
                f"{code.name if code else delivery.error_code}: {delivery.error_message}",
                code,
                self.node_id,
            )  # fmt: skip
        future = self._waiting.pop(key, None)
        if future is not None and not future.done():
            _settle(future, outcome)
            return
        log.debug("node %s delivered step %d before anyone waited", self.node_id, delivery.step)
        self._unclaim(key)  # a second answer to one call: the first one was not taken
        self._early[key] = outcome
        while len(self._early) > EARLY_ANSWERS:
            self._unclaim(next(iter(self._early)))

    def _unclaim(self, key: Key) -> None:
        outcome = self._early.pop(key, None)
        if outcome is not None and not isinstance(outcome, DeliveryLost) and self._on_unclaimed:
            self._on_unclaimed(self.node_id, key)

    def _end(self, reason: DeliveryLost) -> None:
        if self._ended is None:
            self._ended = reason
            log.info("%s", reason)
        if not self._ready.done():
            self._ready.set_exception(reason)
            self._ready.exception()  # retrieved: ``ready`` re-raises it to whoever asks
        waiting, self._waiting = self._waiting, {}
        for future in waiting.values():
            if not future.done():
                future.set_exception(reason)
                future.exception()


class Subscriptions:
    """One subscription per node of the session, opened when a pushed step first needs it."""

    def __init__(
        self, channels: ChannelPool, session_id: str, on_unclaimed: Unclaimed | None = None
    ) -> None:
        self._channels = channels
        self._session_id = session_id
        self._on_unclaimed = on_unclaimed
        self._by_node: dict[str, Subscription] = {}

    async def at(
        self,
        node_id: str,
        address: str,
        capability: client_api_pb2.SignedCapability,
        timeout_s: float,
    ) -> Subscription:
        """The node's live subscription, opened (and acknowledged) if need be."""
        sub = self._by_node.get(node_id)
        if sub is None or not sub.usable or sub.address != address:
            if sub is not None:
                sub.close()
            sub = self._by_node[node_id] = Subscription(
                node_id, address, self._channels, self._session_id, capability,
                self._on_unclaimed,
            )  # fmt: skip
        await sub.ready(timeout_s)
        return sub

    def release_early(self) -> None:
        for sub in self._by_node.values():
            sub.release_early()

    def close(self) -> None:
        subs, self._by_node = list(self._by_node.values()), {}
        for sub in subs:
            sub.close()


def _settle(future: asyncio.Future[Answer], outcome: Answer | DeliveryLost) -> None:
    if isinstance(outcome, DeliveryLost):
        future.set_exception(outcome)
    else:
        future.set_result(outcome)


def _status(value: int) -> grpc.StatusCode | None:
    with contextlib.suppress(StopIteration):
        return next(c for c in grpc.StatusCode if c.value[0] == value)
    return None
