"""TrainingDriver against real stage servers: 1F1B overlap, failures, restore, bad input.

Checkpoints go to ``StandInTrainingStore`` (tests/training/training_harness.py), which
stands in for the coordinator's TrainingStore: it really stores, hashes and serves bytes.
"""

from __future__ import annotations

import time

import grpc
import numpy as np
import pytest
from data_plane.stage_harness import CoordinatorKeys, node_context
from training.training_harness import (
    SPLIT,
    HangsAfterForwards,
    counting_batch,
    hyper,
    training_capability,
)

from client.errors import RequestRejected
from client.training_driver import (
    StageFailed,
    StageOutOfSync,
    TrainingDriver,
    TrainingDriverConfig,
    TrainingHop,
)
from node_agent.data_plane import start_server
from node_agent.shard_manager import DirectorySource, ShardManager
from node_agent.stage_server import StageServicer
from node_agent.training_server import TrainingStageServicer
from protos.tessera.v1 import training_pb2, training_pb2_grpc

JOB = "job-drv"


class RecordingServicer(TrainingStageServicer):
    """Records the order in which micro-batches reach this stage."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.events: list[tuple[str, int]] = []

    async def ForwardTrain(self, request, context):  # noqa: N802
        self.events.append(("F", request.micro_batch))
        return await super().ForwardTrain(request, context)

    async def BackwardTrain(self, request, context):  # noqa: N802
        self.events.append(("B", request.micro_batch))
        return await super().BackwardTrain(request, context)


async def pipeline(
    start_node,
    keys,
    h,
    *,
    spare: bool = False,
    middle: type[TrainingStageServicer] | None = None,
    config: TrainingDriverConfig | None = None,
    **options,
):
    nodes = []
    for index, span in enumerate(SPLIT):
        if index == 1 and middle is not None:
            nodes.append(await start_node([span], servicer_class=middle, **options))
        else:
            nodes.append(await start_node([span], **options))
    extra = await start_node([SPLIT[1]]) if spare else None
    grants = [(n, s, e) for n, (s, e) in zip(nodes, SPLIT, strict=True)]
    if extra is not None:
        grants.append((extra, *SPLIT[1]))
    cap = training_capability(keys, JOB, grants)
    driver = TrainingDriver(
        job_id=JOB,
        model="tiny-train",
        hops=[n.hop(s, e) for n, (s, e) in zip(nodes, SPLIT, strict=True)],
        capability=cap,
        hyper=h,
        config=config,
    )
    return driver, nodes, extra, cap


async def test_micro_batches_overlap_within_a_bounded_window(
    start_node, keys: CoordinatorKeys
) -> None:
    h = hyper("full", micro_batches=6)
    driver, nodes, _, _ = await pipeline(start_node, keys, h, servicer_class=RecordingServicer)
    try:
        await driver.open()
        tokens, labels = counting_batch(0, batch=12)
        await driver.train_step(0, tokens, labels)
    finally:
        await driver.close()
    assert driver.window == 3
    first = nodes[0].training.events
    assert first.index(("F", 1)) < first.index(("B", 0)), first  # >= 2 in flight
    in_flight, peak = 0, 0
    for kind, _ in first:
        in_flight += 1 if kind == "F" else -1
        peak = max(peak, in_flight)
    assert 2 <= peak <= driver.window, first  # 1F1B: never all 6 at once
    for node in nodes:
        assert sorted(node.training.events) == sorted(
            [("F", mb) for mb in range(6)] + [("B", mb) for mb in range(6)]
        )


async def test_stage_failure_then_replan_and_restore_matches_an_unfailed_run(
    start_node, keys: CoordinatorKeys, store
) -> None:
    """Kill the middle stage's server mid-job: StageFailed names it; the spare takes its
    layers, every stage restores the last checkpoint, and the losses after the resume
    equal those of a run that never failed."""
    h = hyper("lora")
    store.stages[JOB] = set(SPLIT)
    driver, nodes, spare, cap = await pipeline(start_node, keys, h, spare=True)
    try:
        await driver.open()
        for step in range(2):
            await driver.train_step(step, *counting_batch(step))
        digests = await driver.save_checkpoint(2)
        assert store.consistent(JOB, 2)
        unfailed = [(await driver.train_step(s, *counting_batch(s))).loss for s in (2, 3)]

        await nodes[1].server.stop(0)
        with pytest.raises(StageFailed) as info:
            await driver.train_step(4, *counting_batch(4))
        assert info.value.index == 1 and info.value.node_id == nodes[1].node_id
        assert not isinstance(info.value, StageOutOfSync)

        driver.replace_hop(1, spare.hop(*SPLIT[1]), cap)
        assert await driver.open(restore_step=2, restore_sha256=digests) == 2
        resumed = [(await driver.train_step(s, *counting_batch(s))).loss for s in (2, 3)]
    finally:
        await driver.close()
    assert resumed == pytest.approx(unfailed, rel=1e-6)


async def test_a_stage_that_hangs_mid_job_fails_at_its_step_deadline_not_the_rpc_timeout(
    start_node, keys: CoordinatorKeys, store
) -> None:
    """The middle node stops answering at step 4 with its connection open. Its calls had
    taken milliseconds, so the driver gives up after the 2 s floor instead of the 300 s
    RPC timeout, names the node, and the job resumes on the spare with the losses of a run
    that never failed."""
    h = hyper("lora")
    store.stages[JOB] = set(SPLIT)
    config = TrainingDriverConfig(rpc_timeout_s=300.0, step_deadline_floor_s=2.0)
    driver, nodes, spare, cap = await pipeline(
        start_node, keys, h, spare=True, middle=HangsAfterForwards, config=config
    )
    try:
        await driver.open()
        for step in range(2):
            await driver.train_step(step, *counting_batch(step))
        digests = await driver.save_checkpoint(2)
        unfailed = [(await driver.train_step(s, *counting_batch(s))).loss for s in (2, 3)]
        assert nodes[1].training.forwards == HangsAfterForwards.answers  # 2 per step

        began = time.monotonic()
        with pytest.raises(
            StageFailed, match=r"ForwardTrain: DEADLINE_EXCEEDED: no answer"
        ) as info:
            await driver.train_step(4, *counting_batch(4))
        waited = time.monotonic() - began
        assert info.value.index == 1 and info.value.node_id == nodes[1].node_id
        assert not isinstance(info.value, StageOutOfSync)
        # max(2 s, 8x a few ms): far below the cold 300 s, with room for a loaded box.
        assert waited < 30.0, waited
        assert 2.0 <= driver.deadlines.timeout(nodes[1].node_id, "ForwardTrain") < 30.0

        driver.replace_hop(1, spare.hop(*SPLIT[1]), cap)
        assert await driver.open(restore_step=2, restore_sha256=digests) == 2
        # The spare's first calls wait the cold timeout; once answered, they have a deadline.
        assert driver.deadlines.timeout(spare.node_id, "ForwardTrain") == 300.0
        resumed = [(await driver.train_step(s, *counting_batch(s))).loss for s in (2, 3)]
        assert driver.deadlines.timeout(spare.node_id, "ForwardTrain") < 30.0
    finally:
        await driver.close()
    assert resumed == pytest.approx(unfailed, rel=1e-6)


async def test_out_of_sync_stage_is_reported_as_such(start_node, keys: CoordinatorKeys) -> None:
    driver, nodes, _, cap = await pipeline(start_node, keys, hyper("full"))
    try:
        await driver.open()
        await driver.train_step(0, *counting_batch(0))
        # Another driver rolls stage 2 back (a second client on the same job, say).
        rogue = TrainingDriver(
            job_id=JOB,
            model="tiny-train",
            hops=[nodes[0].hop(0, 1)],
            capability=cap,
            hyper=hyper("full"),
        )
        rogue.hops[0] = nodes[2].hop(*SPLIT[2])  # bypasses the tiling check on purpose
        await rogue.open()
        with pytest.raises(StageOutOfSync) as info:
            await driver.train_step(1, *counting_batch(1))
        assert info.value.index == 2 and "stale step 1" in str(info.value)
        await rogue.close()
    finally:
        await driver.close()


async def test_driver_refuses_bad_input(start_node, keys: CoordinatorKeys) -> None:
    driver, nodes, _, cap = await pipeline(start_node, keys, hyper("full"))
    tokens, labels = counting_batch(0)
    with pytest.raises(ValueError, match="open"):
        await driver.train_step(0, tokens, labels)
    try:
        await driver.open()
        bad = [
            (0, tokens[:3], labels[:3], "multiple of micro_batches"),
            (0, tokens, labels[:, :5], "must match"),
            (0, tokens.astype(np.float32), labels, "integers"),
            (0, tokens[0], labels[0], "integers"),
            (1, tokens, labels, "at step 0"),
            (0, tokens, np.full_like(labels, -100), "no label"),
        ]
        for step, x, y, words in bad:
            with pytest.raises(ValueError, match=words):
                await driver.train_step(step, x, y)
        # A node refusal (a token outside the vocabulary) is not a node failure.
        with pytest.raises(RequestRejected, match="vocabulary"):
            await driver.train_step(0, tokens + 1000, labels)
        with pytest.raises(ValueError, match="covers layers"):
            driver.replace_hop(1, nodes[1].hop(1, 2), cap)
        with pytest.raises(ValueError, match="out of range"):
            driver.replace_hop(3, nodes[1].hop(1, 3), cap)
        with pytest.raises(ValueError, match="sha256"):
            await driver.open(restore_step=1, restore_sha256={(0, 1): "a" * 64})
    finally:
        await driver.close()
    for hops in (
        [],
        [TrainingHop("n", "x:1", 1, 4)],
        [TrainingHop("n", "x:1", 0, 2), TrainingHop("m", "y:1", 3, 4)],
    ):
        with pytest.raises(ValueError):
            TrainingDriver(job_id=JOB, model="m", hops=hops, capability=cap, hyper=hyper())


async def test_agent_data_plane_serves_training_next_to_stage(
    tmp_path, keys: CoordinatorKeys, checkpoint
) -> None:
    """The node agent's own start_server registers TrainingStage through its plug-in."""
    ctx = node_context(tmp_path, keys.public)
    manager = ShardManager(DirectorySource(checkpoint))
    ctx.shard_handler = manager
    server, port = await start_server(ctx, "127.0.0.1:0", StageServicer(ctx, manager))
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = training_pb2_grpc.TrainingStageStub(channel)
            cap = keys.capability(JOB, [(ctx.node_id, 0, 4)], model="tiny-train")
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.CloseTraining(
                    training_pb2.CloseTrainingRequest(capability=cap, job_id=JOB)
                )
            assert info.value.code() == grpc.StatusCode.NOT_FOUND  # served, not UNIMPLEMENTED
    finally:
        await server.stop(0)
        manager.close()
