"""Caller buffers as byte views, and the bytes objects reads that return bytes receive into."""

from __future__ import annotations

import numpy as np
import pytest

from kvstore_client.buffers import byte_view, newly_allocated, receivable_bytes
from kvstore_client.errors import InvalidValue


def test_byte_views_of_any_contiguous_buffer():
    assert bytes(byte_view(b"abc")) == b"abc"
    assert byte_view(np.arange(4, dtype=np.float32)).nbytes == 16
    assert byte_view(np.arange(4, dtype=np.float32)).format == "B"
    assert byte_view(bytearray(8), writable=True).readonly is False
    with pytest.raises(InvalidValue):
        byte_view(b"read-only", writable=True)
    with pytest.raises(InvalidValue):
        byte_view(np.arange(10)[::2])  # not contiguous
    with pytest.raises(InvalidValue):
        byte_view(12345)


def test_receivable_bytes_are_filled_through_their_view():
    for size in (1, 4096, 1 << 20):
        block, view = receivable_bytes(size)
        assert type(block) is bytes and len(block) == size and len(view) == size and not view.readonly
        content = np.random.default_rng(size).bytes(size)
        view[:] = content
        del view
        assert block == content and hash(block) == hash(content)  # an ordinary bytes object
        assert block[: min(size, 5)] == content[:5]


def test_only_receivable_bytes_count_as_newly_allocated():
    _, view = receivable_bytes(4096)
    assert newly_allocated(view)
    assert newly_allocated(view[100:200])
    assert not newly_allocated(byte_view(bytearray(4096), writable=True))
    assert not newly_allocated(byte_view(np.zeros(512, dtype=np.uint64), writable=True))
