"""Model-based tests of BlockStore under memory pressure (hypothesis.stateful).

A small key space on tiny tiers (DRAM 256 KiB, SSD 512 KiB, blocks up to
64 KiB) keeps the store evicting, demoting and promoting while random
puts, reads, two-phase puts, removes, pins and prefix matches run against it.

The model is what a cache may promise: ``model`` maps every key that was
committed and not removed to its bytes, ``pins`` counts pins. A block may
vanish at any time (evicted) unless it is pinned, so a miss is allowed and
prunes the model, but wrong bytes, a lost pinned block, a key that was never
committed, or drifting byte accounting are failures. Each policy runs on
DRAM-only and DRAM+SSD stores with eviction inline (deterministic), plus one
layout with the background evictor.
"""

from __future__ import annotations

import contextlib
import itertools
import random
import shutil

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from kvstore_client.errors import BufferTooSmall, CapacityError, InvalidKey, InvalidValue, UnknownNamespace
from kvstore.node.config import StoreConfig
from kvstore.node.store import BlockStore
from kvstore.policy import POLICIES

KiB = 1 << 10
GRANULE = 4096
DRAM_CAPACITY = 256 * KiB
SSD_CAPACITY = 384 * KiB
MAX_BLOCK = 64 * KiB
NAMESPACES = frozenset({"m", "n"})
MAX_PINNED_KEYS = 2  # more pins could leave DRAM too fragmented for any 64 KiB put

KEYS = [("m", i.to_bytes(16, "little")) for i in range(18)] + [("n", b"\x01"), ("n", b"\x02")]
CHAIN = KEYS[:6]  # a prefix chain: match_prefix walks it until the first miss

key_strategy = st.sampled_from(KEYS)
# Mostly large blocks (so the tiers fill within a few steps), plus the edge sizes.
size_strategy = st.one_of(
    st.tuples(st.integers(1, MAX_BLOCK // GRANULE), st.integers(0, GRANULE - 1)).map(lambda t: t[0] * GRANULE - t[1]),
    st.sampled_from([1, GRANULE - 1, GRANULE, GRANULE + 1, MAX_BLOCK - 1, MAX_BLOCK]),
)
seed_strategy = st.integers(0, 2**32 - 1)
depth_strategy = st.integers(0, 7)


def value_of(seed: int, size: int) -> bytes:
    """Cheap, seed-determined bytes of the given size."""
    return random.Random(seed).randbytes(size)


def footprint(size: int) -> int:
    return -(-size // GRANULE) * GRANULE


class StoreMachine(RuleBasedStateMachine):
    """One BlockStore against a dict model; subclasses fix the configuration."""

    TIERS = "dram"
    POLICY = "lru"
    BACKGROUND = False
    ROOT = None  # a tmp_path, set by make_machine
    _counter = itertools.count()

    reservations = Bundle("reservations")

    def __init__(self) -> None:
        super().__init__()
        self.ssd_dir = None
        options = dict(
            dram_capacity=DRAM_CAPACITY,
            granule=GRANULE,
            max_block_bytes=MAX_BLOCK,
            policy=self.POLICY,
            background_eviction=self.BACKGROUND,
            namespaces=NAMESPACES,
        )
        if self.TIERS == "dram+ssd":
            self.ssd_dir = self.ROOT / f"ssd{next(self._counter)}"
            options.update(ssd_path=str(self.ssd_dir), ssd_capacity=SSD_CAPACITY)
        self.store = BlockStore(StoreConfig(**options))
        self.model: dict[tuple, bytes] = {}
        self.depths: dict[tuple, int] = {}
        self.pins: dict[tuple, int] = {}
        self.open_reservations: dict[int, tuple] = {}  # id(res) -> (res, key, bytes, depth)

    def teardown(self) -> None:
        for res, _, _, _ in list(self.open_reservations.values()):
            res.revoke()
        self.store.close()
        if self.ssd_dir is not None:
            shutil.rmtree(self.ssd_dir, ignore_errors=True)

    # -- helpers ---------------------------------------------------------------------
    def quiet(self):
        """Hold off the background evictor (its passes take this lock) while checking."""
        return self.store.tiering.evict_lock if self.BACKGROUND else contextlib.nullcontext()

    def forget_if_evicted(self, key) -> None:
        """A miss: the block may have been evicted, unless it is pinned."""
        assert not self.pins.get(key), f"pinned block {key} is missing"
        self.model.pop(key, None)
        self.depths.pop(key, None)

    def check_read(self, key, got) -> None:
        if got is None:
            self.forget_if_evicted(key)
        else:
            assert key in self.model, f"{key} was never committed (or was removed) but reads {len(got)} bytes"
            assert got == self.model[key], f"{key} returned other bytes than were committed"

    def tier_bytes(self, key):
        """The block's bytes straight from its tier (no hit counted, no promotion)."""
        tier = self.store.tier_of(key)
        if tier is None:
            return None, None
        if tier == "dram":
            return tier, self.store.dram.get(key)
        return tier, self.store.ssd.get(key)

    def snapshot(self):
        keys = sorted(self.store.keys())
        return keys, [self.tier_bytes(k) for k in keys], self.used()

    def used(self):
        stats = self.store.stats()
        return stats["dram"]["used"], stats.get("ssd", {}).get("used")

    def record_commit(self, key, data: bytes, depth: int) -> None:
        self.model[key] = data
        self.depths[key] = depth

    # -- writes ------------------------------------------------------------------------
    @rule(key=key_strategy, size=size_strategy, seed=seed_strategy, depth=depth_strategy)
    def put(self, key, size, seed, depth):
        data = value_of(seed, size)
        try:
            self.store.put(key, data, depth=depth)
        except CapacityError:
            self.check_capacity_error(size)
            return
        self.record_commit(key, data, depth)

    @rule(items=st.lists(st.tuples(key_strategy, size_strategy, seed_strategy), min_size=2, max_size=6))
    def put_burst(self, items):
        for key, size, seed in items:
            self.put(key, size, seed, depth=KEYS.index(key) % 8)

    def check_capacity_error(self, size: int) -> None:
        """CapacityError is only fair when pins and open reservations leave no free extent that fits."""
        with self.quiet():
            assert self.pins or self.open_reservations, "CapacityError with nothing pinned or reserved"
            for key in self.store.keys():
                if self.store.tier_of(key) == "dram":
                    assert self.pins.get(key), f"CapacityError while unpinned {key} still sits in DRAM"
            assert self.store.dram.largest_free_extent() < footprint(size)

    @rule(target=reservations, key=key_strategy, size=size_strategy, seed=seed_strategy, depth=depth_strategy)
    @precondition(lambda self: not self.open_reservations)
    def reserve(self, key, size, seed, depth):
        try:
            res = self.store.reserve(key, size, depth=depth)
        except CapacityError:
            self.check_capacity_error(size)
            return None
        assert res.size == size and len(res.buffer) == size
        assert not self.store.exists(key) or key in self.model  # invisible until committed
        data = value_of(seed, size)
        res.buffer[:] = data
        self.open_reservations[id(res)] = (res, key, data, depth)
        return res

    @rule(res=consumes(reservations))
    def commit(self, res):
        if res is None:
            return
        _, key, data, depth = self.open_reservations.pop(id(res))
        res.commit()
        self.record_commit(key, data, depth)
        if not self.BACKGROUND:
            assert self.store.tier_of(key) == "dram"

    @rule(res=consumes(reservations))
    def revoke(self, res):
        if res is None:
            return
        key = self.open_reservations.pop(id(res))[1]
        res.revoke()
        self.check_read(key, self.store.get(key))  # the old value, if any, is untouched

    @rule(key=key_strategy, size=size_strategy, seed=seed_strategy)
    def reserve_and_revoke(self, key, size, seed):
        try:
            res = self.store.reserve(key, size)
        except CapacityError:
            self.check_capacity_error(size)
            return
        res.buffer[:] = value_of(seed, size)
        res.revoke()
        self.check_read(key, self.store.get(key))

    @rule(key=key_strategy)
    def remove(self, key):
        with self.quiet():
            present = self.store.exists(key)
            assert self.store.remove(key) is present
        if present:
            assert key in self.model
        else:
            self.forget_if_evicted(key)
        self.model.pop(key, None)
        self.depths.pop(key, None)
        self.pins.pop(key, None)
        assert not self.store.exists(key)
        assert self.store.get(key) is None

    # -- pins ----------------------------------------------------------------------------
    @rule(key=key_strategy)
    def pin(self, key):
        if not self.pins.get(key) and len(self.pins) >= MAX_PINNED_KEYS:
            return
        with self.quiet():
            present = self.store.exists(key)
            assert self.store.pin(key) is present
        if present:
            self.pins[key] = self.pins.get(key, 0) + 1
        else:
            self.forget_if_evicted(key)

    @rule(key=key_strategy)
    def unpin(self, key):
        pinned = self.pins.get(key, 0)
        assert self.store.unpin(key) is (pinned > 0)
        if pinned > 1:
            self.pins[key] = pinned - 1
        elif pinned == 1:
            del self.pins[key]

    # -- reads -------------------------------------------------------------------------------
    @rule(key=key_strategy)
    def get(self, key):
        self.check_read(key, self.store.get(key))

    @rule(pick=st.integers(0, len(KEYS) - 1), how=st.sampled_from(["get", "get_into", "read"]))
    def read_stored(self, pick, how):
        """Read a block the model holds (random keys mostly miss once the model is sparse). What is
        drawn is an index, not one of the model's keys: under the background evictor the model
        shrinks with timing, and hypothesis needs draws that do not depend on it."""
        if not self.model:
            return
        stored = sorted(self.model)
        key = stored[pick % len(stored)]
        {"get": self.get, "get_into": lambda k: self.get_into(k, 0), "read": self.zero_copy_read}[how](key)

    @rule(key=key_strategy, slack=st.integers(0, 5000))
    def get_into(self, key, slack):
        expected = self.model.get(key)
        size = (len(expected) if expected is not None else 100) + slack
        buf = bytearray(b"\xa5" * size)
        n = self.store.get_into(key, buf)
        if n is None:
            self.forget_if_evicted(key)
            assert buf == b"\xa5" * size  # a miss writes nothing
        else:
            self.check_read(key, bytes(buf[:n]))
            assert buf[n:] == b"\xa5" * (size - n)

    @rule(key=key_strategy, short=st.integers(1, 4096))
    def get_into_too_small(self, key, short):
        with self.quiet():
            expected = self.model.get(key)
            if expected is None or not self.store.exists(key):
                return
            before = self.tier_bytes(key)
            size = max(len(expected) - short, 0)
            buf = bytearray(b"\x5a" * size)
            with pytest.raises(BufferTooSmall) as err:
                self.store.get_into(key, buf)
            assert err.value.needed == len(expected)
            assert buf == b"\x5a" * size
            assert self.tier_bytes(key) == before  # nothing moved or changed

    @rule(key=key_strategy)
    def zero_copy_read(self, key):
        with self.store.read(key) as view:
            got = None if view is None else bytes(view)
        self.check_read(key, got)

    @rule(key=key_strategy)
    def exists_agrees_with_get(self, key):
        with self.quiet():
            present = self.store.exists(key)
            assert self.store.batch_exists([key, key]) == [present, present]
            size = self.store.size_of(key)
            got = self.store.get(key)
        assert (got is not None) is present
        assert size == (None if got is None else len(got))
        self.check_read(key, got)

    @rule(keys=st.lists(key_strategy, max_size=6))
    def batch_exists(self, keys):
        with self.quiet():
            flags = self.store.batch_exists(keys)
            assert flags == [self.store.exists(k) for k in keys]
        for k, flag in zip(keys, flags):
            if flag:
                assert k in self.model
            else:
                self.forget_if_evicted(k)

    @rule(start=st.integers(0, len(CHAIN) - 1))
    def match_prefix(self, start):
        chain = CHAIN[start:]
        with self.quiet():
            n = self.store.match_prefix(chain)
            present = [self.store.exists(k) for k in chain]
        assert 0 <= n <= len(chain)
        assert all(present[:n]) and (n == len(chain) or not present[n])
        assert all(k in self.model for k in chain[:n])
        assert self.store.match_prefix([]) == 0

    # -- eviction --------------------------------------------------------------------------------
    @rule()
    def evict(self):
        self.store.evict()
        if self.BACKGROUND:
            return
        cfg, stats = self.store.config, self.store.stats()
        dram_blocks = [k for k in self.store.keys() if self.store.tier_of(k) == "dram"]
        if stats["dram"]["used"] > cfg.high_watermark * stats["dram"]["capacity"]:
            assert all(self.pins.get(k) for k in dram_blocks), "evict() left unpinned DRAM blocks over the mark"
        if "ssd" in stats and stats["ssd"]["used"] > cfg.high_watermark * stats["ssd"]["capacity"]:
            ssd_blocks = [k for k in self.store.keys() if self.store.tier_of(k) == "ssd"]
            assert all(self.pins.get(k) for k in ssd_blocks), "evict() left unpinned SSD blocks over the mark"

    # -- invalid input -----------------------------------------------------------------------------
    @rule(
        case=st.sampled_from(
            [
                "empty value",
                "oversized value",
                "zero reserve",
                "negative depth",
                "empty namespace",
                "empty digest",
                "str key",
                "str digest",
                "long digest",
                "unknown namespace put",
                "unknown namespace get",
                "bad key get_into",
                "bad key pin",
                "bad key remove",
                "bad key exists",
                "bad key match_prefix",
                "non-buffer value",
            ]
        ),
        key=key_strategy,
    )
    def invalid_input(self, case, key):
        store = self.store
        calls = {
            "empty value": (InvalidValue, lambda: store.put(key, b"")),
            "oversized value": (InvalidValue, lambda: store.put(key, bytes(MAX_BLOCK + 1))),
            "zero reserve": (InvalidValue, lambda: store.reserve(key, 0)),
            "negative depth": (InvalidValue, lambda: store.put(key, b"x", depth=-1)),
            "empty namespace": (InvalidKey, lambda: store.put(("", b"x"), b"x")),
            "empty digest": (InvalidKey, lambda: store.put(("m", b""), b"x")),
            "str key": (InvalidKey, lambda: store.put("m:abc", b"x")),
            "str digest": (InvalidKey, lambda: store.get(("m", "abc"))),
            "long digest": (InvalidKey, lambda: store.put(("m", b"d" * 65), b"x")),
            "unknown namespace put": (UnknownNamespace, lambda: store.put(("zz", key[1]), b"x")),
            "unknown namespace get": (UnknownNamespace, lambda: store.get(("zz", key[1]))),
            "bad key get_into": (InvalidKey, lambda: store.get_into(("", b"x"), bytearray(10))),
            "bad key pin": (InvalidKey, lambda: store.pin(("m", b""))),
            "bad key remove": (UnknownNamespace, lambda: store.remove(("zz", key[1]))),
            "bad key exists": (InvalidKey, lambda: store.exists(("m", b"x", 1))),
            "bad key match_prefix": (InvalidKey, lambda: store.match_prefix(["nope", key])),
            "non-buffer value": (InvalidValue, lambda: store.put(key, object())),
        }
        error, call = calls[case]
        with self.quiet():
            before = self.snapshot()
            with pytest.raises(error):
                call()
            assert self.snapshot() == before

    # -- invariants ------------------------------------------------------------------------------------
    @invariant()
    def store_agrees_with_model(self):
        """Prune evicted blocks from the model, then check every stored block and the accounting."""
        with self.quiet():
            store, stats = self.store, self.store.stats()
            present = set(store.keys())
            assert present <= set(self.model), f"stored keys never committed: {present - set(self.model)}"
            for key in list(self.model):
                if key not in present:
                    self.forget_if_evicted(key)
            assert stats["store"]["blocks"] == len(store) == len(present) == len(self.model)
            assert stats["store"]["pinned"] == len(self.pins)
            dram_used = ssd_used = dram_blocks = ssd_blocks = 0
            for key in present:
                tier, data = self.tier_bytes(key)
                assert data == self.model[key], f"{key} in {tier} holds other bytes than committed"
                assert store.size_of(key) == len(data)
                if tier == "dram":
                    dram_used += footprint(len(data))
                    dram_blocks += 1
                    if store.describe(key).ssd_copy:  # the SSD record kept when it was promoted
                        assert store.ssd.get(key) == data, f"{key}'s kept SSD copy holds other bytes"
                        ssd_used += len(data)
                        ssd_blocks += 1
                else:
                    assert tier == "ssd" and self.TIERS == "dram+ssd"
                    assert store.ssd.depth_of(key) == self.depths[key]
                    ssd_used += len(data)
                    ssd_blocks += 1
            reserved = sum(footprint(len(data)) for _, _, data, _ in self.open_reservations.values())
            assert stats["dram"]["used"] == dram_used + reserved
            assert stats["dram"]["blocks"] == dram_blocks
            assert stats["dram"]["used"] <= stats["dram"]["capacity"] == DRAM_CAPACITY
            if self.TIERS == "dram+ssd":
                assert stats["ssd"]["used"] == ssd_used
                assert stats["ssd"]["blocks"] == ssd_blocks
                assert stats["ssd"]["used"] <= stats["ssd"]["capacity"] == SSD_CAPACITY
                assert stats["ssd"]["checksum_failures"] == 0
            else:
                assert "ssd" not in stats and ssd_blocks == 0
            for key in self.pins:
                assert key in present, f"pinned block {key} is missing"


CONFIGS = [(tiers, policy, False) for tiers in ("dram", "dram+ssd") for policy in sorted(POLICIES)]
CONFIGS.append(("dram+ssd", "lru", True))


def make_machine(tiers: str, policy: str, background: bool, root) -> type[StoreMachine]:
    return type(
        f"StoreMachine_{tiers.replace('+', '_')}_{policy}{'_bg' if background else ''}",
        (StoreMachine,),
        {"TIERS": tiers, "POLICY": policy, "BACKGROUND": background, "ROOT": root},
    )


@pytest.mark.parametrize(
    "tiers,policy,background", CONFIGS, ids=[f"{t}-{p}{'-bg' if b else ''}" for t, p, b in CONFIGS]
)
def test_store_matches_model(tmp_path, tiers, policy, background):
    run_state_machine_as_test(
        make_machine(tiers, policy, background, tmp_path),
        settings=settings(
            max_examples=30,
            stateful_step_count=60,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
        ),
    )
