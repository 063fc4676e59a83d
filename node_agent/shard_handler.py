"""The seam between the control loop and whatever loads model shards.

The coordinator sends `assign` and `drop` commands down the Attach stream; the agent hands
each one to a `ShardHandler` in its own task. The real handler lives in
`node_agent/shard_manager.py` and exposes `build_shard_handler(ctx) -> ShardHandler`;
without it the agent uses `NoRuntimeShardHandler`, which answers FAILED at once so the
coordinator never waits on a shard that will not come. A handler may also have a
`close()` (plain or async); the agent calls it once, when it stops.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, runtime_checkable

from protos.tessera.v1 import coordinator_pb2, node_pb2

# Sends one ShardStatus up the Attach stream (or keeps it for the next stream if the
# coordinator is unreachable right now). Never blocks, never raises.
ReportFn = Callable[[node_pb2.ShardStatus], None]


@runtime_checkable
class ShardHandler(Protocol):
    async def assign(self, cmd: coordinator_pb2.AssignShard, report: ReportFn) -> None:
        """Fetch and load the shard, calling `report` at each step until READY or FAILED.

        Runs in its own task, concurrently with other commands (a `drop` may arrive while
        its `assign` still loads: the handler decides how to cancel). If it raises, the
        agent reports FAILED with the error's message. On shutdown the task is cancelled.
        """
        ...

    async def drop(self, cmd: coordinator_pb2.DropShard) -> None:
        """Unload the shard and free its memory. The agent reports DROPPED after it returns."""
        ...


class NoRuntimeShardHandler:
    """Used when the agent has no model runtime: refuses every shard, loudly and at once."""

    async def assign(self, cmd: coordinator_pb2.AssignShard, report: ReportFn) -> None:
        report(
            node_pb2.ShardStatus(
                model=cmd.model,
                layers=cmd.layers,
                state=node_pb2.SHARD_STATE_FAILED,
                error="this agent has no model runtime",
            )
        )

    async def drop(self, cmd: coordinator_pb2.DropShard) -> None:
        return None
