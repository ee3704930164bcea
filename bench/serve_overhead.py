"""What ``kvstore router`` adds to TTFT in ``bench.serve``: the router against the same steps called
directly.

The direct path does what the router does, minus the router: the prefill engine's
``/v1/completions`` with ``max_tokens`` 1, not streamed (the router's prefill call), then a wait
until the master's index lists the prompt's blocks (polled as the router polls: every 2 ms,
backing off to 10, so that the decode engine's lookup finds them), then the decode engine's
streamed completion; its TTFT runs from the first call to the decode stream's first chunk. What
is left to the router: the request's hashing, the conductor's ``Schedule`` (over the master's
conductor port), and one more HTTP hop each way; its prefill_finished report runs beside the
index wait and is not waited for when Schedule says the decode engine is final, and the engine
records are read again in the background. Each round also reports
the mean time a request spent in each stage: the router's from its ``/metrics``
(``kvstore_router_stage_seconds_total``), the direct path's as this bench times it.

Each pair is two new random prompts of ``--probe-tokens`` (nothing cached anywhere), one per path,
the path going first alternating pair by pair (one direct call before, not counted: its
first pool call connects); a round's figure is the p50 over its pairs of
(router TTFT - direct TTFT); the result is the median over rounds, beside the p50 over every
pair of the run (steadier: a round's 20 pairs leave its p50 a few ms from the run's).
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time

from bench.serve_client import body_of, percentile, session, stream
from kvstore.router.server import INDEX_POLL_S

PROBE_OUTPUT = 4


async def direct(http, prefill_url: str, decode_url: str, prompt: list[int], indexed) -> dict:
    start = time.perf_counter()
    job = {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": 1,
        "temperature": 0,
        "ignore_eos": True,
        "stream": False,
        "n": 1,
    }
    async with http.post(f"{prefill_url}/v1/completions", json=job) as resp:
        await resp.read()
        if resp.status != 200:
            return {"ok": False, "error": f"prefill HTTP {resp.status}"}
    prefilled = time.perf_counter()
    deadline, (poll, slowest) = time.monotonic() + 1.0, INDEX_POLL_S
    while not await asyncio.to_thread(indexed, prompt) and time.monotonic() < deadline:
        await asyncio.sleep(poll)
        poll = min(poll * 2, slowest)
    waited = time.perf_counter()
    record = await stream(http, decode_url, body_of(prompt, PROBE_OUTPUT))
    if record["ttft_s"] is not None:
        record["stages_s"] = {
            "prefill": prefilled - start,
            "to_decode": waited - prefilled,
            "decode_first_byte": record["ttft_s"],
        }
        record["ttft_s"] += waited - start
    return record


async def router_stages(http, router_url: str) -> dict:
    """The router's per-stage totals from its /metrics: {stage: [seconds, requests]}."""
    async with http.get(f"{router_url}/metrics") as resp:
        text = await resp.text()
    out: dict = {}
    for line in text.splitlines():
        for name, column in (("kvstore_router_stage_seconds_total", 0), ("kvstore_router_stage_total", 1)):
            if line.startswith(name + "{"):
                stage = line.split('stage="', 1)[1].split('"', 1)[0]
                out.setdefault(stage, [0.0, 0])[column] = float(line.rsplit(" ", 1)[1])
    return out


def mean_stages_ms(before: dict, after: dict) -> dict:
    """Mean ms a request spent in each router stage between two /metrics readings."""
    out = {}
    for stage, (seconds, count) in after.items():
        was = before.get(stage, [0.0, 0])
        if count > was[1]:
            out[stage] = round((seconds - was[0]) / (count - was[1]) * 1000, 2)
    return out


def index_probe(master: str):
    """(a function: is every block of a prompt in the master's index, its partial last one too
    when the prefill engine stores those, as the router waits for?, the client to close)."""
    from kvstore.router.server import PoolBackend, tail_keys
    from kvstore_client import Client
    from kvstore_client.vllm_hashing import VLLMBlockHasher

    client = Client(master)
    record = next(r for r in PoolBackend(client).engines() if "prefill" in (r.ids or {}))
    hasher = VLLMBlockHasher(record.block_size, record.hash_algo, seed=record.hash_seed)

    def indexed(prompt: list[int]) -> bool:
        hashes = hasher.hashes(prompt)
        namespace = record.conductor_namespace
        keys = [(namespace, h) for h in hashes] + tail_keys(record, namespace, prompt, hashes)
        return not keys or client.match_prefix(keys).longest >= len(keys)

    return indexed, client


async def rounds(router_url: str, prefill_url: str, decode_url: str, indexed, args) -> tuple[list[dict], list[float]]:
    """(per round: its pairs, p50s and stage means; every pair's router TTFT - direct TTFT, s)."""
    rng = random.Random(args.seed + 2)
    out, every = [], []
    async with session() as http:
        warm = [rng.randrange(3, 1000) for _ in range(args.probe_tokens)]  # the direct path's first calls
        await direct(http, prefill_url, decode_url, warm, indexed)
        for _ in range(args.overhead_rounds):
            diffs, router_ttft, direct_ttft = [], [], []
            direct_stages: dict = {}
            before = await router_stages(http, router_url)
            for pair in range(args.overhead_pairs):
                prompts = [[rng.randrange(3, 1000) for _ in range(args.probe_tokens)] for _ in range(2)]
                runs = {}
                order = ("router", "direct") if pair % 2 == 0 else ("direct", "router")
                for path, prompt in zip(order, prompts):
                    if path == "router":
                        runs[path] = await stream(http, router_url, body_of(prompt, PROBE_OUTPUT))
                    else:
                        runs[path] = await direct(http, prefill_url, decode_url, prompt, indexed)
                if all(r.get("ttft_s") is not None for r in runs.values()):
                    router_ttft.append(runs["router"]["ttft_s"])
                    direct_ttft.append(runs["direct"]["ttft_s"])
                    diffs.append(runs["router"]["ttft_s"] - runs["direct"]["ttft_s"])
                    for stage, seconds in runs["direct"]["stages_s"].items():
                        direct_stages.setdefault(stage, []).append(seconds)
            every += diffs
            out.append(
                {
                    "pairs": len(diffs),
                    "added_p50_ms": _ms(percentile(diffs, 50)),
                    "router_ttft_p50_ms": _ms(percentile(router_ttft, 50)),
                    "direct_ttft_p50_ms": _ms(percentile(direct_ttft, 50)),
                    "router_stages_mean_ms": mean_stages_ms(before, await router_stages(http, router_url)),
                    "direct_stages_mean_ms": {k: _ms(statistics.mean(v)) for k, v in direct_stages.items()},
                }
            )
    return out, every


def _ms(value):
    return None if value is None else round(value * 1000, 2)


def router_overhead(router_url: str, prefill_url: str, decode_url: str, master: str, args) -> dict:
    indexed, client = index_probe(master)
    try:
        per_round, every = asyncio.run(rounds(router_url, prefill_url, decode_url, indexed, args))
    finally:
        client.close()
    added = [r["added_p50_ms"] for r in per_round if r["added_p50_ms"] is not None]
    return {
        "probe_tokens": args.probe_tokens,
        "output_tokens": PROBE_OUTPUT,
        "rounds": per_round,
        "added_ttft_p50_ms": round(statistics.median(added), 2) if added else None,
        "range_ms": [min(added), max(added)] if added else [None, None],
        "added_ttft_p50_all_pairs_ms": _ms(percentile(every, 50)),
    }
