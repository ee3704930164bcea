"""Client: what an inference engine uses to share KV blocks through a kvstore pool.

Control traffic (where blocks live, where to put them) goes to the master over
gRPC; block bytes go straight to storage nodes over the data plane: shared
memory when the node is on this host, TCP otherwise.

Thread-safe: one Client may serve many threads (each thread gets its own
data-plane connections, closed when the thread ends or the client closes).
``AsyncClient`` offers the same calls to asyncio code.
"""

from __future__ import annotations

import logging
import threading
import weakref
from dataclasses import dataclass, field
from typing import Sequence

import grpc

from kvstore_client.buffers import buffer_view
from kvstore_client.cluster_address import master_channel
from kvstore_client.connect import check_data_path, open_connection
from kvstore_client.credentials import Credentials
from kvstore_client.cuda import DeviceView
from kvstore_client.etcd import EtcdTLS
from kvstore_client.errors import (
    ChecksumMismatch,
    ClientClosed,
    ConfigError,
    InvalidValue,
    KVStoreError,
    Overloaded,
    PermissionDenied,
    PutFailed,
    QuotaExceeded,
    ServiceUnavailable,
    Unauthenticated,
)
from kvstore_client.hashing import BlockHasher
from kvstore_client.hostid import machine_id
from kvstore_client.keys import BlockKey, check_key
from kvstore_client.locations import MAX_KEYS, LocationCache, Replica
from kvstore_client.nodes import REFRESH_EVERY_S, KnownNodes
from kvstore_client.objects import ObjectReader, ObjectWriter
from kvstore_client.placements import GROWTH, Placements
from kvstore_client.proto import kvstore_pb2 as pb
from kvstore_client.proto import kvstore_pb2_grpc as pb_grpc
from kvstore_client.scheduling import EngineAssignment, SchedulingCalls
from kvstore_client import slices
from kvstore_client.transport import KEYS_PER_FRAME, UNACKED_MAX, WINDOW, Tuning
from kvstore_client.wire import reply_spin

log = logging.getLogger(__name__)
# Reconnect to a master that went away within a second of its return (gRPC's default backoff
# grows to two minutes, and calls fail fast meanwhile).
GRPC_OPTIONS = [
    ("grpc.max_send_message_length", 64 << 20),
    ("grpc.max_receive_message_length", 64 << 20),
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 1000),
]
_REFUSED = {grpc.StatusCode.UNAUTHENTICATED: Unauthenticated, grpc.StatusCode.PERMISSION_DENIED: PermissionDenied}
QUOTA_MARK = "quota exceeded"  # in the details of the master's QuotaExceeded (RESOURCE_EXHAUSTED)


@dataclass
class PrefixMatch:
    """How much of a prefix chain the pool holds: ``longest`` leading blocks
    somewhere, and per node the leading blocks that node holds by itself."""

    longest: int
    per_node: dict[str, int] = field(default_factory=dict)


class Client:
    """A handle on one kvstore pool, reached through its master at ``master`` (host:port, or
    ``etcd://HOST:PORT[,...][/PREFIX]`` for masters that elect a leader through etcd: calls
    follow the leader, see kvstore_client.cluster_address).

    ``prefer_shm``: use shared memory with nodes on this host. ``location_ttl``:
    seconds a block location stays cached. ``replicas``: copies per put
    (0 = the master's replication factor). ``placement_ttl`` and
    ``placement_bytes``: one placement from the master serves this client's
    puts to a namespace for that many seconds or bytes, whichever ends first
    (the master counts those bytes against the chosen nodes, so concurrent
    writers spread over the pool); a faster writer's placements grow to what
    it puts in ``placement_ttl``, up to ``placement_growth`` (16) times ``placement_bytes``
    (``kvstore_client.placements``). ``verify``: check block checksums on
    every read (cheap: XXH3-64). ``data_path``: force "tcp", "unix" or "shm"
    (default None: shared memory on this host when ``prefer_shm``, else the
    Unix socket, TCP to other hosts). ``token``: what the pool's access file
    knows this caller by (default: the KVSTORE_TOKEN environment variable;
    none for a pool without one). ``tls_ca``: the CA of a pool that speaks
    TLS (default: KVSTORE_TLS_CA); ``tls_cert`` and ``tls_key``: this
    client's certificate, for a pool that wants mutual TLS. ``etcd_tls``: how an
    ``etcd://`` address reaches etcd (kvstore_client.etcd.EtcdTLS: its CA and a client
    certificate; default: KVSTORE_ETCD_CA, KVSTORE_ETCD_CERT and KVSTORE_ETCD_KEY, else plain text).
    The environment is read when the client is built, never at import.

    Tuning (defaults: the SDK's constants; docs/configuration.md lists them all):
    ``window``: request frames in flight on a data-plane connection (the next is sent
    while the node answers the previous). ``keys_per_frame``: blocks in one frame at
    most (and the node's limit). ``max_unacked_puts``: frames of ``wait=False`` puts a
    connection leaves unanswered before it reads the oldest replies. ``reply_spin_us``:
    microseconds a connection polls for a small reply before it sleeps (0: never poll;
    default: the KVSTORE_REPLY_SPIN_US environment variable, else 200).
    ``data_timeout``: seconds a data-plane dial, and each socket operation after it,
    may take (default None: no limit). ``one_sided_reads``: read blocks of this host's
    nodes straight through their block directories, no round trip (else each read
    leases). ``location_cache_size``: keys whose locations are cached at most.
    ``placement_growth``: see ``placement_bytes``. ``node_refresh_interval``: seconds
    between two refreshes of the nodes' addresses at most, when dialling one fails.

    ``close()`` (or the end of a ``with`` block) closes its connections; any
    call after that raises ClientClosed.
    """

    def __init__(
        self,
        master: str,
        *,
        prefer_shm: bool = True,
        location_ttl: float = 2.0,
        placement_ttl: float = 1.0,
        placement_bytes: int = 64 << 20,
        replicas: int = 0,
        verify: bool = True,
        timeout: float = 10.0,
        data_path: str | None = None,
        token: str | None = None,
        tls_ca: str | None = None,
        tls_cert: str | None = None,
        tls_key: str | None = None,
        etcd_tls: EtcdTLS | None = None,
        window: int = WINDOW,
        keys_per_frame: int = KEYS_PER_FRAME,
        max_unacked_puts: int = UNACKED_MAX,
        reply_spin_us: float | None = None,
        data_timeout: float | None = None,
        one_sided_reads: bool = True,
        location_cache_size: int = MAX_KEYS,
        placement_growth: int = GROWTH,
        node_refresh_interval: float = REFRESH_EVERY_S,
    ):
        self.master = master
        self.credentials = Credentials.resolve(token, tls_ca, tls_cert, tls_key, etcd_tls)  # reads the environment
        spin = reply_spin() if reply_spin_us is None else _microseconds(reply_spin_us)  # likewise, now
        self.tuning = Tuning(window, keys_per_frame, max_unacked_puts, spin)
        self.data_timeout = data_timeout
        self.one_sided_reads = one_sided_reads
        self.prefer_shm = prefer_shm
        self.replicas = replicas
        self.verify = verify
        self.data_path = check_data_path(data_path)
        self.timeout = timeout
        self._channel = master_channel(master, self.credentials, GRPC_OPTIONS)  # host:port or etcd://
        self._stub = pb_grpc.MasterStub(self._channel)
        self._locations = LocationCache(location_ttl, location_cache_size)
        self._nodes = KnownNodes(node_refresh_interval)
        self._placements = Placements(
            lambda namespace, nbytes: self._call(self._stub.Place, self._place_request(namespace, nbytes)),
            lambda namespace, nbytes: self._stub.Place.future(
                self._place_request(namespace, nbytes), timeout=self.timeout
            ),
            self._nodes.update,
            placement_ttl,
            placement_bytes,
            placement_growth,
        )
        self._lock = threading.Lock()  # guards _threads and _closed
        self._local = threading.local()  # .state (_ThreadConns) and its .conns and .put_failures
        self._threads: weakref.WeakSet[_ThreadConns] = weakref.WeakSet()  # of the threads alive that used it
        self._closed = False
        self.scheduling = SchedulingCalls(self._channel, self._call)

    # -- writes -------------------------------------------------------------------------
    def put(self, key: BlockKey, value, *, depth: int = 0, wait: bool = True) -> None:
        """Store one block (any contiguous buffer) in the pool (``wait``: see ``batch_put``)."""
        self.batch_put([key], [value], depths=[depth], wait=wait)

    def batch_put(
        self, keys: Sequence[BlockKey], values: Sequence, *, depths: Sequence[int] | None = None, wait: bool = True
    ) -> None:
        """Store blocks; the master places them (local node first, else the one with most free space).

        A primary node may store some blocks of a batch and refuse others
        (CapacityError: it ran out of room): the others are still put (each
        namespace's blocks go to their own placement), then the typed error
        of the first block refused is raised, carrying ``stored`` (the keys
        stored) and ``failures`` ((key, node id, error) for every key not
        stored, PutFailed's shape: retry those). An error that stops the
        batch (the primary unreachable, no placement) carries them too, the
        keys not known to be stored in ``failures``. Replicas are best
        effort, of the blocks their primary stored. With ``wait=False`` it
        returns once the values are on their way (copied into the node's
        arena, or handed to the socket): the caller may reuse its buffers at
        once, and the next put overlaps the node's work on this one. This
        thread's next read from that node waits for them first;
        ``wait_for_puts`` waits for all of them and raises PutFailed for
        those not stored.
        """
        self._check_open()
        keys = [check_key(k) for k in keys]
        if len(values) != len(keys):
            raise InvalidValue(f"{len(keys)} keys but {len(values)} values")
        if not keys:
            return
        depths = list(depths) if depths is not None else [0] * len(keys)
        views = [buffer_view(v) for v in values]
        groups = list(_group_by_namespace(keys).items())
        stored: list[BlockKey] = []
        failures: list[tuple] = []  # (key, node id, error) of each block not stored
        first: KVStoreError | None = None  # the first block's refusal
        for g, (namespace, idx) in enumerate(groups):
            node_id = ""
            try:
                nodes = self._placements.nodes_for(namespace, sum(len(views[i]) for i in idx))
                items = [(keys[i], views[i], depths[i]) for i in idx]
                primary, *replicas = nodes
                node_id = primary.node_id
                results = self._on_node(primary, lambda c: c.put_many(items, wait))
            except KVStoreError as exc:  # nothing of this group, or the next ones, is known stored
                failures.extend((keys[i], node_id, exc) for _, rest in groups[g:] for i in rest)
                raise _put_stopped(exc, stored, failures, len(keys)) from None
            rejected = [(i, e) for i, e in zip(idx, results) if e is not None]
            if rejected:
                first = first or rejected[0][1]
                failures.extend((keys[i], node_id, e) for i, e in rejected)
                idx = [i for i, e in zip(idx, results) if e is None]
                items = [(keys[i], views[i], depths[i]) for i in idx]
                if not idx:
                    continue
            stored.extend(keys[i] for i in idx)
            stored_on = [primary.node_id]
            for node in replicas:
                try:
                    refused: list[Exception] = [
                        e for e in self._on_node(node, lambda c: c.put_many(items, wait)) if e is not None
                    ]
                except OSError as exc:
                    refused = [exc]
                if refused:
                    log.warning("replica put to %s failed: %s", node.node_id, refused[0])
                else:
                    stored_on.append(node.node_id)
            located = tuple((n, pb.DRAM) for n in stored_on)
            self._locations.remember((keys[i], located) for i in idx)
        if first is not None:
            raise _put_stopped(first, stored, failures, len(keys))

    def wait_for_puts(self) -> None:
        """Wait until the nodes have answered every put this thread sent with ``wait=False``;
        raise PutFailed (``.failures``: key, node id, error) if any was not stored, replica
        copies included. Blocks not stored read as misses."""
        self._check_open()
        for node_id, conn in list(self._local.__dict__.get("conns", {}).items()):
            try:
                conn.settle()
            except KVStoreError:
                self._drop_conn(node_id)  # keeps what its puts failed to store
            self._take_put_failures(node_id, conn)
        pending = self._local.__dict__.get("put_failures")
        if pending:
            failures = list(pending)
            pending.clear()
            self._locations.forget(key for key, _, _ in failures)
            raise PutFailed(failures)

    def _take_put_failures(self, node_id: str, conn) -> None:
        """Move what ``conn``'s puts not waited for failed to store into this thread's list."""
        if conn.put_failures:
            self._thread().put_failures.extend((key, node_id, error) for key, error in conn.put_failures)
            conn.put_failures.clear()

    # -- reads ----------------------------------------------------------------------------
    def get(self, key: BlockKey) -> bytes | None:
        """The block's bytes, or None when no node holds it."""
        if self._closed:
            self._check_open()
        key = check_key(key)
        value = self._read_local_one(key, None)
        return value if value is not None else self._read([key], None, local_tried=True)[0]

    def batch_get(self, keys: Sequence[BlockKey]) -> list[bytes | None]:
        self._check_open()
        return self._read([check_key(k) for k in keys], None)

    def get_into(self, key: BlockKey, buffer) -> int | None:
        """Copy the block into ``buffer``; its size, or None when no node holds it."""
        if self._closed:
            self._check_open()
        key, view = check_key(key), buffer_view(buffer, writable=True)
        size = self._read_local_one(key, view)
        return size if size is not None else self._read([key], [view], local_tried=True)[0]

    def batch_get_into(self, keys: Sequence[BlockKey], buffers: Sequence) -> list[int | None]:
        self._check_open()
        if len(buffers) != len(keys):
            raise InvalidValue(f"{len(keys)} keys but {len(buffers)} buffers")
        return self._read([check_key(k) for k in keys], [buffer_view(b, writable=True) for b in buffers])

    def _read(self, keys: list[BlockKey], buffers: list | None, local_tried: bool = False) -> list:
        """Read each key from this host's nodes' block directories if they have it (no round
        trip, not even to the master), else from its best replica, falling back to the next
        on a miss, a dead node or a damaged copy (a copy damaged at its node is dropped there
        and is a miss). Raises the first error no replica got past (ChecksumMismatch: a copy
        arrived damaged twice though its node holds it intact, and no other copy was read)."""
        results: list = [None] * len(keys)
        todo = list(range(len(keys))) if local_tried else self._read_local(keys, buffers, results)
        if not todo:
            return results
        self._from_replicas(
            keys,
            todo,
            results,
            lambda c, idx: c.read_many([keys[i] for i in idx], None if buffers is None else [buffers[i] for i in idx]),
        )
        return results

    def _from_replicas(self, keys: list[BlockKey], todo: list[int], results: list, read) -> None:
        """Fill ``results[i]`` for i in ``todo`` from each key's best replica, falling back to the
        next on a miss, a dead node or a damaged copy: ``read(connection, indices)`` is one
        node's (results, {position: error}). Raises the first error no replica got past."""
        located = self._locate([keys[i] for i in todo]) if todo else []
        candidates: list = [[] for _ in keys]
        for i, replicas in zip(todo, located):
            candidates[i] = self._order(replicas)
        damaged: dict[int, KVStoreError] = {}
        pending = [i for i in todo if candidates[i]]
        while pending:
            by_node: dict[str, list[int]] = {}
            for i in pending:
                by_node.setdefault(candidates[i].pop(0), []).append(i)
            retry = []
            for node_id, idx in by_node.items():
                got, errors = self._read_from(node_id, idx, read)
                for n, (i, value) in enumerate(zip(idx, got)):
                    error = errors.get(n)
                    if error is not None and not isinstance(error, ChecksumMismatch):
                        raise error  # the key or the buffer is at fault, not the replica
                    if error is not None:
                        log.warning("node %s holds a damaged copy of block %d: trying other replicas", node_id, i)
                        damaged[i] = error
                    if value is not None:
                        results[i] = value
                        damaged.pop(i, None)
                    elif candidates[i]:
                        retry.append(i)
                missed = [keys[i] for i, v in zip(idx, got) if v is None]
                if missed:
                    self._locations.forget(missed)
            pending = retry
        if damaged:
            raise damaged[min(damaged)]

    def _read_local(self, keys: list[BlockKey], buffers: list | None, results: list) -> list[int]:
        """Serve what this thread's same-host connections can read one-sidedly into ``results``;
        the indices left to read the usual way."""
        todo = list(range(len(keys)))
        for conn in list(self._local.__dict__.get("conns", {}).values()):
            if not todo:
                break
            if getattr(conn, "one_sided", False):
                got = conn.read_direct([keys[i] for i in todo], None if buffers is None else [buffers[i] for i in todo])
                for i, value in zip(todo, got):
                    results[i] = value
                todo = [i for i, value in zip(todo, got) if value is None]
        return todo

    def _read_local_one(self, key: BlockKey, view: memoryview | DeviceView | None):
        """``_read_local`` for one key (the common call, a few microseconds less): its size once
        copied into ``view``, or its bytes, or None."""
        for conn in list(self._local.__dict__.get("conns", {}).values()):
            if getattr(conn, "one_sided", False):
                got = conn.read_direct_one(key, view)
                if got is not None:
                    return got
        return None

    def _read_from(self, node_id: str, idx: list[int], read) -> tuple[list, dict]:
        """(results, per-position errors) of ``read(connection, idx)`` on one node; all misses
        when it cannot be reached."""
        node = self._nodes.get(node_id)
        if node is None:
            return [None] * len(idx), {}
        try:
            return self._on_node(node, lambda c: read(c, idx))
        except OSError as exc:
            self._nodes.unreachable(node_id, exc)
            return [None] * len(idx), {}

    def _on_node(self, node: pb.NodeInfo, call):
        """``call(connection)``, redialling once: a cached connection, and the address it was
        dialled at, may predate a node restart (the redial asks the master for the current one)."""
        try:
            return call(self._conn(node))
        except OSError:  # TransportError included
            self._drop_conn(node.node_id)
        node = self._nodes.refresh(node, self._live_node_infos)
        try:
            return call(self._conn(node))
        except OSError:
            self._drop_conn(node.node_id)
            raise

    def _live_node_infos(self) -> list[pb.NodeInfo]:
        """Every live node's info, as the master has it now; none when it cannot be asked."""
        try:
            return [n.info for n in self.cluster_status().nodes if n.alive]
        except ServiceUnavailable:
            return []

    # -- sliced values (kvstore_client.slices, kvstore_client.objects) ----------------------------
    def open_objects(
        self, keys: Sequence[BlockKey], slice_lengths: Sequence, *, depths: Sequence[int] | None = None
    ) -> ObjectWriter:
        """Open sliced values for writing a slice at a time: ``writer.write(i, buffers)`` gives
        slice ``i`` of every value, ``writer.complete()`` publishes them (nothing is visible
        before), ``writer.abort()`` gives them up (``with`` does either). ``slice_lengths``:
        the slices' lengths, the same for every value, or one sequence per value. Placed as
        ``batch_put`` places; use the writer on this thread only."""
        self._check_open()
        keys = [check_key(k) for k in keys]
        if slice_lengths and all(type(n) is int for n in slice_lengths):
            shared = slices.layout(slice_lengths)
            tables = [shared] * len(keys)
        else:
            if len(slice_lengths) != len(keys):
                raise InvalidValue(f"{len(keys)} keys but {len(slice_lengths)} slice length lists")
            tables = [slices.layout(lengths) for lengths in slice_lengths]
        depths = list(depths) if depths is not None else [0] * len(keys)
        if len(depths) != len(keys):
            raise InvalidValue(f"{len(keys)} keys but {len(depths)} depths")
        primaries = [""] * len(keys)
        by_node: dict[str, tuple] = {}
        for namespace, idx in _group_by_namespace(keys).items():
            nodes = self._placements.nodes_for(namespace, sum(tables[j].size for j in idx))
            for j in idx:
                primaries[j] = nodes[0].node_id
            for node in nodes:
                by_node.setdefault(node.node_id, (node, []))[1].extend(idx)
        targets = []
        for node_id, (node, idx) in by_node.items():
            try:
                targets.append((node_id, self._conn(node), idx))
            except OSError as exc:
                self._nodes.unreachable(node_id, exc)
                if any(primaries[j] == node_id for j in idx):
                    raise ServiceUnavailable(f"node {node_id} cannot be reached to write to: {exc}") from None
        return ObjectWriter(keys, tables, depths, targets, primaries, self._remember_stored)

    def _remember_stored(self, stored: list[tuple[BlockKey, list[str]]]) -> None:
        self._locations.remember((key, tuple((n, pb.DRAM) for n in nodes)) for key, nodes in stored)

    def read_objects(self, keys: Sequence[BlockKey], *, slices: int | None = None) -> ObjectReader:
        """Hold sliced values for reading slice ranges of all of them at a time:
        ``reader.read_into(first, buffers, count=1)``, then ``reader.close()`` (or ``with``).
        Values on this host are leased once and copied straight out of the arena; others
        are asked for range by range. ``slices``: read only values of that many slices (the
        others are misses). Use the reader on this thread only."""
        self._check_open()
        keys = [check_key(k) for k in keys]
        routes: list = [None] * len(keys)
        todo = list(range(len(keys)))
        for node_id, conn in list(self._local.__dict__.get("conns", {}).items()):  # this host's, first
            if todo and getattr(conn, "one_sided", False):
                here = conn.holds([keys[j] for j in todo])
                for j, held in zip(todo, here):
                    if held:
                        routes[j] = (node_id, conn)
                todo = [j for j, held in zip(todo, here) if not held]
        for j, replicas in zip(todo, self._locate([keys[j] for j in todo]) if todo else []):
            route = None
            for node_id in self._order(replicas):
                node = self._nodes.get(node_id)
                if node is None:
                    continue
                try:
                    route = (node_id, self._conn(node))
                    break
                except OSError as exc:
                    self._nodes.unreachable(node_id, exc)
            routes[j] = route
        return ObjectReader(keys, routes, self.verify, slices)

    def get_ranges_into(self, key: BlockKey, ranges: Sequence, buffers: Sequence) -> list[int | None]:
        """Ranges of slices of one sliced value, ``ranges[k]`` = (first, count) (or a ``range``)
        into ``buffers[k]``: the bytes copied, None when the value is not in the pool."""
        return self.batch_get_ranges_into([key] * len(ranges), ranges, buffers)

    def batch_get_ranges_into(self, keys: Sequence[BlockKey], ranges: Sequence, buffers: Sequence) -> list[int | None]:
        """For each j, slices ``ranges[j]`` of ``keys[j]``'s value into ``buffers[j]``: the bytes
        copied, or None for a miss. Each slice is checked against its own checksum; a copy
        found damaged is dropped at its node and the next replica is tried. Raises the typed
        error of a key the pool refuses (InvalidValue: not a sliced value, or too few slices)."""
        self._check_open()
        keys = [check_key(k) for k in keys]
        if not len(keys) == len(ranges) == len(buffers):
            raise InvalidValue(f"{len(keys)} keys, {len(ranges)} ranges and {len(buffers)} buffers")
        results: list[int | None] = [None] * len(keys)
        self._from_replicas(
            keys,
            list(range(len(keys))),
            results,
            lambda c, idx: c.read_ranges([keys[j] for j in idx], [ranges[j] for j in idx], [buffers[j] for j in idx]),
        )
        return results

    # -- lookups ---------------------------------------------------------------------------
    def exists(self, key: BlockKey) -> bool:
        return self.batch_exists([key])[0]

    def batch_exists(self, keys: Sequence[BlockKey]) -> list[bool]:
        """Whether each key is in the master's index (asked afresh) or was just stored by this client."""
        self._check_open()
        keys = [check_key(k) for k in keys]
        indexed = self._locate(keys, use_cache=False)
        return [bool(r) or bool(c) for r, c in zip(indexed, self._locations.lookup(keys))]

    def match_prefix(self, keys: Sequence[BlockKey], *, timeout: float | None = None) -> PrefixMatch:
        """How many leading blocks of a prefix chain the pool holds, overall and per node
        (``timeout``: seconds the master may take, default the client's)."""
        self._check_open()
        keys = [check_key(k) for k in keys]
        if not keys:
            return PrefixMatch(0)
        namespace = keys[0][0]
        if any(k[0] != namespace for k in keys):
            raise InvalidValue("a prefix chain lives in one namespace")
        reply = self._call(
            self._stub.MatchPrefix, pb.KeyBatch(namespace=namespace, digests=[k[1] for k in keys]), timeout
        )
        # read your writes: blocks this client just stored may not be indexed yet
        return with_cached_locations(
            PrefixMatch(reply.longest, dict(reply.node_prefix_blocks)), self._locations.lookup(keys)
        )

    def remove(self, key: BlockKey) -> bool:
        """Remove the block from every node holding it that can be reached.

        Returns True if a node reached held the block (and dropped it), False if none
        did, or none holds it. A holder that cannot be reached (a node that just died) is
        skipped: a dead node's copies leave the index when its lease at the master lapses
        (one that comes back with its SSD tier in time may still hold its copy). Raises
        ServiceUnavailable when the block has holders but not one could be reached (what
        is left of it is not known), or when the master cannot be asked where it is.
        """
        self._check_open()
        key = check_key(key)
        removed = False
        holders = {node_id for node_id, _ in self._locate([key], use_cache=False)[0]}
        holders.update(node_id for node_id, _ in self._locations.lookup([key])[0] or ())  # stored just now
        unreachable: dict[str, object] = {}
        for node_id in sorted(holders):
            node = self._nodes.get(node_id)
            if node is None:
                unreachable[node_id] = "address not known"
                continue
            try:
                removed |= bool(self._on_node(node, lambda c: c.remove_many([key]))[0])
            except OSError as exc:  # TransportError included: dead, or gone meanwhile
                self._nodes.unreachable(node_id, exc, "skipped by remove")
                unreachable[node_id] = exc
        self._locations.forget([key])
        if holders and len(unreachable) == len(holders):
            detail = "; ".join(f"{node_id}: {why}" for node_id, why in unreachable.items())
            raise ServiceUnavailable(f"no node holding the block could be reached to remove it ({detail})")
        return removed

    # -- token-level helpers ---------------------------------------------------------------------
    def store_prefix(self, hasher: BlockHasher, tokens: Sequence[int], blocks: Sequence, *, wait: bool = True) -> int:
        """Store the KV blocks of ``tokens`` (one value per full block) that the pool lacks
        (``wait``: see ``batch_put``).

        Returns how many blocks were written (those after the longest cached prefix).
        """
        self._check_open()
        keys = hasher.keys(tokens)
        if len(blocks) < len(keys):
            raise InvalidValue(f"{len(keys)} full blocks but {len(blocks)} values")
        start = self.match_prefix(keys).longest
        if start < len(keys):
            self.batch_put(keys[start:], list(blocks[start : len(keys)]), depths=range(start, len(keys)), wait=wait)
        return len(keys) - start

    def load_prefix(self, hasher: BlockHasher, tokens: Sequence[int], buffers: Sequence) -> int:
        """Load the longest cached prefix of ``tokens`` into ``buffers`` (one per block);
        returns how many tokens are covered by the blocks loaded."""
        self._check_open()
        keys = hasher.keys(tokens)
        hit = self.match_prefix(keys).longest
        got = self.batch_get_into(keys[:hit], list(buffers[:hit]))
        loaded = next((i for i, n in enumerate(got) if n is None), len(got))
        return loaded * hasher.block_size

    # -- scheduling (the conductor) ---------------------------------------------------------------
    def schedule(
        self, keys: Sequence[BlockKey], input_length: int, output_length: int = 0, request_id: str = ""
    ) -> EngineAssignment:
        """Ask the conductor which prefill and decode engines run a request whose prompt has
        the block ``keys``; raises Overloaded (with ``.reason``) when it rejects the request.
        Engines register and report through ``client.scheduling``."""
        self._check_open()
        keys = [check_key(k) for k in keys]
        return self.scheduling.schedule(keys, input_length, output_length, request_id)

    # -- admin -----------------------------------------------------------------------------------
    def cluster_status(self) -> pb.ClusterStatusReply:
        return self._call(self._stub.ClusterStatus, pb.ClusterStatusRequest())

    def drain(self, node_id: str, cancel: bool = False) -> pb.DrainReply:
        """Take a storage node out of service (admin): no new placements on it, blocks only it
        holds copied to other nodes, then its blocks leave the index. ``cancel``: back in service."""
        return self._call(self._stub.Drain, pb.DrainRequest(node_id=node_id, cancel=cancel))

    def list_keys(self, namespace: str = "", limit: int = 100, start_after: bytes = b"") -> pb.ListKeysReply:
        return self._call(
            self._stub.ListKeys, pb.ListKeysRequest(namespace=namespace, limit=limit, start_after=start_after)
        )

    # -- internals -------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise ClientClosed(f"this client of {self.master} is closed")

    def _call(self, method, request, timeout: float | None = None):
        self._check_open()
        try:
            return method(request, timeout=self.timeout if timeout is None else timeout)
        except ValueError:  # "Cannot invoke RPC on closed channel!": closed meanwhile
            self._check_open()
            raise
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
                raise InvalidValue(exc.details()) from None
            if exc.code() in _REFUSED:
                raise _REFUSED[exc.code()](exc.details()) from None
            if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and QUOTA_MARK in (exc.details() or ""):
                raise QuotaExceeded(exc.details()) from None
            if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:  # "Method: reason: detail"
                parts = (exc.details() or "").split(": ", 2)
                raise Overloaded(exc.details() or "", parts[1] if len(parts) == 3 else "") from None
            reachable = exc.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
            state = "failed" if reachable else "is unreachable"
            raise ServiceUnavailable(f"master {self.master} {state}: {exc.code().name}: {exc.details()}") from None

    def _locate(self, keys: list[BlockKey], use_cache: bool = True) -> list[tuple[Replica, ...]]:
        """Replicas of each key: (node_id, tier) pairs, possibly empty."""
        found: list[tuple[Replica, ...] | None] = self._locations.lookup(keys) if use_cache else [None] * len(keys)
        missing = [i for i, r in enumerate(found) if r is None]
        for namespace, idx in _group_by_namespace([keys[i] for i in missing]).items():
            positions = [missing[j] for j in idx]
            reply = self._call(
                self._stub.Locate, pb.KeyBatch(namespace=namespace, digests=[keys[i][1] for i in positions])
            )
            self._nodes.update(reply.nodes)
            fresh = []
            for i, location in zip(positions, reply.locations):
                replicas = found[i] = tuple((r.node_id, r.tier) for r in location.replicas)
                if replicas:
                    fresh.append((keys[i], replicas))
            self._locations.remember(fresh)
        return [() if replicas is None else replicas for replicas in found]

    def _order(self, replicas: tuple) -> list[str]:
        """Replica preference: same host first, then DRAM before SSD."""
        if len(replicas) == 1:  # the common case: nothing to rank
            return [replicas[0][0]]
        here = machine_id()

        def rank(replica):
            node = self._nodes.get(replica[0])
            return (0 if node is not None and node.machine_id == here else 1, 0 if replica[1] == pb.DRAM else 1)

        return [node_id for node_id, _ in sorted(replicas, key=rank)]

    def _place_request(self, namespace: str, nbytes: int) -> pb.PlaceRequest:
        return pb.PlaceRequest(namespace=namespace, bytes=nbytes, replicas=self.replicas, machine_id=machine_id())

    def _thread(self) -> "_ThreadConns":
        """This thread's connections and put failures, made on first use. They live in the
        thread's slot of ``_local``, so they go when the thread ends: a finalizer then closes
        the connections; ``_threads`` knows them only weakly (for ``close``)."""
        state = self._local.__dict__.get("state")
        if state is None:
            state = _ThreadConns()
            self._local.state, self._local.conns, self._local.put_failures = state, state.conns, state.put_failures
            weakref.finalize(state, _close_connections, state.conns, state.put_failures).atexit = False
            with self._lock:
                self._threads.add(state)
        return state

    def _conn(self, node: pb.NodeInfo):
        conns = self._local.__dict__.get("conns")
        if conns is None:
            conns = self._thread().conns
        conn = conns.get(node.node_id)
        if conn is None:
            self._check_open()
            conn = open_connection(
                node,
                prefer_shm=self.prefer_shm,
                verify=self.verify,
                data_path=self.data_path,
                credentials=self.credentials,
                timeout=self.data_timeout,
                one_sided=self.one_sided_reads,
                tuning=self.tuning,
            )
            with self._lock:
                closed = self._closed
                if not closed:
                    conns[node.node_id] = conn
            if closed:  # closed while dialling: nothing may be left open
                conn.close()
                self._check_open()
        return conn

    @property
    def _all_connections(self) -> list:
        """Every data-plane connection this client holds: at most one per node for each live
        thread that used it (one found dead is dropped and closed when it is redialled)."""
        with self._lock:
            threads = list(self._threads)
        return [conn for state in threads for conn in list(state.conns.values())]

    def _drop_conn(self, node_id: str) -> None:
        conn = self._local.__dict__.get("conns", {}).pop(node_id, None)
        if conn is not None:
            try:
                conn.close()
            except OSError:
                pass
            self._take_put_failures(node_id, conn)
        self._placements.clear()  # may name the node just dropped

    def close(self) -> None:
        """Close every data-plane connection and the master channel; later calls raise
        ClientClosed (``close`` itself does nothing the second time)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            threads = list(self._threads)
        for state in threads:
            _close_connections(state.conns, state.put_failures)
        self._placements.clear()
        self._channel.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _ThreadConns:
    """One thread's data-plane connections (node id -> connection) and what its puts sent
    without waiting failed to store ((key, node id, error), for ``wait_for_puts``)."""

    __slots__ = ("conns", "put_failures", "__weakref__")

    def __init__(self) -> None:
        self.conns: dict = {}
        self.put_failures: list = []


def _close_connections(conns: dict, put_failures: list) -> None:
    """Close a thread's connections (its client closed, or the thread ended) and log what its
    puts sent without waiting failed to store: nobody is left to call ``wait_for_puts``."""
    while conns:
        try:
            node_id, conn = conns.popitem()
        except KeyError:  # emptied meanwhile by another closer
            break
        try:
            conn.close()
        except OSError:
            pass
        put_failures.extend((key, node_id, error) for key, error in conn.put_failures)
        conn.put_failures.clear()
    while put_failures:
        key, node_id, error = put_failures.pop(0)
        log.warning("a put sent without waiting was not stored (%r on %s): %s", key, node_id, error)


def _put_stopped(error: KVStoreError, stored: list, failures: list, total: int) -> KVStoreError:
    """``error``, the one a batch put raises, with ``stored`` (the keys stored) and ``failures``
    ((key, node id, error) of each key not stored) on it, and its message saying how many."""
    error.stored = list(stored)
    error.failures = list(failures)
    if total > 1:
        error.args = (f"{error}: batch_put stored {len(stored)} of {total} blocks (.stored and .failures say which)",)
    return error


def with_cached_locations(match: PrefixMatch, cached: list) -> PrefixMatch:
    """``match`` (the master's answer for a chain) extended by the locations this client
    holds for the chain's keys (``cached[i]``: replicas of key i, or None), overall and per
    node: what it stored a moment ago is found before the master has indexed it."""
    n = len(cached)
    longest = match.longest
    while longest < n and cached[longest]:
        longest += 1
    per_node = dict(match.per_node)
    for node_id in {node_id for replicas in cached if replicas for node_id, _ in replicas}:
        held = per_node.get(node_id, 0)
        while held < n and cached[held] and any(r[0] == node_id for r in cached[held]):
            held += 1
        if held:
            per_node[node_id] = held
    return PrefixMatch(longest, per_node)


def _microseconds(us: float) -> float:
    """``us`` microseconds in seconds; ConfigError unless a number of at least 0."""
    if isinstance(us, bool) or not isinstance(us, (int, float)) or not us >= 0:
        raise ConfigError(f"reply_spin_us must be a number of microseconds, at least 0, got {us!r}")
    return us / 1e6


def _group_by_namespace(keys: Sequence[BlockKey]) -> dict[str, list[int]]:
    groups: dict[str, list[int]] = {}
    for i, key in enumerate(keys):
        groups.setdefault(key[0], []).append(i)
    return groups
