"""ExtentAllocator: no overlaps, exact accounting, full coalescing."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings, strategies as st

from kvstore.tiers.allocator import ExtentAllocator, _bin_ceil, _bin_floor

GRANULE = 4096


def check_disjoint(alloc: ExtentAllocator, live: dict[int, int]) -> None:
    spans = sorted((off, off + alloc.extent_size(size)) for off, size in live.items())
    for (_, end), (start, _) in zip(spans, spans[1:]):
        assert end <= start
    assert all(0 <= s and e <= alloc.capacity for s, e in spans)
    assert alloc.allocated_bytes == sum(alloc.extent_size(s) for s in live.values())


def test_bins_are_safe_for_good_fit():
    """Every extent in bin _bin_ceil(n) or above holds n granules."""
    smallest = {}
    for m in range(1, 1 << 16):
        smallest.setdefault(_bin_floor(m), m)
    for n in range(1, 1 << 15):
        assert smallest[_bin_ceil(n)] >= n


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 300_000)), max_size=300), st.integers(0, 2**32))
def test_random_alloc_free(ops, seed):
    rng = random.Random(seed)
    alloc = ExtentAllocator(8 << 20, GRANULE)
    live: dict[int, int] = {}
    for is_free, size in ops:
        if is_free and live:
            off = rng.choice(sorted(live))
            alloc.free(off, live.pop(off))
        else:
            off = alloc.alloc(size)
            if off is None:
                assert alloc.free_bytes < alloc.extent_size(size) or alloc.largest_free_extent() < alloc.extent_size(
                    size
                )
            else:
                assert off % GRANULE == 0 and off not in live
                live[off] = size
        check_disjoint(alloc, live)
    for off, size in list(live.items()):
        alloc.free(off, size)
    assert alloc.allocated_bytes == 0 and alloc.free_extent_count() == 1
    assert alloc.largest_free_extent() == alloc.capacity and alloc.fragmentation() == 0.0


def test_fills_exactly_and_rejects_beyond():
    alloc = ExtentAllocator(1 << 20, GRANULE)
    offsets = [alloc.alloc(GRANULE) for _ in range(256)]
    assert None not in offsets and alloc.free_bytes == 0
    assert alloc.alloc(1) is None
    alloc.free(offsets[10], GRANULE)
    assert alloc.alloc(GRANULE) == offsets[10]
    assert alloc.alloc(2 << 20) is None and alloc.alloc(0) is None


def test_fragmentation_is_measured():
    alloc = ExtentAllocator(1 << 20, GRANULE)
    offsets = [alloc.alloc(GRANULE) for _ in range(256)]
    for off in offsets[::2]:
        alloc.free(off, GRANULE)
    assert alloc.free_bytes == 512 << 10
    assert alloc.largest_free_extent() == GRANULE
    assert alloc.fragmentation() == pytest.approx(1 - GRANULE / (512 << 10))
    assert alloc.alloc(2 * GRANULE) is None  # free but scattered
