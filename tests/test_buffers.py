"""Caller buffers as byte views, and the receive space reads that return bytes reuse."""

from __future__ import annotations

import numpy as np
import pytest

from kvstore_client.buffers import LANDING_MAX, LandingBuffer, byte_view
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


def test_landing_space_is_reused_and_grows_to_what_a_round_needed():
    landing = LandingBuffer()
    first = landing.take(1000)  # nothing kept yet: a fresh buffer
    first[:] = b"x" * 1000
    landing.reset()  # now it keeps 1000 bytes
    a, b = landing.take(600), landing.take(400)
    a[:], b[:] = b"a" * 600, b"b" * 400
    assert a.obj is b.obj and len(a.obj) == 1000  # both from the kept space, side by side
    assert bytes(a) == b"a" * 600 and bytes(b) == b"b" * 400
    c = landing.take(10)  # full: a fresh buffer, and the next round keeps more
    assert c.obj is not a.obj
    landing.reset()
    assert len(landing.take(1010).obj) == 1010  # the kept space grew to the whole last round


def test_landing_space_grows_to_every_block_of_a_round_that_did_not_fit():
    landing = LandingBuffer()
    for _ in range(3):
        landing.take(100)  # all three fresh: nothing kept yet
    landing.reset()
    views = [landing.take(100) for _ in range(3)]
    assert all(v.obj is views[0].obj for v in views) and len(views[0].obj) == 300


def test_landing_space_kept_is_bounded():
    landing = LandingBuffer()
    landing.take(LANDING_MAX + 1)
    landing.reset()
    assert len(landing.take(1).obj) == 1  # too big to keep: still fresh buffers
