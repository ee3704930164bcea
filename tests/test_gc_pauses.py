"""The services' garbage-collector setting: survivors of a full collection are frozen, and frozen
objects that are dropped are still freed at once."""

from __future__ import annotations

import subprocess
import sys

CHILD = """
import gc
from kvstore import gc_pauses
from kvstore.node.config import StoreConfig
from kvstore.node.store import BlockStore

gc_pauses.install()
gc_pauses.install()  # idempotent
assert gc_pauses.installed() and gc.callbacks.count(gc_pauses._freeze_after_full_collection) == 1
store = BlockStore(StoreConfig(dram_capacity=4 << 20, max_block_bytes=4096, directory_slots=0))
keys = [("gc", i.to_bytes(16, "little")) for i in range(500)]
for k in keys:
    store.put(k, b"v" * 100)
before = gc.get_freeze_count()
gc.collect()  # a full collection: what survived it is frozen
frozen = gc.get_freeze_count()
assert frozen >= before + 2 * len(keys), (before, frozen)  # a BlockMeta and an Extent per block at least
for k in keys[:100]:
    store.remove(k)
assert gc.get_freeze_count() <= frozen - 2 * 100  # frozen, yet freed the moment they were dropped
assert store.get(keys[100]) == b"v" * 100 and store.get(keys[0]) is None
store.close()
print("ok")
"""


def test_survivors_of_a_full_collection_are_frozen_and_still_freed_when_dropped():
    # a process of its own: freezing would keep this test session's cyclic garbage
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
