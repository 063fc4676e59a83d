"""Sampled redundant execution for training: shadow replicas re-run ForwardTrain.

A stage node with TESSERA_FAILPOINTS corrupting its ForwardTrain outputs is caught by an
independent checker on the first sampled forward, the stage is re-planned onto another
node, and the job's losses equal those of an honest run. Honest runs with checks on every
stage produce 0 mismatches and the very same losses. Real stage servers on loopback.
"""

from __future__ import annotations

import pytest
from training.training_harness import SPLIT, counting_batch, hyper
from verification.training_verification_harness import JOB, keyed_capability

from client.training_driver import StageFailed, StageOutOfSync, TrainingDriver
from node_agent import failpoints

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
    keys, nodes, checkers, *, spares=(), probability: float | None = 1.0, trust=None
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
    # Checked: every micro-batch of every stage at step 0 (fresh) and step 2 (restored).
    assert stats.checks == 2 * len(SPLIT) * 2
    assert stats.mismatches == 0 and max(stats.errors) <= 1e-5, stats.errors
    assert losses == pytest.approx(honest, rel=1e-6)


async def test_a_corrupting_stage_is_caught_replanned_and_the_losses_stay_honest(
    start_train_node, keys, store, monkeypatch
) -> None:
    store.stages[JOB] = set(SPLIT)
    honest = await honest_losses(start_train_node, keys)
    first = await start_train_node([SPLIT[0]])
    monkeypatch.setenv(failpoints.ENV_VAR, "corrupt=1.0,seed=2")
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
        with pytest.raises(StageFailed, match="redundant check failed") as info:
            await driver.train_step(0, *counting_batch(0))
        assert not isinstance(info.value, StageOutOfSync)  # a node fault: re-plan it
        assert info.value.index == 1 and info.value.node_id == cheat.node_id
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
    assert driver.shadows.stats.checks == 1 + 2 * 2
    assert losses == pytest.approx(honest, rel=1e-6)


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
    assert driver.shadows.stats.checks == 2  # both micro-batches of stage 0 only
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
