"""Tessera as the coordinator runs it: coordinator.planner.plan + coordinator.router.route.

Planner inputs: speed = the card's FP16 TFLOPS, memory bandwidth, region, fp16 weights,
the coordinator's KV budget, and each node's leave rate as coordinator/reliability.py
estimates it from the node's time online so far (no node has left before in the trace).
Router inputs, as the coordinator measures them once traffic flows: per-layer time of the
node at its would-be batch (load-adjusted), RTT between nodes (plus the hand-off of the
hidden states) and between the client and each node.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from coordinator.planner import ModelPlan, ModelSpec, NodeSpec, plan
from coordinator.reliability import leave_rate_per_h
from coordinator.router import Holder, NoRouteError, route

from .regions import Site, backbone_rtt_ms
from .swarm import Hop, SimNode, Swarm, fetched_bytes, handoff_s


def typical_peer_rtt_ms(nodes: list[SimNode]) -> dict[str, float]:
    """What the coordinator's measurements report as a node's typical RTT: the median of its
    round trips to the peers of its region (backbone + its access line + theirs)."""
    access: dict[str, list[float]] = {}
    for n in nodes:
        access.setdefault(n.site.region, []).append(n.site.access.rtt_ms)
    median = {region: float(np.median(values)) for region, values in access.items()}
    return {
        n.node_id: backbone_rtt_ms(n.site.region, n.site.region)
        + n.site.access.rtt_ms
        + median[n.site.region]
        for n in nodes
    }


class TesseraSystem:
    client_runs_head = False  # the last stage holds the LM head (node_agent runtime)

    def __init__(self, swarm: Swarm, *, replicas: int | None = 2, name: str = "tessera") -> None:
        """`replicas=None` asks for as many replicas as there are nodes (use every node)."""
        self.swarm = swarm
        self.replicas = replicas
        self.name = name
        model = swarm.model
        self.spec = ModelSpec(
            name=model.name,
            num_layers=model.num_layers,
            params_per_layer=model.params_per_layer,
            embed_params=model.embed_params,
            head_params=model.head_params,
            kv_values_per_token_per_layer=model.kv_values_per_token_per_layer,
            hidden_size=model.hidden,
        )
        self.plan: ModelPlan | None = None
        self.now_s = 0.0  # the churn trace's clock at the latest event

    def _node_specs(self) -> list[NodeSpec]:
        peers = typical_peer_rtt_ms(list(self.swarm.nodes.values()))
        swarm, slots = self.swarm, self.swarm.params.slots
        per_gparam = 1e12 / swarm.model.params_per_layer  # ms per gparam, from s per layer
        measured: dict[str, float] = {}  # per card: every node of a card measures the same
        for n in swarm.nodes.values():
            if n.gpu.name not in measured:
                measured[n.gpu.name] = swarm.layer_time_s(n.node_id, slots) * per_gparam
        return [
            NodeSpec(
                n.node_id,
                usable_bytes=n.usable_bytes,
                speed=n.gpu.fp16_tflops,
                dtype_bytes=2,
                kv_tokens=self.swarm.params.kv_tokens,
                mem_bandwidth=n.gpu.memory_gbps,
                region=n.site.region,
                rtt_ms=peers[n.node_id],
                # Measured hand-offs carry the batch of a busy node: its uplink per session.
                upload_mbps=n.site.access.up_mbps / slots,
                download_mbps=n.site.access.down_mbps,
                # What coordinator/measurements.py converges to once traffic flows: the
                # node's per-layer time with its KV slots in use.
                ms_per_gparam=measured[n.gpu.name],
                leave_rate_per_h=leave_rate_per_h(0, self.now_s - n.joined_s),
            )
            for n in self.swarm.nodes.values()
        ]

    def _replan(self) -> int:
        replicas = self.replicas or max(1, len(self.swarm.nodes))
        previous = {self.spec.name: self.plan} if self.plan is not None else None
        old = self.ranges()
        self.plan = plan([self.spec], self._node_specs(), previous, replicas=replicas)[
            self.spec.name
        ]
        return sum(
            fetched_bytes(self.swarm.model, old.get(nid), rng) for nid, rng in self.ranges().items()
        )

    def start(self) -> None:
        self.plan = None
        self._replan()

    def join(self, node: SimNode, now_s: float) -> int:
        self.now_s = now_s
        return self._replan()

    def leave(self, node_id: str, now_s: float) -> int:
        self.now_s = now_s
        return self._replan()

    def ranges(self) -> dict[str, tuple[int, int]]:
        if self.plan is None:
            return {}
        return {nid: (s.start, s.end) for nid, s in self.plan.holders.items()}

    def route(self, client: Site, load: Mapping[str, int], full: set[str]) -> list[Hop] | None:
        if self.plan is None or not self.plan.holders:
            return None
        swarm = self.swarm
        group = {nid: str(i) for i, pipe in enumerate(self.plan.pipelines) for nid in pipe}
        holders = [
            Holder(
                nid,
                nid,
                s.start,
                s.end,
                swarm.layer_time_s(nid, load.get(nid, 0) + 1) * 1000.0,
                group=group.get(nid, ""),
            )
            for nid, s in self.plan.holders.items()
            if nid in swarm.nodes
        ]

        def rtt_ms(a: str, b: str) -> float:
            handoff = handoff_s(swarm.nodes[a], swarm.model, load.get(a, 0) + 1)
            return (swarm.rtt_s(a, b) + 2 * handoff) * 1000.0

        try:
            stages = route(
                self.plan.boundaries,
                holders,
                exclude=full,
                rtt_ms=rtt_ms,
                client_rtt_ms=lambda nid: swarm.client_rtt_s(client, nid) * 1000.0,
            )
        except NoRouteError:
            return None
        return [Hop(st.primary.node_id, st.start, st.end) for st in stages]
