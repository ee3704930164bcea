"""Device checks: CUDA tensors through a local pool, every op, both data paths, and how fast.

    python -m bench.gpu_check --json                # on a machine with a CUDA GPU
    python -m bench.gpu_check --json --device cpu   # the same checks on CPU tensors (a dry run)

Starts a master and one node (processes of their own, like the other benchmarks), then, for
the same-host path (shared memory) and TCP, and for bf16, fp16 and fp32 tensors:

- round trips of every op with device tensors: put / get_into, batch_put / batch_get_into,
  store_prefix / load_prefix, a device put read back as bytes and host bytes read into a
  device tensor, each compared byte for byte; the typed errors (a non-contiguous tensor, one
  too small for the block);
- the vLLM connector's layer-wise mover (``LayerwiseTransfers``) on device tensors in two
  layouts (LBNHC, one run per block; LHBNC, gathered and scattered), saved and loaded back;
- GB/s of put from and get_into into device memory for 1 MiB to 64 MiB, next to torch's
  own host-to-device and device-to-host copies of the same size in the same run, from
  pinned and from pageable host memory; and a same-host get_into by a client that does not
  verify checksums (``verify=False``), to tell the copy's cost from the CPU's hashing.

Progress goes to stderr, the result (JSON with ``--json``) to stdout. Without a usable GPU it
prints ``{"gpu": false, "reason": ...}`` and exits 0. It stops starting new rate rows after
``--budget`` seconds (default 240) so that it ends well within five minutes.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from bench.common import emit, markdown_table

MiB = 1 << 20
DTYPES = ("bfloat16", "float16", "float32")
PATHS = ("shm", "tcp")


def progress(message: str) -> None:
    print(f"[gpu_check] {message}", file=sys.stderr, flush=True)


def detect(device: str) -> tuple[bool, str]:
    """(usable, why not) for ``device`` ("cuda" or "cpu")."""
    try:
        import torch
    except ImportError:
        return False, "torch is not installed"
    if device == "cpu":
        return True, ""
    if not torch.cuda.is_available():
        return False, f"torch {torch.__version__} (CUDA build: {torch.version.cuda}) sees no usable CUDA device"
    return True, ""


def start_pool(tmp: Path, dram: str):
    from bench.cluster import Service

    master = Service(["master", "--port", "0", "--metrics-port", "0", "--ttl", "30"], tmp / "master.err")
    node = Service(
        [
            "node",
            "--master",
            master.record["master"],
            "--port",
            "0",
            "--metrics-port",
            "0",
            "--data-dir",
            str(tmp / "node"),
            "--dram",
            dram,
            "--ssd",
            "0",
            "--max-block",
            "64MiB",
        ],
        tmp / "node.err",
    )
    return master, node


def random_tensor(torch, n_bytes: int, dtype, device, seed: int):
    generator = torch.Generator().manual_seed(seed)
    host = torch.randint(0, 256, (n_bytes,), dtype=torch.uint8, generator=generator)
    return host.view(dtype).to(device)


def same(torch, a, b) -> bool:
    return torch.equal(a.reshape(-1).view(torch.uint8).cpu(), b.reshape(-1).view(torch.uint8).cpu())


def op_checks(client, torch, device, path: str, dtype_name: str) -> list[dict]:
    """Every op once with device tensors; one dict per check (ok, and why not)."""
    from kvstore_client import BlockHasher, BufferTooSmall, InvalidValue, make_key

    dtype = getattr(torch, dtype_name)
    tag = f"{path}-{dtype_name}"
    results = []

    def check(name: str, fn) -> None:
        try:
            ok, detail = fn()
        except Exception as exc:  # reported, not raised: every check runs
            ok, detail = False, f"{type(exc).__name__}: {exc}"
        results.append({"check": name, "path": path, "dtype": dtype_name, "ok": bool(ok), "detail": detail})
        progress(f"{'ok  ' if ok else 'FAIL'} {name} {path} {dtype_name} {detail}")

    def put_get_into():
        src = random_tensor(torch, 3 * MiB + 512, dtype, device, 1)
        key = make_key("gpucheck", f"{tag}-single".encode())
        client.put(key, src)
        out = torch.empty_like(src)
        size = client.get_into(key, out)
        return size == src.numel() * src.element_size() and same(torch, src, out), ""

    def batch():
        srcs = [random_tensor(torch, n, dtype, device, 10 + i) for i, n in enumerate((64 << 10, 1 * MiB, 5 * MiB))]
        keys = [make_key("gpucheck", f"{tag}-batch-{i}".encode()) for i in range(len(srcs))]
        client.batch_put(keys, srcs)
        outs = [torch.empty_like(s) for s in srcs]
        sizes = client.batch_get_into(keys, outs)
        return sizes == [s.numel() * s.element_size() for s in srcs] and all(map(same, [torch] * 3, srcs, outs)), ""

    def prefix():
        hasher = BlockHasher(f"gpucheck-{tag}", block_size=16)
        tokens = list(range(64))
        blocks = [random_tensor(torch, 256 << 10, dtype, device, 20 + i) for i in range(4)]
        client.store_prefix(hasher, tokens, blocks)
        outs = [torch.zeros_like(b) for b in blocks]
        loaded = client.load_prefix(hasher, tokens, outs)
        return loaded == 64 and all(map(same, [torch] * 4, blocks, outs)), f"{loaded} tokens"

    def device_to_bytes_and_back():
        src = random_tensor(torch, 2 * MiB, dtype, device, 30)
        key = make_key("gpucheck", f"{tag}-mixed".encode())
        client.put(key, src)
        as_bytes = client.get(key)
        host_key = make_key("gpucheck", f"{tag}-host".encode())
        client.put(host_key, as_bytes)
        out = torch.empty_like(src)
        client.get_into(host_key, out)
        return as_bytes == src.cpu().reshape(-1).view(torch.uint8).numpy().tobytes() and same(torch, src, out), ""

    def errors():
        key = make_key("gpucheck", f"{tag}-errors".encode())
        client.put(key, random_tensor(torch, 1 * MiB, dtype, device, 40))
        small = torch.empty(1024, dtype=torch.uint8, device=device)
        try:
            client.get_into(key, small)
            return False, "a too small tensor was accepted"
        except BufferTooSmall:
            pass
        strided = torch.empty((256, 256), dtype=dtype, device=device)[:, ::2]
        try:
            client.put(key, strided)
            return False, "a non-contiguous tensor was accepted"
        except InvalidValue:
            pass
        return True, ""

    for name, fn in (
        ("put+get_into", put_get_into),
        ("batch_put+batch_get_into", batch),
        ("store_prefix+load_prefix", prefix),
        ("device put, get as bytes, get_into", device_to_bytes_and_back),
        ("typed errors", errors),
    ):
        check(name, fn)
    return results


def layerwise_checks(client, torch, device, path: str) -> list[dict]:
    """The connector's mover on device KV caches in two layouts, saved then loaded elsewhere."""
    from kvstore_client.vllm.layouts import KV_CACHE_LAYOUTS, describe, layout_format, permuted_strides
    from kvstore_client.vllm.naming import KVLayout, PoolNaming
    from kvstore_client.vllm.plans import BlockTransfer
    from kvstore_client.vllm.transfer import LayerwiseTransfers

    layers, blocks, heads, tokens, head = 4, 8, 4, 16, 64
    results = []
    for name in ("LBNHC", "LHBNC"):
        fmt = layout_format(name, heads, tokens, head, "torch.bfloat16")
        naming = PoolNaming(
            "gpucheck",
            KVLayout(
                model=f"check-{path}-{name}",
                revision="",
                kv_dtype="bf16",
                block_size=tokens,
                num_kv_heads=heads,
                head_size=head,
                num_layers=layers,
                tp_size=1,
                device="cuda",
                hash_algo="sha256",
                block_format=fmt.name(),
            ),
        )

        def caches(fill):
            shape = (layers, blocks, heads, tokens, 2 * head)
            raw = fill(int(torch.tensor(shape).prod()), dtype=torch.bfloat16, device=device)
            full = torch.as_strided(raw, shape, permuted_strides(shape, KV_CACHE_LAYOUTS[name]))
            views = [full[i] for i in range(layers)]
            return views, [
                describe("vllm", v.shape, v.stride(), v.element_size(), "torch.bfloat16", head) for v in views
            ]

        try:
            src, layouts = caches(torch.randn)
            dst, _ = caches(torch.zeros)
            hashes = [f"{path}-{name}-{i}".encode() for i in range(3)]
            saver = LayerwiseTransfers(client, naming, src, layouts, block_format=fmt)
            for layer in range(layers):
                saver.save_layer(layer, [BlockTransfer("a", [1, 3, 5], hashes, 0)])
            saver.finish_saves()
            loader = LayerwiseTransfers(client, naming, dst, layouts, block_format=fmt)
            loader.start_loads([BlockTransfer("b", [0, 2, 4], hashes, 0)])
            for layer in range(layers):
                loader.wait_layer(layer)
            failed = loader.take_load_failures()
            torch.cuda.synchronize() if device.type != "cpu" else None
            ok = not failed and all(
                torch.equal(src[i][s], dst[i][d]) for i in range(layers) for s, d in ((1, 0), (3, 2), (5, 4))
            )
            detail = f"failed blocks {sorted(failed)}" if failed else ""
            saver.close()
            loader.close()
        except Exception as exc:
            ok, detail = False, f"{type(exc).__name__}: {exc}"
        results.append({"check": f"layerwise {name}", "path": path, "dtype": "bfloat16", "ok": ok, "detail": detail})
        progress(f"{'ok  ' if ok else 'FAIL'} layerwise {name} {path} {detail}")
    return results


def timed(fn, repeats: int, sync) -> float:
    """Median seconds of ``fn()`` (``sync()`` after each), after one run not timed."""
    fn()
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    times.sort()
    return times[len(times) // 2]


def rate_row(clients: dict, unverified, torch, device, size: int, repeats: int) -> dict:
    """GB/s of the pool's put / get_into per path, a same-host get_into that skips the checksum
    (``unverified``, a ``Client(verify=False)``: what the copy alone costs), and torch's copies
    of the same size."""
    from kvstore_client import make_key

    sync = torch.cuda.synchronize if device.type != "cpu" else (lambda: None)
    gb = size / 1e9
    src = random_tensor(torch, size, torch.uint8, device, size)
    out = torch.empty_like(src)
    row = {"size_mib": size // MiB}

    def key_of(path: str):
        return make_key("gpucheck-rate", f"{path}-{size}".encode())

    for path, client in clients.items():
        key = key_of(path)
        row[f"{path}_put_gbps"] = round(gb / timed(lambda c=client, k=key: c.put(k, src), repeats, sync), 3)
        row[f"{path}_get_into_gbps"] = round(gb / timed(lambda c=client, k=key: c.get_into(k, out), repeats, sync), 3)
        row[f"{path}_round_trip_ok"] = bool(torch.equal(src, out))
    shm_key = key_of("shm")  # the block the shm client just put
    row["shm_get_into_unverified_gbps"] = round(gb / timed(lambda: unverified.get_into(shm_key, out), repeats, sync), 3)
    pageable = torch.empty(size, dtype=torch.uint8)
    pinned = torch.empty(size, dtype=torch.uint8, pin_memory=device.type != "cpu")
    row["torch_h2d_pinned_gbps"] = round(gb / timed(lambda: out.copy_(pinned, non_blocking=True), repeats, sync), 3)
    row["torch_d2h_pinned_gbps"] = round(gb / timed(lambda: pinned.copy_(src, non_blocking=True), repeats, sync), 3)
    row["torch_h2d_pageable_gbps"] = round(gb / timed(lambda: out.copy_(pageable), repeats, sync), 3)
    row["torch_d2h_pageable_gbps"] = round(gb / timed(lambda: pageable.copy_(src), repeats, sync), 3)
    return row


def run(args) -> dict:
    import torch

    from kvstore_client import Client

    started = time.perf_counter()
    device = torch.device("cuda:0") if args.device == "cuda" else torch.device("cpu")
    result = {
        "gpu": args.device == "cuda",
        "device": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
    }
    sizes = [int(s) * MiB for s in args.sizes.split(",")]
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        master, node = start_pool(Path(tmp), args.dram)
        progress(f"pool up: master {master.record['master']}")
        try:
            clients = {path: Client(master.record["master"], data_path=path) for path in PATHS}
            unverified = Client(master.record["master"], data_path="shm", verify=False)
            checks = []
            for path, client in clients.items():
                for dtype_name in DTYPES:
                    checks += op_checks(client, torch, device, path, dtype_name)
                checks += layerwise_checks(client, torch, device, path)
            rows = []
            for size in sizes:
                if time.perf_counter() - started > args.budget:
                    progress(f"budget of {args.budget} s spent: rates of {size // MiB} MiB and up left out")
                    result["rates_cut_at_mib"] = size // MiB
                    break
                progress(f"rates at {size // MiB} MiB")
                rows.append(rate_row(clients, unverified, torch, device, size, args.repeats))
            for client in (*clients.values(), unverified):
                client.close()
        finally:
            node.close()
            master.close()
    result.update(
        checks=checks,
        rates=rows,
        ok=all(c["ok"] for c in checks) and all(r[f"{p}_round_trip_ok"] for r in rows for p in PATHS),
        seconds=round(time.perf_counter() - started, 1),
    )
    return result


def table(result: dict) -> str:
    if not result.get("checks"):
        return f"gpu: {result['gpu']} ({result.get('reason', '')})"
    failed = [c for c in result["checks"] if not c["ok"]]
    lines = [f"{len(result['checks']) - len(failed)}/{len(result['checks'])} checks passed on {result['device']}"]
    lines += [f"FAILED {c['check']} {c['path']} {c['dtype']}: {c['detail']}" for c in failed]
    keys = [k for k in result["rates"][0] if k.endswith("_gbps")] if result["rates"] else []
    lines.append(markdown_table(["MiB", *keys], [[r["size_mib"], *(r[k] for k in keys)] for r in result["rates"]]))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.add_argument(
        "--device",
        choices=("cuda", "cpu"),
        default="cuda",
        help="cuda (default), or cpu: the same checks on CPU tensors",
    )
    parser.add_argument("--sizes", default="1,4,16,64", help="MiB per block for the rates (default 1,4,16,64)")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per figure; the median is reported")
    parser.add_argument("--dram", default="2GiB", help="the node's DRAM tier")
    parser.add_argument("--budget", type=float, default=240.0, help="seconds after which no new rate row starts")
    args = parser.parse_args(argv)
    usable, reason = detect(args.device)
    if not usable:
        progress(f"no GPU: {reason}")
        emit({"gpu": False, "reason": reason}, args.json, table)
        return 0
    result = run(args)
    emit(result, args.json, table)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
