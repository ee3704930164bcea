"""The keyed surface both tiers share (DRAM arena, SSD on lmdb), one suite for both."""

from __future__ import annotations

import pytest
import xxhash

from kvstore_client.errors import BufferTooSmall
from kvstore.tiers.dram import DramTier
from kvstore.tiers.ssd import SsdTier

KiB = 1 << 10


@pytest.fixture(params=["dram", "ssd"])
def tier(request, tmp_path):
    t = DramTier(256 * KiB) if request.param == "dram" else SsdTier(str(tmp_path / "ssd"), 256 * KiB)
    yield t
    t.close()


def put(tier, key, value: bytes) -> bool:
    return tier.put(key, memoryview(value), xxhash.xxh3_64_intdigest(value))


def k(i):
    return ("ns", bytes([i]) * 16)


def test_round_trip(tier):
    assert put(tier, k(1), b"hello")
    assert tier.get(k(1)) == b"hello"
    out = bytearray(10)
    assert tier.get_into(k(1), memoryview(out)) == 5 and out[:5] == b"hello"
    assert tier.contains(k(1)) and tier.size_of(k(1)) == 5 and len(tier) == 1
    assert tier.get(k(2)) is None and tier.get_into(k(2), memoryview(out)) is None and tier.size_of(k(2)) is None
    assert list(tier.keys()) == [k(1)]


def test_buffer_too_small(tier):
    put(tier, k(1), b"x" * 100)
    with pytest.raises(BufferTooSmall) as err:
        tier.get_into(k(1), memoryview(bytearray(99)))
    assert err.value.needed == 100


def test_replace_and_discard_keep_accounting_exact(tier):
    base = tier.used_bytes
    put(tier, k(1), b"a" * 5000)
    put(tier, k(1), b"b" * 9000)
    assert tier.get(k(1)) == b"b" * 9000 and len(tier) == 1
    grown = tier.used_bytes - base
    assert grown in (9000, -(-9000 // 4096) * 4096)  # payload bytes (SSD) or arena extent (DRAM)
    assert tier.discard(k(1)) and not tier.discard(k(1))
    assert tier.used_bytes == base and len(tier) == 0


def test_full_tier_refuses_and_keeps_contents(tier):
    put(tier, k(1), b"k" * 128 * KiB)
    stored = [put(tier, k(i), b"f" * 64 * KiB) for i in range(2, 6)]
    assert not all(stored)  # it filled up
    assert not put(tier, k(9), b"x" * 300 * KiB)
    assert tier.get(k(1)) == b"k" * 128 * KiB
    assert tier.used_bytes <= tier.capacity_bytes
