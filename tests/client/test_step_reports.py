"""StepReporter keeps every entry it sends inside the coordinator's limits: one entry out of
range would make the coordinator refuse the whole report (coordinator/sessions.py)."""

from __future__ import annotations

import math

from client.step_reports import MAX_WALL_MS, StepReporter
from protos.tessera.v1 import client_api_pb2


async def test_entries_outside_the_coordinators_limits_are_dropped_or_clamped() -> None:
    reports: list[client_api_pb2.StepTimesReport] = []

    async def send(report: client_api_pb2.StepTimesReport) -> client_api_pb2.StepTimesAck:
        reports.append(report)
        return client_api_pb2.StepTimesAck(accepted=len(report.steps))

    reporter = StepReporter("s", lambda: client_api_pb2.SignedCapability(), send, every=100)
    reporter.add("a", 0, 2, 1, 12.5)
    reporter.add("a", 0, 2, 1, 0.0)  # too short to measure: no information
    reporter.add("a", 0, 2, 1, math.nan)
    reporter.add("b", 2, 4, 3, 5 * MAX_WALL_MS)  # a lower bound past the limit
    await reporter.close()
    [report] = reports
    assert [(s.node_id, s.tokens, s.wall_ms) for s in report.steps] == [
        ("a", 1, 12.5),
        ("b", 3, MAX_WALL_MS),
    ]
