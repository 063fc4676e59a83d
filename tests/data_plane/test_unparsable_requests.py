"""Request bytes that no protobuf parses, on every method a node's data plane serves.

grpc.aio parses a request before any servicer runs and answers a parse error with UNKNOWN
"Unexpected <class 'DecodeError'>"; the node's server turns that into INVALID_ARGUMENT
with a message a person can act on (protos/request_parsing.py), and keeps serving.
"""

from __future__ import annotations

import grpc
import numpy as np
from data_plane.stage_harness import NUM_LAYERS, CoordinatorKeys
from data_plane.test_stage_server import PROMPT, Session, logits_of
from support.coordinator_harness import CHANNEL_OPTIONS
from support.hostile import every_method_refuses_garbage

from protos.tessera.v1 import stage_pb2, training_pb2


async def test_every_data_plane_method_refuses_unparsable_bytes(
    start_node, keys: CoordinatorKeys
) -> None:
    node = await start_node([(0, NUM_LAYERS)])
    services = [
        stage_pb2.DESCRIPTOR.services_by_name["Stage"],
        training_pb2.DESCRIPTOR.services_by_name["TrainingStage"],
    ]
    async with grpc.aio.insecure_channel(node.address, options=CHANNEL_OPTIONS) as channel:
        await every_method_refuses_garbage(channel, services)
    # Still serving: a session runs its prefill.
    session = Session.open(node, keys, "s-after-garbage")
    logits = logits_of(await session.tokens(PROMPT, 0))
    assert logits.shape[1] == len(PROMPT) and np.isfinite(logits).all()
    await session.close()
