"""The connector's settings, read from ``kv_connector_extra_config`` and checked once at start.

Keys (all optional but ``master``):

- ``master``: the pool's master, ``HOST:PORT``;
- ``namespace``: prefix of every key this engine writes and reads (default ``vllm``);
  engines that should share KV use the same one;
- ``load`` / ``save``: switch loading hits / storing new blocks off (both on by default;
  ``kv_role`` ``kv_consumer`` only loads and ``kv_producer`` only saves, whatever these say);
- ``save_decode``: also store blocks filled by generated tokens (default false: prompts only,
  which is what a later request can hit);
- ``partial_blocks``: also store and load a prompt's partial last block, under a key of its own
  (``kvstore_client.vllm_hashing.tail_hash``), so an engine that finds the whole prompt in the
  pool computes only its last token (default true; never for multimodal or prompt-embeds
  requests, whose KV the tokens alone do not name);
- ``timeout``: seconds one pool call may take before it counts as failed (default 10);
- ``lookup_timeout``: seconds the scheduler's prefix lookup may take (default 0.01): past
  it the request is scheduled as a miss, and after ``LOOKUP_FAILURES`` failed lookups in a row
  the pool is not asked for a while (``kvstore_client.vllm.lookup``), so a master that hangs
  never stalls vLLM's scheduler;
- ``role``: ``prefill``, ``decode`` or ``both``: register the engine with the master's conductor
  in that role, report its load and announce it to ``kvstore router`` (default: none, the
  engine serves on its own); needs ``engine_url``;
- ``engine_url``: the base URL of the engine's OpenAI server (``http://HOST:PORT``), where the
  router sends its requests;
- ``engine_id``: the id the engine registers under (default: ``engine_url``);
- ``load_report_interval``: seconds between load reports to the conductor (default 0.5).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from kvstore_client.errors import ConfigError
from kvstore_client.keys import check_namespace

KNOWN_KEYS = {
    "master",
    "namespace",
    "load",
    "save",
    "save_decode",
    "partial_blocks",
    "timeout",
    "lookup_timeout",
    "role",
    "engine_url",
    "engine_id",
    "load_report_interval",
}
ROLES = ("prefill", "decode", "both")


@dataclass(frozen=True)
class ConnectorSettings:
    master: str
    namespace: str = "vllm"
    load: bool = True
    save: bool = True
    save_decode: bool = False
    partial_blocks: bool = True
    timeout: float = 10.0
    lookup_timeout: float = 0.01
    role: str | None = None  # prefill, decode, both; None: not registered with the conductor
    engine_url: str | None = None
    engine_id: str | None = None  # engine_url unless set
    load_report_interval: float = 0.5


def _flag(extra: Mapping[str, Any], name: str, default: bool) -> bool:
    value = extra.get(name, default)
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
        return value.lower() in ("true", "1", "yes")
    raise ConfigError(f"kv_connector_extra_config[{name!r}] must be true or false, not {value!r}")


def _seconds(extra: Mapping[str, Any], name: str, default: float) -> float:
    """A positive number of seconds; ConfigError naming the key otherwise."""
    value = extra.get(name, default)
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"kv_connector_extra_config[{name!r}] must be a number, not {value!r}") from None
    if not seconds > 0:
        raise ConfigError(f"kv_connector_extra_config[{name!r}] must be positive")
    return seconds


def read_settings(extra: Mapping[str, Any] | None, kv_role: str | None) -> ConnectorSettings:
    """Settings from the extra config and vLLM's ``kv_role``; ConfigError on anything unusable."""
    extra = dict(extra or {})
    unknown = set(extra) - KNOWN_KEYS
    if unknown:
        raise ConfigError(f"unknown kv_connector_extra_config keys {sorted(unknown)}; known: {sorted(KNOWN_KEYS)}")
    master = extra.get("master")
    if not isinstance(master, str) or ":" not in master:
        raise ConfigError("kv_connector_extra_config needs 'master': the pool's HOST:PORT")
    namespace = extra.get("namespace", "vllm")
    try:
        check_namespace(namespace)
    except Exception as exc:
        raise ConfigError(f"kv_connector_extra_config['namespace']: {exc}") from None
    if "/" in namespace:
        raise ConfigError("kv_connector_extra_config['namespace'] may not contain '/'")
    timeout = _seconds(extra, "timeout", 10.0)
    lookup_timeout = _seconds(extra, "lookup_timeout", 0.01)
    role = extra.get("role")
    if role is not None and role not in ROLES:
        raise ConfigError(f"kv_connector_extra_config['role'] must be one of {', '.join(ROLES)}, not {role!r}")
    engine_url = extra.get("engine_url")
    if engine_url is not None and not (
        isinstance(engine_url, str)
        and engine_url.startswith(("http://", "https://"))
        and len(engine_url.split("://", 1)[1].strip("/")) > 0
    ):
        raise ConfigError(
            f"kv_connector_extra_config['engine_url'] must be the engine's http://HOST:PORT, not {engine_url!r}"
        )
    if role is not None and engine_url is None:
        raise ConfigError(
            "kv_connector_extra_config['role'] needs 'engine_url': the base URL of this engine's "
            "OpenAI server, where the router sends requests"
        )
    engine_id = extra.get("engine_id", engine_url.rstrip("/") if engine_url else None)
    if engine_id is not None and (not isinstance(engine_id, str) or not engine_id or "#" in engine_id):
        raise ConfigError(
            f"kv_connector_extra_config['engine_id'] must be a non-empty string without '#', not {engine_id!r}"
        )
    interval = _seconds(extra, "load_report_interval", 0.5)
    if kv_role not in ("kv_both", "kv_producer", "kv_consumer"):
        raise ConfigError(f"kv_role must be kv_both, kv_producer or kv_consumer, not {kv_role!r}")
    return ConnectorSettings(
        master=master,
        namespace=namespace,
        load=_flag(extra, "load", True) and kv_role != "kv_producer",
        save=_flag(extra, "save", True) and kv_role != "kv_consumer",
        save_decode=_flag(extra, "save_decode", False),
        partial_blocks=_flag(extra, "partial_blocks", True),
        timeout=timeout,
        lookup_timeout=lookup_timeout,
        role=role,
        engine_url=engine_url.rstrip("/") if engine_url else None,
        engine_id=engine_id,
        load_report_interval=interval,
    )
