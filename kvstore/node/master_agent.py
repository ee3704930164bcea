"""The node's link to the master: registration, heartbeats, block events.

The master keeps no state on disk. When it answers ``known = false`` (it
restarted, or let this node's lease expire) the agent registers again and
sends the node's whole inventory, which rebuilds the master's index: packed
(digests joined per namespace, tier and length) to a master whose RegisterReply
says ``packed_reports``, else as STORED events. The agent takes and packs that
inventory as soon as a call to the master fails, while the master is away (a
restart takes it a second or so), so that registering with it costs only the
sending; events after the snapshot wait in the queue and follow it.
Events are batched so the put path never waits on the master; a master that is
down only delays them. Queued events go out when the stream pauses (no event for
``_QUIET_S``, and ``_MIN_GAP_S`` since the last report), else ``flush_interval``
after the last report, else as soon as ``max_batch`` are queued: a burst (a
prefill engine's step) is in the index a few milliseconds after its last block,
which a decode engine then looks up, while a steady stream costs one report an
interval and no pattern more than one report every ``_MIN_GAP_S``.

Every membership call carries this process's incarnation (a random secret,
``kvstore.master.credentials``): the master binds the node id to it while the
lease is live. A Register it refuses (ALREADY_EXISTS: another live process
holds the id, e.g. the previous run of this node whose lease has not lapsed
yet) is said once, clearly, and retried until the master accepts it.

``master_address`` may be ``etcd://...`` (masters with a leader elected
through etcd): the calls then follow the leader, and a new leader answers
``known = false``, so the node registers with it and resends its inventory.
"""

from __future__ import annotations

import collections
import logging
import secrets
import threading
import time

import grpc

from kvstore_client.client import GRPC_OPTIONS
from kvstore_client.cluster_address import master_channel
from kvstore_client.credentials import NO_CREDENTIALS, Credentials
from kvstore_client.proto import kvstore_pb2 as pb
from kvstore_client.proto import kvstore_pb2_grpc as pb_grpc
from kvstore_client.tiers import TIER_OF_NAME
from kvstore.master.credentials import node_metadata
from kvstore.node.store import BlockStore

log = logging.getLogger(__name__)

_INVENTORY_CHUNK = 50_000  # STORED events a BlockReport
_PACKED_CHUNK = 200_000  # digests a PackedBlocks message: 3.2 MB at 16 bytes, 12.8 MB at 64
# A restarted master is found within about _RETRY_S: calls are retried that often, and the
# channel redials as often (gRPC's default backoff grows to minutes), so the index comes back
# that soon after the master does. A refused dial costs the master nothing.
_RETRY_S = 0.25
# A snapshot taken while the master was away is sent as is unless this many events came after it
# (they follow it as events): past that, a fresh snapshot is cheaper for the master to take in.
_STALE_EVENTS = 100_000
_QUIET_S = 0.002  # no event for this long: the burst is over, report it
_MIN_GAP_S = 0.01  # reports at most this often, however the events come
_CHANNEL_OPTIONS = [option for option in GRPC_OPTIONS if "reconnect_backoff" not in option[0]] + [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", int(_RETRY_S * 1000)),
]


def tier_stats(stats: dict) -> list:
    """The store's per-tier stats as protobuf TierStats."""
    fields = (
        "capacity",
        "used",
        "blocks",
        "hits",
        "misses",
        "evictions",
        "demotions",
        "promotions",
        "checksum_failures",
    )
    return [
        pb.TierStats(tier=name, **{f: int(stats[name][f]) for f in fields}) for name in ("dram", "ssd") if name in stats
    ]


_REFUSALS = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED)


class MasterAgent:
    """Reports one BlockStore to the master. Thread-safe; runs one daemon thread.

    ``_events`` is appended to by the store's listener under the store lock and
    drained by the agent thread; deque appends and pops are atomic.
    """

    def __init__(
        self,
        master_address: str,
        info: pb.NodeInfo,
        store: BlockStore,
        *,
        flush_interval: float = 0.05,
        max_batch: int = 4096,
        credentials: Credentials = NO_CREDENTIALS,
        usage=None,
    ):
        self._usage = usage  # TenantUsage: reported with heartbeats, given the master's allowances
        self.info = info
        self._store = store
        self._master_address = master_address
        self._unreachable = False  # said once, not on every retry
        self.refused: str | None = None  # why the master refuses this node id, while it does
        self._metadata = node_metadata(secrets.token_hex(16))  # this process's incarnation
        self._channel = master_channel(master_address, credentials, _CHANNEL_OPTIONS)  # host:port or etcd://
        self._stub = pb_grpc.MasterStub(self._channel)
        self._events: collections.deque = collections.deque()
        self._flush_interval = flush_interval
        self._max_batch = max_batch
        self._heartbeat_interval = 1.0
        self._last_report = 0.0  # monotonic time the last event report was sent
        self._last_event = 0.0  # monotonic time the last event was queued
        self.reports_sent = 0  # event reports sent (full inventories not counted)
        self._registration = threading.Event()  # set while the master knows this node
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvstore-master-agent", daemon=True)
        self._reconnected = threading.Event()  # the channel is READY again after a loss: heartbeat now
        self._wake = threading.Event()  # ends the agent's wait early: stop, a reconnect, the first queued event
        self._was_lost = False
        self._prepared: Inventory | None = None  # taken while the master was away, for the next registration
        store.subscribe(self._on_event)
        self._channel.subscribe(self._on_channel_state, try_to_connect=True)  # (a no-op through etcd://)

    def start(self) -> "MasterAgent":
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop reporting and leave the pool: the master drops this node and its blocks at once
        (rather than when its lease runs out), so no client is placed on it or sent to it."""
        self._stop.set()
        self._wake.set()
        self._thread.join()
        if self._registration.is_set():
            try:
                self._stub.Deregister(
                    pb.DeregisterRequest(node_id=self.info.node_id), timeout=2, metadata=self._metadata
                )
            except grpc.RpcError as exc:
                log.info(
                    "could not deregister from the master (%s): it drops this node when its lease lapses", exc.code()
                )
        self._channel.unsubscribe(self._on_channel_state)
        self._channel.close()

    def _on_channel_state(self, state: grpc.ChannelConnectivity) -> None:
        """gRPC's callback: a master that comes back (a restart, a new leader at the same address)
        is heartbeated as soon as the channel reconnects, not at the next heartbeat, so it learns
        of this node and its inventory that much sooner."""
        if state is grpc.ChannelConnectivity.READY:
            if self._was_lost:
                self._reconnected.set()
                self._wake.set()
            self._was_lost = False
        elif state in (grpc.ChannelConnectivity.TRANSIENT_FAILURE, grpc.ChannelConnectivity.IDLE):
            if not self._was_lost and self._registration.is_set():
                self._reconnected.set()  # heartbeat now: if the master is gone, its inventory is packed meanwhile
                self._wake.set()
            self._was_lost = True

    @property
    def registered(self) -> bool:
        return self._registration.is_set()

    @property
    def inventory_waiting(self) -> int | None:
        """Blocks in the inventory snapshot taken for the next registration (None: none taken)."""
        prepared = self._prepared
        return None if prepared is None else prepared.blocks

    def wait_registered(self, timeout: float) -> bool:
        """Block until the master knows this node (at most ``timeout`` s); whether it does."""
        return self._registration.wait(timeout)

    def _on_event(self, event: str, key, tier: str) -> None:
        kind = pb.BlockEvent.REMOVED if event == "removed" else pb.BlockEvent.STORED
        self._events.append((key, kind, TIER_OF_NAME[tier]))
        self._last_event = time.monotonic()
        if len(self._events) == 1:
            self._wake.set()  # the agent waits for events: time their report from now

    # -- the agent thread ----------------------------------------------------------------
    def _run(self) -> None:
        next_heartbeat = 0.0
        while not self._stop.is_set():
            try:
                if not self._registration.is_set():
                    self._register()
                    next_heartbeat = 0.0
                if time.monotonic() >= next_heartbeat or self._reconnected.is_set():
                    self._reconnected.clear()
                    self._heartbeat()
                    next_heartbeat = time.monotonic() + self._heartbeat_interval
                    if not self._registration.is_set():  # a master that does not know this node: register now
                        continue
                if self._report_wait() == 0:
                    self._flush()
            except grpc.RpcError as exc:
                if exc.code() == grpc.StatusCode.ALREADY_EXISTS:
                    self._on_refused(exc.details())
                elif exc.code() in _REFUSALS:  # a bug, a bad flag or a bad token: say what, once
                    if exc.details() != self.refused:
                        log.warning("the master refuses this node's message: %s; retrying", exc.details())
                    self.refused = exc.details()
                else:
                    if not self._unreachable:
                        log.warning(
                            "master %s unreachable (%s): retrying every %.2g s",
                            self._master_address,
                            exc.code(),
                            min(self._heartbeat_interval, _RETRY_S),
                        )
                    self._unreachable = True
                self._registration.clear()
                self._prepare_inventory()
                self._pause(min(self._heartbeat_interval, _RETRY_S))
                continue
            wait = self._report_wait()
            if wait is None:  # nothing queued: idle until the heartbeat (the first event, a reconnect or stop wake it)
                wait = next_heartbeat - time.monotonic() if self._registration.is_set() else self._flush_interval
            self._pause(max(wait, 0.001))  # a stream does not spin it
        try:
            self._flush(drain=True)
        except grpc.RpcError:
            pass

    def _pause(self, seconds: float) -> None:
        """Wait ``seconds``, or less if stopped or the channel reconnected meanwhile."""
        self._wake.wait(seconds)
        self._wake.clear()

    def _on_refused(self, details: str) -> None:
        if self.refused is None:
            log.warning(
                "the master refuses node id %s: %s; retrying until it is free (another process with this "
                "node id? it may be this node's previous run, whose lease has not lapsed yet)",
                self.info.node_id,
                details,
            )
        self.refused = details
        self._registration.clear()

    def _prepare_inventory(self) -> None:
        """While unregistered (the master unreachable): snapshot and pack the inventory for the
        next registration now, unless one is ready. The queue is cleared with the snapshot, so it
        then holds exactly the events that follow it; nothing is flushed while unregistered."""
        if self._prepared is None and not self._stop.is_set():
            self._prepared = Inventory(self.info.node_id, self._store.inventory(then=self._events.clear))

    def _register(self) -> None:
        reply = self._stub.Register(pb.RegisterRequest(info=self.info), timeout=5, metadata=self._metadata)
        if reply.heartbeat_interval_s > 0:
            self._heartbeat_interval = reply.heartbeat_interval_s
        self._allow(reply.allowances)
        inventory, self._prepared = self._prepared, None
        if inventory is None or len(self._events) > _STALE_EVENTS:
            inventory = Inventory(self.info.node_id, self._store.inventory(then=self._events.clear))
        for report in inventory.reports(packed=reply.packed_reports):
            self._stub.ReportBlocks(report, timeout=30, metadata=self._metadata)
        # A snapshot taken while the master was away has events after it: they go now, so
        # that the index holds everything this node stores once it counts as registered.
        if not self._flush(drain=True, registering=True):
            return  # the master forgot this node meanwhile: the next loop registers again
        self._registration.set()
        self._unreachable = False
        if self.refused is not None:
            log.info("the master accepts node id %s again", self.info.node_id)
        self.refused = None
        log.info("registered with the master as %s (%d blocks)", self.info.node_id, inventory.blocks)

    def _heartbeat(self) -> None:
        held = [pb.TenantBytes(tenant=t, bytes=b) for t, b in self._usage.held().items()] if self._usage else []
        reply = self._stub.Heartbeat(
            pb.HeartbeatRequest(node_id=self.info.node_id, tiers=tier_stats(self._store.stats()), held=held),
            timeout=5,
            metadata=self._metadata,
        )
        if not reply.known:
            self._registration.clear()
        self._allow(reply.allowances)

    def _allow(self, allowances) -> None:
        if self._usage is not None and allowances:
            self._usage.allow({a.tenant: a.bytes for a in allowances})

    def _report_wait(self) -> float | None:
        """Seconds until the queued events are due (see the module doc): 0 now, None when none
        are queued (the first one wakes the agent)."""
        if not self._events:
            return None
        if len(self._events) >= self._max_batch:
            return 0.0
        now = time.monotonic()
        since_report = now - self._last_report
        quiet = max(_QUIET_S - (now - self._last_event), _MIN_GAP_S - since_report)
        return max(min(self._flush_interval - since_report, quiet), 0.0)

    def _flush(self, drain: bool = False, registering: bool = False) -> bool:
        """Report queued events: full batches, then the partial rest, once (while registered, or
        ``registering``); False if the master no longer knows this node.

        Events that arrive while a report is in flight wait until they are due
        (unless ``drain``): looping until the queue is empty would, under a steady
        put load, send a report every few events and cost the master and this
        node a gRPC call per put or so.
        """
        while self._events and (registering or self._registration.is_set()):
            batch = []
            while self._events and len(batch) < self._max_batch:
                batch.append(self._events.popleft())
            report = self._report(batch, full_inventory=False)
            self._last_report = time.monotonic()
            self.reports_sent += 1
            if not self._stub.ReportBlocks(report, timeout=10, metadata=self._metadata).known:
                self._registration.clear()  # the next registration resends everything
                return False
            if len(batch) < self._max_batch and not drain:
                break
        return True

    def live_data_addresses(self) -> set[str]:
        """Data addresses of the nodes whose lease the master holds live (grpc.RpcError if it cannot say)."""
        return set(self._stub.Peers(pb.PeersRequest(), timeout=5).data_addresses)

    def _report(self, events: list, full_inventory: bool) -> pb.BlockReport:
        return block_report(self.info.node_id, events, full_inventory)


class Inventory:
    """A snapshot of the store's blocks, as the BlockReports that send it: packed ones made at
    once (what current masters read), event ones only for a master that reads no packed blocks."""

    def __init__(self, node_id: str, blocks: list):
        self.node_id, self.blocks = node_id, len(blocks)
        self._snapshot = blocks
        self._packed = list(packed_reports(node_id, blocks))

    def reports(self, packed: bool):
        return iter(self._packed) if packed else event_reports(self.node_id, self._snapshot)


def block_report(node_id: str, events: list, full_inventory: bool) -> pb.BlockReport:
    """A BlockReport of ``events``: ((namespace, digest), kind, tier) triples, grouped by namespace."""
    by_namespace: dict[str, list] = {}
    for (namespace, digest), kind, tier in events:
        by_namespace.setdefault(namespace, []).append(pb.BlockEvent(kind=kind, tier=tier, digest=digest))
    return pb.BlockReport(
        node_id=node_id,
        full_inventory=full_inventory,
        batches=[pb.EventBatch(namespace=ns, events=evs) for ns, evs in by_namespace.items()],
    )


def event_reports(node_id: str, inventory: list):
    """A store's inventory as BlockReports of STORED events (to a master that reads no packed blocks)."""
    for start in range(0, max(len(inventory), 1), _INVENTORY_CHUNK):
        chunk = inventory[start : start + _INVENTORY_CHUNK]
        yield block_report(
            node_id, [(key, pb.BlockEvent.STORED, TIER_OF_NAME[tier]) for key, tier in chunk], full_inventory=start == 0
        )


def packed_reports(node_id: str, inventory: list):
    """A store's inventory as BlockReports of PackedBlocks: digests grouped by namespace, tier and
    length and joined, ``_PACKED_CHUNK`` a message; the first report replaces the index's entries."""
    groups: dict[tuple, list[bytes]] = collections.defaultdict(list)
    for (namespace, digest), tier in inventory:
        groups[namespace, tier, len(digest)].append(digest)
    packed = [
        pb.PackedBlocks(
            namespace=namespace,
            tier=TIER_OF_NAME[tier],
            digest_len=length,
            digests=b"".join(digests[start : start + _PACKED_CHUNK]),
        )
        for (namespace, tier, length), digests in groups.items()
        for start in range(0, len(digests), _PACKED_CHUNK)
    ]
    for i in range(max(len(packed), 1)):
        yield pb.BlockReport(node_id=node_id, full_inventory=i == 0, packed=packed[i : i + 1])
