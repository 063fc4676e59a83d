"""Push pipeline, node side: ``relay_to`` on Forward and the ``Deliveries`` stream.

Three real stage servers on loopback (see stage_harness), one stage each. The client sends
a token to the first node with ``relay_to`` = the rest of the route; each node computes,
sends its output on to the next, and every relayed node answers on the Deliveries stream
the client holds there. Everything a relay does must be what the capability grants.
"""

from __future__ import annotations

import asyncio
import hashlib
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass

import grpc
import numpy as np
import pytest
from data_plane.stage_harness import (
    MODEL,
    NUM_LAYERS,
    OPTIONS,
    VOCAB,
    CoordinatorKeys,
    StageNode,
    nowhere,
    reference_greedy,
    reference_logits,
)
from data_plane.test_stage_server import hold_forward

from node_agent.relay import DeliveryHub, RelayLimits, Subscriber, SubscriptionEnded
from node_agent.stage_server import StageLimits
from protos import codec, identity, output_check
from protos.tessera.v1 import client_api_pb2, common_pb2, stage_pb2, stage_pb2_grpc

PROMPT = [1, 5, 9, 13, 20]
TIMEOUT = 10.0


def capability(
    keys: CoordinatorKeys,
    session_id: str,
    grants: Sequence[tuple[StageNode, int, int]],
    **options: object,
) -> client_api_pb2.SignedCapability:
    """As the coordinator grants them: node id, address and layers per hop."""
    return keys.capability(
        session_id, [(n.node_id, s, e, n.address) for n, s, e in grants], **options
    )


def relay_hop(node: StageNode, start: int, end: int, **overrides: str) -> stage_pb2.RelayHop:
    return stage_pb2.RelayHop(
        node_id=overrides.get("node_id", node.node_id),
        address=overrides.get("address", node.address),
        layers=common_pb2.LayerRange(start=start, end=end),
    )


def ids(values: list[int], batch: int = 1) -> common_pb2.Tensor:
    return codec.encode(np.array([values] * batch, dtype=np.int64))


def decoded(tensor: common_pb2.Tensor) -> np.ndarray:
    return codec.decode(tensor)


class Stream:
    """A client's Forward stream to one node."""

    def __init__(self, node: StageNode) -> None:
        self.channel = grpc.aio.insecure_channel(node.address, options=OPTIONS)
        self.call = stage_pb2_grpc.StageStub(self.channel).Forward()
        self.sent = False  # the capability goes on the first request only

    async def send(self, request: stage_pb2.ForwardRequest) -> stage_pb2.ForwardResponse:
        await self.call.write(request)
        response = await asyncio.wait_for(self.call.read(), TIMEOUT)
        assert response is not grpc.aio.EOF
        return response

    async def close(self) -> None:
        self.call.cancel()
        await self.channel.close()


class Subscription:
    """A client's Deliveries stream at one node."""

    def __init__(
        self,
        node: StageNode,
        request: stage_pb2.DeliveriesRequest,
        options: Sequence[tuple[str, int]] = (),
    ) -> None:
        self.channel = grpc.aio.insecure_channel(node.address, options=[*OPTIONS, *options])
        self.call = stage_pb2_grpc.StageStub(self.channel).Deliveries(request)

    @classmethod
    async def open(
        cls,
        node: StageNode,
        session_id: str,
        signed: client_api_pb2.SignedCapability,
        options: Sequence[tuple[str, int]] = (),
    ) -> Subscription:
        sub = cls(
            node, stage_pb2.DeliveriesRequest(session_id=session_id, capability=signed), options
        )
        # The node sends its headers once the subscription is in place.
        await asyncio.wait_for(sub.call.initial_metadata(), TIMEOUT)
        return sub

    async def next(self) -> stage_pb2.Delivery:
        delivery = await asyncio.wait_for(self.call.read(), TIMEOUT)
        assert delivery is not grpc.aio.EOF
        return delivery

    async def close(self) -> None:
        self.call.cancel()
        await self.channel.close()


def request(
    session_id: str,
    step: int,
    start: int,
    end: int,
    tensor: common_pb2.Tensor,
    *,
    start_pos: int = 0,
    relay_to: Sequence[stage_pb2.RelayHop] = (),
    last_position_only: bool = False,
    signed: client_api_pb2.SignedCapability | None = None,
) -> stage_pb2.ForwardRequest:
    message = stage_pb2.ForwardRequest(
        session_id=session_id,
        step=step,
        model=MODEL,
        layers=common_pb2.LayerRange(start=start, end=end),
        start_pos=start_pos,
        input=tensor,
        relay_to=list(relay_to),
        last_position_only=last_position_only,
    )
    if signed is not None:
        message.capability.CopyFrom(signed)
    return message


def verify_signed(
    node: StageNode, session_id: str, response: stage_pb2.ForwardResponse, start: int, end: int
) -> None:
    digest = hashlib.sha256(response.output.data).digest()
    payload = identity.output_payload(
        session_id, response.step, start, end, digest, input_digest=response.input_digest
    )
    assert identity.verify(node.public_key, response.signature, payload)


@dataclass
class Pipeline:
    """n0 [0, 2) -> n1 [2, 3) -> n2 [3, 4), one session, the capability granting all."""

    nodes: tuple[StageNode, StageNode, StageNode]
    session_id: str
    signed: client_api_pb2.SignedCapability

    @property
    def route(self) -> list[stage_pb2.RelayHop]:
        _, n1, n2 = self.nodes
        return [relay_hop(n1, 2, 3), relay_hop(n2, 3, NUM_LAYERS)]


async def three_nodes(start_node, **options) -> tuple[StageNode, StageNode, StageNode]:
    n0 = await start_node([(0, 2)])
    n1 = await start_node([(2, 3)], **options)
    n2 = await start_node([(3, NUM_LAYERS)])
    return n0, n1, n2


def pipeline(keys, nodes, session_id: str, **options) -> Pipeline:
    n0, n1, n2 = nodes
    grants = [(n0, 0, 2), (n1, 2, 3), (n2, 3, NUM_LAYERS)]
    return Pipeline(nodes, session_id, capability(keys, session_id, grants, **options))


async def direct_hops(
    p: Pipeline, streams: list[Stream], step: int, tokens: list[int], start_pos: int
) -> list[stage_pb2.ForwardResponse]:
    """One step the old way: the client carries each output to the next node."""
    first = not streams[0].sent
    spans = [(0, 2), (2, 3), (3, NUM_LAYERS)]
    tensor = ids(tokens)
    answers = []
    for stream, (start, end) in zip(streams, spans, strict=True):
        answer = await stream.send(
            request(
                p.session_id,
                step,
                start,
                end,
                tensor,
                start_pos=start_pos,
                last_position_only=end == NUM_LAYERS,
                signed=p.signed if first else None,
            )
        )
        answers.append(answer)
        tensor = answer.output
    for stream in streams:
        stream.sent = True
    return answers


# ---- the happy path -------------------------------------------------------------------------


async def test_relayed_steps_match_hop_by_hop_and_the_full_model(
    start_node, keys, checkpoint
) -> None:
    nodes = await three_nodes(start_node)
    n0, n1, n2 = nodes
    relayed = pipeline(keys, nodes, "s-relay")
    sub1 = await Subscription.open(n1, relayed.session_id, relayed.signed)
    sub2 = await Subscription.open(n2, relayed.session_id, relayed.signed)
    head = Stream(n0)
    # The same calls, hop by hop, on another session of the same nodes.
    direct = pipeline(keys, nodes, "s-direct")
    direct_streams = [Stream(n) for n in nodes]

    generated: list[int] = []
    inputs_of_n1: list[tuple[np.ndarray, str]] = []
    tokens, position = list(PROMPT), 0
    for step in range(1, 7):
        own = await head.send(
            request(
                relayed.session_id,
                step,
                0,
                2,
                ids(tokens),
                start_pos=position,
                relay_to=relayed.route,
                last_position_only=True,
                signed=relayed.signed if step == 1 else None,
            )
        )
        d1, d2 = await sub1.next(), await sub2.next()
        assert (d1.step, d1.layers.start, d1.layers.end, d1.error_code) == (step, 2, 3, 0)
        assert (d2.step, d2.layers.start, d2.layers.end, d2.error_code) == (step, 3, 4, 0)
        assert own.step == d1.response.step == d2.response.step == step
        verify_signed(n0, relayed.session_id, own, 0, 2)
        verify_signed(n1, relayed.session_id, d1.response, 2, 3)
        verify_signed(n2, relayed.session_id, d2.response, 3, 4)
        # node1's signature commits to the history it was sent: node0's outputs, as signed.
        inputs_of_n1.append((decoded(own.output), own.output.dtype))
        assert d1.response.input_digest == output_check.prefix_digest(inputs_of_n1)
        assert d1.response.cache_length == d2.response.cache_length == position + len(tokens)

        expected = await direct_hops(direct, direct_streams, step, tokens, position)
        assert own.output == expected[0].output
        assert d1.response.output == expected[1].output
        assert d2.response.output == expected[2].output
        logits = decoded(d2.response.output)
        assert logits.shape == (1, 1, VOCAB)  # last_position_only reached the last hop
        if step == 1:
            np.testing.assert_allclose(
                logits[0, -1], reference_logits(checkpoint, PROMPT)[-1], rtol=1e-5, atol=1e-5
            )
        position += len(tokens)
        tokens = [int(np.argmax(logits[0, -1]))]
        generated.append(tokens[0])
    assert generated == reference_greedy(checkpoint, PROMPT, 6)
    assert n0.servicer._relay.links() == [(relayed.session_id, n1.address)]
    assert n1.servicer._relay.links() == [(relayed.session_id, n2.address)]

    for closable in (head, sub1, sub2, *direct_streams):
        await closable.close()


async def test_a_hop_to_the_same_node_is_handed_over_in_process(
    start_node, keys, checkpoint
) -> None:
    # a holds two consecutive stages of the route: its hand-off to itself never leaves
    # the process, and it still answers, signs and counts that stage on its own.
    a = await start_node([(0, 2), (2, 3)])
    c = await start_node([(3, NUM_LAYERS)])
    session_id = "s-same-node"
    signed = capability(keys, session_id, [(a, 0, 2), (a, 2, 3), (c, 3, NUM_LAYERS)])
    route = [relay_hop(a, 2, 3), relay_hop(c, 3, NUM_LAYERS)]
    sub_a = await Subscription.open(a, session_id, signed)
    sub_c = await Subscription.open(c, session_id, signed)
    head = Stream(a)
    generated: list[int] = []
    inputs_of_second: list[tuple[np.ndarray, str]] = []
    tokens, position = list(PROMPT), 0
    for step in range(1, 6):
        own = await head.send(
            request(
                session_id,
                step,
                0,
                2,
                ids(tokens),
                start_pos=position,
                relay_to=route,
                last_position_only=True,
                signed=signed if step == 1 else None,
            )
        )
        second, last = await sub_a.next(), await sub_c.next()
        assert (second.step, second.layers.start, second.layers.end) == (step, 2, 3)
        assert (last.step, last.layers.start, last.layers.end) == (step, 3, NUM_LAYERS)
        assert second.error_code == last.error_code == 0
        verify_signed(a, session_id, own, 0, 2)
        verify_signed(a, session_id, second.response, 2, 3)
        verify_signed(c, session_id, last.response, 3, NUM_LAYERS)
        # The second stage ran exactly the first stage's signed output.
        inputs_of_second.append((decoded(own.output), own.output.dtype))
        assert second.response.input_digest == output_check.prefix_digest(inputs_of_second)
        assert second.response.cache_length == position + len(tokens)
        position += len(tokens)
        tokens = [int(np.argmax(decoded(last.response.output)[0, -1]))]
        generated.append(tokens[0])
    assert generated == reference_greedy(checkpoint, PROMPT, 5)
    # No link from a to its own address: only the hop to c went over gRPC.
    assert a.servicer._relay.links() == [(session_id, c.address)]
    assert not a.servicer._relays_here  # every hand-off finished
    for closable in (head, sub_a, sub_c):
        await closable.close()


async def test_in_process_hand_offs_are_bounded(start_node, keys) -> None:
    # With no room for waiting hand-offs the step is dropped, as by a full link: nothing
    # is delivered for it and the node goes on serving.
    limits = StageLimits(relay=RelayLimits(link_queue=0))
    a = await start_node([(0, 2), (2, NUM_LAYERS)], limits=limits)
    session_id = "s-bounded"
    signed = capability(keys, session_id, [(a, 0, 2), (a, 2, NUM_LAYERS)])
    sub = await Subscription.open(a, session_id, signed)
    head = Stream(a)
    own = await head.send(
        request(
            session_id,
            1,
            0,
            2,
            ids(PROMPT),
            relay_to=[relay_hop(a, 2, NUM_LAYERS)],
            last_position_only=True,
            signed=signed,
        )  # fmt: skip
    )
    assert own.cache_length == len(PROMPT)
    assert "in-process hand-offs already wait" in own.relay_failed  # the client knows at once
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(sub.call.read(), 0.5)
    # The client sends the dropped step itself, and the node serves it.
    answer = await head.send(
        request(session_id, 1, 2, NUM_LAYERS, own.output, last_position_only=True)
    )
    assert answer.cache_length == len(PROMPT)
    for closable in (head, sub):
        await closable.close()


async def test_the_own_answer_does_not_wait_for_the_next_hop(start_node, keys) -> None:
    nodes = await three_nodes(start_node)
    n0, n1, _ = nodes
    held = hold_forward(n1, 2, 3)
    p = pipeline(keys, nodes, "s-nowait")
    sub1 = await Subscription.open(n1, p.session_id, p.signed)
    head = Stream(n0)
    try:
        own = await head.send(
            request(p.session_id, 1, 0, 2, ids(PROMPT), relay_to=p.route[:1], signed=p.signed)
        )
        assert own.cache_length == len(PROMPT)
        assert await asyncio.to_thread(held.entered.wait, TIMEOUT)  # node1 still computes
        held.release.set()
        assert (await sub1.next()).response.cache_length == len(PROMPT)
    finally:
        held.release.set()
        await head.close()
        await sub1.close()


def next_hop_at(
    keys: CoordinatorKeys, n0: StageNode, session_id: str, address: str
) -> tuple[client_api_pb2.SignedCapability, list[stage_pb2.RelayHop]]:
    """A session whose second hop, granted like any, is whatever listens at ``address``:
    the capability and the relay route to it."""
    signed = keys.capability(
        session_id, [(n0.node_id, 0, 2, n0.address), ("n-next", 2, NUM_LAYERS, address)]
    )
    layers = common_pb2.LayerRange(start=2, end=NUM_LAYERS)
    return signed, [stage_pb2.RelayHop(node_id="n-next", address=address, layers=layers)]


async def test_a_next_node_that_takes_nothing_does_not_hold_up_the_answer(start_node, keys) -> None:
    # A peer that accepts the TCP connection and then neither reads nor answers: the HTTP/2
    # handshake never completes, so a write to it never does either.
    silent = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    address = f"127.0.0.1:{silent.getsockname()[1]}"
    limits = StageLimits(relay=RelayLimits(write_timeout_s=0.5, first_write_timeout_s=0.5))
    n0 = await start_node([(0, 2)], limits=limits)
    signed, route = next_hop_at(keys, n0, "s-silent", address)
    head = Stream(n0)
    try:
        began = time.monotonic()
        own = await head.send(request("s-silent", 1, 0, 2, ids(PROMPT), relay_to=route,
                                      signed=signed))  # fmt: skip
        assert own.cache_length == len(PROMPT)
        assert time.monotonic() - began < 0.5 + 2.0  # the write timeout, not the peer
        assert (
            own.relay_failed == "sending failed: the next node took nothing within the "
            "write timeout"
        )
        # The link is gone; the next step is answered as promptly (a new link, same fate).
        assert n0.servicer._relay.links() == []
        nxt = await head.send(request("s-silent", 2, 0, 2, ids([3]), start_pos=len(PROMPT),
                                      relay_to=route))  # fmt: skip
        assert nxt.cache_length == len(PROMPT) + 1
    finally:
        await head.close()
        silent.close()


async def test_a_next_node_behind_a_dropping_firewall_costs_the_answer_a_second(
    start_node, keys
) -> None:
    # Nothing answers the connection at all (a firewall that drops packets; here a peer
    # that never completes the HTTP/2 handshake): a new link's first write, which waits
    # for the connection, gives up after first_write_timeout_s, not the later writes' 5 s.
    silent = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    n0 = await start_node([(0, 2)])
    limits = n0.servicer.limits.relay
    assert limits.first_write_timeout_s < limits.write_timeout_s
    signed, route = next_hop_at(keys, n0, "s-dropped", f"127.0.0.1:{silent.getsockname()[1]}")
    head = Stream(n0)
    try:
        for step, start_pos, tokens in ((1, 0, PROMPT), (2, len(PROMPT), [3])):
            began = time.monotonic()
            own = await head.send(request("s-dropped", step, 0, 2, ids(tokens),
                                          start_pos=start_pos, relay_to=route,
                                          signed=signed if step == 1 else None))  # fmt: skip
            took = time.monotonic() - began
            assert limits.first_write_timeout_s <= took < limits.write_timeout_s
            assert own.relay_failed.endswith("took nothing within the write timeout")
    finally:
        await head.close()
        silent.close()


async def test_a_next_node_nobody_listens_at_is_named_in_the_answer(start_node, keys) -> None:
    # The next node's port refuses connections (it is gone, or this node cannot reach it):
    # the answer says the hand-off failed, so the client need not wait for a delivery.
    n0 = await start_node([(0, 2)])
    signed, route = next_hop_at(keys, n0, "s-gone", nowhere())
    head = Stream(n0)
    try:
        own = await head.send(request("s-gone", 1, 0, 2, ids(PROMPT), relay_to=route,
                                      signed=signed))  # fmt: skip
        assert own.cache_length == len(PROMPT) and own.signature  # its own answer stands
        assert own.relay_failed.startswith("sending failed: UNAVAILABLE")
        assert n0.servicer._relay.links() == []
        # Every later relay tries again, and says so again when it fails.
        nxt = await head.send(request("s-gone", 2, 0, 2, ids([3]), start_pos=len(PROMPT),
                                      relay_to=route))  # fmt: skip
        assert nxt.relay_failed.startswith("sending failed: UNAVAILABLE")
    finally:
        await head.close()


# ---- hostile and malformed relay routes -----------------------------------------------------


@dataclass(frozen=True)
class BadRoute:
    name: str
    route: object  # (n1, n2) -> list[RelayHop]
    code: grpc.StatusCode
    message: str
    last_position_only: bool = False


BAD_ROUTES = [
    BadRoute(
        "a node id the capability does not grant",
        lambda n1, n2: [relay_hop(n1, 2, 3, node_id="n-stranger")],
        grpc.StatusCode.PERMISSION_DENIED,
        "relay_to[0] (n-stranger at",
    ),
    BadRoute(
        "a granted node id at another address",
        lambda n1, n2: [relay_hop(n1, 2, 3, address="10.9.9.9:7070")],
        grpc.StatusCode.PERMISSION_DENIED,
        "is not a hop the capability grants",
    ),
    BadRoute(
        "a granted node with layers outside its grant",
        lambda n1, n2: [relay_hop(n1, 2, NUM_LAYERS)],
        grpc.StatusCode.PERMISSION_DENIED,
        "is not a hop the capability grants",
    ),
    BadRoute(
        "hops with a gap",
        lambda n1, n2: [relay_hop(n2, 3, NUM_LAYERS)],
        grpc.StatusCode.INVALID_ARGUMENT,
        "starts at layer 3, but the hop before it ends at 2",
    ),
    BadRoute(
        "hops out of order",
        lambda n1, n2: [relay_hop(n2, 3, NUM_LAYERS), relay_hop(n1, 2, 3)],
        grpc.StatusCode.INVALID_ARGUMENT,
        "without a gap",
    ),
    BadRoute(
        "too many hops",
        lambda n1, n2: [relay_hop(n1, 2, 3)] * 17,
        grpc.StatusCode.INVALID_ARGUMENT,
        "relay_to has 17 hops; this node relays along at most 16",
    ),
    BadRoute(
        "a hop past the model's layers",
        lambda n1, n2: [relay_hop(n1, 2, 9)],
        grpc.StatusCode.INVALID_ARGUMENT,
        "a hop needs start < end <= 4",
    ),
    BadRoute(
        "last_position_only on a route that stops short of the last layer",
        lambda n1, n2: [relay_hop(n1, 2, 3)],
        grpc.StatusCode.INVALID_ARGUMENT,
        "relay_to ends at layer 3, before the model's last layer (4)",
        last_position_only=True,
    ),
]


@pytest.mark.parametrize("case", BAD_ROUTES, ids=[c.name for c in BAD_ROUTES])
async def test_a_route_the_capability_does_not_grant_is_refused_before_computing(
    start_node, keys, case
) -> None:
    nodes = await three_nodes(start_node)
    n0, n1, n2 = nodes
    p = pipeline(keys, nodes, "s-hostile")
    bad = Stream(n0)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await bad.send(
            request(
                p.session_id,
                1,
                0,
                2,
                ids(PROMPT),
                relay_to=case.route(n1, n2),
                last_position_only=case.last_position_only,
                signed=p.signed,
            )
        )
    assert err.value.code() == case.code, err.value.details()
    assert case.message in (err.value.details() or "")
    await bad.close()
    assert n0.manager.active_sessions() == 0, "refused before it computed anything"
    assert n0.servicer._relay.links() == []

    # The node keeps serving: the same session, relayed properly, on a new stream.
    sub2 = await Subscription.open(n2, p.session_id, p.signed)
    good = Stream(n0)
    own = await good.send(
        request(p.session_id, 2, 0, 2, ids(PROMPT), relay_to=p.route, signed=p.signed)
    )
    assert own.cache_length == len(PROMPT)
    delivery = await sub2.next()
    assert delivery.step == 2 and delivery.response.cache_length == len(PROMPT)
    await good.close()
    await sub2.close()


async def test_last_position_only_without_relay_still_needs_the_last_layer(
    start_node, keys
) -> None:
    nodes = await three_nodes(start_node)
    p = pipeline(keys, nodes, "s-lpo")
    stream = Stream(nodes[0])
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stream.send(
            request(p.session_id, 1, 0, 2, ids(PROMPT), last_position_only=True, signed=p.signed)
        )
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "set it only on the hop that ends there" in (err.value.details() or "")
    await stream.close()


# ---- Deliveries: who may subscribe ----------------------------------------------------------


def _deliveries_cases(keys: CoordinatorKeys, n1: StageNode, n2: StageNode):
    session = "s-subs"
    mine = [(n1, 2, 3)]
    return [
        (
            "no capability",
            stage_pb2.DeliveriesRequest(session_id=session),
            grpc.StatusCode.UNAUTHENTICATED,
            "must carry the session's capability",
        ),
        (
            "forged capability",
            stage_pb2.DeliveriesRequest(
                session_id=session,
                capability=capability(keys, session, mine, key=identity.generate_private_key()),
            ),
            grpc.StatusCode.UNAUTHENTICATED,
            "does not verify",
        ),
        (
            "expired capability",
            stage_pb2.DeliveriesRequest(
                session_id=session, capability=capability(keys, session, mine, ttl_s=-5)
            ),
            grpc.StatusCode.UNAUTHENTICATED,
            "token expired at",
        ),
        (
            "another session's capability",
            stage_pb2.DeliveriesRequest(
                session_id=session, capability=capability(keys, "s-other", mine)
            ),
            grpc.StatusCode.PERMISSION_DENIED,
            "is for session 's-other'",
        ),
        (
            "a capability that does not grant this node",
            stage_pb2.DeliveriesRequest(
                session_id=session, capability=capability(keys, session, [(n2, 3, 4)])
            ),
            grpc.StatusCode.PERMISSION_DENIED,
            "is not among the nodes the capability grants",
        ),
    ]


async def test_deliveries_are_only_for_the_sessions_own_granted_nodes(start_node, keys) -> None:
    nodes = await three_nodes(start_node)
    n0, n1, n2 = nodes
    for name, bad, code, message in _deliveries_cases(keys, n1, n2):
        sub = Subscription(n1, bad)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await asyncio.wait_for(sub.call.read(), TIMEOUT)
        assert err.value.code() == code, name
        assert message in (err.value.details() or ""), name
        await sub.close()
    assert n1.servicer._deliveries.subscribers() == 0

    # ...and a proper subscription still works.
    p = pipeline(keys, nodes, "s-subs")
    sub1 = await Subscription.open(n1, p.session_id, p.signed)
    head = Stream(n0)
    await head.send(
        request(p.session_id, 1, 0, 2, ids(PROMPT), relay_to=p.route[:1], signed=p.signed)
    )
    assert (await sub1.next()).response.cache_length == len(PROMPT)
    await head.close()
    await sub1.close()


async def test_subscriptions_are_capped_per_node(start_node, keys) -> None:
    limits = StageLimits(relay=RelayLimits(max_subscriptions=2))
    nodes = await three_nodes(start_node, limits=limits)
    n1 = nodes[1]
    subs = [
        await Subscription.open(n1, p.session_id, p.signed)
        for p in (pipeline(keys, nodes, f"s-cap-{i}") for i in range(2))
    ]
    third = pipeline(keys, nodes, "s-cap-2")
    refused = Subscription(
        n1, stage_pb2.DeliveriesRequest(session_id=third.session_id, capability=third.signed)
    )
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await asyncio.wait_for(refused.call.read(), TIMEOUT)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "delivery subscriptions, its limit" in (err.value.details() or "")
    await refused.close()
    # A session already subscribed may still replace its own subscription.
    again = pipeline(keys, nodes, "s-cap-0")
    replacement = await Subscription.open(n1, again.session_id, again.signed)
    assert await asyncio.wait_for(subs[0].call.read(), TIMEOUT) is grpc.aio.EOF
    # A cancelled subscription frees its place.
    await subs[1].close()
    deadline = time.monotonic() + TIMEOUT
    while n1.servicer._deliveries.subscribers() > 1 and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    admitted = await Subscription.open(n1, third.session_id, third.signed)
    for sub in (subs[0], replacement, admitted):
        await sub.close()


# ---- failures downstream, stale calls, subscription lifetime -------------------------------


async def test_a_relayed_call_that_fails_downstream_is_delivered_as_an_error(
    start_node, keys, checkpoint
) -> None:
    nodes = await three_nodes(start_node)
    n0, n1, n2 = nodes
    p = pipeline(keys, nodes, "s-fail")
    sub1 = await Subscription.open(n1, p.session_id, p.signed)
    sub2 = await Subscription.open(n2, p.session_id, p.signed)
    # The prefill reaches node0 and node1 only (relayed to node1): node2 has no cache.
    head = Stream(n0)
    await head.send(
        request(p.session_id, 1, 0, 2, ids(PROMPT), relay_to=p.route[:1], signed=p.signed)
    )
    assert (await sub1.next()).response.cache_length == len(PROMPT)

    own = await head.send(
        request(
            p.session_id,
            2,
            0,
            2,
            ids([3]),
            start_pos=len(PROMPT),
            relay_to=p.route,
            last_position_only=True,
        )
    )
    assert own.cache_length == len(PROMPT) + 1
    d1, d2 = await sub1.next(), await sub2.next()
    assert d1.error_code == 0 and d1.response.cache_length == len(PROMPT) + 1
    assert d2.step == 2 and (d2.layers.start, d2.layers.end) == (3, 4)
    assert not d2.HasField("response")
    assert d2.error_code == grpc.StatusCode.FAILED_PRECONDITION.value[0]
    assert "start_pos must be 0" in d2.error_message

    # The links stay up: the client replays the whole sequence and it flows through.
    sequence = [*PROMPT, 3]
    await head.send(
        request(p.session_id, 3, 0, 2, ids(sequence), relay_to=p.route, last_position_only=True)
    )
    d1, d2 = await sub1.next(), await sub2.next()
    assert (d1.step, d2.step, d1.error_code, d2.error_code) == (3, 3, 0, 0)
    np.testing.assert_allclose(
        decoded(d2.response.output)[0, -1],
        reference_logits(checkpoint, sequence)[-1],
        rtol=1e-5,
        atol=1e-5,
    )
    assert n0.servicer._relay.links() == [(p.session_id, n1.address)]
    for closable in (head, sub1, sub2):
        await closable.close()


async def test_a_relayed_call_with_bad_input_does_not_end_the_link(start_node, keys) -> None:
    nodes = await three_nodes(start_node)
    n0, n1, _ = nodes
    p = pipeline(keys, nodes, "s-badin")
    sub1 = await Subscription.open(n1, p.session_id, p.signed)
    head = Stream(n0)
    await head.send(
        request(p.session_id, 1, 0, 2, ids(PROMPT), relay_to=p.route[:1], signed=p.signed)
    )
    assert (await sub1.next()).error_code == 0
    await head.close()
    # A relayed call (here from a stand-in for node0) with a tensor node1 refuses (NaN
    # hidden states) arrives as an error on the Deliveries stream...
    link = Stream(n1)
    nan = codec.encode(np.full((1, 1, 32), np.nan, dtype=np.float32))
    relayed = request(p.session_id, 3, 2, 3, nan, start_pos=len(PROMPT), signed=p.signed)
    relayed.relayed = True
    await link.call.write(relayed)
    delivery = await sub1.next()
    assert delivery.error_code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "NaN" in delivery.error_message
    # ...and the same stream carries the next one.
    hidden = codec.encode(np.full((1, 1, 32), 0.1, dtype=np.float32))
    relayed = request(p.session_id, 4, 2, 3, hidden, start_pos=len(PROMPT))
    relayed.relayed = True
    await link.call.write(relayed)
    delivery = await sub1.next()
    assert delivery.error_code == 0 and delivery.response.cache_length == len(PROMPT) + 1
    await link.close()
    await sub1.close()


async def test_a_broken_link_is_dropped_and_the_next_relay_reopens_it(start_node, keys) -> None:
    nodes = await three_nodes(start_node)
    n0, n1, _ = nodes
    p = pipeline(keys, nodes, "s-broken")
    sub1 = await Subscription.open(n1, p.session_id, p.signed)
    head = Stream(n0)
    await head.send(
        request(p.session_id, 1, 0, 2, ids(PROMPT), relay_to=p.route[:1], signed=p.signed)
    )
    assert (await sub1.next()).step == 1
    key = (p.session_id, n1.address)
    broken = n0.servicer._relay._links[key]
    broken.call.cancel()  # as when the connection to node1 breaks
    deadline = time.monotonic() + TIMEOUT
    while n0.servicer._relay.links() and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    assert n0.servicer._relay.links() == [], "the broken link was dropped"
    own = await head.send(
        request(p.session_id, 2, 0, 2, ids([3]), start_pos=len(PROMPT), relay_to=p.route[:1])
    )
    assert own.relay_failed == ""  # handed on, on a new link
    delivery = await sub1.next()
    assert (delivery.step, delivery.error_code) == (2, 0)
    # A new stream: it carried the capability again, and node1's cache went on.
    assert n0.servicer._relay._links[key] is not broken
    assert delivery.response.cache_length == own.cache_length == len(PROMPT) + 1
    await head.close()
    await sub1.close()


async def test_a_relayed_step_older_than_a_direct_one_is_dropped(
    start_node, keys, checkpoint
) -> None:
    nodes = await three_nodes(start_node)
    n0, n1, n2 = nodes
    p = pipeline(keys, nodes, "s-stale")
    sub1 = await Subscription.open(n1, p.session_id, p.signed)
    sub2 = await Subscription.open(n2, p.session_id, p.signed)
    head = Stream(n0)
    await head.send(
        request(
            p.session_id,
            1,
            0,
            2,
            ids(PROMPT),
            relay_to=p.route,
            last_position_only=True,
            signed=p.signed,
        )
    )
    first = await sub2.next()
    await sub1.next()
    token = int(np.argmax(decoded(first.response.output)[0, -1]))
    position = len(PROMPT)

    # The client gave up waiting and ran step 2 hop by hop itself...
    direct = [Stream(n) for n in nodes]
    answers = await direct_hops(p, direct, 2, [token], position)
    # ...then node0 relays its (late) step 2: node1 has run step 2 already, so it drops the
    # call: no compute, nothing sent on to node2, no delivery.
    await head.send(
        request(
            p.session_id,
            2,
            0,
            2,
            ids([token]),
            start_pos=position,
            relay_to=p.route,
            last_position_only=True,
        )
    )
    # Later steps still flow; the next deliveries are theirs.
    token2 = int(np.argmax(decoded(answers[2].output)[0, -1]))
    await head.send(
        request(
            p.session_id,
            3,
            0,
            2,
            ids([token2]),
            start_pos=position + 1,
            relay_to=p.route,
            last_position_only=True,
        )
    )
    d1, d2 = await sub1.next(), await sub2.next()
    assert (d1.step, d2.step) == (3, 3), "the stale step 2 was delivered"
    assert d2.response.cache_length == position + 2
    expected = reference_greedy(checkpoint, PROMPT, 3)
    assert [token, token2, int(np.argmax(decoded(d2.response.output)[0, -1]))] == expected
    for closable in (head, sub1, sub2, *direct):
        await closable.close()


async def test_a_newer_subscription_replaces_the_older_and_end_session_ends_it(
    start_node, keys
) -> None:
    nodes = await three_nodes(start_node)
    n0, n1, _ = nodes
    p = pipeline(keys, nodes, "s-subs")
    older = await Subscription.open(n1, p.session_id, p.signed)
    newer = await Subscription.open(n1, p.session_id, p.signed)
    assert await asyncio.wait_for(older.call.read(), TIMEOUT) is grpc.aio.EOF
    assert await older.call.code() == grpc.StatusCode.OK
    head = Stream(n0)
    await head.send(
        request(p.session_id, 1, 0, 2, ids(PROMPT), relay_to=p.route[:1], signed=p.signed)
    )
    assert (await newer.next()).step == 1

    for node in (n1, n0):
        async with grpc.aio.insecure_channel(node.address, options=OPTIONS) as channel:
            await stage_pb2_grpc.StageStub(channel).EndSession(
                stage_pb2.EndSessionRequest(session_id=p.session_id, capability=p.signed)
            )
    assert await asyncio.wait_for(newer.call.read(), TIMEOUT) is grpc.aio.EOF
    assert n1.servicer._deliveries.subscribers() == 0
    assert n0.servicer._relay.links() == []
    for closable in (head, older, newer):
        await closable.close()


async def test_idle_expiry_ends_the_subscription_and_the_links(start_node, keys) -> None:
    options = {"idle_ttl_s": 0.3, "limits": StageLimits(expiry_interval_s=0.05)}
    n0 = await start_node([(0, 2)], **options)
    n1 = await start_node([(2, 3)], **options)
    n2 = await start_node([(3, NUM_LAYERS)], **options)
    p = pipeline(keys, (n0, n1, n2), "s-idle")
    sub1 = await Subscription.open(n1, p.session_id, p.signed)
    head = Stream(n0)
    await head.send(
        request(p.session_id, 1, 0, 2, ids(PROMPT), relay_to=p.route[:1], signed=p.signed)
    )
    assert (await sub1.next()).step == 1
    assert n0.servicer._relay.links()
    assert await asyncio.wait_for(sub1.call.read(), TIMEOUT) is grpc.aio.EOF
    deadline = time.monotonic() + TIMEOUT
    while n0.servicer._relay.links() and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert n0.servicer._relay.links() == []
    await head.close()
    await sub1.close()


async def test_closing_the_server_ends_subscriptions_and_links(start_node, keys) -> None:
    nodes = await three_nodes(start_node)
    n0, n1, _ = nodes
    p = pipeline(keys, nodes, "s-close")
    sub1 = await Subscription.open(n1, p.session_id, p.signed)
    head = Stream(n0)
    await head.send(
        request(p.session_id, 1, 0, 2, ids(PROMPT), relay_to=p.route[:1], signed=p.signed)
    )
    assert (await sub1.next()).step == 1
    await n0.servicer.close()
    assert n0.servicer._relay.links() == []
    await n1.servicer.close()
    assert await asyncio.wait_for(sub1.call.read(), TIMEOUT) is grpc.aio.EOF
    await head.close()
    await sub1.close()


async def test_a_subscriber_that_does_not_read_loses_its_subscription(start_node, keys) -> None:
    """Deliveries wait in a bounded buffer; a client that never reads is cut off with
    RESOURCE_EXHAUSTED instead of the node's memory growing, and the node goes on."""
    limits = StageLimits(relay=RelayLimits(delivery_buffer=4))
    nodes = await three_nodes(start_node, limits=limits)
    n0, n1, _ = nodes
    p = pipeline(keys, nodes, "s-slow")
    # A fixed flow-control window (no BDP growth): what gRPC buffers unread stays small.
    sub1 = await Subscription.open(n1, p.session_id, p.signed, [("grpc.http2.bdp_probe", 0)])
    head = Stream(n0)
    batch, length = 8, 120  # each delivery carries 8 x 120 x 32 float32: 123 KB
    for step in range(1, 21):
        await head.send(
            request(
                p.session_id,
                step,
                0,
                2,
                ids([1] * length, batch),
                relay_to=p.route[:1],
                signed=p.signed if step == 1 else None,
            )
        )
    # Node1 may still be working through the relayed calls: wait until it gives up.
    deadline = time.monotonic() + TIMEOUT
    while n1.servicer._deliveries.subscribers() and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    received = 0
    with pytest.raises(grpc.aio.AioRpcError) as err:
        while True:
            delivery = await sub1.next()
            assert delivery.error_code == 0
            received += 1
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "waited unread at this node" in (err.value.details() or "")
    assert received < 20, received
    await sub1.close()
    # A new subscription of the session gets the next calls.
    sub1 = await Subscription.open(n1, p.session_id, p.signed)
    await head.send(request(p.session_id, 21, 0, 2, ids([1] * length, batch), relay_to=p.route[:1]))
    # (Steps node1 had still to compute when the old one ended may come first.)
    steps = [(await sub1.next()).step]
    while steps[-1] != 21:
        steps.append((await sub1.next()).step)
    assert steps == sorted(steps) and steps[0] > received
    await head.close()
    await sub1.close()


# ---- the delivery buffers themselves ---------------------------------------------------------


def _delivery(step: int, size: int = 0) -> stage_pb2.Delivery:
    delivery = stage_pb2.Delivery(step=step, layers=common_pb2.LayerRange(start=2, end=3))
    if size:
        delivery.response.output.data = b"x" * size
    return delivery


async def test_delivery_buffers_are_bounded_per_subscriber_and_per_node() -> None:
    limits = RelayLimits(
        delivery_buffer=3, delivery_buffer_bytes=10_000, deliveries_total_bytes=15_000
    )
    hub = DeliveryHub(limits)
    a, b, c = (hub.subscribe(s, 8) for s in "abc")
    assert all(isinstance(sub, Subscriber) for sub in (a, b, c))
    # Count: the fourth unread delivery ends the subscription, and frees what it held.
    assert all(hub.deliver("a", _delivery(step)) for step in (1, 2, 3))
    assert not hub.deliver("a", _delivery(4))
    with pytest.raises(SubscriptionEnded) as err:
        await a.next()
    assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "(steps 1..4) were dropped" in err.value.message
    assert not hub.deliver("a", _delivery(5)), "no subscriber until the client subscribes again"
    assert hub.buffered_bytes == 0
    # Bytes per subscriber: an empty buffer takes one delivery, however large.
    assert hub.deliver("b", _delivery(1, 12_000))
    assert not hub.deliver("b", _delivery(2, 10))
    assert hub.buffered_bytes == 0
    # Bytes per node: c's second delivery would pass the node's 15 000.
    assert hub.deliver("b", _delivery(1, 12_000)) is False  # b was ended above
    b2 = hub.subscribe("b", 8)
    assert hub.deliver("b", _delivery(3, 9_000))
    assert hub.deliver("c", _delivery(1, 5_000))
    assert not hub.deliver("c", _delivery(2, 2_000))
    assert (await b2.next()).step == 3
    assert hub.buffered_bytes == 0
    for sub in (a, b, b2, c):
        hub.release(sub)
    assert hub.subscribers() == 0


async def test_a_replacement_takes_over_what_was_not_sent_and_replacements_are_bounded() -> None:
    hub = DeliveryHub(RelayLimits())
    older = hub.subscribe("s", 8)
    assert hub.deliver("s", _delivery(1)) and hub.deliver("s", _delivery(2))
    newer = hub.subscribe("s", 8)
    assert await older.next() is None  # ended cleanly
    assert [(await newer.next()).step, (await newer.next()).step] == [1, 2]
    # Two streams of the session are still running (the older has not returned): a client
    # that keeps subscribing without reading cannot pile up more.
    assert "has 2 delivery streams here" in hub.subscribe("s", 8)
    hub.release(older)
    third = hub.subscribe("s", 8)
    assert isinstance(third, Subscriber)
    assert "delivery subscriptions, its limit" in hub.subscribe("t", 1)
    hub.release(newer)
    hub.release(third)
    assert isinstance(hub.subscribe("t", 1), Subscriber)
