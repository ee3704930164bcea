"""Which credential a master RPC carries: the one place that reads it from gRPC metadata.

A storage node sends its incarnation (a random secret drawn once per process)
as ``kvstore-node-incarnation`` metadata on every Register, Heartbeat and
ReportBlocks; Membership binds a node id to the credential that registered it
while its lease is live. Callers that send none carry "" (older tools and
tests), which binds an id just the same. With an access file the credential
is the caller's token name and its incarnation together: another token can
never take a live node's id, even with its incarnation.
"""

from __future__ import annotations

from kvstore.security.grpc_gate import caller

INCARNATION_METADATA = "kvstore-node-incarnation"
MAX_CREDENTIAL_LEN = 256


def node_metadata(incarnation: str) -> tuple[tuple[str, str], ...]:
    """The gRPC metadata a node sends with its membership calls."""
    return ((INCARNATION_METADATA, incarnation),)


def credential_of(context) -> str:
    """The caller's credential from a gRPC servicer context: "<token name>/<incarnation>"
    (either part "" when absent).

    An incarnation over MAX_CREDENTIAL_LEN is cut, not refused: it then matches nothing a node sends.
    """
    incarnation = ""
    for key, value in context.invocation_metadata() or ():
        if key == INCARNATION_METADATA:
            incarnation = value[:MAX_CREDENTIAL_LEN] if isinstance(value, str) else ""
            break
    return f"{caller().name}/{incarnation}"
