"""The sliced value format (kvstore_client.slices): tables, checksums, and the streaming hasher
that every receiver and copier uses, against the one-shot function, on plain, sliced and
damaged values cut at every kind of boundary."""

from __future__ import annotations

import random

import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore_client.errors import InvalidValue
from kvstore_client.slices import (
    FLIP,
    MAGIC,
    ValueHasher,
    header_len,
    layout,
    pack_header,
    parse_header,
    value_checksum,
)


def sliced(parts: list[bytes]) -> bytes:
    table = layout([len(p) for p in parts])
    return pack_header(table, [xxhash.xxh3_64_intdigest(p) for p in parts]) + b"".join(parts)


def streamed(value: bytes, cuts: list[int]) -> int:
    hasher = ValueHasher(len(value))
    at = 0
    for cut in sorted(set(c for c in cuts if 0 < c < len(value))) + [len(value)]:
        hasher.update(memoryview(value)[at:cut])
        at = cut
    return hasher.intdigest()


def test_a_table_lays_slices_after_an_aligned_header():
    table = layout([100, 8192, 1])
    assert table.header_len == header_len(3) == 64
    assert table.offsets == (64, 164, 8356) and table.size == 8357
    assert table.span(1, 2) == (164, 8193)
    assert header_len(80) == 1024  # 16 + 80 x 12 = 976, padded


def test_layout_refuses_what_cannot_be_a_sliced_value():
    for lengths in ([], [0], [5, -1], [1 << 32], [1.5]):
        with pytest.raises(InvalidValue):
            layout(lengths)
    with pytest.raises(InvalidValue):
        layout([4, 4]).span(1, 2)
    with pytest.raises(InvalidValue):
        pack_header(layout([4, 4]), [1])


def test_a_sliced_value_checks_as_its_header_and_parses_back():
    parts = [random.randbytes(n) for n in (10, 4096, 7)]
    value = sliced(parts)
    table = parse_header(value)
    assert table is not None and table.checksums == tuple(xxhash.xxh3_64_intdigest(p) for p in parts)
    assert value_checksum(value) == xxhash.xxh3_64_intdigest(value[: table.header_len])
    assert value_checksum(value) != xxhash.xxh3_64_intdigest(value)
    for i, part in enumerate(parts):
        offset, length = table.span(i)
        assert value[offset : offset + length] == part


def test_a_plain_value_checks_as_its_bytes():
    for value in (b"x", b"KVS", MAGIC, MAGIC + bytes(60), random.randbytes(5000)):
        assert value_checksum(value) == xxhash.xxh3_64_intdigest(value)
        assert parse_header(value) is None


def test_damage_anywhere_in_a_sliced_value_changes_its_checksum():
    value = sliced([random.randbytes(n) for n in (300, 301, 302)])
    good = value_checksum(value)
    for at in list(range(0, 64)) + [64, 200, 364, 665, len(value) - 1]:
        damaged = bytearray(value)
        damaged[at] ^= 0x40
        assert value_checksum(bytes(damaged)) != good, at
        assert streamed(bytes(damaged), [7, 100, 500]) != good, at


def test_a_damaged_slice_flips_the_header_hash():
    value = bytearray(sliced([b"a" * 64, b"b" * 64]))
    value[-1] ^= 1
    header = bytes(value[:64])
    assert value_checksum(bytes(value)) == xxhash.xxh3_64_intdigest(header) ^ FLIP


def test_a_table_that_does_not_add_up_is_a_plain_value():
    value = sliced([b"a" * 10, b"b" * 10])
    for tampered in (value + b"extra", value[:-1]):
        assert parse_header(tampered) is None
        assert value_checksum(tampered) == xxhash.xxh3_64_intdigest(tampered)


@settings(max_examples=300, deadline=None)
@given(
    st.one_of(
        st.binary(max_size=300),
        st.lists(st.binary(min_size=1, max_size=200), min_size=1, max_size=12).map(sliced),
    ),
    st.lists(st.integers(min_value=0, max_value=3000), max_size=8),
    st.integers(min_value=-1, max_value=3000),
)
def test_the_streaming_hasher_agrees_with_value_checksum(value, cuts, flip_at):
    if 0 <= flip_at < len(value):
        damaged = bytearray(value)
        damaged[flip_at] ^= 1
        value = bytes(damaged)
    assert streamed(value, cuts) == value_checksum(value)
