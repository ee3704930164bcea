"""Pool throughput through the SDK next to memcpy, a raw socket and Redis: ``kvstore bench`` from a checkout.

    python -m bench.throughput [--sizes 64KiB,1MiB,4MiB] [--clients 1,4] [--master HOST:PORT]
                               [--no-redis] [--json] [--plot FILE]

Everything is in ``kvstore.benchmark`` (what runs where, how figures and
ratios are taken); this is its command line without click.
"""

from __future__ import annotations

import argparse
import os

from kvstore.benchmark import OPS, TRANSPORTS, Settings, emit, run
from kvstore.units import parse_size


def _list(text: str, allowed=None) -> list[str]:
    items = [x.strip() for x in text.split(",") if x.strip()]
    if allowed is not None:
        bad = [x for x in items if x not in allowed]
        if bad:
            raise argparse.ArgumentTypeError(f"unknown {bad}; choose from {', '.join(allowed)}")
    return items


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--master", default=None, help="benchmark this pool (default: start one in its own process)")
    p.add_argument("--sizes", default="64KiB,1MiB,4MiB", help="comma-separated value sizes")
    p.add_argument("--ops", default=",".join(OPS), type=lambda t: _list(t, OPS))
    p.add_argument("--transports", default=",".join(TRANSPORTS), type=lambda t: _list(t, TRANSPORTS))
    p.add_argument("--clients", default="1,4", help="client process counts, e.g. 1,2,4")
    p.add_argument("--bytes", default="64MiB", help="working set of each client at each size")
    p.add_argument("--batch", type=int, default=64, help="blocks per batch call / Redis pipeline")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds; figures are medians")
    p.add_argument("--dram", default=None, help="DRAM of the pool started here (default: twice the working set)")
    p.add_argument("--no-redis", action="store_true", help="skip the Redis baselines")
    p.add_argument("--shm-dir", help="directory (a tmpfs) for the arena of the pool started here")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--json", action="store_true")
    p.add_argument("--plot", default=None, metavar="FILE", help="write a PNG of GB/s against value size")
    return p


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    ops = args.ops if isinstance(args.ops, list) else _list(args.ops, OPS)
    transports = args.transports if isinstance(args.transports, list) else _list(args.transports, TRANSPORTS)
    settings = Settings(sizes=[parse_size(s) for s in _list(args.sizes)], ops=ops, transports=transports,
                        clients=[int(c) for c in _list(args.clients)], bytes_per_client=parse_size(args.bytes),
                        batch=args.batch, rounds=args.rounds, master=args.master,
                        dram=parse_size(args.dram) if args.dram else None, redis=not args.no_redis,
                        progress=not args.quiet)
    if args.shm_dir:
        os.environ["KVSTORE_SHM_DIR"] = args.shm_dir  # read by the pool process the benchmark starts
    emit(run(settings), args.json, args.plot)


if __name__ == "__main__":
    main()
