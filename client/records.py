"""Plain records of what a generation did: per-stage timings and fail-over events.

They are what ``tessera generate --json`` prints and what the demo summarises, so they
are flat dataclasses that turn into JSON with ``asdict``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class HopRecord:
    """A node serving layers [start, end) of the route."""

    node_id: str
    address: str
    start: int
    end: int
    relayed: bool = False

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class StageTiming:
    """One request to one hop: wall time seen by the client vs compute time on the node."""

    step: int
    node_id: str
    start: int
    end: int
    tokens: int
    wall_ms: float
    compute_ms: float
    replay: bool = False

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class FailoverEvent:
    """A hop that stopped answering and what replaced it."""

    step: int  # the driver's request step (prefill chunks and replays count too)
    start: int
    end: int
    failed_node_id: str
    replacement_node_ids: tuple[str, ...]
    via: str  # "alternate" | "reroute" | "replay" (same node lost its cache) | "resume" (same
    # node, reached again after its connection broke: the step alone went again)
    reason: str
    stalled_ms: float  # from the failed request to the replacement's first answer
    replayed_tokens: int
    position: int = 0  # sequence position of the first token of the request that failed

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["replacement_node_ids"] = list(self.replacement_node_ids)
        return data


@dataclass(frozen=True)
class RollbackEvent:
    """A deferred check rejected a primary after the generation had gone on past the step
    it checked: the session went back to that step and ran it again without the node."""

    position: int  # sequence position of the step's first token
    rejected_node_id: str
    # Positions computed past the step (on the rejected node's output, or just beyond
    # it) and thrown away; 0 when the check settled before the next step began.
    discarded_positions: int
    reason: str

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Receipt:
    """A node's signature over one output; the ledger and verifier consume these."""

    node_id: str
    step: int
    start: int
    end: int
    output_sha256: bytes
    signature: bytes
    input_digest: bytes = b""  # the session's input-prefix digest the signature covers
