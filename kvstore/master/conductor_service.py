"""The conductor's gRPC servicer: engines register and report load, and ask where to run requests.

One Conductor per namespace (a model's engines share one), created on first
use with the master's scheduling settings. A Decision that fetches a prefix
starts a real copy of those blocks to the prefill engine's node (see
Replicator). A rejection becomes RESOURCE_EXHAUSTED with a "reason: detail"
message for people and, for programs, a ScheduleReply carrying ``reason`` and
``detail`` in the trailing metadata ``REJECTION_METADATA`` (the SDK reads it).
Thread-safety: ``_lock`` guards the namespace -> Conductor map; each
Conductor guards itself.
"""

from __future__ import annotations

import threading
import uuid
from dataclasses import dataclass

from kvstore.master.errors import InvalidRequest
from kvstore.master.index import PrefixIndex
from kvstore.master.replicator import Replicator
from kvstore.master.service import _rpc
from kvstore.scheduler.clock import Clock
from kvstore.scheduler.conductor import DEFAULT_MAX_REQUESTS, Conductor, Decision, Rejected
from kvstore.scheduler.cost_model import CostModel
from kvstore.security.grpc_gate import require_namespace
from kvstore_client.errors import ConfigError, Overloaded
from kvstore_client.keys import check_namespace
from kvstore_client.proto import kvstore_pb2 as pb
from kvstore_client.proto import kvstore_pb2_grpc as pb_grpc
from kvstore_client.scheduling import REJECTION_METADATA

_Stage = pb.RequestEvent.Stage


@dataclass
class SchedulingOptions:
    """How the master's conductors decide (see kvstore.scheduler)."""

    policy: str = "kvcache_centric"
    admission: str = "prediction"
    ttft_slo_s: float = float("inf")
    tbt_slo_s: float = float("inf")
    balancing_threshold: int = 0
    request_ttl_s: float = 3600.0  # a request with no report this long is forgotten (lost engine or client)
    max_requests: int = DEFAULT_MAX_REQUESTS  # in flight per namespace; past it Schedule rejects

    def __post_init__(self) -> None:
        if not self.request_ttl_s > 0:
            raise ConfigError(f"request_ttl_s must be positive, got {self.request_ttl_s}")


class ConductorServicer(pb_grpc.ConductorServicer):
    """Adapts the Conductor RPCs to per-namespace Conductor objects."""

    def __init__(
        self,
        index: PrefixIndex,
        replicator: Replicator,
        options: SchedulingOptions,
        counter,
        cost: CostModel | None = None,
        clock: Clock | None = None,
    ):
        self._index = index
        self._replicator = replicator
        self._options = options
        self._cost = cost or CostModel()
        self.count_rpc = counter  # the master's RPC counter, shared with the metrics
        self._clock = clock  # None: the real clock; tests inject a SimClock (request TTLs)
        self._conductors: dict[str, Conductor] = {}
        self._lock = threading.Lock()

    @property
    def cost(self) -> CostModel:
        """The cost model every namespace's conductor estimates with."""
        return self._cost

    def conductor(self, namespace: str, create: bool = False) -> Conductor:
        """The namespace's Conductor; PermissionDenied when the caller's token may not use it
        (every RPC here reaches its conductor through this). Only ``create`` (RegisterEngine)
        keeps a new one: for a namespace no engine ever registered in, the others get an empty
        conductor that is not kept, so calls naming ever new namespaces hold no master memory
        (bench.fuzz found ~2.5 KB kept per namespace a Schedule named)."""
        namespace = check_namespace(namespace)
        require_namespace(namespace)
        with self._lock:
            conductor = self._conductors.get(namespace)
            if conductor is None:
                o = self._options
                conductor = Conductor(
                    self._index,
                    self._cost,
                    policy=o.policy,
                    admission=o.admission,
                    ttft_slo=o.ttft_slo_s,
                    tbt_slo=o.tbt_slo_s,
                    namespace=namespace,
                    balancing_threshold=o.balancing_threshold,
                    request_ttl=o.request_ttl_s,
                    clock=self._clock,
                    max_requests=o.max_requests,
                )
                if create:
                    self._conductors[namespace] = conductor
            return conductor

    @_rpc
    def RegisterEngine(self, request, context):
        conductor = self.conductor(request.namespace, create=True)  # the namespace's check comes first
        if not request.engine_id or not request.node_id:
            raise InvalidRequest("an engine needs an engine_id and the node_id its KV lands on")
        if request.role == pb.PREFILL:
            conductor.register_prefill(request.engine_id, request.node_id)
        elif request.role == pb.DECODE:
            conductor.register_decode(request.engine_id, request.node_id)
        else:
            raise InvalidRequest("role must be PREFILL or DECODE")
        return pb.EngineRegistered()

    @_rpc
    def DeregisterEngine(self, request, context):
        conductor = self.conductor(request.namespace)
        if not request.engine_id:
            raise InvalidRequest("deregistering needs an engine_id")
        ended = conductor.deregister(request.engine_id)
        return pb.EngineDeregistered(known=ended is not None, ended_requests=ended or 0)

    @_rpc
    def ReportEngineLoad(self, request, context):
        """Read by the engine's registered role: an idle decode engine's zeros are a decode report."""
        self.conductor(request.namespace).report_load(
            request.engine_id,
            queue_len=request.queue_length,
            busy_s=request.busy_s,
            batch=request.running_batch,
            context_tokens=request.context_tokens,
        )
        return pb.EngineRegistered()

    @_rpc
    def Schedule(self, request, context):
        try:
            return self.schedule(request)
        except ScheduleRejected as rejected:
            context.set_trailing_metadata([(REJECTION_METADATA, rejected.reply.SerializeToString())])
            raise

    @_rpc
    def ReportRequest(self, request, context):
        return self.report_request(request)

    # -- the calls behind the RPCs (the conductor port serves them too) ------------------------
    def schedule(self, request: pb.ScheduleRequest) -> pb.ScheduleReply:
        """Place one request; ScheduleRejected when the conductor turns it away."""
        conductor = self.conductor(request.namespace)
        outcome = conductor.schedule(
            list(request.digests),
            request.input_length,
            request.output_length,
            request_id=request.request_id or uuid.uuid4().hex,
            start_prefill=request.start_prefill,
        )
        if isinstance(outcome, Rejected):
            raise ScheduleRejected(outcome)
        if outcome.fetch_from and outcome.fetch_blocks:
            self._replicator.copy(
                request.namespace,
                outcome.fetch_from,
                outcome.prefill_node,
                list(outcome.fetch_blocks),
                outcome.local_blocks,
            )
        return _schedule_reply(outcome)

    def report_request(self, request: pb.RequestEvent) -> pb.RequestEventReply:
        conductor = self.conductor(request.namespace)
        request_id = request.request_id
        if request.stage == _Stage.PREFILL_STARTED:
            conductor.prefill_started(request_id)
        elif request.stage == _Stage.PREFILL_FINISHED:
            outcome = conductor.prefill_finished(request_id)
            if isinstance(outcome, Rejected):
                return pb.RequestEventReply(rejected=True, reason=outcome.reason.value, detail=outcome.detail)
            return pb.RequestEventReply(decode_engine=outcome.decode)
        elif request.stage == _Stage.DECODE_FINISHED:
            conductor.decode_finished(request_id)
        elif request.stage == _Stage.CANCELLED:
            conductor.cancel(request_id)
        else:
            raise InvalidRequest("unknown request stage")
        return pb.RequestEventReply()


class ScheduleRejected(Overloaded):
    """Schedule turned a request away; ``reply``: the ScheduleReply saying why (reason, detail)."""

    def __init__(self, rejected: Rejected):
        super().__init__(rejected.message, rejected.reason.value)
        self.reply = _rejection_reply(rejected)


def _rejection_reply(r: Rejected) -> pb.ScheduleReply:
    return pb.ScheduleReply(
        request_id=str(r.request_id), reason=r.reason.value, detail=r.detail, estimated_ttft_s=r.est_ttft_s
    )


def _schedule_reply(d: Decision) -> pb.ScheduleReply:
    return pb.ScheduleReply(
        request_id=str(d.request_id),
        prefill_engine=d.prefill,
        prefill_node=d.prefill_node,
        decode_engine=d.decode or "",
        prefix_blocks=d.prefix_blocks,
        prefix_tokens=d.prefix_len,
        fetch_from_node=d.fetch_from or "",
        fetch_blocks=len(d.fetch_blocks),
        estimated_ttft_s=d.est_ttft_s,
        estimated_tbt_s=d.est_tbt_s,
        decode_final=d.decode_final,
    )
