"""Audits: a checker's catch-up compared with the unchecked steps it replays.

Real stage servers on loopback. The client's draws are scripted (no check until the test
arms them, then a check at every draw), so the step a node corrupts is one that no check
was drawn for: only the audit of a later check's catch-up can see it. The verification
report goes to an arbiter built from the coordinator's own parts: its evidence checks
(`coordinator/verifier/evidence.py`) and its data-plane runner on a fourth, honest node
(`coordinator/verifier/stage_runner.py`); the verdict follows what that node computes.
"""

from __future__ import annotations

import random
from collections.abc import Awaitable, Callable

import numpy as np
import pytest
from data_plane.stage_harness import (
    MODEL,
    CoordinatorKeys,
    StageNode,
    reference_greedy,
    session_grant,
)
from data_plane.test_driver import PROMPT, greedy
from verification.test_driver_verification import keyed

from client import verification as client_verification
from client.channels import ChannelPool
from client.driver import PipelineDriver
from client.errors import OutputTainted
from client.verification import StageVerifier, VerificationStats
from coordinator.verifier import evidence
from coordinator.verifier.stage_runner import StageRunner
from node_agent import failpoints
from protos import codec, output_check
from protos.tessera.v1 import client_api_pb2, common_pb2, verification_pb2

NEW_TOKENS = 12
Outcome = verification_pb2.Verdict.Outcome


class Armed(random.Random):
    """Draws no check until ``armed``, then a check at every draw."""

    armed = False

    def random(self) -> float:
        return 0.0 if self.armed else 0.99


def arm_after(draws: Armed) -> Callable[[], Awaitable[None]]:
    """A hook for ``greedy(after_step=...)``: checks are drawn from then on."""

    async def arm() -> None:
        draws.armed = True

    return arm


def assert_proven(
    raised: pytest.ExceptionInfo[OutputTainted],
    stats: VerificationStats,
    mismatches: list[evidence.Mismatch],
    cheater: StageNode,
    layers: tuple[int, int],
    corrupted: int,
) -> evidence.Mismatch:
    """The audit's one finding: ``cheater`` proven wrong on ``layers`` at position
    ``corrupted``, on evidence the coordinator's checks accepted; the mismatch it was."""
    assert raised.value.node_id == cheater.node_id
    [finding] = stats.findings
    assert (finding.node_id, finding.layer_start, finding.layer_end) == (cheater.node_id, *layers)
    assert (finding.start_pos, finding.end_pos, finding.outcome) == (
        corrupted,
        corrupted + 1,
        "PRIMARY_WRONG",
    )
    # The evidence was the step itself, signed by both nodes: the coordinator's checks
    # accepted it (they raise otherwise) and the arbiter's run sided with the checker.
    [mismatch] = mismatches
    assert mismatch.comparison.primary.node_id == cheater.node_id
    assert mismatch.comparison.primary.step == finding.step
    return mismatch


class CorruptsOneCall(failpoints.Failpoints):
    """The node's corrupt failpoint on one output only, its ``target``-th (every output
    when ``target`` is None); like the failpoint, before the node signs it."""

    def __init__(self, target: int | None) -> None:
        super().__init__(failpoints.parse("corrupt=1.0,seed=3"))
        self.target = target

    def _tamper(self, values: np.ndarray, request_input: common_pb2.Tensor) -> np.ndarray | None:
        if self.target is not None and self.calls != self.target:
            return None
        return super()._tamper(values, request_input)


Reporter = Callable[
    [verification_pb2.VerificationReport], Awaitable[verification_pb2.ReportVerdict]
]


def arbiter(
    keys: CoordinatorKeys,
    node: StageNode,
    mismatches: list[evidence.Mismatch],
    reports: list[verification_pb2.VerificationReport] | None = None,
) -> Reporter:
    """What the coordinator does with a report: every comparison's evidence checked, and
    each mismatch's input prefix run on ``node``, whose answer decides."""
    runner = StageRunner(keys.key)

    async def report(
        request: verification_pb2.VerificationReport,
    ) -> verification_pb2.ReportVerdict:
        if reports is not None:
            reports.append(request)
        claims = client_api_pb2.CapabilityClaims.FromString(request.capability.claims)
        for audit in request.audits:
            evidence.check_audit(claims, audit)  # raises, as the coordinator would refuse
        verdicts = []
        for comparison in request.comparisons:
            primary, checker = evidence.check_comparison(claims, comparison)
            if comparison.agreed:
                continue
            mismatch = evidence.check_mismatch(comparison, primary, checker)
            mismatches.append(mismatch)
            layers = comparison.primary.layers
            run = await runner.run(
                node.node_id, node.address, MODEL, layers.start, layers.end,
                [*comparison.prefix, comparison.input],
                last_position_only=comparison.last_position_only,
            )  # fmt: skip
            truth = run.response.output
            assert list(truth.shape) == list(mismatch.primary_output.shape)
            right = tuple(
                output_check.relative_error(codec.decode(truth), truth.dtype, out, "float32")
                <= mismatch.tolerance
                for out in (mismatch.primary_output, mismatch.checker_output)
            )
            outcome = {
                (False, True): Outcome.PRIMARY_WRONG,
                (True, False): Outcome.CHECKER_WRONG,
            }.get(right, Outcome.UNRESOLVED)
            verdicts.append(verification_pb2.Verdict(outcome=outcome, arbiter_node_id=node.node_id))
        return verification_pb2.ReportVerdict(verdicts=verdicts)

    return report


async def swarm(
    start_node: Callable[..., Awaitable[StageNode]],
    keys: CoordinatorKeys,
    *,
    checked: tuple[int, int] = (0, 2),
    primary_corrupts: int | None = None,
    checker_corrupts: bool = False,
    primary_delay_ms: int = 0,
    reports: list[verification_pb2.VerificationReport] | None = None,
) -> tuple[PipelineDriver, Armed, StageNode, StageNode, list[evidence.Mismatch]]:
    """Layers ``checked`` ([0, 2), or the model's last ones, [2, 4)) on a primary with one
    independent replica (its only checker), the other span on one node (never checked:
    no replica), and an arbiter of ``checked`` outside the session."""
    other = (2, 4) if checked == (0, 2) else (0, 2)
    primary, checker, lone, judge = [
        await start_node([checked]),
        await start_node([checked]),
        await start_node([other]),
        await start_node([checked]),
    ]
    if primary_corrupts is not None:
        primary.servicer._failpoints = CorruptsOneCall(primary_corrupts)
    if checker_corrupts:
        checker.servicer._failpoints = CorruptsOneCall(None)
    if primary_delay_ms:
        primary.servicer._failpoints = failpoints.Failpoints(
            failpoints.parse(f"delay_ms={primary_delay_ms}")
        )
    nodes = [primary, checker, lone]
    accounts = {n.node_id: f"op-{i}" for i, n in enumerate(nodes)}
    hops = sorted([(*checked, primary, [checker]), (*other, lone, [])], key=lambda h: h[0])
    grant = keyed(keys, session_grant(keys, hops), nodes, accounts, 0.5)
    draws = Armed()
    mismatches: list[evidence.Mismatch] = []
    channels = ChannelPool()
    verifier = StageVerifier(
        grant.session_id, channels, arbiter(keys, judge, mismatches, reports), rng=draws
    )
    driver = PipelineDriver(grant, MODEL, channels=channels, verifier=verifier)
    return driver, draws, primary, checker, mismatches


async def test_a_corrupted_step_nobody_checked_is_found_by_a_later_catch_up(
    start_node, keys
) -> None:
    # Calls of the primary: 1 the prompt, 2 and 3 the first decode steps. Call 3 is
    # corrupted while no check is drawn; the first check comes after token 4.
    driver, draws, cheater, _, mismatches = await swarm(start_node, keys, primary_corrupts=3)

    with pytest.raises(OutputTainted) as raised:
        await greedy(driver, PROMPT, NEW_TOKENS, after_step={4: arm_after(draws)})
    stats = driver.verifier.stats
    corrupted = len(PROMPT) + 1  # the position call 3 computed
    assert raised.value.position == corrupted
    assert f"position {corrupted}" in str(raised.value) and "generate again" in str(raised.value)
    mismatch = assert_proven(raised, stats, mismatches, cheater, (0, 2), corrupted)
    assert len(mismatch.comparison.prefix) >= 1  # the history before the step, as signed
    assert stats.audited_layer_tokens > 0
    await driver.close()


async def test_an_honest_swarm_is_audited_without_a_finding(start_node, keys, checkpoint) -> None:
    reports: list[verification_pb2.VerificationReport] = []
    driver, draws, primary, _, mismatches = await swarm(start_node, keys, reports=reports)

    tokens = await greedy(driver, PROMPT, NEW_TOKENS, after_step={4: arm_after(draws)})
    assert tokens == reference_greedy(checkpoint, PROMPT, NEW_TOKENS)
    stats = driver.verifier.stats
    # The first check's catch-up replayed the prompt and the unchecked decode steps: every
    # position of layers [0, 2) before it, two layers each.
    assert stats.audited_layer_tokens >= (len(PROMPT) + 4) * 2
    assert not stats.findings and not mismatches and not driver.failovers
    # The session's risk counts the audited steps as checked: the prompt and the decode
    # steps before the first check, each once, beside the checks of every later step.
    assert stats.audited[primary.node_id] >= 5
    await driver.verifier.finish()
    # Every audited step went to the coordinator as an agreement signed by both nodes (it
    # earns them trust there), vouched for by the checker's catch-up answers.
    reported = [a for r in reports for a in r.audits]
    assert len(reported) == stats.audited[primary.node_id]
    assert {a.primary.node_id for a in reported} == {primary.node_id}
    assert len({a.primary.signature for a in reported}) == len(reported)
    assert all(a.checker.step >= a.primary.step for a in reported)
    calls = {c.node_id: c for c in reports[-1].calls}[primary.node_id]
    assert calls.checked == stats.checked[primary.node_id] + stats.audited[primary.node_id]
    assert calls.checked <= calls.calls == stats.calls[primary.node_id]
    await driver.close()


async def test_a_checker_whose_catch_up_lies_cannot_stop_a_generation(
    start_node, keys, checkpoint
) -> None:
    driver, draws, primary, checker, mismatches = await swarm(
        start_node, keys, checker_corrupts=True
    )

    tokens = await greedy(driver, PROMPT, NEW_TOKENS, after_step={4: arm_after(draws)})
    assert tokens == reference_greedy(checkpoint, PROMPT, NEW_TOKENS)
    stats = driver.verifier.stats
    assert mismatches, "the lying checker's answers were taken to the arbiter"
    assert all(f.outcome == "CHECKER_WRONG" for f in stats.findings)
    assert primary.node_id in {h.node_id for h in driver.route}
    assert not [f for f in driver.failovers if f.failed_node_id == primary.node_id]
    await driver.close()


async def test_a_call_whose_answer_comes_after_its_warm_up_is_audited_at_the_next_call(
    start_node, keys, checkpoint
) -> None:
    # The primary answers 80 ms late, so the checker's warm-up (which replays the call
    # under way) is back first: that call's step is compared at the span's next call.
    driver, draws, primary, *_ = await swarm(start_node, keys, primary_delay_ms=80)

    tokens = await greedy(driver, PROMPT, 8, after_step={4: arm_after(draws)})
    assert tokens == reference_greedy(checkpoint, PROMPT, 8)
    stats = driver.verifier.stats
    node = primary.node_id
    # Every call of the primary was compared once: by its own check, or by an audit.
    assert stats.checked[node] + stats.audited[node] == stats.calls[node]
    assert stats.audited[node] == 6  # the prompt and decode steps 1-5, before any check
    assert not stats.findings
    await driver.close()


async def test_many_audits_go_in_reports_of_bounded_size(
    start_node, keys, checkpoint, monkeypatch
) -> None:
    monkeypatch.setattr(client_verification, "AUDITS_TO_FLUSH", 2)
    monkeypatch.setattr(client_verification, "AUDITS_PER_REPORT", 3)
    reports: list[verification_pb2.VerificationReport] = []
    driver, draws, primary, _, _ = await swarm(start_node, keys, reports=reports)
    tokens = await greedy(driver, PROMPT, NEW_TOKENS, after_step={4: arm_after(draws)})
    assert tokens == reference_greedy(checkpoint, PROMPT, NEW_TOKENS)
    # Sent while the generation ran, as soon as 2 waited (not only at the session's end).
    assert sum(len(r.audits) for r in reports) >= 2
    await driver.verifier.finish()
    sizes = [len(r.audits) for r in reports if r.audits]
    # Never more than 3 in a report, and none lost.
    assert len(sizes) >= 2 and max(sizes) <= 3
    assert sum(sizes) == driver.verifier.stats.audited[primary.node_id]
    await driver.close()
