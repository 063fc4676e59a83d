"""Requests whose bytes do not parse get INVALID_ARGUMENT, on every server.

grpc.aio parses a request with the method's deserializer before any servicer code runs,
and answers a protobuf DecodeError there with UNKNOWN "Unexpected <class ...>". An
interceptor swaps each method's deserializer for one that marks (single requests) or
raises (streamed requests) instead, and aborts the call with INVALID_ARGUMENT and a
message a person can act on.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError

Context = grpc.aio.ServicerContext
ADVICE = (
    "the request is not a valid protobuf message of this method's type ({error}); the "
    "client and server may be built from different .proto files: update the client"
)


class _Unparsable:
    """What a single request that did not parse becomes, for its handler to refuse."""

    __slots__ = ("error",)

    def __init__(self, error: str) -> None:
        self.error = error


class UnparsableRequest(Exception):
    """A message of a request stream did not parse."""


def _marking(deserializer: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    def parse(data: bytes) -> Any:
        try:
            return deserializer(data)
        except DecodeError as err:
            return _Unparsable(str(err))

    return parse


def _raising(deserializer: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    def parse(data: bytes) -> Any:
        try:
            return deserializer(data)
        except DecodeError as err:
            raise UnparsableRequest(str(err)) from None

    return parse


async def _refuse(context: Context, error: str) -> None:
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, ADVICE.format(error=error[:200]))


def _single(behavior: Callable[..., Any]) -> Callable[..., Any]:
    if inspect.isasyncgenfunction(behavior):

        async def stream_out(request: Any, context: Context) -> AsyncIterator[Any]:
            if isinstance(request, _Unparsable):
                await _refuse(context, request.error)
            async for response in behavior(request, context):
                yield response

        return stream_out

    async def unary(request: Any, context: Context) -> Any:
        if isinstance(request, _Unparsable):
            await _refuse(context, request.error)
        return await behavior(request, context)

    return unary


def _streamed(behavior: Callable[..., Any]) -> Callable[..., Any]:
    # The parse error is raised where the servicer reads its next message. Read through
    # the request iterator it becomes an abort right there (servicers let AbortError
    # through, while many turn other exceptions into INTERNAL); read with context.read(),
    # it is caught here on its way out.
    async def checked(requests: AsyncIterator[Any], context: Context) -> AsyncIterator[Any]:
        try:
            async for request in requests:
                yield request
        except UnparsableRequest as err:
            await _refuse(context, str(err))

    if inspect.isasyncgenfunction(behavior):

        async def stream_out(requests: Any, context: Context) -> AsyncIterator[Any]:
            try:
                async for response in behavior(checked(requests, context), context):
                    yield response
            except UnparsableRequest as err:
                await _refuse(context, str(err))

        return stream_out

    async def unary(requests: Any, context: Context) -> Any:
        try:
            return await behavior(checked(requests, context), context)
        except UnparsableRequest as err:
            await _refuse(context, str(err))

    return unary


class ParseErrorsAreInvalidArgument(grpc.aio.ServerInterceptor):
    def __init__(self) -> None:
        # gRPC asks on every call; a method's wrapped handler is built once. Only methods the
        # server has are kept (unknown names get no handler), so this stays bounded.
        self._wrapped: dict[str, tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]] = {}

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        method = handler_call_details.method
        cached = self._wrapped.get(method)
        if cached is not None and cached[0] is handler:
            return cached[1]
        wrapped = _wrapped(handler)
        self._wrapped[method] = (handler, wrapped)
        return wrapped


def _wrapped(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """The handler with a deserializer that does not raise a parse error at gRPC."""
    # grpc's own method handlers are namedtuples; anything else is passed on as it is.
    if getattr(handler, "request_deserializer", None) is None or not hasattr(handler, "_replace"):
        return handler
    streamed = handler.request_streaming
    kind = ("stream_" if streamed else "unary_") + (
        "stream" if handler.response_streaming else "unary"
    )
    behavior = getattr(handler, kind)
    # Only coroutines can abort; a synchronous handler (none of ours) keeps gRPC's way.
    if not (inspect.iscoroutinefunction(behavior) or inspect.isasyncgenfunction(behavior)):
        return handler
    if streamed:
        return handler._replace(
            request_deserializer=_raising(handler.request_deserializer),
            **{kind: _streamed(behavior)},
        )
    return handler._replace(
        request_deserializer=_marking(handler.request_deserializer),
        **{kind: _single(behavior)},
    )
