"""The ring: the node that ends the model draws the next token and starts its step itself.

Real stage servers on loopback (see stage_harness). Node side: a call with ``ring`` makes
the last node relay its drawn token to the ring's first hop, for as many steps as the ring
holds, and every ring the capability does not allow is refused before anything is
computed. Client side: the driver adopts each step a ring started once the first node's
signed input digest says it ran the client's own token; a ring that drew another token, or
whose step never came, ends for the session and the client sends the step itself. Output
always equals the whole model's.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import grpc
import numpy as np
import pytest
from data_plane.stage_harness import (
    HIDDEN,
    MODEL,
    NUM_LAYERS,
    StageNode,
    cut_link,
    reference_greedy,
    reference_logits,
    session_grant,
)
from data_plane.test_driver import NEW_TOKENS
from data_plane.test_relay import (
    Pipeline,
    Stream,
    Subscription,
    ids,
    pipeline,
    relay_hop,
    request,
    three_nodes,
)

from client.driver import DriverConfig, PipelineDriver, RingPlan
from client.sampling import Sampler
from node_agent.stage_server import MAX_STOP_IDS, StageServicer
from protos import codec, identity, output_check
from protos.sampling import SamplingParams, draw_at
from protos.tessera.v1 import common_pb2, ledger_pb2, stage_pb2

GREEDY = SamplingParams()
# The tiny model's greedy tokens from it differ from one another (many prompts give one
# token over and over, which would hide a ring that starts a step with a stale token).
PROMPT = [2, 40, 17, 33, 5, 60]


def ring(p: Pipeline, steps: int, **fields: object) -> stage_pb2.RingContinuation:
    n0, n1, n2 = p.nodes
    message = stage_pb2.RingContinuation(
        route=[relay_hop(n0, 0, 2), relay_hop(n1, 2, 3), relay_hop(n2, 3, NUM_LAYERS)],
        steps=steps,
        top_p=1.0,
        origin_step=1,  # the prefill's step, which starts every ring here
    )
    for name, value in fields.items():
        if name == "route":
            del message.route[:]
            message.route.extend(value)  # type: ignore[arg-type]
        elif name == "stop_token_ids":
            message.stop_token_ids.extend(value)  # type: ignore[arg-type]
        else:
            setattr(message, name, value)
    return message


def chain_of(tokens: list[int]) -> bytes:
    """The input digest a first node signs after running these token ids in one session."""
    digest = None
    for token in tokens:
        [digest] = output_check.input_chain(digest, np.array([[token]], np.int64), "int64")
    assert digest is not None
    return digest


# ---- node side --------------------------------------------------------------------------------


async def test_the_last_node_draws_each_token_and_starts_its_step(
    start_node, keys, checkpoint
) -> None:
    nodes = await three_nodes(start_node)
    n0, n1, n2 = nodes
    p = pipeline(keys, nodes, "s-ring")
    subs = [await Subscription.open(n, p.session_id, p.signed) for n in nodes]
    first = Stream(n0)
    prefill = request(
        p.session_id, 1, 0, 2, ids(PROMPT), relay_to=p.route, last_position_only=True,
        signed=p.signed,
    )  # fmt: skip
    prefill.ring.CopyFrom(ring(p, steps=3))
    own = await first.send(prefill)
    assert own.cache_length == len(PROMPT)

    expected = reference_greedy(checkpoint, PROMPT, 4)
    tokens = list(PROMPT)
    for step in range(1, 5):
        if step > 1:
            # The ring's step at the first node: run on the token the last node drew,
            # answered on the client's subscription there.
            started = await subs[0].next()
            assert (started.step, started.response.cache_length) == (step, len(tokens))
            assert started.response.input_digest == chain_of(tokens)
        assert (await subs[1].next()).step == step
        last = await subs[2].next()
        assert last.step == step and not last.error_message
        logits = codec.decode(last.response.output)
        np.testing.assert_allclose(
            logits[0, -1], reference_logits(checkpoint, tokens)[-1], atol=1e-4
        )
        tokens.append(int(np.argmax(logits[0, -1])))
    assert tokens[len(PROMPT) :] == expected
    # Three steps started, as the ring allowed, and no more.
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(subs[0].call.read(), 0.5)
    await first.close()
    for sub in subs:
        await sub.close()


async def test_a_ring_stops_at_a_stop_token(start_node, keys, checkpoint) -> None:
    nodes = await three_nodes(start_node)
    p = pipeline(keys, nodes, "s-ring-stop")
    subs = [await Subscription.open(n, p.session_id, p.signed) for n in nodes]
    first = Stream(nodes[0])
    [t0, t1] = reference_greedy(checkpoint, PROMPT, 2)
    prefill = request(
        p.session_id, 1, 0, 2, ids(PROMPT), relay_to=p.route, last_position_only=True,
        signed=p.signed,
    )  # fmt: skip
    prefill.ring.CopyFrom(ring(p, steps=10, stop_token_ids=[t1]))
    await first.send(prefill)
    assert (await subs[2].next()).step == 1
    assert (await subs[0].next()).response.input_digest == chain_of([*PROMPT, t0])
    assert (await subs[2].next()).step == 2  # whose logits draw t1: the end
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(subs[0].call.read(), 0.5)
    await first.close()
    for sub in subs:
        await sub.close()


@dataclass(frozen=True)
class BadRing:
    name: str
    fields: Callable[[Pipeline], dict[str, object]]
    code: grpc.StatusCode
    message: str
    batch: int = 1
    last_position_only: bool = True


BAD_RINGS = [
    BadRing(
        "a hop the capability does not grant",
        lambda p: {
            "route": [
                relay_hop(p.nodes[0], 0, 2, node_id="n-stranger"),
                relay_hop(p.nodes[1], 2, 3),
                relay_hop(p.nodes[2], 3, NUM_LAYERS),
            ]
        },
        grpc.StatusCode.PERMISSION_DENIED,
        "is not a hop the capability grants",
    ),
    BadRing(
        "a route that does not start at layer 0",
        lambda p: {"route": [relay_hop(p.nodes[1], 2, 3), relay_hop(p.nodes[2], 3, NUM_LAYERS)]},
        grpc.StatusCode.INVALID_ARGUMENT,
        "ring.route[0]",
    ),
    BadRing(
        "a route that stops before the last layer",
        lambda p: {"route": [relay_hop(p.nodes[0], 0, 2), relay_hop(p.nodes[1], 2, 3)]},
        grpc.StatusCode.INVALID_ARGUMENT,
        "a ring must cover the whole model",
    ),
    BadRing(
        "no route",
        lambda p: {"route": []},
        grpc.StatusCode.INVALID_ARGUMENT,
        "ring.route has 0 hops",
    ),
    BadRing(
        "a route of too many hops",
        lambda p: {"route": [relay_hop(p.nodes[0], 0, 2)] * 17},
        grpc.StatusCode.INVALID_ARGUMENT,
        "ring.route has 17 hops",
    ),
    BadRing(
        "every position's logits",
        lambda p: {},
        grpc.StatusCode.INVALID_ARGUMENT,
        "needs last_position_only and a batch of 1",
        last_position_only=False,
    ),
    BadRing(
        "a batch of two",
        lambda p: {},
        grpc.StatusCode.INVALID_ARGUMENT,
        "(got batch 2)",
        batch=2,
    ),
    BadRing(
        "more steps than the session's budget",
        lambda p: {"steps": 129},
        grpc.StatusCode.INVALID_ARGUMENT,
        "exceeds the session's budget of 128",
    ),
    BadRing(
        "a ring that began after this step",
        lambda p: {"origin_step": 2},
        grpc.StatusCode.INVALID_ARGUMENT,
        "ring.origin_step 2 is after this step (1)",
    ),
    BadRing(
        "too many stop tokens",
        lambda p: {"stop_token_ids": list(range(MAX_STOP_IDS + 1))},
        grpc.StatusCode.INVALID_ARGUMENT,
        f"at most {MAX_STOP_IDS} are accepted",
    ),
    BadRing(
        "a temperature that is not a number",
        lambda p: {"temperature": float("nan")},
        grpc.StatusCode.INVALID_ARGUMENT,
        "ring: temperature must be >= 0",
    ),
    BadRing(
        "a negative temperature",
        lambda p: {"temperature": -1.0},
        grpc.StatusCode.INVALID_ARGUMENT,
        "ring: temperature must be >= 0",
    ),
    BadRing(
        "a seed past what a draw takes",
        lambda p: {"seed": 2**64 - 1},
        grpc.StatusCode.INVALID_ARGUMENT,
        "ring: seed must be in [0, 9223372036854775807]",
    ),
    BadRing(
        "top_p of zero",
        lambda p: {"top_p": 0.0},
        grpc.StatusCode.INVALID_ARGUMENT,
        "ring: top_p must be in (0, 1]",
    ),
]


@pytest.mark.parametrize("case", BAD_RINGS, ids=[c.name for c in BAD_RINGS])
async def test_a_bad_ring_is_refused_before_computing(start_node, keys, case) -> None:
    nodes = await three_nodes(start_node)
    n0, _, n2 = nodes
    p = pipeline(keys, nodes, "s-bad-ring")
    bad = request(
        p.session_id, 1, 0, 2, ids(PROMPT, batch=case.batch), relay_to=p.route,
        last_position_only=case.last_position_only, signed=p.signed,
    )  # fmt: skip
    bad.ring.CopyFrom(ring(p, **{"steps": 2, **case.fields(p)}))
    stream = Stream(n0)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stream.send(bad)
    assert err.value.code() == case.code, err.value.details()
    assert case.message in (err.value.details() or "")
    await stream.close()
    assert n0.manager.active_sessions() == 0, "refused before it computed anything"

    # The node keeps serving the same session, with a ring it may run.
    sub2 = await Subscription.open(n2, p.session_id, p.signed)
    good = request(
        p.session_id, 2, 0, 2, ids(PROMPT), relay_to=p.route, last_position_only=True,
        signed=p.signed,
    )  # fmt: skip
    good.ring.CopyFrom(ring(p, steps=0))
    stream = Stream(n0)
    assert (await stream.send(good)).cache_length == len(PROMPT)
    assert (await sub2.next()).response.cache_length == len(PROMPT)
    await stream.close()
    await sub2.close()


async def test_a_ring_on_a_hop_that_does_not_end_the_model_is_refused(start_node, keys) -> None:
    # Only logits can be drawn from: a middle hop asked to run a ring is refused whatever
    # else the call asks, and computes nothing.
    nodes = await three_nodes(start_node)
    middle = nodes[1]
    p = pipeline(keys, nodes, "s-ring-middle")
    hidden = codec.encode(np.zeros((1, len(PROMPT), HIDDEN), dtype=np.float32))
    for last_position_only, message in (
        (False, "needs last_position_only"),
        (True, "set it only on the hop that ends there"),
    ):
        call = request(
            p.session_id, 1, 2, 3, hidden, last_position_only=last_position_only, signed=p.signed
        )
        call.ring.CopyFrom(ring(p, steps=2))
        stream = Stream(middle)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stream.send(call)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert message in (err.value.details() or "")
        await stream.close()
    assert middle.manager.active_sessions() == 0


# ---- client side: the driver adopts what the ring started ------------------------------------


class RingDrawsAnother(StageServicer):
    """Hands on the runner-up token instead of the one its signed logits give: the client,
    which draws from those logits itself, must not use the ring's step."""

    async def _ring_on(self, request, output, stream, tokens):
        logits = np.frombuffer(output.data, dtype=np.float32).copy()
        logits[int(np.argmax(logits))] = -np.inf
        forged = common_pb2.Tensor()
        forged.CopyFrom(output)
        forged.data = logits.tobytes()
        await super()._ring_on(request, forged, stream, tokens)


class RingDrawsAnotherOnce(RingDrawsAnother):
    """Draws another token the first time only, as after a glitch."""

    async def _ring_on(self, request, output, stream, tokens):
        if getattr(self, "glitched", False):
            return await StageServicer._ring_on(self, request, output, stream, tokens)
        self.glitched = True
        await super()._ring_on(request, output, stream, tokens)


class RingNeverStarts(StageServicer):
    """Never starts the ring's next step (as an older node, or one that drops it)."""

    async def _ring_on(self, request, output, stream, tokens):
        return


class CountsCalls(StageServicer):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.direct = self.relayed = 0

    async def _forward_one(self, request, stream):
        if request.relayed:
            self.relayed += 1
        else:
            self.direct += 1
        return await super()._forward_one(request, stream)


async def ring_nodes(start_node, last_class: type = StageServicer) -> list[StageNode]:
    return [
        await start_node([(0, 2)], servicer_class=CountsCalls),
        await start_node([(2, 3)]),
        await start_node([(3, NUM_LAYERS)], servicer_class=last_class),
    ]


def ring_driver(keys, nodes: list[StageNode], **config: object) -> PipelineDriver:
    a, b, c = nodes
    grant = session_grant(keys, [(0, 2, a, []), (2, 3, b, []), (3, NUM_LAYERS, c, [])])
    return PipelineDriver(grant, MODEL, config=DriverConfig(**config))  # type: ignore[arg-type]


def paid_nodes(driver: PipelineDriver) -> set[str]:
    """Nodes whose usage receipt the client counter-signs: a receipt that counts more than
    the client knows the node ran is left unsigned, and the node goes unpaid."""
    signed = driver.usage.countersign(driver.session_id, identity.generate_private_key())
    return {usage_node(u) for u in signed}


def usage_node(usage: ledger_pb2.SignedUsage) -> str:
    receipt = ledger_pb2.UsageReceipt()
    receipt.ParseFromString(usage.receipt)
    return receipt.node_id


async def generate(
    driver: PipelineDriver,
    new_tokens: int,
    params: SamplingParams = GREEDY,
    stop_ids: tuple[int, ...] = (),
    after_token: Callable[[int], Awaitable[None]] | None = None,
) -> list[int]:
    """As Client.generate steps the driver: each step hands the ring the steps still to go,
    and the client draws every token itself. ``after_token(n)`` runs once n tokens are out."""
    sampler = Sampler(params)
    inputs, out = list(PROMPT), []
    while True:
        plan = RingPlan(sampler.params, new_tokens - len(out) - 1, stop_ids)
        logits = await driver.step(inputs, last_only=True, ring=plan)
        out.append(sampler(logits[0], driver.length))
        if after_token is not None:
            await after_token(len(out))
        if len(out) == new_tokens:
            return out
        inputs = [out[-1]]


async def test_the_client_adopts_every_step_the_ring_started(start_node, keys, checkpoint) -> None:
    nodes = await ring_nodes(start_node)
    driver = ring_driver(keys, nodes)

    assert await generate(driver, NEW_TOKENS) == reference_greedy(checkpoint, PROMPT, NEW_TOKENS)
    assert driver.ring_off is None
    assert driver.ring_steps == NEW_TOKENS - 1  # every step after the prefill
    assert driver.pushed_steps == NEW_TOKENS
    # The client sent the first node the prefill only; the last node started the rest.
    first = nodes[0].servicer
    assert (first.direct, first.relayed) == (1, NEW_TOKENS - 1)
    # Every node's answer still reached the client: signed, recorded, timed.
    assert len(driver.receipts) == 3 * NEW_TOKENS
    assert driver.failovers == []
    await driver.close()
    assert paid_nodes(driver) == {n.node_id for n in nodes}


async def test_a_ring_at_a_temperature_draws_the_clients_tokens(
    start_node, keys, checkpoint
) -> None:
    nodes = await ring_nodes(start_node)
    driver = ring_driver(keys, nodes)
    params = SamplingParams(temperature=1.3, top_p=0.95, seed=2024)

    tokens = await generate(driver, NEW_TOKENS, params)
    sequence = list(PROMPT)
    for _ in range(NEW_TOKENS):
        sequence.append(draw_at(reference_logits(checkpoint, sequence)[-1], params, len(sequence)))
    assert tokens == sequence[len(PROMPT) :]
    assert driver.ring_off is None and driver.ring_steps == NEW_TOKENS - 1
    await driver.close()


async def test_a_ring_that_draws_another_token_is_not_used(start_node, keys, checkpoint) -> None:
    nodes = await ring_nodes(start_node, RingDrawsAnother)
    driver = ring_driver(keys, nodes)

    assert await generate(driver, NEW_TOKENS) == reference_greedy(checkpoint, PROMPT, NEW_TOKENS)
    assert driver.ring_off is not None and "another token" in driver.ring_off
    assert driver.ring_steps == 0  # caught at the first step it started
    # Nobody is failed over for it. That step went hop by hop from the first node, and
    # the steps after it are pushed by the client again: the ring's next steps, which the
    # last node still started, are dropped by the first node, not run into the pipeline.
    assert driver.failovers == []
    assert driver.push_off is None and driver.pushed_steps == NEW_TOKENS - 1
    await driver.close()
    # The ring's spoilt steps still ran on every node, and each is paid for them.
    assert paid_nodes(driver) == {n.node_id for n in nodes}


async def test_a_new_ring_starts_some_steps_after_one_ended_early(
    start_node, keys, checkpoint
) -> None:
    nodes = await ring_nodes(start_node, RingDrawsAnotherOnce)
    driver = ring_driver(keys, nodes, ring_retry_steps=3)

    assert await generate(driver, NEW_TOKENS) == reference_greedy(checkpoint, PROMPT, NEW_TOKENS)
    assert driver.ring_off is not None and "another token" in driver.ring_off
    # The ring ended at the first step it started (the 2nd token's), which the client
    # sent again; the 3rd to 5th tokens' steps went without a ring; the 6th token's step
    # started a new one, which started the steps of the last 4.
    assert driver.ring_steps == NEW_TOKENS - 6
    assert nodes[0].servicer.relayed >= driver.ring_steps + 1  # the spoilt step ran too
    assert driver.failovers == []
    await driver.close()
    assert paid_nodes(driver) == {n.node_id for n in nodes}


async def test_a_ring_whose_step_never_comes_costs_one_short_wait(
    start_node, keys, checkpoint
) -> None:
    nodes = await ring_nodes(start_node, RingNeverStarts)
    driver = ring_driver(keys, nodes, ring_wait_floor_s=0.2)

    assert await generate(driver, NEW_TOKENS) == reference_greedy(checkpoint, PROMPT, NEW_TOKENS)
    assert driver.ring_off is not None and "not back within" in driver.ring_off
    assert driver.ring_steps == 0
    assert driver.failovers == []
    first = nodes[0].servicer
    assert (first.direct, first.relayed) == (NEW_TOKENS, 0)
    await driver.close()
    assert paid_nodes(driver) == {n.node_id for n in nodes}


async def test_a_ring_the_last_node_cannot_start_costs_no_wait(
    start_node, keys, checkpoint
) -> None:
    # The last node cannot reach the first (a firewall between the two): its answer says
    # so, and the client sends the next step itself at once instead of waiting for it.
    nodes = await ring_nodes(start_node)
    cut_link(nodes[2], nodes[0])
    driver = ring_driver(keys, nodes, ring_wait_floor_s=30.0)

    assert await generate(driver, NEW_TOKENS) == reference_greedy(checkpoint, PROMPT, NEW_TOKENS)
    assert driver.ring_off is not None
    assert "could not start the next step: 'sending failed: UNAVAILABLE" in driver.ring_off
    assert driver.ring_steps == 0
    assert driver.failovers == [] and driver.push_off is None
    assert driver.pushed_steps == NEW_TOKENS  # pushing itself was never in the way
    first = nodes[0].servicer
    assert (first.direct, first.relayed) == (NEW_TOKENS, 0)
    await driver.close()
    assert paid_nodes(driver) == {n.node_id for n in nodes}


async def test_the_client_starts_again_after_a_stop_token_it_steps_anyway(
    start_node, keys, checkpoint
) -> None:
    # A caller that goes on past an end-of-sequence id: the ring stopped there, so the
    # client sends that step itself and a new ring starts with it.
    expected = reference_greedy(checkpoint, PROMPT, NEW_TOKENS)
    nodes = await ring_nodes(start_node)
    driver = ring_driver(keys, nodes)

    assert await generate(driver, NEW_TOKENS, stop_ids=(expected[0],)) == expected
    assert driver.ring_off is None
    stops = expected[: NEW_TOKENS - 1].count(expected[0])
    assert stops == 2  # the prefill's token, and once more later
    assert driver.ring_steps == NEW_TOKENS - 1 - stops
    first = nodes[0].servicer
    assert (first.direct, first.relayed) == (1 + stops, NEW_TOKENS - 1 - stops)
    await driver.close()


async def test_a_node_killed_mid_ring_fails_over_and_the_ring_ends(
    start_node, keys, checkpoint
) -> None:
    a = await start_node([(0, 2)])
    b = await start_node([(2, 3)])
    b_alt = await start_node([(2, 4)])
    c = await start_node([(3, NUM_LAYERS)])
    grant = session_grant(keys, [(0, 2, a, []), (2, 3, b, [b_alt]), (3, NUM_LAYERS, c, [])])
    driver = PipelineDriver(grant, MODEL)

    async def kill_b(tokens: int) -> None:
        if tokens == 4:
            await b.server.stop(0)

    out = await generate(driver, NEW_TOKENS, after_token=kill_b)
    assert out == reference_greedy(checkpoint, PROMPT, NEW_TOKENS)
    [event] = driver.failovers
    assert (event.failed_node_id, event.replacement_node_ids) == (b.node_id, (b_alt.node_id,))
    assert driver.ring_off is not None
    assert 3 <= driver.ring_steps < NEW_TOKENS - 1
    await driver.close()


async def test_one_node_serving_the_whole_model_goes_round_a_ring_by_itself(
    start_node, keys, checkpoint
) -> None:
    # A model that fits one node: the node draws each token and starts the next step on
    # itself, so the client's round trip leaves every token but the first.
    node = await start_node([(0, NUM_LAYERS)], servicer_class=CountsCalls)
    grant = session_grant(keys, [(0, NUM_LAYERS, node, [])])
    driver = PipelineDriver(grant, MODEL)

    assert await generate(driver, NEW_TOKENS) == reference_greedy(checkpoint, PROMPT, NEW_TOKENS)
    assert driver.ring_off is None and driver.ring_steps == NEW_TOKENS - 1
    assert (node.servicer.direct, node.servicer.relayed) == (1, NEW_TOKENS - 1)
    await driver.close()
    assert paid_nodes(driver) == {node.node_id}
