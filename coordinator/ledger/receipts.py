"""Checks a session's usage receipts before they can move credit.

A receipt counts only if the stage node signed it (its key hashes to its node id), the
session's client counter-signed the very same bytes and the tokens it pays for (so a node
cannot inflate what the client agreed to; tokens the node computed for the client's
verification checks are not billed), it names this session (no replay from another),
and its numbers fit the ledger. One bad receipt refuses the whole close: the client
retries with good ones.
"""

from __future__ import annotations

import hashlib

import grpc
from google.protobuf.message import DecodeError

from coordinator.ledger.amounts import INT64_MAX, LedgerError
from coordinator.ledger.book import Usage
from protos import identity
from protos.tessera.v1 import ledger_pb2
from protos.usage_credit import MAX_RECEIPT_BYTES

MAX_RECEIPTS = 4096


def _refuse(code: grpc.StatusCode, message: str) -> LedgerError:
    return LedgerError(code, message)


def verify_usage(
    session_id: str, signed: list[ledger_pb2.SignedUsage], client_key: bytes
) -> list[Usage]:
    if len(signed) > MAX_RECEIPTS:
        raise _refuse(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"{len(signed)} receipts in one close; at most {MAX_RECEIPTS} (one per node and "
            "layer range)",
        )
    usages: list[Usage] = []
    seen: set[tuple[str, int, int]] = set()
    for index, item in enumerate(signed):
        usage = _verify_one(session_id, item, client_key, index)
        key = (usage.node_id, usage.layer_start, usage.layer_end)
        if key in seen:
            raise _refuse(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"receipt {index}: a second receipt for node {usage.node_id} on layers "
                f"[{usage.layer_start}, {usage.layer_end}); send only the newest (they are "
                "cumulative)",
            )
        seen.add(key)
        usages.append(usage)
    return usages


def _verify_one(
    session_id: str, item: ledger_pb2.SignedUsage, client_key: bytes, index: int
) -> Usage:
    if len(item.receipt) > MAX_RECEIPT_BYTES:
        raise _refuse(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"receipt {index} is {len(item.receipt)} bytes; a receipt is at most "
            f"{MAX_RECEIPT_BYTES}",
        )
    receipt = ledger_pb2.UsageReceipt()
    try:
        receipt.ParseFromString(item.receipt)
    except DecodeError:
        raise _refuse(
            grpc.StatusCode.INVALID_ARGUMENT, f"receipt {index} is not a UsageReceipt"
        ) from None
    if receipt.session_id != session_id:
        raise _refuse(
            grpc.StatusCode.PERMISSION_DENIED,
            f"receipt {index} is for session {receipt.session_id!r}, not {session_id!r}",
        )
    try:
        owner = identity.node_id(receipt.node_public_key)
    except ValueError:
        owner = ""
    if owner != receipt.node_id:
        raise _refuse(
            grpc.StatusCode.UNAUTHENTICATED,
            f"receipt {index}: the key it carries is not node {receipt.node_id}'s",
        )
    if not identity.verify(
        receipt.node_public_key, item.node_signature, identity.usage_payload(item.receipt)
    ):
        raise _refuse(
            grpc.StatusCode.UNAUTHENTICATED,
            f"receipt {index} is not signed by node {receipt.node_id}",
        )
    if not identity.verify(
        client_key,
        item.client_signature,
        identity.usage_countersign_payload(item.receipt, item.billed_tokens),
    ):
        raise _refuse(
            grpc.StatusCode.UNAUTHENTICATED,
            f"receipt {index} (node {receipt.node_id}) is not counter-signed by the session's "
            "client key: the client never agreed to these numbers",
        )
    if receipt.layer_start >= receipt.layer_end:
        raise _refuse(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"receipt {index}: layers [{receipt.layer_start}, {receipt.layer_end}) are empty",
        )
    if receipt.tokens > INT64_MAX or receipt.first_step > receipt.last_step:
        raise _refuse(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"receipt {index}: {receipt.tokens} tokens over steps {receipt.first_step}.."
            f"{receipt.last_step} do not fit the ledger",
        )
    if item.billed_tokens > receipt.tokens:
        raise _refuse(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"receipt {index}: {item.billed_tokens} billed tokens, but node {receipt.node_id} "
            f"computed only {receipt.tokens}",
        )
    if receipt.longest > receipt.tokens:
        raise _refuse(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"receipt {index}: node {receipt.node_id} held a prefix of {receipt.longest} "
            f"tokens but computed only {receipt.tokens}",
        )
    # The tokens the client agreed to pay for (the rest were its verification checks), the
    # node's count, which a stage's primary is paid in full (book._billable), and the
    # longest prefix it held, which the session's layers are billed for at least
    # (shortfall.py).
    return Usage(
        receipt_id=hashlib.sha256(item.receipt).hexdigest(),
        node_id=receipt.node_id,
        layer_start=receipt.layer_start,
        layer_end=receipt.layer_end,
        tokens=item.billed_tokens,
        counted=receipt.tokens,
        longest=receipt.longest,
    )
