"""The SDK's tuning knobs as Client(...) arguments, each seen to change what the client does,
against a live pool (master and node on loopback sockets in this process)."""

from __future__ import annotations

import asyncio
import inspect
import socket
import time

import pytest

from kvstore_client import AsyncClient, Client
from kvstore_client.errors import ConfigError, TransportError
from kvstore_client.nodes import KnownNodes
from kvstore_client.placements import Placements
from kvstore_client.transport import TcpConnection
from kvstore_client.wire import DEFAULT_REPLY_SPIN_US
from kvstore.benchmark import embedded_pool
from kvstore.configuration_doc import SDK_ARGUMENTS, client_arguments

MiB = 1 << 20


@pytest.fixture(scope="module")
def master():
    with embedded_pool(64 << 20) as address:
        yield address


def _keys(ns: str, n: int) -> list:
    return [(ns, i.to_bytes(16, "big")) for i in range(n)]


def _only_connection(client: Client):
    (conn,) = client._local.conns.values()
    return conn


class _FrameCounter:
    """Counts the request frames a connection sends of each op, and the most sent and not yet
    answered at once (its pipelining depth)."""

    def __init__(self, conn):
        self.sent: dict[int, int] = {}
        self.outstanding = self.deepest = 0
        send, reply = conn._send, conn._reply

        def counted_send(op, *args, **kwargs):
            self.sent[op] = self.sent.get(op, 0) + 1
            self.outstanding += 1
            self.deepest = max(self.deepest, self.outstanding)
            return send(op, *args, **kwargs)

        def counted_reply(*args, **kwargs):
            self.outstanding -= 1
            return reply(*args, **kwargs)

        conn._send, conn._reply = counted_send, counted_reply


def test_the_client_takes_every_documented_knob_and_asyncclient_the_same():
    assert list(client_arguments()) == list(SDK_ARGUMENTS)
    assert inspect.signature(AsyncClient) == inspect.signature(Client)


@pytest.mark.parametrize("window", [1, 3])
def test_a_small_window_and_small_frames_still_move_every_block(master, window):
    from kvstore_client.wire import Op

    with Client(master, data_path="tcp", window=window, keys_per_frame=3) as kv:
        keys = _keys(f"window-{window}", 20)
        values = [bytes([i]) * 1000 for i in range(20)]
        kv.put(keys[0], values[0])  # dials the node
        counter = _FrameCounter(_only_connection(kv))
        kv.batch_put(keys, values)
        assert kv.batch_get(keys) == values
    assert counter.sent[Op.GET] == 7  # 20 keys, 3 a frame
    assert counter.deepest == window  # frames in flight at most


def test_the_default_window_pipelines_two_frames(master):
    with Client(master, data_path="tcp", keys_per_frame=4) as kv:
        keys = _keys("window-default", 12)
        kv.batch_put(keys, [b"v" * 100] * 12)
        counter = _FrameCounter(_only_connection(kv))
        assert kv.batch_get(keys) == [b"v" * 100] * 12
    assert counter.deepest == 2


def test_max_unacked_puts_bounds_the_replies_left_unread(master):
    for limit, most in ((1, 1), (None, 8)):
        options = {} if limit is None else {"max_unacked_puts": limit}
        with Client(master, data_path="tcp", **options) as kv:
            keys = _keys(f"unacked-{limit}", 12)
            seen = 0
            for key in keys:
                kv.put(key, b"x" * 64, wait=False)
                seen = max(seen, len(_only_connection(kv)._unacked))
            kv.wait_for_puts()
            assert seen == most
            assert kv.batch_get(keys) == [b"x" * 64] * 12


def test_reply_spin_comes_from_the_environment_when_the_client_is_built(master, monkeypatch):
    monkeypatch.setenv("KVSTORE_REPLY_SPIN_US", "0")  # after kvstore_client was imported
    kv = Client(master, data_path="tcp")
    monkeypatch.delenv("KVSTORE_REPLY_SPIN_US")  # the connection, made later, does not look again
    with kv:
        kv.put(("spin", b"e" * 16), b"a")
        assert _only_connection(kv)._reader._spin == 0

    kv = Client(master, data_path="tcp")
    monkeypatch.setenv("KVSTORE_REPLY_SPIN_US", "0")  # too late for this client
    with kv:
        kv.put(("spin", b"l" * 16), b"a")
        assert _only_connection(kv)._reader._spin == DEFAULT_REPLY_SPIN_US / 1e6

    with Client(master, data_path="tcp", reply_spin_us=50) as kv:  # the argument wins over the environment
        kv.put(("spin", b"a" * 16), b"a")
        assert _only_connection(kv)._reader._spin == pytest.approx(50e-6)


def test_one_sided_reads_off_leases_every_same_host_read(master):
    from kvstore_client.wire import Op

    for one_sided in (True, False):
        with Client(master, data_path="shm", one_sided_reads=one_sided) as kv:
            key = (f"one-sided-{one_sided}", b"k" * 16)
            kv.put(key, b"z" * 4096)
            conn = _only_connection(kv)
            if not conn.one_sided and one_sided:
                pytest.skip("this machine reads no block directory (ONE_SIDED_READS)")
            counter = _FrameCounter(conn)
            assert kv.get(key) == b"z" * 4096
            assert conn.one_sided is one_sided
            assert (Op.LEASE in counter.sent) is not one_sided


def test_location_cache_size_bounds_the_keys_remembered(master):
    with Client(master, location_cache_size=2) as kv:
        keys = _keys("cache-size", 5)
        kv.batch_put(keys, [b"c"] * 5)
        assert sum(r is not None for r in kv._locations.lookup(keys)) == 2
        assert kv.batch_get(keys) == [b"c"] * 5


def test_data_timeout_reaches_the_connection_and_bounds_a_silent_node(master):
    with Client(master, data_path="tcp", data_timeout=3.5) as kv:
        kv.put(("timeout", b"t" * 16), b"a")
        assert _only_connection(kv)._sock.gettimeout() == 3.5
    with socket.create_server(("127.0.0.1", 0)) as silent:  # accepts (backlog), never answers INFO
        started = time.monotonic()
        with pytest.raises(TransportError):
            TcpConnection(f"127.0.0.1:{silent.getsockname()[1]}", timeout=0.2)
        assert time.monotonic() - started < 5


def test_placement_growth_caps_a_fast_writers_placements():
    never = lambda *a: None  # noqa: E731
    assert Placements(never, never, never, 1.0, MiB).next_size(used=1 << 30, elapsed=0.001) == 16 * MiB
    assert Placements(never, never, never, 1.0, MiB, growth=2).next_size(used=1 << 30, elapsed=0.001) == 2 * MiB


def test_node_refresh_interval_spaces_the_refreshes(master):
    asked = []

    def live():
        asked.append(1)
        return []

    with Client(master, node_refresh_interval=0) as kv:
        node = type("Info", (), {"node_id": "n"})()
        kv._nodes.refresh(node, live)
        kv._nodes.refresh(node, live)
    assert len(asked) == 2
    slow = KnownNodes()  # the default: once a second at most
    slow.refresh(node, live)
    slow.refresh(node, live)
    assert len(asked) == 3


@pytest.mark.parametrize(
    "bad", [{"window": 0}, {"keys_per_frame": 0}, {"max_unacked_puts": -1}, {"reply_spin_us": -5}, {"window": 1.5}]
)
def test_a_knob_that_cannot_work_is_refused(master, bad):
    with pytest.raises(ConfigError):
        Client(master, **bad)


def test_asyncclient_takes_the_knobs(master):
    async def run():
        async with AsyncClient(master, data_path="tcp", window=1, keys_per_frame=2) as kv:
            keys = _keys("async-tuning", 9)
            await kv.batch_put(keys, [b"q" * 10] * 9)
            return await kv.batch_get(keys)

    assert asyncio.run(run()) == [b"q" * 10] * 9
