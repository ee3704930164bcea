"""The master's gRPC gate: every call authenticated and checked against its method's roles.

With an access file, ``AuthGate`` (a server interceptor) reads the bearer token
of each call, refuses a missing or unknown one (UNAUTHENTICATED) and a role the
method does not admit (PERMISSION_DENIED), and runs the method with the
caller's Principal in a context variable, where servicers read it with
``caller()`` to check namespaces. ``OPEN_METHODS`` (Prove: the master proving
itself to a client before that client sends a token) are served to anyone. A refused call is answered from its metadata:
its body is never read into a message nor parsed. A method missing from METHOD_ROLES is refused
to everyone: a new RPC is closed until someone decides who may call it.
Without an access file there is no gate and ``caller()`` is ANYONE.
"""

from __future__ import annotations

import contextlib
import contextvars

import grpc

from kvstore_client.auth import token_from_metadata
from kvstore_client.errors import PermissionDenied
from kvstore.security.access import ADMIN, ANYONE, NODE, TENANT, AccessList, Principal

_MEMBERSHIP, _DATA = frozenset({ADMIN, NODE}), frozenset({ADMIN, TENANT})
METHOD_ROLES: dict[str, frozenset] = {
    "Master/Register": _MEMBERSHIP,
    "Master/Heartbeat": _MEMBERSHIP,
    "Master/ReportBlocks": _MEMBERSHIP,
    "Master/Deregister": _MEMBERSHIP,
    "Master/Drain": frozenset({ADMIN}),
    "Master/Peers": _MEMBERSHIP,  # a node checking a PULL's source
    "Master/Locate": _DATA,
    "Master/MatchPrefix": _DATA,
    "Master/Place": _DATA,
    "Master/ClusterStatus": _DATA,
    "Master/ListKeys": _DATA,
    "Conductor/RegisterEngine": _DATA,
    "Conductor/ReportEngineLoad": _DATA,
    "Conductor/Schedule": _DATA,
    "Conductor/ReportRequest": _DATA,
    "Conductor/DeregisterEngine": _DATA,
}

# Methods any caller may use, with or without a token: they reveal nothing and change nothing.
OPEN_METHODS = frozenset({"Master/Prove"})  # a client checking the master before it sends a token
NOBODY = Principal("", TENANT)  # the caller of an open method: a tenant of no namespace

_CALLER: contextvars.ContextVar[Principal] = contextvars.ContextVar("kvstore_caller", default=ANYONE)


def caller() -> Principal:
    """The principal of the RPC this thread serves (ANYONE when no access file is in force)."""
    return _CALLER.get()


@contextlib.contextmanager
def serving_as(principal: Principal):
    """Run the enclosed call as ``principal`` (what ``caller()`` returns): for a transport other
    than gRPC that authenticated its caller itself (the master's conductor port)."""
    token = _CALLER.set(principal)
    try:
        yield
    finally:
        _CALLER.reset(token)


def require_namespace(namespace: str) -> None:
    """PermissionDenied unless the caller may use ``namespace``."""
    principal = _CALLER.get()
    if not principal.may_use(namespace):
        raise PermissionDenied(f"token {principal.name!r} may not use namespace {namespace!r}")


def short_name(method: str) -> str:
    """ "/kvstore.v1.Master/Register" -> "Master/Register"."""
    service, _, name = method.lstrip("/").rpartition("/")
    return f"{service.rpartition('.')[2]}/{name}"


class AuthGate(grpc.ServerInterceptor):
    """Authenticates every call against ``access`` (see the module docstring)."""

    def __init__(self, access: AccessList):
        self._access = access

    def intercept_service(self, continuation, details):
        handler = continuation(details)
        if handler is None:  # unknown method: gRPC answers UNIMPLEMENTED
            return handler
        if handler.unary_unary is None:  # closed until the gate learns to check streams
            return _refusal(
                handler,
                grpc.StatusCode.PERMISSION_DENIED,
                f"{short_name(details.method)}: streaming methods are not served under an access file",
            )
        method = short_name(details.method)
        if method in OPEN_METHODS:
            return _as(handler, NOBODY)
        principal = self._access.bearer(token_from_metadata(details.invocation_metadata))
        if principal is None:
            return _refusal(
                handler,
                grpc.StatusCode.UNAUTHENTICATED,
                f"{method}: a valid token is required (Client(token=...), --token or KVSTORE_TOKEN)",
            )
        roles = METHOD_ROLES.get(method, frozenset())
        if principal.role not in roles:
            return _refusal(
                handler,
                grpc.StatusCode.PERMISSION_DENIED,
                f"{method}: token {principal.name!r} ({principal.role}) may not call it",
            )
        return _as(handler, principal)


def _as(handler, principal: Principal):
    behavior = handler.unary_unary

    def with_caller(request, context):
        with serving_as(principal):
            return behavior(request, context)

    return handler._replace(unary_unary=with_caller)


def _refusal(handler, code: grpc.StatusCode, message: str):
    """A handler that aborts every call with ``code`` from its metadata alone: it takes the
    request as a stream it never reads, so a refused caller's body is never parsed (nor
    waited for), whatever the method's kind."""

    def refuse(requests, context):
        context.abort(code, message)

    return grpc.stream_unary_rpc_method_handler(refuse, response_serializer=handler.response_serializer)
