"""BlockStore: a node's paged KV-block store, usable in-process like an embedded database.

Blocks live in a DRAM tier (a shared-memory arena) and, when configured, an
SSD tier (lmdb). Writers reserve DRAM, write, and commit; eviction runs off
the request path (see :mod:`kvstore.node.tiering`) and demotes DRAM victims to
SSD; SSD hits are promoted back to DRAM.

Thread-safe. Locks, always taken in this order:
  1. ``Tiering.evict_lock`` - one eviction pass at a time;
  2. ``BlockStore._lock``    - the block table, both policies, the counters
                               (``StoreState.lock``: the same lock);
  3. each tier's own lock    - its index and allocator (never held across I/O).
Bytes are copied outside ``_lock``, protected by DRAM read leases.

The store is made of parts that talk through named interfaces, never through each
other's attributes: the state they share (``kvstore.node.block_table.StoreState``),
handed to ``Tiering`` when it is built; ``ReservationOwner``, what a ``Reservation``
calls back; and, for code outside the store (the data plane, the node, tests), the
read-only views ``dram`` (``kvstore.tiers.dram.DramView``: the shared arena and block
directory, where a block lies) and ``ssd`` (``kvstore.tiers.ssd.SsdView``), and
``describe(key)``.

Inside ``with store.request():`` the blocks a thread reads or writes are
pinned until the request ends, so that serving a request (a batch put, a
prefix load) never evicts that request's own blocks (Mooncake, 3.2.1).
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Callable, Iterable, Iterator

from kvstore_client.buffers import byte_view
from kvstore_client.errors import (
    BufferTooSmall,
    CapacityError,
    ChecksumMismatch,
    InvalidValue,
    QuotaExceeded,
    SameHostSpaceFull,
    UnknownNamespace,
)
from kvstore_client.keys import BlockKey, check_key
from kvstore_client.slices import value_checksum
from kvstore.node.block_table import DRAM, SSD, STORE_TIER_NAMES, BlockInfo, BlockMeta, StoreState
from kvstore.node.config import StoreConfig
from kvstore.node.reservation import Reservation, ReservationOwner
from kvstore.node.tiering import Tiering
from kvstore.policy import make_policy
from kvstore.tiers.dram import DramTier, DramView, Extent

_checksum = value_checksum
GRANT_SHARE = 8  # grants (space set aside for same-host writers' next puts) hold at most 1/8 of DRAM

# A listener gets (event, key, tier name) for "stored", "moved" and "removed";
# it runs under the store lock, so it must only hand the event off (e.g. queue it).
Listener = Callable[[str, BlockKey, str], None]


class BlockStore:
    """Paged KV blocks in DRAM and SSD tiers with pluggable eviction.

    ``tiering``: what makes room, called as ``tiering(state, config)`` (default: ``Tiering``;
    a test may pass a subclass with hooks)."""

    def __init__(self, config: StoreConfig | None = None, *, tiering: Callable[..., Tiering] = Tiering, **overrides):
        self.config = config = config or StoreConfig(**overrides)
        self._local = threading.local()  # .held: the ongoing request's blocks on this thread, or None
        self._granted = 0  # bytes held by grants not bound to a key yet
        self._grant_lock = threading.Lock()
        dram = DramTier(
            config.dram_capacity,
            granule=config.granule,
            prefault=config.prefault,
            arena_name=config.arena_name,
            directory_slots=config.directory_slots,
        )
        ssd = ssd_view = None
        if config.ssd_path is not None:
            from kvstore.tiers.ssd import SsdTier, SsdView

            ssd = SsdTier(config.ssd_path, config.ssd_capacity, sync=config.ssd_sync, on_damage=config.ssd_damaged)
            ssd_view = SsdView(ssd)
        self._state = state = StoreState(dram, ssd, [make_policy(config.policy), make_policy(config.ssd_policy)])
        # The shared state's parts, bound once: the read and write paths use them on every call.
        self._lock, self._table, self._dram, self._ssd = state.lock, state.blocks, dram, ssd
        self._policies, self._counters = state.policies, state.counters
        self._writes = ReservationOwner(
            writable=dram.writable,
            abort=dram.abort,
            check_key=self.check_key,
            publish=self._commit,
            grant_ended=self._grant_ended,
            charge=self._charge,
            settle=self._settle,
        )
        self._dram_view, self._ssd_view = DramView(dram), ssd_view
        if ssd is not None:
            self._index_ssd()
        self._tiering = tiering(state, config)
        if config.background_eviction:
            self._tiering.start()

    def _index_ssd(self) -> None:
        """Re-index blocks that survived in the SSD tier from an earlier run."""
        for key, size, depth in self._ssd.inventory():
            self._table[key] = BlockMeta(SSD, size, depth)
            self._state.account(key, size)
            self._policies[SSD].add(key, depth=depth)
        self._counters[SSD].checksum_failures = self._ssd.checksum_failures

    # -- the parts others may see ---------------------------------------------------
    @property
    def dram(self) -> DramView:
        """The DRAM tier, read-only: its shared arena and block directory (what same-host
        clients map), sizes, where a block lies."""
        return self._dram_view

    @property
    def ssd(self):
        """The SSD tier, read-only (a ``kvstore.tiers.ssd.SsdView``), or None without one."""
        return self._ssd_view

    @property
    def tiering(self) -> Tiering:
        """The part that makes room: ``evict_lock`` (held: no eviction pass runs), ``run_once``."""
        return self._tiering

    # -- validation ---------------------------------------------------------------
    def check_key(self, key: BlockKey) -> BlockKey:
        """``key`` as the store takes it: InvalidKey when malformed, UnknownNamespace when its
        namespace is not declared on this store (``StoreConfig.namespaces``)."""
        key = check_key(key)
        allowed = self.config.namespaces
        if allowed is not None and key[0] not in allowed:
            raise UnknownNamespace(f"namespace {key[0]!r} is not declared on this store")
        return key

    def track_usage(self, usage) -> None:
        """Report every change of the bytes held per namespace to ``usage.changed(namespace,
        delta)`` (called under the store lock: it must be quick), and ask ``usage.charge(namespace,
        size)`` before each write's bytes land (False: refused, QuotaExceeded), telling
        ``usage.settle(namespace, size)`` when they are published or given back. Tenant quotas
        use it (kvstore.node.tenant_usage)."""
        self.recount_usage(usage)

    def recount_usage(self, usage, before=None) -> None:
        """Tell ``usage`` every block held, under the store lock (``before()`` first, under it
        too: a tenant list reloaded and its counts zeroed), so no write lands in between."""
        with self._lock:
            if before is not None:
                before()
            self._state.usage = usage
            for key, meta in self._table.items():
                usage.changed(key[0], meta.size)

    def _check_size(self, size: int) -> None:
        if size <= 0:
            raise InvalidValue("a block value cannot be empty")
        if size > self.config.max_block_bytes:
            raise InvalidValue(f"value of {size} bytes exceeds max_block_bytes {self.config.max_block_bytes}")

    # -- writes ---------------------------------------------------------------------
    def reserve(self, key: BlockKey, size: int, *, depth: int = 0) -> Reservation:
        """Reserve DRAM for a block of ``size`` bytes; write into ``.buffer`` then commit.

        Makes room inline (evicting or demoting) only when the background
        evictor has not kept enough free; raises CapacityError when even that
        cannot free space (everything left is pinned or being read).
        """
        key = self.check_key(key)
        self._check_size(size)
        if depth < 0:
            raise InvalidValue("depth cannot be negative")
        self._charge(key[0], size)
        try:
            extent = self._reserve_extent(size)
        except BaseException:
            self._settle(key[0], size)
            raise
        return Reservation(self._writes, key, extent, depth, charged=key[0])

    def grant(self, size: int) -> Reservation:
        """Reserve DRAM for a block whose key is not known yet (a same-host writer's next
        put); ``bind`` it to a key before committing. Raises like ``reserve``, and
        SameHostSpaceFull (a CapacityError) when grants would hold more than 1/GRANT_SHARE of
        DRAM: each lives as long as its writer's connection, idle or not, and they must not
        crowd blocks out."""
        self._check_size(size)
        with self._grant_lock:
            if self._granted + size > self._dram.capacity_bytes // GRANT_SHARE:
                raise SameHostSpaceFull(f"grants already hold {self._granted} bytes, 1/{GRANT_SHARE} of DRAM")
            self._granted += size
        try:
            return Reservation(self._writes, None, self._reserve_extent(size), 0, granted=True)
        except BaseException:
            self._grant_ended(size)
            raise

    def _charge(self, namespace: str, size: int) -> None:
        """Count ``size`` bytes about to land against the quotas of ``namespace``'s tenants
        (``track_usage``); QuotaExceeded when one would hold more than it may here."""
        usage = self._state.usage
        if usage is not None and not usage.charge(namespace, size):
            raise QuotaExceeded(
                f"quota exceeded: a tenant of namespace {namespace!r} may hold no more here; "
                "remove blocks or wait for eviction"
            )

    def _settle(self, namespace: str, size: int) -> None:
        usage = self._state.usage
        if usage is not None:
            usage.settle(namespace, size)

    def _grant_ended(self, size: int) -> None:
        """A grant was bound to a key or given back (called by its Reservation)."""
        with self._grant_lock:
            self._granted -= size

    def _reserve_extent(self, size: int) -> Extent:
        """A free DRAM extent of ``size`` bytes, made room for inline if the evictor has not."""
        extent = self._dram.reserve(size) or self._tiering.make_room(size)
        if extent is None:
            raise CapacityError(f"no room for a {size}-byte block: the DRAM tier holds only pinned or leased blocks")
        self._tiering.poke()
        return extent

    def put(self, key: BlockKey, value, *, depth: int = 0) -> None:
        """Store ``value`` (any contiguous buffer) under ``key``, replacing an older value."""
        data = byte_view(value)
        with self.reserve(key, len(data), depth=depth) as res:
            res.buffer[:] = data

    def _commit(
        self, key: BlockKey, extent: Extent, depth: int, expected: int | None = None, trusted: bool = False
    ) -> None:
        """Publish a written extent (called by Reservation.commit); ``trusted``: take ``expected``
        as the checksum without reading the bytes back."""
        checksum = expected if trusted else _checksum(self._dram.writable(extent))
        if expected is not None and checksum != expected:
            self._dram.abort(extent)
            raise ChecksumMismatch(f"block {key!r:.60} arrived damaged: checksum {checksum:#x} != {expected:#x}")
        with self._lock:
            if self._state.closed:
                self._dram.abort(extent)
                raise CapacityError("store is closed")
            old = self._table.get(key)
            meta = BlockMeta(DRAM, extent.size, depth)
            if old is not None:
                meta.hits, meta.pins = old.hits, old.pins
                self._policies[old.tier].discard(key)
                self._drop_ssd_record(key, old)
            self._dram.commit(key, extent, checksum)
            self._table[key] = meta
            self._state.account(key, extent.size - (old.size if old is not None else 0))
            self._hold(key, meta, new=old is None)
            if not meta.pins:
                self._policies[DRAM].add(key, depth=depth, hits=meta.hits)
            self._state.emit("stored", key, DRAM)

    # -- reads ------------------------------------------------------------------------
    def get(self, key: BlockKey) -> bytes | None:
        """The block's bytes, or None on a miss."""
        key = self.check_key(key)
        meta, extent = self._lookup(key)
        if meta is None:
            return None
        if extent is not None:
            try:
                view = self._verified(key, extent)
                return None if view is None else bytes(view)
            finally:
                self._dram.release(extent)
        return self._get_from_ssd(key, meta)

    def _get_from_ssd(self, key: BlockKey, meta: BlockMeta) -> bytes | None:
        out = bytearray(meta.size)
        try:
            n = self._read_ssd(key, meta, memoryview(out))
        except BufferTooSmall:  # replaced by a larger value (now in SSD too) since the lookup
            return self.get(key)
        return None if n is None else bytes(out[:n])

    def get_into(self, key: BlockKey, buffer) -> int | None:
        """Copy the block into ``buffer``; its size, or None on a miss.

        Raises BufferTooSmall (with ``.needed``) when the buffer cannot hold it.
        """
        key = self.check_key(key)
        out = byte_view(buffer, writable=True)
        meta, extent = self._lookup(key)
        if meta is None:
            return None
        if extent is not None:
            if len(out) < extent.size:
                self._dram.release(extent)
                raise BufferTooSmall(f"block is {extent.size} bytes, buffer holds {len(out)}", extent.size)
            return self._copy_leased(key, extent, out)
        if len(out) < meta.size:
            raise BufferTooSmall(f"block is {meta.size} bytes, buffer holds {len(out)}", meta.size)
        return self._read_ssd(key, meta, out)

    @contextmanager
    def read(self, key: BlockKey) -> Iterator[memoryview | None]:
        """Zero-copy read: a read-only view of the block in the arena while the
        ``with`` block runs (the block cannot be evicted meanwhile), or None."""
        key = self.check_key(key)
        meta, extent = self._lookup(key)
        if extent is None:
            data = None if meta is None else self._get_from_ssd(key, meta)
            yield None if data is None else memoryview(data)
            return
        try:
            yield self._verified(key, extent)
        finally:
            self._dram.release(extent)

    def lease(self, key: BlockKey) -> "Lease | None":
        """Pin a DRAM block's bytes in place for a reader outside this process
        (network send, same-host client); None on a miss. A block found only
        on SSD is promoted first; if it cannot be (DRAM full), None is returned
        with the block still stored: read it with ``get`` instead.
        Every lease must be released."""
        key = self.check_key(key)
        meta, extent = self._lookup(key)
        if meta is not None and extent is None:
            if self._get_from_ssd(key, meta) is None:
                return None
            with self._lock:
                extent = self._dram.acquire(key)
        return None if extent is None else Lease(self._dram, key, extent)

    def _lookup(self, key: BlockKey) -> tuple[BlockMeta | None, Extent | None]:
        """Find a block, count the hit or miss, and lease it if it is in DRAM."""
        with self._lock:
            meta = self._table.get(key)
            if meta is None:
                self._counters[DRAM].misses += 1
                if self._ssd is not None:
                    self._counters[SSD].misses += 1
                return None, None
            meta.hits += 1
            self._policies[meta.tier].touch(key)
            self._hold(key, meta)
            if meta.tier == DRAM:
                self._counters[DRAM].hits += 1
                return meta, self._dram.acquire(key)
            self._counters[DRAM].misses += 1
            return meta, None

    def _verified(self, key: BlockKey, extent: Extent) -> memoryview | None:
        """View of a leased DRAM block; with verify_dram_reads, None (and the
        block dropped) when its bytes no longer match their checksum."""
        view = self._dram.view(extent)
        if self.config.verify_dram_reads and _checksum(view) != extent.checksum:
            self._drop_damaged(key, extent)
            return None
        return view

    def _drop_damaged(self, key: BlockKey, extent: Extent) -> None:
        """Count a DRAM block whose bytes fail their checksum and drop it, if it is still ``extent``."""
        with self._lock:
            self._counters[DRAM].checksum_failures += 1
            meta = self._table.get(key)
            if meta is not None and self._dram.current(key) is extent:
                self._forget(key, meta)

    def _read_ssd(self, key: BlockKey, meta: BlockMeta, out: memoryview) -> int | None:
        """Read a block from SSD into ``out`` (checksum verified), promoting it when configured."""
        got = self._ssd.read_into(key, out)
        n, checksum = (None, 0) if got is None else got
        with self._lock:
            if n is None:
                if self._table.get(key) is meta and meta.tier == DRAM:  # promoted since the lookup
                    extent = self._dram.acquire(key)
                else:
                    self._counters[SSD].misses += 1
                    self._counters[SSD].checksum_failures = self._ssd.checksum_failures
                    if self._table.get(key) is meta and meta.tier == SSD and not self._ssd.contains(key):
                        self._forget(key, meta)
                    return None
            else:
                self._counters[SSD].hits += 1
        if n is None:
            return self._copy_leased(key, extent, out)
        if self.config.promote_on_hit:
            self._tiering.promote(key, meta, out[:n], checksum)
        return n

    def _copy_leased(self, key: BlockKey, extent: Extent, out: memoryview) -> int | None:
        """Copy a leased DRAM block into ``out`` (large enough) and release the lease."""
        try:
            view = self._verified(key, extent)
            if view is None:
                return None
            out[: extent.size] = view
            return extent.size
        finally:
            self._dram.release(extent)

    def check(self, key: BlockKey) -> bool | None:
        """Verify a block's bytes against its checksum now, because a reader got them damaged:
        True when intact; False when damaged, and then dropped (and counted) so that it reads
        as a miss from now on, as a damaged SSD record does; None when absent. Blocks on SSD
        are verified by every read there and count as intact."""
        key = self.check_key(key)
        with self._lock:
            meta = self._table.get(key)
            if meta is None:
                return None
            extent = self._dram.acquire(key) if meta.tier == DRAM else None
        if extent is None:
            return True
        try:
            if _checksum(self._dram.view(extent)) == extent.checksum:
                return True
            self._drop_damaged(key, extent)
            return False
        finally:
            self._dram.release(extent)

    def touch(self, keys: Iterable[BlockKey]) -> None:
        """Count reads that same-host clients served themselves from the block
        directory, as hits that keep the blocks warm for eviction; absent keys are skipped."""
        keys = [self.check_key(k) for k in keys]
        with self._lock:
            for key in keys:
                meta = self._table.get(key)
                if meta is not None:
                    meta.hits += 1
                    self._policies[meta.tier].touch(key)
                    self._counters[meta.tier].hits += 1
                    self._hold(key, meta)

    # -- lookups without reading ---------------------------------------------------------
    def exists(self, key: BlockKey) -> bool:
        return self.check_key(key) in self._table

    def batch_exists(self, keys: Iterable[BlockKey]) -> list[bool]:
        keys = [self.check_key(k) for k in keys]
        table = self._table
        return [k in table for k in keys]

    def match_prefix(self, keys: Iterable[BlockKey]) -> int:
        """How many leading keys of a prefix chain are stored (in any tier)."""
        keys = [self.check_key(k) for k in keys]
        table = self._table
        for count, key in enumerate(keys):
            if key not in table:
                return count
        return len(keys)

    def describe(self, key: BlockKey) -> BlockInfo | None:
        """A snapshot of the block's state (tier, size, depth, hits, pins, whether an SSD copy
        was kept); None if it is not stored. Not a read: counts no hit."""
        key = self.check_key(key)
        with self._lock:
            meta = self._table.get(key)
            if meta is None:
                return None
            return BlockInfo(STORE_TIER_NAMES[meta.tier], meta.size, meta.depth, meta.hits, meta.pins, meta.ssd_copy)

    def size_of(self, key: BlockKey) -> int | None:
        meta = self._table.get(self.check_key(key))
        return None if meta is None else meta.size

    def tier_of(self, key: BlockKey) -> str | None:
        meta = self._table.get(self.check_key(key))
        return None if meta is None else STORE_TIER_NAMES[meta.tier]

    def keys(self, namespace: str | None = None) -> list[BlockKey]:
        with self._lock:
            return [k for k in self._table if namespace is None or k[0] == namespace]

    def __len__(self) -> int:
        return len(self._table)

    def inventory(self, then: Callable[[], None] | None = None) -> list[tuple[BlockKey, str]]:
        """Every stored block and its tier, as one consistent snapshot.

        ``then`` runs under the same lock right after the snapshot: a listener's
        queue cleared there holds exactly the events that come after it.
        """
        with self._lock:
            snapshot = [(key, STORE_TIER_NAMES[meta.tier]) for key, meta in self._table.items()]
            if then is not None:
                then()
            return snapshot

    # -- removal and pinning ------------------------------------------------------------
    def remove(self, key: BlockKey) -> bool:
        """Drop the block from every tier; False if it was not stored."""
        key = self.check_key(key)
        with self._lock:
            meta = self._table.get(key)
            if meta is None:
                return False
            self._forget(key, meta)
            return True

    def pin(self, key: BlockKey) -> bool:
        """Keep the block from eviction until a matching unpin; False if absent. Pins nest."""
        key = self.check_key(key)
        with self._lock:
            meta = self._table.get(key)
            if meta is None:
                return False
            meta.pins += 1
            if meta.pins == 1:
                self._policies[meta.tier].discard(key)
            return True

    def unpin(self, key: BlockKey) -> bool:
        """Undo one pin; False if the block is absent or not pinned."""
        key = self.check_key(key)
        with self._lock:
            return self._unpin(key)

    def _unpin(self, key: BlockKey) -> bool:
        """Under _lock: undo one pin; a block left unpinned is a candidate again."""
        meta = self._table.get(key)
        if meta is None or meta.pins == 0:
            return False
        meta.pins -= 1
        if meta.pins == 0:
            self._policies[meta.tier].add(key, depth=meta.depth, hits=meta.hits)
        return True

    # -- requests -------------------------------------------------------------------------
    @contextmanager
    def request(self) -> Iterator[None]:
        """Serve one request (a batch put, a prefix load) on this thread: every block it reads
        (get, get_into, read, lease, touch) or writes (put, commit) inside the ``with`` block
        is pinned until the block ends, so the request cannot evict its own blocks to make
        room for itself; only when nothing else is left does a put raise CapacityError.
        At the end the blocks become candidates again in the order the request last used
        them, with their hits, as if just accessed. Nested requests join the outer one."""
        if getattr(self._local, "held", None) is not None:
            yield
            return
        held = self._local.held = {}  # key -> None, in order of last use
        try:
            yield
        finally:
            self._local.held = None
            with self._lock:
                for key in held:
                    self._unpin(key)

    def _hold(self, key: BlockKey, meta: BlockMeta, new: bool = False) -> None:
        """Under _lock: pin a block the ongoing request on this thread uses, once per request.
        ``new``: ``meta`` was just committed and replaced nothing (a replacement takes over
        the old block's pins, this request's included)."""
        held = getattr(self._local, "held", None)
        if held is None:
            return
        if key in held:
            del held[key]
            held[key] = None  # moved to the end: the order of last use
            if not new:
                return
        else:
            held[key] = None
        meta.pins += 1
        if meta.pins == 1:
            self._policies[meta.tier].discard(key)

    def _forget(self, key: BlockKey, meta: BlockMeta) -> None:
        """Under _lock: remove a block from the table, its policy and its tier."""
        self._policies[meta.tier].discard(key)
        if meta.tier == DRAM:
            self._dram.discard(key)
        self._drop_ssd_record(key, meta)
        self._state.unlist(key, meta, meta.tier)

    def _drop_ssd_record(self, key: BlockKey, meta: BlockMeta) -> None:
        """Under _lock: delete the SSD record of a block that is going away or being replaced
        (its home on SSD, or the copy kept when it was promoted)."""
        if meta.ssd_copy:
            self._policies[SSD].discard(key)
        if meta.tier == SSD or meta.ssd_copy:
            self._ssd.discard(key)

    # -- events, stats, lifecycle ----------------------------------------------------------
    def subscribe(self, listener: Listener) -> None:
        """Call ``listener(event, key, tier)`` on every stored/moved/removed block."""
        self._state.listeners.append(listener)

    def stats(self) -> dict[str, dict[str, int | float]]:
        """Per-tier capacity, use and counters; plus store-wide figures."""
        with self._lock:
            tiers = {"dram": self._tier_stats(DRAM, self._dram)}
            if self._ssd is not None:
                self._counters[SSD].checksum_failures = self._ssd.checksum_failures
                tiers["ssd"] = self._tier_stats(SSD, self._ssd)
                tiers["ssd"]["bytes_written"] = self._ssd.bytes_written
                tiers["ssd"]["disk_full"] = self._ssd.disk_full
            tiers["store"] = {
                "blocks": len(self._table),
                "pinned": sum(1 for m in self._table.values() if m.pins),
                "inline_evictions": self._tiering.inline_passes,
                "dram_fragmentation": round(self._dram.fragmentation(), 4),
                "granted_bytes": self._granted,
            }
            return tiers

    def _tier_stats(self, tier: int, backend) -> dict[str, int]:
        return {
            "capacity": backend.capacity_bytes,
            "used": backend.used_bytes,
            "blocks": len(backend),
            **self._counters[tier].as_dict(),
        }

    def evict(self) -> None:
        """Run one watermark-driven eviction pass now (the background thread does this by itself)."""
        self._tiering.run_once()

    def close(self) -> None:
        """Stop the evictor and release both tiers; SSD contents stay on disk."""
        with self._lock:
            if self._state.closed:
                return
            self._state.closed = True
        self._tiering.stop()
        self._dram.close()
        if self._ssd is not None:
            self._ssd.close()

    def __enter__(self) -> "BlockStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Lease:
    """A read lease on one DRAM block: its bytes stay put until ``release``.

    ``offset``/``size`` locate the block in the shared arena (for same-host
    readers), ``view`` is a read-only memoryview of it, ``checksum`` its XXH3-64.
    """

    __slots__ = ("key", "offset", "size", "checksum", "view", "_dram", "_extent")

    def __init__(self, dram: DramTier, key: BlockKey, extent: Extent):
        self.key = key
        self.offset, self.size, self.checksum = extent.offset, extent.size, extent.checksum
        self.view = dram.view(extent)
        self._dram, self._extent = dram, extent

    def release(self) -> None:
        extent, self._extent = self._extent, None
        if extent is not None:
            self.view.release()
            self._dram.release(extent)
