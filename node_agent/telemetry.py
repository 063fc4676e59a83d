"""Live numbers for every heartbeat, gathered from pluggable sources.

The agent itself only knows process-level facts (memory, CPU load). The stage server and
the shard manager know sessions, queues and KV cache use; they add a source to
`AgentContext.telemetry_sources` and the agent merges them all into each heartbeat.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Protocol, runtime_checkable

import psutil

from protos.tessera.v1 import node_pb2

log = logging.getLogger(__name__)


@runtime_checkable
class TelemetrySource(Protocol):
    def sample(self) -> node_pb2.Telemetry:
        """Only the fields this source knows; leave the rest at zero. Must not block."""
        ...


class ProcessTelemetry:
    """Memory in use and utilisation of this process on its device."""

    def __init__(self, torch_device: str = "cpu") -> None:
        self._torch_device = torch_device
        self._process = psutil.Process()
        self._cores = psutil.cpu_count() or 1
        # The first cpu_percent() call only starts the measurement window.
        self._process.cpu_percent(interval=None)

    def sample(self) -> node_pb2.Telemetry:
        telemetry = node_pb2.Telemetry(
            memory_used_bytes=self._process.memory_info().rss,
            utilization=min(1.0, self._process.cpu_percent(interval=None) / 100.0 / self._cores),
        )
        if self._torch_device.startswith("cuda"):
            self._add_cuda(telemetry)
        return telemetry

    def _add_cuda(self, telemetry: node_pb2.Telemetry) -> None:
        import torch

        telemetry.memory_used_bytes = torch.cuda.memory_allocated(self._torch_device)
        try:
            telemetry.utilization = torch.cuda.utilization(self._torch_device) / 100.0
        except Exception:  # needs the optional pynvml; CPU load is the fallback
            pass


def merge(sources: Iterable[TelemetrySource]) -> node_pb2.Telemetry:
    """Later sources override the non-zero fields of earlier ones; rtt maps are unioned."""
    merged = node_pb2.Telemetry()
    for source in sources:
        try:
            merged.MergeFrom(source.sample())
        except Exception:
            # A broken source must not stop heartbeats, or the node would look dead.
            log.exception("telemetry source %r failed; skipping it for this heartbeat", source)
    return merged


def is_idle(telemetry: node_pb2.Telemetry) -> bool:
    """No session is open and nothing is queued: safe to disconnect."""
    return telemetry.active_sessions == 0 and telemetry.queue_length == 0
