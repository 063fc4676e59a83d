"""Moving averages of what the coordinator measures about each node, replacing what the
node claims about itself.

Pure data, no I/O: the coordinator feeds observations in (drivers report per-stage step
times of real traffic, nodes report RTTs to their peers in telemetry) and reads estimates
out when it builds the planner's NodeSpecs and the router's Holders.

Why it cannot be gamed by the node: a node's speed comes from *driver-measured* stage
times (the client's clock, minus the client-node round trip), never from numbers the node
sends. Its self-reported benchmark (`matmul_tflops`) is only a prior, and a pessimistic
one: until `MIN_SAMPLES` observations exist the estimate is the slower of the claim and
what was measured, so a node that claims 10x its speed is corrected by its first
observation and can never look faster than its measurements. After `MIN_SAMPLES`
observations the claim is ignored (a node that under-claimed gets its real speed).

Each average is an exponentially weighted moving average seeded with the first sample, so
after n samples of a steady value the estimate *is* that value, and a node that slows down
is tracked within a few samples (weight `ALPHA` on the newest).
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from dataclasses import dataclass

ALPHA = 0.3  # weight of the newest sample: a changed node is tracked within ~5 samples
MIN_SAMPLES = 8  # observations after which measurements replace the self-reported claim
# One observation cannot move a per-layer time by more than this factor from the average
# once the average is established: a single stall (GC pause, swap) is not a new speed.
MAX_STEP_FACTOR = 4.0
MAX_PEERS = 256  # RTT averages kept per node (telemetry is bounded by what nodes probe)


@dataclass
class Ewma:
    value: float = 0.0
    samples: int = 0

    def add(self, sample: float, alpha: float = ALPHA) -> None:
        if self.samples == 0:
            self.value = sample
        else:
            self.value += alpha * (sample - self.value)
        self.samples += 1


@dataclass(frozen=True)
class Measured:
    """What the planner and the router should use for one node (for one model's layers)."""

    layer_ms: float  # compute time of one layer for one token (0: nothing known)
    queue_ms: float  # mean wait before its compute starts (load)
    rtt_ms: float  # typical round trip to its peers: median of per-peer averages (0: none)
    samples: int  # step observations behind layer_ms
    measured: bool  # True once layer_ms no longer depends on the node's claim


class Measurements:
    def __init__(self, *, min_samples: int = MIN_SAMPLES, alpha: float = ALPHA) -> None:
        if min_samples < 1 or not 0 < alpha <= 1:
            raise ValueError("min_samples must be >= 1 and alpha in (0, 1]")
        self.min_samples = min_samples
        self.alpha = alpha
        self._layer: dict[str, Ewma] = {}
        self._queue: dict[str, Ewma] = {}
        self._rtt: dict[str, dict[str, Ewma]] = {}

    # ---- inputs -------------------------------------------------------------------------

    def observe_step(
        self,
        node_id: str,
        *,
        layers: int,
        params_per_layer: int,
        tokens: int,
        compute_ms: float,
        queue_ms: float = 0.0,
    ) -> None:
        """One stage call of real traffic, as the driver timed it.

        `compute_ms`: the driver's wall time for the call minus its round trip to the node
        and minus `queue_ms`; `layers` layers of `params_per_layer` parameters ran on
        `tokens` tokens. Stored per billion parameters and token, so one average serves
        every model (decode reads each weight once per step: time ~ parameters).
        Observations that cannot be real (no work, negative or non-finite times) are ignored.
        """
        work = layers * params_per_layer * tokens / 1e9
        if work <= 0 or not _finite_non_negative(compute_ms, queue_ms):
            return
        per = compute_ms / work
        average = self._layer.setdefault(node_id, Ewma())
        if average.samples >= self.min_samples:
            low, high = average.value / MAX_STEP_FACTOR, average.value * MAX_STEP_FACTOR
            per = min(max(per, low), high)
        average.add(per, self.alpha)
        self._queue.setdefault(node_id, Ewma()).add(queue_ms, self.alpha)

    def observe_rtt(self, node_id: str, peer_id: str, rtt_ms: float) -> None:
        """A round trip `node_id` measured to `peer_id` (its telemetry's rtt_ms map)."""
        if node_id == peer_id or not _finite_non_negative(rtt_ms):
            return
        peers = self._rtt.setdefault(node_id, {})
        if peer_id not in peers and len(peers) >= MAX_PEERS:
            return
        peers.setdefault(peer_id, Ewma()).add(rtt_ms, self.alpha)

    def observe_rtts(self, node_id: str, rtts: dict[str, float]) -> None:
        for peer_id, rtt in rtts.items():
            self.observe_rtt(node_id, peer_id, rtt)

    def forget(self, node_id: str) -> None:
        """The node left for good (banned, deregistered): drop what we know."""
        self._layer.pop(node_id, None)
        self._queue.pop(node_id, None)
        self._rtt.pop(node_id, None)
        for peers in self._rtt.values():
            peers.pop(node_id, None)

    # ---- outputs ------------------------------------------------------------------------

    def ms_per_gparam(self, node_id: str, claimed: float = 0.0) -> float:
        """Compute time per billion parameters and token to plan with.

        Measured once there are `min_samples` observations; before that the slower of the
        claim and the measurements so far (a claim never makes a node look faster than it
        was seen to be); the claim alone when nothing was observed.
        """
        average = self._layer.get(node_id)
        if average is None or average.samples == 0:
            return claimed
        if average.samples >= self.min_samples:
            return average.value
        return max(claimed, average.value)

    def layer_ms(self, node_id: str, params_per_layer: int, claimed_ms: float = 0.0) -> float:
        """`ms_per_gparam` for one layer of `params_per_layer` parameters."""
        scale = params_per_layer / 1e9
        return self.ms_per_gparam(node_id, claimed_ms / scale) * scale

    def rtt_ms(self, node_id: str) -> float:
        """Typical round trip from the node to its peers (median of per-peer averages)."""
        peers = self._rtt.get(node_id)
        if not peers:
            return 0.0
        return float(statistics.median(e.value for e in peers.values()))

    def pair_rtt_ms(self, a: str, b: str) -> float | None:
        """Round trip between two nodes: the mean of what each measured, None if neither did."""
        seen = [
            e.value
            for x, y in ((a, b), (b, a))
            if (e := self._rtt.get(x, {}).get(y)) is not None and e.samples
        ]
        return sum(seen) / len(seen) if seen else None

    def of(self, node_id: str, params_per_layer: int, claimed_layer_ms: float = 0.0) -> Measured:
        average = self._layer.get(node_id)
        samples = average.samples if average else 0
        queue = self._queue.get(node_id)
        return Measured(
            layer_ms=self.layer_ms(node_id, params_per_layer, claimed_layer_ms),
            queue_ms=queue.value if queue else 0.0,
            rtt_ms=self.rtt_ms(node_id),
            samples=samples,
            measured=samples >= self.min_samples,
        )

    def known(self) -> Iterable[str]:
        return set(self._layer) | set(self._rtt)


def _finite_non_negative(*values: float) -> bool:
    return all(v == v and 0.0 <= v < float("inf") for v in values)
