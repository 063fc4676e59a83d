"""Hostile input to Ledger.GetBalance and GetEarnings, which anyone can call with a signed
query: empty, huge and invalid public keys, absurd timestamps, garbage and huge signatures,
a signature replayed from the other query, and messages over the size limit.

Each is refused with the right status and a short message that says what to fix (error
details travel in gRPC metadata, which a client refuses past 16 KiB), no balance changes,
and the coordinator goes on serving: the same account's and node's genuine queries are
answered afterwards, with the balance intact, and the ledger audits clean.
"""

from __future__ import annotations

import time

import grpc
from ledger.test_ledger_rpcs import admin, client_account, harness, stub  # noqa: F401 - fixture
from support.coordinator_harness import Harness
from support.hostile import huge, refused

from protos import codec, identity
from protos.tessera.v1 import common_pb2, ledger_pb2

INT64_MAX = 2**63 - 1


async def test_balance_and_earnings_refuse_hostile_queries_and_keep_serving(
    harness: Harness,  # noqa: F811 - the fixture imported above
) -> None:
    ledger = stub(harness)
    key, account = client_account()
    grant = ledger_pb2.GrantCreditsRequest(account=account, amount=42, request_id="r1")
    await ledger.GrantCredits(grant, metadata=admin(harness))
    node = await harness.registered_node("earner")
    now = int(time.time() * 1000)
    public = identity.public_key_bytes(key)

    for purpose, call, signer in (
        ("balance", ledger.GetBalance, key),
        ("earnings", ledger.GetEarnings, node.key),
    ):
        genuine = identity.sign_ledger_query(signer, purpose, now)
        other = "earnings" if purpose == "balance" else "balance"
        cases = [
            # Keys: none, 100 KB with control characters, one byte short.
            (ledger_pb2.SignedQuery(unix_ms=now), grpc.StatusCode.INVALID_ARGUMENT, "32-byte"),
            (
                ledger_pb2.SignedQuery(public_key=huge("k").encode(), unix_ms=now),
                grpc.StatusCode.INVALID_ARGUMENT,
                "32-byte",
            ),
            (
                ledger_pb2.SignedQuery(public_key=public[:31], unix_ms=now),
                grpc.StatusCode.INVALID_ARGUMENT,
                "32-byte",
            ),
            # Timestamps far from now: zero and both ends of int64.
            *[
                (
                    ledger_pb2.SignedQuery(
                        public_key=genuine.public_key, unix_ms=ms, signature=genuine.signature
                    ),
                    grpc.StatusCode.UNAUTHENTICATED,
                    "check this machine's clock",
                )
                for ms in (0, INT64_MAX, -INT64_MAX - 1)
            ],
            # Signatures: none, garbage, 100 KB, another purpose's; then 32 junk bytes as key.
            *[
                (
                    ledger_pb2.SignedQuery(
                        public_key=genuine.public_key, unix_ms=now, signature=signature
                    ),
                    grpc.StatusCode.UNAUTHENTICATED,
                    "not signed by its key",
                )
                for signature in (
                    b"",
                    b"\xff" * 64,
                    huge("s").encode(),
                    identity.sign_ledger_query(signer, other, now).signature,
                )
            ],
            (
                ledger_pb2.SignedQuery(public_key=b"\xff" * 32, unix_ms=now, signature=b"\0" * 64),
                grpc.StatusCode.UNAUTHENTICATED,
                "not signed by its key",
            ),
            # Over the 64 MiB message limit: refused by gRPC before the ledger sees it.
            (
                ledger_pb2.SignedQuery(
                    public_key=genuine.public_key,
                    unix_ms=now,
                    signature=b"x" * (codec.MAX_MESSAGE_BYTES + 10),
                ),
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                "",
            ),
        ]
        for query, code, words in cases:
            details = await refused(call(query, timeout=10), code, words)
            assert "\x1b" not in details and "\n" not in details

    # Still serving, and nothing lost: the genuine queries are answered as before.
    balance = await ledger.GetBalance(identity.sign_ledger_query(key, "balance", now))
    assert (balance.account, balance.available, balance.escrowed) == (account, 42, 0)
    earnings = await ledger.GetEarnings(identity.sign_ledger_query(node.key, "earnings", now))
    assert (earnings.node_id, earnings.pending, earnings.released) == (node.node_id, 0, 0)
    report = await ledger.Audit(common_pb2.Empty(), metadata=admin(harness))
    assert report.ok and report.minted == 42, report.violations
