"""An in-process tour of the block store: hash a token stream, store its KV
blocks, overflow DRAM into SSD, read everything back, and show the tiers.

Without a data dir it works in a temporary one, removed afterwards: it never
opens the service's data dir (``./kvstore-data``), whose SSD tier a running
node may hold."""

from __future__ import annotations

import os
import random
import tempfile
import time

from kvstore_client.hashing import BlockHasher
from kvstore.node.config import StoreConfig
from kvstore.node.store import BlockStore
from kvstore.units import format_size


def fake_kv_block(key_digest: bytes, size: int) -> bytes:
    """Deterministic stand-in for a block's K/V bytes (so reads can be checked)."""
    return random.Random(key_digest).randbytes(size)


def run_demo(data_dir: str | None, dram: int, ssd: int, blocks: int, block_bytes: int, policy: str, echo=print) -> dict:
    """Store ``blocks`` blocks through a real BlockStore and verify every byte read back
    (in ``data_dir``, or a temporary directory when it is None)."""
    if data_dir is None:
        with tempfile.TemporaryDirectory(prefix="kvstore-demo-") as scratch:
            return run_demo(scratch, dram, ssd, blocks, block_bytes, policy, echo)
    os.makedirs(data_dir, exist_ok=True)
    config = StoreConfig(
        dram_capacity=dram,
        ssd_path=os.path.join(data_dir, "ssd"),
        ssd_capacity=ssd,
        max_block_bytes=block_bytes,
        policy=policy,
    )
    hasher = BlockHasher("demo-model", block_size=16)
    tokens = list(range(blocks * 16))
    keys = hasher.keys(tokens)
    with BlockStore(config) as store:
        echo(
            f"block store: DRAM {format_size(dram)} in shared memory ({store.dram.arena.path}), "
            f"SSD {format_size(ssd)} under {config.ssd_path}"
        )
        start = time.perf_counter()
        for depth, key in enumerate(keys):
            store.put(key, fake_kv_block(key[1], block_bytes), depth=depth)
        put_s = time.perf_counter() - start
        store.evict()
        matched = store.match_prefix(keys)
        start = time.perf_counter()
        good = sum(store.get(key) == fake_kv_block(key[1], block_bytes) for key in keys[:matched])
        get_s = time.perf_counter() - start
        stats = store.stats()
    echo(
        f"stored {len(keys)} blocks of {format_size(block_bytes)} in {put_s:.2f}s; "
        f"prefix match finds {matched}; {good} read back byte-exact in {get_s:.2f}s"
    )
    echo(format_stats(stats))
    return {"blocks": len(keys), "matched": matched, "verified": good, "stats": stats}


def format_stats(stats: dict) -> str:
    """A small per-tier table."""
    cols = ("capacity", "used", "blocks", "hits", "misses", "evictions", "demotions", "promotions", "checksum_failures")
    rows = [("tier",) + cols]
    for tier in ("dram", "ssd"):
        if tier in stats:
            s = stats[tier]
            rows.append((tier,) + tuple(format_size(s[c]) if c in ("capacity", "used") else str(s[c]) for c in cols))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(v.rjust(w) for v, w in zip(r, widths)) for r in rows)
