"""Registering a servicer so that a request which is not a valid protobuf message gets
INVALID_ARGUMENT naming the method and the message type it should have been.

The generated `add_*Servicer_to_server` functions hand the bytes to protobuf inside grpcio, where a
parse failure becomes UNKNOWN ("Unexpected <class DecodeError>") for a unary call and an exception in
the middle of a stream handler. `add_servicer` registers the same methods, read from the service's
descriptor, with the parse moved into the handler: same handlers, same response serializers.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
from google.protobuf.descriptor import MethodDescriptor, ServiceDescriptor
from google.protobuf.message import DecodeError, Message
from google.protobuf.message_factory import GetMessageClass

from manager.errors import InvalidRequest


def not_a_message(method: MethodDescriptor, e: DecodeError) -> str:
    """What a client that sent bytes which do not parse as `method`'s request is told."""
    return (
        f"{method.name}: the request is not a valid {method.input_type.full_name} message ({e}); "
        "send it with a client generated from this server's .proto files"
    )


def _handler(method: MethodDescriptor, fn: Callable[..., Any]) -> grpc.RpcMethodHandler:
    parse: Callable[[bytes], Message] = GetMessageClass(method.input_type).FromString
    serialize = GetMessageClass(method.output_type).SerializeToString

    if method.client_streaming and not method.server_streaming:
        raise TypeError(f"{method.full_name}: client-streaming unary methods are not supported")

    if method.client_streaming:

        async def parsed(requests: AsyncIterator[bytes]) -> AsyncIterator[Message]:
            async for raw in requests:
                try:
                    yield parse(raw)
                except DecodeError as e:  # the servicer maps domain errors to their status
                    raise InvalidRequest(not_a_message(method, e)) from None

        async def stream_stream(requests: AsyncIterator[bytes], context: Any) -> AsyncIterator[Any]:
            async for out in fn(parsed(requests), context):
                yield out

        return grpc.stream_stream_rpc_method_handler(stream_stream, response_serializer=serialize)

    if method.server_streaming:

        async def unary_stream(raw: bytes, context: Any) -> AsyncIterator[Any]:
            try:
                request = parse(raw)
            except DecodeError as e:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, not_a_message(method, e))
            async for out in fn(request, context):
                yield out

        return grpc.unary_stream_rpc_method_handler(unary_stream, response_serializer=serialize)

    async def unary(raw: bytes, context: Any) -> Any:
        try:
            request = parse(raw)
        except DecodeError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, not_a_message(method, e))
        return await fn(request, context)

    return grpc.unary_unary_rpc_method_handler(unary, response_serializer=serialize)


def add_servicer(server: grpc.aio.Server, service: ServiceDescriptor, servicer: object) -> None:
    """Register every method of `service` on `server`, served by `servicer`'s method of that name."""
    handlers = {m.name: _handler(m, getattr(servicer, m.name)) for m in service.methods}
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))
    server.add_registered_method_handlers(service.full_name, handlers)
