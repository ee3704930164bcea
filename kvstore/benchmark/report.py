"""From raw measurements to the result: records (medians, ratios, percentiles), targets, the table,
the plot, the progress line."""

from __future__ import annotations

import json
import statistics
import sys

from kvstore.benchmark.settings import BASELINES, MiB, Settings


class Progress:
    """tqdm on stderr when installed, else a plain counter line; nothing when disabled."""

    def __init__(self, total: int, enabled: bool):
        self.bar, self.done, self.total, self.enabled = None, 0, total, enabled
        if enabled:
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total, unit="measure", file=sys.stderr, leave=False, dynamic_ncols=True)
            except ImportError:
                pass

    def step(self, label: str) -> None:
        self.done += 1
        if self.bar is not None:
            self.bar.set_description(label, refresh=False)
            self.bar.update()
        elif self.enabled:
            sys.stderr.write(f"\r{self.done}/{self.total} {label:<40}")
            sys.stderr.flush()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        elif self.enabled:
            sys.stderr.write("\n")


# -- records ---------------------------------------------------------------------------------------------
def aggregate(replies: list[dict]) -> dict:
    """All clients' bytes over the slowest client's wall time; latencies pooled."""
    slowest = max(r["elapsed"] for r in replies)
    lat = [x for r in replies for x in r["latencies"]]
    return {
        "gbps": sum(r["bytes"] for r in replies) / slowest / 1e9,
        "ops_s": sum(r["ops"] for r in replies) / slowest,
        "latencies": lat,
    }


def _median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _pct(sorted_lat: list[float], q: float) -> float:
    return sorted_lat[min(len(sorted_lat) - 1, int(q * len(sorted_lat)))]


def _round(value, digits: int = 3):
    return None if value is None else round(value, digits)


def label(size: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if size >= 1 << shift and size % (1 << shift) == 0:
            return f"{size >> shift}{unit}"
    return str(size)


def records(settings: Settings, raw: dict, redis_py: bool, redis_c: bool) -> list[dict]:
    """One record per (clients, size, op, transport): kvstore's medians and each baseline next to it."""
    out = []
    for n in settings.clients:
        for size in settings.sizes:
            for op in settings.ops:
                for transport in settings.transports:
                    rounds = raw[(n, size, f"kv:{transport}:{op}")]
                    rec = _kvstore_record(settings, n, size, op, transport, rounds)
                    _add_baselines(rec, settings, raw, rounds, redis_py, redis_c)
                    out.append(rec)
    return out


def _kvstore_record(settings: Settings, n: int, size: int, op: str, transport: str, rounds: list[dict]) -> dict:
    lat = sorted(x for r in rounds for x in r["latencies"])
    return {
        "size": size,
        "size_label": label(size),
        "op": op,
        "transport": transport,
        "clients": n,
        "batch": settings.batch if op.startswith("batch") else 1,
        "kvstore_gbps": _round(_median(r["gbps"] for r in rounds)),
        "kvstore_ops_s": _round(_median(r["ops_s"] for r in rounds), 1),
        "p50_ms": _round(1e3 * _pct(lat, 0.5), 4),
        "p99_ms": _round(1e3 * _pct(lat, 0.99), 4),
        "notes": [],
    }


def _add_baselines(rec: dict, settings: Settings, raw: dict, rounds: list[dict], redis_py: bool, redis_c: bool) -> None:
    """``<baseline>_gbps`` and ``vs_<baseline>`` (median of per-round ratios), null with a note when absent."""
    n, size, op = rec["clients"], rec["size"], rec["op"]
    py_measure, c_test, batched, sock_measure = BASELINES[op]
    c_measure = f"redis_c:{c_test}:{settings.batch if batched else 1}"
    for field_name, measure, present, why in (
        ("redis_gbps", py_measure, redis_py, "Redis (redis-py) not measured: see notes"),
        ("redis_c_gbps", c_measure, redis_c, "redis-benchmark not measured: see notes"),
        ("socket_gbps", sock_measure, True, ""),
        ("memcpy_gbps", "memcpy", True, ""),
    ):
        base = raw.get((n, size, measure)) if present else None
        prefix = field_name[: -len("_gbps")]
        if base is None:
            rec[field_name] = rec[f"vs_{prefix}"] = None
            rec["notes"].append(why)
            continue
        rec[field_name] = _round(_median(b["gbps"] for b in base))
        rec[f"vs_{prefix}"] = _round(_median(a["gbps"] / b["gbps"] for a, b in zip(rounds, base)))
        if prefix in ("redis", "redis_c"):
            blat = sorted(x for b in base for x in b.get("latencies", ()))
            rec[f"{prefix}_p50_ms"] = (
                _round(1e3 * _pct(blat, 0.5), 4) if blat else _round(_median(b["p50_ms"] for b in base), 4)
            )


# -- targets, table, plot ------------------------------------------------------------------------------
TARGETS = [  # (name, size, clients, transport, op, ratio field, at least)
    ("1MiB 1 client: TCP get_into >= 3x Redis GET (redis-py)", MiB, 1, "tcp", "get_into", "vs_redis", 3.0),
    ("1MiB 1 client: TCP get_into >= 0.8x Redis GET (redis-benchmark)", MiB, 1, "tcp", "get_into", "vs_redis_c", 0.8),
    ("1MiB 1 client: TCP get >= 3x Redis GET (redis-py)", MiB, 1, "tcp", "get", "vs_redis", 3.0),
    ("1MiB 1 client: TCP get >= 0.8x Redis GET (redis-benchmark)", MiB, 1, "tcp", "get", "vs_redis_c", 0.8),
    ("1MiB 1 client: TCP put >= 2x Redis SET (redis-py)", MiB, 1, "tcp", "put", "vs_redis", 2.0),
    ("1MiB 1 client: shm get_into >= 0.6x memcpy", MiB, 1, "shm", "get_into", "vs_memcpy", 0.6),
    ("1MiB 1 client: shm put >= 0.5x memcpy", MiB, 1, "shm", "put", "vs_memcpy", 0.5),
    (
        "64KiB 1 client: TCP batch_get_into (64) >= 3x redis-py GET pipeline (64)",
        64 << 10,
        1,
        "tcp",
        "batch_get_into",
        "vs_redis",
        3.0,
    ),
    (
        "64KiB 1 client: shm batch_get_into (64) >= 3x redis-py GET pipeline (64)",
        64 << 10,
        1,
        "shm",
        "batch_get_into",
        "vs_redis",
        3.0,
    ),
    (
        "1MiB 4 clients: aggregate TCP get_into >= 0.7x raw socket (4 clients)",
        MiB,
        4,
        "tcp",
        "get_into",
        "vs_socket",
        0.7,
    ),
]


def targets(records: list[dict]) -> list[dict]:
    index = {(r["size"], r["clients"], r["transport"], r["op"]): r for r in records}
    out = []
    for name, size, clients, transport, op, ratio, least in TARGETS:
        rec = index.get((size, clients, transport, op))
        value = None if rec is None else rec.get(ratio)
        out.append(
            {"target": name, "ratio": value, "at_least": least, "met": None if value is None else value >= least}
        )
    return out


def format_table(result: dict) -> str:
    def cell(rec, prefix):
        g = rec.get(f"{prefix}_gbps")
        return "-" if g is None else f"{g:.2f} ({rec[f'vs_{prefix}']:.2f}x)"

    header = [
        "size",
        "op",
        "transport",
        "clients",
        "kvstore GB/s",
        "ops/s",
        "p50 ms",
        "p99 ms",
        "redis-py GB/s (kv/x)",
        "redis-benchmark GB/s",
        "raw socket GB/s",
        "memcpy GB/s",
    ]
    rows = [
        [
            r["size_label"],
            r["op"],
            r["transport"],
            r["clients"],
            f"{r['kvstore_gbps']:.2f}",
            f"{r['kvstore_ops_s']:,.0f}",
            r["p50_ms"],
            r["p99_ms"],
            cell(r, "redis"),
            cell(r, "redis_c"),
            cell(r, "socket"),
            cell(r, "memcpy"),
        ]
        for r in result["records"]
    ]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(v) for v in row) + " |" for row in rows]
    lines.append("\nbaseline cells: baseline GB/s (kvstore / baseline, median of per-round ratios)")
    for t in result["targets"]:
        state = "not measured" if t["met"] is None else ("met" if t["met"] else "MISSED")
        ratio = "-" if t["ratio"] is None else f"{t['ratio']:.2f}"
        lines.append(f"target {t['target']}: {ratio} -> {state}")
    lines += [f"note: {n}" for n in result["notes"]]
    return "\n".join(lines)


def _plot_series(recs: list[dict], ops: tuple[str, ...], batch_op: str) -> dict:
    """{line label: {size: GB/s}} of one panel: kvstore per transport and op, its batch op, and
    the baselines of the first op."""
    series = {}
    for r in recs:
        if r["op"] in ops:
            series.setdefault(f"kvstore {r['transport']} {r['op']}", {})[r["size"]] = r["kvstore_gbps"]
        if r["op"] == ops[0]:
            for prefix, name in (
                ("redis", "Redis, redis-py"),
                ("redis_c", "Redis, redis-benchmark (C)"),
                ("socket", "limit: raw Python socket"),
                ("memcpy", "limit: memcpy"),
            ):
                if r.get(f"{prefix}_gbps") is not None:
                    series.setdefault(name, {})[r["size"]] = r[f"{prefix}_gbps"]
        elif r["op"] == batch_op:
            series.setdefault(f"kvstore {r['transport']} {batch_op} ({r['batch']})", {})[r["size"]] = r["kvstore_gbps"]
    return series


def plot(result: dict, path: str) -> None:
    """Throughput against value size (one client): kvstore tcp and shm, Redis (both clients), the limits."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise RuntimeError("--plot needs matplotlib (pip install 'kvstore[bench]')") from exc
    clients = min(result["config"]["clients"])
    recs = [r for r in result["records"] if r["clients"] == clients]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8), sharey=True)
    for ax, (title, ops, batch_op) in zip(
        axes, (("get (get_into)", ("get_into",), "batch_get_into"), ("put", ("put", "put_nowait"), "batch_put"))
    ):
        for name, points in _plot_series(recs, ops, batch_op).items():
            xs = sorted(points)
            style = "--" if name.startswith("limit") else (":" if "Redis" in name else "-")
            ax.plot([x / 1024 for x in xs], [points[x] for x in xs], style, marker="o", label=name)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("value size (KiB)")
        ax.set_title(f"{title}, {clients} client{'s' if clients > 1 else ''}")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    axes[0].set_ylabel("GB/s")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def emit(result: dict, as_json: bool, plot_path: str | None, echo=print) -> None:
    if plot_path:
        plot(result, plot_path)
    echo(json.dumps(result, indent=2) if as_json else format_table(result))
