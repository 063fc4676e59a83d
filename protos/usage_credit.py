"""Usage receipts and a paid session's credit, where node, client and coordinator meet.

How a node words its refusal of a paid session's call past the session's credit, so that
the client can tell it from other refusals and acknowledge instead of failing over
(node_agent/stage_server.py words it; client/driver.py reads it). A relayed call's
refusal reaches the client as a message only, so the words are the contract."""

from __future__ import annotations

UNACKNOWLEDGED = "that the client has not acknowledged"
# The most bytes of a serialized UsageReceipt that a node (Acknowledge) or the coordinator
# (settlement) takes: a real one is about 150.
MAX_RECEIPT_BYTES = 1024


def refusal(owed: int, start: int, end: int, session_id: str, credit: int) -> str:
    return (
        f"this node computed {owed} token positions on layers [{start}, {end}) of session "
        f"{session_id} {UNACKNOWLEDGED}, and the session's credit is {credit}: send "
        "Stage.Acknowledge with the node's newest receipt counter-signed (the tessera client "
        "does this as it goes), then this call again"
    )


def is_refusal(details: str) -> bool:
    """Whether a FAILED_PRECONDITION's details are this refusal."""
    return UNACKNOWLEDGED in details
