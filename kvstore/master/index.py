"""The master's global prefix index: which nodes hold each block, in which tier.

Pure Python, no grpc. Layout, chosen so that lookups are one dict probe per
digest and a node can be dropped in O(its keys):

- ``_table[namespace][digest] -> holders``. ``holders`` is an *interned*,
  immutable tuple of ``(node_id, tier)`` pairs sorted by node id: every block
  held by the same nodes in the same tiers shares one tuple object. A change
  replaces the tuple (copy-on-write), so lookups hand tuples out without
  copying, the gRPC adapter caches one reply message per distinct tuple, and
  ``match_prefix`` skips a digest whose holders are the very object of the
  previous one (the common case along a chain). Memory is about 130 bytes a
  key (digest, dict slot, the node's set slot), not a dict per key.
- ``_by_node[node_id][namespace] -> set of digests``: what to undo when the
  node goes.
- ``_counts[node_id] -> [_, dram blocks, ssd blocks]`` (indexed by tier).

Tiers and event kinds are the proto's integer values (DRAM=1, SSD=2;
STORED=1, REMOVED=2) so the adapter passes them through unchanged.

Change feed: ``watch(sink)`` makes every update call report its net effect,
``sink(changes, emptied)`` with ``changes`` = [(namespace, [(digest, holders
before, holders after), ...])] (a digest once per call) and ``emptied`` = the
index holds nothing now. It costs nothing while no sink is set; with one, a
dict of the keys a call touches. The KV event publisher
(kvstore.master.kv_events) turns the feed into vLLM-style events.

Thread-safety: one ``threading.Lock`` (``_lock``) guards every field; each
public method holds it for its whole call, so each call is atomic. Callers may
hold their own lock around these calls (Membership does: the lock order is
Membership._lock, then PrefixIndex._lock); this class never calls out while
holding its lock, except to the watch sink, which is called under it (so
changes arrive in the order they were applied) and must only hand them on:
not block, not call back into the index. Input is validated before the lock
is taken, so a rejected call changes nothing.
"""

from __future__ import annotations

import bisect
import threading
from itertools import chain, repeat
from typing import Callable, Iterable, Sequence

from kvstore.master.errors import InvalidRequest
from kvstore_client.errors import InvalidKey
from kvstore_client.keys import MAX_DIGEST_LEN, check_namespace
from kvstore_client.tiers import DRAM, SSD, TIER_NAMES

STORED, REMOVED = 1, 2

Holders = tuple  # tuple[tuple[str, int], ...], interned
Event = tuple  # (kind, tier, digest)
Stored = tuple  # (namespace, tier, digests): blocks now present in one tier (a packed inventory)
Batch = tuple  # (namespace, Sequence[Event])
Change = tuple  # (digest, holders before, holders after)
ChangeSink = Callable[[list[tuple[str, list[Change]]], bool], None]  # (changes, emptied)

NO_HOLDERS: Holders = ()


def check_digests(digests: Sequence[bytes]) -> None:
    """Raise InvalidKey unless every digest is 1..MAX_DIGEST_LEN bytes."""
    if not digests:
        return
    if set(map(type, digests)) != {bytes}:
        raise InvalidKey("digests must be bytes")
    lengths = list(map(len, digests))
    if min(lengths) < 1 or max(lengths) > MAX_DIGEST_LEN:
        bad = next(i for i, n in enumerate(lengths) if not 0 < n <= MAX_DIGEST_LEN)
        raise InvalidKey(f"digest #{bad} is {lengths[bad]} bytes: a digest is 1..{MAX_DIGEST_LEN} bytes")


def check_batches(batches: Iterable[Batch]) -> list[tuple[str, list[Event]]]:
    """Validate event batches; return them as a list of (namespace, events list)."""
    out = []
    for namespace, events in batches:
        check_namespace(namespace)
        events = list(events)
        for kind, tier, _digest in events:
            if kind == STORED:
                if tier != DRAM and tier != SSD:
                    raise InvalidRequest(f"a STORED event needs tier DRAM ({DRAM}) or SSD ({SSD}), got {tier}")
            elif kind != REMOVED:
                raise InvalidRequest(f"event kind must be STORED ({STORED}) or REMOVED ({REMOVED}), got {kind}")
        check_digests([e[2] for e in events])
        out.append((namespace, events))
    return out


class SplitDigests(list):
    """Digests split from one packed string at a valid length (``validation.unpack_digests``):
    all bytes, all 1..MAX_DIGEST_LEN long, so ``check_stored`` need not look at each again."""


def check_stored(stored: Iterable[Stored]) -> list[tuple[str, int, list[bytes]]]:
    """Validate packed STORED blocks; return them as a list of (namespace, tier, digests list)."""
    out = []
    for namespace, tier, digests in stored:
        check_namespace(namespace)
        if tier != DRAM and tier != SSD:
            raise InvalidRequest(f"stored blocks need tier DRAM ({DRAM}) or SSD ({SSD}), got {tier}")
        if not isinstance(digests, SplitDigests):
            digests = list(digests)
            check_digests(digests)
        out.append((namespace, tier, digests))
    return out


class PrefixIndex:
    """(namespace, digest) -> {node_id: tier}, with per-node key sets. See the module doc."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._table: dict[str, dict[bytes, Holders]] = {}
        self._by_node: dict[str, dict[str, set[bytes]]] = {}
        self._counts: dict[str, list[int]] = {}
        self._canon: dict[Holders, Holders] = {(): ()}
        self._with: dict[tuple, tuple[Holders, int]] = {}  # (holders, node, tier) -> (new holders, old tier)
        self._without: dict[tuple, tuple[Holders, int]] = {}  # (holders, node) -> (new holders, old tier)
        self._change_count = 0
        self._versions: dict[str, int] = {}  # namespace -> _change_count at its last change
        self._snapshots: dict[str, tuple[int, list[bytes]]] = {}  # sorted digests for paging
        self._sink: ChangeSink | None = None

    def watch(self, sink: ChangeSink | None) -> None:
        """Report each update call's net changes to ``sink`` (None: stop). See the module doc."""
        with self._lock:
            self._sink = sink

    # -- nodes ----------------------------------------------------------------------------
    def add_node(self, node_id: str) -> None:
        """Make ``node_id`` known (keeping what it holds); events of unknown nodes are refused."""
        with self._lock:
            if node_id not in self._by_node:
                self._by_node[node_id] = {}
                self._counts[node_id] = [0, 0, 0]

    def reset_node(self, node_id: str) -> None:
        """Make ``node_id`` known and holding nothing (a fresh registration)."""
        with self._lock:
            if node_id in self._by_node:
                before = self._holders_now(self._by_node[node_id].items()) if self._sink else None
                self._drop_entries(node_id)
                if before is not None:
                    self._report(before)
            self._by_node[node_id] = {}
            self._counts[node_id] = [0, 0, 0]

    def node_keys(self, node_id: str) -> list[tuple[str, list[bytes]]]:
        """[(namespace, digests)] of every block indexed for ``node_id`` (a snapshot)."""
        with self._lock:
            return [(ns, list(digests)) for ns, digests in self._by_node.get(node_id, {}).items()]

    def drop_node(self, node_id: str) -> bool:
        """Forget ``node_id`` and every block it holds, in O(its keys). False if unknown."""
        with self._lock:
            if node_id not in self._by_node:
                return False
            before = self._holders_now(self._by_node[node_id].items()) if self._sink else None
            self._drop_entries(node_id)
            del self._by_node[node_id], self._counts[node_id]
            if before is not None:
                self._report(before)
            return True

    def has_node(self, node_id: str) -> bool:
        with self._lock:
            return node_id in self._by_node

    # -- updates ----------------------------------------------------------------------------
    def apply(self, node_id: str, batches: Iterable[Batch], stored: Iterable[Stored] = ()) -> bool:
        """Apply a node's event batches in order, then its ``stored`` blocks. False (nothing
        applied) if the node is unknown."""
        checked, packed = check_batches(batches), check_stored(stored)
        with self._lock:
            if node_id not in self._by_node:
                return False
            self._apply_all(node_id, checked, packed, drop_first=False)
            return True

    def replace_inventory(self, node_id: str, batches: Iterable[Batch], stored: Iterable[Stored] = ()) -> bool:
        """Replace everything indexed for ``node_id`` by these batches and ``stored`` blocks (its
        full inventory, or the first part of it: the rest follows through ``apply``).

        Normally STORED events only; REMOVED events are applied in order like any
        other. False (nothing changed) if the node is unknown.
        """
        checked, packed = check_batches(batches), check_stored(stored)
        with self._lock:
            if node_id not in self._by_node:
                return False
            self._apply_all(node_id, checked, packed, drop_first=True)
            return True

    def _apply_all(self, node: str, checked: list, packed: list, drop_first: bool) -> None:
        """Under _lock: (drop the node's entries, then) apply validated batches and packed blocks."""
        if self._sink:  # the change feed needs each key's before and after: go event by event
            checked = checked + [(ns, [(STORED, tier, d) for d in digests]) for ns, tier, digests in packed]
            packed = []
            held = self._by_node[node].items() if drop_first else ()
            before = self._holders_now(chain(held, _digests_of(checked)))
        if drop_first:
            self._drop_entries(node)
        for namespace, events in checked:
            self._apply_batch(node, namespace, events)
        for namespace, tier, digests in packed:
            self._store_many(node, namespace, tier, digests)
        if self._sink:
            self._report(before)

    def _holders_now(self, keys: Iterable[tuple[str, Iterable[bytes]]]) -> dict[str, dict[bytes, Holders]]:
        """Under _lock: {namespace: {digest: holders}} of these keys, before a change (for _report)."""
        out: dict[str, dict[bytes, Holders]] = {}
        for namespace, digests in keys:
            get = self._table.get(namespace, {}).get
            now = {d: get(d, NO_HOLDERS) for d in digests}  # a digest twice: the same value, nothing changed yet
            if namespace in out:
                out[namespace].update(now)
            else:
                out[namespace] = now
        return out

    def _report(self, before: dict[str, dict[bytes, Holders]]) -> None:
        """Under _lock: hand the keys whose holders differ from ``before`` to the sink."""
        changes = []
        for namespace, old in before.items():
            get = self._table.get(namespace, {}).get
            diff = [(d, h, new) for d, h in old.items() if (new := get(d, NO_HOLDERS)) != h]
            if diff:
                changes.append((namespace, diff))
        if changes:
            self._sink(changes, not self._table)

    def _apply_batch(self, node: str, namespace: str, events: list[Event]) -> None:
        """Under _lock: one namespace's events for one node."""
        table = self._table.setdefault(namespace, {})
        keys = self._by_node[node].setdefault(namespace, set())
        counts = self._counts[node]
        with_cache, without_cache = self._with, self._without
        for kind, tier, digest in events:
            holders = table.get(digest, NO_HOLDERS)
            if kind == STORED:
                step = with_cache.get((holders, node, tier)) or self._step_with(holders, node, tier)
                new, old = step
                if new is holders:
                    continue
                table[digest] = new
                if old:
                    counts[old] -= 1
                else:
                    keys.add(digest)
                counts[tier] += 1
            else:
                new, old = without_cache.get((holders, node)) or self._step_without(holders, node)
                if not old:
                    continue
                if new:
                    table[digest] = new
                else:
                    del table[digest]
                keys.discard(digest)
                counts[old] -= 1
        if not keys:
            del self._by_node[node][namespace]
        self._changed(namespace, table)

    def _store_many(self, node: str, namespace: str, tier: int, digests: list[bytes]) -> None:
        """Under _lock: ``digests`` now held by ``node`` in ``tier``, in bulk: keys no node holds
        yet (all of them, after a restart) take one shared holders tuple, inserted by dict and
        set updates in C; keys held already take the per-event path."""
        table = self._table.setdefault(namespace, {})
        held = table.keys() & digests if table else ()  # a C loop over digests
        if held:
            digests = [d for d in digests if d not in held]
        table.update(zip(digests, repeat(self._intern([(node, tier)]))))
        keys = self._by_node[node].setdefault(namespace, set())
        before = len(keys)
        keys.update(digests)
        self._counts[node][tier] += len(keys) - before  # a digest listed twice counts once
        self._apply_batch(node, namespace, [(STORED, tier, d) for d in held])  # also notes the change

    def _drop_entries(self, node: str) -> None:
        """Under _lock: remove every block of ``node`` from the table (the node stays known)."""
        for namespace, keys in self._by_node[node].items():
            table = self._table[namespace]
            for digest in keys:
                new, _old = self._without.get((table[digest], node)) or self._step_without(table[digest], node)
                if new:
                    table[digest] = new
                else:
                    del table[digest]
            self._changed(namespace, table)
        self._by_node[node] = {}
        self._counts[node] = [0, 0, 0]
        # Transition caches may name the node; they rebuild themselves on demand.
        self._with.clear()
        self._without.clear()
        self._canon = {h: h for h in self._canon if all(n != node for n, _ in h)}

    def _changed(self, namespace: str, table: dict) -> None:
        """Under _lock: note that a namespace's keys changed; forget it when it is empty."""
        self._change_count += 1  # versions never repeat, even for a namespace emptied and refilled
        if table:
            self._versions[namespace] = self._change_count
        else:
            del self._table[namespace]
            self._versions.pop(namespace, None)
            self._snapshots.pop(namespace, None)

    def _intern(self, pairs: list) -> Holders:
        pairs.sort()
        holders = tuple(pairs)
        return self._canon.setdefault(holders, holders)

    def _step_with(self, holders: Holders, node: str, tier: int) -> tuple[Holders, int]:
        old = next((t for n, t in holders if n == node), 0)
        new = holders if old == tier else self._intern([p for p in holders if p[0] != node] + [(node, tier)])
        self._with[(holders, node, tier)] = step = (new, old)
        return step

    def _step_without(self, holders: Holders, node: str) -> tuple[Holders, int]:
        old = next((t for n, t in holders if n == node), 0)
        new = self._intern([p for p in holders if p[0] != node]) if old else holders
        self._without[(holders, node)] = step = (new, old)
        return step

    # -- lookups ------------------------------------------------------------------------------
    def locate(self, namespace: str, digests: Sequence[bytes]) -> list[Holders]:
        """Per digest, in order: a tuple of (node_id, tier) pairs holding it (empty: nowhere).

        The tuples are immutable and shared; do not rely on their identity across calls.
        """
        check_namespace(namespace)
        check_digests(digests)
        with self._lock:
            table = self._table.get(namespace)
            if table is None:
                return [NO_HOLDERS] * len(digests)
            get = table.get
            return [get(d, NO_HOLDERS) for d in digests]

    def match_prefix(self, namespace: str, digests: Sequence[bytes]) -> tuple[dict[str, int], int]:
        """({node_id: leading blocks it holds itself}, leading blocks held by any mix of nodes).

        Nodes that do not hold the first block are left out of the dict.
        """
        check_namespace(namespace)
        check_digests(digests)
        with self._lock:
            table = self._table.get(namespace)
            if table is None or not digests:
                return {}, 0
            return _walk_prefix(table.get, digests)

    # -- admin ----------------------------------------------------------------------------------
    def list_keys(
        self, namespace: str | None, limit: int, start_after: bytes = b""
    ) -> list[tuple[str, bytes, Holders]]:
        """Up to ``limit`` keys as (namespace, digest, holders), ordered by (namespace, digest).

        With a namespace, the page starts after digest ``start_after``; without one
        (every namespace) paging by cursor is not possible, so ``start_after`` must be
        empty. A scan (first page, then each next page after the last digest seen)
        lists every key present for the whole scan exactly once; keys added or
        removed meanwhile may or may not appear. Pages come from a sorted snapshot
        of the namespace, refreshed at the start of a scan when keys changed.
        """
        if limit < 0:
            raise InvalidRequest("limit cannot be negative")
        if namespace is None:
            if start_after:
                raise InvalidRequest("start_after needs a namespace: page within one namespace")
            out: list[tuple[str, bytes, Holders]] = []
            for ns in self.namespaces():
                if len(out) >= limit:
                    break
                out += self._page(ns, limit - len(out), b"")
            return out
        check_namespace(namespace)
        return self._page(namespace, limit, bytes(start_after))

    def _page(self, namespace: str, limit: int, start_after: bytes) -> list[tuple[str, bytes, Holders]]:
        snapshot = self._sorted_digests(namespace, refresh=not start_after)
        out = []
        i = bisect.bisect_right(snapshot, start_after) if start_after else 0
        while len(out) < limit and i < len(snapshot):
            chunk = snapshot[i : i + max(limit - len(out), 64)]
            i += len(chunk)
            with self._lock:
                get = self._table.get(namespace, {}).get
                out += [(namespace, d, h) for d in chunk if (h := get(d))]
        return out[:limit]

    def _sorted_digests(self, namespace: str, refresh: bool) -> list[bytes]:
        """The namespace's digests, sorted; copied under the lock, sorted outside it."""
        with self._lock:
            version = self._versions.get(namespace, 0)
            cached = self._snapshots.get(namespace)
            if cached is not None and (cached[0] == version or not refresh):
                return cached[1]
            digests = list(self._table.get(namespace, ()))
        digests.sort()
        with self._lock:
            self._snapshots[namespace] = (version, digests)
        return digests

    def namespaces(self) -> list[str]:
        """Every namespace with at least one key, sorted."""
        with self._lock:
            return sorted(self._table)

    def size(self) -> int:
        """Distinct keys indexed (a key held by two nodes counts once)."""
        with self._lock:
            return sum(map(len, self._table.values()))

    def namespace_size(self, namespace: str) -> int:
        """Distinct keys indexed in one namespace (0 if none)."""
        with self._lock:
            return len(self._table.get(namespace, ()))

    def node_counts(self) -> dict[str, dict[str, int]]:
        """{node_id: {"dram": blocks, "ssd": blocks}} for every known node."""
        with self._lock:
            return {n: {TIER_NAMES[DRAM]: c[DRAM], TIER_NAMES[SSD]: c[SSD]} for n, c in self._counts.items()}

    def node_blocks(self, node_id: str) -> int:
        """Blocks indexed for one node (0 if unknown)."""
        with self._lock:
            c = self._counts.get(node_id)
            return c[DRAM] + c[SSD] if c else 0


def _digests_of(batches: list[tuple[str, list[Event]]]):
    """(namespace, digests) of checked batches."""
    return ((namespace, (e[2] for e in events)) for namespace, events in batches)


def _walk_prefix(get, digests: Sequence[bytes]) -> tuple[dict[str, int], int]:
    """The prefix walk of match_prefix over one namespace's ``get``; runs under the lock."""
    first = get(digests[0])
    if first is None:
        return {}, 0
    active = {n for n, _ in first}  # nodes holding every block so far
    counts: dict[str, int] = {}
    prev = first
    longest = len(digests)
    for i, digest in enumerate(digests):
        holders = get(digest)
        if holders is prev:
            continue
        if holders is None:
            longest = i
            break
        prev = holders
        if active:
            gone = active.difference([n for n, _ in holders])
            if gone:
                for n in gone:
                    counts[n] = i
                active -= gone
    for n in active:
        counts[n] = longest
    return counts, longest
