"""Registering a gRPC service so that a request protobuf cannot parse is the caller's error, not the server's.

grpcio parses each request with the message class's `FromString`; when that raises (corrupt wire bytes, a
string field that is not UTF-8), it answers UNKNOWN "Unexpected <class DecodeError>", which reads like a crash
in the server. `add_service` registers a servicer as the generated `add_<Service>Servicer_to_server` does, but
its deserializers return an `Undecodable` in place of raising:
- a unary request that is one fails with INVALID_ARGUMENT, naming the type, before the servicer runs;
- a streamed request's messages reach the servicer as they come, an `Undecodable` among them; the servicer
  answers it inside the stream (the stage's `Process` fails that request with INVALID_ARGUMENT).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import grpc
from google.protobuf import message_factory
from google.protobuf.descriptor import MethodDescriptor, ServiceDescriptor
from google.protobuf.message import DecodeError, Message


class Undecodable:
    """A request message that is not a valid protobuf of its type."""

    __slots__ = ("type_name", "error")

    def __init__(self, type_name: str, error: str):
        self.type_name = type_name
        self.error = error

    @property
    def message(self) -> str:
        return (f"the request message is not a valid {self.type_name} ({self.error}): the client sent corrupt "
                "protobuf bytes, or a string field that is not UTF-8")


def _lenient(cls: type[Message]) -> Callable[[bytes], Message | Undecodable]:
    name = cls.DESCRIPTOR.full_name

    def parse(data: bytes) -> Message | Undecodable:
        try:
            return cls.FromString(data)
        except DecodeError as exc:
            return Undecodable(name, str(exc).removeprefix(f"Error parsing message with type '{name}': "))
    return parse


def _checked_unary(behavior: Callable[..., Any]) -> Callable[..., Any]:
    """`behavior` (a coroutine or an async generator of responses) behind the INVALID_ARGUMENT check."""
    if inspect.isasyncgenfunction(behavior):
        async def stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
            if isinstance(request, Undecodable):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
            async for response in behavior(request, context):
                yield response
        return stream

    async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if isinstance(request, Undecodable):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
        return await behavior(request, context)
    return unary


def _handler(method: MethodDescriptor, behavior: Callable[..., Any]) -> grpc.RpcMethodHandler:
    parse = _lenient(message_factory.GetMessageClass(method.input_type))
    write = message_factory.GetMessageClass(method.output_type).SerializeToString
    streams_out = method.server_streaming
    if method.client_streaming:
        make = grpc.stream_stream_rpc_method_handler if streams_out else grpc.stream_unary_rpc_method_handler
        return make(behavior, request_deserializer=parse, response_serializer=write)
    make = grpc.unary_stream_rpc_method_handler if streams_out else grpc.unary_unary_rpc_method_handler
    return make(_checked_unary(behavior), request_deserializer=parse, response_serializer=write)


def add_service(server: grpc.aio.Server, servicer: object, service: ServiceDescriptor) -> None:
    """Serve `servicer`'s methods (named as in the .proto) as `service`, with lenient request parsing."""
    handlers = {m.name: _handler(m, getattr(servicer, m.name)) for m in service.methods}
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))
    server.add_registered_method_handlers(service.full_name, handlers)
