"""Audits of the model's last hop: a checker's catch-up compared with unchecked logits.

The last hop's answers are logits, which no hop takes as input: the client keeps the
primary's rows (client/kept_logits.py) and the checker's catch-up answers a probe per
position (protos/logit_probes.py) and the whole row at its last one. Real stage servers on
loopback; draws scripted as in test_catch_up_audits.py (no check until armed, then one at
every draw), so a corrupted step is one no check was drawn for. The arbiter is built from
the coordinator's own evidence checks and data-plane runner on a fourth, honest node.
"""

from __future__ import annotations

import pytest
from data_plane.stage_harness import (
    MODEL,
    VOCAB,
    reference_greedy,
    session_grant,
)
from data_plane.test_driver import PROMPT, greedy
from verification.test_catch_up_audits import (
    NEW_TOKENS,
    Armed,
    arm_after,
    assert_proven,
    swarm,
)
from verification.test_driver_verification import keyed

from client import verification as client_verification
from client.channels import ChannelPool
from client.driver import PipelineDriver
from client.errors import OutputTainted
from client.verification import StageVerifier
from node_agent import stage_server
from node_agent.stage_server import StageLimits
from protos.tessera.v1 import stage_pb2

LAST = (2, 4)  # the model's last layers: the hop whose answers are logits


async def test_corrupted_logits_nobody_checked_are_found_by_a_later_catch_up(
    start_node, keys
) -> None:
    # Calls of the last hop's primary: 1 the prompt, 2 and 3 the first decode steps. Call 3
    # answers wrong logits while no check is drawn; the first check comes after token 4.
    driver, draws, cheater, _, mismatches = await swarm(
        start_node, keys, checked=LAST, primary_corrupts=3
    )
    with pytest.raises(OutputTainted) as raised:
        await greedy(driver, PROMPT, NEW_TOKENS, after_step={4: arm_after(draws)})
    corrupted = len(PROMPT) + 1  # the position call 3 answered the logits of
    stats = driver.verifier.stats
    mismatch = assert_proven(raised, stats, mismatches, cheater, (2, 4), corrupted)
    # The arbiter ran the step as the primary had, for its last position's logits.
    assert mismatch.comparison.last_position_only
    await driver.close()


async def test_an_honest_last_hop_is_audited_with_probes_and_whole_rows(
    start_node, keys, checkpoint, monkeypatch
) -> None:
    answered: list[stage_pb2.ProbeAnswer] = []
    real = stage_server._probe_answer

    def spy(row, probe):  # type: ignore[no-untyped-def]
        answered.append(real(row, probe))
        return answered[-1]

    monkeypatch.setattr(stage_server, "_probe_answer", spy)
    driver, draws, primary, _, mismatches = await swarm(start_node, keys, checked=LAST)
    tokens = await greedy(driver, PROMPT, NEW_TOKENS, after_step={4: arm_after(draws)})
    assert tokens == reference_greedy(checkpoint, PROMPT, NEW_TOKENS)
    stats = driver.verifier.stats
    # The first check's catch-up replayed the prompt and the unchecked decode steps in one
    # chunk: each of the primary's answers in it was compared, by a probe or (the chunk's
    # last position) by the whole row, and every later call had a check of its own.
    assert len(answered) >= 4
    assert stats.audited[primary.node_id] >= 5
    assert (
        stats.checked[primary.node_id] + stats.audited[primary.node_id]
        == (stats.calls[primary.node_id])
    )
    assert not stats.findings and not mismatches and not driver.failovers
    # Rows compared are let go: what stays is only what no catch-up has reached yet.
    assert len(driver.verifier._rows) <= 1
    await driver.close()


def lie(answers: list[stage_pb2.ProbeAnswer]) -> None:
    for answer in answers:
        answer.top_logits[0] += 50.0


def drop(answers: list[stage_pb2.ProbeAnswer]) -> None:
    del answers[:]


@pytest.mark.parametrize("tamper", [lie, drop], ids=["lies", "answers-none"])
async def test_a_checker_whose_probes_fail_costs_a_recheck_and_nothing_else(
    start_node, keys, checkpoint, tamper
) -> None:
    driver, draws, primary, checker, mismatches = await swarm(start_node, keys, checked=LAST)
    forward = checker.servicer._forward_one

    async def tampering(request, stream):  # type: ignore[no-untyped-def]
        response = await forward(request, stream)
        if response is not None:
            tamper(response.probe_answers)
        return response

    checker.servicer._forward_one = tampering  # type: ignore[method-assign]
    rechecked: list[int] = []
    recheck = driver.verifier._recheck

    async def counting(checker_hop, span, step, history):  # type: ignore[no-untyped-def]
        rechecked.append(step.step)
        await recheck(checker_hop, span, step, history)

    driver.verifier._recheck = counting  # type: ignore[method-assign]
    tokens = await greedy(driver, PROMPT, NEW_TOKENS, after_step={4: arm_after(draws)})
    assert tokens == reference_greedy(checkpoint, PROMPT, NEW_TOKENS)
    await driver.verifier.finish()
    stats = driver.verifier.stats
    # Each step its probe failed ran again on the checker, exactly as the primary ran it;
    # the two signed rows agreed, so nobody went to the arbiter and the primary kept serving.
    assert len(rechecked) >= 4
    assert not stats.findings and not mismatches
    assert primary.node_id in {h.node_id for h in driver.route}
    await driver.close()


async def test_a_last_hop_nobody_can_check_keeps_no_rows(start_node, keys, checkpoint) -> None:
    first, last = await start_node([(0, 2)]), await start_node([(2, 4)])
    nodes = [first, last]
    accounts = {n.node_id: f"op-{i}" for i, n in enumerate(nodes)}
    grant = keyed(
        keys, session_grant(keys, [(0, 2, first, []), (2, 4, last, [])]), nodes, accounts, 0.5
    )
    channels = ChannelPool()
    verifier = StageVerifier(grant.session_id, channels, rng=Armed())
    driver = PipelineDriver(grant, MODEL, channels=channels, verifier=verifier)
    tokens = await greedy(driver, PROMPT, NEW_TOKENS)
    assert tokens == reference_greedy(checkpoint, PROMPT, NEW_TOKENS)
    # Every answer's signature was checked, but no catch-up can ever come for the last hop:
    # none of its rows was kept.
    assert verifier.stats.calls[last.node_id] == NEW_TOKENS
    assert len(verifier._rows) == 0
    await driver.close()


async def test_a_long_catch_up_is_cut_into_calls_whose_probes_a_node_can_read(
    start_node, keys, checkpoint, monkeypatch
) -> None:
    # The checker reads at most 3 rows of logits per call, and the client sizes its calls
    # for that many: a catch-up over the prompt and 4 decode steps goes in calls of 3.
    rows = 3 * VOCAB * 4
    monkeypatch.setattr(client_verification, "PROBE_ROWS_BYTES", rows)
    driver, draws, primary, checker, mismatches = await swarm(start_node, keys, checked=LAST)
    checker.servicer.limits = StageLimits(max_output_bytes=rows)
    probed: list[int] = []
    forward = checker.servicer._forward_one

    async def counting(request, stream):  # type: ignore[no-untyped-def]
        probed.append(len(request.probes))
        return await forward(request, stream)

    checker.servicer._forward_one = counting  # type: ignore[method-assign]
    tokens = await greedy(driver, PROMPT, NEW_TOKENS, after_step={4: arm_after(draws)})
    assert tokens == reference_greedy(checkpoint, PROMPT, NEW_TOKENS)
    stats = driver.verifier.stats
    # Cut into several calls (each one's last position is compared on its whole row, the
    # others by probes), none asking for more rows than the checker reads.
    assert max(probed) <= 3 and len([n for n in probed if n]) >= 2
    assert (
        stats.checked[primary.node_id] + stats.audited[primary.node_id]
        == (stats.calls[primary.node_id])
    )
    assert not stats.findings and not mismatches
    await driver.close()
