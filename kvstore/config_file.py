"""One configuration story for the `kvstore` commands: flags, environment, a TOML file.

Every option of a command can come from, in this order of precedence:

1. its flag (``kvstore node --dram 8GiB``);
2. its environment variable, ``KVSTORE_<COMMAND>_<OPTION>`` (``KVSTORE_NODE_DRAM=8GiB``;
   a few shared ones keep a name of their own: KVSTORE_TOKEN, KVSTORE_TLS_CA,
   KVSTORE_SHM_DIR);
3. the command's table of the file given with ``--config FILE`` (or KVSTORE_CONFIG),
   keyed by the option's name, with dashes or underscores::

       [node]
       dram = "8GiB"
       max-connections = 2048

       [master]
       replicas = 2

       [cost_model]          # the conductor's cost model (kvstore.scheduler.cost_model.CostParams)
       layers = 32
       block_tokens = 16

4. its default.

`kvstore config COMMAND [ARGS...]` prints what a command would run with, and
where each value came from. docs/configuration.md lists every knob
(generated from these definitions by ``python -m kvstore.configuration_doc``).
"""

from __future__ import annotations

import dataclasses

import click

from kvstore_client.errors import ConfigError
from kvstore.toml_files import read_toml

CONFIG_ENV = "KVSTORE_CONFIG"
ENV_PREFIX = "KVSTORE"
SHARED_TABLES = ("cost_model",)  # tables that are no command's options
_DOCUMENT_KEY = "kvstore.config_document"


def command_defaults(document: dict, command: click.Command, name: str, path: str) -> dict:
    """The ``[name]`` table as defaults for ``command``'s parameters (by parameter name);
    ConfigError naming an unknown key."""
    table = document.get(name, {})
    if not isinstance(table, dict):
        raise ConfigError(f"{path}: [{name}] must be a table")
    options = {}
    for param in command.params:
        if isinstance(param, click.Option) and param.name != "config":  # shm-dir too: it acts in its callback
            for flag in param.opts:
                options[flag.lstrip("-")] = param.name
            options[param.name] = param.name
    defaults = {}
    for key, value in table.items():
        target = options.get(key) or options.get(key.replace("_", "-"))
        if target is None or target == "config":
            known = sorted(k for k in options if "_" not in k and k != "config")
            raise ConfigError(f"{path}: [{name}] has no option {key!r} (options: {', '.join(known)})")
        defaults[target] = value
    return defaults


def check_tables(document: dict, commands: dict, path: str) -> None:
    """Every top-level table is a command's or a shared one."""
    for name in document:
        if name not in commands and name not in SHARED_TABLES:
            raise ConfigError(
                f"{path}: unknown table [{name}] (commands: {', '.join(sorted(commands))}; "
                f"shared: {', '.join(SHARED_TABLES)})"
            )


def _load(ctx: click.Context, param, value):
    """--config's callback (eager): the file's table becomes the command's defaults."""
    if not value:
        return value
    document = read_toml(value)
    root = ctx.find_root()
    check_tables(document, getattr(root.command, "commands", {}), value)
    ctx.default_map = {**command_defaults(document, ctx.command, ctx.info_name, value), **(ctx.default_map or {})}
    ctx.meta[_DOCUMENT_KEY] = document
    return value


config_option = click.option(
    "--config",
    "config",
    metavar="FILE",
    envvar=CONFIG_ENV,
    is_eager=True,
    expose_value=False,
    callback=_load,
    help="TOML file whose [COMMAND] table sets this command's defaults (flags and KVSTORE_* variables win; "
    "see docs/configuration.md) [env KVSTORE_CONFIG].",
)


def shared_table(ctx: click.Context, name: str, cls):
    """The dataclass ``cls`` filled from the config file's shared table ``name`` (None: no such
    table); ConfigError for a key ``cls`` does not have."""
    document = ctx.meta.get(_DOCUMENT_KEY) or {}
    table = document.get(name)
    if table is None:
        return None
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = set(table) - fields
    if unknown:
        raise ConfigError(f"[{name}] has no key(s) {sorted(unknown)} (keys: {', '.join(sorted(fields))})")
    try:
        return cls(**table)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"[{name}]: {exc}") from None


def effective(command: click.Command, name: str, args: list[str], parent: click.Context) -> list[dict]:
    """What ``command`` would run with given ``args``: one record per option (name, flag, value,
    source: command line, environment, config file or default), without running it."""
    ctx = command.make_context(name, list(args), parent=parent)
    out = []
    for param in command.params:
        if not isinstance(param, click.Option) or not param.expose_value or param.name == "as_json":
            continue
        source = ctx.get_parameter_source(param.name)
        value = ctx.params.get(param.name)
        if param.name in ("token",) and value:
            value = "(set)"
        out.append(
            {
                "option": param.opts[0],
                "value": value,
                "source": _SOURCES.get(source.name if source else "", "default"),
                "env": param.envvar or _auto_envvar(name, param),
            }
        )
    if name in COST_MODEL_COMMANDS:
        from kvstore.scheduler.cost_model import CostParams

        given = shared_table(ctx, "cost_model", CostParams)
        for f in dataclasses.fields(CostParams):
            out.append(
                {
                    "option": f"[cost_model] {f.name}",
                    "value": getattr(given or CostParams(), f.name),
                    "source": "config file" if given is not None and f.name in _table(ctx, "cost_model") else "default",
                    "env": "",
                }
            )
    return out


COST_MODEL_COMMANDS = ("master", "up")  # the commands that run a conductor


def _table(ctx: click.Context, name: str) -> dict:
    return (ctx.meta.get(_DOCUMENT_KEY) or {}).get(name) or {}


_SOURCES = {
    "COMMANDLINE": "command line",
    "ENVIRONMENT": "environment",
    "DEFAULT_MAP": "config file",
    "DEFAULT": "default",
    "PROMPT": "prompt",
}


def _auto_envvar(command: str, param: click.Option) -> str:
    return f"{ENV_PREFIX}_{command}_{param.name}".upper().replace("-", "_")
