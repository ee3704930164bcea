"""The connector's settings, read from ``kv_connector_extra_config`` and checked once at start.

Keys (all optional but ``master``):

- ``master``: the pool's master, ``HOST:PORT``;
- ``namespace``: prefix of every key this engine writes and reads (default ``vllm``);
  engines that should share KV use the same one;
- ``load`` / ``save``: switch loading hits / storing new blocks off (both on by default;
  ``kv_role`` ``kv_consumer`` only loads and ``kv_producer`` only saves, whatever these say);
- ``save_decode``: also store blocks filled by generated tokens (default false: prompts only,
  which is what a later request can hit);
- ``timeout``: seconds one pool call may take before it counts as failed (default 10).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from kvstore_client.errors import ConfigError
from kvstore_client.keys import check_namespace

KNOWN_KEYS = {"master", "namespace", "load", "save", "save_decode", "timeout"}


@dataclass(frozen=True)
class ConnectorSettings:
    master: str
    namespace: str = "vllm"
    load: bool = True
    save: bool = True
    save_decode: bool = False
    timeout: float = 10.0


def _flag(extra: Mapping[str, Any], name: str, default: bool) -> bool:
    value = extra.get(name, default)
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
        return value.lower() in ("true", "1", "yes")
    raise ConfigError(f"kv_connector_extra_config[{name!r}] must be true or false, not {value!r}")


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
    try:
        timeout = float(extra.get("timeout", 10.0))
    except (TypeError, ValueError):
        raise ConfigError(f"kv_connector_extra_config['timeout'] must be a number, not {extra['timeout']!r}") from None
    if not timeout > 0:
        raise ConfigError("kv_connector_extra_config['timeout'] must be positive")
    if kv_role not in ("kv_both", "kv_producer", "kv_consumer"):
        raise ConfigError(f"kv_role must be kv_both, kv_producer or kv_consumer, not {kv_role!r}")
    return ConnectorSettings(
        master=master,
        namespace=namespace,
        load=_flag(extra, "load", True) and kv_role != "kv_producer",
        save=_flag(extra, "save", True) and kv_role != "kv_consumer",
        save_decode=_flag(extra, "save_decode", False),
        timeout=timeout,
    )
