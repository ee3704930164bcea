"""The connector's worker-side mover against a real pool, on torch tensors shaped like vLLM's
CPU KV caches ([blocks, heads, tokens, 2 x head size] per layer), without an engine."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from kvstore_client import Client  # noqa: E402
from kvstore_client.slices import encode  # noqa: E402
from kvstore_client.vllm.naming import KVLayout, PoolNaming  # noqa: E402
from kvstore_client.vllm.plans import BlockTransfer  # noqa: E402
from kvstore_client.vllm.transfer import LayerwiseTransfers  # noqa: E402
from tests.processes import start_master, start_node, wait_for  # noqa: E402

LAYERS, BLOCKS, SHAPE = 3, 8, (2, 4, 16)


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    master = start_master(ttl=30.0)
    node = start_node(master.record["master"], tmp_path_factory.mktemp("node"))
    yield master.record["master"]
    node.close()
    master.close()


def naming(tag: str) -> PoolNaming:
    layout = KVLayout(
        model=tag,
        revision="",
        kv_dtype="float32",
        block_size=4,
        num_kv_heads=2,
        head_size=8,
        num_layers=LAYERS,
        tp_size=1,
        device="cpu",
        hash_algo="sha256",
    )
    return PoolNaming("test", layout)


def kv_caches(fill: str = "random") -> list:
    make = torch.randn if fill == "random" else torch.zeros
    return [make(BLOCKS, *SHAPE) for _ in range(LAYERS)]


def digests(n: int, tag: str = "h") -> list[bytes]:
    return [f"{tag}-{i}".encode() for i in range(n)]


def save_all(transfers: LayerwiseTransfers, saves: list[BlockTransfer]) -> None:
    for layer in range(LAYERS):
        transfers.save_layer(layer, saves)
    transfers.finish_saves()


def indexed(client: Client, names: PoolNaming, hashes: list[bytes]) -> None:
    """Wait until the master's index has ``hashes`` (it follows the nodes' reports)."""
    wait_for(lambda: client.match_prefix(names.keys(hashes)).longest == len(hashes))


def load_all(transfers: LayerwiseTransfers, loads: list[BlockTransfer]) -> set[int]:
    transfers.start_loads(loads)
    for layer in range(LAYERS):
        transfers.wait_layer(layer)
    return transfers.take_load_failures()


def test_blocks_saved_by_one_engine_load_into_other_block_ids_of_another(pool):
    names, hashes = naming("roundtrip"), digests(3)
    source, target = kv_caches(), kv_caches("zeros")
    with Client(pool) as writer, Client(pool) as reader:
        saver = LayerwiseTransfers(writer, names, source)
        save_all(saver, [BlockTransfer("a", [1, 3, 5], hashes, 0)])
        assert saver.stats.saved == 3 and saver.stats.save_failures == 0  # one value per block
        indexed(reader, names, hashes)
        loader = LayerwiseTransfers(reader, names, target)
        assert load_all(loader, [BlockTransfer("b", [2, 4, 6], hashes, 0)]) == set()
        assert loader.stats.loaded_bytes == 3 * LAYERS * source[0][0].nbytes and loader.stats.load_seconds > 0
        for layer in range(LAYERS):
            for src, dst in ((1, 2), (3, 4), (5, 6)):
                assert torch.equal(source[layer][src], target[layer][dst])
            assert not target[layer][0].any() and not target[layer][7].any()  # nothing else written
        saver.close()
        loader.close()


def test_a_missing_block_is_a_load_error_and_the_rest_load(pool):
    names, hashes = naming("missing"), digests(4, "m")
    source, target = kv_caches(), kv_caches("zeros")
    with Client(pool) as client:
        transfers = LayerwiseTransfers(client, names, source)
        save_all(transfers, [BlockTransfer("a", [0, 1, 2], hashes[:3], 0)])
        assert client.remove(names.keys([hashes[1]])[0])  # evicted since
        loader = LayerwiseTransfers(client, names, target)
        failed = load_all(loader, [BlockTransfer("b", [4, 5, 6, 7], hashes, 0)])
        assert failed == {5, 7}  # hashes[1] (gone) and hashes[3] (never stored)
        assert loader.stats.load_failures == 2  # counted once, at the first layer that misses
        assert all(torch.equal(source[layer][0], target[layer][4]) for layer in range(LAYERS))
        assert all(torch.equal(source[layer][2], target[layer][6]) for layer in range(LAYERS))
        assert loader.take_load_failures() == set()  # reported once
        transfers.close()
        loader.close()


@pytest.mark.parametrize("kind", ["half slabs", "fewer layers", "plain"])
def test_a_stored_value_of_another_shape_is_never_loaded_as_a_block(pool, kind):
    names, hashes = naming(f"sizes-{kind}"), digests(1, "s")
    target = kv_caches("zeros")
    with Client(pool) as client:
        slab = target[0][0].nbytes
        value = {
            "half slabs": encode([b"\x01" * (slab // 2)] * LAYERS),
            "fewer layers": encode([b"\x01" * slab] * (LAYERS - 1)),
            "plain": b"\x01" * slab * LAYERS,
        }[kind]
        client.put(names.keys(hashes)[0], value)
        loader = LayerwiseTransfers(client, names, target)
        assert load_all(loader, [BlockTransfer("b", [3], hashes, 0)]) == {3}
        assert not any(t[3].any() for t in target)
        loader.close()


def test_a_step_that_saved_only_some_layers_stores_nothing(pool):
    names, hashes = naming("partial"), digests(2, "p")
    with Client(pool) as client:
        transfers = LayerwiseTransfers(client, names, kv_caches())
        for layer in range(LAYERS - 1):  # the last layer's attention never ran
            transfers.save_layer(layer, [BlockTransfer("a", [0, 1], hashes, 0)])
        transfers.finish_saves()
        assert transfers.stats.save_failures == 2 and transfers.stats.saved == 0
        assert client.match_prefix(names.keys(hashes)).longest == 0
        transfers.close()


def test_a_rank_that_does_not_save_stores_nothing(pool):
    names, hashes = naming("nosave"), digests(2, "n")
    with Client(pool) as client:
        transfers = LayerwiseTransfers(client, names, kv_caches(), save=False)
        save_all(transfers, [BlockTransfer("a", [0, 1], hashes, 0)])
        assert transfers.stats.saved == 0 and client.match_prefix(names.keys(hashes)).longest == 0
        transfers.close()


def test_an_unreachable_pool_fails_every_load_and_save_without_hanging_or_raising():
    names = naming("down")
    with Client("127.0.0.1:1", timeout=1.0) as client:
        transfers = LayerwiseTransfers(client, names, kv_caches())
        save_all(transfers, [BlockTransfer("a", [0, 1], digests(2), 0)])
        assert transfers.stats.save_failures == 2
        assert load_all(transfers, [BlockTransfer("b", [2, 3], digests(2), 0)]) == {2, 3}
        transfers.close()


def test_waiting_with_nothing_to_load_returns_at_once(pool):
    with Client(pool) as client:
        transfers = LayerwiseTransfers(client, naming("idle"), kv_caches())
        transfers.start_loads([])
        transfers.wait_layer(LAYERS - 1)
        transfers.finish_saves()
        assert transfers.take_load_failures() == set()
        transfers.close()
