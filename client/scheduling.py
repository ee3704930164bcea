"""The SDK side of the conductor: engines register, report load, leave, and ask where requests run.

A rejected Schedule raises :class:`~kvstore_client.errors.Overloaded` whose
``reason`` comes from the structured ScheduleReply the master sends in the
trailing metadata ``REJECTION_METADATA``, not from the message text.
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc

from kvstore_client.errors import Overloaded
from kvstore_client.keys import BlockKey
from kvstore_client.proto import kvstore_pb2 as pb
from kvstore_client.proto import kvstore_pb2_grpc as pb_grpc

ROLES = {"prefill": pb.PREFILL, "decode": pb.DECODE}
REJECTION_METADATA = "kvstore-schedule-reply-bin"  # a serialized ScheduleReply with reason and detail
STAGES = {
    "prefill_started": pb.RequestEvent.PREFILL_STARTED,
    "prefill_finished": pb.RequestEvent.PREFILL_FINISHED,
    "decode_finished": pb.RequestEvent.DECODE_FINISHED,
    "cancelled": pb.RequestEvent.CANCELLED,
}


@dataclass(frozen=True)
class EngineAssignment:
    """Where the conductor runs a request, and what it reuses.

    ``fetch_blocks`` blocks are being copied from ``fetch_from_node`` to the
    prefill engine's node; ``prefix_tokens`` of the input need no prefill.
    """

    request_id: str
    prefill_engine: str
    prefill_node: str
    decode_engine: str
    prefix_blocks: int
    prefix_tokens: int
    fetch_from_node: str
    fetch_blocks: int
    estimated_ttft_s: float
    estimated_tbt_s: float
    decode_final: bool = False  # prefill_finished will name decode_engine and cannot reject


def schedule_request(
    keys: list[BlockKey],
    input_length: int,
    output_length: int = 0,
    request_id: str = "",
    namespace: str | None = None,
    start_prefill: bool = False,
) -> pb.ScheduleRequest:
    """The Schedule request of ``SchedulingCalls.schedule``'s arguments (the namespace: the keys'
    when not given)."""
    if namespace is None:
        if not keys:
            raise ValueError("schedule needs block keys or a namespace")
        namespace = keys[0][0]
    return pb.ScheduleRequest(
        namespace=namespace,
        request_id=request_id,
        digests=[k[1] for k in keys],
        input_length=input_length,
        output_length=output_length,
        start_prefill=start_prefill,
    )


def assignment_of(reply: pb.ScheduleReply) -> EngineAssignment:
    return EngineAssignment(**{f: getattr(reply, f) for f in EngineAssignment.__dataclass_fields__})


class SchedulingCalls:
    """Conductor RPCs over an existing master channel; ``call`` maps gRPC errors to typed ones."""

    def __init__(self, channel: grpc.Channel, call):
        self._stub = pb_grpc.ConductorStub(channel)
        self._call = call

    def register_engine(self, namespace: str, engine_id: str, role: str, node_id: str) -> None:
        self._call(
            self._stub.RegisterEngine,
            pb.EngineRegistration(namespace=namespace, engine_id=engine_id, role=ROLES[role], node_id=node_id),
        )

    def deregister_engine(self, namespace: str, engine_id: str) -> pb.EngineDeregistered:
        """Leave: no new work comes to the engine, and its requests in flight end.
        The reply says whether it was registered (``known``) and how many requests ended."""
        return self._call(
            self._stub.DeregisterEngine, pb.EngineDeregistration(namespace=namespace, engine_id=engine_id)
        )

    def report_load(
        self,
        namespace: str,
        engine_id: str,
        *,
        queue_length: int = 0,
        busy_s: float = 0.0,
        running_batch: int = 0,
        context_tokens: int = 0,
    ) -> None:
        """A prefill engine sends queue_length and busy_s, a decode engine running_batch and
        context_tokens (zeros when idle); the conductor reads them by the registered role."""
        self._call(
            self._stub.ReportEngineLoad,
            pb.EngineLoad(
                namespace=namespace,
                engine_id=engine_id,
                queue_length=queue_length,
                busy_s=busy_s,
                running_batch=running_batch,
                context_tokens=context_tokens,
            ),
        )

    def schedule(
        self,
        keys: list[BlockKey],
        input_length: int,
        output_length: int = 0,
        request_id: str = "",
        namespace: str | None = None,
        start_prefill: bool = False,
    ) -> EngineAssignment:
        """Place one request. ``start_prefill``: the caller sends it to the prefill engine at once,
        so the conductor counts it as started there (no ``prefill_started`` report follows)."""
        request = schedule_request(keys, input_length, output_length, request_id, namespace, start_prefill)
        return assignment_of(self._call(self._schedule, request))

    def _schedule(self, request: pb.ScheduleRequest, **kwargs) -> pb.ScheduleReply:
        """The Schedule call; a rejection raises Overloaded with the reply's ``reason`` field."""
        try:
            return self._stub.Schedule(request, **kwargs)
        except grpc.RpcError as exc:
            rejection = rejection_of(exc)
            if rejection is None:
                raise  # not a rejection: the caller's mapping applies
            raise Overloaded(exc.details() or rejection.detail, rejection.reason) from None

    def report_request(self, namespace: str, request_id: str, stage: str) -> pb.RequestEventReply:
        return self._call(
            self._stub.ReportRequest, pb.RequestEvent(namespace=namespace, request_id=request_id, stage=STAGES[stage])
        )


def rejection_of(exc: grpc.RpcError) -> pb.ScheduleReply | None:
    """The structured rejection a failed Schedule carries, or None (another error, or an older master)."""
    if exc.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
        return None
    # grpc's metadata items are (key, value) namedtuples; the stubs' _Metadatum declares no __iter__
    metadata: tuple[tuple[str, bytes], ...] = exc.trailing_metadata() or ()  # type: ignore[assignment]
    for key, value in metadata:
        if key == REJECTION_METADATA:
            return pb.ScheduleReply.FromString(value)
    return None
