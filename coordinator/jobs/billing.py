"""Billing for training jobs: the quote and its escrow when a job's session opens, new
prices after a re-plan, settlement from counter-signed receipts at checkpoints and at the
end (docs/ledger.md, "Jobs").

A job's hold is `job:<job id>`; its receipts name the job id as their session. The rule
is "pay for samples computed": each stage node counts every sample it ran forward,
redone steps after a rollback included, and the escrow caps the total (a client never
pays past its quote).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import cast

import grpc

from coordinator.jobs.repository import JobRecord, StageRecord
from coordinator.ledger.amounts import INT64_MAX, LedgerError, quote_amount
from coordinator.ledger.billing import (
    HOLD_GRACE_MS,
    accept_once,
    check_fresh,
    check_nonce,
    job_hold_id,
    log_shortfall,
)
from coordinator.ledger.book import Ledger, NodeQuote, SettlementResult
from coordinator.ledger.receipts import verify_usage
from coordinator.model_store.errors import StoreError
from protos import identity
from protos.tessera.v1 import jobs_pb2, ledger_pb2

log = logging.getLogger("tessera.jobs")

PriceOf = Callable[[str], NodeQuote]


hold_id = job_hold_id


def _refused(err: LedgerError) -> StoreError:
    return StoreError(err.code, err.message, err.trailing_metadata)


class JobBilling:
    def __init__(self, ledger: Ledger, training_price_of: PriceOf, usage_credit: int = 0) -> None:
        self.ledger = ledger
        self._price_of = training_price_of
        # A paid job's credit at each stage node, in samples (CapabilityClaims.usage_credit).
        self.usage_credit = usage_credit

    def credit(self, job_id: str) -> tuple[bytes, int]:
        """The client key that counter-signs a paid job's receipts and the credit its nodes
        give it; (b"", 0) for a free job, a settled one, or with acknowledgments off."""
        held = self.ledger.hold(hold_id(job_id))
        if self.usage_credit == 0 or held is None or held["state"] != "open":
            return b"", 0
        return bytes(held["client_key"]), self.usage_credit  # type: ignore[arg-type]

    def quote(self, job: JobRecord, stages: Sequence[StageRecord]) -> int:
        """steps x batch_size x sum over stages of layers x that node's price per
        sample-layer: what the job may cost at most."""
        samples = job.steps * job.batch_size
        try:
            return quote_amount(
                samples, [(s.end - s.start, self._price_of(s.node_id).price) for s in stages]
            )
        except LedgerError as err:
            raise _refused(err) from None

    def open(
        self,
        job: JobRecord,
        stages: Sequence[StageRecord],
        request: jobs_pb2.OpenTrainingSessionRequest,
        expires_ms: int,
    ) -> ledger_pb2.Quote:
        """Escrow the job's quote on its first open; on a resume, let its new nodes bill.
        Raises StoreError (unsigned, over max_price, past the client's balance)."""
        try:
            return self._open(job, stages, request, expires_ms)
        except LedgerError as err:
            raise _refused(err) from None

    def _open(
        self,
        job: JobRecord,
        stages: Sequence[StageRecord],
        request: jobs_pb2.OpenTrainingSessionRequest,
        expires_ms: int,
    ) -> ledger_pb2.Quote:
        prices = {s.node_id: self._price_of(s.node_id) for s in stages}
        held = self.ledger.hold(hold_id(job.id))
        if held is not None and held["state"] != "open":
            # Its escrow expired (paused past the capability's life) or was settled: the
            # nodes would train unpaid, so the job does not run again.
            raise LedgerError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"job {job.id}'s escrow is {held['state']} and the unused part went back to "
                "the client; submit a new job to train again",
            )
        # A new session supersedes the job's driver (and spends a paid job's escrow), so a
        # job with an owner, or an escrow, opens only for that key: anyone can list job ids.
        payer = cast(bytes, held["client_key"]) if held is not None else b""
        for key, what in ((job.owner_key, "belongs to"), (payer, "is paid from")):
            if key and request.client_public_key != key:
                raise LedgerError(
                    grpc.StatusCode.PERMISSION_DENIED,
                    f"job {job.id} {what} account {identity.client_account(key)}; only that "
                    "account's client key can open its training session (sign the request "
                    "with it)",
                )
        signer = self._signer(request) if request.client_public_key else ""
        if held is not None:
            self.ledger.add_prices(hold_id(job.id), prices, expires_ms + HOLD_GRACE_MS)
            return ledger_pb2.Quote(amount=int(held["amount"]), account=str(held["account"]))  # type: ignore[call-overload]
        amount = self.quote(job, stages)
        if not 0 <= request.max_price <= INT64_MAX:
            raise LedgerError(grpc.StatusCode.INVALID_ARGUMENT, "max_price must be >= 0")
        if request.max_price and amount > request.max_price:
            raise LedgerError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"job {job.id} costs up to {amount} credit units ({job.steps} steps x "
                f"{job.batch_size} samples on these nodes), more than your max_price of "
                f"{request.max_price}; raise --max-price or train fewer steps",
            )
        quote = ledger_pb2.Quote(amount=amount)
        if amount == 0:
            return quote
        if not signer:
            raise LedgerError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"this job costs up to {amount} credit units; open it with a client key "
                "(`tessera balance` creates ~/.tessera/client.key and shows the account)",
            )
        self.ledger.open_hold(
            hold_id(job.id),
            signer,
            amount,
            prices,
            expires_ms + HOLD_GRACE_MS,
            request.client_public_key,
            # Its first stage nodes train and never check their own stages (checkers are
            # other nodes): their receipts there are billed whole, whatever the runner
            # says it billed.
            primaries=[(s.node_id, s.start, s.end) for s in stages],
        )
        log.info("job %s: %d credit units escrowed from %s", job.id, amount, signer)
        quote.account = signer
        return quote

    def billed_whole(self, job_id: str) -> set[str]:
        """The nodes whose receipts of the job are billed in full (its first stage nodes),
        which therefore must never check it."""
        return set(self.ledger.primaries(hold_id(job_id)))

    def _signer(self, request: jobs_pb2.OpenTrainingSessionRequest) -> str:
        """The account of the key that signed ``request``, once the signature, the stamp
        and the one-time nonce have passed."""
        key = request.client_public_key
        if len(key) != identity.PUBLIC_KEY_BYTES:
            raise LedgerError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"client_public_key must be a raw {identity.PUBLIC_KEY_BYTES}-byte Ed25519 key",
            )
        check_fresh(request.request_unix_ms)
        check_nonce(request.nonce)
        if not identity.verify(
            key, request.client_signature, identity.open_training_payload(request)
        ):
            raise LedgerError(
                grpc.StatusCode.UNAUTHENTICATED,
                "the open request is not signed by its client_public_key",
            )
        accept_once(self.ledger, request.nonce)
        return identity.client_account(key)

    def settled(self, job_id: str) -> list[ledger_pb2.UsageReceipt]:
        return [
            ledger_pb2.UsageReceipt(
                session_id=job_id,
                node_id=u.node_id,
                layer_start=u.layer_start,
                layer_end=u.layer_end,
                tokens=u.tokens,
            )  # fmt: skip
            for u in self.ledger.usage_settled(hold_id(job_id))
        ]

    def replanned(self, job_id: str, node_id: str, expires_ms: int) -> None:
        """A re-planned stage's node bills at its own price (the escrow still caps)."""
        self.ledger.add_prices(
            hold_id(job_id), {node_id: self._price_of(node_id)}, expires_ms + HOLD_GRACE_MS
        )

    def settle(
        self, job_id: str, usage: Sequence[ledger_pb2.SignedUsage], *, close: bool
    ) -> SettlementResult | None:
        """Pay what the receipts add; `close` also refunds the rest. None: a free job."""
        held = self.ledger.hold(hold_id(job_id))
        if held is None or (held["state"] != "open" and not close):
            return None
        try:
            usages = verify_usage(job_id, list(usage), bytes(held["client_key"]))  # type: ignore[arg-type]
            if close:
                result = self.ledger.settle(hold_id(job_id), usages)
            else:
                result = self.ledger.settle_usage(hold_id(job_id), usages)
        except LedgerError as err:
            raise _refused(err) from None
        log.info(
            "job %s: %d charged, %d refunded%s (%d receipts)", job_id, result.charged,
            result.refunded, "" if close else " so far", len(usages),
        )  # fmt: skip
        log_shortfall(hold_id(job_id), result)
        return result
