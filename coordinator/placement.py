"""Placement: turns planner output into AssignShard/DropShard commands and tracks readiness.

It re-plans (debounced) whenever a node comes, goes, drains or is banned, and whenever a
model is added or removed. New shards are loaded before superseded ones are dropped, so a
node growing its range keeps serving while it fetches. After a restart it starts from the
saved plans (`restore`) and holds re-plans until their nodes are back (`await_returning`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, replace

from coordinator.measurements import Measurements
from coordinator.model_store.layout import ModelLayout
from coordinator.planner import HEADROOM, ModelPlan, ModelSpec, NodeSpec, Shard, plan, shard_bytes
from coordinator.reliability import NodeHistory
from coordinator.router import Holder
from protos.tessera.v1 import common_pb2, coordinator_pb2, node_pb2

log = logging.getLogger("tessera.placement")

MAX_CACHED_SHARDS = 8  # shards remembered per node as being in its disk cache
MAX_PROBE_PEERS = 16  # peers a node is asked to ping: its likely hand-off partners
MAX_RTT_MS = 60_000.0  # a reported round trip above this is not a measurement
# A model's demand is the sessions asked for it, each counting less as it ages: half as
# much after this long. Re-plans then share the swarm's memory by recent demand, and a
# model whose share of demand has moved by this factor since the last plan causes one.
DEMAND_HALF_LIFE_S = 600.0
DEMAND_SHIFT = 2.0
# A node whose measured speed has moved this far from what the last plan assumed (an
# owner's game took the GPU, a driver fix made it faster) causes a re-plan; the planner's
# hysteresis then decides whether anything moves.
SPEED_SHIFT = 2.0
# ... and only a shift that lasts: this many step observations in a row outside that band,
# on the same side. Drivers report 16 calls at a time and the average follows each report
# (measurements.ALPHA), so one noisy report of a busy node would otherwise re-plan, and the
# next one re-plan back (seen in the demo: 1.9 and 4.2 s per gparam half a second apart).
# The router steers around a slow node call by call meanwhile; re-plans move weights.
SPEED_SHIFT_HOLD = 24
# CPU nodes compute in fp32; GPU nodes in fp16/bf16.
_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


@dataclass(frozen=True)
class PlacementNode:
    """What placement needs to know about an online node."""

    node_id: str
    address: str
    capabilities: node_pb2.Capabilities
    load: float = 0.0


def model_spec(name: str, config_json: str) -> ModelSpec:
    layout = ModelLayout.from_config(json.loads(config_json))
    shapes = layout.expected_shapes()

    def numel(tensor: str) -> int:
        n = 1
        for d in shapes[tensor]:
            n *= d
        return n

    prefix = "model.layers.0."
    per_layer = sum(numel(t) for t in shapes if t.startswith(prefix))
    embed = numel("model.embed_tokens.weight")
    head = numel("model.norm.weight") + (
        embed if layout.tie_word_embeddings else numel("lm_head.weight")
    )
    return ModelSpec(
        name=name,
        num_layers=layout.num_layers,
        params_per_layer=per_layer,
        embed_params=embed,
        head_params=head,
        kv_values_per_token_per_layer=2 * layout.num_kv_heads * layout.head_dim,
        hidden_size=layout.hidden_size,
    )


def compute_dtype(capabilities: node_pb2.Capabilities) -> str:
    if capabilities.device_kind == "cuda":
        return "bfloat16" if "bfloat16" in capabilities.dtypes else "float16"
    return "float32"


def claimed_ms_per_gparam(capabilities: node_pb2.Capabilities) -> float:
    """What the node's own benchmarks imply per billion parameters and token: the slower of
    2 FLOPs per parameter at its matmul rate and reading every weight once at its memory
    bandwidth, which is what decoding at batch 1 does (on a GPU the second is tens of times
    the first). A prior that measurements replace; an agent too old to report bandwidth
    gets the matmul term alone."""
    compute = 2.0 / max(capabilities.matmul_tflops, 1e-3)
    if capabilities.memory_bandwidth_gbps <= 0:
        return compute
    weight_bytes = _DTYPE_BYTES[compute_dtype(capabilities)]
    return max(compute, weight_bytes / capabilities.memory_bandwidth_gbps * 1e3)


def node_spec(
    node: PlacementNode,
    kv_tokens: int,
    measurements: Measurements | None = None,
    cached: Iterable[Shard] = (),
    *,
    leave_rate_per_h: float = 0.0,
    price: float = 0.0,
) -> NodeSpec:
    """The planner's view of a node: memory and dtype from its capabilities; speed and
    RTT from the coordinator's measurements once it has them (the node's claim until
    then, and never faster than it was measured); region as the node declared it; how
    often it leaves (its history) and what it asks (the ledger's price)."""
    caps = node.capabilities
    claimed = claimed_ms_per_gparam(caps)
    return NodeSpec(
        node_id=node.node_id,
        usable_bytes=caps.memory_usable_bytes,
        speed=max(caps.matmul_tflops, 1e-3),
        mem_bandwidth=caps.memory_bandwidth_gbps,
        dtype_bytes=_DTYPE_BYTES[compute_dtype(caps)],
        kv_tokens=kv_tokens,
        region=caps.region,
        ms_per_gparam=measurements.ms_per_gparam(node.node_id, claimed) if measurements else 0.0,
        call_ms=measurements.call_ms(node.node_id) if measurements else 0.0,
        rtt_ms=measurements.rtt_ms(node.node_id) if measurements else 0.0,
        cached=tuple(cached),
        leave_rate_per_h=leave_rate_per_h,
        price=price,
    )


SendCommand = Callable[[str, coordinator_pb2.Command], Awaitable[bool]]


class Placement:
    def __init__(
        self,
        send_command: SendCommand,
        *,
        replicas: int = 2,
        min_stages: int = 1,
        kv_tokens: int = 2048,
        max_token_latency_s: float = 0.0,
        max_token_price: float = 0.0,
        debounce_s: float = 0.2,
        on_change: Callable[[str], None] | None = None,
        measurements: Measurements | None = None,
        on_plans: Callable[[Mapping[str, ModelPlan], Measurements], None] | None = None,
    ) -> None:
        self._send = send_command
        # Fed by the lead's wiring (driver step reports, telemetry RTTs); read at re-plan
        # and routing time.
        self.measurements = measurements or Measurements()
        self.replicas = replicas
        self.min_stages = min_stages
        self.kv_tokens = kv_tokens
        # The planner's latency bound for every model (0: none); see PLANNER.md.
        self.max_token_latency_s = max_token_latency_s
        self.max_token_price = max_token_price  # and its price bound (0: none)
        self._debounce_s = debounce_s
        self._on_change = on_change
        # Gets every plan made and the measurements behind it (the coordinator saves them).
        self._on_plans = on_plans
        self._models: dict[str, ModelSpec] = {}
        self._nodes: dict[str, PlacementNode] = {}
        self._plans: dict[str, ModelPlan] = {}
        # (node_id, model) -> shard the node was told to load, and what it reported
        self._assigned: dict[tuple[str, str], Shard] = {}
        self._state: dict[tuple[str, Shard], int] = {}
        self._superseded: dict[tuple[str, str], Shard] = {}  # drop once the new one is ready
        # Shards each node has been ready with: their weights are in its disk cache, so the
        # planner prefers it for them and does not count them as fetched. Kept when the node
        # goes away (a returning node still has its cache); bounded by MAX_CACHED_SHARDS.
        self._cached: dict[str, list[Shard]] = {}
        self._replan_task: asyncio.Task[None] | None = None
        self._replan_wanted = False
        self._lock = asyncio.Lock()
        # Training state held on nodes, by holder (e.g. "job/stage"): (node_id, bytes).
        self._training: dict[str, tuple[str, int]] = {}
        # Peers each node was last told to probe (ProbePeers): RTTs it reports to others
        # are ignored, so a node cannot make itself look close to nodes it never pinged.
        self._probing: dict[str, tuple[str, ...]] = {}
        # Cost multiplier per node for the router; the verifier makes failing nodes dearer.
        self.trust_cost: Callable[[str], float] = lambda node_id: 1.0
        # The planner's reliability and price inputs: departures per hour online, from
        # every node's state changes (coordinator/inference.py feeds `history`), and the
        # node's price per 1,000 token-layers (the ledger's, wired there too; 0 = free).
        self.history = NodeHistory()
        self.leave_rate_of: Callable[[str], float] = self._leave_rate
        self.price_of: Callable[[str], float] = lambda node_id: 0.0
        # Sessions asked per model, decayed (DEMAND_HALF_LIFE_S): (count, as of monotonic s).
        self._demand: dict[str, tuple[float, float]] = {}
        self._planned_shares: dict[str, float] = {}  # demand shares the last plan used
        # (call ms, ms per gparam) that the last plan used for each node
        self._planned_speed: dict[str, tuple[float, float]] = {}
        # node -> (side of the band, observations in a row there): see SPEED_SHIFT_HOLD
        self._speed_shift: dict[str, tuple[int, int]] = {}
        # After a restart: nodes expected back that have not re-attached and reported their
        # shards yet, and until when re-plans wait for them (monotonic s).
        self._returning: set[str] = set()
        self._returning_until = 0.0
        self._returned = asyncio.Event()
        self._returned.set()

    # ---- inputs -------------------------------------------------------------------------

    def restore(self, plans: Mapping[str, ModelPlan]) -> None:
        """The plans an earlier run of this coordinator made: re-plans start from them, so
        a restart moves no shard that is still where they put it."""
        self._plans = dict(plans)

    def await_returning(self, node_ids: Iterable[str], grace_s: float) -> None:
        """Hold re-plans until these nodes (online when the coordinator stopped, or placed
        by the restored plans) have re-attached and reported their shards, for at most
        `grace_s`.

        A plan made while only some of them were back would re-cut the layout around them
        and move shards the others still hold; their agents retry with back-off, so they
        come back over seconds, not at once. Sessions route over the shards nodes report
        meanwhile, and nothing moves."""
        self._returning = set(node_ids)
        self._returning_until = time.monotonic() + grace_s
        if self._returning:
            self._returned.clear()
            log.info("waiting up to %.0f s for %d node(s) that were online or placed before "
                     "the restart to re-attach before placing shards", grace_s,
                     len(self._returning))  # fmt: skip
        else:
            self._returned.set()

    def node_reported(self, node_id: str) -> None:
        """The node's first telemetry on its Attach stream arrived: the shard reports it
        sends first on a new stream are in."""
        if node_id in self._returning:
            self._returning.discard(node_id)
            if not self._returning:
                log.info("every node that was online before the restart is back")
                self._returned.set()

    async def _wait_for_returning(self) -> None:
        if self._returned.is_set():
            return
        try:
            await asyncio.wait_for(
                self._returned.wait(), max(0.0, self._returning_until - time.monotonic())
            )
        except TimeoutError:
            log.warning("%d node(s) online before the restart did not come back in time "
                        "(%s): placing shards without them", len(self._returning),
                        ", ".join(sorted(self._returning)))  # fmt: skip
            self._returning.clear()
            self._returned.set()

    def set_models(self, models: Iterable[ModelSpec]) -> None:
        self._models = {
            m.name: replace(
                m,
                max_token_latency_s=self.max_token_latency_s,
                max_token_price=self.max_token_price,
            )
            for m in models
        }
        self.schedule_replan()

    def node_up(self, node: PlacementNode) -> None:
        self._nodes[node.node_id] = node
        self.schedule_replan()

    def node_down(self, node_id: str) -> None:
        """The node left, drains or was banned: its shards no longer count."""
        if self._nodes.pop(node_id, None) is None:
            return
        for key in [k for k in self._assigned if k[0] == node_id]:
            del self._assigned[key]
            self._superseded.pop(key, None)
        for key in [k for k in self._state if k[0] == node_id]:
            del self._state[key]
        self._probing.pop(node_id, None)
        self.schedule_replan()

    def update_load(self, node_id: str, load: float) -> None:
        node = self._nodes.get(node_id)
        if node is not None:
            self._nodes[node_id] = PlacementNode(
                node.node_id, node.address, node.capabilities, load
            )

    def note_session(self, model: str, now_s: float | None = None) -> None:
        """A client asked for a session of `model` (served or not: demand is what is asked)."""
        if model not in self._models:
            return
        now_s = time.monotonic() if now_s is None else now_s
        self._demand[model] = (self.demand(model, now_s) + 1.0, now_s)
        if len(self._models) > 1 and self._planned_shares:
            shares = self.demand_shares(now_s)
            planned = self._planned_shares
            if any(
                not 1 / DEMAND_SHIFT < share / planned.get(m, share) < DEMAND_SHIFT
                for m, share in shares.items()
            ):
                self._planned_shares = shares  # one re-plan per shift
                self.schedule_replan()

    def demand_shares(self, now_s: float | None = None) -> dict[str, float]:
        """Each model's share of demand + 1 (what the planner shares memory by)."""
        weights = {m: self.demand(m, now_s) + 1.0 for m in self._models}
        total = sum(weights.values())
        return {m: w / total for m, w in weights.items()}

    def demand(self, model: str, now_s: float | None = None) -> float:
        """Sessions asked for `model`, each halved every DEMAND_HALF_LIFE_S since."""
        count, since = self._demand.get(model, (0.0, 0.0))
        if not count:
            return 0.0
        now_s = time.monotonic() if now_s is None else now_s
        return count * 0.5 ** (max(0.0, now_s - since) / DEMAND_HALF_LIFE_S)

    def observe_step(
        self, node_id: str, model: str, layers: int, tokens: int, wall_ms: float
    ) -> bool:
        """A driver's timing of one stage call of real traffic (ReportStepTimes). The
        driver's wall time includes the client-node round trip, so the estimate is a little
        pessimistic for far nodes, which is what a route through them costs anyway."""
        spec = self._models.get(model)
        if spec is None:
            return False
        self.measurements.observe_step(
            node_id,
            layers=layers,
            params_per_layer=spec.params_per_layer,
            tokens=tokens,
            compute_ms=wall_ms,
        )
        self._replan_if_speed_moved(node_id)
        return True

    def _replan_if_speed_moved(self, node_id: str) -> None:
        """Overload (or the end of it): re-plan when a node's measured speed has stayed
        SPEED_SHIFT away from what the last plan assumed for SPEED_SHIFT_HOLD observations.

        Compared per gparam at the work the node now gets, the fixed part of its calls
        included on both sides: a re-plan that changed its span alone is no shift."""
        planned, node = self._planned_speed.get(node_id), self._nodes.get(node_id)
        work = self.measurements.work(node_id)
        if not planned or node is None or work <= 0:
            return
        planned_call_ms, planned_per_gparam = planned
        expected = planned_per_gparam + planned_call_ms / work
        now = self.measurements.mean_ms_per_gparam(
            node_id, claimed_ms_per_gparam(node.capabilities)
        )
        shift = now / expected
        side = 1 if shift >= SPEED_SHIFT else -1 if shift <= 1 / SPEED_SHIFT else 0
        if side == 0:
            self._speed_shift.pop(node_id, None)
            return
        held_side, held = self._speed_shift.get(node_id, (0, 0))
        held = held + 1 if side == held_side else 1
        if held < SPEED_SHIFT_HOLD:
            self._speed_shift[node_id] = (side, held)
            return
        log.info(
            "node %s now runs at %.3g ms per billion parameters, planned at %.3g: re-planning",
            node_id,
            now,
            expected,
        )
        self._speed_shift.pop(node_id, None)
        self._planned_speed[node_id] = (0.0, now)  # one re-plan per shift
        self.schedule_replan()

    def observe_rtts(self, node_id: str, rtts: Mapping[str, float]) -> int:
        """Round trips a node reported in telemetry; only to peers it was asked to probe."""
        asked = self._probing.get(node_id, ())
        kept = {p: float(ms) for p, ms in rtts.items() if p in asked and 0.0 <= ms <= MAX_RTT_MS}
        self.measurements.observe_rtts(node_id, kept)
        return len(kept)

    def _leave_rate(self, node_id: str) -> float:
        return self.history.leave_rate_per_h(node_id, _now_ms())

    def reliability(self, node_id: str) -> node_pb2.NodeReliability:
        """How often the node leaves, as the planner weighs it (ListNodes shows it)."""
        return self.history.describe(node_id, _now_ms())

    def speed(self, node_id: str) -> node_pb2.NodeSpeed | None:
        """The node's claimed and measured speed, as ListNodes shows it."""
        node = self._nodes.get(node_id)
        if node is None:
            return None
        claimed = claimed_ms_per_gparam(node.capabilities)
        seen = self.measurements.of(node_id, 1_000_000_000, claimed)
        return node_pb2.NodeSpeed(
            claimed_ms_per_gparam=claimed,
            ms_per_gparam=seen.layer_ms,
            call_ms=seen.call_ms,
            samples=seen.samples,
            measured=seen.measured,
            rtt_ms=seen.rtt_ms,
        )

    async def shard_status(self, node_id: str, status: node_pb2.ShardStatus) -> None:
        shard = Shard(status.model, status.layers.start, status.layers.end)
        self._state[(node_id, shard)] = status.state
        if status.state == node_pb2.SHARD_STATE_FAILED:
            log.warning(
                "node %s failed to load %s [%d, %d): %s",
                node_id,
                shard.model,
                shard.start,
                shard.end,
                status.error,
            )
        if status.state == node_pb2.SHARD_STATE_READY:
            log.info(
                "node %s is ready with %s layers [%d, %d)",
                node_id,
                shard.model,
                shard.start,
                shard.end,
            )
            cached = self._cached.setdefault(node_id, [])
            if shard not in cached:
                cached.append(shard)
                del cached[:-MAX_CACHED_SHARDS]
            old = self._superseded.pop((node_id, shard.model), None)
            if old is not None and old != shard:
                await self._drop(node_id, old)
        if self._on_change:
            self._on_change(shard.model)

    def reserve_training(self, holder: str, node_id: str, nbytes: int) -> None:
        """Count a training stage's state against the node's memory until released."""
        self._training[holder] = (node_id, nbytes)

    def release_training(self, holder: str) -> None:
        self._training.pop(holder, None)

    def node_ids(self) -> list[str]:
        return list(self._nodes)

    def planned_nodes(self) -> set[str]:
        """Every node some plan gives a shard, online or not."""
        return {node_id for p in self._plans.values() for node_id in p.holders}

    async def assign_extra(
        self, node_id: str, model: str, start: int, end: int, reserve: int = 0
    ) -> Shard | None:
        """Have `node_id` load a shard covering [start, end) that the plan gave nobody else
        it could go to (a training stage's replacement). It grows the node's current shard
        when the two touch, goes into the plan so later re-plans keep it, and is refused
        (None) unless the node has the memory for it plus `reserve` bytes."""
        node, spec = self._nodes.get(node_id), self._models.get(model)
        async with self._lock:
            model_plan = self._plans.get(model)
            if node is None or spec is None or model_plan is None:
                return None
            current = self._assigned.get((node_id, model))
            if current is not None and current.start <= end and start <= current.end:
                shard = Shard(model, min(current.start, start), max(current.end, end))
            else:
                shard = Shard(model, start, end)
            node_bytes = node_spec(node, self.kv_tokens)
            grow = shard_bytes(spec, node_bytes, shard.start, shard.end) - (
                shard_bytes(spec, node_bytes, current.start, current.end) if current else 0
            )
            if self.free_bytes(node_id) < grow + reserve:
                return None
            if not await self._assign(node_id, shard, spec):
                return None
            self._assigned[(node_id, model)] = shard
            if current is not None and current != shard:
                self._superseded[(node_id, model)] = current
            model_plan.holders[node_id] = shard
            self._plans_changed()
        return shard

    # ---- outputs ------------------------------------------------------------------------

    def training_bytes(self, node_id: str) -> int:
        return sum(n for holder_node, n in self._training.values() if holder_node == node_id)

    def free_bytes(self, node_id: str) -> int:
        """Usable memory (less headroom) not taken by assigned shards or training state."""
        node = self._nodes.get(node_id)
        if node is None:
            return 0
        spec = node_spec(node, self.kv_tokens)
        used = sum(
            shard_bytes(self._models[model], spec, shard.start, shard.end)
            for (holder, model), shard in self._assigned.items()
            if holder == node_id and model in self._models
        )
        return int(spec.usable_bytes * (1 - HEADROOM)) - used - self.training_bytes(node_id)

    def boundaries(self, model: str) -> list[int] | None:
        p = self._plans.get(model)
        if p is not None:
            return list(p.boundaries)
        # Not planned yet: a restarted coordinator with no saved plan, waiting for its
        # nodes to come back. Routes may chain whatever shards they report.
        spec = self._models.get(model)
        return [0, spec.num_layers] if spec else None

    def ready_holders(self, model: str) -> list[Holder]:
        """Ready replicas for the router: measured per-layer time (the claim until there
        are measurements), load, and the planner's pipeline each belongs to."""
        holders = []
        spec = self._models.get(model)
        model_plan = self._plans.get(model)
        group = {
            nid: f"{i}"
            for i, pipe in enumerate(model_plan.pipelines if model_plan else ())
            for nid in pipe
        }
        params = spec.params_per_layer if spec else 1_000_000_000
        for (node_id, shard), state in self._state.items():
            node = self._nodes.get(node_id)
            if shard.model != model or state != node_pb2.SHARD_STATE_READY or node is None:
                continue
            claimed = claimed_ms_per_gparam(node.capabilities) * params / 1e9
            # The verifier makes failing nodes dearer for the router.
            trust = self.trust_cost(node_id)
            ms = self.measurements.layer_ms(node_id, params, claimed) * trust
            # The pipeline label only holds while the shard is the one the plan gave it.
            planned = model_plan.holders.get(node_id) if model_plan else None
            holders.append(
                Holder(
                    node_id,
                    node.address,
                    shard.start,
                    shard.end,
                    ms,
                    node.load,
                    group=group.get(node_id, "") if planned == shard else "",
                    call_ms=self.measurements.call_ms(node_id) * trust,
                )
            )
        return holders

    def rtt_ms(self, a: str, b: str) -> float:
        """Measured round trip between two nodes for the router (0 when unmeasured)."""
        rtt = self.measurements.pair_rtt_ms(a, b)
        return rtt if rtt is not None else 0.0

    def coverage(self, model: str) -> list[int]:
        spec = self._models.get(model)
        if spec is None:
            return []
        counts = [0] * spec.num_layers
        for h in self.ready_holders(model):
            for layer in range(h.start, min(h.end, spec.num_layers)):
                counts[layer] += 1
        return counts

    def unavailable_reason(self, model: str) -> str:
        """Why some layers have no ready replica: they fit nowhere, or are still loading."""
        model_plan = self._plans.get(model)
        if model_plan is None:
            return ""
        if not self._nodes:
            return "no node is online to load it yet"
        if not model_plan.holders:
            return (
                "the online nodes do not have the memory to hold it "
                f"({len(self._nodes)} node(s) online); add nodes or larger ones"
            )
        missing = model_plan.missing_layers()
        if missing:
            spans = ", ".join(f"{a}-{b - 1}" for a, b in missing)
            return f"no online node can hold layers {spans}; add nodes with more memory"
        counts = self.coverage(model)
        loading = [i for i, n in enumerate(counts) if n == 0]
        if loading:
            return f"nodes are still fetching or loading layers {_spans(loading)}"
        return ""

    def plan_of(self, model: str) -> ModelPlan | None:
        return self._plans.get(model)

    # ---- re-planning --------------------------------------------------------------------

    def schedule_replan(self) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        # A change that lands while a re-plan runs (a node joining while assignments go
        # out) must cause another pass: that re-plan took its snapshot of the swarm before.
        self._replan_wanted = True
        if self._replan_task is None or self._replan_task.done():
            self._replan_task = loop.create_task(self._debounced_replan())

    async def _debounced_replan(self) -> None:
        while self._replan_wanted:
            await asyncio.sleep(self._debounce_s)
            await self._wait_for_returning()
            self._replan_wanted = False
            try:
                await self.replan()
            except Exception:  # a planner bug must not end re-planning for good, unseen
                log.exception("re-plan failed; the previous plan stays until the next change")

    async def settled(self) -> None:
        """Wait until no re-plan is scheduled or running."""
        while self._replan_task is not None and not self._replan_task.done():
            await asyncio.shield(self._replan_task)

    async def replan(self) -> None:
        async with self._lock:
            # Memory a node spends on training is not there for new inference shards.
            nodes = []
            for node in self._nodes.values():
                spec = node_spec(
                    node,
                    self.kv_tokens,
                    self.measurements,
                    self._cached.get(node.node_id, ()),
                    leave_rate_per_h=self.leave_rate_of(node.node_id),
                    price=self.price_of(node.node_id),
                )
                training = self.training_bytes(node.node_id)
                nodes.append(replace(spec, usable_bytes=max(0, spec.usable_bytes - training)))
            self._planned_shares = self.demand_shares()
            self._planned_speed = {n.node_id: (n.call_ms, n.ms_per_gparam) for n in nodes}
            self._speed_shift.clear()
            self._plans = plan(
                [replace(m, demand=self.demand(m.name)) for m in self._models.values()],
                nodes,
                previous=self._plans,
                replicas=self.replicas,
                min_stages=self.min_stages,
            )
            self._plans_changed()
            await self._apply()

    def _plans_changed(self) -> None:
        if self._on_plans is not None:
            try:
                self._on_plans(self._plans, self.measurements)
            except Exception:  # the plan stands; only a restart would forget it
                log.exception("saving the placement plans failed")

    async def _apply(self) -> None:
        wanted: dict[tuple[str, str], Shard] = {}
        for name, model_plan in self._plans.items():
            for node_id, shard in model_plan.holders.items():
                wanted[(node_id, name)] = shard
            missing = model_plan.missing_layers()
            if missing:
                spans = ", ".join(f"{a}-{b - 1}" for a, b in missing)
                log.warning("model %s is unavailable: no node can hold layers %s", name, spans)
        for key, shard in wanted.items():
            current = self._assigned.get(key)
            if current == shard:
                continue
            node_id, model = key
            spec = self._models[model]
            if await self._assign(node_id, shard, spec):
                self._assigned[key] = shard
                if current is not None:
                    self._superseded[key] = current
        for key in [k for k in self._assigned if k not in wanted]:
            shard = self._assigned.pop(key)
            await self._drop(key[0], shard)
        await self._send_probe_lists()

    def probe_peers(self, node_id: str) -> list[str]:
        """Nodes `node_id` might hand off to or receive from: holders of a model it holds
        whose shard starts where one of its shards ends or ends where one starts (then any
        other holder of those models), at most MAX_PROBE_PEERS, by node id."""
        mine = [s for (n, _), s in self._assigned.items() if n == node_id]
        adjacent: set[str] = set()
        others: set[str] = set()
        for (other, model), shard in self._assigned.items():
            if other == node_id or other not in self._nodes:
                continue
            for own in mine:
                if own.model != model:
                    continue
                if shard.start == own.end or shard.end == own.start:
                    adjacent.add(other)
                else:
                    others.add(other)
        ranked = sorted(adjacent) + sorted(others - adjacent)
        return ranked[:MAX_PROBE_PEERS]

    async def _send_probe_lists(self) -> None:
        for node_id in list(self._nodes):
            peers = tuple(self.probe_peers(node_id))
            if self._probing.get(node_id, ()) == peers:  # an empty list goes only to replace one
                continue
            command = coordinator_pb2.Command(
                probe=coordinator_pb2.ProbePeers(
                    peers=[
                        coordinator_pb2.Peer(node_id=p, address=self._nodes[p].address)
                        for p in peers
                    ]
                )
            )
            if await self._send(node_id, command):
                self._probing[node_id] = peers

    async def _assign(self, node_id: str, shard: Shard, spec: ModelSpec) -> bool:
        node = self._nodes[node_id]
        log.info(
            "assigning %s layers [%d, %d) to node %s", shard.model, shard.start, shard.end, node_id
        )
        if self._state.get((node_id, shard)) != node_pb2.SHARD_STATE_READY:
            # A shard the node already serves (e.g. what it reported after a coordinator
            # restart) stays routable while it confirms: marking it ASSIGNED left a hole in
            # which sessions were refused (make before break).
            self._state[(node_id, shard)] = node_pb2.SHARD_STATE_ASSIGNED
        command = coordinator_pb2.Command(
            assign=coordinator_pb2.AssignShard(
                model=shard.model,
                layers=common_pb2.LayerRange(start=shard.start, end=shard.end),
                dtype=compute_dtype(node.capabilities),
                kv_tokens_budget=self.kv_tokens,
                num_layers=spec.num_layers,
            )
        )
        return await self._send(node_id, command)

    async def _drop(self, node_id: str, shard: Shard) -> None:
        self._state.pop((node_id, shard), None)
        command = coordinator_pb2.Command(
            drop=coordinator_pb2.DropShard(
                model=shard.model,
                layers=common_pb2.LayerRange(start=shard.start, end=shard.end),
            )
        )
        await self._send(node_id, command)


def _spans(layers: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2, 5"."""
    out: list[str] = []
    start = prev = layers[0]
    for layer in [*layers[1:], None]:
        if layer is not None and layer == prev + 1:
            prev = layer
            continue
        out.append(f"{start}-{prev}" if prev != start else f"{start}")
        if layer is not None:
            start = prev = layer
    return ", ".join(out)


def _now_ms() -> int:
    return int(time.time() * 1000)
