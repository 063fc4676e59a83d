"""Straggler hedging over real stage servers, and the race it is built on.

A hop that answers late is hedged on its alternate (history replayed there first); the
first answer wins, the output stays identical to the whole model, the alternate becomes
the hop's primary and the slow node goes last among the alternates. The driver reports
its timings to the coordinator (ReportStepTimes), the slow call included.
"""

from __future__ import annotations

import asyncio

import pytest
from data_plane.stage_harness import MODEL, reference_greedy, session_grant
from data_plane.test_driver import PROMPT, greedy

from client.driver import DriverConfig, HopFailure, PipelineDriver
from client.hedging import hedge_delay, race
from node_agent.stage_server import StageServicer
from protos.tessera.v1 import client_api_pb2

NEW_TOKENS = 12


class SlowServicer(StageServicer):
    """Answers every request `delay_s` late once `delay_s` is set: a slow node or link."""

    delay_s = 0.0

    async def _forward_one(self, request, stream):
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        return await super()._forward_one(request, stream)


class Reports:
    def __init__(self) -> None:
        self.steps = []

    async def send(self, report):
        self.steps.extend(report.steps)
        return client_api_pb2.StepTimesAck(accepted=len(report.steps))


async def test_a_slow_hop_is_hedged_on_its_alternate_and_demoted(start_node, keys, checkpoint):
    a = await start_node([(0, 2)])
    slow = await start_node([(2, 4)], servicer_class=SlowServicer)
    spare = await start_node([(2, 4)])
    grant = session_grant(keys, [(0, 2, a, []), (2, 4, slow, [spare])])
    reports = Reports()
    # A 2 s straggler deadline: a fail-over must not be what saves this run.
    config = DriverConfig(
        hedge_factor=3.0, hedge_floor_s=0.1, min_samples=2, deadline_floor_s=2.0, report_every=4
    )
    driver = PipelineDriver(grant, MODEL, config=config, report_step_times=reports.send)

    async def slow_down() -> None:
        slow.servicer.delay_s = 1.0

    tokens = await greedy(driver, PROMPT, NEW_TOKENS, after_step={4: slow_down})
    assert tokens == reference_greedy(checkpoint, PROMPT, NEW_TOKENS)
    assert driver.failovers == []
    [hedge] = [h for h in driver.hedges if h.slow_node_id == slow.node_id]
    assert hedge.winner == "alternate" and hedge.alternate_node_id == spare.node_id
    assert hedge.replayed_tokens >= len(PROMPT) + 4
    assert hedge.answered_ms < 1000, "the alternate answered before the slow node"
    # The alternate now serves the hop; the slow node is the last resort.
    slot = driver._slots[1]
    assert slot.hop.node_id == spare.node_id and slot.alternates[-1].node_id == slow.node_id
    later = [t for t in driver.timings if t.step > hedge.step and t.start == 2 and not t.replay]
    assert later and {t.node_id for t in later} == {spare.node_id}
    await driver.close()
    # Every decode call was reported, and the slow one as at least the time it ran.
    reported = {(s.node_id, s.layers.start) for s in reports.steps}
    assert {(a.node_id, 0), (slow.node_id, 2), (spare.node_id, 2)} <= reported
    slow_ms = max(s.wall_ms for s in reports.steps if s.node_id == slow.node_id)
    assert slow_ms >= hedge.answered_ms * 0.99
    assert all(s.tokens == 1 for s in reports.steps)


async def test_with_hedging_off_a_slow_hop_is_waited_for(start_node, keys, checkpoint):
    a = await start_node([(0, 2)])
    slow = await start_node([(2, 4)], servicer_class=SlowServicer)
    spare = await start_node([(2, 4)])
    grant = session_grant(keys, [(0, 2, a, []), (2, 4, slow, [spare])])
    config = DriverConfig(hedge_factor=0.0, min_samples=2, deadline_floor_s=5.0)
    driver = PipelineDriver(grant, MODEL, config=config)

    async def slow_down() -> None:
        slow.servicer.delay_s = 0.3

    tokens = await greedy(driver, PROMPT, 6, after_step={2: slow_down})
    assert tokens == reference_greedy(checkpoint, PROMPT, 6)
    assert driver.hedges == [] and driver.route[1].node_id == slow.node_id
    await driver.close()


def test_hedge_delay_follows_the_p95_with_a_floor():
    assert hedge_delay([0.01] * 5, factor=3.0, floor_s=0.1, min_samples=3) == 0.1
    assert hedge_delay([0.1] * 5, factor=3.0, floor_s=0.1, min_samples=3) == pytest.approx(0.3)
    assert hedge_delay([0.1] * 2, factor=3.0, floor_s=0.1, min_samples=3) is None
    assert hedge_delay([0.1] * 5, factor=0.0, floor_s=0.1, min_samples=3) is None


async def _after(delay: float, value=None, error: BaseException | None = None):
    await asyncio.sleep(delay)
    if error is not None:
        raise error
    return value


async def test_race_takes_the_first_success_and_cancels_the_loser():
    started = []

    def hedge(delay, value="alt", error=None):
        async def start():
            started.append(True)
            return "shadow", await _after(delay, value, error)

        return start

    fast = await race(_after(0.01, "primary"), hedge(0.0), 0.2)
    assert (fast.value, fast.hedged, started) == ("primary", False, [])
    won = await race(_after(1.0, "primary"), hedge(0.01), 0.05)
    assert (won.value, won.alternate_won, won.hedge) == ("alt", True, "shadow")
    assert won.answered_s < 0.5
    lost = await race(_after(0.1, "primary"), hedge(1.0), 0.02)
    assert (lost.value, lost.hedged, lost.alternate_won) == ("primary", True, False)
    # A failed hedge is ignored; a primary that fails while the hedge runs is rescued.
    failed_hedge = await race(_after(0.1, "primary"), hedge(0.0, error=HopFailure("x")), 0.02,
                              hedge_errors=(HopFailure,))  # fmt: skip
    assert failed_hedge.value == "primary"
    rescued = await race(_after(0.05, error=HopFailure("down")), hedge(0.1), 0.01,
                         primary_errors=(HopFailure,))  # fmt: skip
    assert rescued.value == "alt" and rescued.alternate_won
    with pytest.raises(HopFailure, match="down"):  # both fail: the primary's error
        await race(_after(0.05, error=HopFailure("down")), hedge(0.01, error=HopFailure("h")),
                   0.01, primary_errors=(HopFailure,), hedge_errors=(HopFailure,))  # fmt: skip
    with pytest.raises(ValueError):  # not a hop failure: no rescue
        await race(_after(0.05, error=ValueError("bug")), hedge(0.5), 0.01,
                   primary_errors=(HopFailure,))  # fmt: skip
