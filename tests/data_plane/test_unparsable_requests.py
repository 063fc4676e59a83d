"""Request bytes that no protobuf parses, and messages over the size limit, on every
method a node's data plane serves.

grpc.aio parses a request before any servicer runs and answers a parse error with UNKNOWN
"Unexpected <class 'DecodeError'>"; the node's server turns that into INVALID_ARGUMENT
with a message a person can act on (protos/request_parsing.py), and keeps serving.
"""

from __future__ import annotations

import grpc
import numpy as np
import pytest
from data_plane.stage_harness import NUM_LAYERS, CoordinatorKeys
from data_plane.test_stage_server import PROMPT, Session, logits_of
from google.protobuf.descriptor import MethodDescriptor
from support.coordinator_harness import CHANNEL_OPTIONS
from support.hostile import (
    every_method_refuses_garbage,
    method_id,
    method_refuses_oversized,
    methods_of,
)

from protos import codec
from protos.tessera.v1 import stage_pb2, training_pb2

SERVICES = [
    stage_pb2.DESCRIPTOR.services_by_name["Stage"],
    training_pb2.DESCRIPTOR.services_by_name["TrainingStage"],
]


async def test_every_data_plane_method_refuses_unparsable_bytes(
    start_node, keys: CoordinatorKeys
) -> None:
    node = await start_node([(0, NUM_LAYERS)])
    async with grpc.aio.insecure_channel(node.address, options=CHANNEL_OPTIONS) as channel:
        await every_method_refuses_garbage(channel, SERVICES)
    # Still serving: a session runs its prefill.
    session = Session.open(node, keys, "s-after-garbage")
    logits = logits_of(await session.tokens(PROMPT, 0))
    assert logits.shape[1] == len(PROMPT) and np.isfinite(logits).all()
    await session.close()


@pytest.mark.parametrize("method", methods_of(SERVICES), ids=method_id)
async def test_every_data_plane_method_refuses_oversized_messages(
    start_node, keys: CoordinatorKeys, method: MethodDescriptor
) -> None:
    """Past the 64 MiB message limit gRPC answers before any servicer runs: the node's
    server sets that limit for every method, and goes on serving."""
    node = await start_node([(0, NUM_LAYERS)])
    async with grpc.aio.insecure_channel(node.address, options=CHANNEL_OPTIONS) as channel:
        await method_refuses_oversized(channel, method, codec.MAX_MESSAGE_BYTES)
    # Still serving: a session runs its prefill.
    session = Session.open(node, keys, "s-after-oversized")
    assert (await session.tokens(PROMPT, 0)).cache_length == len(PROMPT)
    await session.close()
