"""Pushed steps over real stage servers: nodes hand hidden states on, the client verifies.

The driver sends each step to the first stage only; every later node gets its input from
the node before it and answers on the client's Deliveries subscription. Output must equal
the whole model, through a killed node, a node without the push protocol, and a node whose
pushed input differs from what the node before it signed.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest
from data_plane.stage_harness import MODEL, cut_link, reference_greedy, session_grant
from data_plane.test_driver import NEW_TOKENS, PROMPT, greedy
from data_plane.test_ring import CountsCalls, paid_nodes

from client.driver import RELAY_BREAKS_TO_STOP, DriverConfig, PipelineDriver
from node_agent.stage_server import StageServicer
from protos.tessera.v1 import stage_pb2


class NoDeliveries(StageServicer):
    """A node from before the push pipeline: it has no Deliveries to offer."""

    async def Deliveries(self, request, context):  # noqa: N802
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "Method not implemented!")
        yield stage_pb2.Delivery()  # pragma: no cover - makes this an async generator


class DeliveriesLater(StageServicer):
    """Refuses its first Deliveries subscription as a busy node would, then serves."""

    refused = 0

    async def Deliveries(self, request, context):  # noqa: N802
        if not self.refused:
            self.refused += 1
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "too many subscriptions")
        async for delivery in super().Deliveries(request, context):
            yield delivery


class TamperedHandOff(StageServicer):
    """Runs pushed inputs with one value changed: what a node sees when the node before it
    hands on something other than the output it signed."""

    async def _forward_one(self, request, stream):
        if request.relayed:
            data = bytearray(request.input.data)
            data[0] ^= 0x40
            request.input.data = bytes(data)
        return await super()._forward_one(request, stream)


async def test_pushed_steps_match_the_whole_model(start_node, keys, checkpoint) -> None:
    a = await start_node([(0, 2)])
    b = await start_node([(2, 3)])
    c = await start_node([(3, 4)])
    driver = PipelineDriver(
        session_grant(keys, [(0, 2, a, []), (2, 3, b, []), (3, 4, c, [])]), MODEL
    )
    tokens = await greedy(driver, PROMPT, NEW_TOKENS)

    assert tokens == reference_greedy(checkpoint, PROMPT, NEW_TOKENS)
    assert driver.push_off is None
    assert driver.pushed_steps == NEW_TOKENS  # the prefill and every decode step
    assert driver.failovers == []
    # Every node's answer reached the client: signed, recorded, timed.
    for node in (a, b, c):
        assert len([t for t in driver.timings if t.node_id == node.node_id]) == NEW_TOKENS
    assert len(driver.receipts) == 3 * NEW_TOKENS
    await driver.close()


async def test_consecutive_stages_on_one_node_are_pushed_without_a_network_hop(
    start_node, keys, checkpoint
) -> None:
    # Kept as separate stages (as when each is checked on its own): a hands the first
    # stage's output to its second stage in-process, and answers both.
    a = await start_node([(0, 2), (2, 3)])
    c = await start_node([(3, 4)])
    layout = [(0, 2, a, []), (2, 3, a, []), (3, 4, c, [])]
    config = DriverConfig(merge_same_node_hops=False)
    driver = PipelineDriver(session_grant(keys, layout), MODEL, config=config)
    assert [(h.start, h.end) for h in driver.route] == [(0, 2), (2, 3), (3, 4)]

    assert await greedy(driver, PROMPT, NEW_TOKENS) == reference_greedy(
        checkpoint, PROMPT, NEW_TOKENS
    )
    assert driver.push_off is None
    assert driver.pushed_steps == NEW_TOKENS
    assert len(driver.receipts) == 3 * NEW_TOKENS  # every stage answered and signed
    assert a.servicer._relay.links() == [(driver.session_id, c.address)]
    await driver.close()


async def test_a_node_killed_mid_push_fails_over(start_node, keys, checkpoint) -> None:
    a = await start_node([(0, 2)])
    b = await start_node([(2, 3)])
    b_alt = await start_node([(2, 4)])
    c = await start_node([(3, 4)])
    grant = session_grant(keys, [(0, 2, a, []), (2, 3, b, [b_alt]), (3, 4, c, [])])
    driver = PipelineDriver(grant, MODEL)

    tokens = await greedy(driver, PROMPT, NEW_TOKENS, after_step={3: lambda: b.server.stop(0)})

    assert tokens == reference_greedy(checkpoint, PROMPT, NEW_TOKENS)
    [event] = driver.failovers
    assert (event.failed_node_id, event.replacement_node_ids) == (b.node_id, (b_alt.node_id,))
    assert event.replayed_tokens == len(PROMPT) + 4
    assert [h.node_id for h in driver.route] == [a.node_id, b_alt.node_id, c.node_id]
    # The steps after the fail-over are pushed again, through the alternate.
    assert driver.push_off is None
    assert driver.pushed_steps == NEW_TOKENS - 1
    late = [t for t in driver.timings if t.node_id == b_alt.node_id and not t.replay]
    assert len(late) == NEW_TOKENS - 5
    await driver.close()


async def test_a_node_without_deliveries_is_driven_hop_by_hop(start_node, keys, checkpoint) -> None:
    a = await start_node([(0, 2)])
    b = await start_node([(2, 4)], servicer_class=NoDeliveries)
    driver = PipelineDriver(session_grant(keys, [(0, 2, a, []), (2, 4, b, [])]), MODEL)

    expected = reference_greedy(checkpoint, PROMPT, NEW_TOKENS)
    assert await greedy(driver, PROMPT, NEW_TOKENS) == expected
    assert driver.push_off is not None and "UNIMPLEMENTED" in driver.push_off
    assert driver.pushed_steps == 0
    await driver.close()


async def test_a_hand_off_other_than_the_signed_output_is_caught(
    start_node, keys, checkpoint
) -> None:
    a = await start_node([(0, 2)])
    b = await start_node([(2, 4)], servicer_class=TamperedHandOff)
    driver = PipelineDriver(session_grant(keys, [(0, 2, a, []), (2, 4, b, [])]), MODEL)

    # The client's own copy of a's signed output goes to b instead: the output is right.
    expected = reference_greedy(checkpoint, PROMPT, NEW_TOKENS)
    assert await greedy(driver, PROMPT, NEW_TOKENS) == expected
    assert driver.push_off is not None and "other than the one node" in driver.push_off
    assert driver.pushed_steps == 0  # the first step's hand-off was caught; no more pushes
    assert driver.failovers == []  # b itself did nothing wrong: it is still the route
    await driver.close()


async def test_push_can_be_turned_off(start_node, keys, checkpoint) -> None:
    a = await start_node([(0, 2)])
    b = await start_node([(2, 4)])
    grant = session_grant(keys, [(0, 2, a, []), (2, 4, b, [])])
    driver = PipelineDriver(grant, MODEL, config=DriverConfig(push=False))

    expected = reference_greedy(checkpoint, PROMPT, NEW_TOKENS)
    assert await greedy(driver, PROMPT, NEW_TOKENS) == expected
    assert driver.pushed_steps == 0 and driver.push_off == "turned off"
    await driver.close()


async def test_a_node_whose_subscription_failed_is_asked_again_later(
    start_node, keys, checkpoint
) -> None:
    a = await start_node([(0, 2)])
    b = await start_node([(2, 4)], servicer_class=DeliveriesLater)
    grant = session_grant(keys, [(0, 2, a, []), (2, 4, b, [])])
    driver = PipelineDriver(grant, MODEL, config=DriverConfig(push_retry_steps=3))

    expected = reference_greedy(checkpoint, PROMPT, NEW_TOKENS)
    assert await greedy(driver, PROMPT, NEW_TOKENS) == expected
    # Steps 1-3 went hop by hop (b refused), from step 4 on every step was pushed.
    assert b.servicer.refused == 1
    assert driver.push_off is None
    assert driver.pushed_steps == NEW_TOKENS - 3
    await driver.close()


class ClaimsEveryRelayFailed(StageServicer):
    """Hands every step on, yet says in each answer that it could not, at great length;
    with ``answer_after_s``, answers that late (the next node's answer comes first)."""

    answer_after_s = 0.0

    async def _forward_one(self, request, stream):
        response = await super()._forward_one(request, stream)
        if response is not None and request.relay_to:
            response.relay_failed = "no! " * 250_000
            if self.answer_after_s:
                await asyncio.sleep(self.answer_after_s)
        return response


class ClaimsLate(ClaimsEveryRelayFailed):
    answer_after_s = 0.3


@pytest.mark.parametrize(
    "liar", [ClaimsEveryRelayFailed, ClaimsLate], ids=["answers-first", "answers-last"]
)
async def test_a_node_that_claims_its_hand_offs_failed_only_costs_the_push(
    start_node, keys, checkpoint, liar: type[ClaimsEveryRelayFailed]
) -> None:
    # "answers-last": the next node's answer to the step handed on reaches the client
    # before the claim does (CI once saw it so by chance), and must still count.
    a = await start_node([(0, 2)], servicer_class=liar)
    b = await start_node([(2, 4)], servicer_class=CountsCalls)
    grant = session_grant(keys, [(0, 2, a, []), (2, 4, b, [])])
    driver = PipelineDriver(grant, MODEL, config=NO_WAITING)

    expected = reference_greedy(checkpoint, PROMPT, NEW_TOKENS)
    assert await greedy(driver, PROMPT, NEW_TOKENS) == expected
    # Its claim is believed (a node that does not hand on costs what it would if it said
    # nothing, a deadline), and quoted cut short. Nobody was failed over.
    assert driver.failovers == [] and driver.pushed_steps == 0
    assert driver.push_off is not None and len(driver.push_off) < 500
    assert "'no! no! no!" in driver.push_off
    assert len([t for t in driver.timings if t.node_id == b.node_id]) == NEW_TOKENS
    await driver.close()
    # b ran some steps twice: the one a handed on after all, and the client's. Its receipt
    # counts both, and the client signs it: b is paid for all the work it did.
    assert b.servicer.relayed >= 1
    assert paid_nodes(driver) == {a.node_id, b.node_id}


# A straggler deadline far below the default: were a broken hand-off waited out, the prompt
# step would fail b over (and, with no alternate, the generation) within it.
NO_WAITING = DriverConfig(cold_timeout_s=10.0)


@pytest.mark.parametrize("cut", [0, 1], ids=["first-to-second", "second-to-last"])
async def test_a_node_that_cannot_reach_the_next_hands_the_steps_back(
    start_node, keys, checkpoint, cut
) -> None:
    nodes = [await start_node([(0, 2)]), await start_node([(2, 3)]), await start_node([(3, 4)])]
    a, b, c = nodes
    sender, unreached = nodes[cut], nodes[cut + 1]
    cut_link(sender, unreached)
    grant = session_grant(keys, [(0, 2, a, []), (2, 3, b, []), (3, 4, c, [])])
    driver = PipelineDriver(grant, MODEL, config=NO_WAITING)

    expected = reference_greedy(checkpoint, PROMPT, NEW_TOKENS)
    assert await greedy(driver, PROMPT, NEW_TOKENS) == expected
    # Each failed hand-off was named in the sender's answer and the client sent the step
    # on itself at once; after a few in a row the session stopped pushing. Nobody was
    # failed over, and every node answered every step.
    assert driver.failovers == []
    assert driver.pushed_steps == 0
    assert driver.push_off is not None
    assert f"{RELAY_BREAKS_TO_STOP} pushes in a row could not be handed on" in driver.push_off
    assert (
        f"node {sender.node_id} to node {unreached.node_id}: 'sending failed: UNAVAILABLE"
        in driver.push_off
    )
    for node in nodes:
        assert len([t for t in driver.timings if t.node_id == node.node_id]) == NEW_TOKENS
    await driver.close()


async def test_one_broken_hand_off_costs_one_step_of_pushing(start_node, keys, checkpoint) -> None:
    a = await start_node([(0, 2)])
    b = await start_node([(2, 4)])
    cut_link(a, b)
    driver = PipelineDriver(session_grant(keys, [(0, 2, a, []), (2, 4, b, [])]), MODEL,
                            config=NO_WAITING)  # fmt: skip

    async def mend() -> None:  # the next relay opens a link on a channel of its own
        await a.servicer._relay._channels.pop(b.address).close()

    expected = reference_greedy(checkpoint, PROMPT, NEW_TOKENS)
    assert await greedy(driver, PROMPT, NEW_TOKENS, after_step={0: mend}) == expected
    assert driver.failovers == [] and driver.push_off is None
    assert driver.pushed_steps == NEW_TOKENS - 1  # all but the prompt's step
    await driver.close()
