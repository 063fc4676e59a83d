"""A node's link turns slow mid-generation: hedging and the router keep token latency.

Six real node agents serve a three-stage pipeline with two replicas of every stage; each
node's data plane sits behind its own link emulator (tests/support/link_emulator.py), so
the driver, the coordinator and the peers' RTT probes all reach it through the link.
Mid-generation the link of the middle stage's primary gets +300 ms per round trip. The
driver hedges that call on the stage's alternate, takes the first answer and keeps the
alternate; the next session's route avoids the slow node (its reported step time and its
peers' RTT probes). The p95 of the per-token latency stays within 1.5x of a run measured
in this same test without the slow link, and the output is identical in every run.
(The test is robust to a loaded machine, not to a saturated one: 48 tokens of a tiny
model take well under a second per run.)
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import numpy as np
import pytest
from support.checkpoints import TINY_SHAPE, make_checkpoint
from support.link_emulator import LinkEmulator
from support.ports import reserved_ports
from support.waiting import wait_for

from client.api import Client, GenerationResult
from client.driver import DriverConfig
from client.local_swarm import LocalSwarm

pytestmark = pytest.mark.slow

MODEL = "tiny-llama"
PROMPT = [1, 5, 9, 23, 42, 7, 11]
NEW_TOKENS = 48
SLOW_AFTER = 5  # tokens before the link slows down
ADDED_RTT_MS = 300.0
LEARN_S = 20.0  # how long the coordinator may take to route new sessions around it
ATTEMPTS = 3
NODES = ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot")
# A LAN-scale floor: the tiny model's stage calls take a few ms, a WAN deployment's more.
CONFIG = DriverConfig(hedge_factor=3.0, hedge_floor_s=0.1)


@pytest.fixture(scope="module")
def links() -> Iterator[dict[str, LinkEmulator]]:
    made: dict[str, LinkEmulator] = {}
    yield made
    for link in made.values():
        link.stop_thread()


@pytest.fixture(scope="module")
def swarm(tmp_path_factory: pytest.TempPathFactory, links) -> Iterator[LocalSwarm]:
    work = tmp_path_factory.mktemp("swarm")
    checkpoint = make_checkpoint(
        work / "tiny", "llama", num_layers=6, **TINY_SHAPE, seed=7,
    )  # fmt: skip
    with LocalSwarm(
        work, coordinator_args=["--min-stages", "3", "--replicas", "2", "--heartbeat-interval", "1"]
    ) as s:
        s.start_coordinator()
        nodes = []
        advertised = {}
        # The proxies listen on port 0: hold the nodes' ports until every proxy is up, or
        # one proxy could be given a port a node is about to listen on.
        with reserved_ports(len(NODES)) as ports:
            for name, port in zip(NODES, ports, strict=True):
                link = LinkEmulator("127.0.0.1", port, name=f"link->{name}")
                links[name] = link
                advertised[name] = (port, link.start_in_thread())
        for name, (port, address) in advertised.items():
            args = ["--listen", f"127.0.0.1:{port}", "--advertise", address]
            nodes.append(s.start_node(name, args))
        s.wait_registered(nodes)
        s.add_model(checkpoint, MODEL)
        yield s


def run(client: Client, slow_down=None) -> tuple[GenerationResult, list[float]]:
    """Generate; returns the record and the latency of each decoded token (seconds)."""
    stamps = []
    for token in client.generate(
        MODEL, token_ids=PROMPT, max_new_tokens=NEW_TOKENS, stop_at_eos=False
    ):
        stamps.append(time.monotonic())
        if slow_down is not None and token.index + 1 == SLOW_AFTER:
            slow_down(client.last_run)
    assert client.last_run is not None
    return client.last_run, list(np.diff(stamps))


def p95(values: list[float]) -> float:
    return float(np.percentile(values, 95))


def test_a_link_slowed_mid_generation_is_hedged_and_then_avoided(swarm, links):
    by_id = {p.node_id: p.name for p in swarm.processes if p.name in NODES}
    with Client(swarm.address, driver_config=CONFIG) as client:

        def replicated() -> bool:
            info = {m.name: m for m in client.models()}.get(MODEL)
            return bool(info and info.available and min(info.ready_replicas) >= 2)

        wait_for(replicated, "two ready replicas of every layer")
        run(client)  # warm-up: connections, first-use costs
        # Latency on a shared 2-core test machine is noisy (other processes burst for a
        # few hundred ms), so the comparison may take up to ATTEMPTS tries, each with its
        # own reference measured right before: the slower p95 of two runs without the slow
        # link. Every functional check holds on every try. A hedge that did not work would
        # cost 300 ms on every token after the slow-down: 10x the reference, on every try.
        tries: list[str] = []
        for _ in range(ATTEMPTS):
            baseline, fast_latency = run(client)
            second, second_latency = run(client)
            assert second.token_ids == baseline.token_ids
            reference = max(p95(fast_latency), p95(second_latency))
            stages = baseline.granted_stages
            assert len(stages) == 3 and len({h.node_id for h in stages}) == 3, stages

            victim: list[str] = []

            def slow_down(record: GenerationResult, victim: list[str] = victim) -> None:
                middle = record.granted_stages[1].node_id
                victim.append(middle)
                links[by_id[middle]].set(delay_ms=ADDED_RTT_MS / 2)  # each way

            slowed, slow_latency = run(client, slow_down)
            [slow_id] = victim
            assert slowed.token_ids == baseline.token_ids, "hedging changed the output"
            hedges = [h for h in slowed.hedges if h.slow_node_id == slow_id]
            assert hedges and hedges[0].winner == "alternate", slowed.hedges
            assert slow_id not in {h.node_id for h in slowed.route}, slowed.failovers
            assert not slowed.failovers, "a hedge, not a fail-over, should have handled it"
            tries.append(
                f"p95 {p95(slow_latency) * 1e3:.1f} ms with the slow link vs "
                f"{reference * 1e3:.1f} ms without; slowed run "
                f"{[round(v * 1e3) for v in slow_latency]}, hedges {slowed.hedges}"
            )
            if p95(slow_latency) <= 1.5 * reference:
                break
            links[by_id[slow_id]].set(delay_ms=0)  # the next try slows whoever serves then
        else:
            raise AssertionError("\n".join(tries))

        # The coordinator learned it (the reported slow call, the peers' probes): a new
        # session is routed around the slow node from the start. (Its latency is not
        # compared: the slow node is still the stage's only other replica, and the
        # verifier's sampled checks on it stall the tokens they check; see docs/hedging.md.)
        # Peers probe every 2 s and report with telemetry every 3 heartbeats (1 s here), so
        # the coordinator may need a few seconds: it must learn within LEARN_S.
        deadline = time.monotonic() + LEARN_S
        while True:
            after, _ = run(client)
            assert after.token_ids == baseline.token_ids
            if slow_id not in {h.node_id for h in after.granted_stages}:
                break
            assert time.monotonic() < deadline, (
                f"new sessions still go through the slow node {LEARN_S:.0f} s later: "
                f"{after.granted_stages}"
            )
            time.sleep(1.0)
