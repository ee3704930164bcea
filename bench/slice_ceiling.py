"""How fast one Python thread can move and check slices at all: the floor under the connector's
load path (``bench.load_path``), without a pool or any bookkeeping.

For slices of ``--slice`` bytes laid out as sliced values in one anonymous mapping (a value per
block, a slice per layer), each slice of each layer is hashed (XXH3-64) then copied into a
block's slab, the two steps every checked read makes; beside it, the copy alone, the hash
alone, and one ``memcpy`` of all the bytes (libc's, one call): GB/s, medians.

``python -m bench.slice_ceiling --slice 8192 --layers 80 --blocks 128``
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import statistics
import time

import xxhash

from bench.common import emit


def measure(slice_bytes: int, layers: int, blocks: int, repeats: int) -> dict:
    value = slice_bytes * layers + 4096
    total = slice_bytes * layers * blocks
    arena = mmap.mmap(-1, value * blocks)
    ctypes.memset(ctypes.addressof(ctypes.c_char.from_buffer(arena)), 3, value * blocks)
    src = memoryview(arena)
    dst_buf = bytearray(total)
    ctypes.memset(ctypes.addressof(ctypes.c_char.from_buffer(dst_buf)), 1, total)
    dst = memoryview(dst_buf)
    values = [src[b * value + 4096 : (b + 1) * value] for b in range(blocks)]
    slabs = [
        [dst[(layer * blocks + b) * slice_bytes : (layer * blocks + b + 1) * slice_bytes] for b in range(blocks)]
        for layer in range(layers)
    ]
    h = xxhash.xxh3_64_intdigest

    def hash_then_copy() -> None:
        for layer in range(layers):
            start, end, out = layer * slice_bytes, (layer + 1) * slice_bytes, slabs[layer]
            for b in range(blocks):
                piece = values[b][start:end]
                h(piece)
                out[b][:] = piece

    def copy_only() -> None:
        for layer in range(layers):
            start, end, out = layer * slice_bytes, (layer + 1) * slice_bytes, slabs[layer]
            for b in range(blocks):
                out[b][:] = values[b][start:end]

    def hash_only() -> None:
        for layer in range(layers):
            start, end = layer * slice_bytes, (layer + 1) * slice_bytes
            for b in range(blocks):
                h(values[b][start:end])

    one = ctypes.create_string_buffer(total)
    ctypes.memset(one, 2, total)

    def memcpy() -> None:
        ctypes.memmove(ctypes.addressof(ctypes.c_char.from_buffer(dst_buf)), one, total)

    runs = {"hash_then_copy": hash_then_copy, "copy_only": copy_only, "hash_only": hash_only, "memcpy": memcpy}
    seconds: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            seconds[name].append(time.perf_counter() - start)
    gbps = {name: total / statistics.median(s) / 1e9 for name, s in seconds.items()}
    return {
        "slice_bytes": slice_bytes,
        "bytes": total,
        "gbps": gbps,
        "hash_then_copy_vs_memcpy": gbps["hash_then_copy"] / gbps["memcpy"],
    }


def table(result: dict) -> str:
    g = result["gbps"]
    return (
        f"{result['bytes'] >> 20} MiB in {result['slice_bytes']} B slices: hash then copy {g['hash_then_copy']:.2f} GB/s "
        f"({result['hash_then_copy_vs_memcpy']:.2f}x memcpy), copy only {g['copy_only']:.2f}, hash only "
        f"{g['hash_only']:.2f}, one memcpy {g['memcpy']:.2f}"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--slice", type=int, default=8192)
    parser.add_argument("--layers", type=int, default=80)
    parser.add_argument("--blocks", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    emit(measure(args.slice, args.layers, args.blocks, args.repeats), args.json, table)


if __name__ == "__main__":
    main()
