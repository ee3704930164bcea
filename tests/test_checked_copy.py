"""Copies out of an arena that compute the block's XXH3-64 as they go: the same checksum as
hashing the whole block, every byte copied, and any damaged byte, in any chunk, noticed."""

from __future__ import annotations

import os

import pytest
import xxhash

from kvstore_client.checked_copy import CHUNK, copy_verified, copy_with_checksum

SIZES = [1, 4096, CHUNK - 1, CHUNK, CHUNK + 1, 2 * CHUNK, 3 * CHUNK + 12345]


@pytest.mark.parametrize("size", SIZES)
def test_the_checksum_is_the_whole_blocks_and_every_byte_is_copied(size):
    src = os.urandom(size)
    dst = bytearray(size)
    assert copy_with_checksum(memoryview(dst), memoryview(src)) == xxhash.xxh3_64_intdigest(src)
    assert dst == src


@pytest.mark.parametrize("where", ["first", "last of a chunk", "first of the next", "last"])
def test_a_damaged_byte_anywhere_fails_verification(where):
    size = 2 * CHUNK + 777
    good = os.urandom(size)
    checksum = xxhash.xxh3_64_intdigest(good)
    at = {"first": 0, "last of a chunk": CHUNK - 1, "first of the next": CHUNK, "last": size - 1}[where]
    damaged = bytearray(good)
    damaged[at] ^= 0x01
    dst = bytearray(size)
    assert not copy_verified(memoryview(dst), memoryview(damaged), checksum, verify=True)
    assert copy_verified(memoryview(dst), memoryview(good), checksum, verify=True) and dst == good


def test_without_verification_it_copies_and_trusts():
    src, dst = os.urandom(CHUNK + 5), bytearray(CHUNK + 5)
    assert copy_verified(memoryview(dst), memoryview(src), checksum=0, verify=False)
    assert dst == src
