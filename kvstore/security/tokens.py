"""New tokens and their access-file entries (`kvstore token`)."""

from __future__ import annotations

import hashlib
import json
import secrets
import tomllib

from kvstore.security.access import AccessList, check_token_name
from kvstore_client.errors import ConfigError

TOKEN_BYTES = 32  # 256 random bits: no dictionary or brute force reaches one


def new_entry(name: str, role: str, namespaces: list[str], quota: int | None, hashed: bool) -> tuple[str, str]:
    """(the TOML entry, the token). The entry is checked as the access file would be."""
    check_token_name(name)
    if role != "tenant" and (namespaces or quota is not None):
        raise ConfigError("--namespace and --quota are for tenants")
    token = secrets.token_urlsafe(TOKEN_BYTES)
    lines = [f"[tokens.{name}]"]
    if hashed:
        lines.append(f'secret_sha256 = "{hashlib.sha256(token.encode()).hexdigest()}"')
    else:
        lines.append(f"secret = {json.dumps(token)}")
    lines.append(f'role = "{role}"')
    if role == "tenant":
        lines.append(f"namespaces = {json.dumps(namespaces)}")
    if quota is not None:
        lines.append(f"quota = {quota}")
    entry = "\n".join(lines) + "\n"
    AccessList.parse(tomllib.loads(entry))  # the same checks as --auth: a bad name or pattern fails here
    return entry, token
