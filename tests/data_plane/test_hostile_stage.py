"""Hostile input to the Stage service: huge and control-character ids and names, and
messages over the size limit, on Forward, EndSession and Deliveries.

Any client that opened a session holds a genuine capability, so it can send those with
one. Each refusal must carry the right status and a short message (error details travel
in gRPC metadata, which a client refuses past 16 KiB: a message that repeats a huge id
arrives as RESOURCE_EXHAUSTED "Stream removed" instead of the real reason), and the node
must go on serving: an open session continues afterwards.
"""

from __future__ import annotations

import asyncio

import grpc
import numpy as np
from data_plane.stage_harness import NUM_LAYERS, CoordinatorKeys, StageNode
from data_plane.test_stage_server import PROMPT, Session, ids, logits_of
from support.coordinator_harness import CHANNEL_OPTIONS
from support.hostile import huge, refused

from protos import codec
from protos.tessera.v1 import client_api_pb2, stage_pb2, stage_pb2_grpc

HUGE_ID = huge("s")
TIMEOUT = 10


async def open_bystander(node: StageNode, keys: CoordinatorKeys) -> tuple[Session, int]:
    """A session that runs its prefill before the hostile calls and a step after them."""
    bystander = Session.open(node, keys, "s-bystander")
    prefill = await bystander.tokens(PROMPT, 0)
    return bystander, int(np.argmax(logits_of(prefill)[0, -1]))


async def still_serves(bystander: Session, token: int) -> None:
    step = await bystander.tokens([token], len(PROMPT))
    assert step.cache_length == len(PROMPT) + 1
    await bystander.close()


async def test_forward_refuses_huge_session_ids_and_model_names_briefly(
    start_node, keys: CoordinatorKeys
) -> None:
    node = await start_node([(0, NUM_LAYERS)])
    bystander, token = await open_bystander(node, keys)

    async def first_reply(request: stage_pb2.ForwardRequest) -> None:
        session = Session.open(node, keys, "s-hostile")
        try:
            await session.send(request)
        finally:
            await session.close()

    hostile = Session.open(node, keys, "s-hostile")
    genuine = hostile.capability()
    # A genuine capability of its own session, sent with another (huge) session id...
    named = hostile.request(ids([PROMPT]), capability=genuine)
    named.session_id = HUGE_ID
    details = await refused(first_reply(named), grpc.StatusCode.PERMISSION_DENIED, "s-hostile")
    assert "\x1b" not in details and "\n" not in details  # quoted, never raw
    # ...the same relayed on by a "node" (relayed calls are answered on Deliveries, but a
    # session mismatch ends the stream they came on)...
    relayed = hostile.request(ids([PROMPT]), capability=genuine)
    relayed.session_id, relayed.relayed = HUGE_ID, True
    await refused(first_reply(relayed), grpc.StatusCode.PERMISSION_DENIED, "s-hostile")
    # ...and a huge model name.
    model = hostile.request(ids([PROMPT]), capability=genuine, model="m\n" * 50_000)
    await refused(first_reply(model), grpc.StatusCode.PERMISSION_DENIED, "is for model")
    await hostile.close()

    await still_serves(bystander, token)


async def test_end_session_refuses_hostile_ids_and_oversized_messages(
    start_node, keys: CoordinatorKeys
) -> None:
    node = await start_node([(0, NUM_LAYERS)])
    bystander, token = await open_bystander(node, keys)
    genuine = bystander.capability()
    async with grpc.aio.insecure_channel(node.address, options=CHANNEL_OPTIONS) as channel:
        stub = stage_pb2_grpc.StageStub(channel)

        def end(session_id: str, capability: client_api_pb2.SignedCapability | None = None):
            request = stage_pb2.EndSessionRequest(session_id=session_id, capability=capability)
            return stub.EndSession(request, timeout=TIMEOUT)

        await refused(end(""), grpc.StatusCode.UNAUTHENTICATED, "must carry the session")
        await refused(end(HUGE_ID, genuine), grpc.StatusCode.PERMISSION_DENIED, "s-bystander")
        garbage = client_api_pb2.SignedCapability(claims=b"\xff" * 1000, signature=b"\x00" * 7)
        await refused(end("s-bystander", garbage), grpc.StatusCode.UNAUTHENTICATED, "forged")
        # Over the 64 MiB message limit: refused by gRPC before the servicer sees it.
        oversized = "x" * (codec.MAX_MESSAGE_BYTES + 10)
        await refused(
            end(oversized, genuine), grpc.StatusCode.RESOURCE_EXHAUSTED, "larger than max"
        )
        assert node.manager.active_sessions() == 1  # none of that ended the session

        await still_serves(bystander, token)
        await end("s-bystander", genuine)  # the real end still works
        assert node.manager.active_sessions() == 0


async def test_deliveries_refuses_a_huge_session_id_briefly(start_node, keys) -> None:
    node = await start_node([(0, NUM_LAYERS)])
    bystander, token = await open_bystander(node, keys)
    genuine = bystander.capability()
    async with grpc.aio.insecure_channel(node.address, options=CHANNEL_OPTIONS) as channel:
        stub = stage_pb2_grpc.StageStub(channel)
        hostile = stub.Deliveries(
            stage_pb2.DeliveriesRequest(session_id=HUGE_ID, capability=genuine), timeout=TIMEOUT
        )
        await refused(hostile.read(), grpc.StatusCode.PERMISSION_DENIED, "s-bystander")
        assert node.servicer._deliveries.subscribers() == 0

        # The session's own subscription is still taken.
        own = stub.Deliveries(
            stage_pb2.DeliveriesRequest(session_id="s-bystander", capability=genuine)
        )
        await asyncio.wait_for(own.initial_metadata(), TIMEOUT)
        assert node.servicer._deliveries.subscribers() == 1
        own.cancel()
    await still_serves(bystander, token)
