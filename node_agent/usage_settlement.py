"""Settling a paid session's acknowledged receipts with the coordinator, from the node.

The client settles its sessions itself (periodically and at the close), but a client that
crashes, is killed, or simply never closes would leave the node unpaid for everything
since its last settlement. Each receipt the client acknowledged (Stage.Acknowledge) is
counter-signed, which is all Ledger.SettleUsage asks for, so the node sends the newest
one per (session, layers) itself, a few seconds apart. Receipts are cumulative and each
is paid once: the client's and the node's settlements of the same work never pay twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
from collections import OrderedDict, deque
from collections.abc import Sequence

import grpc

from protos import dialing
from protos.tessera.v1 import ledger_pb2, ledger_pb2_grpc

log = logging.getLogger(__name__)

# How often; $TESSERA_SETTLE_EVERY_S overrides it (tests settle within a second).
SETTLE_EVERY_ENV = "TESSERA_SETTLE_EVERY_S"
DEFAULT_SETTLE_EVERY_S = 10.0
# Sessions whose receipts wait to be settled; past this the oldest are settled by their
# client alone (a bound on what a flood of tiny sessions can make the node hold).
MAX_PENDING_SESSIONS = 4096
SETTLE_TIMEOUT_S = 30.0
# The last round, as the node stops: a coordinator that is down must not hold the stop up.
CLOSING_TIMEOUT_S = 5.0
# A refusal that another try would meet again: the session closed or expired too long ago
# (the coordinator settles a closed one for 15 minutes), or the coordinator does not know it.
_FINAL = {
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.UNAUTHENTICATED,
}

_Layers = tuple[int, int]


def settle_every_s() -> float:
    """The interval from the environment, else the default (a bad value is logged)."""
    raw = os.environ.get(SETTLE_EVERY_ENV)
    if raw is None:
        return DEFAULT_SETTLE_EVERY_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 0 < value < math.inf:
        log.warning("%s=%r is not a positive number of seconds; settling every %.0f s",
                    SETTLE_EVERY_ENV, raw, DEFAULT_SETTLE_EVERY_S)  # fmt: skip
        return DEFAULT_SETTLE_EVERY_S
    return value


class UsageSettler:
    def __init__(
        self,
        coordinator_address: str,
        channel_options: Sequence[tuple[str, int]],
        every_s: float = DEFAULT_SETTLE_EVERY_S,
    ) -> None:
        self._address = coordinator_address
        self._options = list(channel_options)
        self.every_s = every_s
        # session -> layers -> (tokens, the counter-signed receipt), newest sessions last
        self._pending: OrderedDict[str, dict[_Layers, tuple[int, ledger_pb2.SignedUsage]]] = (
            OrderedDict()
        )
        self._channel: grpc.aio.Channel | None = None
        self._task: asyncio.Task[None] | None = None
        # What the coordinator answered lately, newest last (for logs and tests).
        self.settled: deque[ledger_pb2.Settlement] = deque(maxlen=256)

    def add(self, receipt: ledger_pb2.UsageReceipt, signed: ledger_pb2.SignedUsage) -> None:
        """Keep an acknowledged receipt to settle; an older one of the same layers is moot."""
        layers = (receipt.layer_start, receipt.layer_end)
        session = self._pending.setdefault(receipt.session_id, {})
        self._pending.move_to_end(receipt.session_id)
        kept = session.get(layers)
        if kept is None or receipt.tokens > kept[0]:
            session[layers] = (receipt.tokens, signed)
        while len(self._pending) > MAX_PENDING_SESSIONS:
            dropped, _ = self._pending.popitem(last=False)
            log.warning("too many sessions to settle; session %s is left to its client", dropped)
        self.start()

    def start(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(
                self._loop(), name="usage settlement"
            )

    async def _loop(self) -> None:
        while self._pending:
            await asyncio.sleep(self.every_s)
            await self.flush()

    async def flush(self) -> None:
        """Settle every waiting session once; a session that could not be reached is kept
        for the next round."""
        for session_id in list(self._pending):
            batch = self._pending.pop(session_id, {})
            if batch:
                await self._settle(session_id, batch)

    async def _settle(
        self, session_id: str, batch: dict[_Layers, tuple[int, ledger_pb2.SignedUsage]]
    ) -> None:
        if self._channel is None:
            self._channel = dialing.aio_channel(self._address, self._options)
        stub = ledger_pb2_grpc.LedgerStub(self._channel)
        request = ledger_pb2.SettleUsageRequest(
            session_id=session_id, usage=[signed for _, signed in batch.values()]
        )
        try:
            settlement = await stub.SettleUsage(request, timeout=SETTLE_TIMEOUT_S)
        except grpc.aio.AioRpcError as err:
            if err.code() in _FINAL:  # closed too long ago, or refused: nobody can now
                log.warning(
                    "session %s not settled by this node (%s): %s",
                    session_id, err.code().name, err.details(),
                )  # fmt: skip
                return
            log.warning(
                "could not settle session %s (%s: %s); trying again in %.0f s",
                session_id, err.code().name, err.details(), self.every_s,
            )  # fmt: skip
            for layers, kept in batch.items():  # unless a newer one came meanwhile
                self._keep(session_id, layers, kept)
            return
        self.settled.append(settlement)
        log.info(
            "settled session %s's acknowledged usage: %d credit units charged",
            session_id, settlement.charged,
        )  # fmt: skip

    def _keep(
        self, session_id: str, layers: _Layers, kept: tuple[int, ledger_pb2.SignedUsage]
    ) -> None:
        session = self._pending.setdefault(session_id, {})
        newer = session.get(layers)
        if newer is None or newer[0] < kept[0]:
            session[layers] = kept

    async def close(self) -> None:
        """Settle what waits, once, then stop."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        with contextlib.suppress(Exception):  # a coordinator that is gone: nothing to do
            await asyncio.wait_for(self.flush(), CLOSING_TIMEOUT_S)
        if self._channel is not None:
            await self._channel.close()
