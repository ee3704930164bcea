"""The access file: tokens, their roles, namespaces and quotas (``--auth FILE``).

    [tokens.acme]
    secret = "..."                     # or secret_sha256 = "<hex of sha256(secret)>"
    role = "tenant"                    # admin | node | tenant | metrics
    namespaces = ["acme", "acme-*"]    # tenants only: exact names, or prefixes ending in *
    quota = "64GiB"                    # tenants only, optional: bytes held across the pool

A metrics token may scrape the Prometheus endpoints and nothing else: every gRPC
method, the conductor port and the data plane refuse it (they admit only
``SERVICE_ROLES``); an admin token may scrape too (``SCRAPE_ROLES``).

The file is as secret as the tokens (its hashes key the data plane's
challenge-response), so it must not be readable by group or others: loading
refuses one that is. Loading checks everything and raises ConfigError naming
the entry; nothing is half-loaded.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import stat
import threading
from dataclasses import dataclass, field

from kvstore_client.auth import DataKey
from kvstore_client.errors import ConfigError
from kvstore_client.keys import check_namespace
from kvstore_client.leader_record import pool_key
from kvstore.toml_files import read_toml
from kvstore.units import parse_size

ADMIN, NODE, TENANT, METRICS = "admin", "node", "tenant", "metrics"
ROLES = (ADMIN, NODE, TENANT, METRICS)
SERVICE_ROLES = frozenset({ADMIN, NODE, TENANT})  # may call the services (each method its own subset)
SCRAPE_ROLES = frozenset({ADMIN, METRICS})  # may read /metrics
MIN_SECRET_CHARS = 16
_ENTRY_KEYS = {"secret", "secret_sha256", "role", "namespaces", "quota"}
log = logging.getLogger(__name__)
_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
_HEX = re.compile(r"^[0-9a-fA-F]{64}$")


@dataclass(frozen=True)
class Principal:
    """Who a caller is once its token checked out. Tenants are confined to their namespaces
    (``may_use``); admins and nodes are not; a metrics token reaches none."""

    name: str
    role: str
    namespaces: tuple[str, ...] = ()
    quota: int | None = None
    _exact: frozenset = field(default=frozenset(), repr=False, compare=False)
    _prefixes: tuple[str, ...] = field(default=(), repr=False, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "_exact", frozenset(p for p in self.namespaces if not p.endswith("*")))
        object.__setattr__(self, "_prefixes", tuple(p[:-1] for p in self.namespaces if p.endswith("*")))

    @property
    def confined(self) -> bool:
        """Whether the namespaces bind this principal (tenants; metrics tokens, which have none)."""
        return self.role not in (ADMIN, NODE)

    def may_use(self, namespace: str) -> bool:
        if self.role in (ADMIN, NODE):
            return True
        return namespace in self._exact or namespace.startswith(self._prefixes)


ANYONE = Principal("", ADMIN)  # the caller of a service that checks no tokens


@dataclass(frozen=True)
class Entry:
    principal: Principal
    key: DataKey
    secret: str | None  # the token itself, when the file has it (not just its hash)


class _Tokens:
    """One version of an access file's entries, indexed the ways callers look them up."""

    __slots__ = ("entries", "by_hash", "by_key_id")

    def __init__(self, entries: list[Entry], source: str):
        self.entries = list(entries)
        self.by_hash = {e.key.key: e for e in entries}
        self.by_key_id = {e.key.key_id: e for e in entries}
        if len(self.by_hash) != len(entries):
            raise ConfigError(f"{source}: two entries share one secret")


class AccessList:
    """The tokens of one access file, looked up by bearer token or by data-plane key id.

    ``reload()`` reads the file again (on SIGHUP, or when it changes: ``access_reload``): the
    lookups see the new tokens at once, ``generation`` counts the versions, and the callbacks
    given to ``subscribe`` run, so that each service closes the connections whose token was
    removed or changed (``still_valid``). A file that no longer loads keeps the old tokens."""

    def __init__(self, entries: list[Entry], source: str = "<access list>"):
        self.source = source
        self._tokens = _Tokens(entries, source)
        self.generation = 0  # bumped by every reload that changed something
        self._listeners: list = []
        self._reload_lock = threading.Lock()

    @classmethod
    def load(cls, path: str) -> "AccessList":
        """Parse and check the file at ``path``; ConfigError says what is wrong and where."""
        try:
            mode = stat.S_IMODE(os.stat(path).st_mode)
        except OSError as exc:
            raise ConfigError(f"cannot read access file {path}: {exc.strerror or exc}") from None
        if mode & 0o077:
            raise ConfigError(
                f"{path} is readable by others (mode {mode:04o}): it holds the tokens' keys; chmod 600 {path}"
            )
        return cls.parse(read_toml(path, "access file"), path)

    @classmethod
    def parse(cls, document: dict, source: str = "<access list>") -> "AccessList":
        unknown = set(document) - {"tokens"}
        if unknown:
            raise ConfigError(f"{source}: unknown table(s) {sorted(unknown)}; tokens go under [tokens.NAME]")
        tokens = document.get("tokens")
        if not isinstance(tokens, dict) or not tokens:
            raise ConfigError(f"{source}: no [tokens.NAME] entries")
        return cls([_entry(name, body, source) for name, body in tokens.items()], source)

    def __len__(self) -> int:
        return len(self._tokens.entries)

    def bearer(self, token: str | None) -> Principal | None:
        """The principal of a bearer token (gRPC), or None when it is no token of this file."""
        if not token:
            return None
        entry = self._tokens.by_hash.get(hashlib.sha256(token.encode()).digest())
        return None if entry is None else entry.principal

    def data_key(self, key_id: bytes) -> tuple[DataKey, Principal] | None:
        """The key and principal a data-plane hello names, or None."""
        entry = self._tokens.by_key_id.get(bytes(key_id))
        return None if entry is None else (entry.key, entry.principal)

    def still_valid(self, key: DataKey, principal: Principal) -> bool:
        """Whether the token of ``key`` is still in the file, as ``principal`` (same name, role,
        namespaces and quota): what a connection that authenticated with it may go on using."""
        entry = self._tokens.by_hash.get(key.key)
        return entry is not None and entry.principal == principal

    # -- reloading ----------------------------------------------------------------------------
    def subscribe(self, callback) -> None:
        """Call ``callback()`` after each reload that changed the tokens."""
        self._listeners.append(callback)

    def reload(self) -> bool:
        """Read ``source`` again; whether the tokens changed. A file that does not load (ConfigError)
        is logged and the tokens in force stay."""
        with self._reload_lock:
            try:
                fresh = AccessList.load(self.source)
            except ConfigError as exc:
                log.error("access file not reloaded, the tokens in force stay: %s", exc)
                return False
            old = self._tokens
            if _same(old.entries, fresh._tokens.entries):
                return False
            self._tokens = fresh._tokens
            self.generation += 1
            gone = {e.principal.name for e in old.entries} - {e.principal.name for e in fresh._tokens.entries}
            log.warning(
                "access file %s reloaded: %d tokens%s",
                self.source,
                len(fresh),
                f"; removed: {', '.join(sorted(gone))}" if gone else "",
            )
        for callback in list(self._listeners):
            try:
                callback()
            except Exception:  # one service's trouble must not keep the others on old tokens
                log.exception("applying the reloaded access file failed")
        return True

    def service_token(self) -> str | None:
        """The first node or admin token the file holds in full: what `kvstore up` runs its own
        node with, when no --token is given."""
        for role in (NODE, ADMIN):
            for e in self._tokens.entries:
                if e.principal.role == role and e.secret is not None:
                    return e.secret
        return None

    def service_key(self) -> DataKey | None:
        """A node or admin data-plane key: what the master sends its PULLs with."""
        for role in (NODE, ADMIN):
            for e in self._tokens.entries:
                if e.principal.role == role:
                    return e.key
        return None

    def principals(self) -> list[Principal]:
        return [e.principal for e in self._tokens.entries]

    def pool_key(self) -> bytes:
        """The key masters sign the leader key in etcd with, and masters and nodes check it by
        (kvstore_client.leader_record): derived from the admin and node tokens, so tenants
        cannot derive it."""
        return pool_key(e.key.key for e in self._tokens.entries if e.principal.role in (ADMIN, NODE))


def _same(a: list[Entry], b: list[Entry]) -> bool:
    return sorted((e.principal.name, e.key.key, repr(e.principal)) for e in a) == sorted(
        (e.principal.name, e.key.key, repr(e.principal)) for e in b
    )


def check_token_name(name: str, where: str = "") -> str:
    if not isinstance(name, str) or not _NAME.match(name):
        raise ConfigError(f"{where or repr(name)}: a token name is 1-64 letters, digits, '.', '_' or '-'")
    return name


def _entry(name: str, body, source: str) -> Entry:
    where = f"{source}: [tokens.{name}]"
    check_token_name(name, where)
    if not isinstance(body, dict):
        raise ConfigError(f"{where} must be a table")
    unknown = set(body) - _ENTRY_KEYS
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {sorted(unknown)} (known: {sorted(_ENTRY_KEYS)})")
    role = body.get("role")
    if role not in ROLES:
        raise ConfigError(f"{where}: role must be one of {ROLES}, got {role!r}")
    secret, hashed = body.get("secret"), body.get("secret_sha256")
    if (secret is None) == (hashed is None):
        raise ConfigError(f"{where}: give exactly one of secret and secret_sha256")
    if secret is not None:
        if not isinstance(secret, str) or len(secret) < MIN_SECRET_CHARS or secret != secret.strip():
            raise ConfigError(
                f"{where}: a secret is a string of at least {MIN_SECRET_CHARS} characters without "
                "surrounding blanks (`kvstore token` makes one)"
            )
        key = DataKey.of_token(secret)
    else:
        if not isinstance(hashed, str) or not _HEX.match(hashed):
            raise ConfigError(f"{where}: secret_sha256 must be 64 hex digits")
        key = DataKey(bytes.fromhex(hashed))
    namespaces, quota = body.get("namespaces"), body.get("quota")
    if role != TENANT:
        if namespaces is not None or quota is not None:
            raise ConfigError(f"{where}: namespaces and quota are for tenants; a {role} reaches every namespace")
        return Entry(Principal(name, role), key, secret)
    if not isinstance(namespaces, list) or not namespaces:
        raise ConfigError(f'{where}: a tenant needs namespaces = ["name", "prefix-*", ...]')
    for pattern in namespaces:
        _check_pattern(pattern, where)
    if quota is not None:
        try:
            quota = parse_size(quota)
        except (ConfigError, TypeError):
            raise ConfigError(f'{where}: quota must be a size such as "64GiB", got {quota!r}') from None
    return Entry(Principal(name, TENANT, tuple(namespaces), quota), key, secret)


def _check_pattern(pattern, where: str) -> None:
    if not isinstance(pattern, str) or not pattern:
        raise ConfigError(f"{where}: namespaces are non-empty strings")
    if "*" in pattern[:-1]:
        raise ConfigError(f"{where}: {pattern!r}: '*' may only end a pattern (a prefix)")
    if pattern == "*":
        raise ConfigError(f"{where}: '*' alone would reach every namespace; make the token an admin instead")
    try:
        check_namespace(pattern.rstrip("*"))
    except ValueError as exc:
        raise ConfigError(f"{where}: {pattern!r}: {exc}") from None
