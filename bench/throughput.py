"""Pool throughput through the SDK next to memcpy, a raw socket and Redis: ``kvstore bench`` from a checkout.

    python -m bench.throughput [--sizes 64KiB,1MiB,4MiB] [--clients 1,4] [--master HOST:PORT]
                               [--no-redis] [--json] [--plot FILE]

Everything is in ``kvstore.benchmark`` (what runs where, how figures and
ratios are taken); this is its command line without click.
"""

from __future__ import annotations

import argparse
import os

from kvstore.benchmark import OPS, TRANSPORTS, Settings, emit, parse_list, run
from kvstore.units import parse_size


def _choices(allowed):
    """An argparse type: the comma-separated items of ``allowed``."""

    def parse(text: str) -> list[str]:
        try:
            return parse_list(text, allowed)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return parse


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--master", default=None, help="benchmark this pool (default: start one in its own process)")
    p.add_argument("--sizes", default="64KiB,1MiB,4MiB", help="comma-separated value sizes")
    p.add_argument("--ops", default=",".join(OPS), type=_choices(OPS))
    p.add_argument("--transports", default=",".join(TRANSPORTS), type=_choices(TRANSPORTS))
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
    p = parser()
    args = p.parse_args(argv)  # string defaults go through their type too: ops, transports are lists
    try:
        settings = Settings(
            sizes=[parse_size(s) for s in parse_list(args.sizes)],
            ops=args.ops,
            transports=args.transports,
            clients=[int(c) for c in parse_list(args.clients)],
            bytes_per_client=parse_size(args.bytes),
            batch=args.batch,
            rounds=args.rounds,
            master=args.master,
            dram=parse_size(args.dram) if args.dram else None,
            redis=not args.no_redis,
            progress=not args.quiet,
        )
    except ValueError as exc:  # ConfigError from parse_size included
        p.error(str(exc))
    if args.shm_dir:
        os.environ["KVSTORE_SHM_DIR"] = args.shm_dir  # read by the pool process the benchmark starts
    emit(run(settings), args.json, args.plot)


if __name__ == "__main__":
    main()
