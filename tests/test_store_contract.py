"""The BlockStore contract, run against every eviction policy and tier layout."""

from __future__ import annotations

import numpy as np
import pytest

from kvstore_client.errors import (
    BufferTooSmall,
    CapacityError,
    ConfigError,
    InvalidKey,
    InvalidValue,
    ReservationError,
    UnknownNamespace,
)
from kvstore_client.hashing import BlockHasher
from kvstore.node.config import StoreConfig
from tests.conftest import KiB, value_for


def key(i: int, ns: str = "m") -> tuple[str, bytes]:
    return (ns, i.to_bytes(16, "little"))


def test_put_get_round_trip_any_buffer(make_store):
    store = make_store()
    store.put(key(1), b"abc")
    store.put(key(2), bytearray(b"defg"))
    store.put(key(3), np.arange(1000, dtype=np.float16))
    store.put(key(4), memoryview(b"0123456789")[2:6])
    assert store.get(key(1)) == b"abc"
    assert store.get(key(2)) == b"defg"
    assert store.get(key(3)) == np.arange(1000, dtype=np.float16).tobytes()
    assert store.get(key(4)) == b"2345"
    assert store.get(key(99)) is None


def test_get_into_caller_buffer(make_store):
    store = make_store()
    data = value_for(key(1), 10_000)
    store.put(key(1), data)
    out = np.zeros(3000, dtype=np.int32)  # 12,000 bytes
    assert store.get_into(key(1), out) == 10_000
    assert out.tobytes()[:10_000] == data
    with pytest.raises(BufferTooSmall) as err:
        store.get_into(key(1), bytearray(9_999))
    assert err.value.needed == 10_000
    with pytest.raises(InvalidValue):
        store.get_into(key(1), b"read-only buffer of enough size" * 1000)
    assert store.get_into(key(2), bytearray(10)) is None


def test_two_phase_put(make_store):
    store = make_store()
    res = store.reserve(key(1), 5000, depth=3)
    res.buffer[:] = value_for(key(1), 5000)
    assert not store.exists(key(1))  # invisible until committed
    res.commit()
    assert store.get(key(1)) == value_for(key(1), 5000)
    with pytest.raises(ReservationError):
        res.commit()


def test_revoke_and_abandon_free_space(make_store):
    store = make_store()
    before = store.stats()["dram"]["used"]
    res = store.reserve(key(1), 60 * KiB)
    assert store.stats()["dram"]["used"] == before + 60 * KiB
    res.revoke()
    assert store.stats()["dram"]["used"] == before
    with pytest.raises(ReservationError):
        res.commit()
    store.reserve(key(2), 60 * KiB)  # dropped on the floor
    import gc

    gc.collect()
    assert store.stats()["dram"]["used"] == before
    assert not store.exists(key(1)) and not store.exists(key(2))


def test_reservation_context_revokes_on_error(make_store):
    store = make_store()
    with pytest.raises(RuntimeError):
        with store.reserve(key(1), 100) as res:
            res.buffer[:] = b"x" * 100
            raise RuntimeError("engine failed mid-write")
    assert not store.exists(key(1))
    assert store.stats()["dram"]["used"] == 0


def test_overwrite_replaces_value_and_accounting(make_store):
    store = make_store()
    store.put(key(1), b"a" * 10_000)
    store.put(key(1), b"b" * 20_000)
    assert store.get(key(1)) == b"b" * 20_000
    assert len(store) == 1
    assert store.stats()["dram"]["used"] == 20_480


def test_check_finds_and_drops_a_damaged_block(make_store):
    store = make_store()
    store.put(key(1), value_for(1, 8 * KiB))
    store.put(key(2), value_for(2, 8 * KiB))
    assert store.check(key(1)) is True and store.check(key(99)) is None
    where = store.dram.location(key(1))
    store.dram.arena.view[where.offset + 100] ^= 0xFF  # a stray write into the arena
    assert store.check(key(1)) is False  # found, dropped and counted
    assert not store.exists(key(1)) and store.get(key(1)) is None and store.check(key(1)) is None
    assert store.stats()["dram"]["checksum_failures"] == 1
    assert store.get(key(2)) == value_for(2, 8 * KiB)


def test_granted_space_is_named_at_commit(make_store):
    store = make_store()
    res = store.grant(4 * KiB)
    res.buffer[:] = b"g" * (4 * KiB)
    with pytest.raises(ReservationError):
        res.commit()  # no key yet
    res.bind(key(7), depth=3)
    res.commit()
    assert store.get(key(7)) == b"g" * (4 * KiB)
    with pytest.raises(InvalidValue):
        store.grant(0)


def test_grants_hold_at_most_an_eighth_of_dram(make_store):
    store = make_store()  # 512 KiB of DRAM: 64 KiB of grants
    held = [store.grant(16 * KiB) for _ in range(4)]
    with pytest.raises(CapacityError):
        store.grant(4 * KiB)
    assert store.stats()["store"]["granted_bytes"] == 64 * KiB
    store.reserve(key(1), 16 * KiB).revoke()  # reservations named at once are not grants
    held.pop().revoke()  # given back
    held.pop().bind(key(2))  # now a block being written, no longer a grant
    assert store.stats()["store"]["granted_bytes"] == 32 * KiB
    held.append(store.grant(32 * KiB))
    with pytest.raises(CapacityError):
        store.grant(4 * KiB)
    for res in held:
        res.revoke()
    assert store.stats()["store"]["granted_bytes"] == 0


def test_exists_batch_exists_match_prefix(make_store):
    store = make_store()
    keys = BlockHasher("m", 4).keys(list(range(40)))
    for depth, k in enumerate(keys[:6]):
        store.put(k, value_for(k, 100), depth=depth)
    store.put(keys[8], b"x")
    assert store.match_prefix(keys) == 6
    assert store.batch_exists(keys) == [True] * 6 + [False, False, True, False]
    assert store.exists(keys[0]) and not store.exists(keys[7])
    assert store.match_prefix([]) == 0


def test_remove(make_store):
    store = make_store()
    store.put(key(1), b"abc")
    assert store.remove(key(1)) is True
    assert store.remove(key(1)) is False
    assert store.get(key(1)) is None
    assert store.stats()["dram"]["used"] == 0


def test_eviction_keeps_memory_bounded_and_pins_survive(make_store):
    store = make_store()
    store.put(key(0), value_for(key(0), 64 * KiB))
    assert store.pin(key(0))
    for i in range(1, 100):
        store.put(key(i), value_for(key(i), 64 * KiB))
        stats = store.stats()
        assert stats["dram"]["used"] <= stats["dram"]["capacity"]
    assert store.get(key(0)) == value_for(key(0), 64 * KiB)
    assert store.tier_of(key(0)) == "dram"
    assert store.unpin(key(0)) and not store.unpin(key(0))
    assert not store.pin(key(12345))
    for i in range(100):
        got = store.get(key(i))
        assert got is None or got == value_for(key(i), 64 * KiB)


def test_all_pinned_means_capacity_error(make_store):
    store = make_store(dram_capacity=128 * KiB)
    for i in range(2):
        store.put(key(i), b"p" * 64 * KiB)
        store.pin(key(i))
    with pytest.raises(CapacityError):
        store.put(key(9), b"x" * 64 * KiB)
    assert store.get(key(0)) == b"p" * 64 * KiB and store.get(key(1)) == b"p" * 64 * KiB


def test_block_being_read_is_not_evicted(make_store):
    store = make_store(dram_capacity=128 * KiB)
    store.put(key(0), b"r" * 64 * KiB)
    with store.read(key(0)) as view:
        for i in range(1, 6):
            try:
                store.put(key(i), b"w" * 64 * KiB)
            except CapacityError:
                pass  # DRAM-only with one of two slots leased: room for one at a time
        assert bytes(view) == b"r" * 64 * KiB
    assert store.stats()["dram"]["used"] <= 128 * KiB


def test_bad_input_is_typed_and_harmless(make_store):
    store = make_store(namespaces={"m"})
    store.put(key(1), b"keep")
    snapshot = store.stats()
    with pytest.raises(InvalidValue):
        store.put(key(2), b"")
    with pytest.raises(InvalidValue):
        store.put(key(2), b"x" * (64 * KiB + 1))
    with pytest.raises(InvalidKey):
        store.put(("m", b""), b"x")
    with pytest.raises(InvalidKey):
        store.put("not a tuple", b"x")
    with pytest.raises(InvalidKey):
        store.get(("", b"x"))
    with pytest.raises(InvalidKey):
        store.put(("m", b"x" * 65), b"x")
    with pytest.raises(UnknownNamespace):
        store.put(key(2, ns="other"), b"x")
    with pytest.raises(UnknownNamespace):
        store.get(key(1, ns="other"))
    with pytest.raises(InvalidValue):
        store.put(key(2), object())
    assert store.stats()["dram"] == snapshot["dram"]
    assert store.get(key(1)) == b"keep"
    assert len(store) == 1


def test_tier_smaller_than_one_block_is_rejected(tmp_path):
    with pytest.raises(ConfigError):
        StoreConfig(dram_capacity="1MiB", max_block_bytes="2MiB")
    with pytest.raises(ConfigError):
        StoreConfig(dram_capacity="4MiB", max_block_bytes="2MiB", ssd_path=str(tmp_path), ssd_capacity="1MiB")
    with pytest.raises(ConfigError):
        StoreConfig(policy="fifo")


def test_stats_shape(make_store, tiers):
    store = make_store()
    store.put(key(1), b"x" * 100)
    store.get(key(1))
    store.get(key(2))
    stats = store.stats()
    expected = {
        "capacity",
        "used",
        "blocks",
        "hits",
        "misses",
        "evictions",
        "demotions",
        "promotions",
        "checksum_failures",
    }
    assert expected <= set(stats["dram"])
    assert stats["dram"]["hits"] == 1 and stats["dram"]["misses"] == 1 and stats["dram"]["blocks"] == 1
    assert ("ssd" in stats) == (tiers == "dram+ssd")


@pytest.mark.parametrize("tiers", ["dram+ssd"])
def test_demotion_and_promotion(make_store):
    store = make_store(dram_capacity=256 * KiB, high_watermark=0.8, low_watermark=0.5)
    for i in range(12):
        store.put(key(i), value_for(key(i), 60 * KiB), depth=i)
    stats = store.stats()
    assert stats["dram"]["demotions"] > 0 and stats["ssd"]["blocks"] > 0
    on_ssd = [i for i in range(12) if store.tier_of(key(i)) == "ssd"]
    assert on_ssd and len(store) == 12  # nothing dropped: SSD had room
    i = on_ssd[0]
    store.evict()  # down to the low watermark: promotion never evicts on the read path
    assert store.get(key(i)) == value_for(key(i), 60 * KiB)
    assert store.tier_of(key(i)) == "dram"
    assert store.stats()["ssd"]["promotions"] == 1
    for j in range(12):
        assert store.get(key(j)) == value_for(key(j), 60 * KiB)


def promoted_block(store, size: int = 60 * KiB) -> int:
    """Fill a 256 KiB DRAM tier over a 2 MiB SSD, then read one demoted block back into DRAM."""
    for i in range(12):
        store.put(key(i), value_for(key(i), size), depth=i)
    store.evict()  # room for the promotion (promotion never evicts)
    i = next(i for i in range(12) if store.tier_of(key(i)) == "ssd")
    assert store.get(key(i)) == value_for(key(i), size) and store.tier_of(key(i)) == "dram"
    return i


@pytest.mark.parametrize("tiers", ["dram+ssd"])
@pytest.mark.parametrize("policy", ["lru"])  # recency alone decides when the promoted block leaves again
def test_a_promoted_block_keeps_its_ssd_copy_and_is_demoted_again_without_a_write(make_store):
    store = make_store(dram_capacity=256 * KiB, high_watermark=0.8, low_watermark=0.5)
    i = promoted_block(store)
    assert store.ssd.get(key(i)) == value_for(key(i), 60 * KiB)  # the record stayed
    before = store.stats()
    for j in range(12, 20):  # push it out of DRAM again
        store.put(key(j), value_for(key(j), 60 * KiB))
        store.evict()
    after = store.stats()
    assert store.tier_of(key(i)) == "ssd" and store.get(key(i)) == value_for(key(i), 60 * KiB)
    demoted = after["dram"]["demotions"] - before["dram"]["demotions"]
    assert after["ssd"]["bytes_written"] - before["ssd"]["bytes_written"] == 60 * KiB * (demoted - 1)
    assert after["ssd"]["used"] == sum(
        store.size_of(k) for k in store.keys() if store.tier_of(k) == "ssd" or store.describe(k).ssd_copy
    )


@pytest.mark.parametrize("tiers", ["dram+ssd"])
def test_without_keep_ssd_copy_a_promotion_moves_the_block(make_store):
    store = make_store(dram_capacity=256 * KiB, high_watermark=0.8, low_watermark=0.5, keep_ssd_copy=False)
    i = promoted_block(store)
    assert not store.ssd.contains(key(i))


@pytest.mark.parametrize("tiers", ["dram+ssd"])
def test_a_kept_ssd_copy_never_outlives_its_block(make_store):
    store = make_store(dram_capacity=256 * KiB, high_watermark=0.8, low_watermark=0.5)
    i = promoted_block(store)
    store.put(key(i), b"new value")  # replaced: the kept copy of the old value goes
    assert not store.ssd.contains(key(i)) and store.get(key(i)) == b"new value"
    j = promoted_block(store) if store.tier_of(key(i)) == "dram" else i
    store.remove(key(j))
    assert not store.ssd.contains(key(j)) and store.get(key(j)) is None


@pytest.mark.parametrize("tiers", ["dram+ssd"])
def test_ssd_pressure_drops_kept_copies_but_not_their_blocks(make_store):
    store = make_store(dram_capacity=256 * KiB, high_watermark=0.8, low_watermark=0.5, ssd_capacity=640 * KiB)
    i = promoted_block(store)  # 12 x 60 KiB through 256 KiB of DRAM: the SSD is near its 640 KiB
    for j in range(12, 24):  # more demotions: the SSD evicts, kept copies included
        store.put(key(j), value_for(key(j), 60 * KiB))
        store.evict()
    assert store.stats()["ssd"]["used"] <= 640 * KiB
    if store.tier_of(key(i)) == "dram":  # still in DRAM: its copy may be gone, the block is not
        assert store.get(key(i)) == value_for(key(i), 60 * KiB)
    for k in store.keys():
        assert store.get(k) == value_for(k, 60 * KiB)


@pytest.mark.parametrize("tiers", ["dram+ssd"])
def test_ssd_only_hits_without_promotion(make_store):
    store = make_store(dram_capacity=128 * KiB, promote_on_hit=False)
    for i in range(6):
        store.put(key(i), value_for(key(i), 60 * KiB))
    assert store.tier_of(key(0)) == "ssd"
    out = bytearray(64 * KiB)
    assert store.get_into(key(0), out) == 60 * KiB and out[: 60 * KiB] == value_for(key(0), 60 * KiB)
    assert store.tier_of(key(0)) == "ssd"
    with store.read(key(0)) as view:
        assert bytes(view) == value_for(key(0), 60 * KiB)


def test_background_eviction_holds_watermarks(make_store):
    store = make_store(background_eviction=True, high_watermark=0.75, low_watermark=0.5)
    for i in range(64):
        store.put(key(i), value_for(key(i), 32 * KiB))
    import time

    deadline = time.monotonic() + 5
    while store.stats()["dram"]["used"] > 0.75 * 512 * KiB and time.monotonic() < deadline:
        time.sleep(0.01)
    assert store.stats()["dram"]["used"] <= 0.75 * 512 * KiB


def test_listener_sees_lifecycle(make_store, tiers):
    store = make_store(dram_capacity=128 * KiB)
    events = []
    store.subscribe(lambda event, k, tier: events.append((event, k[1][0], tier)))
    store.put(key(1), b"x" * 60 * KiB)
    store.put(key(2), b"y" * 60 * KiB)
    store.put(key(3), b"z" * 60 * KiB)
    store.remove(key(3))
    assert ("stored", 1, "dram") in events and ("removed", 3, "dram") in events
    assert (("moved", 1, "ssd") if tiers == "dram+ssd" else ("removed", 1, "dram")) in events
