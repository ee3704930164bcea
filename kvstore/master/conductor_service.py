"""The conductor's gRPC servicer: engines register and report load, and ask where to run requests.

One Conductor per namespace (a model's engines share one), created on first
use with the master's scheduling settings. A Decision that fetches a prefix
starts a real copy of those blocks to the prefill engine's node (see
Replicator). A rejection becomes RESOURCE_EXHAUSTED with a "reason: detail"
message for people and, for programs, a ScheduleReply carrying ``reason`` and
``detail`` in the trailing metadata ``REJECTION_METADATA`` (the SDK reads it).

What callers leave in the master is bounded (finding: a tenant grew it without bound): every
field a caller controls is size-checked before it is kept (:mod:`kvstore.scheduler.limits`);
engines go only on storage nodes the master has live (else InvalidRequest naming the node id);
each token's engines, namespaces and requests in flight are counted in one
:class:`~kvstore.scheduler.ledger.Ledger` against its limits (ConductorLimitExceeded, or a
TOO_MANY_REQUESTS rejection); and a namespace's conductor is dropped, with all it held, when its
last engine deregisters. At most ``MAX_PENDING_COPIES`` fetches are being copied at once; a
fetch decided beyond that is not copied (the prefill engine computes what its node lacks).

Thread-safety: ``_lock`` guards the namespace -> Conductor map, and registration and
deregistration run under it whole, so a conductor is never dropped while an engine joins it
(lock order: ``_lock``, then a Conductor's lock, then the Ledger's). Each Conductor guards
itself; the Ledger too.
"""

from __future__ import annotations

import threading
import uuid
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable

from kvstore.master.errors import InvalidRequest
from kvstore.master.index import PrefixIndex
from kvstore.master.membership import check_node_id
from kvstore.master.replicator import Replicator
from kvstore.master.service import _rpc
from kvstore.scheduler.clock import Clock
from kvstore.scheduler.conductor import DEFAULT_MAX_REQUESTS, Conductor, Decision, Rejected
from kvstore.scheduler.cost_model import CostModel
from kvstore.scheduler.ledger import Ledger, Owner, Usage
from kvstore.scheduler.limits import (
    TENANT_LIMITS,
    TRUSTED_LIMITS,
    ConductorLimits,
    check_block_digests,
    check_engine_id,
    check_request_id,
)
from kvstore.security.grpc_gate import caller, require_namespace
from kvstore_client.errors import ConfigError, Overloaded
from kvstore_client.keys import check_namespace
from kvstore_client.proto import kvstore_pb2 as pb
from kvstore_client.proto import kvstore_pb2_grpc as pb_grpc
from kvstore_client.scheduling import REJECTION_METADATA

_Stage = pb.RequestEvent.Stage
MAX_PENDING_COPIES = 64  # fetches being copied at once: each holds its digests until done


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
    tenant_limits: ConductorLimits = TENANT_LIMITS  # what one tenant token may hold in the conductor
    trusted_limits: ConductorLimits = TRUSTED_LIMITS  # an admin token, or anyone without an access file

    def __post_init__(self) -> None:
        if not self.request_ttl_s > 0:
            raise ConfigError(f"request_ttl_s must be positive, got {self.request_ttl_s}")


class ConductorServicer(pb_grpc.ConductorServicer):
    """Adapts the Conductor RPCs to per-namespace Conductor objects. ``node_live(node_id)``: whether
    the master has that storage node live (default: the prefix index knows it, which the
    master's membership keeps in step with registration, deregistration and lease expiry)."""

    def __init__(
        self,
        index: PrefixIndex,
        replicator: Replicator,
        options: SchedulingOptions,
        counter,
        cost: CostModel | None = None,
        clock: Clock | None = None,
        node_live: Callable[[str], bool] | None = None,
    ):
        self._index = index
        self._replicator = replicator
        self._options = options
        self._cost = cost or CostModel()
        self.count_rpc = counter  # the master's RPC counter, shared with the metrics
        self._clock = clock  # None: the real clock; tests inject a SimClock (request TTLs)
        self._node_live = node_live or index.has_node
        self._conductors: dict[str, Conductor] = {}
        self._ledger = Ledger()
        self._lock = threading.Lock()
        self._copies = threading.BoundedSemaphore(MAX_PENDING_COPIES)
        self.copies_skipped = 0  # fetches not copied: MAX_PENDING_COPIES were under way

    @property
    def cost(self) -> CostModel:
        """The cost model every namespace's conductor estimates with."""
        return self._cost

    def conductor(self, namespace: str) -> Conductor:
        """The namespace's Conductor; PermissionDenied when the caller's token may not use it
        (every RPC here reaches its conductor through this). For a namespace with no engine the
        answer is an empty conductor that is not kept, so calls naming ever new namespaces hold
        no master memory (bench.fuzz found ~2.5 KB kept per namespace a Schedule named); only a
        registration keeps one, until its last engine leaves."""
        namespace = _checked_namespace(namespace)
        with self._lock:
            return self._conductors.get(namespace) or self._new_conductor(namespace)

    def usage(self, token: str | None = None) -> Usage:
        """Namespaces with engines, engines and requests in flight that the token named ``token``
        holds ("" in a pool without an access file); None: everyone's, every namespace kept."""
        return self._ledger.usage(token)

    def _new_conductor(self, namespace: str) -> Conductor:
        o = self._options
        return Conductor(
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
            budget=self._ledger,
        )

    def _owner(self) -> Owner:
        """The caller, with the limits its role has."""
        principal = caller()
        o = self._options
        return Owner(principal.name, o.tenant_limits if principal.confined else o.trusted_limits)

    @_rpc
    def RegisterEngine(self, request, context):
        self.register_engine(request)
        return pb.EngineRegistered()

    @_rpc
    def DeregisterEngine(self, request, context):
        namespace = _checked_namespace(request.namespace)
        if not request.engine_id:
            raise InvalidRequest("deregistering needs an engine_id")
        ended = self.deregister_engine(namespace, check_engine_id(request.engine_id))
        return pb.EngineDeregistered(known=ended is not None, ended_requests=ended or 0)

    @_rpc
    def ReportEngineLoad(self, request, context):
        """Read by the engine's registered role: an idle decode engine's zeros are a decode report."""
        conductor = self.conductor(request.namespace)
        conductor.report_load(
            check_engine_id(request.engine_id),
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

    # -- engines ----------------------------------------------------------------------------
    def register_engine(self, request: pb.EngineRegistration) -> None:
        """Add an engine on a live node, charged to the caller; the namespace's conductor is kept
        from its first engine on."""
        namespace = _checked_namespace(request.namespace)  # the namespace's check comes first
        if not request.engine_id or not request.node_id:
            raise InvalidRequest("an engine needs an engine_id and the node_id its KV lands on")
        if request.role not in (pb.PREFILL, pb.DECODE):
            raise InvalidRequest("role must be PREFILL or DECODE")
        engine_id, node_id = check_engine_id(request.engine_id), check_node_id(request.node_id)
        if not self._node_live(node_id):
            raise InvalidRequest(f"node_id {node_id!r} is not a live storage node of this pool")
        with self._lock:
            conductor = self._conductors.get(namespace) or self._new_conductor(namespace)
            self._ledger.add_engine(self._owner(), namespace, engine_id)
            try:
                if request.role == pb.PREFILL:
                    conductor.register_prefill(engine_id, node_id)
                else:
                    conductor.register_decode(engine_id, node_id)
            except BaseException:
                self._ledger.remove_engine(namespace, engine_id)
                raise
            self._conductors[namespace] = conductor

    def deregister_engine(self, namespace: str, engine_id: str) -> int | None:
        """Forget an engine and give back its charge; the requests it ended, None if unknown. The
        namespace's conductor goes with its last engine, and all it held with it."""
        with self._lock:
            conductor = self._conductors.get(namespace)
            ended = conductor.deregister(engine_id) if conductor is not None else None
            if ended is None:
                return None
            self._ledger.remove_engine(namespace, engine_id)
            if conductor.engines() == 0:
                ended += conductor.close()
                del self._conductors[namespace]
            return ended

    # -- the calls behind the RPCs (the conductor port serves them too) ------------------------
    def schedule(self, request: pb.ScheduleRequest) -> pb.ScheduleReply:
        """Place one request; ScheduleRejected when the conductor turns it away."""
        request_id = check_request_id(request.request_id)
        digests = check_block_digests(request.digests)
        conductor = self.conductor(request.namespace)
        outcome = conductor.schedule(
            list(digests),
            request.input_length,
            request.output_length,
            request_id=request_id or uuid.uuid4().hex,
            start_prefill=request.start_prefill,
            owner=self._owner(),
        )
        if isinstance(outcome, Rejected):
            raise ScheduleRejected(outcome)
        if outcome.fetch_from and outcome.fetch_blocks:
            self._copy(request.namespace, outcome)
        return _schedule_reply(outcome)

    def _copy(self, namespace: str, d: Decision) -> None:
        """Start the fetch's copy, unless MAX_PENDING_COPIES are under way (then it is skipped)."""
        if not self._copies.acquire(blocking=False):
            self.copies_skipped += 1
            return
        try:
            started: Future = self._replicator.copy(
                namespace, d.fetch_from, d.prefill_node, list(d.fetch_blocks), d.local_blocks
            )
        except BaseException:
            self._copies.release()
            raise
        started.add_done_callback(lambda _: self._copies.release())

    def report_request(self, request: pb.RequestEvent) -> pb.RequestEventReply:
        request_id = check_request_id(request.request_id)
        conductor = self.conductor(request.namespace)
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


def _checked_namespace(namespace: str) -> str:
    """InvalidKey for a malformed namespace, PermissionDenied for one the caller may not use."""
    namespace = check_namespace(namespace)
    require_namespace(namespace)
    return namespace


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
