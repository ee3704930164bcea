"""Data-plane throughput: one client reading from a node, next to raw baselines.

    python -m bench.dataplane --json

A node (BlockStore with a prefaulted DRAM arena + DataPlaneServer) runs in
this process, as does the raw-socket baseline server, so both compete for
the same two cores and the same GIL. Each round reads every block of the
working set once; rounds of all measures are interleaved (this machine is
noisy) and each figure is the median of ``--repeats`` rounds, each ratio the
median of the per-round ratios:

- ``tcp_get``: TcpConnection.get_into of 1 MiB blocks into one preallocated
  buffer (checksum verified), against ``raw_socket``: a tiny server thread
  that answers a 16-byte request with 1 MiB via sendall, the client
  recv_into's it (rotating over a working set of the same size, so both
  read cold memory);
- ``shm_get``: ShmConnection.get_into of the same blocks, one key per call
  (LEASE round trip, copy, verify, RELEASE), against ``memcpy``:
  numpy.copyto from a cold buffer set of the same size into one buffer;
- ``shm_get_batch16``: get_into_many of 16 keys into 16 buffers, against
  ``memcpy_16dst``: numpy.copyto into the same 16 buffers in turn;
- ``tcp_batch_64k``: get_into_many of 64 KiB blocks in batches of 64, blocks/s.

Targets: tcp_get >= 0.7x raw_socket; shm_get >= 0.6x memcpy; >= 20,000 blocks/s.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import tempfile
import threading
import time

import numpy as np

from bench.common import emit, markdown_table, median_rate
from kvstore.node.config import StoreConfig
from kvstore.node.store import BlockStore
from kvstore.transport.server import DataPlaneServer
from kvstore.units import parse_size
from kvstore_client.transport import ShmConnection, TcpConnection

MiB, KiB = 1 << 20, 1 << 10


class RawServer:
    """The baseline: answers each 16-byte request with ``size`` bytes via sendall, rotating over ``blocks``."""

    def __init__(self, blocks: np.ndarray):
        self.blocks = blocks
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = self.listener.getsockname()[:2]
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        sock, _ = self.listener.accept()
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        request, i = bytearray(16), 0
        with sock:
            while sock.recv_into(request, 16, socket.MSG_WAITALL) == 16:
                sock.sendall(self.blocks[i % len(self.blocks)])
                i += 1


def raw_round(sock: socket.socket, dst: np.ndarray, count: int) -> int:
    view, size = memoryview(dst), dst.nbytes
    for _ in range(count):
        sock.sendall(b"0123456789abcdef")
        got = 0
        while got < size:
            got += sock.recv_into(view[got:], size - got, socket.MSG_WAITALL)
    return count * size


RATIOS = {  # figure: (measure, its baseline), each ratio the median over rounds of the same round's pair
    "tcp_vs_raw": ("tcp_get", "raw_socket"),
    "shm_vs_memcpy": ("shm_get", "memcpy"),
    "shm_batch16_vs_memcpy_16dst": ("shm_get_batch16", "memcpy_16dst"),
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


def fill(store: BlockStore, keys: list, size: int) -> None:
    rng = np.random.default_rng(1)
    for key in keys:
        store.put(key, rng.integers(0, 256, size, dtype=np.uint8))


def bench_1mib(size: int, working_set: int, repeats: int, tmp: str) -> dict:
    count = max(working_set // size, 8)
    keys = [("bench", i.to_bytes(16, "little")) for i in range(count)]
    cold = np.random.default_rng(0).integers(0, 256, (count, size), dtype=np.uint8)
    dst = np.empty(size, dtype=np.uint8)
    config = StoreConfig(dram_capacity=count * size + 64 * MiB, max_block_bytes=size, prefault=True)
    with BlockStore(config) as store, DataPlaneServer(store, unix_path=os.path.join(tmp, "dp.sock")) as server:
        fill(store, keys, size)
        raw = RawServer(cold)
        raw_sock = socket.create_connection(raw.address)
        raw_sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        tcp = TcpConnection(server.address)
        tcp_fast = TcpConnection(server.address, verify=False)
        shm = ShmConnection(server.unix_path)
        batch = 16
        bufs = [np.empty(size, dtype=np.uint8) for _ in range(batch)]

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

        def memcpy() -> int:
            for i in range(count):
                np.copyto(dst, cold[i])
            return count * size

        def memcpy_rotating() -> int:  # the batch's baseline: the same 16 destination buffers
            for i in range(count):
                np.copyto(bufs[i % batch], cold[i])
            return count * size

        measures = {
            "raw_socket": lambda: raw_round(raw_sock, dst, count),
            "tcp_get": each(tcp),
            "tcp_get_noverify": each(tcp_fast),
            "memcpy": memcpy,
            "shm_get": each(shm),
            "memcpy_16dst": memcpy_rotating,
            "shm_get_batch16": shm_batched,
        }
        rates = interleaved(measures, repeats)
        assert shm.get(keys[-1]) == tcp.get(keys[-1]) == store.get(keys[-1])
        for conn in (tcp, tcp_fast, shm):
            conn.close()
        raw_sock.close()
    out = {name: round(statistics.median(r) / 1e9, 3) for name, r in rates.items()}
    for name, (num, den) in RATIOS.items():
        out[name] = round(statistics.median(a / b for a, b in zip(rates[num], rates[den])), 3)
    return out



def bench_batch(size: int, blocks: int, batch: int, repeats: int) -> dict:
    keys = [("bench", i.to_bytes(16, "little")) for i in range(blocks)]
    config = StoreConfig(dram_capacity=blocks * size + 64 * MiB, max_block_bytes=size, prefault=True)
    with BlockStore(config) as store, DataPlaneServer(store) as server:
        fill(store, keys, size)
        bufs = [np.empty(size, dtype=np.uint8) for _ in range(batch)]
        with TcpConnection(server.address) as conn:
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
    batch = bench_batch(64 * KiB, args.batch_blocks, 64, args.repeats)
    result = {
        "size": args.size,
        "single": single,
        "tcp_batch_64k": batch,
        "targets": {
            "tcp_get >= 0.7x raw_socket": single["tcp_vs_raw"] >= 0.7,
            "shm_get (one key per call) >= 0.6x memcpy": single["shm_vs_memcpy"] >= 0.6,
            "shm_get_batch16 >= 0.6x memcpy_16dst": single["shm_batch16_vs_memcpy_16dst"] >= 0.6,
            "tcp_batch_64k >= 20000 blocks/s": batch["blocks_per_s"] >= 20000,
        },
    }
    emit(result, args.json, _table)


def _table(result: dict) -> str:
    s, b = result["single"], result["tcp_batch_64k"]
    rows = [
        ["TCP get_into", s["tcp_get"], "raw socket", s["raw_socket"], s["tcp_vs_raw"]],
        ["shm get_into", s["shm_get"], "memcpy", s["memcpy"], s["shm_vs_memcpy"]],
        ["shm get_into_many (16 keys)", s["shm_get_batch16"], "memcpy into 16 buffers", s["memcpy_16dst"],
         s["shm_batch16_vs_memcpy_16dst"]],
    ]
    text = markdown_table([f"{result['size']} path", "GB/s", "baseline", "GB/s", "ratio"], rows)
    text += (f"\n\nTCP get_into_many of 64 KiB blocks, batches of {b['batch']}: "
             f"{b['blocks_per_s']:,} blocks/s ({b['gbps']} GB/s)")
    text += "\n\n" + "\n".join(f"{name}: {'met' if ok else 'MISSED'}" for name, ok in result["targets"].items())
    return text


if __name__ == "__main__":
    main()
