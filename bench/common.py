"""Small helpers shared by the benchmarks: timing, medians, output."""

from __future__ import annotations

import json
import statistics
import sys
import time
from typing import Callable


def median_rate(fn: Callable[[], int], repeats: int) -> float:
    """Median over ``repeats`` runs of (units fn() reports) / seconds it took."""
    rates = []
    for _ in range(repeats):
        start = time.perf_counter()
        units = fn()
        rates.append(units / (time.perf_counter() - start))
    return statistics.median(rates)


def die_with_parent() -> None:
    """A ``preexec_fn`` for helper processes: SIGTERM when the benchmark dies, however it dies
    (Linux; elsewhere a no-op), so a killed benchmark leaves no pool or server behind."""
    if sys.platform == "linux":
        import ctypes
        import signal

        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def emit(result: dict, as_json: bool, table: Callable[[dict], str]) -> None:
    """Print ``result`` as JSON or through ``table``."""
    if as_json:
        json.dump(result, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print(table(result))


def markdown_table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def wait_until(predicate, timeout: float, interval: float = 0.02):
    """Poll until ``predicate()`` is truthy and return its value; TimeoutError past ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"not within {timeout} s")
        time.sleep(interval)
