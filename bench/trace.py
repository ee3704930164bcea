"""Request traces (JSONL, one request a line), read and checked for the benchmarks that replay them
(bench.replay, bench.hit_rate).

Each line is a JSON object; ``timestamp`` (ms) and ``hash_ids`` (a list of ints, one per block) are
always needed, the benchmark names any others it uses (``input_length``, ``output_length``: ints).
Blank lines are skipped. A line that is not JSON (a truncated last line, say), lacks a field or has
one of the wrong type, and a trace with no requests, are a TraceError naming the file and line.
"""

from __future__ import annotations

import json
import math

BASE_FIELDS = ("timestamp", "hash_ids")


class TraceError(ValueError):
    """A trace that cannot be replayed: ``str()`` is ``FILE:LINE: what is wrong`` (or ``FILE: ...``)."""


def _check(request, fields) -> str | None:
    """What is wrong with one parsed line, or None."""
    if not isinstance(request, dict):
        return f"expected a JSON object, got {type(request).__name__}"
    missing = [f for f in fields if f not in request]
    if missing:
        return f"missing field{'s' if len(missing) > 1 else ''} {', '.join(missing)}"
    for name in fields:
        value = request[name]
        if name == "timestamp":
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                return f"timestamp must be a number, got {value!r}"
        elif name == "hash_ids":
            if not isinstance(value, list) or not all(isinstance(h, int) and not isinstance(h, bool) for h in value):
                return f"hash_ids must be a list of integers, got {_short(value)}"
        elif isinstance(value, bool) or not isinstance(value, int) or value < 0:
            return f"{name} must be a non-negative integer, got {value!r}"
    return None


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def read_trace(path: str, fields=BASE_FIELDS, limit: int | None = None) -> list[dict]:
    """The requests of the JSONL trace at ``path`` in timestamp order (stable for equal stamps), the
    first ``limit`` of them; each line must carry ``fields`` (``timestamp`` and ``hash_ids`` always).
    Raises TraceError for an unreadable or empty file and for the first bad line."""
    fields = tuple(dict.fromkeys((*BASE_FIELDS, *fields)))
    requests = []
    try:
        with open(path, encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    request = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise TraceError(
                        f"{path}:{number}: not a JSON object ({exc.msg} at column {exc.colno}; a truncated line?)"
                    ) from None
                problem = _check(request, fields)
                if problem:
                    raise TraceError(f"{path}:{number}: {problem}")
                requests.append(request)
    except UnicodeDecodeError as exc:
        raise TraceError(f"{path}: not a text file ({exc.reason})") from None
    except OSError as exc:
        raise TraceError(f"{path}: cannot read the trace: {exc.strerror or exc}") from None
    if not requests:
        raise TraceError(f"{path}: the trace holds no requests")
    requests.sort(key=lambda r: r["timestamp"])
    return requests[:limit] if limit else requests
