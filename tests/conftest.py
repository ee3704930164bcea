"""Shared fixtures: store configurations every contract suite runs against."""

from __future__ import annotations

import random

import pytest

from kvstore.node.config import StoreConfig
from kvstore.node.store import BlockStore
from kvstore.policy import POLICIES

KiB = 1 << 10


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
