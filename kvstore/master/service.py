"""The master's gRPC servicer: a thin adapter from proto messages to the domain.

Domain objects (PrefixIndex, Membership, PlacementPolicy) know nothing of gRPC; this
module converts messages, calls them, and maps their typed errors to status
codes in one place (``status_for``). Tiers and event kinds pass through as the
proto's integers (the index uses the same values, asserted below).

Restart path: the master keeps nothing on disk. After a restart every node's
Heartbeat / ReportBlocks answers ``known=false``; the node registers again
(which starts it with an empty index entry set) and sends its full inventory
(``full_inventory=true``; a large inventory may be split: the first message
with full_inventory=true replaces, the following ones with
full_inventory=false add), which rebuilds the index.

Thread-safety: the servicer's own state is the RPC counters (guarded by
``_counts_lock``) and a cache of reply messages per distinct holders tuple
(plain dict operations, atomic under the GIL; a race only builds a message
twice). Everything else is the domain objects' business.
"""

from __future__ import annotations

import functools
import logging
import threading
from typing import Callable

import grpc

from kvstore.master import index as ix
from kvstore.master.credentials import credential_of
from kvstore.master.drain import Drainer
from kvstore.master.errors import InvalidRequest
from kvstore.master.membership import (
    NODE_INFO_FIELDS,
    TIER_STATS_FIELDS,
    Membership,
    NodeIdInUse,
    NodeIdentity,
    TierStats,
    check_node_id,
)
from kvstore.master.validation import check_node_info, check_tier_stats, unpack_digests
from kvstore.master.placement import Candidate, PlacementPolicy
from kvstore.master.quotas import Quotas
from kvstore_client.errors import (
    InvalidKey,
    KVStoreError,
    Overloaded,
    PermissionDenied,
    QuotaExceeded,
    ServiceUnavailable,
    Unauthenticated,
    UnknownNamespace,
)
from kvstore.security.grpc_gate import caller, require_namespace
from kvstore_client.keys import check_namespace
from kvstore_client.leader_record import NONCE_BYTES
from kvstore_client.proto import kvstore_pb2 as pb
from kvstore_client.proto import kvstore_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

assert (ix.DRAM, ix.SSD) == (pb.DRAM, pb.SSD)
assert (ix.STORED, ix.REMOVED) == (pb.BlockEvent.STORED, pb.BlockEvent.REMOVED)

DEFAULT_LIST_LIMIT = 1000
MAX_LIST_LIMIT = 10_000
_LOCATION_CACHE_MAX = 4096


def status_for(error: Exception) -> grpc.StatusCode:
    """The one status code each domain error maps to."""
    if isinstance(error, (InvalidKey, InvalidRequest)):
        return grpc.StatusCode.INVALID_ARGUMENT
    if isinstance(error, UnknownNamespace):
        return grpc.StatusCode.NOT_FOUND
    if isinstance(error, NodeIdInUse):
        return grpc.StatusCode.ALREADY_EXISTS
    if isinstance(error, (Overloaded, QuotaExceeded)):
        return grpc.StatusCode.RESOURCE_EXHAUSTED
    if isinstance(error, PermissionDenied):
        return grpc.StatusCode.PERMISSION_DENIED
    if isinstance(error, Unauthenticated):
        return grpc.StatusCode.UNAUTHENTICATED
    if isinstance(error, ServiceUnavailable):  # passing: the caller may retry (an etcd:// client does)
        return grpc.StatusCode.UNAVAILABLE
    if isinstance(error, ValueError):  # other KVStoreError value errors: still the caller's input
        return grpc.StatusCode.INVALID_ARGUMENT
    return grpc.StatusCode.INTERNAL


def _rpc(method):
    """Count the call and turn domain errors into one clear status."""
    name = method.__name__

    @functools.wraps(method)
    def wrapper(self: MasterServicer, request, context):
        try:
            reply = method(self, request, context)
        except KVStoreError as e:
            code = status_for(e)
            self.count_rpc(name, code)
            context.abort(code, f"{name}: {e}")
        except Exception as e:  # a bug: say so, do not leak a traceback to the client
            log.exception("%s failed", name)
            self.count_rpc(name, grpc.StatusCode.INTERNAL)
            context.abort(grpc.StatusCode.INTERNAL, f"{name}: internal error: {type(e).__name__}")
        self.count_rpc(name, grpc.StatusCode.OK)
        return reply

    return wrapper


def info_from_pb(msg: pb.NodeInfo) -> NodeIdentity:
    return NodeIdentity(**{f: getattr(msg, f) for f in NODE_INFO_FIELDS})


def info_to_pb(info: NodeIdentity) -> pb.NodeInfo:
    return pb.NodeInfo(**{f: getattr(info, f) for f in NODE_INFO_FIELDS})


def tiers_from_pb(msgs) -> list[TierStats]:
    return [TierStats(**{f: getattr(m, f) for f in TIER_STATS_FIELDS}) for m in msgs]


def tiers_to_pb(tiers) -> list[pb.TierStats]:
    return [pb.TierStats(**{f: getattr(t, f) for f in TIER_STATS_FIELDS}) for t in tiers]


def capacities_to_pb(tiers) -> list[pb.TierStats]:
    """What a tenant sees of a node's tiers: their sizes, not what the pool holds or hits."""
    return [pb.TierStats(tier=t.tier, capacity=t.capacity) for t in tiers]


class MasterServicer(pb_grpc.MasterServicer):
    """Serves the Master service over a PrefixIndex, a Membership and a PlacementPolicy."""

    def __init__(
        self,
        membership: Membership,
        placement: PlacementPolicy,
        heartbeat_interval_s: float,
        quotas: Quotas | None = None,
        drainer: Drainer | None = None,
        conductor_address: Callable[[], str] = lambda: "",
        prover: Callable[[bytes, bytes], bytes | None] | None = None,
    ):
        self.membership = membership
        self.prover = prover  # (key id, nonce) -> proof, None for an unknown key (Prove); None: no access file
        self.conductor_address = conductor_address  # the master's conductor port, for ClusterStatus
        self.drainer = drainer  # serves Drain; without one Drain is refused (INVALID_ARGUMENT)
        self.quotas = quotas  # tenant quotas (kvstore.master.quotas), when the access file sets any
        self.index = membership.index
        self.placement = placement
        self.heartbeat_interval_s = heartbeat_interval_s
        self._counts_lock = threading.Lock()
        self._place_lock = threading.Lock()
        self._counts: dict[tuple[str, str], int] = {}
        self._location_cache: dict[ix.Holders, pb.KeyLocation] = {}

    def count_rpc(self, method: str, code: grpc.StatusCode) -> None:
        """One call of ``method`` answered with ``code`` (the conductor's calls count here too)."""
        key = (method, code.name)
        with self._counts_lock:
            self._counts[key] = self._counts.get(key, 0) + 1

    def rpc_counts(self) -> dict[tuple[str, str], int]:
        """{(method, status code name): calls} since start."""
        with self._counts_lock:
            return dict(self._counts)

    # -- membership ------------------------------------------------------------------------
    # A node id is bound to the credential that registered it (``kvstore.master.credentials``):
    # a Register, Heartbeat or ReportBlocks for a live id under another one is ALREADY_EXISTS.
    @_rpc
    def Register(self, request, context):
        info = check_node_info(info_from_pb(request.info))
        self.membership.register(info, credential=credential_of(context))
        return pb.RegisterReply(
            heartbeat_interval_s=self.heartbeat_interval_s,
            ttl_s=self.membership.ttl_s,
            allowances=self._allowances(info.node_id, None),
            packed_reports=True,
        )

    @_rpc
    def Heartbeat(self, request, context):
        check_node_id(request.node_id)
        tiers = check_tier_stats(tiers_from_pb(request.tiers))
        known = self.membership.heartbeat(request.node_id, tiers, credential=credential_of(context))
        return pb.HeartbeatReply(
            known=known, allowances=self._allowances(request.node_id, request.held) if known else []
        )

    def _allowances(self, node_id: str, held) -> list[pb.TenantBytes]:
        """Record a node's per-tenant figures (None: none yet) and answer its allowances."""
        if not self.quotas:
            return []
        if held is not None:
            self.quotas.report(node_id, {t.tenant: t.bytes for t in held})
        allowed = self.quotas.allowances(node_id, len(self.membership.live_nodes()))
        return [pb.TenantBytes(tenant=t, bytes=b) for t, b in allowed.items()]

    @_rpc
    def ReportBlocks(self, request, context):
        check_node_id(request.node_id)
        batches = [(b.namespace, [(e.kind, e.tier, e.digest) for e in b.events]) for b in request.batches]
        stored = [(p.namespace, p.tier, unpack_digests(p.digests, p.digest_len)) for p in request.packed]
        known = self.membership.report(
            request.node_id,
            batches,
            full_inventory=request.full_inventory,
            credential=credential_of(context),
            stored=stored,
        )
        return pb.ReportReply(known=known)

    @_rpc
    def Deregister(self, request, context):
        check_node_id(request.node_id)
        known = self.membership.remove(request.node_id, credential=credential_of(context))
        if known and self.quotas:
            self.quotas.forget(request.node_id)
        if known:
            log.info("node %s left (deregistered) with its blocks", request.node_id)
        return pb.DeregisterReply(known=known)

    @_rpc
    def Prove(self, request, context):
        if self.prover is None:
            return pb.ProveReply()
        if len(request.nonce) != NONCE_BYTES:
            raise InvalidRequest(f"a nonce is {NONCE_BYTES} bytes, got {len(request.nonce)}")
        proof = self.prover(request.key_id, request.nonce)
        if proof is None:
            raise Unauthenticated("Prove: this master holds no such key")
        return pb.ProveReply(proof=proof)

    @_rpc
    def Peers(self, request, context):
        membership = self.membership
        addresses = [
            state.info.data_address
            for state in membership.nodes()
            if state.info.data_address and membership.seconds_since(state) <= membership.ttl_s
        ]
        return pb.PeersReply(data_addresses=addresses)

    @_rpc
    def Drain(self, request, context):
        check_node_id(request.node_id)
        if self.drainer is None:
            raise InvalidRequest("this master does not drain nodes")
        if request.cancel:
            return pb.DrainReply(known=self.drainer.cancel(request.node_id))
        started = self.drainer.start(request.node_id)
        if started is None:
            return pb.DrainReply(known=False)
        indexed, copying = started
        return pb.DrainReply(known=True, indexed_blocks=indexed, copying=copying)

    # -- lookups -----------------------------------------------------------------------------
    @_rpc
    def Locate(self, request, context):
        require_namespace(request.namespace)
        holders_list = self.index.locate(request.namespace, request.digests)
        cache = self._location_cache
        messages = []
        append = messages.append
        distinct = set()
        prev = message = None
        for holders in holders_list:
            if holders is not prev:
                prev = holders
                message = cache.get(holders)
                if message is None:
                    message = self._location_message(holders)
                distinct.add(holders)
            append(message)
        node_ids = sorted({n for holders in distinct for n, _ in holders})
        reply = pb.LocateReply(nodes=[info_to_pb(i) for i in self.membership.infos(node_ids)])
        reply.locations.extend(messages)
        return reply

    def _location_message(self, holders: ix.Holders) -> pb.KeyLocation:
        if len(self._location_cache) >= _LOCATION_CACHE_MAX:
            self._location_cache.clear()
        message = pb.KeyLocation(replicas=[pb.Replica(node_id=n, tier=t) for n, t in holders])
        self._location_cache[holders] = message
        return message

    @_rpc
    def MatchPrefix(self, request, context):
        require_namespace(request.namespace)
        counts, longest = self.index.match_prefix(request.namespace, request.digests)
        return pb.MatchPrefixReply(node_prefix_blocks=counts, longest=longest)

    # -- placement -----------------------------------------------------------------------------
    @_rpc
    def Place(self, request, context):
        check_namespace(request.namespace)
        require_namespace(request.namespace)
        if self.quotas:
            self.quotas.check_place(caller())
        counts = self.index.node_counts()
        with self._place_lock:  # rank and charge as one step: concurrent writers spread out
            live = {s.node_id: s for s in self.membership.placeable_nodes()}
            candidates = [
                Candidate(n, s.info.machine_id, s.dram_free(), sum(counts.get(n, {}).values())) for n, s in live.items()
            ]
            if not live and self.membership.rejoining():
                raise ServiceUnavailable("newly elected: the storage nodes are registering again")
            chosen = self.placement.choose(candidates, machine_id=request.machine_id, replicas=request.replicas)
            self.membership.charge(chosen, request.bytes)
        return pb.PlaceReply(nodes=[info_to_pb(live[n].info) for n in chosen])

    # -- admin ---------------------------------------------------------------------------------
    @_rpc
    def ClusterStatus(self, request, context):
        principal = caller()
        counts = {} if principal.confined else self.index.node_counts()  # per node: the pool's, not a tenant's
        membership = self.membership
        statuses = []
        for state in membership.nodes():
            since = membership.seconds_since(state)
            statuses.append(
                pb.NodeStatus(
                    info=info_to_pb(state.info),
                    tiers=tiers_to_pb(state.tiers) if not principal.confined else capacities_to_pb(state.tiers),
                    alive=since <= membership.ttl_s,
                    seconds_since_heartbeat=since,
                    indexed_blocks=sum(counts.get(state.node_id, {}).values()),
                    draining=membership.is_draining(state.node_id),
                )
            )
        indexed = self.index.size()
        if principal.confined:
            indexed = sum(self.index.namespace_size(ns) for ns in self.index.namespaces() if principal.may_use(ns))
        return pb.ClusterStatusReply(
            nodes=statuses,
            indexed_keys=indexed,
            replication_factor=self.placement.replication_factor,
            conductor_address=self.conductor_address(),
        )

    @_rpc
    def ListKeys(self, request, context):
        """Keys of one namespace, or of every namespace the caller may use."""
        limit = min(request.limit or DEFAULT_LIST_LIMIT, MAX_LIST_LIMIT)
        principal = caller()
        namespaces = [ns for ns in self.index.namespaces() if principal.may_use(ns)]
        if request.namespace:
            require_namespace(request.namespace)
            entries = self.index.list_keys(request.namespace, limit, request.start_after)
        elif not principal.confined:
            entries = self.index.list_keys(None, limit, request.start_after)
        else:
            if request.start_after:
                raise InvalidRequest("start_after needs a namespace: page within one namespace")
            entries = []
            for ns in namespaces:
                if len(entries) >= limit:
                    break
                entries += self.index.list_keys(ns, limit - len(entries))
        keys = [
            pb.KeyEntry(namespace=ns, digest=d, replicas=[pb.Replica(node_id=n, tier=t) for n, t in holders])
            for ns, d, holders in entries
        ]
        return pb.ListKeysReply(keys=keys, namespaces=namespaces)
