"""A coordinator outage in the middle of a generation, with real processes on loopback.

The coordinator hands out routes and signs capabilities, but nodes check a capability
offline and the client drives the pipeline itself, so a session that is already open
needs no coordinator. kill -9 the coordinator mid-generation, then kill -9 the node serving
the middle stage while it is still down: the driver fails over to the stage's alternate
from the route it holds, and the output equals transformers' greedy run. Restarted on its
database and address, the coordinator gets its nodes back and serves new sessions.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from support.checkpoints import TINY_SHAPE, make_checkpoint, transformers_greedy
from support.swarms import three_stage_swarm
from support.waiting import wait_for

from client.api import Client, GenerationResult
from client.driver import DriverConfig
from client.errors import CoordinatorUnavailable
from client.local_swarm import LocalSwarm

pytestmark = pytest.mark.slow

MODEL = "tiny-llama"
PROMPT = [1, 5, 9, 23, 42, 7, 11]
NEW_TOKENS = 20
NODES = ("alpha", "bravo", "charlie", "delta")
COORDINATOR_DIES_AFTER = 5  # tokens
NODE_DIES_AFTER = 10


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(
        tmp_path_factory.mktemp("ckpt") / "tiny", "llama", num_layers=6, **TINY_SHAPE, seed=7
    )


@pytest.fixture(scope="module")
def swarm(tmp_path_factory: pytest.TempPathFactory, checkpoint: Path) -> Iterator[LocalSwarm]:
    # The node killed during the outage never re-attaches: the restarted coordinator waits
    # this long for it before it re-plans around it (45 s by default).
    grace = ["--reattach-grace", "5"]
    with three_stage_swarm(tmp_path_factory.mktemp("swarm"), checkpoint, MODEL, NODES, grace) as s:
        yield s


def serving(client: Client, replicas: int) -> bool:
    """The model is available with ``replicas`` ready replicas of every layer; False while
    the coordinator cannot be reached (it is starting again)."""
    try:
        info = {m.name: m for m in client.models()}.get(MODEL)
    except CoordinatorUnavailable:
        return False
    return bool(info and info.available and min(info.ready_replicas) >= replicas)


def online(client: Client) -> set[str]:
    try:
        return {n.node_id for n in client.nodes()}
    except CoordinatorUnavailable:
        return set()


def generate_through_the_outage(swarm: LocalSwarm, client: Client) -> tuple[GenerationResult, str]:
    """One generation, stepped on demand so that each kill lands between two steps; returns
    its result and the node id of the middle stage's node, killed while the coordinator
    was down."""
    victim = ""
    for token in client.generate(
        MODEL, token_ids=PROMPT, max_new_tokens=NEW_TOKENS, stop_at_eos=False, run_ahead=False
    ):
        if token.index + 1 == COORDINATOR_DIES_AFTER:
            swarm.coordinator.kill9()
        elif token.index + 1 == NODE_DIES_AFTER:
            assert client.last_run is not None
            # Whoever serves the middle stage now: a straggler hedge (this machine may be
            # busy) may have moved it off the node the session was granted.
            middle = client.last_run.granted_stages[1]
            [victim] = [h.node_id for h in client.last_run.route if h.start <= middle.start < h.end]
            swarm.node(victim).kill9()
    assert client.last_run is not None
    return client.last_run, victim


def test_a_generation_outlives_its_coordinator_and_a_node_dying_while_it_is_down(
    swarm: LocalSwarm, checkpoint: Path
) -> None:
    (reference,) = transformers_greedy(checkpoint, [PROMPT], NEW_TOKENS)
    address = swarm.address
    # Checks settle before each token is yielded: with deferred checks the driver steps on
    # while tokens wait for theirs, and on a busy machine it could finish the generation
    # before the kills below, which must land between two steps.
    with Client(address, driver_config=DriverConfig(defer_checks=False)) as client:
        wait_for(lambda: serving(client, 2), "two ready replicas of every layer", 90)
        result, victim = generate_through_the_outage(swarm, client)
        assert not swarm.coordinator.alive()
        assert result.token_ids == reference, "the outage changed the output"
        # The middle stage moved to the alternate the route named, with no coordinator to
        # ask; its history was replayed there.
        [failover] = result.failovers
        assert (failover.failed_node_id, failover.via) == (victim, "alternate")
        assert failover.replayed_tokens >= len(PROMPT) + NODE_DIES_AFTER - 1
        assert victim not in {h.node_id for h in result.route}
        # The session could not be closed with the coordinator; its usage is kept to settle.
        assert result.settlement is None and result.close_request is not None
        assert result.finish_reason == "length"

        survivors = {p.node_id for p in swarm.processes if p.alive() and p.name in NODES}
        assert len(survivors) == len(NODES) - 1 and victim not in survivors
        swarm.start_coordinator(listen=address)
        # The surviving nodes attach again by themselves (the killed one stays gone), and
        # the coordinator places the model on them.
        wait_for(lambda: online(client) == survivors, "the survivors to attach again", 90)
        wait_for(lambda: serving(client, 2), "two ready replicas on the survivors", 90)
        again = client.generate_all(
            MODEL, token_ids=PROMPT, max_new_tokens=NEW_TOKENS, stop_at_eos=False
        )
        assert again.token_ids == reference
