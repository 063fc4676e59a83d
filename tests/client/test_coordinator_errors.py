"""Telling a coordinator that was never reached from one that answered with an error.

`Client` raises CoordinatorUnavailable (wait and retry) for the first and CoordinatorError
(its answer) for the second. A coordinator that restarts can be listening again by the time
the client looks at its channel after a refused connection: the refusal itself must say so.
"""

from __future__ import annotations

import grpc
import pytest
from support.ports import free_port

from client.api import never_reached
from protos.tessera.v1 import client_api_pb2_grpc, common_pb2

READY = grpc.ChannelConnectivity.READY
BROKEN = grpc.ChannelConnectivity.TRANSIENT_FAILURE


def answered(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


async def test_a_refused_connection_was_never_reached_whatever_the_channel_says_now() -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{free_port()}") as channel:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await client_api_pb2_grpc.ClientApiStub(channel).ListModels(
                common_pb2.Empty(), timeout=10
            )
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    assert never_reached(refused.value, BROKEN)
    assert never_reached(refused.value, READY)  # the coordinator came back just then


@pytest.mark.parametrize(
    ("code", "state", "expected"),
    [
        (grpc.StatusCode.UNAVAILABLE, READY, False),  # its own answer over a live connection
        (grpc.StatusCode.UNAVAILABLE, BROKEN, True),  # the connection broke under the call
        (grpc.StatusCode.DEADLINE_EXCEEDED, READY, True),
        (grpc.StatusCode.NOT_FOUND, BROKEN, False),
        (grpc.StatusCode.INVALID_ARGUMENT, READY, False),
    ],
)
def test_the_coordinators_own_answers_are_its_answers(
    code: grpc.StatusCode, state: grpc.ChannelConnectivity, expected: bool
) -> None:
    error = answered(code, "model 'tiny' is not served yet: no node has finished loading it")
    assert never_reached(error, state) is expected
