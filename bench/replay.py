"""Scheduler trace replay: the real Conductor under a simulated clock.

    python -m bench.replay --trace conversation_trace.jsonl \
        --policy kvcache_centric [--prefill 16 --decode 16 --cache-blocks 4000 \
        --speed 1 --admission off] --json
    python -m bench.replay --trace FILE --table policies   # every policy, one table
    python -m bench.replay --trace FILE --table admission --prefill 8 --decode 8 --speed 2
    python -m bench.replay --decision-latency [--blocks 1000000]   # one decision, 16P + 16D

A discrete-event replay (``bench.simulation``) in which every
decision is made by ``kvstore.scheduler.Conductor`` reading the real
``PrefixIndex`` that the simulated storage nodes (one per prefill instance,
``--cache-blocks`` each, a real eviction policy) keep up to date. Cost model:
``kvstore.scheduler.cost_model`` (LLaMA3-70B on 8xA800; ``--mfu``,
``--bandwidth-gbps`` override). Trace timestamps are divided by ``--speed``.

Reported per run: mean/p50/p90/p99 TTFT of served requests, TTFT SLO
attainment (served within ``--ttft-slo`` / all requests), prefix hit ratio
(reused blocks / blocks of admitted requests; ``local_hit_ratio`` without
fetched ones), blocks transferred; rejected requests (at arrival, after
prefill), prefill seconds wasted on requests rejected after prefill, decode
pool load over time (sampled every ``--sample-s``) with its oscillation:
standard deviation, mean absolute change between samples, and the
correlation between prefill and decode load (anti-phase swings < 0); and, per
admission mode, what the served requests asked of decode (mean context tokens,
served requests per prompt length, and tokens x output length summed, in 10^9
token-steps).

Overload, arXiv §7-8.2 (paper, 8P+8D, its 23k trace at 2x: rejected 4183
baseline, 3771 early, 3589 prediction). Whole trace, 3 seeds (``--jitter-s 1``:
each arrival delayed by a seeded uniform [0, 1) s; rejected requests per seed 0/1/2):

    python -m bench.replay --trace conversation_trace.jsonl --table admission \
        --prefill 8 --decode 8 --speed 2 --jitter-s 1 --seeds 0,1,2
    # none 492/496/498, early 492/496/498, prediction 492/496/498: all TTFT-SLO at arrival;
    # mean decode pool load 0.05: decode is never the bottleneck

    python -m bench.replay --trace conversation_trace.jsonl --table admission \
        --prefill 8 --decode 1 --speed 2 --jitter-s 1 --seeds 0,1,2
    # none       2527/2464/2490 (492-498 at arrival + 1968-2035 after prefill, 1617-1715 s prefill wasted)
    # early      3068/3123/3209 (0 after prefill)
    # prediction 2678/2790/2843 (0 after prefill)

(``--prefill 8 --decode 1 --speed 1.5``: none 957/921/907, early 1123/1154/1165,
prediction 1135/1061/1106.)

Why 8P+1D: at 1x it carries the trace (prefill 66% busy, decode at 0.41 of
its KV memory; only the 136-139 prompts too long to prefill within the TTFT SLO
are turned away) and 2x overloads both pools, as the paper's 8P+8D at 2x did.
With this cost model one decode instance holds 1.33M context tokens (HBM, at
64 ms a step, inside the 0.1 s TBT SLO), so 8 of them carry the 2x trace at
5% of capacity and the three modes cannot differ.

Where it differs from the paper: prediction < early holds and no early mode
wastes prefill, but ``none`` still rejects the fewest. The decode checks read
the decode side's load (``kvstore.scheduler.admission``); asking whether each
request still fits, as before, let ``none`` pack the last gaps of a full pool
with small requests (1,426-1,513 rejected). What remains is the mix. Decode
binds and every mode serves about the same decode work (35.3-36.5 x 10^9
token-steps), so the count depends on which requests get through. The wasted
prefill does lengthen ``none``'s prefill queues (mean TTFT 19.7-19.8 s, early
11.9-12.2 s) and its TTFT check turns more away (492-498, early 261-284), but
those are the longest prompts, which also hold the most decode memory: early
serves 400-421 prompts of 32-64k tokens and 31-37 over 64k against 346-356
and 1-2, and 246-337 fewer under 8k. The prediction counts only requests
already admitted, so it sees a far-off pool emptier than it will be and lets
long prefills in while turning short prompts away (4,849-4,992 served under
8k against 5,237-5,275); it serves the most tokens (99.4-100.1 M prompt +
output, ``none`` 98.0-98.5 M, early 94.6-96.0 M). Each replay takes 1-4 s.
"""

from __future__ import annotations

import argparse
import math
import random
import time

import numpy as np

from bench.common import emit, markdown_table
from bench.trace import TraceError, read_trace
from kvstore.master.index import DRAM, STORED, PrefixIndex
from kvstore.policy import POLICIES
from kvstore.scheduler import ADMISSIONS, PREFILL_POLICIES, Conductor, CostModel, CostParams, Rejected, SimClock
from bench.simulation import SimRequest, Simulation

NAMESPACE = "trace"
DEFAULTS = dict(
    prefill=16,
    decode=16,
    cache_blocks=4000,
    speed=1.0,
    admission="off",
    ttft_slo=30.0,
    tbt_slo=0.1,
    mfu=0.35,
    bandwidth_gbps=25.0,
    balancing_threshold=0,
    eviction="lru",
    seed=0,
    sample_s=10.0,
    decode_kv_tokens=1_330_000,
    jitter_s=0.0,
)


TRACE_FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")


def load_requests(path: str, limit: int | None = None) -> list[dict]:
    """Trace lines in timestamp order (stable for equal stamps), the first ``limit`` of them;
    TraceError names the file and line of anything wrong (``bench.trace``)."""
    return read_trace(path, TRACE_FIELDS, limit)


def to_sim_requests(trace: list[dict], speed: float, jitter_s: float = 0.0, seed: int = 0) -> list[SimRequest]:
    """Trace lines as simulated requests, timestamps divided by ``speed``. ``jitter_s`` > 0 delays every
    arrival by a uniform [0, jitter_s) seconds drawn from ``seed`` (a perturbation of the replay that keeps
    its load, to see how much a result owes to the exact arrival instants); 0 replays the trace as is."""
    digest_cache: dict[int, bytes] = {}
    rng = random.Random(seed)

    def digest(h: int) -> bytes:
        d = digest_cache.get(h)
        if d is None:
            d = digest_cache[h] = h.to_bytes(8, "little", signed=h < 0)
        return d

    out = [
        SimRequest(
            i,
            r["timestamp"] / 1000.0 / speed + (rng.uniform(0.0, jitter_s) if jitter_s > 0 else 0.0),
            int(r["input_length"]),
            int(r["output_length"]),
            [digest(h) for h in r["hash_ids"]],
        )
        for i, r in enumerate(trace)
    ]
    if jitter_s > 0:
        out.sort(key=lambda r: r.arrival)
    return out


def replay(trace: list[dict], policy: str, **options) -> dict:
    """One run; ``options`` override DEFAULTS. Returns the metrics dict."""
    cfg = {**DEFAULTS, **options}
    params = CostParams(
        mfu=cfg["mfu"], transfer_bandwidth=cfg["bandwidth_gbps"] * 1e9, decode_kv_tokens=cfg["decode_kv_tokens"]
    )
    clock = SimClock()
    conductor = Conductor(
        PrefixIndex(),
        CostModel(params),
        policy=policy,
        admission=cfg["admission"],
        ttft_slo=cfg["ttft_slo"],
        tbt_slo=cfg["tbt_slo"],
        namespace=NAMESPACE,
        clock=clock,
        seed=cfg["seed"],
        balancing_threshold=cfg["balancing_threshold"],
    )
    sim = Simulation(
        conductor, clock, cfg["prefill"], cfg["decode"], cfg["cache_blocks"], cfg["eviction"], cfg["sample_s"]
    )
    requests = to_sim_requests(trace, cfg["speed"], cfg["jitter_s"], cfg["seed"])
    start = time.perf_counter()
    result = sim.run(requests)
    out = {"policy": policy, **{k: cfg[k] for k in DEFAULTS}}
    out.update(summarise(result, cfg["ttft_slo"], conductor.cost))
    out["wall_seconds"] = round(time.perf_counter() - start, 2)
    return out


def summarise(result, ttft_slo: float, cost: CostModel) -> dict:
    reqs = result.requests
    admitted = [r for r in reqs if r.decision is not None]
    served = [r for r in admitted if r.rejected is None]
    ttft = np.array([r.prefill_end - r.arrival for r in served]) if served else np.zeros(1)
    blocks = sum(len(r.digests) for r in admitted) or 1
    after = [r for r in admitted if r.rejected is not None]
    reasons: dict[str, int] = {}
    for r in reqs:
        if r.rejected is not None:
            key = f"{r.rejected.stage}:{r.rejected.reason.value}"
            reasons[key] = reasons.get(key, 0) + 1
    prefill_busy = sum(p.busy_s for p in result.prefills)
    waits = [w for d in result.decodes for w in d.waits]
    decode_busy = sum(d.busy_s for d in result.decodes) or 1.0
    p50, p90, p99 = np.percentile(ttft, [50, 90, 99])
    out = {
        "requests": len(reqs),
        "served": len(served),
        # decode work of the served requests: context tokens held, and held x steps (tokens x output length)
        "served_mean_tokens": round(sum(r.input_len + r.output_len for r in served) / max(len(served), 1)),
        "served_by_input": served_by_input(served),
        "served_decode_gtoken_steps": round(sum((r.input_len + r.output_len) * r.output_len for r in served) / 1e9, 2),
        "mean_ttft_s": round(float(ttft.mean()), 3),
        "p50_ttft_s": round(float(p50), 3),
        "p90_ttft_s": round(float(p90), 3),
        "p99_ttft_s": round(float(p99), 3),
        "ttft_slo_attainment": round(float((ttft <= ttft_slo).sum()) / len(reqs), 4) if served else 0.0,
        "prefix_hit_ratio": round(sum(r.decision.prefix_blocks for r in admitted) / blocks, 4),
        "local_hit_ratio": round(sum(r.decision.local_blocks for r in admitted) / blocks, 4),
        "blocks_transferred": sum(len(r.decision.fetch_blocks) for r in admitted),
        "rejected": len(reqs) - len(served),
        "rejected_at_arrival": len(reqs) - len(admitted),
        "rejected_after_prefill": len(after),
        "rejected_by_reason": reasons,
        "wasted_prefill_s": round(result.wasted_prefill_s, 2),
        "prefill_utilisation": round(prefill_busy / (len(result.prefills) * max(result.end_time, 1e-9)), 4),
        "decode_over_slo_frac": round(sum(d.over_slo_s for d in result.decodes) / decode_busy, 4),
        "decode_wait_mean_s": round(float(np.mean(waits)), 3) if waits else 0.0,
        "decode_wait_p99_s": round(float(np.percentile(waits, 99)), 3) if waits else 0.0,
        "evictions": sum(n.evictions for n in result.nodes),
    }
    out.update(oscillation(result.samples))
    return out


INPUT_BANDS = (8_000, 32_000, 64_000)


def served_by_input(served: list) -> str:
    """Served requests per prompt length, "<8k/8-32k/32-64k/64k+": which sizes a mode lets through."""
    counts = np.histogram([r.input_len for r in served], bins=(0, *INPUT_BANDS, math.inf))[0]
    return "/".join(str(int(c)) for c in counts)


def oscillation(samples: list) -> dict:
    """Decode load over time and how much it swings."""
    if len(samples) < 3:
        return {
            "decode_load_mean": 0.0,
            "decode_load_std": 0.0,
            "decode_load_mean_abs_change": 0.0,
            "prefill_decode_load_corr": 0.0,
            "decode_load_series": [],
        }
    t, dec, pre = (np.array(c, dtype=float) for c in zip(*samples))
    corr = float(np.corrcoef(dec, pre)[0, 1]) if dec.std() > 0 and pre.std() > 0 else 0.0
    return {
        "decode_load_mean": round(float(dec.mean()), 4),
        "decode_load_std": round(float(dec.std()), 4),
        "decode_load_mean_abs_change": round(float(np.abs(np.diff(dec)).mean()), 4),
        "prefill_decode_load_corr": round(corr if math.isfinite(corr) else 0.0, 3),
        "decode_load_series": [[round(a, 1), round(b, 3)] for a, b in zip(t, dec)],
    }


def policy_table(trace: list[dict], **options) -> dict:
    runs = {p: replay(trace, p, **options) for p in PREFILL_POLICIES}
    base = runs["kvcache_centric"]["mean_ttft_s"] or 1e-9
    for r in runs.values():
        r["ttft_ratio_vs_kvcache_centric"] = round(r["mean_ttft_s"] / base, 3)
    return {"table": "policies", "runs": runs}


def admission_table(trace: list[dict], policy: str, seeds: list[int] | None = None, **options) -> dict:
    """Every admission mode; with ``seeds``, once per seed (rows "mode seed=N"), to go with ``jitter_s``."""
    if not seeds:
        return {
            "table": "admission",
            "runs": {a: replay(trace, policy, admission=a, **options) for a in ("none", "early", "prediction")},
        }
    options.pop("seed", None)
    runs = {
        f"{a} seed={s}": replay(trace, policy, admission=a, seed=s, **options)
        for s in seeds
        for a in ("none", "early", "prediction")
    }
    return {"table": "admission", "runs": runs}


def decision_latency(
    blocks: int = 1_000_000,
    chain_len: int = 40,
    prefill: int = 16,
    decode: int = 16,
    calls: int = 5000,
    in_flight: int = 256,
    seed: int = 0,
) -> dict:
    """Time ``Conductor.schedule`` with ``blocks`` distinct blocks indexed (1.5x as many entries).

    Chains of ``chain_len`` random digests: chain c lives on node c % prefill, its first half also on
    node (c + 1) % prefill. Each request is a chain's first k blocks plus up to 8 new ones; ``in_flight``
    requests are kept assigned (the oldest completes as a new one arrives), with admission
    ``prediction`` so the predictor walks them on every call. Per policy: p50/p99/max microseconds.
    """
    rng = random.Random(seed)
    index = PrefixIndex()
    nodes = [f"node-{i}" for i in range(prefill)]
    for n in nodes:
        index.add_node(n)
    chains = [[rng.randbytes(16) for _ in range(chain_len)] for _ in range(max(blocks // chain_len, 1))]
    for c, chain in enumerate(chains):
        index.apply(nodes[c % prefill], [(NAMESPACE, [(STORED, DRAM, d) for d in chain])])
        index.apply(nodes[(c + 1) % prefill], [(NAMESPACE, [(STORED, DRAM, d) for d in chain[: chain_len // 2]])])
    requests = []
    for _ in range(calls):
        chain = rng.choice(chains)
        keys = chain[: rng.randint(1, chain_len)] + [rng.randbytes(16) for _ in range(rng.randint(0, 8))]
        requests.append((keys, len(keys) * 512 - rng.randrange(512), rng.randint(10, 1000)))
    out = {"indexed_blocks": index.size(), "prefill": prefill, "decode": decode, "calls": calls, "policies": {}}
    for policy in PREFILL_POLICIES:
        clock = SimClock()
        conductor = Conductor(
            index,
            CostModel(),
            policy=policy,
            admission="prediction",
            ttft_slo=math.inf,
            tbt_slo=0.1,
            namespace=NAMESPACE,
            clock=clock,
        )
        for i, n in enumerate(nodes):
            conductor.register_prefill(f"prefill-{i}", n)
        for i in range(decode):
            conductor.register_decode(f"decode-{i}", f"dnode-{i}")
        times, live = [], []
        for i, (keys, n, o) in enumerate(requests):
            clock.advance(0.05)
            t0 = time.perf_counter()
            d = conductor.schedule(keys, n, o, request_id=i)
            times.append(time.perf_counter() - t0)
            live.append(d.request_id)
            if len(live) > in_flight:
                _complete(conductor, live.pop(0))
        us = np.array(times) * 1e6
        out["policies"][policy] = {
            "p50_us": round(float(np.percentile(us, 50)), 1),
            "p99_us": round(float(np.percentile(us, 99)), 1),
            "max_us": round(float(us.max()), 1),
        }
    return out


def _complete(conductor: Conductor, rid) -> None:
    conductor.prefill_started(rid)
    if not isinstance(conductor.prefill_finished(rid), Rejected):
        conductor.decode_finished(rid)


def _render(result: dict) -> str:
    if "indexed_blocks" in result:
        rows = [[p, r["p50_us"], r["p99_us"], r["max_us"]] for p, r in result["policies"].items()]
        head = f"{result['indexed_blocks']:,} blocks indexed, {result['prefill']}P + {result['decode']}D\n\n"
        return head + markdown_table(["policy", "p50 us", "p99 us", "max us"], rows)
    if result.get("table") == "policies":
        rows = [
            [
                p,
                r["mean_ttft_s"],
                r["p90_ttft_s"],
                r["p99_ttft_s"],
                r["ttft_ratio_vs_kvcache_centric"],
                r["prefix_hit_ratio"],
                r["blocks_transferred"],
                r["wall_seconds"],
            ]
            for p, r in result["runs"].items()
        ]
        return markdown_table(
            [
                "policy",
                "mean TTFT s",
                "p90 TTFT s",
                "p99 TTFT s",
                "mean / kvcache_centric",
                "prefix hit",
                "blocks moved",
                "wall s",
            ],
            rows,
        )
    if result.get("table") == "admission":
        rows = [
            [
                a,
                r["rejected"],
                r["rejected_by_reason"],
                r["rejected_at_arrival"],
                r["rejected_after_prefill"],
                r["wasted_prefill_s"],
                r["served_mean_tokens"],
                r["served_by_input"],
                r["served_decode_gtoken_steps"],
                r["mean_ttft_s"],
                r["decode_load_std"],
                r["decode_load_mean_abs_change"],
                r["decode_over_slo_frac"],
                r["decode_wait_mean_s"],
                r["wall_seconds"],
            ]
            for a, r in result["runs"].items()
        ]
        return markdown_table(
            [
                "admission",
                "rejected",
                "why",
                "at arrival",
                "after prefill",
                "wasted prefill s",
                "served: mean tokens",
                "served by input <8k/8-32k/32-64k/64k+",
                "served: G token-steps",
                "mean TTFT s",
                "decode load std",
                "mean |change|",
                "decode over SLO",
                "decode wait s",
                "wall s",
            ],
            rows,
        )
    return "\n".join(f"{k}: {v}" for k, v in result.items() if k != "decode_load_series")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", help="JSONL trace: timestamp (ms), input_length, output_length, hash_ids")
    parser.add_argument("--policy", choices=sorted(PREFILL_POLICIES), default="kvcache_centric")
    parser.add_argument("--prefill", type=int, default=DEFAULTS["prefill"], help="prefill instances")
    parser.add_argument("--decode", type=int, default=DEFAULTS["decode"], help="decode instances")
    parser.add_argument("--cache-blocks", type=int, default=DEFAULTS["cache_blocks"], help="blocks per prefill node")
    parser.add_argument("--speed", type=float, default=DEFAULTS["speed"], help="replay speed-up")
    parser.add_argument("--admission", choices=sorted(ADMISSIONS), default=DEFAULTS["admission"])
    parser.add_argument("--ttft-slo", type=float, default=DEFAULTS["ttft_slo"], help="seconds")
    parser.add_argument("--tbt-slo", type=float, default=DEFAULTS["tbt_slo"], help="seconds per token")
    parser.add_argument("--mfu", type=float, default=DEFAULTS["mfu"], help="prefill model FLOPs utilisation")
    parser.add_argument(
        "--bandwidth-gbps", type=float, default=DEFAULTS["bandwidth_gbps"], help="prefix transfer bandwidth, GB/s"
    )
    parser.add_argument(
        "--decode-kv-tokens",
        type=int,
        default=DEFAULTS["decode_kv_tokens"],
        help="context tokens one decode instance's HBM holds",
    )
    parser.add_argument("--balancing-threshold", type=int, default=DEFAULTS["balancing_threshold"], help="blocks")
    parser.add_argument("--eviction", choices=sorted(POLICIES), default=DEFAULTS["eviction"])
    parser.add_argument(
        "--seed", type=int, default=DEFAULTS["seed"], help="seed of the random policy and of --jitter-s"
    )
    parser.add_argument(
        "--seeds",
        type=lambda v: [int(x) for x in v.split(",")],
        default=None,
        help="with --table admission: run every mode once per seed, e.g. 0,1,2",
    )
    parser.add_argument(
        "--jitter-s",
        type=float,
        default=DEFAULTS["jitter_s"],
        help="delay each arrival by uniform [0, J) s drawn from the seed (0: the trace as is)",
    )
    parser.add_argument("--sample-s", type=float, default=DEFAULTS["sample_s"], help="load sampling period")
    parser.add_argument("--limit", type=int, default=None, help="replay only the first N requests")
    parser.add_argument("--table", choices=["policies", "admission"], help="run every policy / admission mode")
    parser.add_argument(
        "--decision-latency",
        action="store_true",
        help="time one scheduling decision at --blocks indexed blocks instead of replaying",
    )
    parser.add_argument("--blocks", type=int, default=1_000_000, help="indexed blocks for --decision-latency")
    parser.add_argument("--series", action="store_true", help="keep decode_load_series in the JSON")
    parser.add_argument("--json", action="store_true", help="print JSON")
    args = parser.parse_args(argv)
    if args.decision_latency:
        emit(decision_latency(args.blocks, prefill=args.prefill, decode=args.decode), args.json, _render)
        return
    if not args.trace:
        parser.error("--trace is required (except with --decision-latency)")
    try:
        trace = load_requests(args.trace, args.limit)
    except TraceError as exc:
        parser.exit(1, f"{parser.prog}: error: {exc}\n")
    options = {k: getattr(args, k) for k in DEFAULTS if k != "admission"}
    if args.table == "policies":
        result = policy_table(trace, admission=args.admission, **options)
    elif args.table == "admission":
        result = admission_table(trace, args.policy, seeds=args.seeds, **options)
    else:
        result = replay(trace, args.policy, admission=args.admission, **options)
    if not args.series:
        for run in result.get("runs", {"": result}).values():
            run.pop("decode_load_series", None)
    emit(result, args.json, _render)


if __name__ == "__main__":
    main()
