"""Sampled redundant execution for training: shadow replicas train in lockstep.

In a sampled checkpoint interval a stage's checker gets the very same ForwardTrain,
BackwardTrain, GradNorm and OptimizerStep as the stage's node, and every answer is
compared. A stage node with TESSERA_FAILPOINTS corrupting its forwards, its backward
gradients, or skipping its optimizer updates is caught, the stage is re-planned onto
another node, and the job's losses equal those of an honest run. Honest runs with checks
on every stage produce 0 mismatches and the very same losses. Real stage servers on
loopback.
"""

from __future__ import annotations

import time

import pytest
from training.training_harness import SPLIT, HangsAfterForwards, counting_batch, hyper
from verification.training_verification_harness import JOB, keyed_capability

from client.training_driver import (
    StageFailed,
    StageOutOfSync,
    TrainingDriver,
    TrainingDriverConfig,
)
from client.training_verification import ShadowChecks, ShadowMismatch
from node_agent import failpoints
from protos.tessera.v1 import training_pb2
from protos.training_answers import KIND

STEPS = 4
CHECKPOINT = 2


async def honest_losses(start_train_node, keys) -> list[float]:
    nodes = [await start_train_node([span]) for span in SPLIT]
    driver = make_driver(keys, nodes, [])
    try:
        await driver.open()
        return [(await driver.train_step(s, *counting_batch(s))).loss for s in range(STEPS)]
    finally:
        await driver.close()


def make_driver(
    keys,
    nodes,
    checkers,
    *,
    spares=(),
    probability: float | None = 1.0,
    trust=None,
    config: TrainingDriverConfig | None = None,
) -> TrainingDriver:
    stages = [(n, s, e) for n, (s, e) in zip(nodes, SPLIT, strict=True)]
    extra = [(c, *span) for c, span in [*checkers, *spares]]
    return TrainingDriver(
        job_id=JOB,
        model="tiny-train",
        hops=[n.hop(s, e) for n, s, e in stages],
        capability=keyed_capability(keys, stages + extra, trust=trust),
        hyper=hyper("lora"),
        checkers=[c.hop(*span) for c, span in checkers],
        check_probability=probability,
        check_seed=1,
        config=config,
    )


async def run_with_checkpoint(driver: TrainingDriver, first: int = 0) -> list[float]:
    losses = []
    for step in range(first, STEPS):
        losses.append((await driver.train_step(step, *counting_batch(step))).loss)
        if step + 1 == CHECKPOINT:
            await driver.save_checkpoint(CHECKPOINT)
    return losses


async def test_honest_checked_runs_have_no_mismatch_and_the_same_losses(
    start_train_node, keys, store
) -> None:
    store.stages[JOB] = set(SPLIT)
    honest = await honest_losses(start_train_node, keys)
    nodes = [await start_train_node([span]) for span in SPLIT]
    checkers = [(await start_train_node([span]), span) for span in SPLIT]
    driver = make_driver(keys, nodes, checkers)
    try:
        await driver.open()
        losses = await run_with_checkpoint(driver)
    finally:
        await driver.close()
    stats = driver.shadows.stats
    # Every call of every step compared: per step, 2 forwards per stage, 2 input gradients
    # on the two stages that have one, and each stage's gradient norm.
    assert stats.checks == STEPS * (3 * 2 + 2 * 2 + 3)
    # Opened once, at step 0: across the checkpoint each shadow kept its own weights.
    assert stats.reopened == 3 and stats.intervals == 3 * 2
    assert stats.mismatches == 0 and max(stats.errors) <= 1e-5, stats.errors
    assert losses == pytest.approx(honest, rel=1e-6)


@pytest.mark.parametrize(
    ("cheat", "caught"),
    [
        ("corrupt=1.0", "forward output"),
        ("corrupt_backward=1.0", "input gradient"),
        ("skip_step=1.0", "forward output"),  # step 1's forwards show step 0 was skipped
    ],
)
async def test_a_cheating_stage_is_caught_replanned_and_the_losses_stay_honest(
    start_train_node, keys, store, monkeypatch, cheat: str, caught: str
) -> None:
    store.stages[JOB] = set(SPLIT)
    honest = await honest_losses(start_train_node, keys)
    first = await start_train_node([SPLIT[0]])
    monkeypatch.setenv(failpoints.ENV_VAR, f"{cheat},seed=2")
    cheat = await start_train_node([SPLIT[1]])
    monkeypatch.delenv(failpoints.ENV_VAR)
    last = await start_train_node([SPLIT[2]])
    checker = await start_train_node([SPLIT[1]])
    spare = await start_train_node([SPLIT[1]])
    driver = make_driver(
        keys, [first, cheat, last], [(checker, SPLIT[1])], spares=[(spare, SPLIT[1])]
    )
    try:
        await driver.open()
        with pytest.raises(StageFailed, match=f"redundant check failed: {caught}") as info:
            for step in range(STEPS):
                await driver.train_step(step, *counting_batch(step))
        assert not isinstance(info.value, StageOutOfSync)  # a node fault: re-plan it
        assert info.value.index == 1 and info.value.node_id == cheat.node_id
        assert info.value.restore_at_most == 0  # the shadow was opened at step 0
        assert driver.shadows.stats.mismatches == 1
        assert cheat.training._failpoints.tampered >= 1
        # The job runner's path: the stage moves to another node and every stage rolls
        # back (here to the start: no checkpoint was taken before the cheat showed).
        driver.replace_hop(1, spare.hop(*SPLIT[1]), driver._capability)
        assert await driver.open() == 0
        losses = await run_with_checkpoint(driver)
    finally:
        await driver.close()
    assert driver.shadows.stats.mismatches == 1  # the honest replacement agrees
    assert losses == pytest.approx(honest, rel=1e-6)


async def test_a_skipped_step_before_a_checkpoint_makes_that_checkpoint_suspect(
    start_train_node, keys, store, monkeypatch
) -> None:
    """A lazy optimizer step right before a checkpoint is baked into the checkpoint the
    node uploads. The shadow kept its own weights across it, so the next step's forwards
    disagree, and the failure names the last checkpoint the shadow vouches for."""
    store.stages[JOB] = set(SPLIT)
    first = await start_train_node([SPLIT[0]])
    monkeypatch.setenv(failpoints.ENV_VAR, "skip_step=1.0")
    cheat = await start_train_node([SPLIT[1]])
    monkeypatch.delenv(failpoints.ENV_VAR)
    last = await start_train_node([SPLIT[2]])
    checker = await start_train_node([SPLIT[1]])
    driver = make_driver(keys, [first, cheat, last], [(checker, SPLIT[1])])
    try:
        await driver.open()
        await driver.train_step(0, *counting_batch(0))
        await driver.save_checkpoint(1)  # carries the skipped step
        with pytest.raises(StageFailed, match="forward output") as info:
            await driver.train_step(1, *counting_batch(1))
    finally:
        await driver.close()
    assert info.value.node_id == cheat.node_id
    assert info.value.restore_at_most == 0  # not the suspect checkpoint at step 1


async def test_without_a_flat_fraction_each_node_is_checked_as_the_coordinator_says(
    start_train_node, keys
) -> None:
    """check_probability=None: each primary's own probability from the capability (the
    coordinator's trust): a new node (1.0) is checked on every forward, a trusted one
    (0.0 here) never."""
    nodes = [await start_train_node([span]) for span in SPLIT]
    checkers = [(await start_train_node([span]), span) for span in SPLIT]
    trust = {nodes[0].node_id: 1.0, nodes[1].node_id: 0.0, nodes[2].node_id: 0.0}
    driver = make_driver(keys, nodes, checkers, probability=None, trust=trust)
    try:
        await driver.open()
        await driver.train_step(0, *counting_batch(0))
    finally:
        await driver.close()
    # Stage 0 only: its 2 forwards and its gradient norm (it answers no input gradient).
    assert driver.shadows.stats.checks == 3
    assert driver.shadows.stats.mismatches == 0


async def test_a_dead_checker_stops_checking_without_failing_the_job(
    start_train_node, keys
) -> None:
    nodes = [await start_train_node([span]) for span in SPLIT]
    checker = await start_train_node([SPLIT[0]])
    driver = make_driver(keys, nodes, [(checker, SPLIT[0])])
    try:
        await driver.open()
        await checker.server.stop(0)
        await driver.train_step(0, *counting_batch(0))
        await driver.train_step(1, *counting_batch(1))
    finally:
        await driver.close()
    assert driver.shadows.checkers == {} and driver.shadows.stats.checks == 0


class HangsAtOnce(HangsAfterForwards):
    answers = 0


class HangsAfterTwoForwards(HangsAfterForwards):
    answers = 2


@pytest.mark.parametrize(
    ("hangs", "forwards", "checks"),
    [
        # Step 0's two forwards, then step 1's two (both micro-batches are in flight). Its
        # own answers set the shadow's deadline; step 0 of stage 1 was compared in full
        # (2 forwards, 2 input gradients, the norm).
        (HangsAfterTwoForwards, 4, 5),
        # Never answers: no deadline of its own yet (the cold 300 s), so what ends its
        # wait is the patience counted from the primary's answer.
        (HangsAtOnce, 2, 0),
    ],
)
async def test_a_hung_checker_stops_checking_after_its_patience_not_the_rpc_timeout(
    start_train_node, keys, store, hangs, forwards: int, checks: int
) -> None:
    """The checker stops answering, with its connection open. Each primary call took
    milliseconds, so the shadow's call is given up about 2 s (the floor) after the
    primary answered, instead of holding the step for the 300 s RPC timeout; the job
    goes on unchecked and its losses are the honest ones."""
    store.stages[JOB] = set(SPLIT)
    honest = await honest_losses(start_train_node, keys)
    nodes = [await start_train_node([span]) for span in SPLIT]
    checker = await start_train_node([SPLIT[1]], servicer_class=hangs)
    config = TrainingDriverConfig(rpc_timeout_s=300.0, step_deadline_floor_s=2.0)
    driver = make_driver(keys, nodes, [(checker, SPLIT[1])], config=config)
    began = time.monotonic()
    try:
        await driver.open()
        losses = await run_with_checkpoint(driver)
    finally:
        await driver.close()
    assert time.monotonic() - began < 60.0
    assert checker.training.forwards == forwards
    assert driver.shadows.stats.checks == checks and driver.shadows.stats.mismatches == 0
    assert driver.shadows.checkers == {}
    assert losses == pytest.approx(honest, rel=1e-6)


async def test_bad_checker_configurations_are_refused(start_train_node, keys) -> None:
    nodes = [await start_train_node([span]) for span in SPLIT]
    other = await start_train_node([(0, 2)])
    for checkers, words in (
        ([(other, (0, 2))], "no stage's layers"),
        ([(nodes[2], SPLIT[1])], "node of the pipeline"),
        ([(other, SPLIT[0]), (other, SPLIT[0])], "two checkers"),
    ):
        with pytest.raises(ValueError, match=words):
            make_driver(keys, nodes, checkers)
    with pytest.raises(ValueError, match="probability"):
        make_driver(keys, nodes, [], probability=1.5)


def test_intervals_lockstep_keep_weights_and_check_the_next_steps_forwards() -> None:
    """The shadow's schedule over checkpoint intervals (no servers: the state machine)."""
    checks = ShadowChecks({0: ("checker", 0, 1)}, probability=None)
    assert checks.start_interval(0, 0, True, rolled_back=True)  # open: from the start
    checks.opened(0, 0)
    for kind in ("forward", "backward", "norm", "step"):
        assert checks.active(0, 0, kind) is not None
    checks.passes_done(0)
    checks.stepped(0, 0)
    # Sampled again at the checkpoint of step 1: it keeps its own weights (no re-open).
    assert not checks.start_interval(0, 1, True, rolled_back=False)
    assert checks.active(0, 1, "step") is not None
    checks.passes_done(1)
    assert checks.shadows[0].anchor == 1  # step 1's forwards agreed after the checkpoint
    checks.stepped(0, 1)
    # Not sampled at step 2: only step 2's forwards are still checked, then it stops.
    assert not checks.start_interval(0, 2, False, rolled_back=False)
    assert checks.active(0, 2, "forward") is not None
    assert checks.active(0, 2, "backward") is None and checks.active(0, 2, "step") is None
    checks.passes_done(2)
    assert checks.active(0, 2, "forward") is None
    # Sampled later: it must re-open from that checkpoint; a rollback always re-opens.
    assert checks.start_interval(0, 4, True, rolled_back=False)
    checks.opened(0, 4)
    assert checks.start_interval(0, 4, True, rolled_back=True)
    with pytest.raises(ShadowMismatch) as info:
        checks.compare(
            0,
            "primary",
            KIND.NORM,
            training_pb2.GradNormResponse(step=4, sq_norm=2.0, finite=True),
            training_pb2.GradNormResponse(step=4, sq_norm=1.0, finite=True),
        )
    assert info.value.restore_at_most == 4 and checks.stats.mismatches == 1
