"""Request bytes that no protobuf parses, and messages over the size limit, on every
method the coordinator serves.

grpc.aio parses a request before any servicer runs and answers a parse error with UNKNOWN
"Unexpected <class 'DecodeError'>"; the coordinator's server turns that into
INVALID_ARGUMENT with a message a person can act on (protos/request_parsing.py).
"""

from __future__ import annotations

import pytest
from google.protobuf.descriptor import MethodDescriptor
from grpc_health.v1 import health_pb2
from support.coordinator_harness import Harness
from support.hostile import (
    every_method_refuses_garbage,
    method_id,
    method_refuses_oversized,
    methods_of,
)

from coordinator.admin_auth import bearer_metadata
from protos import codec
from protos.tessera.v1 import (
    admin_pb2,
    client_api_pb2,
    common_pb2,
    coordinator_pb2,
    jobs_pb2,
    ledger_pb2,
    training_pb2,
    verification_pb2,
)

SERVICES = [
    coordinator_pb2.DESCRIPTOR.services_by_name["Coordinator"],
    client_api_pb2.DESCRIPTOR.services_by_name["ClientApi"],
    admin_pb2.DESCRIPTOR.services_by_name["Admin"],
    ledger_pb2.DESCRIPTOR.services_by_name["Ledger"],
    jobs_pb2.DESCRIPTOR.services_by_name["Jobs"],
    verification_pb2.DESCRIPTOR.services_by_name["Verification"],
    health_pb2.DESCRIPTOR.services_by_name["Health"],  # grpc.health.v1, for load balancers
    *(
        s
        for name, s in training_pb2.DESCRIPTOR.services_by_name.items()
        if name != "TrainingStage"  # served by nodes, not the coordinator
    ),
]


async def _credentials(harness: Harness) -> tuple[tuple[str, str], ...]:
    """An admin's and a registered node's credentials: calls that check who calls before
    they read the request (UploadCheckpoint) get as far as the bytes too."""
    node = await harness.registered_node()
    return (
        *bearer_metadata(harness.ctx.admin_token),
        ("x-tessera-node-id", node.node_id),
        ("x-tessera-ticket", node.ticket.hex()),
    )


async def test_every_coordinator_method_refuses_unparsable_bytes(harness: Harness) -> None:
    await every_method_refuses_garbage(harness.channel, SERVICES, await _credentials(harness))
    # Still serving.
    assert list((await harness.client_api.ListModels(common_pb2.Empty())).models) == []


@pytest.mark.parametrize("method", methods_of(SERVICES), ids=method_id)
async def test_every_coordinator_method_refuses_oversized_messages(
    harness: Harness, method: MethodDescriptor
) -> None:
    """Past the 64 MiB message limit gRPC answers before any servicer runs: the
    coordinator's server sets that limit for every method, and goes on serving."""
    await method_refuses_oversized(
        harness.channel, method, codec.MAX_MESSAGE_BYTES, await _credentials(harness)
    )
    # Still serving.
    assert list((await harness.client_api.ListModels(common_pb2.Empty())).models) == []
