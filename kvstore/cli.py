"""The ``kvstore`` command."""

from __future__ import annotations

import json

import click

from kvstore.units import parse_size


class Size(click.ParamType):
    """A byte size with units (8GiB, 512MiB, 4096)."""

    name = "size"

    def convert(self, value, param, ctx):
        try:
            return parse_size(value)
        except ValueError as exc:
            self.fail(str(exc), param, ctx)


SIZE = Size()


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="kvstore")
def main() -> None:
    """kvstore: a distributed KVCache store for LLM serving."""


@main.command()
@click.option("--data-dir", default="./kvstore-data", show_default=True, help="Where the SSD tier lives.")
@click.option("--dram", type=SIZE, default="64MiB", show_default=True, help="DRAM tier capacity.")
@click.option("--ssd", type=SIZE, default="256MiB", show_default=True, help="SSD tier capacity.")
@click.option("--blocks", type=int, default=96, show_default=True, help="How many blocks to store.")
@click.option("--block-size", type=SIZE, default="1MiB", show_default=True, help="Bytes per block.")
@click.option("--policy", type=click.Choice(["lru", "lfu", "length_aware"]), default="lru", show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def demo(data_dir, dram, ssd, blocks, block_size, policy, as_json) -> None:
    """Store and read back KV blocks in-process, overflowing DRAM into SSD, and print tier stats."""
    from kvstore.demo import run_demo

    result = run_demo(data_dir, dram, ssd, blocks, block_size, policy, echo=(lambda *_: None) if as_json else click.echo)
    if as_json:
        click.echo(json.dumps(result, indent=2))
    if result["verified"] != result["matched"]:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
