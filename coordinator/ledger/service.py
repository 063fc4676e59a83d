"""The ledger as a coordinator component: billing for sessions, the Ledger RPCs, the
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
import time
from collections.abc import Sequence
from typing import Any

import grpc

from coordinator.context import CoordinatorContext
from coordinator.ledger.amounts import INT64_MAX, LedgerError
from coordinator.ledger.audit import audit
from coordinator.ledger.book import Ledger, NodeQuote
from coordinator.ledger.pricing import plan_route
from coordinator.ledger.receipts import verify_usage
from coordinator.router import Holder, Stage
from protos import identity
from protos.tessera.v1 import client_api_pb2, common_pb2, ledger_pb2

log = logging.getLogger("tessera.ledger")

CLIENT_ACCOUNT_RE = re.compile(r"^c[0-9a-f]{23}$")
# A signed query or open request older (or newer) than this is refused: a captured one
# cannot be replayed later.
FRESHNESS_MS = 300_000
# A hold outlives its session's capability by this much, for a close that is under way.
HOLD_GRACE_MS = 600_000


class LedgerComponent:
    def __init__(self, ctx: CoordinatorContext) -> None:
        settings = ctx.settings
        self._ctx = ctx
        self.ledger = Ledger(
            ctx.db,
            challenge_window_ms=int(settings.challenge_window_s * 1000),
            fee_bps=settings.fee_bps,
        )
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

    # ---- sessions ---------------------------------------------------------------------------

    def plan(
        self,
        boundaries: Sequence[int],
        holders: Sequence[Holder],
        request: client_api_pb2.OpenSessionRequest,
    ) -> tuple[list[Stage], int]:
        return plan_route(
            boundaries,
            holders,
            max_tokens=request.max_length,
            max_price=request.max_price,
            prefer=request.prefer,
            price_of=self.price_of,
        )

    def client_of(self, request: client_api_pb2.OpenSessionRequest) -> str:
        """The paying client's account id, after checking it signed this request ("" when
        the request carries no key: only free sessions)."""
        key = request.client_public_key
        if not key:
            return request.account
        if len(key) != identity.PUBLIC_KEY_BYTES:
            raise LedgerError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"client_public_key must be a raw {identity.PUBLIC_KEY_BYTES}-byte Ed25519 key",
            )
        account = identity.client_account(key)
        if request.account and request.account != account:
            raise LedgerError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"account {request.account!r} is not the account of this client key "
                f"({account}); leave account empty",
            )
        _check_fresh(request.request_unix_ms)
        if not identity.verify(
            key, request.client_signature, identity.open_session_payload(request)
        ):
            raise LedgerError(
                grpc.StatusCode.UNAUTHENTICATED,
                "the open request is not signed by its client_public_key",
            )
        return account

    def open(
        self,
        session_id: str,
        request: client_api_pb2.OpenSessionRequest,
        stages: Sequence[Stage],
        amount: int,
        expires_ms: int,
    ) -> ledger_pb2.Quote:
        """Escrow the quote for a new session (nothing for a free one)."""
        account = self.client_of(request)
        nodes = {n: self.price_of(n) for s in stages for n in _nodes(s)}
        quote = ledger_pb2.Quote(
            amount=amount,
            account=account,
            prices=[
                ledger_pb2.NodePrice(node_id=n, price_per_1k_token_layers=q.price)
                for n, q in sorted(nodes.items())
            ],
        )
        if amount == 0:
            return quote
        if not request.client_public_key:
            raise LedgerError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"this session costs up to {amount} credit units; open it with a client key "
                "(the tessera client signs with ~/.tessera/client.key; `tessera balance` "
                "creates it and shows the account to fund)",
            )
        self.ledger.open_hold(
            session_id,
            account,
            amount,
            nodes,
            expires_ms + HOLD_GRACE_MS,
            request.client_public_key,
        )
        log.info("session %s: %d credit units escrowed from %s", session_id, amount, account)
        return quote

    def rerouted(self, session_id: str, node_ids: Sequence[str], expires_ms: int) -> None:
        self.ledger.add_prices(
            session_id, {n: self.price_of(n) for n in node_ids}, expires_ms + HOLD_GRACE_MS
        )

    def close(
        self, session_id: str, usage: Sequence[ledger_pb2.SignedUsage]
    ) -> ledger_pb2.Settlement | None:
        hold = self.ledger.hold(session_id)
        if hold is None:
            return None  # a free session
        usages = verify_usage(session_id, list(usage), bytes(hold["client_key"]))  # type: ignore[arg-type]
        result = self.ledger.settle(session_id, usages)
        log.info(
            "session %s settled: %d charged, %d refunded (%d receipts)", session_id,
            result.charged, result.refunded, len(usages),
        )  # fmt: skip
        return ledger_pb2.Settlement(
            session_id=session_id,
            escrowed=result.escrowed,
            charged=result.charged,
            refunded=result.refunded,
            fee=result.fee,
        )

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
        node_id = identity.node_id(request.public_key)
        view = self._ctx.registry.node(node_id)
        summary = self.ledger.earnings(node_id)
        return ledger_pb2.Earnings(
            node_id=node_id,
            account=(view.account or node_id) if view else node_id,
            pending=summary.pending,
            released=summary.released,
            slashed=summary.slashed,
            rejected=summary.rejected,
            next_release_unix_ms=summary.next_release_ms,
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


def _nodes(stage: Stage) -> list[str]:
    return [stage.primary.node_id, *(a.node_id for a in stage.alternates)]


def _check_fresh(unix_ms: int) -> None:
    skew = abs(time.time() * 1000 - unix_ms)
    if skew > FRESHNESS_MS:
        raise LedgerError(
            grpc.StatusCode.UNAUTHENTICATED,
            f"the request is stamped {skew / 1000:.0f} s away from the coordinator's clock "
            f"(at most {FRESHNESS_MS // 1000} s): check this machine's clock",
        )


def _check_query(query: ledger_pb2.SignedQuery, purpose: str) -> None:
    if len(query.public_key) != identity.PUBLIC_KEY_BYTES:
        raise LedgerError(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"public_key must be a raw {identity.PUBLIC_KEY_BYTES}-byte Ed25519 key",
        )
    _check_fresh(query.unix_ms)
    payload = identity.ledger_query_payload(purpose, query.public_key, query.unix_ms)
    if not identity.verify(query.public_key, query.signature, payload):
        raise LedgerError(
            grpc.StatusCode.UNAUTHENTICATED, f"the {purpose} query is not signed by its key"
        )


async def _answer(context: grpc.aio.ServicerContext, method: Any, *args: Any) -> Any:
    try:
        return method(*args)
    except LedgerError as exc:
        await context.abort(exc.code, exc.message)


def build(ctx: CoordinatorContext) -> LedgerComponent:
    return LedgerComponent(ctx)
