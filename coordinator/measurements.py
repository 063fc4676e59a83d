"""Moving averages of what the coordinator measures about each node, replacing what the
node claims about itself.

Pure data, no I/O: the coordinator feeds observations in (drivers report per-stage step
times of real traffic, nodes report RTTs to their peers in telemetry) and reads estimates
out when it builds the planner's NodeSpecs and the router's Holders.

Why it cannot be gamed by the node: a node's speed comes from *driver-measured* stage times
(the client's clock; the node's queueing and the client-node round trip included, which is
what a route through it costs), never from numbers the node sends. Its load for the router
comes from its telemetry (active sessions and queue length), and lying low there buys
nothing: the waits it causes show in these times. Its self-reported benchmark
(`matmul_tflops`) is only a prior, and a pessimistic one: until `MIN_SAMPLES` observations
exist the estimate is the slower of the claim and what was measured, so a node that claims
10x its speed is corrected by its first observation and can never look faster than its
measurements. After `MIN_SAMPLES` observations the claim is ignored (a node that
under-claimed gets its real speed).

Each average is an exponentially weighted moving average seeded with the first sample, so
after n samples of a steady value the estimate *is* that value, and a node that slows down
is tracked within a few samples (weight `ALPHA` on the newest).

A call costs a fixed part (the framework, kernel launches, serialisation: a few ms whatever
the layers) plus a part that grows with the parameters it reads. Folded into one number per
parameter, the fixed part makes a node serving few layers look slower than the same card
serving many, and the planner would then take layers away from it for no reason. So the
fixed part is fitted per node (`call_ms`): a least-squares line of call time over work, over
its single-token calls, with a long memory (`FIT_ALPHA`) because only re-plans (and serving
a second model) change a node's work. It is used once the node was seen at works that
differ enough to tell the two parts apart (`MIN_SPREAD`), and kept after; until then it is
0 and the per-parameter time carries everything. A node cannot choose its work (the planner
and the drivers do), and the line always passes through its recent mean call: delaying some
calls only moves time between the two parts, never below what its calls took, and the
planner measures it again at any new span.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

ALPHA = 0.3  # weight of the newest sample: a changed node is tracked within ~5 samples
MIN_SAMPLES = 8  # observations after which measurements replace the self-reported claim
# One observation cannot move a per-layer time by more than this factor from the average
# once the average is established: a single stall (GC pause, swap) is not a new speed.
MAX_STEP_FACTOR = 4.0
MAX_PEERS = 256  # RTT averages kept per node (telemetry is bounded by what nodes probe)
# The fixed-cost fit forgets slowly: a node's work changes only at re-plans (or a 2nd model).
FIT_ALPHA = 0.05
# Work must vary by this coefficient of variation before the fixed part can be told apart.
MIN_SPREAD = 0.15
# The fixed part is at most this share of the node's mean call: some time always scales.
MAX_CALL_SHARE = 0.9


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


@dataclass
class LineFit:
    """Exponentially weighted least squares of y over x (a call's ms over its work)."""

    weight: float = 0.0
    x: float = 0.0
    y: float = 0.0
    xx: float = 0.0
    xy: float = 0.0
    samples: int = 0

    def add(self, x: float, y: float, alpha: float = FIT_ALPHA) -> None:
        keep = 1.0 - alpha if self.samples else 0.0
        self.weight = keep * self.weight + 1.0
        self.x = keep * self.x + x
        self.y = keep * self.y + y
        self.xx = keep * self.xx + x * x
        self.xy = keep * self.xy + x * y
        self.samples += 1

    def intercept(self, min_spread: float = MIN_SPREAD) -> float | None:
        """y at x = 0, or None while x has not varied enough to tell it from the slope."""
        if self.weight <= 0:
            return None
        mean_x, mean_y = self.x / self.weight, self.y / self.weight
        var_x = self.xx / self.weight - mean_x * mean_x
        if mean_x <= 0 or var_x <= (min_spread * mean_x) ** 2:
            return None
        slope = (self.xy / self.weight - mean_x * mean_y) / var_x
        return mean_y - slope * mean_x


@dataclass(frozen=True)
class Measured:
    """What the planner and the router should use for one node (for one model's layers)."""

    layer_ms: float  # compute time of one layer for one token (0: nothing known)
    call_ms: float  # fixed time of a call, whatever its layers (0: not told apart yet)
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
        self._work: dict[str, Ewma] = {}  # recent work per call, billion parameter-tokens
        self._fit: dict[str, LineFit] = {}
        self._call: dict[str, float] = {}  # the last fixed part the fit could tell apart
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
    ) -> None:
        """One stage call of real traffic, as the driver timed it.

        `compute_ms`: the driver's wall time for the call, the node's queueing and the
        round trip included (what a route through the node costs at its load; the router
        adds the node's current load from telemetry); `layers` layers of `params_per_layer`
        parameters ran on `tokens` tokens. Stored per billion parameters and token, so one
        average serves every model (decode reads each weight once per step: time ~
        parameters). Observations that cannot be real (no work, negative or non-finite
        times) are ignored.
        """
        work = layers * params_per_layer * tokens / 1e9
        if work <= 0 or not _finite_non_negative(compute_ms):
            return
        per = compute_ms / work
        average = self._layer.setdefault(node_id, Ewma())
        if average.samples >= self.min_samples:
            low, high = average.value / MAX_STEP_FACTOR, average.value * MAX_STEP_FACTOR
            per = min(max(per, low), high)
        average.add(per, self.alpha)
        self._work.setdefault(node_id, Ewma()).add(work, self.alpha)
        if tokens == 1:
            # Only single-token calls feed the line: a batch reads each weight once for all
            # its tokens, a cost per layer that a line over parameter-tokens would misplace.
            fit = self._fit.setdefault(node_id, LineFit())
            fit.add(work, per * work)
            intercept = fit.intercept()
            if intercept is not None and fit.samples >= self.min_samples:
                # Kept when the spread fades (old spans forgotten): a node's software does
                # not change with its span, and the line through its mean follows its speed.
                self._call[node_id] = intercept

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
        self._work.pop(node_id, None)
        self._fit.pop(node_id, None)
        self._call.pop(node_id, None)
        self._rtt.pop(node_id, None)
        for peers in self._rtt.values():
            peers.pop(node_id, None)

    # ---- outputs ------------------------------------------------------------------------

    def ms_per_gparam(self, node_id: str, claimed: float = 0.0) -> float:
        """Compute time per billion parameters and token to plan with, beyond `call_ms`:
        `mean_ms_per_gparam` less the fixed part spread over the node's recent work."""
        mean = self.mean_ms_per_gparam(node_id, claimed)
        call = self.call_ms(node_id)  # 0 until measurements replaced the claim
        return mean - call / self._work[node_id].value if call else mean

    def mean_ms_per_gparam(self, node_id: str, claimed: float = 0.0) -> float:
        """A call's whole time per billion parameters and token at the work the node was
        recently given, its fixed part included (what tells that a node slowed down).

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

    def call_ms(self, node_id: str) -> float:
        """The fixed part of the node's calls (see the module's docstring): 0 until
        `min_samples` calls of work that varied enough, then at most `MAX_CALL_SHARE` of
        its recent mean call."""
        intercept, average = self._call.get(node_id), self._layer.get(node_id)
        if intercept is None or average is None or average.samples < self.min_samples:
            return 0.0
        mean_call = average.value * self._work[node_id].value
        return min(max(intercept, 0.0), MAX_CALL_SHARE * mean_call)

    def work(self, node_id: str) -> float:
        """The node's recent work per call, in billion parameter-tokens (0: none seen)."""
        recent = self._work.get(node_id)
        return recent.value if recent else 0.0

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
        return Measured(
            layer_ms=self.layer_ms(node_id, params_per_layer, claimed_layer_ms),
            call_ms=self.call_ms(node_id),
            rtt_ms=self.rtt_ms(node_id),
            samples=samples,
            measured=samples >= self.min_samples,
        )

    def known(self) -> Iterable[str]:
        return set(self._layer) | set(self._rtt)

    # ---- persistence --------------------------------------------------------------------

    def snapshot(self, node_id: str) -> dict[str, Any]:
        """What is known about the node, as plain JSON-able data (`restore` reads it)."""
        state: dict[str, Any] = {}
        if (layer := self._layer.get(node_id)) is not None:
            state["layer"] = [layer.value, layer.samples]
        if (work := self._work.get(node_id)) is not None:
            state["work"] = [work.value, work.samples]
        if (fit := self._fit.get(node_id)) is not None:
            state["fit"] = [fit.weight, fit.x, fit.y, fit.xx, fit.xy, fit.samples]
        if node_id in self._call:
            state["call"] = self._call[node_id]
        if peers := self._rtt.get(node_id):
            state["rtt"] = {p: [e.value, e.samples] for p, e in sorted(peers.items())}
        return state

    def restore(self, node_id: str, state: Any) -> None:
        """Take back what `snapshot` gave (from a coordinator's database). ValueError, and
        nothing kept, unless every value is a finite non-negative number in its place."""

        def ewma(pair: Any) -> Ewma:
            value, samples = pair
            if not _finite_non_negative(value) or type(samples) is not int or samples < 0:
                raise ValueError(f"not an average: {pair!r}")
            return Ewma(float(value), samples)

        try:
            layer = ewma(state["layer"]) if "layer" in state else None
            work = ewma(state["work"]) if "work" in state else None
            fit = None
            if "fit" in state:
                weight, x, y, xx, xy, samples = state["fit"]
                if not _finite_non_negative(weight, x, y, xx, xy) or type(samples) is not int:
                    raise ValueError(f"not a line fit: {state['fit']!r}")
                fit = LineFit(weight, x, y, xx, xy, samples)
            call = state.get("call")
            if call is not None and not (
                isinstance(call, int | float) and call == call and abs(call) < float("inf")
            ):
                raise ValueError(f"not a fixed part: {call!r}")
            rtt = {str(p): ewma(e) for p, e in list(state.get("rtt", {}).items())[:MAX_PEERS]}
        except (TypeError, KeyError, AttributeError) as exc:
            raise ValueError(f"not a measurement snapshot: {exc!r}") from exc
        if (layer is None) != (work is None):
            raise ValueError("a per-layer time and a work average come together")
        for own in (self._layer, self._work, self._fit, self._call, self._rtt):
            own.pop(node_id, None)  # not `forget`: others' round trips to it stay
        if layer is not None and work is not None:
            self._layer[node_id], self._work[node_id] = layer, work
        if fit is not None:
            self._fit[node_id] = fit
        if call is not None:
            self._call[node_id] = float(call)
        if rtt:
            self._rtt[node_id] = rtt


def _finite_non_negative(*values: float) -> bool:
    return all(v == v and 0.0 <= v < float("inf") for v in values)
