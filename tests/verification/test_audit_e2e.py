"""An audit end to end: a real coordinator and four real node agents on loopback.

Every node is the turncoat agent of tests/ledger: the real `tessera-node`, whose corrupt
failpoint acts only while a trigger file exists. The test holds the trigger of one node of
the route for two steps (the first hop's, or the model's last hop's), and the client draws
no check until the test arms them (its random draws are scripted here; the nodes and the
coordinator are untouched). So two steps are corrupted that no check was drawn for. The
first check drawn after them warms its checker up on the session's history, that catch-up
audits the steps it replays (hidden states on the first hop; on the last, a probe of the
logits at each position), the checker runs a corrupted step again, and the coordinator's
own arbiter (another replica, of another operator) proves the node wrong: it is banned
with stored evidence, and the generation stops with OutputTainted naming it and the first
corrupted position.
"""

from __future__ import annotations

import random
import sqlite3
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import pytest
from support.market import (
    PROMPT,
    make_market_checkpoint,
    running_market,
    serves,
    turncoats,
    wait_for,
)

import client.verification as verification
from client.api import Client, GeneratedToken
from client.driver import DriverConfig
from client.errors import OutputTainted
from client.local_swarm import LocalSwarm
from client.records import HopRecord
from protos.tessera.v1 import node_pb2

pytestmark = pytest.mark.slow

MODEL = "tiny-llama"
NODES = {"alpha": 0, "bravo": 0, "charlie": 0, "delta": 0}  # a free swarm


class Scripted:
    """The client's check draws: none (1.0 is never below a checking probability) until
    the test arms ``checks`` of them (0.0 is below any)."""

    checks = 0

    def __init__(self) -> None:
        self._choices = random.Random(3)

    def random(self) -> float:
        if Scripted.checks > 0:
            Scripted.checks -= 1
            return 0.0
        return 1.0

    def choice(self, seq):  # noqa: ANN001, ANN201
        return self._choices.choice(seq)


@contextmanager
def generating(
    swarm: LocalSwarm, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[Client, dict[str, str], Iterator[GeneratedToken]]]:
    """A client whose check draws are scripted (none until armed), once every node serves,
    and its generation of 10 tokens after PROMPT, stepped on demand: (client, node ids by
    name, the tokens)."""
    monkeypatch.setattr(verification, "random", SimpleNamespace(Random=Scripted))
    Scripted.checks = 0
    # Two hops even on one node, so that the hop under test is a hop of its own.
    config = DriverConfig(merge_same_node_hops=False)
    with Client(swarm.address, driver_config=config) as client:
        ids = {n.name: n.node_id for n in client.nodes()}
        wait_for(lambda: all(serves(client, ids[n]) for n in NODES), "every node to serve")
        tokens = client.generate(
            MODEL, token_ids=PROMPT, max_new_tokens=10, stop_at_eos=False, run_ahead=False
        )
        yield client, ids, tokens


def wait_banned(swarm: LocalSwarm, node_id: str) -> None:
    with Client(swarm.address) as client:
        wait_for(
            lambda: (
                {n.node_id: n.state for n in client.nodes(include_offline=True)}.get(node_id)
                == node_pb2.NODE_STATE_BANNED
            ),
            f"node {node_id} to be banned",
        )


class Cheat:
    """The turncoat on hop ``hop`` of the route corrupts steps 1 and 2 of a generation: its
    trigger is held from the first token to the third."""

    def __init__(
        self, client: Client, ids: dict[str, str], triggers: dict[str, Path], hop: int
    ) -> None:
        self.client, self.triggers, self.hop = client, triggers, hop
        self.names = {node_id: name for name, node_id in ids.items()}
        self.seen: list[int] = []
        self.cheater = ""
        self.route: list[HopRecord] = []

    def run(self, tokens: Iterator[GeneratedToken], after: Callable[[int], None]) -> None:
        """Take every token; ``after(n)`` runs after the n-th."""
        for token in tokens:
            self.seen.append(token.id)
            if len(self.seen) == 1:
                self.route = self.client.last_run.initial_route
                self.cheater = self.route[self.hop].node_id
                self.triggers[self.names[self.cheater]].touch()
            elif len(self.seen) == 3:
                self.triggers[self.names[self.cheater]].unlink()
            after(len(self.seen))


@pytest.fixture(params=["first", "last"])
def market(
    tmp_path: Path, request: pytest.FixtureRequest
) -> Iterator[tuple[LocalSwarm, dict[str, Path], str]]:
    # Every node is a turncoat with a trigger of its own: the test turns whichever node the
    # router puts on the hop under test.
    scripts, env, triggers = turncoats(tmp_path, NODES, "corrupt=1.0,seed=5")
    with running_market(
        tmp_path / "swarm",
        make_market_checkpoint(tmp_path / "ckpt"),
        scripts,
        # Every node holds every stage: there is always an arbiter of another operator.
        layout=("--min-stages", "2", "--replicas", "4"),
        coordinator_args=("--canary-interval", "0"),
        node_env=env,
        prices=NODES,
    ) as swarm:
        yield swarm, triggers, request.param


def test_an_unchecked_corruption_is_audited_proven_and_ends_the_generation(
    market: tuple[LocalSwarm, dict[str, Path], str], monkeypatch: pytest.MonkeyPatch
) -> None:
    swarm, triggers, hop = market

    def arm(seen: int) -> None:
        if seen == 3:
            # One check drawn per hop, the first hop's first: its checker warms up, and
            # audits. The last hop's draw comes second. (The router may put the cheater on
            # both hops: then the first hop is corrupted too.)
            Scripted.checks = 1 if hop == "first" else 2

    with generating(swarm, monkeypatch) as (client, ids, tokens):
        cheat = Cheat(client, ids, triggers, 0 if hop == "first" else -1)
        with pytest.raises(OutputTainted) as raised:
            cheat.run(tokens, arm)
        result = client.last_run
    route, cheater = cheat.route, cheat.cheater
    last_layer = route[-1].end
    assert raised.value.node_id == cheater
    assert raised.value.position == len(PROMPT)  # the first decode step's position
    # That step computed generated token 1 (token 0 came from the prompt's step).
    assert raised.value.first_suspect_token == 1
    assert "generated token 1 on may be wrong" in str(raised.value)
    proven = [f for f in result.verification.findings if f.outcome == "PRIMARY_WRONG"]
    assert proven and {f.node_id for f in proven} == {cheater}
    where = (0, route[0].end) if hop == "first" else (route[-1].start, last_layer)
    assert where in {(f.layer_start, f.layer_end) for f in proven}
    assert min(f.start_pos for f in proven) == len(PROMPT)
    assert result.finish_reason == "error"
    # The coordinator's arbiter proved it: banned, with the evidence kept.
    wait_banned(swarm, cheater)
    with sqlite3.connect(swarm.coordinator_dir / "coordinator.db") as db:
        (evidence,) = db.execute(
            "SELECT COUNT(*) FROM verification_evidence WHERE accused_node_id = ? "
            "AND kind = 'arbitration'",
            [cheater],
        ).fetchone()
    assert evidence >= 1


def test_an_honest_generation_s_audits_earn_its_nodes_trust(
    market: tuple[LocalSwarm, dict[str, Path], str], monkeypatch: pytest.MonkeyPatch
) -> None:
    swarm, _, hop = market
    with generating(swarm, monkeypatch) as (client, _, tokens):
        for seen, _ in enumerate(tokens, 1):
            if seen == 4:
                Scripted.checks = 1 if hop == "first" else 2  # as in the test above
        result = client.last_run
        audited = result.route[0 if hop == "first" else -1].node_id
        stats = result.verification
        # The prompt's step and the decode steps before the check, audited by its warm-up.
        assert stats.audited[audited] >= 4 and not stats.findings
        # The real coordinator accepted them (both signatures, the pairing) and credited
        # each as a verified result: far more than the one check drawn.
        wait_for(
            lambda: (
                {n.node_id: n.trust for n in client.nodes()}[audited].verified
                >= stats.audited[audited]
            ),
            "the audits to be credited",
        )


@pytest.mark.parametrize("market", ["first"], indirect=True)
def test_a_node_killed_after_an_unchecked_corruption_is_proven_wrong_by_its_replay(
    market: tuple[LocalSwarm, dict[str, Path], str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # No check is ever drawn. The first hop's node corrupts steps 1 and 2, then is killed
    # with kill -9: the replacement's replay recomputes those positions, the client
    # compares them with what the dead node signed, and at the session's end the doubted
    # step runs again on the replacement and goes to the coordinator's arbiter.
    swarm, triggers, _ = market
    with generating(swarm, monkeypatch) as (client, ids, tokens):
        cheat = Cheat(client, ids, triggers, 0)

        def kill(seen: int) -> None:
            if seen == 5:
                swarm.node(cheat.cheater).kill9()

        with pytest.raises(OutputTainted) as raised:
            cheat.run(tokens, kill)
        result = client.last_run
    cheater, seen = cheat.cheater, cheat.seen
    assert len(seen) == 10  # the generation ran to its end before the verdict came
    assert result.verification.check_steps == []
    assert [e.failed_node_id for e in result.failovers][:1] == [cheater]
    assert raised.value.node_id == cheater
    assert raised.value.position == len(PROMPT)
    proven = [f for f in result.verification.findings if f.outcome == "PRIMARY_WRONG"]
    assert {f.node_id for f in proven} == {cheater}
    assert min(f.start_pos for f in proven) == len(PROMPT)
    wait_banned(swarm, cheater)
