"""The performance model on examples small enough to check by hand."""

import itertools
import math
from collections import Counter
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest
from placement_sim import joint_bound
from placement_sim.gpus import GpuSpec
from placement_sim.parallax import ParallaxSystem
from placement_sim.petals_greedy import PetalsSystem
from placement_sim.regions import Site
from placement_sim.serving import saturate, throughput_of
from placement_sim.swarm import Hop, handoff_s, layer_time_s, session_latency_s
from placement_sim.tessera import TesseraSystem
from placement_sim.upper_bound import (
    _hop_counts,
    hop_increments,
    lp_max,
    max_sessions,
    upper_bound_tokens_per_s,
)
from placement_toy import EXACT, FAR, HOME, LINE, TOY, gpu_holding, node, swarm, toy_model

# One toy layer: 10,487,808 params -> 20,975,616 bytes; KV 2*8*128*2 = 4096 bytes per token;
# mean context 256 tokens -> 1,048,576 KV bytes per session; flops per token
# 2*10,487,808 + 4*256*1024 = 22,024,192.
WEIGHTS, KV_PER_SESSION, FLOPS = 20_975_616, 1_048_576, 22_024_192
# LM head + final norm: 1000 * 1024 + 1024 = 1,025,024 params -> 2,050,048 bytes in fp16,
# read once per step at 100 GB/s on the node (memory bound below batch 10); on a client's
# CPU at 25 GB/s.
HEAD_BYTES = 2_050_048
HEAD = HEAD_BYTES / 1e11
CLIENT_HEAD = HEAD_BYTES / 25e9


def test_decode_is_memory_bound_at_small_batches_and_compute_bound_at_large():
    n = node("a")
    # 100 GB/s: (weights + 1 session's KV) / 1e11
    assert layer_time_s(n, TOY, EXACT, 1) == pytest.approx((WEIGHTS + KV_PER_SESSION) / 1e11)
    assert layer_time_s(n, TOY, EXACT, 2) == pytest.approx((WEIGHTS + 2 * KV_PER_SESSION) / 1e11)
    # 32 sessions: 32 * 22 MFLOP at 1 TFLOPS = 705 us > (21 MB + 33.5 MB) / 100 GB/s = 545 us
    assert layer_time_s(n, TOY, EXACT, 32) == pytest.approx(32 * FLOPS / 1e12)


def test_handoff_pushes_the_batch_through_the_upload_link():
    # 1024 hidden * 2 bytes * 8 bits / 8 Mb/s = 2.048 ms per session in the batch
    assert handoff_s(node("a"), TOY, 1) == pytest.approx(2.048e-3)
    assert handoff_s(node("a"), TOY, 3) == pytest.approx(3 * 2.048e-3)


def test_two_hop_session_latency_and_tokens_per_second_by_hand():
    s = swarm(node("a"), node("b"))
    hops = [Hop("a", 0, 2), Hop("b", 2, 4)]
    one = session_latency_s(s, HOME, hops, {"a": 1, "b": 1})
    # client->a 10 ms + 2 layers + hand-off 2.048 ms + a->b 10 ms + 2 layers + the head on b
    # + b->client 10 ms
    layer = (WEIGHTS + KV_PER_SESSION) / 1e11
    assert one == pytest.approx(0.030 + 2.048e-3 + 4 * layer + HEAD)
    assert one * 1000 == pytest.approx(32.94946816)
    # Petals: the client runs the head on its CPU instead.
    petals = session_latency_s(s, HOME, hops, {"a": 1, "b": 1}, client_runs_head=True)
    assert petals == pytest.approx(one - HEAD + CLIENT_HEAD)

    tokens_per_s, latencies, load = throughput_of(s, [(HOME, hops), (HOME, hops)])
    assert load == {"a": 2, "b": 2}
    layer2 = (WEIGHTS + 2 * KV_PER_SESSION) / 1e11
    both = 0.030 + 2 * 2.048e-3 + 4 * layer2 + HEAD  # 35.0394112 ms
    assert latencies == pytest.approx([both, both])
    assert tokens_per_s == pytest.approx(2 / both)
    assert tokens_per_s == pytest.approx(57.0786, rel=1e-4)


class FixedRoute:
    """A system that always routes through a and b: admission must stop at the KV slots."""

    name = "fixed"
    client_runs_head = False

    def __init__(self, s):
        self.swarm = s

    def route(self, client, load, full):
        return [Hop("a", 0, 2), Hop("b", 2, 4)]


def test_admission_stops_when_a_node_on_the_route_has_no_free_slot():
    s = swarm(node("a"), node("b"))
    served = saturate(FixedRoute(s), [HOME] * 10)
    assert served.sessions == EXACT.slots == 4
    layer4 = (WEIGHTS + 4 * KV_PER_SESSION) / 1e11
    per_token = 0.030 + 4 * 2.048e-3 + 4 * layer4 + HEAD
    assert served.tokens_per_s == pytest.approx(4 / per_token)
    assert served.percentile_ms(50) == pytest.approx(per_token * 1000)
    assert served.mean_hops == 2


def test_upper_bound_by_hand_for_one_node_that_holds_everything():
    s = swarm(node("a"))

    # One node, no hops. k sessions on it take k x (floor + 4 layers at batch k) together,
    # so the k-th adds floor + 4 x (k t(k) - (k-1) t(k-1)); floor = the client's 20 ms
    # round trip + the head at batch 1 on the node (cheaper than on the client's CPU).
    def layer(batch: int) -> float:
        return (WEIGHTS + batch * KV_PER_SESSION) / 1e11

    floor = 0.020 + HEAD
    expected = sum(1 / (floor + 4 * (k * layer(k) - (k - 1) * layer(k - 1))) for k in range(1, 5))
    assert upper_bound_tokens_per_s(s, [HOME] * 10) == pytest.approx(expected)
    # Each client is one session: one client, one slot's worth.
    assert upper_bound_tokens_per_s(s, [HOME]) == pytest.approx(1 / (floor + 4 * layer(1)))
    # The same node really serving 4 sessions is slower (batch 4 for all), so below the bound.
    real = 4 / (floor + 4 * layer(4))
    assert real < expected


def test_session_count_bound_is_the_bin_covering_lp():
    # L = 32, 4 slots: the 32-layer node carries 4 sessions alone; three 23-layer nodes need
    # two per session, so 12 slots make 6. Sum of capacities / L would allow 12.6.
    assert max_sessions([23, 23, 23, 32], 4, 32) == 10
    assert max_sessions([15, 15], 4, 32) == 0  # 30 layers cannot cover 32
    assert max_sessions([8, 8, 8, 8], 1, 32) == 1
    # 10 + 10 + 20: one session per slot needs {10, 10, 20} or {20, 20}; with one 20 and
    # two 10s, each session takes one of each.
    assert max_sessions([10, 10, 20], 4, 40) == 4
    value, duals = lp_max(np.array([[1.0, 2.0], [3.0, 1.0]]), np.array([4.0, 6.0]))
    assert value == pytest.approx(2.8) and duals == pytest.approx([0.4, 0.2])


def test_hops_of_all_sessions_together_follow_the_slots_they_fill():
    # L = 32, 2 slots on each of two 16-layer and two 8-layer nodes: at most 3 sessions, as
    # {16, 16} + 2 x {16, 8, 8}, which hop 1, 2 and 2 times. Per session, any one may hop
    # only once (two 16-layer nodes cover 32, and 4 slots allow 4 such sessions), so the
    # per-session floors add up to 3. Together, 3 sessions cover 96 layers: all 8 slots,
    # 8 visits, 5 hops. The first session covers 32 with 2 slots, two with 4.
    caps = np.array([16, 16, 8, 8])
    assert list(_hop_counts(caps, 2, 32, 3)) == [1, 1, 1]
    assert list(hop_increments(caps, 2, 32, 3)) == [1, 1, 3]
    # One 32-layer node and 4 slots: nobody has to hop; the count never goes below zero.
    assert list(hop_increments(np.array([32, 8]), 4, 32, 4)) == [0, 0, 0, 0]


def test_the_bound_charges_every_hop_out_of_a_node():
    # Two nodes holding 2 of the 4 layers each: every session hops once. Items on each node
    # carry half of (its nearest-peer RTT / 2 + hand-off); the last node's share is taken back
    # from the client floor, so a 2-hop session is bounded by client RTT + the hop + compute.
    model = toy_model(4)
    a = node("a", gpu=gpu_holding(2.5))
    b = node("b", gpu=gpu_holding(2.5))
    s = swarm(a, b, model=model)
    bound = upper_bound_tokens_per_s(s, [HOME] * 10)

    def layer(batch: int) -> float:
        return (WEIGHTS + batch * KV_PER_SESSION) / 1e11

    u = 2.048e-3  # hand-off of one session's hidden state at 8 Mb/s
    hop = 0.010 + u  # 20 ms RTT / 2 + hand-off at batch 1
    # (a) items of slot j on each node: 2 layers at layer(j) + hop / 2 each (the same hop
    # in every slot: the floor takes back a batch-1 hop, so no slot may carry more);
    # floor: 20 ms / 2 + (20 ms / 2 - hop) + the head at batch 1 on a node
    floor = 0.010 + 0.010 - hop + HEAD
    shared = sum(1 / (floor + 4 * (layer(j) + hop / 2)) for j in range(1, 5))
    # (b) with hand-offs up to batch 2: slot 1 items carry (10 ms + u) / 2, slots 2-4
    # (10 ms + 2u) / 2; each of the 4 sessions takes back one of the 6 credits of a slot
    # 2-4 (10 ms + 2u); floor: both client legs (20 ms) + the head. Tighter than (a).
    per_slot = 1 / (0.020 + HEAD + 4 * layer(1) + 0.020 + 2 * u - (0.010 + 2 * u)) + sum(
        1 / (0.020 + HEAD + 4 * layer(j) + 0.020 + 4 * u - (0.010 + 2 * u)) for j in range(2, 5)
    )
    assert per_slot < shared
    # (d) hops priced at the margin of each node's batch: each node's j-th hop item is
    # 10 ms + (2j - 1) u; the 4 sessions hop once each, fewest first taking the cheapest:
    # u, u, 3u, 3u (8u in all; what they really pay at batch 4: 16u). Tighter than (b).
    batched = sum(
        1 / (0.020 + HEAD + 4 * layer(j) + 0.010 + extra * u)
        for j, extra in zip(range(1, 5), (1, 1, 3, 3), strict=True)
    )
    assert batched < per_slot
    # (e) charges each hop the hand-off of the whole batch, not the margin; its LP mixes
    # whole states of the nodes (sessions served, sessions ending there), so it lands
    # between what the sessions really pay and (d).
    assert bound < batched
    served = saturate(FixedRoute(s), [HOME] * 10)
    assert served.tokens_per_s < bound


def test_the_joint_bound_keeps_each_session_in_the_regions_it_uses():
    # Two nodes at home and a fast one in Asia, each holding the whole model; clients at
    # home. Priced part by part, the first sessions get the fast node's layers *and* the
    # home nodes' 20 ms round trip (ways (a)-(d)). Together (way (e)), a session on the fast
    # node pays its 160 ms round trip.
    fast = replace(gpu_holding(4.5, memory_gbps=1000.0), fp16_tflops=100.0)
    s = swarm(node("a", gpu=gpu_holding(4.5)), node("b", gpu=gpu_holding(4.5)),
              node("f", site=FAR, gpu=fast))  # fmt: skip
    clients = [HOME] * 12  # one per slot
    bound = upper_bound_tokens_per_s(s, clients)

    def layer(batch: int, gbps: float = 100.0) -> float:
        return (WEIGHTS + batch * KV_PER_SESSION) / (gbps * 1e9)

    def added(k: int, gbps: float = 100.0) -> float:
        """What a node's k-th session adds to its sessions' layer time: all run at batch k."""
        return 4 * (k * layer(k, gbps) - (k - 1) * layer(k - 1, gbps))

    # Sessions 1-8 on a or b alone (4 slots each): 20 ms there and back, no hop, and the
    # LM head on the node they end on (the client's CPU is slower).
    home = [0.020 + added(k) + HEAD for k in (1, 1, 2, 2, 3, 3, 4, 4)]
    # Sessions 9-12 on the fast node: 160 ms there and back (150 ms backbone + two lines).
    fast_head = HEAD_BYTES / 1e12
    asia = [0.160 + added(k, 1000.0) + fast_head for k in range(1, 5)]
    assert bound == pytest.approx(sum(1 / t for t in home + asia), rel=1e-6)
    # Priced apart, four sessions had the fast node's layers at the home round trip.
    apart = sum(1 / (0.020 + 4 * layer(j, 1000.0) + fast_head) for j in range(1, 5))
    assert bound < 0.75 * (apart + sum(1 / t for t in home))
    # What the best routes really serve: every node at batch 4.
    routes = [(HOME, [Hop(n, 0, 4)]) for n in "ab" * 4] + [(HOME, [Hop("f", 0, 4)])] * 4
    served, _, _ = throughput_of(s, routes)
    assert 0.95 * bound < served < bound
    for system in (TesseraSystem(s, replicas=2), ParallaxSystem(s), PetalsSystem(s, seed=1)):
        system.start()
        assert saturate(system, clients).tokens_per_s <= bound, system.name


def test_the_joint_bound_counts_whole_visits():
    # Nodes that hold 3 of 4 layers: a session visits two of them and hops once. The LP's
    # items alone would let it make 4/3 visits (a third of a hop).
    s = swarm(*(node(n, gpu=gpu_holding(3.5)) for n in "abc"))
    assert [s.capacity(n) for n in "abc"] == [3, 3, 3]
    lp = joint_bound.SessionsLP(s, [HOME])
    hop = 0.020 / 2 + handoff_s(s.nodes["a"], TOY, 1)
    one = 0.020 + hop + 4 * layer_time_s(s.nodes["a"], TOY, EXACT, 1) + HEAD
    assert lp.solve(1)[0] == pytest.approx(one, rel=1e-9)


def test_the_joint_bound_lets_a_session_visit_a_node_once():
    # A fast card that holds 1 of 4 layers and a slow one that holds all 4. The best
    # session runs a layer on the fast card and three on the slow one (98.2 ms). Counted
    # in visits alone, it could also come back to the fast card four times: four fast
    # layers and three 12 ms hops, 56 ms, and the LP said 74.9 ms.
    s = swarm(node("f", gpu=gpu_holding(1.5, memory_gbps=1000.0)),
              node("s", gpu=gpu_holding(4.5, memory_gbps=1.0)))  # fmt: skip
    assert [s.capacity(n) for n in "fs"] == [1, 4]
    fast, slow = (layer_time_s(s.nodes[n], TOY, EXACT, 1) for n in "fs")
    hop = 0.020 / 2 + handoff_s(s.nodes["f"], TOY, 1)
    best = 0.020 + fast + hop + 3 * slow + CLIENT_HEAD
    assert best == pytest.approx(0.09822, abs=1e-5)
    assert best < 0.020 + 4 * slow + CLIENT_HEAD  # the slow card alone
    lp = joint_bound.SessionsLP(s, [HOME])
    # The LP may still split the hop (a fraction of a visit to the slow card), not the
    # fast card's one visit.
    assert 0.094 < lp.solve(1)[0] <= best
    system = TesseraSystem(s, replicas=2)
    system.start()
    assert 0 < saturate(system, [HOME]).tokens_per_s <= 1 / lp.solve(1)[0]


def _four_regions():
    """One node in each of four regions, each holding half of the 4 layers."""
    regions = ("us-east", "us-west", "eu-west", "eu-central")
    return swarm(*(node(n, site=Site(r, LINE), gpu=gpu_holding(2.5))
                   for n, r in zip("abcd", regions, strict=True)))  # fmt: skip


def _best_two_hop_routes(s, clients: int) -> float:
    """What the best routes of `clients` home sessions serve, each on two of the nodes."""
    pairs = list(itertools.permutations(sorted(s.nodes), 2))
    best = 0.0
    for combo in itertools.combinations_with_replacement(pairs, clients):
        if max(Counter(n for pair in combo for n in pair).values()) > EXACT.slots:
            continue
        routes = [(HOME, [Hop(x, 0, 2), Hop(y, 2, 4)]) for x, y in combo]
        best = max(best, throughput_of(s, routes)[0])
    return best


def test_the_joint_bound_charges_a_session_that_comes_back_to_its_first_node():
    # Nodes that hold half the model, one per region. Counting a node once a session, a
    # session could begin on a, visit b and end on a again with b's hop out charged and
    # not a's: the LP said 42.9 ms, where the best session (a, then b) takes 87.9 ms.
    s = _four_regions()
    best = _best_two_hop_routes(s, 1)
    assert 1 / best == pytest.approx(0.08795, abs=1e-5)
    b1 = joint_bound.SessionsLP(s, [HOME]).solve(1)[0]
    assert 0.07 < b1 <= 1 / best


def test_the_tiered_bound_prices_two_regions_apart_from_three():
    # Way (f) merges the classes of three regions or more into one (fewer columns), but a
    # session on two regions pays their own crossing: a and b, 65 ms apart, not the 25 ms
    # between eu-west and eu-central, which a merge of every class of two regions or more
    # charged it (27.42 tok/s for two sessions).
    s = _four_regions()
    best = _best_two_hop_routes(s, 2)
    assert best == pytest.approx(22.212, abs=1e-3)
    tiered = joint_bound.tiered_bound_tokens_per_s(joint_bound.SessionsLP(s, [HOME] * 2))
    assert best <= tiered < 27.0


def test_the_tiered_bound_keeps_every_session_in_one_placement():
    # A card that computes 22 ms a session and layer: way (e) lets the k-th of 4 sessions
    # pay only its batch's margin, 20 + 88 (2k - 1) ms, as if the first one ran alone at
    # batch 1 while the last paid for all 4: 16.5 tok/s. In one placement every session
    # on the card runs at its batch: 4 at batch 4 serve the most, 10.74 tok/s (the head on
    # the client's CPU, the cheaper place here), and way (f) is that, give or take its
    # tiers' chord (1.2 apart: at most 0.84 % above).
    s = swarm(node("a", gpu=GpuSpec("slow", 4, fp16_tflops=0.001, memory_gbps=1.0)))
    lp = joint_bound.SessionsLP(s, [HOME] * 4)
    best = max(
        b / (0.020 + CLIENT_HEAD + 4 * layer_time_s(s.nodes["a"], TOY, EXACT, b))
        for b in range(1, 5)
    )
    assert best == pytest.approx(10.739, abs=1e-3)
    assert joint_bound.joint_bound_tokens_per_s(lp) == pytest.approx(16.502, abs=1e-3)
    tiered = joint_bound.tiered_bound_tokens_per_s(lp)
    assert best <= tiered <= best * 1.0084
    assert upper_bound_tokens_per_s(s, [HOME] * 10) == pytest.approx(tiered)
    system = TesseraSystem(s, replicas=2)
    system.start()
    assert saturate(system, [HOME] * 10).tokens_per_s <= tiered


def test_the_joint_bound_leaves_room_for_the_lm_head():
    # Each node holds the 4 layers, but only 3 next to the LM head: a session on one node
    # runs the head on its client's CPU; one on the GPU head would need a second node.
    s = swarm(*(node(n, gpu=gpu_holding(4.03)) for n in "ab"))
    assert s.capacity("a") == 4 and s.capacity("a", HEAD_BYTES) == 3
    lp = joint_bound.SessionsLP(s, [HOME])
    one = 0.020 + 4 * layer_time_s(s.nodes["a"], TOY, EXACT, 1) + CLIENT_HEAD
    assert lp.solve(1)[0] == pytest.approx(one, rel=1e-9)
    # With room for the head too, the session takes the faster GPU head.
    roomy = swarm(*(node(n, gpu=gpu_holding(4.5)) for n in "ab"))
    assert joint_bound.SessionsLP(roomy, [HOME]).solve(1)[0] == pytest.approx(
        one - CLIENT_HEAD + HEAD, rel=1e-9
    )


def test_the_joint_bound_counts_the_covers_a_session_can_make():
    # 6 layers on nodes that hold 3, or 2 next to the LM head, and a client far too slow
    # to run the head: a session ends on a node with the head (2 layers) and needs two
    # more visits for the other 4. Rounding alone (grains of 2: 1 + 2 + 2 >= 3) and the
    # items (a third of a visit more) let it make fewer hops.
    slow_client = replace(EXACT, client_memory_gbps=0.01)
    s = swarm(*(node(n, gpu=gpu_holding(3.03)) for n in "abc"), model=toy_model(6),
              params=slow_client)  # fmt: skip
    assert s.capacity("a") == 3 and s.capacity("a", HEAD_BYTES) == 2
    lp = joint_bound.SessionsLP(s, [HOME])
    hop = 0.020 / 2 + handoff_s(s.nodes["a"], s.model, 1)
    one = 0.020 + 2 * hop + 6 * layer_time_s(s.nodes["a"], s.model, slow_client, 1) + HEAD
    assert lp.solve(1)[0] == pytest.approx(one, rel=1e-9)


def test_an_lp_that_does_not_solve_leaves_ways_e_and_f_out(monkeypatch, caplog):
    # HiGHS stopping without an optimum must not take the benchmark down: ways (e) and
    # (f) prove nothing then, and the bound is the least of the other ways.
    s = swarm(node("a", gpu=gpu_holding(2.5)), node("b", gpu=gpu_holding(2.5)),
              model=toy_model(4))  # fmt: skip
    with_e = upper_bound_tokens_per_s(s, [HOME] * 10)
    failed = SimpleNamespace(status=4, message="Numerical difficulties encountered")
    monkeypatch.setattr(joint_bound, "linprog", lambda *args, **kwargs: failed)
    without = upper_bound_tokens_per_s(s, [HOME] * 10)
    assert math.isfinite(without) and without > with_e
    assert "did not solve: Numerical difficulties" in caplog.text
    assert "leaves way (e) out" in caplog.text and "leaves way (f) out" in caplog.text


def test_the_bound_holds_for_nodes_that_each_serve_sessions_alone():
    # Two nodes that each hold the whole model on an 8 Mb/s uplink: every session stays on
    # one node and never hands off. A bound whose slot-j items carried the hand-off at
    # batch j (while the floor takes back only batch 1's) charged the 4th session of each
    # node 6 ms it never pays and fell below what every system serves here (336 < 380).
    s = swarm(node("a"), node("b"))
    bound = upper_bound_tokens_per_s(s, [HOME] * 10)
    for system in (TesseraSystem(s, replicas=2), ParallaxSystem(s), PetalsSystem(s, seed=1)):
        system.start()
        served = saturate(system, [HOME] * 10)
        assert served.sessions == 8, system.name
        assert served.tokens_per_s <= bound, system.name
