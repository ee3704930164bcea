"""KV cache layouts (kvstore_client.vllm.layouts) on CPU tensors with the shapes and strides vLLM
gives each backend: the slabs stored, loaded back through a real pool, and read across layouts
that store the same bytes, or refused with LayoutMismatch where they do not."""

from __future__ import annotations

import pytest
import xxhash

torch = pytest.importorskip("torch")

from kvstore_client import Client, LayoutMismatch  # noqa: E402
from kvstore_client.slices import parse_header  # noqa: E402
from kvstore_client.vllm.layouts import (  # noqa: E402
    KV_CACHE_LAYOUTS,
    describe,
    identify,
    layout_format,
    permuted_strides,
)
from kvstore_client.vllm.naming import VALUE_FORMAT, KVLayout, PoolNaming  # noqa: E402
from kvstore_client.vllm.plans import BlockTransfer  # noqa: E402
from kvstore_client.vllm.transfer import LayerwiseTransfers  # noqa: E402
from tests.processes import start_master, start_node  # noqa: E402

LAYERS, BLOCKS, HEADS, TOKENS, HEAD = 3, 6, 4, 16, 8
# legacy families: (family, logical shape, memory order of the logical axes)
LEGACY = {
    "flash_attn": ("flash_attn", (2, BLOCKS, TOKENS, HEADS, HEAD), (0, 1, 2, 3, 4)),
    "flashinfer-NHD": ("flashinfer", (BLOCKS, 2, TOKENS, HEADS, HEAD), (0, 1, 2, 3, 4)),
    "flashinfer-HND": ("flashinfer", (BLOCKS, 2, TOKENS, HEADS, HEAD), (0, 1, 3, 2, 4)),
}
ALL = [*KV_CACHE_LAYOUTS, *LEGACY]


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    master = start_master(ttl=30.0)
    node = start_node(master.record["master"], tmp_path_factory.mktemp("node"))
    yield master.record["master"]
    node.close()
    master.close()


def caches(name: str, fill=torch.randn, dtype=torch.float32, heads: int = HEADS):
    """(per-layer tensors, their layouts, the block axis) as vLLM would hand them over."""
    if name in KV_CACHE_LAYOUTS:  # one allocation for every layer, [L, B, H, N, C] in the layout's order
        shape = (LAYERS, BLOCKS, heads, TOKENS, 2 * HEAD)
        raw = fill(int(torch.tensor(shape).prod()), dtype=dtype)
        full = torch.as_strided(raw, shape, permuted_strides(shape, KV_CACHE_LAYOUTS[name]))
        views, family, block_axis = [full[i] for i in range(LAYERS)], "vllm", 0
    else:
        family, shape, order = LEGACY[name]
        shape = tuple(heads if n == HEADS else n for n in shape)
        views = [
            torch.as_strided(fill(int(torch.tensor(shape).prod()), dtype=dtype), shape, permuted_strides(shape, order))
            for _ in range(LAYERS)
        ]
        block_axis = shape.index(BLOCKS)
    layouts = [describe(family, v.shape, v.stride(), v.element_size(), str(dtype), HEAD) for v in views]
    return views, layouts, block_axis


def naming(tag: str, block_format: str) -> PoolNaming:
    return PoolNaming(
        "layouts",
        KVLayout(
            model=tag,
            revision="",
            kv_dtype="float32",
            block_size=TOKENS,
            num_kv_heads=HEADS,
            head_size=HEAD,
            num_layers=LAYERS,
            tp_size=1,
            device="cpu",
            hash_algo="sha256",
            block_format=block_format,
        ),
    )


def move(pool: str, tag: str, source: str, target: str, src_blocks=(1, 4), dst_blocks=(0, 5)):
    """Save blocks of a ``source`` layout, load them into a fresh ``target`` layout's tensors."""
    src, src_layouts, src_axis = caches(source)
    dst, dst_layouts, dst_axis = caches(target, fill=torch.zeros)
    fmt = src_layouts[0].format
    names = naming(tag, fmt.name())
    hashes = [f"{tag}-{i}".encode() for i in range(len(src_blocks))]
    with Client(pool) as client:
        saver = LayerwiseTransfers(client, names, src, src_layouts, block_format=fmt)
        for layer in range(LAYERS):
            saver.save_layer(layer, [BlockTransfer("a", list(src_blocks), hashes, 0)])
        saver.finish_saves()
        assert saver.stats.save_failures == 0
        loader = LayerwiseTransfers(client, names, dst, dst_layouts, block_format=fmt)
        loader.start_loads([BlockTransfer("b", list(dst_blocks), hashes, 0)])
        for layer in range(LAYERS):
            loader.wait_layer(layer)
        assert loader.take_load_failures() == set()
        stored = [parse_and_slice(client.get(key), 0) for key in names.keys(hashes)]
        saver.close()
        loader.close()
    return src, src_axis, dst, dst_axis, stored, src_layouts[0]


def parse_and_slice(value: bytes, layer: int) -> bytes:
    """Layer ``layer``'s slice of a stored block (a sliced value: kvstore_client.slices)."""
    table = parse_header(value)
    offset, length = table.span(layer)
    return value[offset : offset + length]


def block(tensors, axis: int, layer: int, b: int):
    return tensors[layer].select(axis, b)


@pytest.mark.parametrize("name", ALL)
def test_layout_blocks_round_trip_through_the_pool(pool, name):
    src, axis, dst, _, stored, layout = move(pool, f"rt-{name}", name, name)
    for layer in range(LAYERS):
        for s, d in ((1, 0), (4, 5)):
            assert torch.equal(block(src, axis, layer, s), block(dst, axis, layer, d))
        for untouched in (1, 2, 3, 4):
            assert not block(dst, axis, layer, untouched).any()
    # what the pool holds of a layer is the block's bytes in the format's order: its axes by stride, outermost first
    view = block(src, axis, 0, 1)
    order = sorted(range(view.dim()), key=lambda i: view.stride(i), reverse=True)
    assert stored[0] == view.permute(order).contiguous().view(torch.uint8).numpy().tobytes()
    assert len(stored[0]) == layout.slab_bytes == HEADS * TOKENS * 2 * HEAD * 4


COMPATIBLE = [
    ("LBHNC", "BLHNC"),
    ("LBHNC", "LHBNC"),
    ("BHLNC", "LBHNC"),
    ("LHBNC", "BHLNC"),
    ("LBNHC", "BLNHC"),
    ("BLNHC", "LBNHC"),
    ("flash_attn", "flashinfer-NHD"),
    ("flashinfer-NHD", "flash_attn"),
]


@pytest.mark.parametrize("source,target", COMPATIBLE)
def test_layout_a_block_stored_from_one_layout_reads_back_into_a_compatible_one(pool, source, target):
    src, src_axis, dst, dst_axis, _, _ = move(pool, f"x-{source}-{target}", source, target)
    for layer in range(LAYERS):
        for s, d in ((1, 0), (4, 5)):
            assert torch.equal(block(src, src_axis, layer, s), block(dst, dst_axis, layer, d))


INCOMPATIBLE = [
    ("LBHNC", "LBNHC"),
    ("BLNHC", "LHBNC"),
    ("LBHNC", "flashinfer-HND"),
    ("flash_attn", "LBNHC"),
    ("flashinfer-HND", "flashinfer-NHD"),
]


@pytest.mark.parametrize("source,target", INCOMPATIBLE)
def test_layout_incompatible_layouts_are_refused_and_never_share_keys(pool, source, target):
    _, src_layouts, _ = caches(source)
    dst, dst_layouts, _ = caches(target, fill=torch.zeros)
    with Client(pool) as client, pytest.raises(LayoutMismatch):
        LayerwiseTransfers(
            client,
            naming("refused", src_layouts[0].format.name()),
            dst,
            dst_layouts,
            block_format=src_layouts[0].format,
        )
    with pytest.raises(LayoutMismatch):
        src_layouts[0].format.check_readable_as(dst_layouts[0].format)
    a, b = naming("same-model", src_layouts[0].format.name()), naming("same-model", dst_layouts[0].format.name())
    assert a.namespace != b.namespace


def test_layout_which_ones_store_blocks_in_one_run():
    one_run = {name: caches(name)[1][0].contiguous_blocks for name in ALL}
    assert one_run == {
        "LBHNC": True,
        "LBNHC": True,
        "BLHNC": True,
        "BLNHC": True,
        "LHBNC": False,
        "BHLNC": False,
        "flash_attn": False,
        "flashinfer-NHD": True,
        "flashinfer-HND": True,
    }
    lhbnc = caches("LHBNC")[1][0]
    assert len(lhbnc.runs(2)) == HEADS and lhbnc.run_bytes == TOKENS * 2 * HEAD * 4


@pytest.mark.parametrize("name", KV_CACHE_LAYOUTS)
def test_layout_format_from_the_configuration_matches_the_tensors(name):
    layout = caches(name, dtype=torch.bfloat16)[1][0]
    assert layout_format(name, HEADS, TOKENS, HEAD, "torch.bfloat16") == layout.format
    assert layout.format.is_canonical() == (name in ("LBHNC", "BLHNC", "LHBNC", "BHLNC"))


def test_layout_strides_are_vllms_own():
    vllm_layouts = pytest.importorskip("vllm.v1.kv_cache_layout")
    from vllm.v1.kv_cache_interface import FullAttentionSpec, compute_layout_strides

    spec = FullAttentionSpec(TOKENS, num_kv_heads=HEADS, head_size=HEAD, dtype=torch.float32)
    for name, order in KV_CACHE_LAYOUTS.items():
        layout = vllm_layouts.KVCacheLayout[name]
        assert layout.stride_order == order
        byte_strides = compute_layout_strides(spec, BLOCKS, LAYERS, layout)  # [L, B, H, N, C bytes]
        ours = permuted_strides((LAYERS, BLOCKS, HEADS, TOKENS, 2 * HEAD), order)
        assert tuple(s // 4 for s in byte_strides[:4]) == ours[:4] and ours[4] == 1


def test_layout_hnd_and_nhd_name_the_layouts_they_alias():
    assert layout_format("HND", HEADS, TOKENS, HEAD, "x") == layout_format("LBHNC", HEADS, TOKENS, HEAD, "x")
    assert layout_format("NHD", HEADS, TOKENS, HEAD, "x") == layout_format("LBNHC", HEADS, TOKENS, HEAD, "x")
    with pytest.raises(LayoutMismatch):
        layout_format("HNLBC", HEADS, TOKENS, HEAD, "x")


def test_layout_with_one_kv_head_heads_first_and_tokens_first_are_the_same_bytes():
    hnc = caches("LBHNC", heads=1)[1][0].format
    assert hnc == caches("LBNHC", heads=1)[1][0].format == caches("BLNHC", heads=1)[1][0].format
    assert hnc.is_canonical()


def test_layout_shapes_are_identified_from_the_kv_spec():
    spec = (BLOCKS, HEADS, TOKENS, HEAD)
    assert identify((BLOCKS, HEADS, TOKENS, 2 * HEAD), *spec) == "vllm"
    assert identify((2, BLOCKS, TOKENS, HEADS, HEAD), *spec) == "flash_attn"
    assert identify((BLOCKS, 2, TOKENS, HEADS, HEAD), *spec) == "flashinfer"
    with pytest.raises(LayoutMismatch):  # blocks split into kernel blocks of 8 tokens: not supported
        identify((2 * BLOCKS, HEADS, TOKENS // 2, 2 * HEAD), *spec)
    with pytest.raises(LayoutMismatch):
        describe(
            "vllm",
            (BLOCKS, HEADS, TOKENS, 2 * HEAD),
            (HEADS * TOKENS * 4 * HEAD, TOKENS * 4 * HEAD, 4 * HEAD, 2),
            4,
            "f",
            HEAD,
        )  # every other element: no axis is dense


def test_layout_the_cpu_backends_keys_carry_no_byte_order_field():
    layout = KVLayout(
        model="m",
        revision="r",
        kv_dtype="torch.float32/auto",
        block_size=16,
        num_kv_heads=2,
        head_size=32,
        num_layers=2,
        tp_size=1,
        device="cpu",
        hash_algo="sha256",
    )
    fields = (VALUE_FORMAT, "m", "r", "torch.float32/auto", 16, 2, 32, 2, 1, 0, "cpu", "sha256")
    assert layout.fingerprint(0) == xxhash.xxh3_64_hexdigest("\x1f".join(map(str, fields)).encode())
