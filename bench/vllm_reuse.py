"""Prefix reuse with real vLLM engines: what loading a prompt's KV from the pool saves.

``python -m bench.vllm_reuse [--json]`` writes a Llama big enough that CPU prefill is real
work (hidden 1024, 8 layers by default; random weights, no hub), starts a pool and
long-lived engines, each in its own process (``bench.vllm_engine``):

- ``plain``: no connector, the recompute baseline;
- ``producer``: kvstore's connector; computes each prompt and stores its KV;
- ``consumer``: kvstore's connector; has never seen the prompt (its own prefix cache is
  empty for it), so it loads the prompt's full blocks from the pool;
- ``lmcache producer`` / ``lmcache consumer``: the same pair through LMCache's
  ``LMCacheMPConnector`` and an ``lmcache server``, from an environment of its own
  (``bench.peers``), where it runs.

Each run draws new prompts of each length (1k, 2k, 4k tokens), so only the pool can hit.
TTFT is the seconds ``generate`` takes for one output token. Reported, as medians over the
runs: TTFT of recompute, of a hit (and its ratio to recompute), of the producer on a miss
(its ratio to plain: the cost of saving), the tokens the consumer got from the pool, and
whether its output equals plain's. The load path: the bytes the consumer's connector loaded
per second its loader worked, and, without a model, ``LayerwiseTransfers`` loading the
same slabs from the pool against memcpy into the same slabs, in the same run; also the
other choice of value (one block across all layers, copied out of a staging buffer).

Targets: hit TTFT <= 0.2x recompute at 4k tokens; load path >= 0.5x memcpy; saving costs
the producer <= 10% TTFT; kvstore's hit TTFT <= LMCache's.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack

from bench import load_path
from bench.common import die_with_parent, emit, markdown_table
from bench.load_path import GEOMETRIES, GiB, MiB, Geometry
from bench.vllm_engine import EngineProcess, make_llama

TARGETS = {
    "hit_vs_recompute_4k": 0.2,
    "load_vs_memcpy": 0.5,
    "save_vs_memcpy": 0.4,
    "save_overhead": 0.10,
    "master_share_of_kv": 0.001,
}


def start_pool(tmp: str, dram: str) -> tuple[subprocess.Popen, str]:
    """``kvstore up`` (master and one node, DRAM only) on free loopback ports; (process, master).
    It ends with the benchmark, even one that is killed (engines end when their stdin closes)."""
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvstore.cli",
            "up",
            "--port",
            "0",
            "--data-port",
            "0",
            "--metrics-port",
            "-1",
            "--data-dir",
            os.path.join(tmp, "pool"),
            "--dram",
            dram,
            "--ssd",
            "0",
            "--json",
        ],
        stdout=subprocess.PIPE,
        text=True,
        preexec_fn=die_with_parent,
    )
    line = proc.stdout.readline()
    if not line:
        raise SystemExit("kvstore up did not start")
    return proc, json.loads(line)["master"]


def prompt(rng: random.Random, length: int, vocab: int) -> list[int]:
    return [rng.randrange(1, vocab) for _ in range(length)]


def ttft(engine: EngineProcess, tokens: list[int]) -> dict:
    return engine.ask({"prompts": [tokens], "max_tokens": 1, "logprobs": 1}, timeout=900)


def first(answer: dict) -> dict:
    return answer["outputs"][0]


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


# -- engines ----------------------------------------------------------------------------------------
def engine_args(args, model: str, **more) -> list[str]:
    out = [
        "--model",
        model,
        "--dtype",
        args.dtype,
        "--block-size",
        str(args.block_size),
        "--max-model-len",
        str(max(args.lengths) + 64),
        "--kv-cache-bytes",
        str(args.kv_cache_bytes),
    ]
    for flag, value in more.items():
        out += [f"--{flag.replace('_', '-')}", value]
    return out


def measure(args, engines: dict, vocab: int) -> dict:
    """TTFT per engine and length over ``args.runs`` runs of new prompts."""
    rng = random.Random(args.seed)
    loaded = {}  # the consumer connector's (bytes, seconds) so far

    def ask(name: str, tokens: list[int]) -> dict:
        answer = ttft(engines[name], tokens)
        stats = answer.get("connector")
        if name == "consumer" and stats:
            before = loaded.get(name, (0, 0.0))
            loaded[name] = (stats["loaded_bytes"], stats["load_seconds"])
            answer["load_gbps"] = (
                (loaded[name][0] - before[0]) / (loaded[name][1] - before[1]) / 1e9
                if loaded[name][1] > before[1]
                else None
            )
        return answer

    for name in engines:  # first requests pay one-time costs: not measured
        for length in args.lengths:
            ask(name, prompt(rng, length, vocab))
    rows: dict[int, dict[str, list]] = {n: {} for n in args.lengths}
    for _ in range(args.runs):
        for length in args.lengths:
            tokens = prompt(rng, length, vocab)
            row = rows[length]
            plain = ask("plain", tokens)
            row.setdefault("recompute", []).append(plain["seconds"])
            for producer, consumer in (("producer", "consumer"), ("lmcache producer", "lmcache consumer")):
                if producer not in engines:
                    continue
                stored = ask(producer, tokens)
                time.sleep(0.2)  # the master indexes new blocks from the node's reports (~50 ms)
                hit = ask(consumer, tokens)
                row.setdefault(f"{producer}_miss", []).append(stored["seconds"])
                row.setdefault(f"{consumer}_hit", []).append(hit["seconds"])
                row.setdefault(f"{consumer}_cached", []).append(first(hit)["cached"])
                row.setdefault(f"{consumer}_same_output", []).append(first(hit)["tokens"] == first(plain)["tokens"])
                if hit.get("load_gbps"):
                    row.setdefault("consumer_load_gbps", []).append(hit["load_gbps"])
    return rows


def summarise(rows: dict) -> list[dict]:
    out = []
    for length, row in rows.items():
        rec = {"prompt_tokens": length, "recompute_s": median(row["recompute"])}
        for name in ("consumer", "lmcache consumer"):
            if f"{name}_hit" in row:
                key = name.replace(" ", "_")
                rec[f"{key}_hit_s"] = median(row[f"{name}_hit"])
                rec[f"{key}_hit_vs_recompute"] = rec[f"{key}_hit_s"] / rec["recompute_s"]
                rec[f"{key}_cached_tokens"] = median(row[f"{name}_cached"])
                rec[f"{key}_same_output"] = all(row[f"{name}_same_output"])
        for name in ("producer", "lmcache producer"):
            if f"{name}_miss" in row:
                key = name.replace(" ", "_")
                rec[f"{key}_miss_s"] = median(row[f"{name}_miss"])
                rec[f"{key}_miss_vs_plain"] = rec[f"{key}_miss_s"] / rec["recompute_s"]
        if "consumer_load_gbps" in row:
            rec["consumer_load_gbps"] = median(row["consumer_load_gbps"])
        out.append(rec)
    return out


def fmt(value, spec: str = ".3f") -> str:
    return "-" if value is None else (str(value) if isinstance(value, (bool, str)) else format(value, spec))


def table(result: dict) -> str:
    header = [
        "prompt",
        "recompute s",
        "kvstore hit s",
        "x recompute",
        "pool tokens",
        "same",
        "LMCache hit s",
        "x recompute",
        "LMCache tokens",
        "producer miss",
        "saving cost",
        "in-engine load GB/s",
    ]
    rows = [
        [
            r["prompt_tokens"],
            fmt(r["recompute_s"]),
            fmt(r.get("consumer_hit_s")),
            fmt(r.get("consumer_hit_vs_recompute")),
            fmt(r.get("consumer_cached_tokens"), ".0f"),
            fmt(r.get("consumer_same_output")),
            fmt(r.get("lmcache_consumer_hit_s")),
            fmt(r.get("lmcache_consumer_hit_vs_recompute")),
            fmt(r.get("lmcache_consumer_cached_tokens"), ".0f"),
            fmt(r.get("producer_miss_s")),
            fmt(r.get("producer_miss_vs_plain", 1.0) - 1, "+.1%"),
            fmt(r.get("consumer_load_gbps"), ".2f"),
        ]
        for r in result["ttft"]
    ]
    lines = [markdown_table(header, rows), ""] if rows else []
    lines += path_lines(result["load_path"])
    lines += [f"skipped: {note}" for note in result["skipped"]]
    lines += [f"target {name}: {'met' if ok else 'missed'}" for name, ok in result["targets"].items()]
    return "\n".join(lines)


def path_lines(path: dict) -> list[str]:
    """The load path's figures, for people."""
    g, r = path["geometry"], path["rates"]
    lines = [
        f"Load path: {g['name']} ({g['layers']} layers, block {g['block_size']}, {g['dtype']}), "
        f"{path['tokens']} tokens = {r['bytes'] / MiB:.0f} MiB, medians of {path['runs']} runs:",
    ]
    rows = []
    for fmt_name, key in (("one value per block per layer (before)", "per_layer"), ("sliced values (now)", "sliced")):
        prefix = "layer" if key == "per_layer" else "sliced"
        master = path.get("master", {}).get(key)
        rows.append(
            [
                fmt_name,
                path["values_per_1k_tokens"][key],
                path["bytes_a_value"][key],
                f"{r['gbps'][prefix + '_load']:.2f} ({r[prefix + '_load_vs_memcpy']:.2f}x)",
                f"{r['gbps'][prefix + '_save']:.2f} ({r[prefix + '_save_vs_memcpy']:.2f}x)",
                "-"
                if master is None
                else f"{master['master_share_of_kv']:.4%} ({master['master_bytes_per_key']:.0f} B/key)",
            ]
        )
    header = ["format", "values / 1k tokens", "bytes a value", "load GB/s", "save GB/s", "master memory / KV"]
    lines += [markdown_table(header, rows), f"memcpy (one call, same bytes): {r['gbps']['memcpy']:.2f} GB/s"]
    return lines


def path_targets(path: dict) -> dict[str, bool]:
    r = path["rates"]
    met = {
        f"load path >= {TARGETS['load_vs_memcpy']}x memcpy": r["sliced_load_vs_memcpy"] >= TARGETS["load_vs_memcpy"],
        f"layer-wise save >= {TARGETS['save_vs_memcpy']}x memcpy": r["sliced_save_vs_memcpy"]
        >= TARGETS["save_vs_memcpy"],
        "1 value per block per rank": path["values_per_block_per_rank"]["sliced"] == 1,
    }
    if "master" in path:
        share = path["master"]["sliced"]["master_share_of_kv"]
        met[f"master memory <= {TARGETS['master_share_of_kv']:.1%} of KV"] = share <= TARGETS["master_share_of_kv"]
    return met


def targets(result: dict) -> dict[str, bool]:
    met = path_targets(result["load_path"])
    by_len = {r["prompt_tokens"]: r for r in result["ttft"]}
    if not by_len:
        return met
    longest = by_len[max(by_len)]
    met[f"hit <= {TARGETS['hit_vs_recompute_4k']}x recompute at {max(by_len)} tokens"] = (
        longest.get("consumer_hit_vs_recompute", 9) <= TARGETS["hit_vs_recompute_4k"]
    )
    met[f"saving costs <= {TARGETS['save_overhead']:.0%} TTFT"] = all(
        r.get("producer_miss_vs_plain", 9) <= 1 + TARGETS["save_overhead"] for r in result["ttft"]
    )
    if "lmcache_consumer_hit_s" in longest:
        met["kvstore hit <= LMCache hit"] = all(
            r["consumer_hit_s"] <= r["lmcache_consumer_hit_s"] for r in result["ttft"]
        )
    return met


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=lambda s: [int(x) for x in s.split(",")], default=[1024, 2048, 4096])
    parser.add_argument("--runs", type=int, default=3, help="runs of new prompts (figures are medians)")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16", "float16"],
        help="float32: CPUs without native bf16 (AVX512-BF16, AMX) run bf16 several times slower",
    )
    parser.add_argument("--kv-cache-bytes", type=int, default=1 << 30, help="KV cache of each engine")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-lmcache", action="store_true", help="leave LMCache out")
    parser.add_argument("--load-path-only", action="store_true", help="only the load path, no engines")
    parser.add_argument(
        "--geometry",
        choices=sorted(GEOMETRIES),
        help="the load path at a real model's KV shape per rank (default: the bench model's, from --layers etc.)",
    )
    parser.add_argument(
        "--fill",
        type=lambda s: int(float(s) * GiB),
        default=GiB,
        help="GiB of KV stored into a fresh pool, per format, to measure the master's memory (load path only)",
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if min(args.lengths) <= args.block_size or args.runs < 1:
        parser.error("lengths must exceed the block size and --runs be >= 1")
    if not args.load_path_only and (args.block_size % 32 or args.geometry):
        parser.error("engines run blocks of a multiple of 32 tokens and the bench model (--geometry: --load-path-only)")
    from bench import peers

    vocab = 4096
    skipped: list[str] = []
    with tempfile.TemporaryDirectory() as tmp, ExitStack() as stack:
        pool, master = start_pool(tmp, "2GiB")
        stack.callback(pool.wait)
        stack.callback(pool.terminate)
        logs = os.path.join(tmp, "logs")
        os.makedirs(logs)
        # the load path first, while no engine runs beside it
        geometry = GEOMETRIES.get(args.geometry) or Geometry(
            "bench model", args.layers, args.kv_heads, args.hidden // args.heads, args.dtype
        )
        path = load_path.measure(
            master, geometry, args.block_size, max(args.lengths), args.runs, args.fill if args.load_path_only else 0
        )
        path["runs"] = args.runs
        if args.load_path_only:
            emit(report(args, argv, {}, path, skipped), args.json, table)
            return
        model = make_llama(
            os.path.join(tmp, "model"),
            hidden=args.hidden,
            layers=args.layers,
            heads=args.heads,
            kv_heads=args.kv_heads,
            vocab=vocab,
            max_positions=max(args.lengths) + 64,
        )

        def start(name: str, *more: str, **kw) -> EngineProcess:
            engine = EngineProcess([*engine_args(args, model), *more], os.path.join(logs, name + ".log"), **kw)
            stack.callback(engine.close)
            return engine

        namespace = ("--extra", json.dumps({"namespace": f"reuse{os.getpid()}"}))
        engines = {
            "plain": start("plain"),
            "producer": start("producer", "--master", master, *namespace),
            "consumer": start("consumer", "--master", master, *namespace),
        }
        if args.no_lmcache:
            skipped.append("LMCache: --no-lmcache")
        else:
            lmcache = peers.start_lmcache(
                os.path.join(logs, "lmcache-server.log"), block_size=args.block_size, size_gb=2.0
            )
            if isinstance(lmcache, str):
                skipped.append(f"LMCache: {lmcache}")
            else:
                stack.callback(lmcache.stop)
                for role in ("producer", "consumer"):
                    engines[f"lmcache {role}"] = start(
                        f"lmcache-{role}",
                        "--kv-transfer-config",
                        json.dumps(lmcache.kv_transfer_config),
                        python=lmcache.python,
                        env=dict(os.environ, **lmcache.engine_env),
                    )
        skipped += peers.offloading_skip_notes()
        rows = measure(args, engines, vocab)
    emit(report(args, argv, rows, path, skipped), args.json, table)


def report(args, argv, rows: dict, path: dict, skipped: list[str]) -> dict:
    result = {
        "command": "python -m bench.vllm_reuse " + " ".join(argv if argv is not None else sys.argv[1:]),
        "model": {
            "hidden": args.hidden,
            "layers": args.layers,
            "heads": args.heads,
            "kv_heads": args.kv_heads,
            "dtype": args.dtype,
            "block_size": args.block_size,
        },
        "runs": args.runs,
        "ttft": summarise(rows),
        "load_path": path,
        "skipped": skipped,
    }
    result["targets"] = targets(result)
    return result


if __name__ == "__main__":
    main()
