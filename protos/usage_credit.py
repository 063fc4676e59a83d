"""Usage receipts and a paid session's credit, where node, client and coordinator meet.

How a node words its refusal of a paid session's call past the session's credit, so that
the client can tell it from other refusals and acknowledge instead of failing over
(node_agent/stage_server.py words it; client/driver.py reads it). A relayed call's
refusal reaches the client as a message only, so the words are the contract."""

from __future__ import annotations

UNACKNOWLEDGED = "that the client has not acknowledged"
LEFT_UNACKNOWLEDGED = "ended or idled with work left unacknowledged"
# The most bytes of a serialized UsageReceipt that a node (Acknowledge) or the coordinator
# (settlement) takes: a real one is about 150.
MAX_RECEIPT_BYTES = 1024


def refusal(
    owed: int, start: int, end: int, session_id: str, credit: int, *, training: bool = False
) -> str:
    """A session's words (token positions x batch), or a training job's (samples)."""
    unit, what, service = (
        ("samples", "job", "TrainingStage") if training else ("token positions", "session", "Stage")
    )
    return (
        f"this node computed {owed} {unit} on layers [{start}, {end}) of {what} "
        f"{session_id} {UNACKNOWLEDGED}, and the {what}'s credit is {credit}: send "
        f"{service}.Acknowledge with the node's newest receipt counter-signed (the tessera "
        "client does this as it goes), then this call again"
    )


def residue_refusal(residue: int, credit: int, *, training: bool = False) -> str:
    """The refusal of a client whose other sessions (jobs) here ended or idled with work it
    never acknowledged: acknowledging this session's receipts does not lift it."""
    unit, what = ("samples", "jobs") if training else ("token positions", "sessions")
    return (
        f"this client's other {what} on this node {LEFT_UNACKNOWLEDGED}: {residue} {unit}, "
        f"and a client's credit is {credit}. Its nodes serve it again once it acknowledges "
        "those receipts (the tessera client does as each ends), or once they are 15 "
        "minutes old; until then use other nodes"
    )


def is_refusal(details: str) -> bool:
    """Whether a FAILED_PRECONDITION's details are this refusal."""
    return UNACKNOWLEDGED in details


def is_residue_refusal(details: str) -> bool:
    """Whether a FAILED_PRECONDITION's details are the residue refusal: the node serves
    this client nothing for now, so the work must go to another node."""
    return LEFT_UNACKNOWLEDGED in details
