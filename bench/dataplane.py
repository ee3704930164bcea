"""Data-plane throughput: one client reading from a node, next to raw baselines.

    python -m bench.dataplane --json

The node (BlockStore with a prefaulted DRAM arena + DataPlaneServer) and the
raw-socket baseline server run in a process of their own
(``bench.node_process``), as in any real deployment: the client never shares
its GIL with them. Each round reads every block of the working set once;
rounds of all measures are interleaved (this machine is noisy), each figure
(``*_gbps``) is the median of ``--repeats`` rounds and each ratio the median
of the per-round ratios of a measure to its baseline:

- ``tcp_get``: TcpConnection.get_into of 1 MiB blocks into one preallocated
  buffer (checksum verified), against ``raw_socket``: a tiny server thread
  in the node's process that answers a 16-byte request with 1 MiB via
  sendall, the client recv_into's it (rotating over a working set of the
  same size, so both read cold memory);
- ``shm_get``: ShmConnection.get_into of the same blocks, one key per call
  (a one-sided read: look the key up in the node's block directory, copy out
  of the arena, validate the slot and the checksum; no round trip), against
  two baselines: ``memcpy``, numpy.copyto from a cold set of anonymous
  buffers of the same size into one buffer (anonymous memory gets
  transparent huge pages), and ``shm_memcpy``, numpy.copyto from a mapping
  of a file in the arena directory (a SharedArena like the node's: 4 KiB
  pages on /dev/shm, huge pages on a tmpfs mounted with huge=within_size,
  see ``KVSTORE_SHM_DIR``) into that buffer: the least work any
  shared-memory read path must do. ``shm_get_vs_memcpy`` says how close a
  read comes to copying between private buffers, ``shm_get_vs_shm_memcpy``
  how much of a read's time is the protocol (lookup, verification, Python)
  rather than the copy itself. ``shm_get_noverify`` is the same read
  validated by the directory slot alone, ``shm_get_leased`` the read that
  asks the node for a lease first (one round trip);
- ``shm_get_batch16``: get_into_many of 16 keys into 16 buffers, against
  ``memcpy_16dst``: numpy.copyto from anonymous buffers into the same 16
  buffers in turn;
- ``tcp_batch_64k``: get_into_many of 64 KiB blocks in batches of 64, blocks/s;
- ``shm_put``: ShmConnection.put of the same blocks (replacing them), and
  ``shm_put_nowait`` with ``wait=False`` (the round ends when the node has
  answered every put), against ``memcpy`` and the floor of any same-host
  put: ``arena_write``, numpy.copyto of each block into the next place of
  a fresh SharedArena (huge pages, as the node's), and ``arena_write_xxh3``,
  the same plus the XXH3-64 of the source that the writer sends along.

Targets: tcp_get >= 0.7x raw_socket; shm_get >= 0.6x memcpy; shm_get_batch16
>= 0.6x memcpy_16dst; tcp_batch_64k >= 20,000 blocks/s.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import tempfile
import time

import numpy as np
import xxhash

from bench.common import emit, markdown_table, median_rate
from bench.node_process import NodeProcess, bench_keys
from kvstore.tiers.arena import SharedArena, on_huge_pages, shm_dir
from kvstore.units import parse_size
from kvstore_client.transport import ShmConnection, TcpConnection

MiB, KiB = 1 << 20, 1 << 10


def raw_round(sock: socket.socket, dst: np.ndarray, count: int) -> int:
    view, size = memoryview(dst), dst.nbytes
    for _ in range(count):
        sock.sendall(b"0123456789abcdef")
        got = 0
        while got < size:
            got += sock.recv_into(view[got:], size - got, socket.MSG_WAITALL)
    return count * size


RATIOS = [  # (measure, its baseline): each ratio the median over rounds of the same round's pair
    ("tcp_get", "raw_socket"),
    ("shm_get", "memcpy"),
    ("shm_get", "shm_memcpy"),
    ("shm_get_noverify", "memcpy"),
    ("shm_get_leased", "memcpy"),
    ("shm_get_batch16", "memcpy_16dst"),
    ("shm_put", "memcpy"),
    ("shm_put_nowait", "memcpy"),
    ("arena_write", "memcpy"),
    ("arena_write_xxh3", "memcpy"),
]


LABELS = {  # what the table calls each measure
    "tcp_get": "TCP get_into",
    "raw_socket": "raw socket",
    "shm_get": "shm get_into",
    "memcpy": "memcpy (anonymous)",
    "shm_memcpy": "memcpy from the arena's tmpfs",
    "shm_get_noverify": "shm get_into, checksum off",
    "shm_get_leased": "shm get_into with a LEASE round trip",
    "shm_get_batch16": "shm get_into_many (16 keys)",
    "memcpy_16dst": "memcpy into 16 buffers",
    "shm_put": "shm put",
    "shm_put_nowait": "shm put, not waited for",
    "arena_write": "copy into fresh arena space",
    "arena_write_xxh3": "the same + XXH3 of the source",
}


def interleaved(measures: dict, repeats: int) -> dict[str, list[float]]:
    """Rates (units/s) of ``repeats`` rounds of every measure, taken in turn so that
    a baseline and its measure see the same machine (this one is noisy)."""
    for fn in measures.values():
        fn()  # warm up: page tables, socket buffers, caches
    rates: dict[str, list[float]] = {name: [] for name in measures}
    for _ in range(repeats):
        for name, fn in measures.items():
            start = time.perf_counter()
            units = fn()
            rates[name].append(units / (time.perf_counter() - start))
    return rates


def copies(sources, dst: np.ndarray, count: int, size: int):
    """A round of numpy.copyto from each of ``sources`` in turn into ``dst``."""

    def run() -> int:
        for i in range(count):
            np.copyto(dst, sources[i])
        return count * size

    return run


def shm_file(blocks: np.ndarray) -> tuple[SharedArena, np.ndarray]:
    """A copy of ``blocks`` in a fresh /dev/shm mapping (SharedArena, as the node's DRAM tier uses)."""
    arena = SharedArena.create(blocks.nbytes)
    view = np.frombuffer(arena.view, dtype=np.uint8, count=blocks.size).reshape(blocks.shape)
    view[:] = blocks
    return arena, view


def bench_1mib(size: int, working_set: int, repeats: int, tmp: str) -> dict:
    count = max(working_set // size, 8)
    keys = bench_keys(count)
    cold = np.random.default_rng(0).integers(0, 256, (count, size), dtype=np.uint8)
    dst = np.empty(size, dtype=np.uint8)
    batch = 16
    bufs = [np.empty(size, dtype=np.uint8) for _ in range(batch)]
    arena, shm_cold = shm_file(cold)
    target = SharedArena.create(2 * count * size, prefault=True)
    places = np.frombuffer(target.view, dtype=np.uint8).reshape(2 * count, size)
    with NodeProcess(size, count, os.path.join(tmp, "dp.sock"), raw=True) as node:
        raw_sock = socket.create_connection(node.info["raw_address"].rsplit(":", 1))
        raw_sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        tcp = TcpConnection(node.info["address"])
        tcp_fast = TcpConnection(node.info["address"], verify=False)
        shm = ShmConnection(node.info["unix_path"])
        shm_noverify = ShmConnection(node.info["unix_path"], verify=False)
        shm_leased = ShmConnection(node.info["unix_path"], one_sided=False)

        def each(conn):
            def run() -> int:
                for key in keys:
                    conn.get_into(key, dst)
                return count * size

            return run

        def shm_batched() -> int:
            for i in range(0, count, batch):
                shm.get_into_many(keys[i : i + batch], bufs[: len(keys[i : i + batch])])
            return count * size

        def memcpy_rotating() -> int:  # the batch's baseline: the same 16 destination buffers
            for i in range(count):
                np.copyto(bufs[i % batch], cold[i])
            return count * size

        def arena_writes(places: np.ndarray, checksum: bool):
            written = [0]

            def run() -> int:  # a fresh place each time, as a put's grant is
                for i in range(count):
                    np.copyto(places[written[0] % len(places)], cold[i])
                    written[0] += 1
                    if checksum:
                        xxhash.xxh3_64_intdigest(cold[i])
                return count * size

            return run

        def puts(wait: bool):
            def run() -> int:
                for key, block in zip(keys, cold):
                    shm.put(key, block, wait=wait)
                shm.flush()
                return count * size

            return run

        measures = {
            "raw_socket": lambda: raw_round(raw_sock, dst, count),
            "tcp_get": each(tcp),
            "tcp_get_noverify": each(tcp_fast),
            "memcpy": copies(cold, dst, count, size),
            "shm_memcpy": copies(shm_cold, dst, count, size),
            "shm_get": each(shm),
            "shm_get_noverify": each(shm_noverify),
            "shm_get_leased": each(shm_leased),
            "memcpy_16dst": memcpy_rotating,
            "shm_get_batch16": shm_batched,
            "shm_put": puts(True),
            "shm_put_nowait": puts(False),
            "arena_write": arena_writes(places, False),
            "arena_write_xxh3": arena_writes(places, True),
        }
        rates = interleaved(measures, repeats)
        check = shm.get(keys[-1])
        assert check is not None and len(check) == size and check == tcp.get(keys[-1])
        for conn in (tcp, tcp_fast, shm, shm_noverify, shm_leased):
            conn.close()
        raw_sock.close()
    del shm_cold, places, measures
    arena.close()
    target.close()
    out = {f"{name}_gbps": round(statistics.median(r) / 1e9, 3) for name, r in rates.items()}
    for num, den in RATIOS:
        out[f"{num}_vs_{den}"] = round(statistics.median(a / b for a, b in zip(rates[num], rates[den])), 3)
    return out


def bench_batch(size: int, blocks: int, batch: int, repeats: int, tmp: str) -> dict:
    keys = bench_keys(blocks)
    bufs = [np.empty(size, dtype=np.uint8) for _ in range(batch)]
    with NodeProcess(size, blocks, os.path.join(tmp, "batch.sock")) as node:
        with TcpConnection(node.info["address"]) as conn:

            def run() -> int:
                for i in range(0, blocks, batch):
                    conn.get_into_many(keys[i : i + batch], bufs)
                return blocks

            run()
            rate = median_rate(run, repeats)
    return {"blocks_per_s": round(rate), "gbps": round(rate * size / 1e9, 3), "batch": batch}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="1MiB", help="block size of the single-block figures")
    parser.add_argument("--working-set", default="64MiB", help="bytes of blocks read per round")
    parser.add_argument("--batch-blocks", type=int, default=2048, help="64 KiB blocks in the batch test")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        single = bench_1mib(parse_size(args.size), parse_size(args.working_set), args.repeats, tmp)
        batch = bench_batch(64 * KiB, args.batch_blocks, 64, args.repeats, tmp)
    result = {
        "size": args.size,
        "arena_dir": shm_dir(),
        "arena_huge_pages": on_huge_pages(shm_dir()),
        "single": single,
        "tcp_batch_64k": batch,
        "targets": {
            "tcp_get >= 0.7x raw_socket": single["tcp_get_vs_raw_socket"] >= 0.7,
            "shm_get (one key per call) >= 0.6x memcpy": single["shm_get_vs_memcpy"] >= 0.6,
            "shm_get_batch16 >= 0.6x memcpy_16dst": single["shm_get_batch16_vs_memcpy_16dst"] >= 0.6,
            "tcp_batch_64k >= 20000 blocks/s": batch["blocks_per_s"] >= 20000,
        },
    }
    emit(result, args.json, _table)


def _table(result: dict) -> str:
    s, b = result["single"], result["tcp_batch_64k"]
    rows = [[LABELS[num], s[f"{num}_gbps"], LABELS[den], s[f"{den}_gbps"], s[f"{num}_vs_{den}"]] for num, den in RATIOS]
    text = markdown_table([f"{result['size']} path", "GB/s", "baseline", "GB/s", "ratio"], rows)
    text += (
        f"\n\nTCP get_into_many of 64 KiB blocks, batches of {b['batch']}: "
        f"{b['blocks_per_s']:,} blocks/s ({b['gbps']} GB/s)"
    )
    text += "\n\n" + "\n".join(f"{name}: {'met' if ok else 'MISSED'}" for name, ok in result["targets"].items())
    return text


if __name__ == "__main__":
    main()
