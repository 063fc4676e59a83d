"""How likely a node is to leave, from its history: the planner's reliability input.

A node's departures are modelled as a Poisson process while it is online, with a rate of
its own. The estimate is the posterior mean under a Gamma prior worth one departure over
one prior mean session (`PRIOR_LEAVE_RATE_PER_H`, the planner's rate for a node without
history):

    rate = (departures + 1) / (hours online + 1 / PRIOR_LEAVE_RATE_PER_H)

so a new node gets the prior, a node that came and went five times in an hour gets about
2.5 an hour, and one online for a day without leaving about 0.04. Time online counts the
current session up to now: volunteers' session lengths are heavy-tailed (Weibull with
shape < 1, see bench/placement_sim/churn.py), so a node that has stayed a long time is
likely to stay longer, and the estimate falls as it stays.

A departure is a connected node (online, suspect or draining) going offline or banned.
Offline because the coordinator stopped (`SHUTDOWN_REASON`) or crashed (`RESTART_REASON`,
written when it starts again) is the coordinator's outage, not the node's, so it is not
counted; after a crash the node's time online is counted up to the last event the
coordinator saw of it, since when the crash happened is not known.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from coordinator.db import StateChange
from coordinator.node_state import CONNECTED, RESTART_REASON, SHUTDOWN_REASON, NodeState
from coordinator.planner import PRIOR_LEAVE_RATE_PER_H
from protos.tessera.v1 import node_pb2

# State changes read back from the database at start-up: enough for every node's recent
# history on a large swarm, bounded so that a coordinator that ran for years starts fast.
HISTORY_EVENTS = 200_000
_CONNECTED = frozenset(s.value for s in CONNECTED)
_GONE = frozenset({NodeState.OFFLINE.value, NodeState.BANNED.value})


def leave_rate_per_h(departures: int, online_s: float) -> float:
    """Posterior mean departures per hour online (see the module docstring)."""
    return (departures + 1) / (max(0.0, online_s) / 3600.0 + 1.0 / PRIOR_LEAVE_RATE_PER_H)


@dataclass
class _History:
    departures: int = 0
    online_ms: int = 0  # closed sessions
    since_ms: int | None = None  # start of the current session, if connected
    last_ms: int = 0  # the newest event seen


class NodeHistory:
    """Departures and time online per node, fed by the registry's state changes."""

    def __init__(self) -> None:
        self._nodes: dict[str, _History] = {}

    def replay(self, changes: Iterable[StateChange]) -> None:
        """Seed from node_events rows, oldest first (NodeRepository.events)."""
        for change in changes:
            self.observe(change.node_id, change.to_state, change.ts_ms, change.reason)

    def observe(self, node_id: str, to_state: str, ts_ms: int, reason: str = "") -> None:
        h = self._nodes.setdefault(node_id, _History())
        if to_state in _CONNECTED:
            if h.since_ms is None:
                h.since_ms = ts_ms
        elif to_state in _GONE and h.since_ms is not None:
            end = h.last_ms if reason == RESTART_REASON else ts_ms
            if reason not in (RESTART_REASON, SHUTDOWN_REASON):
                h.departures += 1
            h.online_ms += max(0, end - h.since_ms)
            h.since_ms = None
        h.last_ms = max(h.last_ms, ts_ms)

    def leave_rate_per_h(self, node_id: str, now_ms: int) -> float:
        return leave_rate_per_h(self.departures(node_id), self._online_s(node_id, now_ms))

    def departures(self, node_id: str) -> int:
        h = self._nodes.get(node_id)
        return h.departures if h is not None else 0

    def describe(self, node_id: str, now_ms: int) -> node_pb2.NodeReliability:
        """What `tessera nodes` shows of it."""
        return node_pb2.NodeReliability(
            leave_rate_per_h=self.leave_rate_per_h(node_id, now_ms),
            departures=self.departures(node_id),
            hours_online=self._online_s(node_id, now_ms) / 3600.0,
        )

    def _online_s(self, node_id: str, now_ms: int) -> float:
        h = self._nodes.get(node_id)
        if h is None:
            return 0.0
        current = max(0, now_ms - h.since_ms) if h.since_ms is not None else 0
        return (h.online_ms + current) / 1000.0
