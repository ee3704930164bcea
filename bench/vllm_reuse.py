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

from bench.common import die_with_parent, emit, markdown_table
from bench.vllm_engine import EngineProcess, make_llama

TARGETS = {"hit_vs_recompute_4k": 0.2, "load_vs_memcpy": 0.5, "save_overhead": 0.10}


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


# -- load path without a model ----------------------------------------------------------------
def load_path(master: str, *, layers: int, blocks: int, slab_shape: tuple, dtype: str, repeats: int) -> dict:
    """GB/s of loading ``blocks`` blocks x ``layers`` layers from the pool into KV-shaped tensors,
    one value per block per layer (what the connector does) and one value per block across all
    layers (a staging copy each), against memcpy into the same slabs; medians, interleaved."""
    import torch

    from kvstore_client import Client
    from kvstore_client.vllm.naming import KVLayout, PoolNaming
    from kvstore_client.vllm.plans import BlockTransfer
    from kvstore_client.vllm.transfer import LayerwiseTransfers

    torch_dtype = getattr(torch, dtype)
    total_blocks = 2 * blocks
    source = [torch.randn(total_blocks, *slab_shape).to(torch_dtype) for _ in range(layers)]
    target = [torch.zeros(total_blocks, *slab_shape, dtype=torch_dtype) for _ in range(layers)]
    slab = source[0][0].nbytes
    total = slab * blocks * layers
    layout = KVLayout(
        model="load-path",
        revision=str(time.time_ns()),
        kv_dtype=dtype,
        block_size=slab_shape[1],
        num_kv_heads=slab_shape[0],
        head_size=slab_shape[2],
        num_layers=layers,
        tp_size=1,
        device="cpu",
        hash_algo="sha256",
    )
    naming = PoolNaming("bench", layout)
    hashes = [i.to_bytes(32, "big") for i in range(blocks)]
    transfer = [BlockTransfer("r", list(range(blocks)), hashes, 0)]
    into = [BlockTransfer("r", list(range(blocks, total_blocks)), hashes, 0)]
    whole_keys = [("bench/whole-" + layout.fingerprint(0), h) for h in hashes]
    staging = torch.empty(layers, *slab_shape, dtype=torch_dtype)
    cold = torch.randn(blocks * layers, *slab_shape).to(torch_dtype)  # memcpy's source: as big as what is loaded
    with Client(master) as client:
        saver = LayerwiseTransfers(client, naming, source)
        for layer in range(layers):
            saver.save_layer(layer, transfer)
        saver.finish_saves()
        client.batch_put(
            whole_keys, [torch.stack([source[l][b] for l in range(layers)]).contiguous() for b in range(blocks)]
        )
        deadline = time.monotonic() + 10
        while client.match_prefix(naming.keys(layers - 1, hashes)).longest < blocks and time.monotonic() < deadline:
            time.sleep(0.05)
        loader = LayerwiseTransfers(client, naming, target)

        def per_layer() -> None:
            loader.start_loads(into)
            for layer in range(layers):
                loader.wait_layer(layer)
            if loader.take_load_failures():
                raise SystemExit("load path: blocks missing from the pool")

        def whole_block() -> None:
            for i, key in enumerate(whole_keys):
                if client.get_into(key, staging) is None:
                    raise SystemExit("load path: blocks missing from the pool")
                for layer in range(layers):
                    target[layer][blocks + i].copy_(staging[layer])

        def memcpy() -> None:
            i = 0
            for layer in range(layers):
                for b in range(blocks, total_blocks):
                    target[layer][b].copy_(cold[i])
                    i += 1

        seconds: dict[str, list[float]] = {"per_layer": [], "whole_block": [], "memcpy": []}
        for _ in range(repeats):
            for name, run in (("memcpy", memcpy), ("per_layer", per_layer), ("whole_block", whole_block)):
                start = time.perf_counter()
                run()
                seconds[name].append(time.perf_counter() - start)
        if not all(torch.equal(source[l][b], target[l][blocks + b]) for l in range(layers) for b in range(blocks)):
            raise SystemExit("load path: loaded bytes differ from the stored ones")
        loader.close()
        saver.close()
    gbps = {name: total / statistics.median(s) / 1e9 for name, s in seconds.items()}
    return {
        "bytes": total,
        "slab_bytes": slab,
        "gbps": gbps,
        "per_layer_vs_memcpy": gbps["per_layer"] / gbps["memcpy"],
        "whole_block_vs_memcpy": gbps["whole_block"] / gbps["memcpy"],
    }


def median_path(runs: list[dict]) -> dict:
    """One load-path record from several: the medians, and each ratio's range."""
    out = {
        "bytes": runs[0]["bytes"],
        "slab_bytes": runs[0]["slab_bytes"],
        "runs": len(runs),
        "gbps": {name: median([r["gbps"][name] for r in runs]) for name in runs[0]["gbps"]},
    }
    for ratio in ("per_layer_vs_memcpy", "whole_block_vs_memcpy"):
        values = [r[ratio] for r in runs]
        out[ratio], out[ratio + "_range"] = median(values), [min(values), max(values)]
    return out


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
    lp = result["load_path"]
    lines = [markdown_table(header, rows), ""] if rows else []
    lines += [
        f"Load path ({lp['bytes'] >> 20} MiB, {lp['slab_bytes'] >> 10} KiB slabs, medians of {lp['runs']} runs): "
        f"per layer {lp['gbps']['per_layer']:.2f} GB/s ({lp['per_layer_vs_memcpy']:.2f}x memcpy, "
        f"{lp['per_layer_vs_memcpy_range'][0]:.2f}-{lp['per_layer_vs_memcpy_range'][1]:.2f}), "
        f"whole block + staging copy {lp['gbps']['whole_block']:.2f} GB/s "
        f"({lp['whole_block_vs_memcpy']:.2f}x), memcpy {lp['gbps']['memcpy']:.2f} GB/s"
    ]
    lines += [f"skipped: {note}" for note in result["skipped"]]
    lines += [f"target {name}: {'met' if ok else 'missed'}" for name, ok in result["targets"].items()]
    return "\n".join(lines)


def targets(result: dict) -> dict[str, bool]:
    met = {
        f"load path >= {TARGETS['load_vs_memcpy']}x memcpy": result["load_path"]["per_layer_vs_memcpy"]
        >= TARGETS["load_vs_memcpy"]
    }
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
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if min(args.lengths) <= args.block_size or args.runs < 1 or args.block_size % 32:
        parser.error("lengths must exceed the block size, --runs be >= 1, and the block size a multiple of 32")
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
        slab_shape = (args.kv_heads, args.block_size, 2 * args.hidden // args.heads)
        path = median_path(
            [
                load_path(
                    master,
                    layers=args.layers,
                    blocks=max(args.lengths) // args.block_size,
                    slab_shape=slab_shape,
                    dtype=args.dtype,
                    repeats=7,
                )
                for _ in range(args.runs)
            ]
        )
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
