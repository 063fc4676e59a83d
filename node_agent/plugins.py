"""Optional parts of the agent that other modules provide, found by name at start-up.

- `node_agent.stage_server.build_stage_servicer(ctx) -> stage_pb2_grpc.StageServicer`
- `node_agent.shard_manager.build_shard_handler(ctx) -> ShardHandler`
- `node_agent.training_server.build_training_servicer(ctx) -> TrainingStageServicer | None`

The shard handler is built first and stored in `ctx.shard_handler`, so the stage server
can find the loaded shards through the context.
"""

from __future__ import annotations

import importlib
import logging

from node_agent.context import AgentContext

log = logging.getLogger(__name__)


def load_plugin(module_name: str, factory: str, ctx: AgentContext) -> object | None:
    """`module.factory(ctx)` if the module exists, else None. Other errors propagate:
    a broken plug-in must fail loudly, not leave a node that silently serves nothing."""
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name != module_name:
            raise
        return None
    build = getattr(module, factory, None)
    if build is None:
        log.warning("%s has no %s(ctx); using the fallback", module_name, factory)
        return None
    return build(ctx)
