"""The connector's data path at the KV geometry of real models, without running them.

For a model's shape per tensor-parallel rank (layers, KV heads, head size, dtype; or MLA's
latent vector) and a block size, against a real pool (master and node processes of their
own, on this host):

- **load** and **save** GB/s of a prompt's KV between KV-shaped tensors and the pool, as the
  connector moves it (``LayerwiseTransfers``: one sliced value per block, a slice per layer;
  saved layer by layer, loaded layer by layer), beside the former format (one value per block
  per layer, each layer a batch of puts or gets, what the connector did before), and one
  ``memcpy`` of the same total bytes (the baseline: libc's, one call, initialised buffers),
  interleaved in the same run;
- **values per 1k tokens** and **bytes a value** of both formats;
- the **master's memory per byte of KV stored**: its anonymous RSS grown over a fill of at
  least ``fill`` bytes of KV (1 GiB by default) into a fresh pool, for each format.

``python -m bench.vllm_reuse --load-path-only --geometry NAME`` runs it (``GEOMETRIES``).
"""

from __future__ import annotations

import ctypes
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

MiB = 1 << 20
GiB = 1 << 30
QUIET_S = 0.1  # pause before each timed run: the pool indexes what the run before stored


@dataclass(frozen=True)
class Geometry:
    """One tensor-parallel rank's KV shape: ``kv_heads`` of ``head_size`` (K and V each) per
    layer, or with ``mla`` one latent vector of ``head_size`` per token, the same on every rank."""

    name: str
    layers: int
    kv_heads: int
    head_size: int
    dtype: str = "bfloat16"
    mla: bool = False
    tp_size: int = 1

    def slab_shape(self, block_size: int) -> tuple[int, ...]:
        """One block of one layer, as vLLM's CPU backend lays it out."""
        if self.mla:
            return (1, block_size, self.head_size)
        return (self.kv_heads, block_size, 2 * self.head_size)

    def slab_bytes(self, block_size: int) -> int:
        itemsize = 4 if self.dtype == "float32" else 2
        n = 1
        for d in self.slab_shape(block_size):
            n *= d
        return n * itemsize


GEOMETRIES = {
    "llama3-8b": Geometry("llama3-8b", layers=32, kv_heads=8, head_size=128),
    "llama3-70b-tp8": Geometry("llama3-70b-tp8", layers=80, kv_heads=1, head_size=128, tp_size=8),
    "deepseek-v3-mla": Geometry("deepseek-v3-mla", layers=61, kv_heads=1, head_size=576, mla=True),
}


class OneMemcpy:
    """The baseline: one libc memcpy of ``total`` bytes between initialised buffers, per call."""

    def __init__(self, total: int):
        self.total = total
        self._src, self._dst = ctypes.create_string_buffer(total), ctypes.create_string_buffer(total)
        ctypes.memset(self._src, 7, total)
        ctypes.memset(self._dst, 1, total)

    def __call__(self) -> None:
        ctypes.memmove(self._dst, self._src, self.total)


def naming_for(geometry: Geometry, block_size: int, tag: str):
    from kvstore_client.vllm.naming import KVLayout, PoolNaming

    layout = KVLayout(
        model=f"bench-{geometry.name}",
        revision=tag,
        kv_dtype=geometry.dtype,
        block_size=block_size,
        num_kv_heads=geometry.kv_heads,
        head_size=geometry.head_size,
        num_layers=geometry.layers,
        tp_size=geometry.tp_size,
        device="cpu",
        hash_algo="sha256",
        mla=geometry.mla,
    )
    return PoolNaming("bench", layout)


class PerLayerValues:
    """The former format, for comparison: one value per block per layer, a batch of puts (not
    waited for, then collected) or gets per layer, straight between slabs and the pool."""

    def __init__(self, client, slabs: list, tag: str):
        self._client, self._slabs, self._tag = client, slabs, tag

    def keys(self, layer: int, hashes: list[bytes]) -> list:
        return [(f"bench/{self._tag}-layer{layer}", h) for h in hashes]

    def save(self, block_ids: list[int], hashes: list[bytes]) -> None:
        for layer, slabs in enumerate(self._slabs):
            self._client.batch_put(self.keys(layer, hashes), [slabs[b] for b in block_ids], wait=False)
        self._client.wait_for_puts()

    def load(self, block_ids: list[int], hashes: list[bytes]) -> None:
        for layer, slabs in enumerate(self._slabs):
            got = self._client.batch_get_into(self.keys(layer, hashes), [slabs[b] for b in block_ids])
            if None in got:
                raise SystemExit("load path: per-layer values missing from the pool")


def transfer_rates(master: str, geometry: Geometry, block_size: int, tokens: int, repeats: int) -> dict:
    """Load and save GB/s of one prompt's KV, both formats, and memcpy: medians, interleaved."""
    import torch

    from kvstore_client import Client
    from kvstore_client.vllm.plans import BlockTransfer
    from kvstore_client.vllm.transfer import LayerSlabs, LayerwiseTransfers, whole_block_layout

    blocks = tokens // block_size
    shape = geometry.slab_shape(block_size)
    dtype = getattr(torch, geometry.dtype)
    source = [torch.randn(2 * blocks, *shape).to(dtype) for _ in range(geometry.layers)]
    target = [torch.zeros(2 * blocks, *shape, dtype=dtype) for _ in range(geometry.layers)]
    total = geometry.slab_bytes(block_size) * blocks * geometry.layers
    hashes = [i.to_bytes(32, "big") for i in range(blocks)]
    stored_ids, loaded_ids = list(range(blocks)), list(range(blocks, 2 * blocks))
    naming = naming_for(geometry, block_size, str(time.time_ns()))
    seconds: dict[str, list[float]] = {
        k: [] for k in ("memcpy", "sliced_save", "sliced_load", "layer_save", "layer_load")
    }
    with Client(master) as client:
        saver = LayerwiseTransfers(client, naming, source)
        loader = LayerwiseTransfers(client, naming, target)
        per_layer_src = PerLayerValues(client, [LayerSlabs(t, whole_block_layout(t)) for t in source], "perlayer")
        per_layer_dst = PerLayerValues(client, [LayerSlabs(t, whole_block_layout(t)) for t in target], "perlayer")

        def sliced_save() -> None:
            for layer in range(geometry.layers):
                saver.save_layer(layer, [BlockTransfer("r", stored_ids, hashes, 0)])
            saver.finish_saves()
            if saver.stats.save_failures:
                raise SystemExit(f"load path: {saver.stats.save_failures} values not stored")

        def sliced_load() -> None:
            loader.start_loads([BlockTransfer("r", loaded_ids, hashes, 0)])
            for layer in range(geometry.layers):
                loader.wait_layer(layer)
            if loader.take_load_failures():
                raise SystemExit("load path: sliced values missing from the pool")

        runs = (
            ("sliced_save", sliced_save),
            ("layer_save", lambda: per_layer_src.save(stored_ids, hashes)),
            ("sliced_load", sliced_load),
            ("layer_load", lambda: per_layer_dst.load(loaded_ids, hashes)),
        )
        one_copy = OneMemcpy(total)
        runs = (("memcpy", one_copy), *runs)
        for _ in range(repeats):
            for name, run in runs:
                time.sleep(QUIET_S)  # the node and master index what the run before stored (memcpy too: the same start)
                start = time.perf_counter()
                run()
                seconds[name].append(time.perf_counter() - start)
                if name == "sliced_load":
                    check_equal(source, target, blocks)
                    for t in target:
                        t.zero_()
        per_layer_dst.load(loaded_ids, hashes)
        check_equal(source, target, blocks)
        saver.close()
        loader.close()
    gbps = {name: total / statistics.median(s) / 1e9 for name, s in seconds.items()}
    return {
        "bytes": total,
        "gbps": gbps,
        **{f"{k}_vs_memcpy": gbps[k] / gbps["memcpy"] for k in seconds if k != "memcpy"},
    }


def check_equal(source: list, target: list, blocks: int) -> None:
    import torch

    for src, dst in zip(source, target):
        if not torch.equal(src[:blocks], dst[blocks:]):
            raise SystemExit("load path: loaded bytes differ from the stored ones")


def master_memory(geometry: Geometry, block_size: int, fill: int, per_layer: bool) -> dict:
    """The master's anonymous RSS grown over storing at least ``fill`` bytes of KV in one format,
    in a pool of its own (master and node processes), per byte of KV."""
    import numpy as np

    from bench.cluster import proc_sample, start_master, start_node
    from kvstore_client import Client

    slab = geometry.slab_bytes(block_size)
    value_bytes = slab if per_layer else slab * geometry.layers
    blocks = -(-fill // (slab * geometry.layers))
    buffer = np.full(slab, 3, dtype=np.uint8)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        master = start_master(work)
        dram = f"{(fill + fill // 2 + 256 * MiB) // MiB}MiB"
        node = start_node(
            master.record["master"], work, "node", dram, "0", f"{max(4 * MiB, 2 * value_bytes) // MiB}MiB"
        )
        try:
            with Client(master.record["master"]) as client:
                client.put(("bench/warm", b"w"), buffer)  # channels, placements and the index's first entries
                time.sleep(1)
                before = proc_sample(master.pid)["rss_anon"]
                naming = naming_for(geometry, block_size, "fill")
                batch = 64
                for first in range(0, blocks, batch):
                    hashes = [i.to_bytes(32, "big") for i in range(first, min(first + batch, blocks))]
                    if per_layer:
                        for layer in range(geometry.layers):
                            keys = [(f"bench/fill-layer{layer}", h) for h in hashes]
                            client.batch_put(keys, [buffer] * len(keys), wait=False)
                        client.wait_for_puts()
                    else:
                        with client.open_objects(naming.keys(hashes), [slab] * geometry.layers) as writer:
                            for layer in range(geometry.layers):
                                writer.write(layer, [buffer] * len(hashes))
                last = [(f"bench/fill-layer{geometry.layers - 1}", (blocks - 1).to_bytes(32, "big"))]
                if not per_layer:
                    last = naming.keys([(blocks - 1).to_bytes(32, "big")])
            with Client(master.record["master"]) as fresh:  # asks the master's index, no cache
                deadline = time.monotonic() + 60
                while not fresh.exists(last[0]) and time.monotonic() < deadline:
                    time.sleep(0.2)
            time.sleep(2)  # the index's last events
            after = proc_sample(master.pid)["rss_anon"]
        finally:
            node.close()
            master.close()
    stored = blocks * geometry.layers * slab
    keys = blocks * (geometry.layers if per_layer else 1)
    return {
        "kv_bytes": stored,
        "keys": keys,
        "master_growth_bytes": after - before,
        "master_bytes_per_key": (after - before) / keys,
        "master_share_of_kv": (after - before) / stored,
    }


def measure(master: str, geometry: Geometry, block_size: int, tokens: int, runs: int, fill: int) -> dict:
    """Every figure of the module docstring for one geometry; transfer rates are medians of
    ``runs`` repeats; the master's memory only with a ``fill`` (bytes)."""
    from kvstore_client.slices import header_len

    slab = geometry.slab_bytes(block_size)
    rates = transfer_rates(master, geometry, block_size, tokens, runs)
    return {
        "geometry": {**vars(geometry), "block_size": block_size},
        "tokens": tokens,
        "slab_bytes": slab,
        "values_per_1k_tokens": {
            "per_layer": round(1000 / block_size * geometry.layers, 1),
            "sliced": round(1000 / block_size, 1),
        },
        "bytes_a_value": {"per_layer": slab, "sliced": slab * geometry.layers + header_len(geometry.layers)},
        "values_per_block_per_rank": {"per_layer": geometry.layers, "sliced": 1},
        "rates": rates,
        **(
            {
                "master": {
                    "per_layer": master_memory(geometry, block_size, fill, per_layer=True),
                    "sliced": master_memory(geometry, block_size, fill, per_layer=False),
                }
            }
            if fill
            else {}
        ),
    }
