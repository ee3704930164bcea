"""Security overhead: TCP get_into throughput and connect time with tokens and TLS, against plain.

    python -m bench.security_overhead --json

One storage node (``bench.node_process``: a BlockStore with a prefaulted
DRAM arena, in a process of its own) serves the same ``--blocks`` blocks of
``--size`` bytes from four DataPlaneServers, one per configuration:

- ``plain``: no access file, no TLS;
- ``auth``: an access file, the client holding a tenant token confined to the
  blocks' namespace: the connection's challenge-response at connect time,
  then the namespace check (``Connection.admitted``) on every key it names;
- ``tls``: TLS over TCP (no access file), the client verifying the node's
  certificate against a throwaway CA;
- ``tls_auth``: both.

The CA and the node's certificate (EC P-256, SAN IP 127.0.0.1) and the
access file are made in a temporary directory with the ``cryptography``
package. One TcpConnection per configuration reads the working set with
get_into (one key per call, into one preallocated buffer, checksum verified)
for ``--seconds``; the configurations take turns within each of ``--rounds``
rounds (this machine is noisy), each figure (``*_gbps``) is the median over
rounds and each ratio (``*_vs_plain``) the median of the per-round ratios to
the same round's plain figure. The connect cost is the median time to open
a connection (TCP connect, TLS handshake, AUTH exchange, the INFO every
connection starts with) and close it, over ``--connects`` opens a round
and configuration; ``*_connect_vs_plain`` is its ratio to plain's median.

Targets (from the issue; reported, never enforced): auth costs at most 5%
of 1 MiB TCP get throughput (auth >= 0.95x plain); TLS >= 0.5x plain.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import numpy as np

from bench.common import emit, markdown_table
from bench.node_process import NodeProcess, bench_keys
from kvstore.units import parse_size
from kvstore_client.credentials import Credentials
from kvstore_client.transport import TcpConnection

CONFIGS = ("plain", "auth", "tls", "tls_auth")
ADDRESSES = {"plain": "address", "auth": "auth_address", "tls": "tls_address", "tls_auth": "tls_auth_address"}
LABELS = {"plain": "plain TCP", "auth": "access file + tenant token", "tls": "TLS", "tls_auth": "TLS + tenant token"}
TENANT_TOKEN = "bench-tenant-token-" + "0" * 16
NAMESPACE = bench_keys(1)[0][0]  # the namespace the node's blocks are stored under


def make_certificates(directory: str) -> tuple[str, str, str]:
    """A throwaway CA and a node certificate it signs (bench.pki): the paths of (ca.pem, node.pem, node.key)."""
    from bench.pki import issue, make_ca

    ca = make_ca(directory, "kvstore bench CA")
    cert, key = issue(directory, ca, "node", server=True)
    return str(ca[2]), cert, key


def write_access_file(directory: str) -> str:
    """An access file (mode 0600) with one tenant token confined to the blocks' namespace."""
    path = os.path.join(directory, "access.toml")
    with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
        f.write(f'[tokens.bench]\nsecret = "{TENANT_TOKEN}"\nrole = "tenant"\nnamespaces = ["{NAMESPACE}"]\n')
    return path


def reader(conn: TcpConnection, keys: list, dst: np.ndarray, seconds: float):
    """A measurement: get_into of the working set, over and over, for at least ``seconds``
    (whole blocks, at least one pass); (bytes, elapsed seconds)."""
    size = dst.nbytes

    def run() -> tuple[int, float]:
        done, start = 0, time.perf_counter()
        while True:
            for key in keys:
                if conn.get_into(key, dst) != size:
                    raise RuntimeError(f"block {key!r} is missing or of the wrong size")
                done += size
            elapsed = time.perf_counter() - start
            if elapsed >= seconds:
                return done, elapsed

    return run


def connect_seconds(address: str, credentials: Credentials, count: int) -> list[float]:
    """Seconds each of ``count`` opens (and closes) of a TcpConnection took."""
    times = []
    for _ in range(count):
        start = time.perf_counter()
        TcpConnection(address, credentials=credentials).close()
        times.append(time.perf_counter() - start)
    return times


def measure(size: int, blocks: int, rounds: int, seconds: float, connects: int, tmp: str) -> dict:
    ca, cert, key = make_certificates(tmp)
    access = write_access_file(tmp)
    credentials = {
        "plain": Credentials(),
        "auth": Credentials(token=TENANT_TOKEN),
        "tls": Credentials(tls_ca=ca),
        "tls_auth": Credentials(token=TENANT_TOKEN, tls_ca=ca),
    }
    keys = bench_keys(blocks)
    dst = np.empty(size, dtype=np.uint8)
    extra = ("--access", access, "--tls-cert", cert, "--tls-key", key)
    rates: dict[str, list[float]] = {name: [] for name in CONFIGS}
    opens: dict[str, list[float]] = {name: [] for name in CONFIGS}
    with NodeProcess(size, blocks, os.path.join(tmp, "sec.sock"), extra=extra) as node:
        addresses = {name: node.info[ADDRESSES[name]] for name in CONFIGS}
        conns = {name: TcpConnection(addresses[name], credentials=credentials[name]) for name in CONFIGS}
        try:
            cipher = conns["tls"]._sock.cipher()  # the TLSSocket's SSLSocket: (name, protocol, bits)
            if conns["auth"].token_name != "bench" or conns["tls_auth"].token_name != "bench":
                raise RuntimeError("the authenticated connections did not authenticate as the tenant")
            runs = {name: reader(conns[name], keys, dst, seconds) for name in CONFIGS}
            for name in CONFIGS:  # warm up: page tables, socket buffers, TLS sessions, caches
                reader(conns[name], keys, dst, 0.0)()
                connect_seconds(addresses[name], credentials[name], 1)
            for _ in range(rounds):
                for name in CONFIGS:
                    done, elapsed = runs[name]()
                    rates[name].append(done / elapsed)
                for name in CONFIGS:
                    opens[name] += connect_seconds(addresses[name], credentials[name], connects)
            check = conns["tls_auth"].get(keys[-1])
            if check is None or len(check) != size or check != conns["plain"].get(keys[-1]):
                raise RuntimeError("the TLS + token connection read other bytes than the plain one")
        finally:
            for conn in conns.values():
                conn.close()
    out: dict = {f"{name}_gbps": round(statistics.median(rates[name]) / 1e9, 3) for name in CONFIGS}
    for name in CONFIGS[1:]:
        out[f"{name}_vs_plain"] = round(statistics.median(a / b for a, b in zip(rates[name], rates["plain"])), 3)
    for name in CONFIGS:
        out[f"{name}_connect_ms"] = round(statistics.median(opens[name]) * 1e3, 3)
    for name in CONFIGS[1:]:
        out[f"{name}_connect_vs_plain"] = round(out[f"{name}_connect_ms"] / out["plain_connect_ms"], 2)
    out["tls_cipher"] = f"{cipher[1]} {cipher[0]}" if cipher else None
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="1MiB", help="block size")
    parser.add_argument("--blocks", type=int, default=64, help="blocks in the working set (read in turn)")
    parser.add_argument("--rounds", type=int, default=7, help="interleaved rounds (figures are their medians)")
    parser.add_argument("--seconds", type=float, default=1.0, help="seconds of reading per configuration a round")
    parser.add_argument("--connects", type=int, default=20, help="connections opened per configuration a round")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.blocks < 1 or args.rounds < 1 or args.connects < 1 or not args.seconds >= 0:
        parser.error("--blocks, --rounds and --connects must be positive, --seconds not negative")
    with tempfile.TemporaryDirectory() as tmp:
        figures = measure(parse_size(args.size), args.blocks, args.rounds, args.seconds, args.connects, tmp)
    result = {
        "size": args.size,
        "blocks": args.blocks,
        "rounds": args.rounds,
        "seconds": args.seconds,
        "figures": figures,
        "targets": {
            "auth costs <= 5% of TCP get throughput (auth >= 0.95x plain)": figures["auth_vs_plain"] >= 0.95,
            "tls >= 0.5x plain": figures["tls_vs_plain"] >= 0.5,
        },
    }
    emit(result, args.json, _table)


def _table(result: dict) -> str:
    f = result["figures"]
    rows = [
        [
            LABELS[name],
            f[f"{name}_gbps"],
            "1.0" if name == "plain" else f[f"{name}_vs_plain"],
            f[f"{name}_connect_ms"],
            "1.0" if name == "plain" else f[f"{name}_connect_vs_plain"],
        ]
        for name in CONFIGS
    ]
    text = markdown_table([f"{result['size']} TCP get_into", "GB/s", "vs plain", "connect (ms)", "vs plain"], rows)
    text += f"\n\nTLS cipher: {f['tls_cipher']}"
    text += "\n\n" + "\n".join(f"{name}: {'met' if ok else 'MISSED'}" for name, ok in result["targets"].items())
    return text


if __name__ == "__main__":
    main()
