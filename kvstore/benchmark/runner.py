"""The run: start the pool and the baselines, measure every (clients, size, measure) in interleaved rounds,
turn the rounds into records. ``run`` is what ``kvstore bench`` and ``bench.throughput`` call."""

from __future__ import annotations

import multiprocessing as mp
import os
import subprocess

from kvstore.benchmark.baselines import RedisServer, preload_redis_c, redis_c_rate, redis_status, serve_socket
from kvstore.benchmark.pool import HelperProcess, serve_pool
from kvstore.benchmark.report import Progress, aggregate, label, records, targets
from kvstore.benchmark.settings import BASELINES, MiB, Settings
from kvstore.benchmark.workers import ClientGroup
from kvstore.tiers.arena import on_huge_pages, shm_dir


def run(settings: Settings) -> dict:
    """Every (size, op, transport, clients) with its baselines; see the package docstring."""
    ctx = mp.get_context("spawn")
    redis_bin, redis_c_bin, notes = redis_status(settings)
    counts = [settings.count(s) for s in settings.sizes]
    need = max(c * s for c, s in zip(counts, settings.sizes)) * max(settings.clients)
    dram = settings.dram or 2 * need + 256 * MiB
    helpers = []
    redis = None
    try:
        if settings.master:
            master = settings.master
            notes.append(f"pool at {master}: its DRAM must hold {need / MiB:.0f} MiB (the working set) or gets miss")
        else:
            pool = HelperProcess(ctx, serve_pool, dram, max(settings.sizes))
            helpers.append(pool)
            master = pool.info["master"]
        sock = HelperProcess(ctx, serve_socket, settings.sizes, counts)
        helpers.append(sock)
        if redis_bin:
            redis = _start_redis(redis_bin, notes)
            if redis is None:
                redis_c_bin = None
            else:
                notes.append(_redis_versions(redis_bin))
        raw = _run_levels(ctx, settings, master, sock.info, redis, redis_c_bin, notes)
    finally:
        if redis is not None:
            redis.close()
        for h in reversed(helpers):
            h.close()
    recs = records(settings, raw, redis is not None, redis_c_bin is not None)
    return {
        "config": _config(settings, dram, master if settings.master else None),
        "notes": notes,
        "records": recs,
        "targets": targets(recs),
    }


def _start_redis(redis_bin: str, notes: list[str]) -> RedisServer | None:
    """redis-server, or None (and a note) when it does not start."""
    try:
        return RedisServer(redis_bin)
    except (RuntimeError, OSError) as exc:
        notes.append(f"Redis baselines skipped: {exc}")
        return None


def _redis_versions(redis_bin: str) -> str:
    """The note of the redis-py version (and parser) and the server version."""
    import redis as redis_py

    parser = "hiredis" if getattr(redis_py.utils, "HIREDIS_AVAILABLE", False) else "pure-Python parser"
    return (
        f"redis-py {redis_py.__version__} ({parser}); "
        f"{subprocess.run([redis_bin, '--version'], capture_output=True, text=True).stdout.split()[2]}"
    )


def _config(settings: Settings, dram: int, master) -> dict:
    return {
        "sizes": settings.sizes,
        "ops": settings.ops,
        "transports": settings.transports,
        "clients": settings.clients,
        "bytes_per_client": settings.bytes_per_client,
        "batch": settings.batch,
        "rounds": settings.rounds,
        "master": master,
        "pool_dram": None if master else dram,
        "pool_arena_dir": None if master else shm_dir(),
        "pool_arena_huge_pages": None if master else on_huge_pages(shm_dir()),
        "cpus": os.cpu_count(),
    }


def _measures(settings: Settings, redis_py: bool) -> list[str]:
    out = [f"kv:{t}:{op}" for op in settings.ops for t in settings.transports]
    out += ["memcpy"] + sorted({BASELINES[op][3] for op in settings.ops})
    if redis_py:
        out += sorted({BASELINES[op][0] for op in settings.ops})
    return out


def _redis_c_tests(settings: Settings) -> list[tuple[str, bool]]:
    return sorted({(BASELINES[op][1], BASELINES[op][2]) for op in settings.ops})


def _run_levels(ctx, settings: Settings, master: str, socket_address: str, redis, redis_c_bin, notes) -> dict:
    """{(clients, size, measure): [per-round dicts of gbps, ops_s, latencies]}."""
    measures = _measures(settings, redis is not None)
    c_tests = _redis_c_tests(settings) if redis_c_bin else []
    total = len(settings.clients) * len(settings.sizes) * settings.rounds * (len(measures) + len(c_tests))
    progress = Progress(total, settings.progress)
    raw: dict = {}
    try:
        for n in settings.clients:
            group = ClientGroup(ctx, n, master, socket_address, redis.port if redis else None, settings.transports)
            try:
                for size in settings.sizes:
                    count = settings.count(size)
                    if redis is not None:
                        redis.client.flushall()
                        if c_tests:
                            preload_redis_c(redis, size, count * n, settings.batch)
                    prepared = group.ask(
                        {
                            "type": "prepare",
                            "size": size,
                            "count": count,
                            "batch": settings.batch,
                            "populate": ["kvstore", "redis"],
                        }
                    )
                    _note_paths(notes, prepared[0]["paths"])
                    for m in measures:  # warm-up: connections, page tables, caches
                        group.ask({"type": "run", "measure": m, "limit": 2 * settings.batch})
                    for _ in range(settings.rounds):
                        for m in measures:
                            progress.step(f"{n} clients {label(size)} {m}")
                            raw.setdefault((n, size, m), []).append(aggregate(group.ask({"type": "run", "measure": m})))
                        for test, batched in c_tests:
                            progress.step(f"{n} clients {label(size)} redis-benchmark {test}")
                            pipeline = settings.batch if batched else 1
                            rps, p50, p99 = redis_c_rate(
                                redis_c_bin, redis.port, test, size, count * n, n, pipeline, count * n
                            )
                            raw.setdefault((n, size, f"redis_c:{test}:{pipeline}"), []).append(
                                {"gbps": rps * size / 1e9, "ops_s": rps, "p50_ms": p50, "p99_ms": p99}
                            )
            finally:
                group.close()
    finally:
        progress.close()
    return raw


def _note_paths(notes: list[str], paths: dict) -> None:
    for transport, kinds in paths.items():
        expected = {"tcp": "TcpConnection", "shm": "ShmConnection"}.get(transport)
        if expected and kinds != [expected]:
            note = f"transport {transport}: the SDK used {', '.join(kinds) or 'nothing'} (the node is not reachable that way)"
            if note not in notes:
                notes.append(note)
