"""A steady mixed workload for N minutes, and whether every process's footprint stays flat.

    python -m bench.soak --minutes N [--clients K] [--interval S] [--json]

Starts a master and two storage nodes (32 MiB DRAM and 64 MiB SSD each) as processes of
their own, and a client process in which ``--clients`` SDK ``Client``s (one thread each)
loop over: put (35%), get (35%, the value checked against the one its key always has),
prefix match of a chain of 8 keys (15%), exists (5%), remove (10%), on a working set of
1024 keys x 128-256 KiB (about 192 MiB: three times the pool's DRAM, so eviction and
demotion to SSD, and eviction from SSD, run all the time).

Every ``--interval`` seconds each process (master, node-1, node-2, the client process) is
sampled from /proc/PID/status and /proc/PID/fd: RSS split into anonymous (RssAnon), file
(RssFile) and shared (RssShmem, the nodes' DRAM arenas) memory, open fds and threads.

Verdict, per process and per series (rss_anon, rss_file, fds, threads; not RssShmem, which
is the arena filling up to its configured size): the least-squares slope over the samples of
the second half of the run (the first half is warm-up), times the length of that half, is
the growth the trend predicts across it. "flat" when that is under FLAT_BYTES (16 MiB) or
FLAT_FRACTION (5%) of the series' mean, whichever is larger, for memory, and under 2 for fds
and threads. "flat after warm-up" when every process's every series is. Also reported: ops
per kind, gets that found nothing (evicted or removed: expected), wrong values and errors
(must be 0).
"""

from __future__ import annotations

import argparse
import collections
import json
import multiprocessing
import random
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench.cluster import proc_sample, reap_arenas, slope, start_master, start_node

KiB, MiB = 1 << 10, 1 << 20
KEYS, CHAIN = 1024, 8
FLAT_BYTES, FLAT_FRACTION, FLAT_COUNT = 16 * MiB, 0.05, 2
SERIES = ("rss_anon", "rss_file", "rss_shmem", "fds", "threads")
JUDGED = ("rss_anon", "rss_file", "fds", "threads")


def value_of(i: int) -> bytes:
    """The one value key ``i`` ever has: 128-256 KiB of a pattern of its index."""
    size = 128 * KiB + (i * 7919 % 128) * KiB
    return (i.to_bytes(4, "little") * 8 + bytes(range(256))[:32]) * (size // 64)


def client_process(master: str, clients: int, seed: int, stop, out) -> None:
    """``clients`` SDK Clients in threads doing the mixed workload until ``stop``."""
    from kvstore_client import Client, make_keys

    keys = make_keys("soak", [i.to_bytes(16, "little") for i in range(KEYS)])
    index = {k: i for i, k in enumerate(keys)}
    counts = collections.Counter()
    errors: list[str] = []
    lock = threading.Lock()

    def work(n: int) -> None:
        rng = random.Random(seed * 100 + n)
        local = collections.Counter()
        client = Client(master)
        try:
            while not stop.is_set():
                r = rng.random()
                i = rng.randrange(KEYS)
                try:
                    if r < 0.35:
                        client.put(keys[i], value_of(i))
                        local["put"] += 1
                    elif r < 0.70:
                        got = client.get(keys[i])
                        local["get"] += 1
                        if got is None:
                            local["get_missing"] += 1
                        elif got != value_of(i):
                            local["wrong_value"] += 1
                    elif r < 0.85:
                        start = rng.randrange(KEYS - CHAIN)
                        client.match_prefix(keys[start : start + CHAIN])
                        local["match_prefix"] += 1
                    elif r < 0.90:
                        client.exists(keys[i])
                        local["exists"] += 1
                    else:
                        client.remove(keys[i])
                        local["remove"] += 1
                except Exception as exc:  # noqa: BLE001 - counted; the soak goes on
                    local["errors"] += 1
                    with lock:
                        if len(errors) < 10:
                            errors.append(f"{type(exc).__name__}: {exc}")
        finally:
            client.close()
            with lock:
                counts.update(local)

    threads = [threading.Thread(target=work, args=(n,)) for n in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    del index
    out.put({"ops": dict(counts), "errors": errors})


def verdict(series: list[dict]) -> dict:
    """Per judged series: the trend's growth across the second half, and whether it is flat."""
    if len(series) < 4:
        return {"flat": True, "note": "too few samples to judge", "series": {}}
    t_end = series[-1]["t"]
    half = [s for s in series if s["t"] >= t_end / 2]
    span = half[-1]["t"] - half[0]["t"] if len(half) > 1 else 0.0
    out, flat = {}, True
    for name in JUDGED:
        points = [(s["t"], s[name]) for s in half]
        growth = slope(points) * span
        mean = sum(y for _, y in points) / len(points)
        limit = FLAT_COUNT if name in ("fds", "threads") else max(FLAT_BYTES, FLAT_FRACTION * mean)
        ok = growth < limit
        flat &= ok
        out[name] = {"growth_over_second_half": round(growth, 1), "limit": round(limit, 1), "flat": ok}
    return {"flat": flat, "series": out}


def run(minutes: float, clients: int, interval: float, seed: int, workdir: Path) -> dict:
    services = {}
    master = services["master"] = start_master(workdir)
    address = master.record["master"]
    try:
        for name in ("node-1", "node-2"):
            services[name] = start_node(address, workdir, name, "32MiB", "64MiB", "1MiB")
        ctx = multiprocessing.get_context("spawn")
        stop, out = ctx.Event(), ctx.Queue()
        proc = ctx.Process(target=client_process, args=(address, clients, seed, stop, out), daemon=True)
        proc.start()
        pids = {name: s.pid for name, s in services.items()}
        pids["clients"] = proc.pid
        samples: dict[str, list] = {name: [] for name in pids}
        started = time.monotonic()
        duration = minutes * 60
        crashed = []
        while True:
            t = round(time.monotonic() - started, 1)
            for name, pid in pids.items():
                s = proc_sample(pid)
                if s is None:
                    if name not in crashed:
                        crashed.append(name)
                    continue
                samples[name].append({"t": t, **{k: s[k] for k in SERIES}})
            if t >= duration or crashed:
                break
            time.sleep(min(interval, max(0.0, duration - (time.monotonic() - started))))
        stop.set()
        try:
            result = out.get(timeout=60)
        except Exception:  # noqa: BLE001 - queue.Empty: the client process died
            result = {"ops": {}, "errors": ["the client process sent no result"]}
        proc.join(30)
        elapsed = time.monotonic() - started
    finally:
        for service in services.values():
            service.close()
        reap_arenas()
    tracebacks = {name: s.tracebacks() for name, s in services.items()}
    processes = {name: {"samples": series, "verdict": verdict(series)} for name, series in samples.items()}
    ops = result["ops"]
    flat = all(p["verdict"]["flat"] for p in processes.values())
    return {
        "minutes": minutes,
        "seconds": round(elapsed, 1),
        "clients": clients,
        "interval_s": interval,
        "working_set_mib": round(sum(len(value_of(i)) for i in range(KEYS)) / MiB),
        "pool_dram_mib": 64,
        "ops": ops,
        "ops_per_s": round(
            sum(v for k, v in ops.items() if k not in ("get_missing", "wrong_value", "errors")) / elapsed, 1
        ),
        "wrong_values": ops.get("wrong_value", 0),
        "errors": ops.get("errors", 0),
        "error_samples": result["errors"],
        "crashed": crashed,
        "tracebacks": tracebacks,
        "processes": processes,
        "verdict": "flat after warm-up" if flat else "not flat",
        "how": (
            "per process and series (rss_anon, rss_file, fds, threads): least-squares slope over the second "
            f"half of the samples x that half's length < max({FLAT_BYTES // MiB} MiB, "
            f"{FLAT_FRACTION:.0%} of the mean) for memory, < {FLAT_COUNT} for fds and threads"
        ),
    }


def table(r: dict) -> str:
    lines = [
        f"{r['seconds']} s, {r['clients']} clients, working set {r['working_set_mib']} MiB over "
        f"{r['pool_dram_mib']} MiB of DRAM; ops {r['ops']} ({r['ops_per_s']}/s); wrong values "
        f"{r['wrong_values']}, errors {r['errors']}, crashed {r['crashed']}, tracebacks {r['tracebacks']}",
        "",
        "| process | anon MiB first / mid / last | file MiB | shmem MiB | fds | threads | growth over 2nd half (anon MiB, fds) | flat |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, p in r["processes"].items():
        s = p["samples"]
        if not s:
            continue
        a, m, z = s[0], s[len(s) // 2], s[-1]
        v = p["verdict"].get("series", {})
        growth = (
            f"{v['rss_anon']['growth_over_second_half'] / MiB:.1f}, {v['fds']['growth_over_second_half']:.1f}"
            if v
            else "-"
        )
        lines.append(
            f"| {name} | {a['rss_anon'] / MiB:.0f} / {m['rss_anon'] / MiB:.0f} / {z['rss_anon'] / MiB:.0f} | "
            f"{a['rss_file'] / MiB:.0f} / {z['rss_file'] / MiB:.0f} | {a['rss_shmem'] / MiB:.0f} / "
            f"{z['rss_shmem'] / MiB:.0f} | {a['fds']} / {z['fds']} | {a['threads']} / {z['threads']} | "
            f"{growth} | {p['verdict']['flat']} |"
        )
    lines += ["", f"verdict: {r['verdict']} ({r['how']})"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=5.0)
    parser.add_argument("--clients", type=int, default=3)
    parser.add_argument("--interval", type=float, default=5.0, help="seconds between samples")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    interval = min(args.interval, max(1.0, args.minutes * 60 / 10))  # at least ~10 samples in a short run
    with tempfile.TemporaryDirectory(prefix="kvstore-soak-") as workdir:
        result = run(args.minutes, args.clients, interval, args.seed, Path(workdir))
    if args.json:
        json.dump(result, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print(table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
