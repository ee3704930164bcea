"""Choosing the data path to a node: shared memory on this host, else TCP."""

from __future__ import annotations

import logging
import os

from kvstore_client.credentials import NO_CREDENTIALS
from kvstore_client.hostid import machine_id

log = logging.getLogger(__name__)


DATA_PATHS = ("shm", "unix", "tcp")


def check_data_path(data_path: str | None) -> str | None:
    """``data_path`` itself, when it is one of DATA_PATHS or None; else ValueError."""
    if data_path is not None and data_path not in DATA_PATHS:
        raise ValueError(f"data_path must be one of {DATA_PATHS} or None, got {data_path!r}")
    return data_path


def open_connection(
    node,
    *,
    prefer_shm: bool = True,
    verify: bool = True,
    data_path: str | None = None,
    credentials=NO_CREDENTIALS,
    timeout: float | None = None,
    one_sided: bool = True,
    tuning=None,
):
    """A data-plane connection to ``node`` (a NodeInfo).

    Same machine and the node's arena and Unix socket visible here: shared
    memory (copies straight from and into the node's DRAM arena). Same machine
    otherwise: the Unix socket. Anywhere else: TCP. ``data_path`` "tcp" always
    uses TCP, "unix" the Unix socket when the node is on this host (else TCP),
    "shm" the default choice; None: the default choice, with ``prefer_shm``.
    ``credentials``: the caller's token and TLS settings. ``timeout``: seconds a
    dial, and then each socket operation, may take (None: no limit). ``one_sided``:
    shared-memory reads through the node's block directory (else every read leases).
    ``tuning``: the connection's ``transport.Tuning`` (None: the defaults).
    """
    from kvstore_client import transport

    tuning = transport.DEFAULT_TUNING if tuning is None else tuning
    common = dict(verify=verify, credentials=credentials, timeout=timeout, tuning=tuning)
    if check_data_path(data_path) == "tcp":
        return transport.TcpConnection(node.data_address, **common)
    if data_path is not None:
        prefer_shm = data_path == "shm"
    same_host = node.machine_id == machine_id() and bool(node.unix_socket) and _reachable(node)
    if same_host and prefer_shm and node.shm_arena:
        try:
            return transport.ShmConnection(node.unix_socket, node.shm_arena, one_sided=one_sided, **common)
        except OSError as exc:  # TransportError included
            if _denied(exc):  # another user's node: its socket and arena are not ours to open
                _not_this_users(node, exc)
                same_host = False
            else:  # e.g. another container's /dev/shm: fall back to a socket
                log.info("shared memory with %s unavailable (%s); using its socket", node.node_id, exc)
    if same_host:
        try:
            return transport.UnixConnection(node.unix_socket, **common)
        except OSError as exc:
            if not _denied(exc):
                raise
            _not_this_users(node, exc)
    return transport.TcpConnection(node.data_address, **common)


def _reachable(node) -> bool:
    """Whether ``node``'s Unix socket is there for this process: not when it is another
    container's, nor (logged once) when it is in another user's private directory."""
    try:
        os.stat(node.unix_socket)
    except PermissionError as exc:
        _not_this_users(node, exc)
        return False
    except OSError:
        return False
    return True


def _denied(exc: OSError) -> bool:
    return isinstance(exc, PermissionError) or isinstance(exc.__cause__, PermissionError)


_TOLD: set[str] = set()  # nodes whose socket this process found closed to it (logged once each)


def _not_this_users(node, exc: OSError) -> None:
    if node.node_id not in _TOLD and len(_TOLD) < 4096:
        _TOLD.add(node.node_id)
        log.info(
            "node %s on this host runs as another user, whose socket and arena this user (uid %d) may not "
            "open (%s): using TCP",
            node.node_id,
            os.getuid(),
            exc,
        )
