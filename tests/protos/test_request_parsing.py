"""The interceptor that turns unparsable requests into INVALID_ARGUMENT, on its own; the
servers' behaviour is tested end to end in tests/*/test_unparsable_requests.py."""

from __future__ import annotations

from types import SimpleNamespace

import grpc

from protos.request_parsing import ParseErrorsAreInvalidArgument
from protos.tessera.v1 import common_pb2


async def intercepted(handler: object) -> object:
    async def continuation(details: grpc.HandlerCallDetails) -> object:
        return handler

    return await ParseErrorsAreInvalidArgument().intercept_service(
        continuation,  # type: ignore[arg-type]
        SimpleNamespace(method="/x/Y", invocation_metadata=()),  # type: ignore[arg-type]
    )


async def test_unknown_methods_foreign_and_synchronous_handlers_pass_unchanged() -> None:
    assert await intercepted(None) is None  # an unknown method: gRPC says UNIMPLEMENTED
    foreign = SimpleNamespace(
        request_streaming=False,
        response_streaming=False,
        request_deserializer=common_pb2.Empty.FromString,
        unary_unary=lambda request, context: None,
    )
    assert await intercepted(foreign) is foreign
    synchronous = grpc.unary_unary_rpc_method_handler(
        lambda request, context: request, request_deserializer=common_pb2.Empty.FromString
    )
    assert await intercepted(synchronous) is synchronous  # it could not abort


async def test_grpc_handlers_get_a_deserializer_that_does_not_raise() -> None:
    async def behavior(request: object, context: object) -> object:
        return request

    handler = grpc.unary_unary_rpc_method_handler(
        behavior, request_deserializer=common_pb2.ModelRef.FromString
    )
    wrapped = await intercepted(handler)
    assert wrapped is not handler
    parse = wrapped.request_deserializer  # type: ignore[attr-defined]
    assert parse(common_pb2.ModelRef(name="m").SerializeToString()).name == "m"
    assert type(parse(b"\xff\xff\xff")).__name__ == "_Unparsable"  # marked, not raised


async def test_a_methods_wrapped_handler_is_built_once() -> None:
    async def behavior(request: object, context: object) -> object:
        return request

    handler = grpc.unary_unary_rpc_method_handler(
        behavior, request_deserializer=common_pb2.ModelRef.FromString
    )
    interceptor = ParseErrorsAreInvalidArgument()

    async def continuation(details: grpc.HandlerCallDetails) -> object:
        return handler

    details = SimpleNamespace(method="/x/Y", invocation_metadata=())
    first = await interceptor.intercept_service(continuation, details)  # type: ignore[arg-type]
    again = await interceptor.intercept_service(continuation, details)  # type: ignore[arg-type]
    assert first is again and first is not handler
