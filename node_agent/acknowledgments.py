"""A paid session's or job's credit at this node, and the client's acknowledgments of its
receipts: shared by the Stage (token positions) and TrainingStage (samples) services.

In paid work the capability names the client's key and a credit (``usage_credit``). The
node computes on a layer range only while what it counted there past the newest receipt
the client counter-signed and handed back is below the credit, and settles each
acknowledged receipt with the coordinator itself (node_agent.usage_settlement), so a
client that withholds its receipts, dies or never closes gets little work unpaid
(docs/ledger.md, "Acknowledgments").
"""

from __future__ import annotations

from collections.abc import Sequence

import grpc

from node_agent.receipts import ReceiptForged, ReceiptRefused, UsageMeter
from node_agent.stage_errors import StageError
from node_agent.usage_settlement import UsageSettler
from protos import usage_credit
from protos.tessera.v1 import client_api_pb2, ledger_pb2, stage_pb2

# Receipts one Acknowledge may carry: one per layer range a node serves in the session.
MAX_ACKNOWLEDGED = 64


def check_credit(
    meter: UsageMeter,
    claims: client_api_pb2.CapabilityClaims,
    session_id: str,
    start: int,
    end: int,
    *,
    training: bool = False,
) -> None:
    """Refuse a paid call past the credit of unacknowledged work on [start, end), or past
    the credit in what the client's other sessions (jobs) here left unacknowledged."""
    if not claims.client_public_key or claims.usage_credit == 0:
        return
    owed = meter.owed(session_id, start, end)
    if owed >= claims.usage_credit:
        raise StageError(
            grpc.StatusCode.FAILED_PRECONDITION,
            usage_credit.refusal(
                owed, start, end, session_id, claims.usage_credit, training=training
            ),
        )
    # The credit again in another short session, never acknowledged, would be work for
    # free: what the client's ended or idle sessions left unacknowledged counts too.
    residue = meter.residue(claims.client_public_key, session_id)
    if residue >= claims.usage_credit:
        raise StageError(
            grpc.StatusCode.FAILED_PRECONDITION,
            usage_credit.residue_refusal(residue, claims.usage_credit, training=training),
        )


def take_acknowledgments(
    meter: UsageMeter,
    settler: UsageSettler,
    claims: client_api_pb2.CapabilityClaims,
    usage: Sequence[ledger_pb2.SignedUsage],
    *,
    training: bool = False,
) -> stage_pb2.AcknowledgeResponse:
    """Acknowledge each counter-signed receipt and keep it to settle. Not checked for
    expiry: paying for work done needs no right to ask for more."""
    what = "job" if training else "session"
    if not claims.client_public_key:
        raise StageError(
            grpc.StatusCode.FAILED_PRECONDITION,
            f"{what} {claims.session_id} is free (its capability names no client key): "
            "there is nothing to acknowledge",
        )
    if not 1 <= len(usage) <= MAX_ACKNOWLEDGED:
        raise StageError(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"{len(usage)} receipts; send 1 to {MAX_ACKNOWLEDGED}, the newest one of each "
            f"layer range this node serves in the {what}",
        )
    response = stage_pb2.AcknowledgeResponse()
    for index, signed in enumerate(usage):
        if len(signed.receipt) > usage_credit.MAX_RECEIPT_BYTES:
            raise StageError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"receipt {index} is {len(signed.receipt)} bytes; a receipt is at most "
                f"{usage_credit.MAX_RECEIPT_BYTES}",
            )
        try:
            receipt, acknowledged = meter.acknowledge(
                claims.session_id, signed, claims.client_public_key
            )
        except ReceiptRefused as err:
            code = (
                grpc.StatusCode.UNAUTHENTICATED
                if isinstance(err, ReceiptForged)
                else grpc.StatusCode.INVALID_ARGUMENT
            )
            raise StageError(code, f"receipt {index}: {err}") from None
        # Settled even when it bills nothing: the ledger pays a stage's primary its whole
        # count (a client cannot call all it asked for checks), and skips the rest.
        settler.add(receipt, signed)
        response.acknowledged_tokens.append(acknowledged)
    return response
