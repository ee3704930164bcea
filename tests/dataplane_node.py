"""A storage node's data plane in a process of its own, for the transport tests.

    python tests/dataplane_node.py --unix PATH --ssd-path DIR [options]

Prints one JSON line ({"address", "unix_path", "arena"}) once it serves, then
serves until its standard input closes (so it dies with the test process).
"""

from __future__ import annotations

import argparse
import json
import sys

from kvstore.node.config import StoreConfig
from kvstore.node.store import BlockStore
from kvstore.transport.server import DataPlaneServer


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--unix", required=True)
    parser.add_argument("--ssd-path")
    parser.add_argument("--dram", default="24MiB")
    parser.add_argument("--ssd", default="128MiB")
    parser.add_argument("--max-block", default="4MiB")
    parser.add_argument("--max-frame", type=int)
    parser.add_argument("--namespaces", help="comma-separated; default: any")
    parser.add_argument("--no-promote", action="store_true", help="SSD hits stay on SSD")
    args = parser.parse_args(argv)
    config = StoreConfig(
        dram_capacity=args.dram,
        ssd_path=args.ssd_path,
        ssd_capacity=args.ssd if args.ssd_path else 0,
        max_block_bytes=args.max_block,
        promote_on_hit=not args.no_promote,
        namespaces=frozenset(args.namespaces.split(",")) if args.namespaces else None,
    )
    with BlockStore(config) as store:
        server = DataPlaneServer(store, unix_path=args.unix, node_id="test-node", max_frame_bytes=args.max_frame)
        server.start()
        print(
            json.dumps({"address": server.address, "unix_path": server.unix_path, "arena": server.info()["arena"]}),
            flush=True,
        )
        sys.stdin.read()
        server.stop()


if __name__ == "__main__":
    main()
