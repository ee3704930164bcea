"""Access files for the authentication tests: fixed tokens of every role, written mode 0600."""

from __future__ import annotations

import os
from pathlib import Path

ADMIN = "admin-token-0123456789abcdef"
NODE = "node-token-0123456789abcdef"
NODE2 = "node2-token-0123456789abcdef"  # a second node's token: may not speak for the first's id
TENANT_A = "tenant-a-token-0123456789"  # namespaces "acme" and "acme-*"
TENANT_B = "tenant-b-token-0123456789"  # namespace "globex"
WRONG = "not-a-token-of-this-file-0123"  # well-formed, in no access file

NS_A, NS_A2, NS_B = "acme", "acme-chat", "globex"

ACCESS_TOML = f"""
[tokens.root]
secret = "{ADMIN}"
role = "admin"

[tokens.storage]
secret = "{NODE}"
role = "node"

[tokens.storage2]
secret = "{NODE2}"
role = "node"

[tokens.acme]
secret = "{TENANT_A}"
role = "tenant"
namespaces = ["{NS_A}", "acme-*"]

[tokens.globex]
secret = "{TENANT_B}"
role = "tenant"
namespaces = ["{NS_B}"]
"""


def write_access_file(directory: Path, text: str = ACCESS_TOML, mode: int = 0o600) -> Path:
    """The access file at ``directory/access.toml`` with ``mode``."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "access.toml"
    path.write_text(text)
    os.chmod(path, mode)
    return path


def access_list(directory: Path):
    from kvstore.security.access import AccessList

    return AccessList.load(str(write_access_file(directory)))
