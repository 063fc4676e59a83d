"""Consecutive stages on one node run as one hop; a failing merged hop splits into stages.

Real stage servers on loopback (see stage_harness). The route's stages are what the
coordinator granted; the driver may join consecutive ones whose primary is the same node,
and the node accepts the joined span when its grants cover it without a gap.
"""

from __future__ import annotations

import asyncio
import threading

import grpc
import numpy as np
from data_plane.stage_harness import (
    MODEL,
    NUM_LAYERS,
    OPTIONS,
    reference_greedy,
    session_grant,
)
from data_plane.test_driver import NEW_TOKENS, PROMPT, greedy

from client.driver import DriverConfig, PipelineDriver
from node_agent.stage_server import StageLimits
from protos import codec, identity
from protos.tessera.v1 import common_pb2, coordinator_pb2, stage_pb2, stage_pb2_grpc


async def test_consecutive_stages_on_one_node_run_as_one_signed_hop(
    start_node, keys, checkpoint
) -> None:
    a = await start_node([(0, 3)])
    c = await start_node([(3, 4)])
    layout = [(0, 2, a, []), (2, 3, a, []), (3, 4, c, [])]
    driver = PipelineDriver(session_grant(keys, layout), MODEL)
    assert [(h.node_id, h.start, h.end) for h in driver.route] == [
        (a.node_id, 0, 3),
        (c.node_id, 3, 4),
    ]

    assert await greedy(driver, PROMPT, NEW_TOKENS) == reference_greedy(
        checkpoint, PROMPT, NEW_TOKENS
    )
    # One request per token to a, for both of its stages.
    assert {(t.node_id, t.start, t.end) for t in driver.timings} == {
        (a.node_id, 0, 3),
        (c.node_id, 3, 4),
    }
    assert len(driver.timings) == 2 * NEW_TOKENS
    # a signed what it computed: the joined span.
    public = identity.public_key_bytes(a.ctx.private_key)
    for receipt in (r for r in driver.receipts if r.node_id == a.node_id):
        payload = identity.output_payload(
            driver.session_id,
            receipt.step,
            0,
            3,
            receipt.output_sha256,
            input_digest=receipt.input_digest,
        )
        assert identity.verify(public, receipt.signature, payload)
    await driver.close()


async def test_merging_can_be_turned_off(start_node, keys, checkpoint) -> None:
    a = await start_node([(0, 3)])
    c = await start_node([(3, 4)])
    layout = [(0, 2, a, []), (2, 3, a, []), (3, 4, c, [])]
    config = DriverConfig(merge_same_node_hops=False)
    driver = PipelineDriver(session_grant(keys, layout), MODEL, config=config)
    assert [(h.start, h.end) for h in driver.route] == [(0, 2), (2, 3), (3, 4)]
    assert await greedy(driver, PROMPT, 4) == reference_greedy(checkpoint, PROMPT, 4)
    await driver.close()


async def test_a_merged_hop_whose_node_dies_moves_each_stage_to_its_alternate(
    start_node, keys, checkpoint
) -> None:
    a = await start_node([(0, 3)])
    b = await start_node([(0, 2)])
    c = await start_node([(2, 4)])
    d = await start_node([(3, 4)])
    layout = [(0, 2, a, [b]), (2, 3, a, [c]), (3, 4, d, [])]
    driver = PipelineDriver(session_grant(keys, layout), MODEL)

    tokens = await greedy(driver, PROMPT, NEW_TOKENS, after_step={3: lambda: a.server.stop(0)})

    assert tokens == reference_greedy(checkpoint, PROMPT, NEW_TOKENS)
    [event] = driver.failovers
    assert (event.start, event.end, event.failed_node_id) == (0, 3, a.node_id)
    assert (event.via, event.replacement_node_ids) == ("alternate", (b.node_id, c.node_id))
    assert event.replayed_tokens == len(PROMPT) + 4
    assert [(h.node_id, h.start, h.end) for h in driver.route] == [
        (b.node_id, 0, 2),
        (c.node_id, 2, 3),
        (d.node_id, 3, 4),
    ]
    await driver.close()


async def test_a_node_holding_the_stages_in_separate_shards_serves_them_one_by_one(
    start_node, keys, checkpoint
) -> None:
    a = await start_node([(0, 2), (2, 3)])  # no one shard holds [0, 3)
    c = await start_node([(3, 4)])
    layout = [(0, 2, a, []), (2, 3, a, []), (3, 4, c, [])]
    driver = PipelineDriver(session_grant(keys, layout), MODEL)

    assert await greedy(driver, PROMPT, NEW_TOKENS) == reference_greedy(
        checkpoint, PROMPT, NEW_TOKENS
    )
    [event] = driver.failovers
    assert (event.via, event.failed_node_id, event.replacement_node_ids) == (
        "split",
        a.node_id,
        (a.node_id,),
    )
    assert "NOT_FOUND" in event.reason
    assert [(h.node_id, h.start, h.end) for h in driver.route] == [
        (a.node_id, 0, 2),
        (a.node_id, 2, 3),
        (c.node_id, 3, 4),
    ]
    await driver.close()


async def _forward(node, keys, grants, start: int, end: int) -> grpc.aio.AioRpcError | None:
    """One prefill of [start, end) on ``node`` under ``grants``; the error, if any."""
    capability = keys.capability("s-grants", grants)
    request = stage_pb2.ForwardRequest(
        session_id="s-grants",
        step=1,
        model=MODEL,
        layers=common_pb2.LayerRange(start=start, end=end),
        input=codec.encode(np.array([PROMPT], dtype=np.int64)),
        capability=capability,
    )
    async with grpc.aio.insecure_channel(node.address, options=OPTIONS) as channel:
        call = stage_pb2_grpc.StageStub(channel).Forward()
        try:
            await call.write(request)
            response = await call.read()
        except grpc.aio.AioRpcError as err:
            return err
        assert response is not grpc.aio.EOF
        assert response.cache_length == len(PROMPT)
        return None


async def test_the_node_serves_a_span_its_grants_cover_together_and_nothing_wider(
    start_node, keys
) -> None:
    node = await start_node([(0, NUM_LAYERS)])
    me = node.node_id
    assert await _forward(node, keys, [(me, 2, 3), (me, 0, 2)], 0, 3) is None
    gap = await _forward(node, keys, [(me, 0, 1), (me, 2, 3)], 0, 3)
    assert gap is not None and gap.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "outside what the capability grants" in (gap.details() or "")
    short = await _forward(node, keys, [(me, 0, 2), (me, 2, 3)], 0, 4)
    assert short is not None and short.code() == grpc.StatusCode.PERMISSION_DENIED


def record_compute_threads(node) -> list[str]:
    """The name of the thread each forward pass of ``node``'s full stage runs on, in order."""
    stage = node.manager.find(MODEL, 0, NUM_LAYERS).stage_for(0, NUM_LAYERS)
    threads: list[str] = []
    original = stage.forward

    def recording_forward(*args, **kwargs):
        threads.append(threading.current_thread().name)
        return original(*args, **kwargs)

    stage.forward = recording_forward
    return threads


async def test_a_decode_step_runs_inline_only_while_the_compute_thread_is_idle(
    start_node, keys, checkpoint
) -> None:
    node = await start_node([(0, NUM_LAYERS)])
    threads = record_compute_threads(node)
    driver = PipelineDriver(session_grant(keys, [(0, NUM_LAYERS, node, [])]), MODEL)
    assert await greedy(driver, PROMPT, 4) == reference_greedy(checkpoint, PROMPT, 4)
    loop_thread = threading.current_thread().name  # the servers share the test's loop
    # The prefill (several tokens) uses the compute thread; it was quick, so the decode
    # steps after it run inline.
    assert threads[0].startswith("tessera-compute")
    assert threads[1:] == [loop_thread] * 3

    # A busy compute thread: the step queues behind the work there instead.
    release = threading.Event()
    busy = asyncio.ensure_future(node.manager.run(lambda: release.wait(30)))
    await asyncio.sleep(0.05)
    step = asyncio.ensure_future(driver.step([3], last_only=True))
    await asyncio.sleep(0.3)
    assert not step.done(), "the step must wait for the busy compute thread"
    release.set()
    await asyncio.gather(busy, step)
    assert threads[-1].startswith("tessera-compute")
    await driver.close()


async def test_a_stage_slower_than_the_inline_limit_always_uses_the_compute_thread(
    start_node, keys, checkpoint
) -> None:
    node = await start_node([(0, NUM_LAYERS)], limits=StageLimits(inline_max_ms=0.0))
    threads = record_compute_threads(node)
    driver = PipelineDriver(session_grant(keys, [(0, NUM_LAYERS, node, [])]), MODEL)
    assert await greedy(driver, PROMPT, 4) == reference_greedy(checkpoint, PROMPT, 4)
    assert len(threads) == 4 and all(t.startswith("tessera-compute") for t in threads)
    await driver.close()


async def test_step_times_of_a_dropped_shard_are_forgotten(start_node, keys, checkpoint) -> None:
    node = await start_node([(0, NUM_LAYERS)])
    driver = PipelineDriver(session_grant(keys, [(0, NUM_LAYERS, node, [])]), MODEL)
    await greedy(driver, PROMPT, 2)
    await driver.close()
    assert node.servicer._step_ms, "the steps were timed"
    await node.manager.drop(
        coordinator_pb2.DropShard(
            model=MODEL, layers=common_pb2.LayerRange(start=0, end=NUM_LAYERS)
        )
    )
    node.servicer.expire_idle()
    assert node.servicer._step_ms == {}
