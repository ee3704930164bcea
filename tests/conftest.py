"""Shared fixtures: store configurations every contract suite runs against."""

from __future__ import annotations

import random
import threading

import pytest

from kvstore.node.config import StoreConfig
from kvstore.node.store import BlockStore
from kvstore.policy import POLICIES

KiB = 1 << 10


def run_in_threads(work, n: int, timeout: float | None = None) -> list[BaseException]:
    """Run ``work(i)`` for i in range(n), each in a thread of its own; what they raised."""
    errors: list[BaseException] = []

    def guarded(i: int) -> None:
        try:
            work(i)
        except BaseException as exc:  # reported to the caller
            errors.append(exc)

    threads = [threading.Thread(target=guarded, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    return errors


def value_for(key, size: int) -> bytes:
    """Deterministic bytes for a key, so a test can check what it reads."""
    return random.Random(repr(key)).randbytes(size)


@pytest.fixture(params=sorted(POLICIES))
def policy(request) -> str:
    return request.param


@pytest.fixture(params=["dram", "dram+ssd"])
def tiers(request) -> str:
    return request.param


@pytest.fixture
def make_store(tmp_path, policy, tiers):
    """Factory for small BlockStores of the parametrised policy and tier layout."""
    stores = []

    def make(**overrides) -> BlockStore:
        options = dict(dram_capacity=512 * KiB, max_block_bytes=64 * KiB, policy=policy, background_eviction=False)
        if tiers == "dram+ssd":
            options.update(ssd_path=str(tmp_path / f"ssd{len(stores)}"), ssd_capacity=2048 * KiB)
        options.update(overrides)
        store = BlockStore(StoreConfig(**options))
        stores.append(store)
        return store

    yield make
    for store in stores:
        store.close()
