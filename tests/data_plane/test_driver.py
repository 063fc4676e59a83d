"""PipelineDriver over real stage servers: output equals the whole model, through failures."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import grpc
import numpy as np
import pytest
from data_plane.stage_harness import (
    MODEL,
    OPTIONS,
    FakeCoordinator,
    reference_greedy,
    reference_logits,
    session_grant,
)
from support.link_emulator import LinkEmulator

from client.driver import DriverConfig, PipelineDriver, _Slot
from client.errors import PipelineError, RequestRejected
from client.records import HopRecord
from client.route_history import Span
from node_agent.stage_server import StageServicer
from protos.tessera.v1 import (
    client_api_pb2,
    client_api_pb2_grpc,
    common_pb2,
    coordinator_pb2,
    stage_pb2,
    stage_pb2_grpc,
)

PROMPT = [1, 5, 9, 13, 20, 7]
NEW_TOKENS = 10


async def greedy(
    driver: PipelineDriver,
    prompt: list[int],
    new_tokens: int,
    after_step: dict[int, object] | None = None,
) -> list[int]:
    """Greedy decode; ``after_step[i]`` (a coroutine function) runs after token i."""
    logits = await driver.step(prompt, last_only=True)
    out = []
    for index in range(new_tokens):
        token = int(np.argmax(logits[0]))
        out.append(token)
        hook = (after_step or {}).get(index)
        if hook is not None:
            await hook()
        if index + 1 < new_tokens:
            logits = await driver.step([token], last_only=True)
    return out


class HangingServicer(StageServicer):
    """Stops answering (without failing) after ``hang_after`` requests: a straggler."""

    hang_after: int | None = None

    async def _forward_one(self, request, stream):
        self.calls = getattr(self, "calls", 0) + 1
        if self.hang_after is not None and self.calls > self.hang_after:
            await asyncio.Event().wait()
        return await super()._forward_one(request, stream)


@pytest.mark.parametrize("push", [True, False], ids=["pushed", "hop-by-hop"])
async def test_three_hops_match_the_whole_model(start_node, keys, checkpoint, push) -> None:
    a = await start_node([(0, 2)])
    b = await start_node([(2, 3)])
    c = await start_node([(3, 4)])
    driver = PipelineDriver(
        session_grant(keys, [(0, 2, a, []), (2, 3, b, []), (3, 4, c, [])]),
        MODEL,
        config=DriverConfig(push=push),
    )
    assert await greedy(driver, PROMPT, NEW_TOKENS) == reference_greedy(
        checkpoint, PROMPT, NEW_TOKENS
    )
    assert driver.length == len(PROMPT) + NEW_TOKENS - 1
    assert driver.failovers == []
    assert driver.pushed_steps == (NEW_TOKENS if push else 0)
    assert {t.node_id for t in driver.timings} == {a.node_id, b.node_id, c.node_id}
    assert all(t.compute_ms > 0 and t.wall_ms >= t.compute_ms for t in driver.timings)
    if push:
        # Every hop of every pushed step answered the client and was timed.
        steps: dict[int, list[float]] = {}
        for t in driver.timings:
            steps.setdefault(t.step, []).append(t.wall_ms)
        assert all(len(walls) == 3 for walls in steps.values())
    assert len(driver.receipts) == len(driver.timings)
    await driver.close()
    # close() ends the session on every node.
    for node in (a, b, c):
        assert node.manager.active_sessions() == 0


async def test_long_prompts_are_chunked_and_positions_can_roll_back(
    start_node, keys, checkpoint
) -> None:
    a = await start_node([(0, 2)])
    b = await start_node([(2, 4)])
    driver = PipelineDriver(
        session_grant(keys, [(0, 2, a, []), (2, 4, b, [])]),
        MODEL,
        config=DriverConfig(max_chunk_tokens=4),
    )
    prompt = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]
    logits = await driver.step(prompt)
    np.testing.assert_allclose(logits[0], reference_logits(checkpoint, prompt), atol=1e-5)
    assert {t.tokens for t in driver.timings} == {4, 2}
    # Speculative rollback: rewrite the last three positions with other tokens.
    logits = await driver.step([7, 8, 9], start_pos=7)
    expected = reference_logits(checkpoint, [*prompt[:7], 7, 8, 9])[7:]
    np.testing.assert_allclose(logits[0], expected, atol=1e-5)
    assert driver.length == 10
    with pytest.raises(ValueError, match="start_pos 11"):
        await driver.step([1], start_pos=11)
    await driver.close()


async def test_a_stopped_node_fails_over_to_its_alternate(start_node, keys, checkpoint) -> None:
    a = await start_node([(0, 2)])
    b = await start_node([(2, 3)])
    b_alt = await start_node([(2, 4)])  # a wider shard can serve the sub-span
    c = await start_node([(3, 4)])
    grant = session_grant(keys, [(0, 2, a, []), (2, 3, b, [b_alt]), (3, 4, c, [])])
    driver = PipelineDriver(grant, MODEL)

    tokens = await greedy(driver, PROMPT, NEW_TOKENS, after_step={3: lambda: b.server.stop(0)})

    assert tokens == reference_greedy(checkpoint, PROMPT, NEW_TOKENS)
    [event] = driver.failovers
    assert (event.failed_node_id, event.replacement_node_ids) == (b.node_id, (b_alt.node_id,))
    assert (event.start, event.end, event.via) == (2, 3, "alternate")
    assert "UNAVAILABLE" in event.reason
    # The replay carried every position sent to that boundary, the failed step included.
    assert event.replayed_tokens == len(PROMPT) + 4
    assert event.position == len(PROMPT) + 3  # the 5th generated token's input position
    assert event.stalled_ms > 0
    assert [h.node_id for h in driver.route] == [a.node_id, b_alt.node_id, c.node_id]
    await driver.close()


@pytest.mark.parametrize("hop", [0, 1], ids=["first-hop", "pushed-hop"])
async def test_a_connection_reset_costs_no_replay(start_node, keys, checkpoint, hop) -> None:
    # One hop's line resets every connection once (a NAT rebinding), and its node is
    # reached again at once. The first hop's stream broke under the client: the step goes
    # to that node again, alone. A pushed hop's Deliveries stream and the first node's
    # hand-off link broke: the step goes to it directly (the first node names its failed
    # hand-off). Either way no node is replaced and nothing is replayed.
    nodes = [await start_node([(0, 2)]), await start_node([(2, 4)])]
    alternate = await start_node([(0, 2) if hop == 0 else (2, 4)])
    async with LinkEmulator("127.0.0.1", nodes[hop].port, name="the line") as line:
        behind = SimpleNamespace(node_id=nodes[hop].node_id, address=line.address)
        stages = [(0, 2, nodes[0], []), (2, 4, nodes[1], [])]
        stages[hop] = (*stages[hop][:2], behind, [alternate])  # type: ignore[assignment]
        driver = PipelineDriver(session_grant(keys, stages), MODEL)

        async def blip() -> None:
            line.reset()

        tokens = await greedy(driver, PROMPT, NEW_TOKENS, after_step={3: blip})
        assert tokens == reference_greedy(checkpoint, PROMPT, NEW_TOKENS)
        assert line.stats.connections_reset >= 1
        assert [h.node_id for h in driver.route] == [n.node_id for n in nodes]
        assert not [t for t in driver.timings if t.node_id == alternate.node_id]  # never called
        assert all(f.via == "resume" for f in driver.failovers), driver.failovers
        if hop == 0:
            [event] = driver.failovers
            assert (event.failed_node_id, event.replacement_node_ids) == (
                nodes[0].node_id, (nodes[0].node_id,)
            )  # fmt: skip
            assert event.replayed_tokens == 1 and event.position == len(PROMPT) + 3
            assert "UNAVAILABLE" in event.reason
        else:
            assert driver.push_off is None and driver.pushed_steps >= NEW_TOKENS - 2
        await driver.close()


async def test_a_connection_reset_before_a_prompt_chunk_resends_only_that_chunk(
    start_node, keys, checkpoint
) -> None:
    # The prompt comes in two steps (a chat's next turn, a chunked prefill), and the first
    # hop's line resets in between: the second step goes to the same node again, alone,
    # instead of replaying the whole prompt on the alternate.
    nodes = [await start_node([(0, 2)]), await start_node([(2, 4)])]
    alternate = await start_node([(0, 2)])
    async with LinkEmulator("127.0.0.1", nodes[0].port, name="the line") as line:
        behind = SimpleNamespace(node_id=nodes[0].node_id, address=line.address)
        driver = PipelineDriver(
            session_grant(keys, [(0, 2, behind, [alternate]), (2, 4, nodes[1], [])]), MODEL
        )
        await driver.step(PROMPT[:2], last_only=True)
        line.reset()
        logits = await driver.step(PROMPT[2:], last_only=True)
        first = int(np.argmax(logits[0]))
        rest = await greedy_from(driver, first, NEW_TOKENS - 1)
        assert [first, *rest] == reference_greedy(checkpoint, PROMPT, NEW_TOKENS)
        assert line.stats.connections_reset >= 1
        assert not [t for t in driver.timings if t.node_id == alternate.node_id]  # never called
        [event] = driver.failovers
        assert event.via == "resume" and event.replacement_node_ids == (nodes[0].node_id,)
        assert (event.replayed_tokens, event.position) == (len(PROMPT) - 2, 2)
        await driver.close()


async def greedy_from(driver: PipelineDriver, token: int, new_tokens: int) -> list[int]:
    """``new_tokens`` more greedy tokens after ``token``."""
    out = []
    for _ in range(new_tokens):
        logits = await driver.step([token], last_only=True)
        token = int(np.argmax(logits[0]))
        out.append(token)
    return out


async def test_a_node_the_driver_cannot_connect_to_is_reported_at_once(
    start_node, keys, checkpoint
) -> None:
    a = await start_node([(0, 2)])
    b = await start_node([(2, 4)])
    b_alt = await start_node([(2, 4)])
    reports: list[client_api_pb2.StepTimesReport] = []

    async def send(report: client_api_pb2.StepTimesReport) -> client_api_pb2.StepTimesAck:
        reports.append(report)
        return client_api_pb2.StepTimesAck(accepted=len(report.steps))

    grant = session_grant(keys, [(0, 2, a, []), (2, 4, b, [b_alt])])
    # Step times alone would wait for a full batch (256): the report comes from the failure.
    driver = PipelineDriver(
        grant, MODEL, config=DriverConfig(report_every=1000), report_step_times=send
    )

    tokens = await greedy(driver, PROMPT, NEW_TOKENS, after_step={3: lambda: b.server.stop(0)})
    assert tokens == reference_greedy(checkpoint, PROMPT, NEW_TOKENS)
    await asyncio.sleep(0.1)  # the report goes out in the background
    # Before the session's last report (at close): the coordinator dials the node back.
    [report] = reports
    assert list(report.unreachable_node_ids) == [b.node_id]
    assert report.capability == grant.capability
    await driver.close()
    assert all(not r.unreachable_node_ids for r in reports[1:])


async def test_a_straggler_is_replaced_after_its_deadline(start_node, keys, checkpoint) -> None:
    a = await start_node([(0, 2)])
    slow = await start_node([(2, 4)], servicer_class=HangingServicer)
    spare = await start_node([(2, 4)])
    grant = session_grant(keys, [(0, 2, a, []), (2, 4, slow, [spare])])
    # The floor keeps a busy test machine from making a healthy hop look like a straggler.
    # Hedging off: this is the deadline's fail-over (test_hedging.py covers hedges).
    config = DriverConfig(
        deadline_floor_s=1.5, deadline_factor=3.0, min_samples=2, hedge_factor=0.0
    )
    driver = PipelineDriver(grant, MODEL, config=config)

    async def stall() -> None:
        slow.servicer.hang_after = slow.servicer.calls

    tokens = await greedy(driver, PROMPT, NEW_TOKENS, after_step={4: stall})

    assert tokens == reference_greedy(checkpoint, PROMPT, NEW_TOKENS)
    [event] = [e for e in driver.failovers if e.failed_node_id == slow.node_id]
    assert event.via == "alternate" and event.replacement_node_ids == (spare.node_id,)
    assert "straggler: no answer within 1.5 s" in event.reason
    assert event.stalled_ms >= 1500
    await driver.close()


async def test_a_node_hung_right_after_the_prefill_is_replaced_without_the_cold_timeout(
    start_node, keys, checkpoint
) -> None:
    # No decode step was timed yet, so the first one's deadline comes from the prefill
    # (here its 1.5 s floor), not the 120 s cold timeout: a PC gone to sleep after the
    # prompt costs seconds.
    a = await start_node([(0, 2)])
    slow = await start_node([(2, 4)], servicer_class=HangingServicer)
    spare = await start_node([(2, 4)])
    slow.servicer.hang_after = 1  # answers the prefill (one call), then never again
    grant = session_grant(keys, [(0, 2, a, []), (2, 4, slow, [spare])])
    config = DriverConfig(first_decode_floor_s=1.5, hedge_factor=0.0)
    driver = PipelineDriver(grant, MODEL, config=config)

    tokens = await greedy(driver, PROMPT, NEW_TOKENS)

    assert tokens == reference_greedy(checkpoint, PROMPT, NEW_TOKENS)
    [event] = [e for e in driver.failovers if e.failed_node_id == slow.node_id]
    assert event.via == "alternate" and event.replacement_node_ids == (spare.node_id,)
    assert "straggler: no answer within 1.5 s" in event.reason
    await driver.close()


def test_a_chunk_is_estimated_from_the_earlier_ones_scaled_up_to_its_size_and_position():
    slot = _Slot(Span(0, 2), HopRecord("n", "127.0.0.1:1", 0, 2), [])
    assert slot.bulk_estimate(4, 4) is None and slot.bulk_seconds == 0.0
    slot.bulk_calls.append((1.0, 8, 8))  # 8 positions, ending at 8, took 1 s
    assert slot.bulk_estimate(4, 4) == 1.0  # less work, earlier: never below the reference
    assert slot.bulk_estimate(8, 16) == 2.0  # as much work, reading twice the positions
    assert slot.bulk_estimate(16, 24) == 6.0  # twice the work, three times the positions
    slot.bulk_calls.append((0.2, 2, 26))
    assert slot.bulk_estimate(4, 26) == 3.25 and slot.bulk_seconds == 1.0
    slot.forget_timings()  # another node serves the slot: its times say nothing of it
    assert slot.bulk_estimate(4, 4) is None


async def test_a_lower_bound_is_reported_within_the_coordinators_per_entry_limits(keys) -> None:
    node = SimpleNamespace(node_id="n1", address="127.0.0.1:1")
    grant = session_grant(keys, [(0, 4, node, [])], max_tokens=128)
    steps: list[client_api_pb2.StepTime] = []

    async def send(report: client_api_pb2.StepTimesReport) -> client_api_pb2.StepTimesAck:
        steps.extend(report.steps)
        return client_api_pb2.StepTimesAck(accepted=len(report.steps))

    config = DriverConfig(report_every=1000)
    driver = PipelineDriver(grant, MODEL, config=config, report_step_times=send)
    # A checker's unanswered catch-up of 512 positions: more tokens than the session's
    # 128, which the coordinator would refuse, so the same time per token goes instead.
    driver.report_at_least("n1", 0, 4, 512, 8000.0)
    driver.report_at_least("n1", 0, 4, 0, 10.0)  # no work: nothing to say
    await driver.close()
    assert [(s.node_id, s.tokens, s.wall_ms) for s in steps] == [("n1", 128, 2000.0)]


@pytest.mark.parametrize("push", [True, False], ids=["pushed", "hop-by-hop"])
async def test_a_node_hung_mid_prefill_is_replaced_without_the_cold_timeout(
    start_node, keys, checkpoint, push
) -> None:
    # A long prompt goes in chunks; the node answers the first and never the second. That
    # chunk's deadline comes from the first one, scaled up to its size and position (here
    # the 1.5 s floor), not the 120 s cold timeout: a PC gone to sleep mid-prompt costs
    # seconds.
    prompt = [(7 * i + 3) % 50 + 1 for i in range(12)]
    a = await start_node([(0, 2)])
    slow = await start_node([(2, 4)], servicer_class=HangingServicer)
    spare = await start_node([(2, 4)])
    slow.servicer.hang_after = 1  # answers the first chunk, then never again
    grant = session_grant(keys, [(0, 2, a, []), (2, 4, slow, [spare])])
    config = DriverConfig(max_chunk_tokens=4, first_decode_floor_s=1.5, hedge_factor=0.0,
                          push=push)  # fmt: skip
    driver = PipelineDriver(grant, MODEL, config=config)

    tokens = await greedy(driver, prompt, 4)

    assert tokens == reference_greedy(checkpoint, prompt, 4)
    [event] = [e for e in driver.failovers if e.failed_node_id == slow.node_id]
    assert event.via == "alternate" and event.replacement_node_ids == (spare.node_id,)
    assert "straggler: no answer within 1.5 s" in event.reason
    assert slow.servicer.calls == 2
    await driver.close()


async def test_without_alternates_the_coordinator_reroutes_over_a_new_chain(
    start_node, keys, checkpoint
) -> None:
    a = await start_node([(0, 2)])
    b = await start_node([(2, 4)])
    x = await start_node([(2, 3)])
    y = await start_node([(3, 4)])
    coordinator = FakeCoordinator(
        keys, checkpoint, [(0, 2, a, []), (2, 4, b, [])], spares=[(2, 3, x), (3, 4, y)]
    )
    address = await coordinator.start()
    channel = grpc.aio.insecure_channel(address, options=OPTIONS)
    stub = client_api_pb2_grpc.ClientApiStub(channel)
    # The original capability does not grant x and y: only the rerouted one does.
    grant = session_grant(keys, [(0, 2, a, []), (2, 4, b, [])])
    driver = PipelineDriver(grant, MODEL, rerouter=stub.Reroute)

    tokens = await greedy(driver, PROMPT, NEW_TOKENS, after_step={2: lambda: b.server.stop(0)})

    assert tokens == reference_greedy(checkpoint, PROMPT, NEW_TOKENS)
    [event] = driver.failovers
    assert event.via == "reroute"
    assert event.replacement_node_ids == (x.node_id, y.node_id)
    [reroute] = coordinator.reroutes
    assert (reroute.span.start, reroute.span.end) == (2, 4)
    assert list(reroute.exclude_node_ids) == [b.node_id]
    assert [(h.start, h.end) for h in driver.route] == [(0, 2), (2, 3), (3, 4)]
    await driver.close()
    await channel.close()
    await coordinator.stop()


async def test_a_node_that_lost_the_cache_gets_a_replay(start_node, keys, checkpoint) -> None:
    a = await start_node([(0, 2)])
    b = await start_node([(2, 4)])
    grant = session_grant(keys, [(0, 2, a, []), (2, 4, b, [])])
    driver = PipelineDriver(grant, MODEL)

    async def forget() -> None:  # as if b's idle sweep had expired the session
        for shard in b.manager.shards():
            shard.release_all()

    tokens = await greedy(driver, PROMPT, NEW_TOKENS, after_step={5: forget})

    assert tokens == reference_greedy(checkpoint, PROMPT, NEW_TOKENS)
    [event] = driver.failovers
    assert (event.via, event.failed_node_id, event.replacement_node_ids) == (
        "replay",
        b.node_id,
        (b.node_id,),
    )
    await driver.close()


async def test_the_clients_own_mistakes_are_not_retried_elsewhere(start_node, keys) -> None:
    a = await start_node([(0, 4)])
    spare = await start_node([(0, 4)])
    # A capability for another model: every node would refuse it the same way.
    grant = session_grant(keys, [(0, 4, a, [spare])], model="other-model")
    driver = PipelineDriver(grant, MODEL)
    with pytest.raises(RequestRejected) as err:
        await driver.step(PROMPT)
    assert err.value.code == grpc.StatusCode.PERMISSION_DENIED
    assert a.node_id in str(err.value)
    assert driver.failovers == []
    with pytest.raises(ValueError, match="outside the vocabulary"):
        await driver.step([64])
    with pytest.raises(ValueError, match="opened for 128 tokens"):
        await driver.step([1] * 129)
    await driver.close()


async def test_running_out_of_replicas_is_a_clear_error(start_node, keys) -> None:
    a = await start_node([(0, 2)])
    b = await start_node([(2, 4)])
    spare = await start_node([(2, 4)])
    driver = PipelineDriver(session_grant(keys, [(0, 2, a, []), (2, 4, b, [spare])]), MODEL)
    await driver.step(PROMPT)
    await b.server.stop(0)
    await spare.server.stop(0)
    with pytest.raises(PipelineError, match=r"layers \[2, 4\) lost node .* no alternate is left"):
        await driver.step([3])
    await driver.close()


async def test_end_session_reaches_every_node_used(start_node, keys) -> None:
    a = await start_node([(0, 4)])
    driver = PipelineDriver(session_grant(keys, [(0, 4, a, [])]), MODEL)
    await driver.step(PROMPT)
    assert a.manager.active_sessions() == 1
    await driver.close()
    assert a.manager.active_sessions() == 0
    # The node still answers other calls after the session is gone.
    async with grpc.aio.insecure_channel(a.address, options=OPTIONS) as channel:
        reply = await stage_pb2_grpc.StageStub(channel).Ping(stage_pb2.PingRequest(payload=b"1"))
    assert reply.node_id == a.node_id


@contextlib.asynccontextmanager
async def _narrowed_mid_generation(
    start_node, keys, checkpoint, offered_a: tuple[int, int], spare: tuple[int, int]
) -> AsyncIterator[tuple[Any, Any, Any, FakeCoordinator, PipelineDriver]]:
    """a serves [0, 3) with no alternate and b [3, 4); after step 3 a re-plan moves a to
    [0, 2), so a's next call is refused (NOT_FOUND). The coordinator's reroute offers a
    for `offered_a` and a third node holding `spare`. Yields after a greedy generation
    that equals the whole model's."""
    a = await start_node([(0, 3)])
    b = await start_node([(3, 4)])
    third = await start_node([spare])
    coordinator = FakeCoordinator(
        keys, checkpoint, [(0, 3, a, []), (3, 4, b, [])], spares=[(*offered_a, a), (*spare, third)]
    )
    address = await coordinator.start()
    channel = grpc.aio.insecure_channel(address, options=OPTIONS)
    stub = client_api_pb2_grpc.ClientApiStub(channel)
    driver = PipelineDriver(
        session_grant(keys, [(0, 3, a, []), (3, 4, b, [])]), MODEL, rerouter=stub.Reroute
    )

    async def narrow() -> None:
        await a.assign(0, 2)
        await a.manager.drop(
            coordinator_pb2.DropShard(model=MODEL, layers=common_pb2.LayerRange(start=0, end=3))
        )

    tokens = await greedy(driver, PROMPT, NEW_TOKENS, after_step={3: narrow})
    assert tokens == reference_greedy(checkpoint, PROMPT, NEW_TOKENS)
    try:
        yield a, b, third, coordinator, driver
    finally:
        await driver.close()
        await channel.close()
        await coordinator.stop()


async def test_a_node_whose_shard_a_replan_narrowed_keeps_the_part_it_still_holds(
    start_node, keys, checkpoint
) -> None:
    # The node did no wrong: the coordinator routes [0, 3) again, over a's new shard and x.
    async with _narrowed_mid_generation(start_node, keys, checkpoint, (0, 2), (2, 3)) as (
        a, b, x, coordinator, driver,
    ):  # fmt: skip
        [event] = driver.failovers
        assert (event.failed_node_id, event.via) == (a.node_id, "reroute")
        assert event.replacement_node_ids == (a.node_id, x.node_id)
        [reroute] = coordinator.reroutes
        assert list(reroute.exclude_node_ids) == []
        assert [(h.node_id, h.start, h.end) for h in driver.route] == [
            (a.node_id, 0, 2), (x.node_id, 2, 3), (b.node_id, 3, 4)
        ]  # fmt: skip


async def test_a_reroute_back_to_the_node_that_refused_the_span_is_not_taken(
    start_node, keys, checkpoint
) -> None:
    # The coordinator has not heard of a's move yet and offers a for [0, 3) again: the
    # driver asks once more without a, and y takes the span.
    async with _narrowed_mid_generation(start_node, keys, checkpoint, (0, 3), (0, 3)) as (
        a, b, y, coordinator, driver,
    ):  # fmt: skip
        [event] = driver.failovers
        assert (event.failed_node_id, event.via, event.replacement_node_ids) == (
            a.node_id, "reroute", (y.node_id,)
        )  # fmt: skip
        assert [list(r.exclude_node_ids) for r in coordinator.reroutes] == [[], [a.node_id]]
        assert [(h.node_id, h.start, h.end) for h in driver.route] == [
            (y.node_id, 0, 3), (b.node_id, 3, 4)
        ]  # fmt: skip
