"""Deferred checks: Client.generate goes on while a step's checks run, and rolls back.

Real stage servers on loopback (see stage_harness) with the in-test coordinator; every
call is checked (probability 1) and the checkers answer checks slowly, as a slower card
would. The generation must not wait for them, must yield a token only once the checks it
depends on have settled, and when a check rejects the primary of a step the pipeline has
already gone past, must go back to that step: the output equals the whole model's, for
greedy decoding and for seeded sampling alike.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from data_plane.stage_harness import (
    MODEL,
    NUM_LAYERS,
    BackgroundLoop,
    CoordinatorKeys,
    FakeCoordinator,
    StageNode,
    reference_greedy,
    reference_logits,
)
from verification.test_driver_verification import keyed

from client import Client
from client import cli as tessera_cli
from client.api import GeneratedToken, GenerationResult
from client.driver import DriverConfig
from client.sampling import Sampler, SamplingParams
from node_agent import failpoints
from node_agent.stage_server import StageError, StageServicer
from protos.tessera.v1 import client_api_pb2

PROMPT = [1, 5, 9, 13, 20]
NEW_TOKENS = 12
CHECK_DELAY_S = 0.3  # far longer than a step of the tiny model


class SlowChecker(StageServicer):
    """Honest, but answers the calls it runs as a checker only after a while."""

    async def _forward_one(self, request, stream):
        if request.background:
            await asyncio.sleep(CHECK_DELAY_S)
        return await super()._forward_one(request, stream)


class CheckedCoordinator(FakeCoordinator):
    """Grants what a real coordinator grants for verification: node keys, accounts, and a
    check probability of 1 for every node."""

    def __init__(self, keys, checkpoint, layout, nodes) -> None:
        super().__init__(keys, checkpoint, layout)
        self.nodes = nodes
        self.step_times: list[client_api_pb2.StepTime] = []

    async def OpenSession(self, request, context):  # noqa: N802
        grant = await super().OpenSession(request, context)
        accounts = {n.node_id: f"operator-{i}" for i, n in enumerate(self.nodes)}
        return keyed(self.keys, grant, self.nodes, accounts, 1.0)

    async def ReportStepTimes(self, request, context):  # noqa: N802
        self.step_times.extend(request.steps)
        return client_api_pb2.StepTimesAck(accepted=len(request.steps))


@dataclass
class Swarm:
    address: str
    cheater: StageNode
    checkpoint: Path
    coordinator: CheckedCoordinator


class HangsAfterTwoChecks(StageServicer):
    """Honest, but after its first two calls as a checker its machine starves it: no
    later check or catch-up is ever answered (the stream stays open)."""

    checks = 0

    async def _forward_one(self, request, stream):
        if request.background:
            self.checks += 1
            if self.checks > 2:
                await asyncio.Event().wait()
        return await super()._forward_one(request, stream)


class DiesAfterItsCalls(StageServicer):
    """Answers its first ``lives`` pipeline calls, then it is gone: every later pipeline
    call is refused as by a node that went away."""

    lives = 1
    calls = 0

    async def _forward_one(self, request, stream):
        if not request.background:
            self.calls += 1
            if self.calls > self.lives:
                raise StageError(grpc.StatusCode.UNAVAILABLE, "this node is shutting down")
        return await super()._forward_one(request, stream)


class CorruptsThenDies(DiesAfterItsCalls):
    """Its first pipeline call's output is corrupted (its failpoint), then it is gone."""


class DiesAfterThreeCalls(DiesAfterItsCalls):
    lives = 3


def start_swarm(
    checkpoint: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    *,
    corrupt: str = "0.3",
    cheater_class: type[StageServicer] = StageServicer,
    checker_class: type[StageServicer] = SlowChecker,
) -> Iterator[Swarm]:
    loop = BackgroundLoop()
    keys = CoordinatorKeys()

    async def start() -> tuple[CheckedCoordinator, list[StageNode]]:
        def node(name: str, shards: list[tuple[int, int]], **options) -> StageNode:
            return StageNode.start(
                checkpoint, keys.public, shards, data_dir=tmp_path / name, **options
            )

        # The first stage's primary corrupts some of its outputs (the failpoint is read
        # when its servicer starts); its replicas check, slowly.
        monkeypatch.setenv(failpoints.ENV_VAR, f"corrupt={corrupt},seed=1")
        cheater = await node("cheater", [(0, 2)], servicer_class=cheater_class)
        monkeypatch.delenv(failpoints.ENV_VAR)
        honest = [await node(f"honest{i}", [(0, 2)], servicer_class=checker_class)
                  for i in (1, 2)]  # fmt: skip
        last = [await node(f"last{i}", [(2, NUM_LAYERS)], servicer_class=checker_class)
                for i in (1, 2)]  # fmt: skip
        layout = [(0, 2, cheater, honest), (2, NUM_LAYERS, last[0], [last[1]])]
        coordinator = CheckedCoordinator(keys, checkpoint, layout, [cheater, *honest, *last])
        await coordinator.start()
        return coordinator, [cheater, *honest, *last]

    coordinator, nodes = loop.run(start())

    async def stop() -> None:
        await coordinator.stop()
        for n in nodes:
            await n.stop()

    try:
        yield Swarm(f"127.0.0.1:{coordinator.port}", nodes[0], checkpoint, coordinator)
    finally:
        loop.run(stop())
        loop.close()


# The same swarm for a `with` block: torn down however the block ends.
running_swarm = contextlib.contextmanager(start_swarm)


@pytest.fixture
def swarm(checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Swarm]:
    yield from start_swarm(checkpoint, tmp_path, monkeypatch)


def sampled_reference(checkpoint: Path, params: SamplingParams, new_tokens: int) -> list[int]:
    """Seeded sampling over the whole model's logits, one token at a time."""
    sampler, ids = Sampler(params), list(PROMPT)
    for _ in range(new_tokens):
        ids.append(sampler(reference_logits(checkpoint, ids)[-1], len(ids)))
    return ids[len(PROMPT) :]


def test_a_check_that_rejects_a_past_step_rolls_the_generation_back(swarm: Swarm) -> None:
    with Client(swarm.address, timeout_s=60) as client:
        result = client.generate_all(
            MODEL, token_ids=PROMPT, max_new_tokens=NEW_TOKENS, stop_at_eos=False
        )
    assert result.token_ids == reference_greedy(swarm.checkpoint, PROMPT, NEW_TOKENS)
    assert result.finish_reason == "length"
    # The pipeline went on past a step whose check later rejected the cheater.
    assert result.rollbacks, "no check ever rejected the cheater"
    assert all(r.rejected_node_id == swarm.cheater.node_id for r in result.rollbacks)
    assert any(r.discarded_positions > 0 for r in result.rollbacks)
    assert swarm.cheater.node_id not in {hop.node_id for hop in result.route}
    assert result.verification is not None and result.verification.mismatches >= 1


def test_seeded_sampling_draws_the_same_tokens_after_a_rollback(swarm: Swarm) -> None:
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=11)
    with Client(swarm.address, timeout_s=60) as client:
        result = client.generate_all(
            MODEL, token_ids=PROMPT, max_new_tokens=NEW_TOKENS, stop_at_eos=False,
            temperature=params.temperature, top_p=params.top_p, seed=params.seed,
        )  # fmt: skip
    assert result.rollbacks
    assert result.token_ids == sampled_reference(swarm.checkpoint, params, NEW_TOKENS)


def test_tokens_stream_only_once_their_checks_settled(swarm: Swarm) -> None:
    # Every call is checked and each check takes CHECK_DELAY_S, so no token can be
    # yielded before the first check answered: the stream lags the pipeline, never
    # runs ahead of its checks.
    with Client(swarm.address, timeout_s=60) as client:
        tokens = list(client.generate(MODEL, token_ids=PROMPT, max_new_tokens=4, stop_at_eos=False))
        result = client.last_run
    assert result is not None
    assert result.first_token_s >= CHECK_DELAY_S
    assert [t.id for t in tokens] == reference_greedy(swarm.checkpoint, PROMPT, 4)
    assert [t.index for t in tokens] == [0, 1, 2, 3]


def test_checks_can_be_settled_step_by_step_instead(swarm: Swarm) -> None:
    config = DriverConfig(defer_checks=False)
    with Client(swarm.address, timeout_s=60, driver_config=config) as client:
        result = client.generate_all(
            MODEL, token_ids=PROMPT, max_new_tokens=NEW_TOKENS, stop_at_eos=False
        )
    assert result.token_ids == reference_greedy(swarm.checkpoint, PROMPT, NEW_TOKENS)
    assert result.rollbacks == []  # every step waited for its checks: nothing to undo
    assert any(f.failed_node_id == swarm.cheater.node_id for f in result.failovers)


def test_a_rollback_after_the_rejected_node_already_left_the_route(
    checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The cheater corrupts the prefill, then dies at the next step: the driver fails over
    # to a replica before the prefill's (slow) check rejects the cheater. The rollback
    # then finds the cheater gone from the route and runs the prefill again, from the
    # first stage, through the route as it is now (the last stage had cached the
    # corrupted hidden states).
    options = {"corrupt": "1.0", "cheater_class": CorruptsThenDies}
    with running_swarm(checkpoint, tmp_path, monkeypatch, **options) as swarm:
        with Client(swarm.address, timeout_s=60) as client:
            result = client.generate_all(
                MODEL, token_ids=PROMPT, max_new_tokens=6, stop_at_eos=False
            )
        assert result.token_ids == reference_greedy(checkpoint, PROMPT, 6)
        [failover] = result.failovers
        assert failover.failed_node_id == swarm.cheater.node_id
        assert failover.position == len(PROMPT)  # the first decode step
        [rollback] = result.rollbacks
        assert (rollback.position, rollback.rejected_node_id) == (0, swarm.cheater.node_id)
        assert rollback.discarded_positions >= 1


def test_the_cli_says_when_a_check_sent_the_generation_back(swarm: Swarm, capsys) -> None:
    code = tessera_cli.main(
        [
            "generate", "--coordinator", swarm.address, "--model", MODEL,
            "--token-ids", ",".join(map(str, PROMPT)), "--max-new-tokens", str(NEW_TOKENS),
            "--no-stop-at-eos",
        ]
    )  # fmt: skip
    captured = capsys.readouterr()
    assert code == 0
    assert f"[{NEW_TOKENS} tokens," in captured.err
    assert f"a check proved node {swarm.cheater.node_id} wrong at position" in captured.err


def generate_tokens(
    address: str, count: int
) -> tuple[list[GeneratedToken], GenerationResult | None]:
    """The tokens as Client.generate yields them, and the run's record."""
    with Client(address, timeout_s=60) as client:
        tokens = list(
            client.generate(MODEL, token_ids=PROMPT, max_new_tokens=count, stop_at_eos=False)
        )
        return tokens, client.last_run


def test_a_held_token_reports_only_its_own_step(
    checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Every token waits for its step's slow checks while the next steps already run: what
    # each token reports (its requests, its fail-overs) must still be its own step's, not
    # the later steps' that ran while it was held.
    with running_swarm(checkpoint, tmp_path, monkeypatch, corrupt="0") as swarm:
        tokens, result = generate_tokens(swarm.address, 6)
        assert result is not None and not result.rollbacks and not result.failovers
        assert [t.id for t in tokens] == reference_greedy(swarm.checkpoint, PROMPT, 6)
        steps = [{timing.step for timing in t.stage_timings} for t in tokens]
        assert all(len(s) == 1 for s in steps), steps  # one step's requests each
        assert len({s.pop() for s in steps}) == len(tokens)  # and each its own step
        assert all(len(t.stage_timings) == 2 for t in tokens)  # both stages, once
        assert sum(len(t.stage_timings) for t in tokens) == len(result.timings)


def test_a_fail_over_is_reported_by_the_token_whose_step_went_through_it(
    checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The first stage's primary dies at its fourth call (the token of index 3) while the
    # tokens before it are still held for their slow checks: the fail-over belongs to that
    # token alone, not to the held ones that come out after it happened.
    options = {"corrupt": "0", "cheater_class": DiesAfterThreeCalls}
    with running_swarm(checkpoint, tmp_path, monkeypatch, **options) as swarm:
        tokens, result = generate_tokens(swarm.address, 6)
        assert result is not None
        assert [t.id for t in tokens] == reference_greedy(swarm.checkpoint, PROMPT, 6)
        [failover] = result.failovers
        assert failover.failed_node_id == swarm.cheater.node_id
        assert [len(t.failovers) for t in tokens] == [0, 0, 0, 1, 0, 0]
        assert tokens[3].failovers == (failover,)


def test_a_hung_checker_costs_its_token_seconds_not_the_check_timeout(
    checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Every call is checked, and every checker hangs after two checks. A check it never
    # answers is given up once the patience after its primary's answer has passed (1 s
    # here): the call goes unchecked and that checker is drawn no more. Before, the first
    # such check held its token for the whole 120 s check timeout.
    config = DriverConfig(check_patience_floor_s=1.0)
    with running_swarm(
        checkpoint, tmp_path, monkeypatch, corrupt="0", checker_class=HangsAfterTwoChecks
    ) as swarm:
        with Client(swarm.address, timeout_s=60, driver_config=config) as client:
            started = time.monotonic()
            result = client.generate_all(
                MODEL, token_ids=PROMPT, max_new_tokens=NEW_TOKENS, stop_at_eos=False
            )
            elapsed = time.monotonic() - started
    assert result.token_ids == reference_greedy(checkpoint, PROMPT, NEW_TOKENS)
    assert result.verification is not None
    late = result.verification.late
    primaries = {hop.node_id for hop in result.route}
    # Checks of later steps may already be queued on a checker when its first is given
    # up (the pipeline runs ahead): each of those is given up too, none waits longer.
    assert late and all(count >= 1 for count in late.values()), late
    assert result.to_json()["verification"]["late_checks"] == late  # what --json prints
    assert not primaries & set(late), "a primary's check was given up, not a checker's"
    assert sum(result.verification.checked.values()) >= 2  # the checks before the hang
    assert not result.rollbacks and not result.failovers
    assert elapsed < 60, f"the generation waited {elapsed:.0f} s for hung checkers"
    # Each late checker's unanswered message went to the coordinator's measured speed as
    # a lower bound: it was written before its primary answered, and given up 1 s after.
    reported = swarm.coordinator.step_times
    for checker in late:
        bounds = [s.wall_ms for s in reported if s.node_id == checker and s.wall_ms >= 900]
        assert bounds, (checker, [(s.node_id, s.wall_ms) for s in reported])
