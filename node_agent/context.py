"""What the pluggable parts of the agent (stage server, shard manager) get to see and use.

One `AgentContext` lives for the whole process. Fields about the coordinator change on
every (re-)registration, so read them when needed instead of copying them at start-up.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from node_agent.hardware_probe import HardwareInfo
from node_agent.shard_handler import NoRuntimeShardHandler, ShardHandler
from node_agent.telemetry import TelemetrySource


@dataclass
class AgentContext:
    node_id: str
    private_key: Ed25519PrivateKey  # signs stage outputs: protos.identity.output_payload
    data_dir: Path  # the shard cache belongs under here, e.g. data_dir / "shards"
    hardware: HardwareInfo
    coordinator_address: str  # HOST:PORT, for GetManifest / FetchTensors
    channel_options: list[tuple[str, int]]  # use for every channel the node opens
    max_sessions: int = 0  # owner's cap, 0 = none
    # Set by the agent after each successful Register:
    coordinator_public_key: bytes = b""  # verifies capability tokens offline
    attach_ticket: bytes = b""  # metadata x-tessera-ticket on GetManifest / FetchTensors
    # The coordinator's clock less this machine's, in seconds (RegisterResponse.
    # coordinator_unix_ms): capabilities expire by the coordinator's clock.
    clock_offset_s: float = 0.0
    local_clock: Callable[[], float] = time.time  # this machine's clock (tests skew it)
    # Plug-ins add theirs; the agent merges them into every heartbeat.
    telemetry_sources: list[TelemetrySource] = field(default_factory=list)
    shard_handler: ShardHandler = field(default_factory=NoRuntimeShardHandler)
    _accepting_work: bool = field(default=True, init=False, repr=False)

    def coordinator_time(self) -> float:
        """Now by the coordinator's clock, in Unix seconds."""
        return self.local_clock() + self.clock_offset_s

    def learn_coordinator_clock(self, coordinator_unix_ms: int) -> float:
        """Take the offset of the coordinator's clock as it answered just now (0: an older
        coordinator that does not say, so this machine's own clock is used); returns it."""
        if coordinator_unix_ms > 0:
            self.clock_offset_s = coordinator_unix_ms / 1000.0 - self.local_clock()
        return self.clock_offset_s

    @property
    def accepting_work(self) -> bool:
        """False once the node drains: the stage server must refuse new sessions
        (UNAVAILABLE) but finish the ones already open."""
        return self._accepting_work

    def stop_accepting_work(self) -> None:
        self._accepting_work = False
