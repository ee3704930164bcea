"""The master's gRPC services, registered so that requests are parsed by the handler, not by gRPC.

grpcio's server never frees a call whose request its deserializer fails on (about 20 KiB
each: tests/test_master_rpc_handlers.py measures it), so a caller sending malformed bodies
could grow the master without bound. Here gRPC hands over the raw bytes and each handler
parses them itself, answering INVALID_ARGUMENT to a body that is not a valid message.
The handlers are otherwise those the generated ``add_*Servicer_to_server`` would register:
same method paths, same reply serializers, and interceptors see them the same way.
"""

from __future__ import annotations

import grpc
from google.protobuf.message import DecodeError

from kvstore_client.proto import kvstore_pb2 as pb


def add_services(server: grpc.Server, servicers: dict[str, object]) -> None:
    """Serve each ``{"Master": servicer, ...}`` (a service of the proto by name) on ``server``."""
    for service_name, servicer in servicers.items():
        service = pb.DESCRIPTOR.services_by_name[service_name]
        handlers = {}
        for method in service.methods:
            request_type = getattr(pb, method.input_type.name)
            reply_type = getattr(pb, method.output_type.name)
            handlers[method.name] = grpc.unary_unary_rpc_method_handler(
                _parsing(getattr(servicer, method.name), request_type),
                request_deserializer=None,  # raw bytes: see the module docstring
                response_serializer=reply_type.SerializeToString,
            )
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))
        server.add_registered_method_handlers(service.full_name, handlers)


def _parsing(behavior, request_type):
    """``behavior(request, context)`` behind a parse of the raw request bytes."""
    name = request_type.DESCRIPTOR.name

    def handle(raw: bytes, context: grpc.ServicerContext):
        try:
            request = request_type.FromString(raw)
        except DecodeError:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed {name}: not a valid protobuf message")
        return behavior(request, context)

    return handle
