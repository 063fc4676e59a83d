"""The client's acknowledger against a node that takes connections and never answers (a
PC gone to sleep, a stopped process): neither a call nor the end of the session waits on
it longer than the acknowledger's wait (client/acknowledgments.py). Its behaviour with
real stage servers is in tests/data_plane/test_acknowledgments.py."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest

from client import acknowledgments
from client.acknowledgments import Acknowledger
from client.billing import UsageBook
from client.channels import ChannelPool
from client.records import HopRecord
from protos import identity
from protos.tessera.v1 import client_api_pb2, ledger_pb2

CREDIT = 8


@pytest.fixture
async def silent_node() -> AsyncIterator[str]:
    """HOST:PORT of a listener that accepts and then says nothing."""
    held: list[asyncio.StreamWriter] = []

    async def accept(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)

    server = await asyncio.start_server(accept, "127.0.0.1", 0)
    yield f"127.0.0.1:{server.sockets[0].getsockname()[1]}"
    for writer in held:
        writer.close()
    server.close()


def owing(book: UsageBook, address: str, tokens: int) -> HopRecord:
    """A node at ``address`` whose signed receipt counts ``tokens`` the client sent it."""
    key = identity.generate_private_key()
    public = identity.public_key_bytes(key)
    node = HopRecord(identity.node_id(public), address, 0, 2)
    body = ledger_pb2.UsageReceipt(
        session_id="s1", node_id=node.node_id, node_public_key=public,
        layer_start=node.start, layer_end=node.end, tokens=tokens,
    ).SerializeToString()  # fmt: skip
    signed = ledger_pb2.SignedUsage(
        receipt=body, node_signature=key.sign(identity.usage_payload(body))
    )
    book.sent(node.node_id, node.start, node.end, tokens)
    book.received(node.node_id, node.start, node.end, signed)
    return node


async def test_a_node_that_never_answers_holds_a_call_and_the_end_up_only_briefly(
    silent_node: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(acknowledgments, "WAIT_S", 0.3)
    book = UsageBook()
    # All of its credit is owed: the next call waits for an acknowledgment.
    node = owing(book, silent_node, CREDIT)
    assert book.countersign_one("s1", node.node_id, 0, 2, identity.generate_private_key())
    channels = ChannelPool()
    acks = Acknowledger(
        "s1", CREDIT, identity.generate_private_key(), book, channels,
        lambda: client_api_pb2.SignedCapability(),
    )  # fmt: skip
    try:
        began = time.monotonic()
        await acks.ready([(node, 0, 2)])
        await acks.close()
        assert time.monotonic() - began < 3 * 0.3 + 1.0  # not the 10 s RPC timeout
        assert acks.sent == 0 and book.owed(node.node_id, 0, 2) == CREDIT
    finally:
        await channels.close()
