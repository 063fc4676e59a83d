"""Billing for sessions: the route within budget and its quote, escrow at OpenSession,
new prices after a Reroute, settlement from receipts at CloseSession.

The session manager (coordinator/sessions.py) calls these; LedgerComponent builds one
with prices from the registry. Everything here is synchronous: one SQLite transaction
per call.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import grpc

from coordinator.ledger.amounts import LedgerError
from coordinator.ledger.book import Ledger, SettlementResult
from coordinator.ledger.pricing import PriceOf, plan_route, stage_nodes
from coordinator.ledger.receipts import verify_usage
from coordinator.router import Holder, RttMs, Stage
from protos import coordinator_clock, identity
from protos.tessera.v1 import client_api_pb2, ledger_pb2

log = logging.getLogger("tessera.ledger")

# A signed query or open request older (or newer) than this is refused: a captured one
# cannot be replayed later.
FRESHNESS_MS = 300_000
# Signed open requests also carry this many random bytes, accepted once (accept_once): a
# request captured while its stamp is fresh cannot be sent again either.
NONCE_BYTES = 16
# A hold outlives its session's capability by this much, for a close that is under way.
HOLD_GRACE_MS = 600_000


def job_hold_id(job_id: str) -> str:
    """A training job's hold: its receipts name the job id as their session, and the
    prefix keeps it from colliding with a session id."""
    return f"job:{job_id}"


class Billing:
    def __init__(self, ledger: Ledger, price_of: PriceOf) -> None:
        self.ledger = ledger
        self._price_of = price_of

    def plan(
        self,
        boundaries: Sequence[int],
        holders: Sequence[Holder],
        request: client_api_pb2.OpenSessionRequest,
        rtt_ms: RttMs | None = None,
    ) -> tuple[list[Stage], int]:
        return plan_route(
            boundaries,
            holders,
            max_tokens=request.max_length,
            max_price=request.max_price,
            prefer=request.prefer,
            price_of=self._price_of,
            rtt_ms=rtt_ms,
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
        check_fresh(request.request_unix_ms)
        check_nonce(request.nonce)
        if not identity.verify(
            key, request.client_signature, identity.open_session_payload(request)
        ):
            raise LedgerError(
                grpc.StatusCode.UNAUTHENTICATED,
                "the open request is not signed by its client_public_key",
            )
        accept_once(self.ledger, request.nonce)
        return account

    def open(
        self,
        session_id: str,
        request: client_api_pb2.OpenSessionRequest,
        stages: Sequence[Stage],
        amount: int,
        expires_ms: int,
        checkers: Sequence[str] = (),
    ) -> ledger_pb2.Quote:
        """Escrow the quote for a new session (nothing for a free one). ``checkers`` are
        the stages' verification-only replicas: priced too, since a client could send a
        stage's work there, and the work is then billed to it as a shortfall
        (shortfall.py); their checks are not billed."""
        account = self.client_of(request)
        nodes = {n: self._price_of(n) for s in stages for n in stage_nodes(s)}
        nodes |= {n: self._price_of(n) for n in checkers if n not in nodes}
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
            primaries=[(s.primary.node_id, s.start, s.end) for s in stages],
        )
        log.info("session %s: %d credit units escrowed from %s", session_id, amount, account)
        return quote

    def rerouted(self, session_id: str, node_ids: Sequence[str], expires_ms: int) -> None:
        self.ledger.add_prices(
            session_id, {n: self._price_of(n) for n in node_ids}, expires_ms + HOLD_GRACE_MS
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
        log_shortfall(session_id, result)
        return _settlement(result)

    def settle_usage(
        self, session_id: str, usage: Sequence[ledger_pb2.SignedUsage]
    ) -> ledger_pb2.Settlement:
        """Periodic settlement of an open session (SettleUsage), or of a training job's
        hold when ``session_id`` is a job id: a node settles the receipts a job's runner
        acknowledged this way too."""
        hold_id = session_id
        hold = self.ledger.hold(hold_id)
        if hold is None:
            hold_id = job_hold_id(session_id)
            hold = self.ledger.hold(hold_id)
        if hold is None:
            raise LedgerError(
                grpc.StatusCode.NOT_FOUND,
                f"session {session_id[:64]!r} holds no escrow (unknown, or free): nothing to "
                "settle",
            )
        usages = verify_usage(session_id, list(usage), bytes(hold["client_key"]))  # type: ignore[arg-type]
        result = self.ledger.settle_usage(hold_id, usages)
        log.info("%s: %d charged so far (periodic, %d receipts)", hold_id, result.charged,
                 len(usages))  # fmt: skip
        log_shortfall(hold_id, result)
        return _settlement(result)


def log_shortfall(hold_id: str, result: SettlementResult) -> None:
    """A warning for the operator where a settlement billed a shortfall."""
    if result.shortfall:
        log.warning(
            "%s: its receipts billed less than the longest prefixes its nodes held; %d credit "
            "units charged to those nodes for it (docs/ledger.md, \"Shortfall\"): a client "
            "that passes its work off as checks, or one that refused a primary's receipt",
            hold_id, result.shortfall,
        )  # fmt: skip


def _settlement(result: SettlementResult) -> ledger_pb2.Settlement:
    return ledger_pb2.Settlement(
        session_id=result.session_id,
        escrowed=result.escrowed,
        charged=result.charged,
        refunded=result.refunded,
        fee=result.fee,
        closed=result.closed,
    )


def check_nonce(nonce: bytes) -> None:
    if len(nonce) != NONCE_BYTES:
        raise LedgerError(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"a signed open request needs a nonce of {NONCE_BYTES} random bytes (got "
            f"{len(nonce)}), new for every request: update the client",
        )


def accept_once(ledger: Ledger, nonce: bytes) -> None:
    """Refuse a signed request seen before. Called once its signature has verified, so a
    stranger cannot spend the nonces of requests a client has not sent yet."""
    if not ledger.first_use(nonce, 2 * FRESHNESS_MS):
        raise LedgerError(
            grpc.StatusCode.ALREADY_EXISTS,
            "this signed open request was accepted once already (its nonce was seen): a "
            "replay is refused; sign a new request, with a new nonce, for every attempt",
        )


def check_fresh(unix_ms: int) -> None:
    """Refuse a stamp too far from this clock. The refusal carries this clock's time, so a
    client whose clock is off can stamp its next try right (protos/coordinator_clock.py)."""
    now_ms = int(time.time() * 1000)
    skew = abs(now_ms - unix_ms)
    if skew > FRESHNESS_MS:
        raise LedgerError(
            grpc.StatusCode.UNAUTHENTICATED,
            f"the request is stamped {skew / 1000:.0f} s away from the coordinator's clock "
            f"(at most {FRESHNESS_MS // 1000} s): check this machine's clock",
            coordinator_clock.clock_trailer(now_ms),
        )
