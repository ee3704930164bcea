"""The conductor's gRPC servicer: engines register and report load, and ask where to run requests.

One Conductor per namespace (a model's engines share one), created on first
use with the master's scheduling settings. A Decision that fetches a prefix
starts a real copy of those blocks to the prefill engine's node (see
Replicator). A rejection becomes RESOURCE_EXHAUSTED with "reason: detail".
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
from kvstore.scheduler.conductor import Conductor, Decision, Rejected
from kvstore.scheduler.cost_model import CostModel
from kvstore_client.errors import Overloaded
from kvstore_client.keys import check_namespace
from kvstore_client.proto import kvstore_pb2 as pb
from kvstore_client.proto import kvstore_pb2_grpc as pb_grpc

_Stage = pb.RequestEvent.Stage


@dataclass
class SchedulingOptions:
    """How the master's conductors decide (see kvstore.scheduler)."""

    policy: str = "kvcache_centric"
    admission: str = "prediction"
    ttft_slo_s: float = float("inf")
    tbt_slo_s: float = float("inf")
    balancing_threshold: int = 0


class ConductorServicer(pb_grpc.ConductorServicer):
    """Adapts the Conductor RPCs to per-namespace Conductor objects."""

    def __init__(self, index: PrefixIndex, replicator: Replicator, options: SchedulingOptions,
                 counter, cost: CostModel | None = None):
        self._index = index
        self._replicator = replicator
        self._options = options
        self._cost = cost or CostModel()
        self._count = counter  # the master's RPC counter, shared with the metrics
        self._conductors: dict[str, Conductor] = {}
        self._lock = threading.Lock()

    def conductor(self, namespace: str) -> Conductor:
        namespace = check_namespace(namespace)
        with self._lock:
            conductor = self._conductors.get(namespace)
            if conductor is None:
                o = self._options
                conductor = self._conductors[namespace] = Conductor(
                    self._index, self._cost, policy=o.policy, admission=o.admission, ttft_slo=o.ttft_slo_s,
                    tbt_slo=o.tbt_slo_s, namespace=namespace, balancing_threshold=o.balancing_threshold)
            return conductor

    @_rpc
    def RegisterEngine(self, request, context):
        if not request.engine_id or not request.node_id:
            raise InvalidRequest("an engine needs an engine_id and the node_id its KV lands on")
        conductor = self.conductor(request.namespace)
        if request.role == pb.PREFILL:
            conductor.register_prefill(request.engine_id, request.node_id)
        elif request.role == pb.DECODE:
            conductor.register_decode(request.engine_id, request.node_id)
        else:
            raise InvalidRequest("role must be PREFILL or DECODE")
        return pb.EngineRegistered()

    @_rpc
    def ReportEngineLoad(self, request, context):
        conductor = self.conductor(request.namespace)
        if request.running_batch or request.context_tokens:
            conductor.report_decode_load(request.engine_id, request.running_batch, request.context_tokens)
        else:
            conductor.report_prefill_load(request.engine_id, request.queue_length, request.busy_s)
        return pb.EngineRegistered()

    @_rpc
    def Schedule(self, request, context):
        conductor = self.conductor(request.namespace)
        outcome = conductor.schedule(list(request.digests), request.input_length, request.output_length,
                                     request_id=request.request_id or uuid.uuid4().hex)
        if isinstance(outcome, Rejected):
            raise Overloaded(f"{outcome.reason.value}: {outcome.detail}", outcome.reason.value)
        if outcome.fetch_from and outcome.fetch_blocks:
            self._replicator.copy(request.namespace, outcome.fetch_from, outcome.prefill_node,
                                  list(outcome.fetch_blocks), outcome.local_blocks)
        return _schedule_reply(outcome)

    @_rpc
    def ReportRequest(self, request, context):
        conductor = self.conductor(request.namespace)
        request_id = request.request_id
        if request.stage == _Stage.PREFILL_STARTED:
            conductor.prefill_started(request_id)
        elif request.stage == _Stage.PREFILL_FINISHED:
            outcome = conductor.prefill_finished(request_id)
            if isinstance(outcome, Rejected):
                return pb.RequestEventReply(rejected=True, reason=f"{outcome.reason.value}: {outcome.detail}")
            return pb.RequestEventReply(decode_engine=outcome.decode)
        elif request.stage == _Stage.DECODE_FINISHED:
            conductor.decode_finished(request_id)
        elif request.stage == _Stage.CANCELLED:
            conductor.cancel(request_id)
        else:
            raise InvalidRequest("unknown request stage")
        return pb.RequestEventReply()


def _schedule_reply(d: Decision) -> pb.ScheduleReply:
    return pb.ScheduleReply(
        request_id=str(d.request_id), prefill_engine=d.prefill, prefill_node=d.prefill_node,
        decode_engine=d.decode or "", prefix_blocks=d.prefix_blocks, prefix_tokens=d.prefix_len,
        fetch_from_node=d.fetch_from or "", fetch_blocks=len(d.fetch_blocks),
        estimated_ttft_s=d.est_ttft_s, estimated_tbt_s=d.est_tbt_s)
