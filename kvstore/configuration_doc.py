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

SDK = """## The SDK

`Client(master, ...)` (and `AsyncClient`, which takes the same arguments) is configured
by its arguments; it reads the environment when it is built, never at import.

| argument | default | meaning |
|---|---|---|
| `prefer_shm` | `True` | use shared memory with nodes on this host |
| `data_path` | `None` | force `"tcp"`, `"unix"` or `"shm"` (default: shared memory on this host, else TCP) |
| `verify` | `True` | check each block's XXH3-64 on every read |
| `timeout` | `10.0` | seconds a call to the master may take |
| `location_ttl` | `2.0` | seconds a block location stays cached |
| `placement_ttl`, `placement_bytes` | `1.0`, 64 MiB | one placement serves this many seconds or bytes of puts |
| `replicas` | `0` | copies per put (0: the master's `--replicas`) |
| `token` | KVSTORE_TOKEN | what the pool's access file knows this caller by |
| `tls_ca`, `tls_cert`, `tls_key` | KVSTORE_TLS_CA | TLS to a pool that speaks it; a certificate for mutual TLS |

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
    return ("### `[cost_model]` (file only)\n\nThe conductor's cost model (`kvstore/scheduler/cost_model.py` says what "
            "each term is): the served model's shape, the KV block size in tokens and the hardware. It decides "
            "predicted TTFT and TBT, so set it to the engines the conductor places.\n\n" + "\n".join(rows) + "\n")


def render() -> str:
    from kvstore.cli import main

    parts = [HEAD, "## The commands\n"]
    for name in sorted(main.commands):
        parts.append(command_table(name, main.commands[name]))
    parts.append(cost_model_table())
    parts.append(SDK)
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
