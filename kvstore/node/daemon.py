"""A storage node: a BlockStore served on the data plane and reported to the master.

What it owns on disk is private to its user: the data dir is 0700 and held
by one process at a time (``kvstore.node.data_dir_lock``), the node id file
and the Unix socket are 0600. It pulls blocks (PULL) only from nodes the
master lists as live (``kvstore.node.peers``).
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import stat
import time
from dataclasses import dataclass
from typing import Callable

from kvstore_client.cluster_address import is_etcd_address, parse_etcd_address
from kvstore_client.credentials import NO_CREDENTIALS, Credentials
from kvstore_client.errors import ConfigError
from kvstore_client.hostid import machine_id
from kvstore_client.proto import kvstore_pb2 as pb
from kvstore.master.membership import NodeIdInUse
from kvstore.node.config import StoreConfig
from kvstore.node.data_dir_lock import DataDirLock
from kvstore.node.peers import RegisteredPeers
from kvstore.node.store import BlockStore
from kvstore.node.tenant_usage import TenantUsage
from kvstore.security.access import AccessList
from kvstore.security.tls import ServerTLS
from kvstore.tiers.arena import node_shm_dir
from kvstore.tiers.private import private_dir
from kvstore.transport.puller import refuse_all
from kvstore.transport.server import DEFAULT_LEASE_TTL, DataPlaneServer

log = logging.getLogger(__name__)
SOCKET_PREFIX, SOCKET_SUFFIX = "", ".sock"  # a node's Unix socket: <node id>.sock, in its user's shm directory
MAX_SOCKET_PATH = 107  # bytes of a Unix socket's path (sun_path, less its NUL)
STALE_SOCKET_AGE_S = 10.0  # younger ones may belong to a node between bind() and listen()


def reap_stale_sockets(directory: str) -> list[str]:
    """Remove node sockets in ``directory`` that nothing listens on any more (their node was
    killed; one that exits cleanly removes its own); the names removed."""
    removed = []
    for entry in os.listdir(directory):
        if not (entry.startswith(SOCKET_PREFIX) and entry.endswith(SOCKET_SUFFIX)):
            continue
        path = os.path.join(directory, entry)
        try:
            st = os.lstat(path)
            if not stat.S_ISSOCK(st.st_mode) or time.time() - st.st_mtime < STALE_SOCKET_AGE_S:
                continue
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
                probe.connect(path)
        except ConnectionRefusedError:
            try:
                os.unlink(path)
                removed.append(entry)
            except FileNotFoundError:
                pass
        except OSError:  # gone already, not a socket, or busy: leave it
            continue
    return removed


@dataclass
class NodeOptions:
    """Where a node listens and whom it reports to.

    ``port`` 0 picks a free port; ``metrics_port`` None serves no metrics.
    ``node_id`` defaults to one kept in ``data_dir`` (so a restarted node keeps
    its identity and its SSD blocks), or a random one without a data dir.
    ``access``, ``tls`` and ``credentials``: see kvstore.security.
    ``register_wait_s``: how long ``start`` waits for the master to know the
    node (so clients that come next can be placed on it); after that it keeps
    trying in the background.
    """

    master: str | None = None
    host: str = "127.0.0.1"
    advertise: str | None = None  # host name clients use; default: ``host``, or this machine's name for 0.0.0.0
    port: int = 0
    unix_socket: bool = True
    metrics_port: int | None = None
    node_id: str | None = None
    data_dir: str | None = None
    register_wait_s: float = 5.0
    access: AccessList | None = None  # tokens clients must prove (None: none checked)
    tls: ServerTLS | None = None  # TLS on the TCP data plane
    credentials: Credentials = NO_CREDENTIALS  # what the node presents to the master and other nodes
    lease_ttl: float | None = DEFAULT_LEASE_TTL  # seconds an unreleased same-host read lease lasts (None: ever)
    stopping: Callable[[], bool] = staticmethod(lambda: False)  # a stop signal came: give up a start that waits


def stable_node_id(data_dir: str | None) -> str:
    """The node id stored in ``data_dir``, created on first use."""
    if data_dir is None:
        return f"node-{secrets.token_hex(4)}"
    path = os.path.join(data_dir, "node_id")
    try:
        with open(path) as f:
            return f.read().strip()
    except FileNotFoundError:
        private_dir(data_dir)
    node_id = f"node-{secrets.token_hex(4)}"
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:  # another process made it meanwhile: its id it is
        return stable_node_id(data_dir)
    with open(fd, "w") as f:
        f.write(node_id + "\n")
    return node_id


class StorageNode:
    """Owns one BlockStore, its data-plane server, metrics and master agent."""

    def __init__(self, config: StoreConfig, options: NodeOptions):
        self.config = config
        self.options = options
        self.node_id = options.node_id or stable_node_id(options.data_dir)
        self.store: BlockStore | None = None
        self.server = None
        self.metrics = None
        self.agent = None
        self.lock: DataDirLock | None = None
        self.claim = None  # the node id's claim in etcd, with an etcd:// master (kvstore.node.id_claim)

    def start(self) -> "StorageNode":
        """Lock the data dir (DataDirInUse if another process holds it), open the store, serve."""
        if self.options.data_dir is not None:
            self.lock = DataDirLock(self.options.data_dir).acquire()
        try:
            return self._start()
        except BaseException:
            self.stop()
            raise

    def _start(self) -> "StorageNode":
        opts = self.options
        if opts.master and is_etcd_address(opts.master):
            self._claim_node_id(opts)
        self.store = BlockStore(self.config)
        usage = None
        if opts.access is not None:  # tracked even with no quota yet: a reload may bring one
            usage, access = TenantUsage(opts.access), opts.access
            self.store.track_usage(usage)
            access.subscribe(lambda: self.store.recount_usage(usage, before=lambda: usage.retarget(access)))
        unix_path = None
        if opts.unix_socket:
            reap_stale_sockets(node_shm_dir())
            unix_path = os.path.join(node_shm_dir(), f"{SOCKET_PREFIX}{self.node_id}{SOCKET_SUFFIX}")
            if len(os.fsencode(unix_path)) > MAX_SOCKET_PATH:
                raise ConfigError(
                    f"the node's Unix socket {unix_path} would be longer than a Unix socket's path may be "
                    f"({MAX_SOCKET_PATH} bytes): choose a shorter --shm-dir"
                )
        self.server = DataPlaneServer(
            self.store,
            host=opts.host,
            port=opts.port,
            unix_path=unix_path,
            node_id=self.node_id,
            machine_id=machine_id(),
            access=opts.access,
            tls=opts.tls.server_context() if opts.tls else None,
            usage=usage,
            lease_ttl=opts.lease_ttl,
        ).start()
        self.server.puller.credentials = opts.credentials
        if unix_path is not None:
            os.chmod(unix_path, 0o600)  # only this user's clients (connect needs write permission)
        self.server.puller.sources = refuse_all  # no master, no registered nodes to pull from
        if opts.metrics_port is not None:
            from kvstore.metrics import MetricsServer
            from kvstore.node.node_metrics import node_metrics

            self.metrics = MetricsServer(
                opts.metrics_port,
                lambda: node_metrics(self),
                host=opts.host,
                access=opts.access,
                tls=opts.tls.server_context() if opts.tls else None,  # HTTPS: tokens not in clear
            )
        if opts.master:
            from kvstore.node.master_agent import MasterAgent

            self.agent = MasterAgent(
                opts.master, self.info(), self.store, credentials=opts.credentials, usage=usage
            ).start()
            self.server.puller.sources = RegisteredPeers(self.agent.live_data_addresses).allows
            if not self.agent.wait_registered(opts.register_wait_s):
                if self.agent.refused:
                    log.warning(
                        "master %s refuses node id %s (%s): serving, and registering as soon as it accepts",
                        opts.master,
                        self.node_id,
                        self.agent.refused,
                    )
                else:
                    log.warning("master %s not reachable yet: serving, and registering as soon as it is", opts.master)
        log.info("node %s serving data on %s", self.node_id, self.server.address)
        arena = self.store.dram.arena
        if arena.pages in ("4KiB", "mixed"):
            log.info(
                "the DRAM arena %s is %s on 4 KiB pages: same-host copies run below memcpy speed; a tmpfs "
                "mounted with huge=within_size (--shm-dir), or Linux >= 6.1 with free memory, fixes that",
                arena.path,
                "partly" if arena.pages == "mixed" else "all",
            )
        return self

    def _claim_node_id(self, opts: NodeOptions) -> None:
        """Hold the node id in etcd before serving, waiting while another process holds it."""
        from kvstore.node.id_claim import NodeIdClaim
        from kvstore_client.etcd import Etcd, EtcdTLS

        endpoints, prefix = parse_etcd_address(opts.master)
        etcd = Etcd(endpoints, tls=opts.credentials.etcd_tls or EtcdTLS.from_env())
        holder = f"{socket.gethostname()} pid {os.getpid()} {secrets.token_hex(6)}"
        self.claim = NodeIdClaim(etcd, prefix, self.node_id, holder)
        if not self.claim.acquire(cancelled=opts.stopping):
            raise NodeIdInUse(f"node id {self.node_id} is held in etcd by {self.claim.held_by}; stopped waiting")

    def info(self) -> pb.NodeInfo:
        return pb.NodeInfo(
            node_id=self.node_id,
            host=socket.gethostname(),
            machine_id=machine_id(),
            data_address=self.data_address(),
            unix_socket=self.server.unix_path or "",
            shm_arena=self.store.dram.arena.name,
            metrics_address=self.metrics.address if self.metrics else "",
            arena_pages=self.store.dram.arena.pages,
        )

    def data_address(self) -> str:
        """host:port clients should dial for the TCP data plane."""
        port = self.server.address.rsplit(":", 1)[1]
        host = self.options.advertise or self.options.host
        if host in ("0.0.0.0", "::", ""):
            host = socket.gethostname()
        return f"{host}:{port}"

    def stop(self) -> None:
        """Stop reporting, serving, then close the store (SSD contents stay)."""
        for part in (self.agent, self.metrics, self.server):
            if part is not None:
                part.stop()
        if self.store is not None:
            self.store.close()
        if self.claim is not None:
            self.claim.release()
        if self.lock is not None:
            self.lock.release()
