"""Serving a slice of the conversation trace with real vLLM engines: kvstore's router with a prefill
and a decode engine against two plain engines behind round-robin (FAST'25 Fig. 11, in miniature).

``python -m bench.serve [--trace conversation_trace.jsonl] [--json]`` takes a slice of the trace
(``bench/serve_trace.py``: whole conversations, token ids generated per ``hash_id`` so prefixes are
shared as in the trace), writes a small random Llama (``bench.vllm_engine.make_llama``; vLLM's CPU
backend) and replays the slice at the trace's inter-arrival times (x ``--time-scale``, or at
``--rate``) against, one after the other:

- ``disaggregated`` (a): a master, a node, a prefill engine (connector ``kv_both``, role
  ``prefill``: it loads from the pool the prefixes its own cache no longer holds, and stores what it
  computes; ``--prefill-kv-role kv_producer`` only stores), a decode engine (``kv_consumer``, role
  ``decode``) and ``kvstore router`` in front;
- ``colocated`` (b): two plain engines (no connector; vLLM's own prefix cache on, as in a plain
  deployment), requests dealt round-robin by this benchmark straight to their ``/v1/completions``.

Every engine has the same block size (``--block-tokens``, also the master's ``[cost_model]
block_tokens``) and KV cache (``--kv-cache-mib``; the model's KV is 1 KiB a token). The default,
4 MiB, is the smallest that holds the slice's longest request with room to spare, and still large
against the trace's own scale: there a prefix is reused after a median of ~6,300 new 512-token
blocks, of which one 8xA800 instance's HBM (~1.4M tokens of LLaMA3-70B KV) holds under half; in the
slice the median is ~110 new blocks, of which 4 MiB holds all. With 64 MiB every engine holds the
whole slice and only the routing differs: one prefill engine sees every prefix, two round-robin
engines each see about half of every conversation's turns. With ``--engine-cpus 0|1`` (the default on two or more cores) the
first engine of a setup is bound to core 0 and the second to core 1. Reported per setup: TTFT and
TBT p50/p90 (``bench/serve_client.py`` says how they are timed), the requests meeting both SLOs
(``--ttft-slo``, ``--tbt-slo``), and the prefill tokens computed: per engine the growth over the
replay of vLLM's ``vllm:prompt_tokens_by_source{source="local_compute"}`` (prompt tokens the
engine ran through the model: neither in its own prefix cache nor loaded by a connector), summed
over the setup's engines; in (a) that includes the decode engine's share: each prompt's last
token (and its last partial block where the prefill engine stores none, connector key
``partial_blocks`` off). The ratios are (a)/(b).

Router overhead, in (a) after the replay: ``--overhead-rounds`` rounds of ``--overhead-pairs``
pairs of new random prompts, one of each pair through the router and one through the same steps
called directly by this benchmark (prefill engine with ``max_tokens`` 1, wait until the master's
index lists the prompt's blocks, as the router waits, then the decode engine, streamed), in
alternating order; per round the p50 of (router TTFT - direct TTFT) over its pairs; reported the
median over rounds, and the p50 over every pair of the run.

Targets: prefill tokens computed (a) <= 0.6x (b); the router adds <= 5 ms p50 to TTFT.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import random
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack

from bench.common import emit, markdown_table
from bench.serve_client import counter_delta, latency_summary, prompt_counters, replay
from bench.serve_overhead import router_overhead
from bench.serve_procs import ROOT, Engine, start_pool, start_router, wait_ready
from bench.serve_trace import build_requests, reuse_bound

TARGETS = {"prefill_computed_ratio": 0.6, "router_overhead_ms": 5.0}
VOCAB = 1000


def engine_options(args, model: str, max_model_len: int) -> dict:
    return {
        "model": model,
        "block_size": args.block_tokens,
        "max_model_len": max_model_len,
        "kv_cache_bytes": args.kv_cache_mib << 20,
    }


def cpus_for(args, n: int) -> str | None:
    if args.engine_cpus == "auto":
        return None
    cores = args.engine_cpus.split("|")
    return cores[n % len(cores)]


async def warm_up(urls: list[str], seed: int) -> None:
    """One request per URL with a prompt the trace never produces: first requests pay one-time costs."""
    from bench.serve_client import body_of, session, stream

    rng = random.Random(seed)
    async with session() as http:
        for url in urls:
            await stream(http, url, body_of([rng.randrange(3, VOCAB) for _ in range(200)], 4))


def measure(urls: dict[str, str], requests, target, args) -> dict:
    """Replay ``requests`` (to ``target(n)``), with the engines' prompt-token counters around it."""
    asyncio.run(warm_up(list(dict.fromkeys(target(n) for n in range(2))), args.seed + 1))
    before = {name: prompt_counters(url) for name, url in urls.items()}
    records, seconds = asyncio.run(replay(requests, target))
    time.sleep(1.0)  # the API server counts a step's prompt tokens as it handles that step's outputs
    engines = {name: counter_delta(before[name], prompt_counters(url)) for name, url in urls.items()}
    result = latency_summary(records, args.ttft_slo / 1000, args.tbt_slo / 1000)
    result.update(
        replay_s=round(seconds, 2),
        engines=engines,
        prefill_tokens_computed=sum(e["local_compute"] for e in engines.values()),
        cached_tokens_reported=sum(r["cached_tokens"] or 0 for r in records if r["ok"]),
    )
    return result


def run_disaggregated(args, model: str, max_model_len: int, requests, logs: str, tmp: str) -> dict:
    with ExitStack() as stack:
        procs, master = start_pool(tmp, args.block_tokens, args.dram, logs)
        for p in procs:
            stack.callback(p.stop)
        options = engine_options(args, model, max_model_len)
        prefill = Engine(
            "prefill", logs=logs, pool=(master, args.prefill_kv_role, "prefill"), cpus=cpus_for(args, 0), **options
        )
        stack.callback(prefill.stop)
        decode = Engine("decode", logs=logs, pool=(master, "kv_consumer", "decode"), cpus=cpus_for(args, 1), **options)
        stack.callback(decode.stop)
        wait_ready([prefill, decode], lambda e: f"{e.url}/health")
        router, url = start_router(master, logs)
        stack.callback(router.stop)
        wait_ready([router], lambda _: f"{url}/health", timeout=60)
        result = measure({"prefill": prefill.url, "decode": decode.url}, requests, lambda n: url, args)
        result["router_overhead"] = router_overhead(url, prefill.url, decode.url, master, args)
        return result


def run_colocated(args, model: str, max_model_len: int, requests, logs: str) -> dict:
    with ExitStack() as stack:
        options = engine_options(args, model, max_model_len)
        engines = []
        for n in range(2):
            engine = Engine(f"plain{n}", logs=logs, cpus=cpus_for(args, n), **options)
            stack.callback(engine.stop)
            engines.append(engine)
        wait_ready(engines, lambda e: f"{e.url}/health")
        return measure({e.name: e.url for e in engines}, requests, lambda n: engines[n % 2].url, args)


def ratio(a, b):
    return None if a is None or b in (None, 0) else round(a / b, 3)


def ratios(a: dict, b: dict) -> dict:
    out = {
        "prefill_tokens_computed": ratio(a["prefill_tokens_computed"], b["prefill_tokens_computed"]),
        "meet_both_slos": ratio(a["meet_both_slos"], b["meet_both_slos"]),
    }
    for metric in ("ttft_ms", "tbt_ms"):
        for q in ("p50", "p90"):
            out[f"{metric[:-3]}_{q}"] = ratio(a[metric][q], b[metric][q])
    return out


def commit() -> str:
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip()
        return head + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def slice_info(requests) -> dict:
    return {
        "requests": len(requests),
        "trace_indexes": [requests[0].index, requests[-1].index],
        "conversations": len({r.hash_ids[:2] for r in requests}),
        "prompt_tokens": sum(len(r.prompt) for r in requests),
        "output_tokens": sum(r.max_tokens for r in requests),
        "longest_prompt": max(len(r.prompt) for r in requests),
        "span_s": round(requests[-1].arrival_s, 2),
        "reuse_bound": round(reuse_bound(requests), 3),
    }


def targets(result: dict) -> dict:
    out = {}
    setups = result["setups"]
    if "prefill_tokens_computed" in result["ratios"]:
        value = result["ratios"]["prefill_tokens_computed"]
        out[f"prefill tokens computed (a) <= {TARGETS['prefill_computed_ratio']}x (b)"] = (
            value is not None and value <= TARGETS["prefill_computed_ratio"]
        )
    overhead = setups.get("disaggregated", {}).get("router_overhead")
    if overhead:
        out[f"router adds <= {TARGETS['router_overhead_ms']} ms p50 TTFT"] = (
            overhead["added_ttft_p50_ms"] is not None and overhead["added_ttft_p50_ms"] <= TARGETS["router_overhead_ms"]
        )
    return out


def fmt(value, spec: str = ".1f") -> str:
    return "-" if value is None else format(value, spec) if isinstance(value, float) else str(value)


def table(result: dict) -> str:
    header = [
        "setup",
        "completed",
        "TTFT p50 ms",
        "TTFT p90 ms",
        "TBT p50 ms",
        "TBT p90 ms",
        "meet both SLOs",
        "prefill tokens computed",
        "replay s",
    ]
    rows = []
    for name, s in result["setups"].items():
        rows.append(
            [
                name,
                f"{s['completed']}/{s['requests']}",
                fmt(s["ttft_ms"]["p50"]),
                fmt(s["ttft_ms"]["p90"]),
                fmt(s["tbt_ms"]["p50"]),
                fmt(s["tbt_ms"]["p90"]),
                s["meet_both_slos"],
                s["prefill_tokens_computed"],
                fmt(s["replay_s"]),
            ]
        )
    sl = result["config"]["slice"]
    lines = [
        markdown_table(header, rows),
        "",
        f"slice: {sl['requests']} requests of {sl['conversations']} conversations, {sl['prompt_tokens']} prompt "
        f"tokens, {sl['span_s']} s; an unbounded cache would skip {sl['reuse_bound']:.0%} of the blocks",
        "ratios (a)/(b): " + ", ".join(f"{k} {fmt(v, '.3f')}" for k, v in result["ratios"].items()),
    ]
    overhead = result["setups"].get("disaggregated", {}).get("router_overhead")
    if overhead:
        lines.append(
            f"router overhead: +{fmt(overhead['added_ttft_p50_ms'], '.2f')} ms p50 TTFT (median of "
            f"{len(overhead['rounds'])} rounds; range {fmt(overhead['range_ms'][0], '.2f')} to "
            f"{fmt(overhead['range_ms'][1], '.2f')}; over every pair "
            f"+{fmt(overhead['added_ttft_p50_all_pairs_ms'], '.2f')})"
        )
    lines += [f"target {name}: {'met' if ok else 'missed'}" for name, ok in result["targets"].items()]
    lines.append(
        f"machine: {result['machine']['nproc']} cores, load {result['machine']['load_before']} before, "
        f"{result['machine']['load_after']} after; commit {result['commit']}"
    )
    return "\n".join(lines)


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", default="conversation_trace.jsonl", help="the conversation trace (JSONL)")
    parser.add_argument("--start", type=int, default=0, help="conversations beginning at or after this request")
    parser.add_argument("--requests", type=int, default=60, help="requests in the slice")
    parser.add_argument(
        "--block-tokens",
        type=int,
        default=32,
        help="tokens per trace block (hash_id): the engines' block size and the conductor's",
    )
    parser.add_argument("--max-output", type=int, default=16, help="cap on output tokens per request")
    parser.add_argument("--time-scale", type=float, default=0.04, help="multiply the trace's inter-arrival times")
    parser.add_argument("--rate", type=float, default=None, help="requests per second instead of the trace's times")
    parser.add_argument("--ttft-slo", type=float, default=1000.0, help="TTFT SLO, ms")
    parser.add_argument("--tbt-slo", type=float, default=100.0, help="TBT SLO (a request's p90 gap), ms")
    parser.add_argument("--setups", default="disaggregated,colocated", help="which setups, in this order")
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--kv-cache-mib", type=int, default=4, help="KV cache of each engine (1 KiB a token)")
    parser.add_argument(
        "--prefill-kv-role",
        default="kv_both",
        choices=["kv_both", "kv_producer"],
        help="the prefill engine's connector role (kv_producer: it never loads from the pool)",
    )
    parser.add_argument("--dram", default="1GiB", help="the node's DRAM tier")
    parser.add_argument(
        "--engine-cpus",
        default="0|1" if (os.cpu_count() or 1) >= 2 else "auto",
        help="'|'-separated cores for a setup's first and second engine (VLLM_CPU_OMP_THREADS_BIND), "
        "or auto (vLLM's own binding)",
    )
    parser.add_argument("--overhead-rounds", type=int, default=5)
    parser.add_argument("--overhead-pairs", type=int, default=20)
    parser.add_argument("--probe-tokens", type=int, default=128, help="prompt length of the router-overhead probes")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    args.setups = [s.strip() for s in args.setups.split(",") if s.strip()]
    if not args.setups or any(s not in ("disaggregated", "colocated") for s in args.setups):
        parser.error("--setups takes disaggregated and/or colocated")
    if args.requests < 1 or args.block_tokens < 32 or args.block_tokens % 32 or args.max_output < 1:
        parser.error("--requests and --max-output must be >= 1, --block-tokens a multiple of 32 (vLLM's CPU attention)")
    return args


def main(argv: list[str] | None = None) -> None:
    from bench.trace import TraceError
    from bench.vllm_engine import make_llama, make_tokenizer

    args = parse_args(argv)
    try:
        requests = build_requests(
            args.trace,
            start=args.start,
            requests=args.requests,
            block_tokens=args.block_tokens,
            vocab=VOCAB,
            max_output=args.max_output,
            time_scale=args.time_scale,
            rate=args.rate,
        )
    except (TraceError, ValueError) as exc:
        raise SystemExit(f"bench.serve: {exc}") from None
    longest = max(len(r.prompt) + r.max_tokens for r in requests)
    max_model_len = max(-(-longest // args.block_tokens) * args.block_tokens, args.probe_tokens + 64)
    kv_per_token = 2 * args.layers * 2 * (args.hidden // 4) * 4  # K and V, 2 KV heads of hidden/4, fp32
    if args.kv_cache_mib << 20 < max_model_len * kv_per_token:
        raise SystemExit(
            f"bench.serve: --kv-cache-mib {args.kv_cache_mib} cannot hold the slice's longest request "
            f"({max_model_len} tokens of {kv_per_token} bytes)"
        )
    load_before = [round(x, 2) for x in os.getloadavg()]
    setups: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="bench-serve-") as tmp:
        logs = os.path.join(tmp, "logs")
        os.makedirs(logs)
        model = make_tokenizer(
            make_llama(
                os.path.join(tmp, "model"),
                hidden=args.hidden,
                layers=args.layers,
                vocab=VOCAB,
                max_positions=max_model_len,
            ),
            vocab=VOCAB,
        )
        for name in args.setups:
            if name == "disaggregated":
                setups[name] = run_disaggregated(args, model, max_model_len, requests, logs, os.path.join(tmp, "pool"))
            else:
                setups[name] = run_colocated(args, model, max_model_len, requests, logs)
    config = {k: v for k, v in vars(args).items() if k != "json"}
    config.update(
        max_model_len=max_model_len,
        model={
            "hidden": args.hidden,
            "layers": args.layers,
            "heads": 4,
            "kv_heads": 2,
            "vocab": VOCAB,
            "dtype": "float32",
        },
        slice=slice_info(requests),
    )
    a, b = setups.get("disaggregated"), setups.get("colocated")
    result = {
        "command": "python -m bench.serve " + " ".join(argv if argv is not None else sys.argv[1:]),
        "date": datetime.date.today().isoformat(),
        "commit": commit(),
        "machine": {
            "nproc": os.cpu_count(),
            "load_before": load_before,
            "load_after": [round(x, 2) for x in os.getloadavg()],
        },
        "config": config,
        "setups": setups,
        "ratios": ratios(a, b) if a and b else {},
    }
    result["targets"] = targets(result)
    emit(result, args.json, table)


if __name__ == "__main__":
    main()
