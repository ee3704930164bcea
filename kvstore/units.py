"""Byte sizes written the way people write them: 8GiB, 512MiB, 64KiB, 1.5GB, 4096."""

from __future__ import annotations

import re

from kvstore_client.errors import ConfigError

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "tib": 1 << 40,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str | int) -> int:
    """Bytes in ``text``; plain ints pass through. Raises ConfigError on nonsense."""
    if isinstance(text, int):
        if text < 0:
            raise ConfigError(f"size cannot be negative: {text}")
        return text
    m = _SIZE.match(text)
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _UNITS:
        raise ConfigError(f"not a size: {text!r} (examples: 8GiB, 512MiB, 64KiB, 4096)")
    return int(float(m.group(1)) * _UNITS[unit])


def format_size(n: int) -> str:
    """Short binary-unit rendering: 1536 -> '1.5KiB'."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{int(value)}{unit}" if value == int(value) else f"{value:.1f}{unit}"
        value /= 1024
    raise AssertionError("unreachable")
