"""Reading the TOML files kvstore takes (--config, --auth): one clear error for each way
a file can be unusable."""

from __future__ import annotations

import tomllib

from kvstore_client.errors import ConfigError


def read_toml(path: str, what: str = "config file") -> dict:
    """The TOML document at ``path``; ConfigError naming ``what`` when it cannot be read or parsed."""
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except OSError as exc:
        raise ConfigError(f"cannot read {what} {path}: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path} is not valid TOML: {exc}") from None
