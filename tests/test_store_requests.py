"""BlockStore.request(): the blocks an ongoing request reads or writes are not eviction victims.

Run for every policy and tier layout (the ``make_store`` fixture)."""

from __future__ import annotations

import threading

import pytest

from kvstore_client.errors import CapacityError

from tests.conftest import KiB, value_for

BLOCK = 64 * KiB


def key(i: int):
    return ("ns", i.to_bytes(16, "little"))


def elsewhere(work) -> None:
    """Run ``work`` on another thread (another client, outside this thread's request)."""
    thread = threading.Thread(target=work)
    thread.start()
    thread.join()


def in_dram(store, k) -> bool:
    return store.tier_of(k) == "dram"


def test_a_batch_does_not_evict_its_own_fresh_blocks(make_store):
    # 4 blocks of DRAM, full of blocks that were read (hits 1); a batch of 3 fresh blocks is
    # put while another client keeps reading the old ones. Every policy would otherwise pick
    # the batch's earlier blocks: LFU and length-aware because they have no hits, LRU
    # because the other client's reads made them the least recent.
    store = make_store(dram_capacity=4 * BLOCK, max_block_bytes=BLOCK, granule=BLOCK)
    old = [key(i) for i in range(4)]
    for k in old:
        store.put(k, value_for(k, BLOCK))
        store.get(k)
    batch = [key(100 + i) for i in range(3)]
    with store.request():
        for depth, k in enumerate(batch):
            store.put(k, value_for(k, BLOCK), depth=depth)
            elsewhere(lambda: [store.get(o) for o in old if in_dram(store, o)])
    assert [in_dram(store, k) for k in batch] == [True] * 3
    assert sum(in_dram(store, k) for k in old) == 1
    assert store.get(batch[0]) == value_for(batch[0], BLOCK)
    assert store.stats()["store"]["pinned"] == 0


def test_blocks_read_by_the_request_are_not_evicted_by_its_writes(make_store):
    store = make_store(dram_capacity=4 * BLOCK, max_block_bytes=BLOCK, granule=BLOCK)
    for i in range(4):
        store.put(key(i), value_for(key(i), BLOCK))
    with store.request():
        assert store.get(key(0)) == value_for(key(0), BLOCK)  # the request's prefix
        for i in range(10, 13):
            store.put(key(i), value_for(key(i), BLOCK))
    assert in_dram(store, key(0))
    assert all(in_dram(store, key(i)) for i in range(10, 13))


def test_after_the_request_its_blocks_are_candidates_again_with_their_hits(make_store):
    store = make_store(dram_capacity=2 * BLOCK, max_block_bytes=BLOCK, granule=BLOCK)
    with store.request():
        store.put(key(0), value_for(key(0), BLOCK))
        store.put(key(1), value_for(key(1), BLOCK))
        assert store.stats()["store"]["pinned"] == 2
        with pytest.raises(CapacityError):  # only the request's own blocks are left
            store.put(key(2), value_for(key(2), BLOCK))
    assert store.stats()["store"]["pinned"] == 0
    store.get(key(1))  # key 1 is now the more recent and has a hit: every policy keeps it
    store.put(key(2), value_for(key(2), BLOCK))
    assert not in_dram(store, key(0)) and in_dram(store, key(1)) and in_dram(store, key(2))


def test_request_holds_add_to_pins_and_nest(make_store):
    store = make_store(dram_capacity=4 * BLOCK, max_block_bytes=BLOCK, granule=BLOCK)
    store.put(key(0), value_for(key(0), BLOCK))
    assert store.pin(key(0))
    with store.request():
        store.get(key(0))
        with store.request():  # joins the outer request
            store.put(key(1), value_for(key(1), BLOCK))
            store.put(key(1), value_for(key(1), BLOCK))  # replaced: still held once
        assert store.stats()["store"]["pinned"] == 2
    assert store.stats()["store"]["pinned"] == 1  # the caller's own pin stays
    assert store.unpin(key(0)) and not store.unpin(key(0)) and not store.unpin(key(1))


def test_other_threads_are_not_part_of_the_request(make_store):
    store = make_store(dram_capacity=4 * BLOCK, max_block_bytes=BLOCK, granule=BLOCK)
    with store.request():
        elsewhere(lambda: store.put(key(0), value_for(key(0), BLOCK)))
        assert store.stats()["store"]["pinned"] == 0
