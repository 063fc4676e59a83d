"""The ledger as a coordinator component: billing for sessions (`.billing`), the Ledger RPCs, the
background sweep that releases earnings past their challenge window and refunds holds of
sessions nobody closed, and the verifier's entry points.

`build(ctx)` is listed in coordinator/server.py COMPONENTS before sessions, so the session
manager finds `ctx.ledger` and bills through it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from typing import Any

import grpc

from coordinator.context import CoordinatorContext
from coordinator.ledger.amounts import INT64_MAX, LedgerError
from coordinator.ledger.audit import audit
from coordinator.ledger.billing import Billing, check_fresh
from coordinator.ledger.book import Ledger, NodeQuote, operator_account, stake_account
from protos import identity
from protos.tessera.v1 import common_pb2, ledger_pb2

log = logging.getLogger("tessera.ledger")

CLIENT_ACCOUNT_RE = re.compile(r"^c[0-9a-f]{23}$")
# Stake txids are "<node id>:<request id>": this keeps them within the ledger's names.
MAX_STAKE_REQUEST_ID = 64


class LedgerComponent:
    def __init__(self, ctx: CoordinatorContext) -> None:
        settings = ctx.settings
        self._ctx = ctx
        self.ledger = Ledger(
            ctx.db,
            challenge_window_ms=int(settings.challenge_window_s * 1000),
            fee_bps=settings.fee_bps,
        )
        self.billing = Billing(self.ledger, self.price_of)
        self._sweep_s = settings.ledger_sweep_s
        self._task: asyncio.Task[None] | None = None

    # ---- lifecycle: the sweep -------------------------------------------------------------

    async def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._sweep_loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def sweep(self) -> None:
        released = self.ledger.release_due()
        expired = self.ledger.expire_holds()
        if released or expired:
            log.info(
                "ledger sweep: released %d earnings, refunded %d expired holds", released,
                len(expired),
            )  # fmt: skip

    async def _sweep_loop(self) -> None:
        while True:
            try:
                self.sweep()
            except Exception:  # the sweep must survive one bad row; audit will name it
                log.exception("ledger sweep failed")
            await asyncio.sleep(self._sweep_s)

    # ---- prices -----------------------------------------------------------------------------

    def price_of(self, node_id: str) -> NodeQuote:
        view = self._ctx.registry.node(node_id)
        default = self._ctx.settings.default_price_units
        if view is None:
            return NodeQuote(default, node_id)
        asked = view.capabilities.price_per_1k_token_layers_units
        return NodeQuote(min(asked, INT64_MAX) if asked else default, view.account or node_id)

    def training_price_of(self, node_id: str) -> NodeQuote:
        """A node's training price per sample-layer, as the ledger's per-1,000 unit (so a
        receipt's samples bill like tokens). A node that asks 0 gets the coordinator's
        --default-training-price (0 by default: free)."""
        view = self._ctx.registry.node(node_id)
        default = self._ctx.settings.default_training_price_units
        asked = view.capabilities.price_per_sample_layer_units if view is not None else 0
        per_sample_layer = min(asked or default, INT64_MAX // 1000)
        return NodeQuote(per_sample_layer * 1000, view.account or node_id if view else node_id)

    # ---- the verifier's outcomes (the verifier calls these; see docs/ledger.md) -------------

    def on_work_rejected(self, node_id: str, session_id: str, reason: str) -> int:
        refunded = self.ledger.work_rejected(node_id, session_id, reason)
        log.warning(
            "work of %s in %s rejected (%s): %d refunded", node_id, session_id, reason, refunded
        )
        return refunded

    def on_fraud_proven(self, node_id: str, account: str, evidence_id: str) -> int:
        slashed = self.ledger.fraud_proven(node_id, account or node_id, evidence_id)
        log.warning("fraud proven against %s (%s): %d slashed", node_id, evidence_id, slashed)
        return slashed

    # ---- Ledger RPCs (services.LedgerService delegates here) --------------------------------

    async def grant_credits(
        self, request: ledger_pb2.GrantCreditsRequest, context: grpc.aio.ServicerContext
    ) -> ledger_pb2.AccountBalance:
        if not CLIENT_ACCOUNT_RE.match(request.account):
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{request.account[:64]!r} is not a client account id (c + 23 hex digits); "
                "`tessera balance` on the client's machine prints it",
            )
        if not request.request_id:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                "give a request_id, so a retried grant mints only once",
            )
        await _answer(context, self.ledger.grant, request.account, request.amount,
                      request.request_id)  # fmt: skip
        log.info("granted %d credit units to %s", request.amount, request.account)
        return self._balance(request.account)

    async def get_balance(
        self, request: ledger_pb2.SignedQuery, context: grpc.aio.ServicerContext
    ) -> ledger_pb2.AccountBalance:
        await _answer(context, _check_query, request, "balance")
        return self._balance(identity.client_account(request.public_key))

    async def get_earnings(
        self, request: ledger_pb2.SignedQuery, context: grpc.aio.ServicerContext
    ) -> ledger_pb2.Earnings:
        await _answer(context, _check_query, request, "earnings")
        return self._earnings(identity.node_id(request.public_key))

    async def deposit_stake(
        self, request: ledger_pb2.StakeRequest, context: grpc.aio.ServicerContext
    ) -> ledger_pb2.Earnings:
        if not 0 < len(request.request_id) <= MAX_STAKE_REQUEST_ID:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"give a request_id of 1 to {MAX_STAKE_REQUEST_ID} characters, so a retried "
                "deposit stakes only once",
            )
        purpose = stake_purpose(request.amount, request.request_id)
        await _answer(context, _check_query, request.query, purpose)
        node_id = identity.node_id(request.query.public_key)
        operator = self._operator(node_id)
        await _answer(context, self.ledger.deposit_stake, operator, request.amount,
                      f"{node_id}:{request.request_id}")  # fmt: skip
        log.info("operator %s (node %s) staked %d", operator, node_id, request.amount)
        return self._earnings(node_id)

    async def settle_usage(
        self, request: ledger_pb2.SettleUsageRequest, context: grpc.aio.ServicerContext
    ) -> ledger_pb2.Settlement:
        return await _answer(context, self.billing.settle_usage, request.session_id,
                             request.usage)  # fmt: skip

    def _operator(self, node_id: str) -> str:
        view = self._ctx.registry.node(node_id)
        return (view.account or node_id) if view else node_id

    def _earnings(self, node_id: str) -> ledger_pb2.Earnings:
        operator = self._operator(node_id)
        summary = self.ledger.earnings(node_id)
        return ledger_pb2.Earnings(
            node_id=node_id,
            account=operator,
            pending=summary.pending,
            released=summary.released,
            slashed=summary.slashed,
            rejected=summary.rejected,
            next_release_unix_ms=summary.next_release_ms,
            staked=self.ledger.balance(stake_account(operator)),
            available=self.ledger.balance(operator_account(operator)),
        )

    async def audit(
        self, request: common_pb2.Empty, context: grpc.aio.ServicerContext
    ) -> ledger_pb2.AuditReport:
        return audit_report(self._ctx.db)

    def _balance(self, account: str) -> ledger_pb2.AccountBalance:
        summary = self.ledger.client_balance(account)
        return ledger_pb2.AccountBalance(
            account=account, available=summary.available, escrowed=summary.escrowed
        )


def audit_report(db: Any) -> ledger_pb2.AuditReport:
    result = audit(db)
    return ledger_pb2.AuditReport(
        ok=result.ok,
        violations=result.violations,
        transactions=result.transactions,
        minted=result.minted,
        escrowed=result.escrowed,
        open_holds=result.open_holds,
    )


def stake_purpose(amount: int, request_id: str) -> str:
    """What a stake deposit's SignedQuery is signed for: the amount and the request id, so
    a captured signature cannot stake another amount."""
    return f"stake {amount} {request_id}"


def _check_query(query: ledger_pb2.SignedQuery, purpose: str) -> None:
    if len(query.public_key) != identity.PUBLIC_KEY_BYTES:
        raise LedgerError(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"public_key must be a raw {identity.PUBLIC_KEY_BYTES}-byte Ed25519 key",
        )
    check_fresh(query.unix_ms)
    payload = identity.ledger_query_payload(purpose, query.public_key, query.unix_ms)
    if not identity.verify(query.public_key, query.signature, payload):
        raise LedgerError(
            grpc.StatusCode.UNAUTHENTICATED, f"the {purpose} query is not signed by its key"
        )


async def _answer(context: grpc.aio.ServicerContext, method: Any, *args: Any) -> Any:
    try:
        return method(*args)
    except LedgerError as exc:
        await context.abort(exc.code, exc.message, trailing_metadata=exc.trailing_metadata)


def build(ctx: CoordinatorContext) -> LedgerComponent:
    return LedgerComponent(ctx)
