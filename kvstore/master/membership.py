"""Storage nodes as the master knows them: registration, heartbeats, TTL expiry.

Pure Python, no grpc. A node registers with a stable ``node_id``; registering
again (the node restarted, or the master told it it was unknown) replaces its
info and starts a fresh session: its index entries are dropped until it
reports its inventory.

Node-id binding: a registration binds the id to the registrant's *credential*
(an opaque string; today the node process's random incarnation, see
``kvstore.master.credentials``) and its advertised data address. While that
lease is live, only the same credential at the same address may register the
id again, and only the same credential may heartbeat or report for it;
anything else raises :class:`NodeIdInUse` and changes nothing. Once the lease
lapses the id is free, so a node restarted on its data dir (a new
incarnation) takes it back. A node silent (no heartbeat, no report) for longer
than ``ttl_s`` is dropped by :meth:`Membership.expire`, and its blocks leave
the index. The clock is injectable so tests can move time by hand.

Thread-safety: ``_lock`` (a threading.Lock) guards ``_nodes``; every public
method is atomic. Registration and expiry change the index while holding
``_lock`` (lock order: Membership._lock, then PrefixIndex._lock), so the
index's set of known nodes always equals ``_nodes``: a block report, which
only takes the index lock, is applied for a known node or refused, never
applied for a node that is being dropped.
"""

from __future__ import annotations

import hmac
import threading
import time
from dataclasses import dataclass, field, fields, replace
from typing import Callable, Iterable

from kvstore.master.errors import InvalidRequest
from kvstore.master.index import REMOVED, Batch, PrefixIndex, Stored
from kvstore_client.errors import KVStoreError

MAX_NODE_ID_LEN = 256


class NodeIdInUse(KVStoreError):
    """A live node holds this node id under another credential (a second process with the
    same id, or a forged message): refused, nothing changed. Not a ValueError: the request is
    well formed, the id is taken (gRPC ALREADY_EXISTS)."""


@dataclass(frozen=True)
class NodeIdentity:
    """A storage node's identity and addresses: the proto NodeInfo's fields, as plain Python."""

    node_id: str
    host: str = ""
    machine_id: str = ""  # decides "same host" (local-first placement, shared memory)
    data_address: str = ""  # host:port of the TCP data plane
    unix_socket: str = ""
    shm_arena: str = ""
    metrics_address: str = ""
    arena_pages: str = ""  # "huge", "4KiB", "mixed" or "" (unknown): the page size under the DRAM arena


@dataclass(frozen=True)
class TierStats:
    """One tier's figures from a node's latest heartbeat (the proto TierStats)."""

    tier: str
    capacity: int = 0
    used: int = 0
    blocks: int = 0
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    demotions: int = 0
    promotions: int = 0
    checksum_failures: int = 0


NODE_INFO_FIELDS = tuple(f.name for f in fields(NodeIdentity))
TIER_STATS_FIELDS = tuple(f.name for f in fields(TierStats))


@dataclass(frozen=True)
class NodeState:
    """A snapshot of one registered node."""

    info: NodeIdentity
    registered_at: float
    last_seen: float
    tiers: tuple[TierStats, ...] = field(default=())
    placed: int = 0  # bytes of puts placed on it since its latest heartbeat (not in ``used`` yet)
    credential: str = field(default="", repr=False)  # who registered it (secret: never shown or sent)

    @property
    def node_id(self) -> str:
        return self.info.node_id

    def dram_free(self) -> int:
        """Free DRAM as far as the master can tell: capacity minus used bytes from the latest
        heartbeat (none yet: 0), minus what was placed on it since. Below zero once a full node
        was handed more: in a cache a full node still takes writes (it evicts), and this keeps
        full nodes ranked by how much each was handed, so writers spread over them."""
        free = next((max(0, t.capacity - t.used) for t in self.tiers if t.tier.lower() == "dram"), 0)
        return free - self.placed


def check_node_id(node_id: str) -> str:
    if not isinstance(node_id, str) or not node_id:
        raise InvalidRequest("node_id must be a non-empty string")
    if len(node_id) > MAX_NODE_ID_LEN or not node_id.isprintable():
        raise InvalidRequest(f"node_id must be printable and at most {MAX_NODE_ID_LEN} characters")
    return node_id


class Membership:
    """Registered nodes with heartbeat leases; keeps the index's node set in step."""

    def __init__(self, index: PrefixIndex, ttl_s: float, clock: Callable[[], float] = time.monotonic):
        if ttl_s <= 0:
            raise InvalidRequest(f"ttl_s must be positive, got {ttl_s}")
        self.index = index
        self.ttl_s = ttl_s
        self._clock = clock
        self._lock = threading.Lock()
        self._nodes: dict[str, NodeState] = {}
        self._draining: set[str] = set()  # node ids out of service (kept across re-registration)
        self._rejoin_until = float("-inf")  # after forget_all: nodes are expected back before this

    def register(self, info: NodeIdentity, credential: str = "") -> None:
        """Add or replace a node; its index entries start empty (it reports its inventory next).

        NodeIdInUse if the id is held by a live node with another credential or data address.
        """
        check_node_id(info.node_id)
        with self._lock:
            now = self._clock()
            held = self._nodes.get(info.node_id)
            if (
                held is not None
                and held.last_seen >= now - self.ttl_s
                and not (_same(held.credential, credential) and held.info.data_address == info.data_address)
            ):
                raise NodeIdInUse(
                    f"node id {info.node_id!r} is held by a live node at {held.info.data_address or '(no address)'}"
                    f" registered by another process; it is free once that node is silent for {self.ttl_s:g}s"
                )
            self._nodes[info.node_id] = NodeState(info=info, registered_at=now, last_seen=now, credential=credential)
            self.index.reset_node(info.node_id)

    def heartbeat(self, node_id: str, tiers: Iterable[TierStats] = (), credential: str = "") -> bool:
        """Renew the node's lease and record its tier figures. False if the node is unknown;
        NodeIdInUse if it was registered with another credential."""
        with self._lock:
            state = self._nodes.get(node_id)
            if state is None:
                return False
            _check_holder(state, credential)
            self._nodes[node_id] = replace(state, last_seen=self._clock(), tiers=tuple(tiers), placed=0)
            return True

    def charge(self, node_ids: Iterable[str], nbytes: int) -> None:
        """Count ``nbytes`` placed on each node until its next heartbeat reports them as used."""
        with self._lock:
            for node_id in node_ids:
                state = self._nodes.get(node_id)
                if state is not None:
                    self._nodes[node_id] = replace(state, placed=state.placed + max(0, nbytes))

    def touch(self, node_id: str) -> bool:
        """Renew the node's lease (any message from it is a sign of life). False if unknown."""
        with self._lock:
            state = self._nodes.get(node_id)
            if state is None:
                return False
            self._nodes[node_id] = replace(state, last_seen=self._clock())
            return True

    def report(
        self,
        node_id: str,
        batches: Iterable[Batch],
        full_inventory: bool = False,
        credential: str = "",
        stored: Iterable[Stored] = (),
    ) -> bool:
        """Apply a node's block events and packed ``stored`` blocks (or replace its inventory
        by them). False if the node is unknown.

        Bad events raise (InvalidKey / InvalidRequest), and a credential other than the
        registrant's raises NodeIdInUse, before anything changes.
        """
        with self._lock:
            state = self._nodes.get(node_id)
            if state is not None:
                _check_holder(state, credential)
            draining = node_id in self._draining
        if draining:  # its blocks stay out of the index: only removals count
            batches, stored = [(ns, [e for e in events if e[0] == REMOVED]) for ns, events in batches], ()
        index = self.index
        applied = (index.replace_inventory if full_inventory else index.apply)(node_id, batches, stored)
        if applied:
            self.touch(node_id)
        return applied

    def expire(self) -> list[str]:
        """Drop every node silent for longer than ttl_s, with its blocks; return their ids."""
        with self._lock:
            deadline = self._clock() - self.ttl_s
            dead = [n for n, s in self._nodes.items() if s.last_seen < deadline]
            for node_id in dead:
                del self._nodes[node_id]
                self.index.drop_node(node_id)
            return dead

    def remove(self, node_id: str, credential: str | None = None) -> bool:
        """Drop one node now (a clean shutdown), with its blocks. False if unknown. With a
        ``credential``, only the one that registered the node may: NodeIdInUse otherwise."""
        with self._lock:
            held = self._nodes.get(node_id)
            if held is None:
                return False
            if credential is not None and not _same(held.credential, credential):
                raise NodeIdInUse(f"node id {node_id!r} was registered by another process: not removed")
            del self._nodes[node_id]
            self._draining.discard(node_id)
            self.index.drop_node(node_id)
            return True

    def forget_all(self) -> list[str]:
        """Drop every node and its blocks (a master elected leader starts afresh); their ids.
        Live nodes re-register within one ``ttl_s`` (each heartbeats more often than that):
        until then, :meth:`rejoining` says an empty pool is not yet the real one."""
        with self._lock:
            gone = sorted(self._nodes)
            for node_id in gone:
                del self._nodes[node_id]
                self.index.drop_node(node_id)
            self._draining.clear()
            self._rejoin_until = self._clock() + self.ttl_s
            return gone

    def rejoining(self) -> bool:
        """Whether no node is placeable yet within ``ttl_s`` of :meth:`forget_all`: the
        nodes are re-registering, so "no node" would be a wrong answer to give a writer."""
        with self._lock:
            if self._clock() >= self._rejoin_until:
                return False
        return not self.placeable_nodes()

    def set_draining(self, node_id: str, draining: bool) -> bool:
        """Take a node out of service (no placements, its reports not indexed) or back in.
        False if the node is unknown."""
        with self._lock:
            if node_id not in self._nodes:
                return False
            (self._draining.add if draining else self._draining.discard)(node_id)
            return True

    def is_draining(self, node_id: str) -> bool:
        with self._lock:
            return node_id in self._draining

    def placeable_nodes(self) -> list[NodeState]:
        """Live nodes that take placements: not draining."""
        with self._lock:
            deadline = self._clock() - self.ttl_s
            return [
                self._nodes[n]
                for n in sorted(self._nodes)
                if self._nodes[n].last_seen >= deadline and n not in self._draining
            ]

    def known(self, node_id: str) -> bool:
        with self._lock:
            return node_id in self._nodes

    def get(self, node_id: str) -> NodeState | None:
        with self._lock:
            return self._nodes.get(node_id)

    def nodes(self) -> list[NodeState]:
        """Every registered node, by node id."""
        with self._lock:
            return [self._nodes[n] for n in sorted(self._nodes)]

    def live_nodes(self) -> list[NodeState]:
        """Registered nodes whose lease has not run out (expiry may not have swept yet)."""
        with self._lock:
            deadline = self._clock() - self.ttl_s
            return [self._nodes[n] for n in sorted(self._nodes) if self._nodes[n].last_seen >= deadline]

    def infos(self, node_ids: Iterable[str]) -> list[NodeIdentity]:
        """NodeIdentity of each known node among ``node_ids`` (unknown ids are skipped)."""
        with self._lock:
            return [s.info for n in node_ids if (s := self._nodes.get(n)) is not None]

    def seconds_since(self, state: NodeState) -> float:
        return max(0.0, self._clock() - state.last_seen)

    def __len__(self) -> int:
        with self._lock:
            return len(self._nodes)


def _same(held: str, offered: str) -> bool:
    """Credentials compared in constant time (they are secrets)."""
    return hmac.compare_digest(held.encode(), offered.encode())


def _check_holder(state: NodeState, credential: str) -> None:
    if not _same(state.credential, credential):
        raise NodeIdInUse(f"node id {state.node_id!r} is registered by another process; this one may not speak for it")
