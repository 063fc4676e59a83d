"""The verifier: reputation, arbitration of reported mismatches, canaries, bans.

Kept import-light on purpose: the migrations import the table definitions from
``reputation`` while the database opens, before the rest of the coordinator exists.
"""

from __future__ import annotations

from typing import Any


def build(ctx: Any) -> Any:
    """COMPONENTS entry point (coordinator/server.py)."""
    from coordinator.verifier.service import FraudProven, Verifier, VerifierEvent, WorkRejected

    verifier = Verifier.from_context(ctx)
    ledger = getattr(ctx, "ledger", None)
    if ledger is not None:
        # Payout only for verified work: rejected work is refunded to the client and never
        # released; proven fraud slashes the node's pending earnings and its stake.
        def settle_verdict(event: VerifierEvent) -> None:
            if isinstance(event, WorkRejected):
                ledger.on_work_rejected(event.node_id, event.session_id, event.reason)
            elif isinstance(event, FraudProven):
                ledger.on_fraud_proven(event.node_id, event.account, event.evidence_id)

        verifier.add_listener(settle_verdict)
    return verifier
