"""docs/configuration.md, generated from the commands' own definitions so it cannot drift.

python -m kvstore.configuration_doc            # rewrite docs/configuration.md
python -m kvstore.configuration_doc --check    # exit 1 if it is out of date (the tests run this)
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import click

from kvstore.config_file import ENV_PREFIX

DOC = Path(__file__).resolve().parent.parent / "docs" / "configuration.md"

HEAD = """# Configuration

Every knob of kvstore in one place. This file is generated from the commands'
definitions (`python -m kvstore.configuration_doc`; a test fails when it is out of
date), so what it says is what the code does.

## Where settings come from

A command's option takes, in this order of precedence:

1. its flag: `kvstore node --dram 8GiB`;
2. its environment variable, `KVSTORE_<COMMAND>_<OPTION>` (the *env* column below):
   `KVSTORE_NODE_DRAM=8GiB`; a few shared ones have names of their own
   (KVSTORE_TOKEN, KVSTORE_TLS_CA, KVSTORE_SHM_DIR);
3. the command's table in the TOML file given with `--config FILE` (or KVSTORE_CONFIG),
   keyed by the flag's name without dashes in front (`max-connections` or
   `max_connections`);
4. its default.

```toml
[node]                     # kvstore node
dram = "64GiB"
ssd = "1TiB"
data-dir = "/data/kv"
max-connections = 4096

[master]                   # kvstore master
replicas = 2
ttl = 5

[cost_model]               # the conductor's cost model: kvstore master and kvstore up
layers = 32
hidden = 4096
block_tokens = 16
```

`kvstore config COMMAND [ARGS...]` prints what COMMAND would run with and where each
value comes from (`--json` for scripts), without running it. A file with an unknown
table or key is refused with a message naming it.
"""

SDK_HEAD = """## The SDK

`Client(master, ...)` (and `AsyncClient`, which takes the same arguments) is configured
by its keyword arguments; it reads the environment when it is built, never at import.
The defaults are the SDK's own constants.

"""

# The meaning of each keyword argument of Client(...), in the signature's order; the table's defaults
# come from the signature itself, and render() refuses a list that is not exactly the Client's arguments.
SDK_ARGUMENTS = {
    "prefer_shm": "use shared memory with nodes on this host",
    "location_ttl": "seconds a block location stays cached (0: none is)",
    "placement_ttl": "seconds one placement from the master serves puts to a namespace",
    "placement_bytes": "bytes of puts one placement serves (a faster writer's grow: `placement_growth`)",
    "replicas": "copies per put (0: the master's `--replicas`)",
    "verify": "check each block's XXH3-64 on every read",
    "timeout": "seconds a call to the master may take",
    "data_path": 'force `"tcp"`, `"unix"` or `"shm"` (default: shared memory on this host, else TCP)',
    "token": "what the pool's access file knows this caller by (default: KVSTORE_TOKEN)",
    "tls_ca": "the CA of a pool that speaks TLS (default: KVSTORE_TLS_CA)",
    "tls_cert": "this client's certificate, for a pool that wants mutual TLS",
    "tls_key": "the key of `tls_cert`",
    "etcd_tls": "how an `etcd://` address reaches etcd (default: KVSTORE_ETCD_CA, KVSTORE_ETCD_CERT, KVSTORE_ETCD_KEY)",
    "window": "request frames in flight on a data-plane connection: the next is sent while the node "
    "answers the previous",
    "keys_per_frame": "blocks in one data-plane frame at most (and the node's `max_items`)",
    "max_unacked_puts": "frames of `wait=False` puts a connection leaves unanswered before it reads the oldest replies",
    "reply_spin_us": "microseconds a connection polls for a small reply before it sleeps (0: never poll; "
    "default: KVSTORE_REPLY_SPIN_US, else 200)",
    "data_timeout": "seconds a data-plane dial, and each socket operation after it, may take (none: no limit)",
    "one_sided_reads": "read blocks of this host's nodes through their block directories, no round trip "
    "(off: every read leases)",
    "location_cache_size": "keys whose locations are cached at most",
    "placement_growth": "a fast writer's placements grow to at most this many times `placement_bytes`",
    "node_refresh_interval": "seconds between two refreshes of the nodes' addresses at most, when dialling one fails",
}

SDK_TAIL = """
| environment | default | meaning |
|---|---|---|
| KVSTORE_TOKEN | none | the caller's token (SDK, CLI, vLLM connector) |
| KVSTORE_TLS_CA | none | the pool's CA, for TLS |
| KVSTORE_REPLY_SPIN_US | `200` | microseconds a client polls for a small reply before sleeping (0: never poll) |
| KVSTORE_SHM_DIR | `/dev/shm` | where nodes put their shared-memory arenas (a tmpfs; huge pages help) |

The vLLM connector's settings (`kv_connector_extra_config`) are in `vllm.md`.

## Tests and benchmarks

| environment | meaning |
|---|---|
| KVSTORE_TEST_VLLM | `0`: `scripts/test` leaves vLLM out and its tests skip |
| KVSTORE_LMCACHE_PYTHON | the Python of an environment with LMCache, for `bench.vllm_reuse`'s peer |
| KVSTORE_HIT_RATE_TRACE | a conversation trace for the hit-rate reference test (skipped without one) |
"""


def client_arguments() -> dict[str, object]:
    """Client(...)'s keyword arguments and their defaults, in the signature's order."""
    import inspect

    from kvstore_client.client import Client

    return {
        name: p.default
        for name, p in inspect.signature(Client.__init__).parameters.items()
        if p.kind is inspect.Parameter.KEYWORD_ONLY
    }


def _sdk_default(value: object) -> str:
    if value is None:
        return "none"
    if type(value) is int and value >= 1 << 20 and value % (1 << 20) == 0:
        return f"`{value >> 20} MiB`"
    return f"`{value:_}`" if type(value) is int and value >= 10_000 else f"`{value}`"


def sdk_section() -> str:
    arguments = client_arguments()
    if list(arguments) != list(SDK_ARGUMENTS):
        raise SystemExit(f"SDK_ARGUMENTS must list Client's keyword arguments in order: {list(arguments)}")
    rows = ["| argument | default | meaning |", "|---|---|---|"]
    rows += [f"| `{name}` | {_sdk_default(default)} | {SDK_ARGUMENTS[name]} |" for name, default in arguments.items()]
    return SDK_HEAD + "\n".join(rows) + "\n" + SDK_TAIL


def _default(param: click.Option) -> str:
    if param.is_flag and not param.secondary_opts:
        return "off"
    value = param.default
    if callable(value) or value is None or value == "":
        return ""
    if isinstance(value, bool) and param.secondary_opts:
        return param.opts[0] if value else param.secondary_opts[0]
    return f"`{value}`"


def _help(param: click.Option) -> str:
    return " ".join((param.help or "").split()).replace("|", "\\|")


def command_table(name: str, command: click.Command) -> str:
    rows = ["| flag | env | default | meaning |", "|---|---|---|---|"]
    for param in command.params:
        if not isinstance(param, click.Option) or param.hidden or "--help" in param.opts:
            continue
        flag = " / ".join(f"`{o}`" for o in (*param.opts, *param.secondary_opts))
        env = param.envvar or f"{ENV_PREFIX}_{name}_{param.name}".upper()
        if isinstance(env, (list, tuple)):
            env = ", ".join(env)
        rows.append(f"| {flag} | {env} | {_default(param)} | {_help(param)} |")
    arguments = [p.human_readable_name for p in command.params if isinstance(p, click.Argument)]
    usage = f"`kvstore {name}{''.join(' ' + a for a in arguments)}`"
    summary = " ".join((command.help or "").split("\n\n")[0].split())
    return f"### {usage}\n\n{summary}\n\n" + "\n".join(rows) + "\n"


def cost_model_table() -> str:
    from kvstore.scheduler.cost_model import CostParams

    rows = ["| key | default |", "|---|---|"]
    rows += [f"| `{f.name}` | `{f.default}` |" for f in dataclasses.fields(CostParams)]
    return (
        "### `[cost_model]` (file only)\n\nThe conductor's cost model (`kvstore/scheduler/cost_model.py` says what "
        "each term is): the served model's shape, the KV block size in tokens and the hardware. It decides "
        "predicted TTFT and TBT, so set it to the engines the conductor places.\n\n" + "\n".join(rows) + "\n"
    )


def render() -> str:
    from kvstore.cli import main

    parts = [HEAD, "## The commands\n"]
    for name in sorted(main.commands):
        parts.append(command_table(name, main.commands[name]))
    parts.append(cost_model_table())
    parts.append(sdk_section())
    return "\n".join(parts)


def main_(argv: list[str]) -> int:
    text = render()
    if "--check" in argv:
        if not DOC.exists() or DOC.read_text() != text:
            print(f"{DOC} is out of date: run python -m kvstore.configuration_doc", file=sys.stderr)
            return 1
        return 0
    DOC.write_text(text)
    print(f"wrote {DOC}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main_(sys.argv[1:]))
