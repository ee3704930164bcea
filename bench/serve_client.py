"""The client side of ``bench.serve``: streamed completions timed chunk by chunk, the replay at
the trace's arrival times, vLLM's prompt-token counters, and percentiles.

One request is ``POST /v1/completions`` with a token-id prompt, ``temperature`` 0,
``ignore_eos``, ``max_tokens``, ``stream`` with ``include_usage``. TTFT is the time from sending
it to the first chunk that carries a choice; TBT the gaps between one such chunk and the next
(vLLM sends one per engine step: a chunk that carries two tokens, because the client fell behind,
counts as one gap, as ``vllm bench serve`` counts them; ``merged_chunks`` says how often).
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request

from aiohttp import ClientError, ClientSession, ClientTimeout, TCPConnector

#: vLLM's counter of prompt tokens by where they came from (vllm/v1/metrics/loggers.py)
SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")


def body_of(prompt: list[int], max_tokens: int) -> dict:
    return {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def stream(session: ClientSession, url: str, body: dict) -> dict:
    """One streamed completion at ``url`` (a base URL): its timing, usage and outcome."""
    start = time.perf_counter()
    times: list[float] = []
    usage, error = None, None
    try:
        async with session.post(f"{url}/v1/completions", json=body) as resp:
            if resp.status != 200:
                error = f"HTTP {resp.status}: {(await resp.read())[:200]!r}"
            else:
                async for raw in resp.content:
                    line = raw.strip()
                    if line.startswith(b"event: error"):
                        error = "error event"
                    if not line.startswith(b"data: ") or line == b"data: [DONE]":
                        continue
                    data = json.loads(line[6:])
                    if data.get("choices"):
                        times.append(time.perf_counter())
                    if data.get("usage"):
                        usage = data["usage"]
                    if "error" in data:
                        error = str(data["error"])[:200]
    except (ClientError, asyncio.TimeoutError) as exc:
        error = repr(exc)
    out = {
        "ok": error is None and bool(times),
        "error": error,
        "chunks": len(times),
        "ttft_s": times[0] - start if times else None,
        "gaps_s": [b - a for a, b in zip(times, times[1:])],
        "completion_tokens": usage.get("completion_tokens") if usage else None,
        "prompt_tokens": usage.get("prompt_tokens") if usage else None,
        "cached_tokens": ((usage or {}).get("prompt_tokens_details") or {}).get("cached_tokens"),
    }
    return out


def session(timeout_s: float = 600) -> ClientSession:
    """An HTTP client that drops a connection idle for 2 s: vLLM's server closes one idle for 5 s
    (``VLLM_HTTP_TIMEOUT_KEEP_ALIVE``), and a request sent on it as it closes fails (aiohttp's own
    default keeps idle connections 15 s)."""
    return ClientSession(connector=TCPConnector(limit=0, keepalive_timeout=2.0), timeout=ClientTimeout(total=timeout_s))


async def replay(requests, target) -> tuple[list[dict], float]:
    """Send each request at its ``arrival_s`` to ``target(n)`` (a base URL; n: its position);
    (the records in request order, the replay's seconds)."""
    async with session() as http:
        start = time.perf_counter()

        async def one(n, request) -> dict:
            delay = request.arrival_s - (time.perf_counter() - start)
            if delay > 0:
                await asyncio.sleep(delay)
            late = time.perf_counter() - start - request.arrival_s
            record = await stream(http, target(n), body_of(request.prompt, request.max_tokens))
            return dict(
                record, index=request.index, prompt_len=len(request.prompt), max_tokens=request.max_tokens, late_s=late
            )

        records = await asyncio.gather(*(one(n, r) for n, r in enumerate(requests)))
        return list(records), time.perf_counter() - start


def prompt_counters(url: str) -> dict[str, float]:
    """An engine's ``vllm:prompt_tokens_by_source`` counters (summed over labels) and ``vllm:prompt_tokens``."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    out = {s: 0.0 for s in SOURCES}
    out["prompt"] = 0.0
    for line in text.splitlines():
        if line.startswith("vllm:prompt_tokens_by_source_total{"):
            for source in SOURCES:
                if f'source="{source}"' in line:
                    out[source] += float(line.rsplit(" ", 1)[1])
        elif line.startswith("vllm:prompt_tokens_total{") or line.startswith("vllm:prompt_tokens_total "):
            out["prompt"] += float(line.rsplit(" ", 1)[1])
    return out


def counter_delta(before: dict, after: dict) -> dict[str, int]:
    return {k: int(round(after[k] - before[k])) for k in after}


def percentile(values: list[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (``q`` in [0, 100]); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def latency_summary(records: list[dict], ttft_slo_s: float, tbt_slo_s: float) -> dict:
    """TTFT and TBT p50/p90 (ms) over the requests that completed, and SLO attainment: a request meets
    the TTFT SLO when its TTFT is within it and the TBT SLO when its own p90 gap is (one output token:
    no gap, met); a failed request meets neither."""
    ok = [r for r in records if r["ok"]]
    ttfts = [r["ttft_s"] for r in ok]
    gaps = [g for r in ok for g in r["gaps_s"]]
    meets_ttft = [r for r in ok if r["ttft_s"] <= ttft_slo_s]
    meets_tbt = [r for r in ok if not r["gaps_s"] or percentile(r["gaps_s"], 90) <= tbt_slo_s]
    both = [r for r in meets_ttft if r in meets_tbt]
    ms = lambda v: None if v is None else round(v * 1000, 2)  # noqa: E731
    return {
        "requests": len(records),
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "errors": sorted({r["error"] for r in records if r["error"]})[:5],
        "ttft_ms": {"p50": ms(percentile(ttfts, 50)), "p90": ms(percentile(ttfts, 90))},
        "tbt_ms": {"p50": ms(percentile(gaps, 50)), "p90": ms(percentile(gaps, 90))},
        "meet_ttft_slo": len(meets_ttft),
        "meet_tbt_slo": len(meets_tbt),
        "meet_both_slos": len(both),
        "output_tokens": sum(r["completion_tokens"] or 0 for r in ok),
        "merged_chunks": sum((r["completion_tokens"] or r["chunks"]) - r["chunks"] for r in ok),
        "max_late_s": round(max((r["late_s"] for r in records), default=0.0), 3),
    }
