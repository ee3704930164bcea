"""The SDK when things go wrong around it: holders that die under a remove, batch puts that
run out of room half way, calls on a closed client, and the connections a long-lived client
holds while nodes close, die and come back and while its threads come and go."""

from __future__ import annotations

import asyncio
import inspect

import pytest

from kvstore_client import AsyncClient, BlockHasher, CapacityError, Client, ClientClosed, KVStoreError
from kvstore_client.errors import ServiceUnavailable
from tests.conftest import run_in_threads, value_for
from tests.processes import start_master, start_node, wait_for

KiB, MiB = 1 << 10, 1 << 20


def _pool(tmp_path, dram: int, max_block: int, idle_timeout: float | None = 300.0, high_watermark: float = 0.95):
    """A master and one node in this process; (master, node)."""
    from kvstore.master.server import MasterServer
    from kvstore.node.config import ConnectionLimits, StoreConfig
    from kvstore.node.daemon import NodeOptions, StorageNode

    master = MasterServer(port=0, ttl_s=5.0, heartbeat_interval_s=0.5).start()
    config = StoreConfig(
        dram_capacity=dram,
        max_block_bytes=max_block,
        high_watermark=high_watermark,
        low_watermark=min(0.85, high_watermark),
        connections=ConnectionLimits(idle_timeout=idle_timeout),
    )
    node = StorageNode(config, NodeOptions(master=master.address, data_dir=str(tmp_path / "n"))).start()
    return master, node


# -- 1. remove with a holder just killed ------------------------------------------------------------
def test_remove_skips_a_dead_holder_and_is_unavailable_only_when_every_holder_is(tmp_path):
    """Two copies of each block; one holder is SIGKILLed (its lease is long, so the master still
    names it): remove drops the copy it can reach and says True instead of raising. With both
    holders dead nothing can be removed, and the caller cannot tell what is left: ServiceUnavailable."""
    master = start_master(ttl=60.0, replicas=2)
    nodes = [start_node(master.record["master"], tmp_path / f"n{i}", ssd="0") for i in range(2)]
    try:
        with Client(master.record["master"], data_path="tcp") as client:
            wait_for(lambda: sum(n.alive for n in client.cluster_status().nodes) == 2)
            keys = [("rm", bytes([i]) * 16) for i in range(2)]
            client.batch_put(keys, [value_for(k, 8 * KiB) for k in keys])
            wait_for(lambda: all(len(r) == 2 for r in client._locate(keys, use_cache=False)))
            assert client.get(keys[0]) is not None  # both nodes dialled: the client holds connections to both
            nodes[0].kill()
            assert client.remove(keys[0]) is True  # the survivor's copy went
            assert client.get(keys[0]) is None
            assert client.remove(("rm", b"\xee" * 16)) is False  # nobody holds it: nothing to reach
            nodes[1].kill()
            with pytest.raises(ServiceUnavailable):
                client.remove(keys[1])
    finally:
        for service in [*nodes, master]:
            service.close()


# -- 2. a batch put that runs out of room ------------------------------------------------------------
@pytest.mark.parametrize("data_path", ["tcp", "shm"])
def test_a_batch_put_out_of_room_says_which_blocks_it_stored(tmp_path, data_path):
    """A batch twice the size of the node's DRAM (no SSD): the node stores what fits and refuses
    the rest. The error is still a CapacityError, and names both parts, so the caller retries
    only what was not stored. (No eviction at a high watermark: a full DRAM would otherwise drop
    a block of the retry in the background before it is read back.)"""
    master, node = _pool(tmp_path, dram=4 * MiB, max_block=MiB, high_watermark=1.0)
    try:
        with Client(master.address, data_path=data_path) as client:
            keys = [(f"full-{data_path}", bytes([i]) * 16) for i in range(8)]
            values = [value_for(k, MiB) for k in keys]
            with pytest.raises(CapacityError) as raised:
                client.batch_put(keys, values)
            error = raised.value
            stored = list(error.stored)
            refused = [key for key, _, _ in error.failures]
            assert stored and refused
            assert sorted(stored + refused) == sorted(keys)  # every key in exactly one of them
            assert all(node_id == node.node_id and isinstance(e, CapacityError) for _, node_id, e in error.failures)
            assert f"{len(stored)} of {len(keys)}" in str(error)
            assert all(client.get(k) is None for k in refused)
            for k in stored:
                client.remove(k)
            client.batch_put(refused, [values[keys.index(k)] for k in refused])  # room again: the rest goes in
            assert client.batch_get(refused) == [values[keys.index(k)] for k in refused]
    finally:
        node.stop()
        master.stop()


# -- 3. calls on a closed client ----------------------------------------------------------------------
def _arguments(function, hasher: BlockHasher) -> dict:
    """Plausible arguments for each required parameter of a public call, by name (a new call
    with a parameter not named here fails the test: add it)."""
    key = ("closed", b"k" * 16)
    known = {
        "key": key,
        "keys": [key],
        "value": b"v",
        "values": [b"v"],
        "buffer": bytearray(8),
        "buffers": [bytearray(8)],
        "hasher": hasher,
        "tokens": list(range(8)),
        "blocks": [b"v", b"v"],
        "input_length": 8,
        "namespace": "closed",
        "engine_id": "e",
        "role": "prefill",
        "node_id": "n",
        "request_id": "r",
        "stage": "cancelled",
        "ranges": [(0, 1)],
        "slice_lengths": [8],
    }
    arguments = {}
    for name, parameter in inspect.signature(function).parameters.items():
        if (
            name == "self"
            or parameter.default is not parameter.empty
            or parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD)
        ):
            continue
        assert name in known, f"{function.__qualname__}: no test argument for {name!r}"
        arguments[name] = known[name]
    return arguments


def _public_calls(cls) -> list[str]:
    return sorted(
        name
        for name, member in inspect.getmembers(cls, inspect.isfunction)
        if not name.startswith("_") and name != "close"
    )


def test_every_call_on_a_closed_client_raises_client_closed(tmp_path):
    master, node = _pool(tmp_path, dram=8 * MiB, max_block=MiB)
    hasher = BlockHasher("closed", 4)
    try:
        client = Client(master.address)
        client.put(("closed", b"a" * 16), b"v")  # connections open, then closed under it
        client.close()
        client.close()  # again: nothing to do, no error
        calls = [(name, getattr(client, name)) for name in _public_calls(Client)]
        calls += [
            (f"scheduling.{name}", getattr(client.scheduling, name)) for name in _public_calls(type(client.scheduling))
        ]
        assert len(calls) > 15 and issubclass(ClientClosed, KVStoreError)
        for _name, method in calls:
            with pytest.raises(ClientClosed):
                method(**_arguments(method, hasher))

        async def scenario() -> list[str]:
            aclient = AsyncClient(master.address)
            await aclient.put(("closed", b"b" * 16), b"v")
            await aclient.close()
            await aclient.close()
            names = _public_calls(AsyncClient)
            for name in names:
                method = getattr(aclient, name)
                with pytest.raises(ClientClosed):
                    await method(**_arguments(method, hasher))
            return names

        assert "get" in asyncio.run(scenario())
    finally:
        node.stop()
        master.stop()


# -- 4. the connections a client holds ----------------------------------------------------------------
def test_a_client_holds_one_connection_per_node_however_often_it_redials(tmp_path):
    """The node closes idle connections; each read after that finds its connection dead and
    dials again. The client keeps only the live one, and the dead ones are closed."""
    master, node = _pool(tmp_path, dram=8 * MiB, max_block=MiB, idle_timeout=0.2)
    try:
        with Client(master.address, data_path="tcp") as client:
            key = ("redial", b"r" * 16)
            client.put(key, b"value")
            seen = []
            for _ in range(12):
                assert client.get(key) == b"value"
                seen.extend(c for c in client._all_connections if c not in seen)
                wait_for(lambda: node.server.connections == 0)  # the node closed it: the next read redials
            assert len(seen) >= 12  # it did redial
            assert len(client._all_connections) <= 1
            assert all(c.closed for c in seen[:-1])
    finally:
        node.stop()
        master.stop()


def test_the_connections_of_threads_that_ended_are_closed_and_let_go(tmp_path):
    master, node = _pool(tmp_path, dram=8 * MiB, max_block=MiB)
    try:
        with Client(master.address, data_path="tcp") as client:
            key = ("threads", b"t" * 16)
            client.put(key, b"value")
            opened = []

            def read(_: int) -> None:
                assert client.get(key) == b"value"
                opened.extend(client._local.conns.values())

            for _ in range(3):
                assert run_in_threads(read, 8) == []
            assert len(opened) == 24
            wait_for(lambda: len(client._all_connections) == 1)  # this thread's own
            assert all(c.closed for c in opened)
            wait_for(lambda: node.server.connections == 1)
    finally:
        node.stop()
        master.stop()
