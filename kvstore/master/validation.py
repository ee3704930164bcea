"""Checks on what a node registers and reports, before the master records any of it.

A node's NodeIdentity (its proto NodeInfo) is handed to every client that locates its blocks, and its
TierStats drive placement, so malformed values are refused at the gRPC edge
with InvalidRequest (INVALID_ARGUMENT), never stored and never a traceback.
"""

from __future__ import annotations

import re
import struct
from operator import itemgetter
from typing import Iterable

from kvstore.master.errors import InvalidRequest
from kvstore.master.index import SplitDigests
from kvstore.master.membership import NodeIdentity, TierStats
from kvstore_client.keys import MAX_DIGEST_LEN

MAX_TEXT_LEN = 256  # host, machine id, arena name
MAX_PATH_LEN = 108  # a Unix socket path (sun_path)
MAX_TIERS = 8
MAX_BYTES = 1 << 60  # 1 EiB: more than any node's tier, well inside uint64
MAX_COUNT = 1 << 62
ARENA_PAGES = ("", "huge", "4KiB", "mixed")
_HOST = re.compile(r"^(?:[A-Za-z0-9_][A-Za-z0-9._-]{0,252}|\[[0-9A-Fa-f:.]{2,45}\]|[0-9A-Fa-f:.]{2,45})$")
_PORT = re.compile(r"^[0-9]{1,5}$")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
_TIER = re.compile(r"^[A-Za-z][A-Za-z0-9_-]{0,31}$")


def check_address(value: str, what: str, required: bool = False) -> str:
    """A "host:port" (a host name, IPv4, or IPv6 with or without brackets; port 1-65535),
    or "" where not ``required``."""
    if not value and not required:
        return value
    host, sep, port = value.rpartition(":")
    if not (sep and _HOST.fullmatch(host) and _PORT.fullmatch(port) and 0 < int(port) < 65536):
        raise InvalidRequest(f"{what} must be host:port with a port 1-65535, got {value[:80]!r}")
    return value


def check_text(value: str, what: str) -> str:
    if len(value) > MAX_TEXT_LEN or not value.isprintable():
        raise InvalidRequest(f"{what} must be printable and at most {MAX_TEXT_LEN} characters")
    return value


def check_node_info(info: NodeIdentity) -> NodeIdentity:
    """InvalidRequest unless every field of ``info`` has a sane shape (node id: checked by Membership)."""
    check_text(info.host, "host")
    check_text(info.machine_id, "machine_id")
    check_address(info.data_address, "data_address")
    check_address(info.metrics_address, "metrics_address")
    if info.unix_socket and (
        not info.unix_socket.startswith("/")
        or len(info.unix_socket.encode()) > MAX_PATH_LEN
        or not info.unix_socket.isprintable()
    ):
        raise InvalidRequest(f"unix_socket must be an absolute path of at most {MAX_PATH_LEN} bytes")
    if info.shm_arena and not (_NAME.fullmatch(info.shm_arena) and len(info.shm_arena) <= MAX_TEXT_LEN):
        raise InvalidRequest("shm_arena must be a file name (letters, digits, '.', '_', '-'), not a path")
    if info.arena_pages not in ARENA_PAGES:
        raise InvalidRequest(f"arena_pages must be one of {ARENA_PAGES}, got {info.arena_pages[:20]!r}")
    return info


def check_tier_stats(tiers: Iterable[TierStats]) -> list[TierStats]:
    """InvalidRequest unless the tiers are few, distinctly named, and their figures in bounds."""
    tiers = list(tiers)
    if len(tiers) > MAX_TIERS:
        raise InvalidRequest(f"at most {MAX_TIERS} tiers per heartbeat, got {len(tiers)}")
    names = set()
    for t in tiers:
        if not _TIER.fullmatch(t.tier) or t.tier.lower() in names:
            raise InvalidRequest(f"tier names must be distinct identifiers, got {t.tier[:40]!r}")
        names.add(t.tier.lower())
        for name in ("capacity", "used"):
            if not 0 <= getattr(t, name) <= MAX_BYTES:
                raise InvalidRequest(f"tier {t.tier} {name} must be 0..{MAX_BYTES} bytes")
        for name in ("blocks", "hits", "misses", "evictions", "demotions", "promotions", "checksum_failures"):
            if not 0 <= getattr(t, name) <= MAX_COUNT:
                raise InvalidRequest(f"tier {t.tier} {name} must be 0..{MAX_COUNT}")
    return tiers


def unpack_digests(packed: bytes, digest_len: int) -> list[bytes]:
    """The digests of a PackedBlocks string: InvalidRequest unless it splits evenly into 1..64-byte digests."""
    if not 0 < digest_len <= MAX_DIGEST_LEN:
        raise InvalidRequest(f"packed digests are 1..{MAX_DIGEST_LEN} bytes each, got digest_len {digest_len}")
    if len(packed) % digest_len:
        raise InvalidRequest(f"{len(packed)} bytes of packed digests do not split into {digest_len}-byte digests")
    return SplitDigests(map(itemgetter(0), struct.iter_unpack(f"{digest_len}s", packed)))
