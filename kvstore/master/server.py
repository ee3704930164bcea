"""The master process: the gRPC server, the expiry sweeper and the metrics endpoint.

    server = MasterServer(port=0, ttl_s=5.0).start()
    server.address                  # "127.0.0.1:41234"
    server.stop()

``run_master(...)`` serves until SIGTERM or SIGINT (what the CLI calls).
The master holds no state on disk: after a restart the nodes re-register and
resend their inventories (see kvstore.master.service).

Threads: gRPC's pool runs the RPCs; one daemon thread ("master-expiry")
drops nodes whose lease ran out, every min(heartbeat interval, ttl/4); the
metrics server (when enabled) runs on its own daemon thread; with
``kv_events`` (KVEventsOptions) the KV event publisher runs one more
("master-kv-events", see kvstore.master.kv_events). Without it no ZMQ or
msgspec module is loaded and the index reports its changes to no one.
With ``access`` (an access file) every RPC is authenticated and checked
(kvstore.security.grpc_gate); with ``tls`` the port speaks TLS only.
With ``etcd`` (EtcdOptions) the master campaigns for leadership through etcd
(kvstore.master.election, one more thread, "master-election") and serves only
while it leads: a standby answers every RPC with UNAVAILABLE, after the auth
gate, so tokens and TLS apply to every master alike.
Shared state lives in the domain objects, each with its own lock (order:
Membership, then PrefixIndex).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import grpc

from kvstore.master.drain import Drainer
from kvstore.master.election import Election, EtcdOptions, LeaderGate, leader_key
from kvstore.master.conductor_port import ConductorPort
from kvstore.master.conductor_service import ConductorServicer, SchedulingOptions
from kvstore.scheduler.cost_model import CostModel
from kvstore.master.index import PrefixIndex
from kvstore.master.kv_events import KVEventsOptions, open_publisher
from kvstore.master.membership import Membership
from kvstore.master.placement import PlacementPolicy
from kvstore.master.quotas import Quotas
from kvstore.master.replicator import Replicator
from kvstore.master.rpc_handlers import add_services
from kvstore.master.service import MasterServicer
from kvstore.metrics import MetricsServer, Sample
from kvstore.security.access import AccessList
from kvstore.security.grpc_gate import AuthGate
from kvstore.security.tls import ServerTLS
from kvstore_client.credentials import NO_CREDENTIALS, Credentials
from kvstore_client.errors import ConfigError
from kvstore_client.leader_record import master_proof


log = logging.getLogger(__name__)

DEFAULT_PORT = 50051
DEFAULT_TTL_S = 5.0
DEFAULT_HEARTBEAT_INTERVAL_S = 1.0
MAX_MESSAGE_BYTES = 64 << 20  # full inventories are large; clients may still split them


class MasterServer:
    """One master: gRPC service + expiry sweeper (+ Prometheus endpoint when metrics_port is set)."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        ttl_s: float = DEFAULT_TTL_S,
        heartbeat_interval_s: float = DEFAULT_HEARTBEAT_INTERVAL_S,
        replication_factor: int = 1,
        metrics_port: int | None = None,
        max_workers: int = 8,
        clock: Callable[[], float] = time.monotonic,
        scheduling: SchedulingOptions | None = None,
        kv_events: KVEventsOptions | None = None,
        access: AccessList | None = None,
        tls: ServerTLS | None = None,
        dialing: Credentials | None = None,
        cost: CostModel | None = None,
        etcd: EtcdOptions | None = None,
        conductor_port: int | None = 0,
    ):
        if not 0 < heartbeat_interval_s < ttl_s:
            raise ConfigError(f"need 0 < heartbeat_interval_s < ttl_s, got {heartbeat_interval_s} and {ttl_s}")
        self.host, self._port, self._metrics_port = host, port, metrics_port
        self.index = PrefixIndex()
        self.membership = Membership(self.index, ttl_s=ttl_s, clock=clock)
        self.placement = PlacementPolicy(replication_factor)
        self.quotas = Quotas(access) if access is not None else None
        self.access, self.tls = access, tls
        if access is not None:
            access.subscribe(self._access_changed)
        dialing = dialing or (tls.dialing(None) if tls is not None else NO_CREDENTIALS)
        if dialing.data_key is None and access is not None:  # the replicator's PULLs need a node's key
            dialing = dataclasses.replace(dialing, key=access.service_key())
        self.replicator = Replicator(self._data_address, dialing)
        self.drainer = Drainer(self.membership, self.replicator)
        self.servicer = MasterServicer(
            self.membership,
            self.placement,
            heartbeat_interval_s,
            self.quotas,
            drainer=self.drainer,
            conductor_address=lambda: self.conductor_address or "",
            prover=self._prove if access is not None else None,
        )
        self.conductor = ConductorServicer(
            self.index, self.replicator, scheduling or SchedulingOptions(), self.servicer.count_rpc, cost=cost
        )
        self._max_workers = max_workers
        self._conductor_port_number = conductor_port  # None: no conductor port
        self._conductor_port: ConductorPort | None = None
        self._advertise_host = etcd.advertise.rsplit(":", 1)[0] if etcd is not None and etcd.advertise else None
        self._sweep_s = max(0.01, min(heartbeat_interval_s, ttl_s / 4))
        self._server: grpc.Server | None = None
        self._metrics: MetricsServer | None = None
        self._stopping = threading.Event()
        self._sweeper: threading.Thread | None = None
        self._kv_events_options = kv_events
        self._kv_events = None  # the KVEventsPublisher while started with kv_events
        self._etcd_options = etcd
        self.election: Election | None = None  # while started with etcd

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> MasterServer:
        """Bind, start serving and sweeping; returns self. ConfigError if a port is taken."""
        if self._kv_events_options is not None:  # first: the index is empty, and a bad endpoint starts nothing
            self._kv_events = open_publisher(self._kv_events_options, self.index, self.access)
        try:
            self._start_serving()
        except BaseException:
            self._stop_kv_events()
            raise
        if self._etcd_options is not None:
            try:
                self._start_election(self._etcd_options)
            except BaseException:
                self.stop(None)
                raise
        log.info("master listening on %s%s", self.address, " (standing by for leadership)" if self.election else "")
        return self

    def _start_election(self, options: EtcdOptions) -> None:
        """Campaign; EtcdTLSError first when etcd cannot be reached as configured (TLS), while an
        etcd that is merely down leaves this master standing by (it campaigns once etcd is back)."""
        from kvstore_client.etcd import Etcd, EtcdTLSError, EtcdUnavailable

        etcd = Etcd(options.endpoints, tls=options.tls)
        try:
            etcd.get(leader_key(options.prefix))  # TLS checked here, not in the campaign's logs (and a key it may read)
        except EtcdTLSError:
            etcd.close()
            raise
        except (EtcdUnavailable, grpc.RpcError) as exc:
            log.warning("etcd %s not reachable yet (%s): standing by", options.endpoints, exc)
        self.election = Election(
            etcd,
            options.prefix,
            options.advertise or self.address,
            options.lease_ttl_s,
            on_elected=self.reset_state,
            pool_key=self.access.pool_key() if self.access is not None else None,
        ).start()

    def _access_changed(self) -> None:
        """The access file was reloaded: calls check the new tokens from now on (the gate looks
        each up); quotas, the KV event subscribers and the key that signs the leader key follow it."""
        self.quotas.retarget(self.access)
        if self._kv_events is not None:
            self._kv_events.reauthenticate()
        if self.election is not None:
            self.election.pool_key = self.access.pool_key()

    def _prove(self, key_id: bytes, nonce: bytes) -> bytes | None:
        """Prove (to a client about to send it a token) that this master holds that token's key,
        bound to the address etcd names it by; None for a key of no token here."""
        found = self.access.data_key(key_id) if self.access is not None else None
        if found is None:
            return None
        election = self.election
        return master_proof(found[0].key, nonce, election.address if election is not None else self.address)

    def reset_state(self) -> None:
        """Forget every node (and so the whole index): what a master elected leader does first."""
        for node_id in self.membership.forget_all():
            if self.quotas is not None:
                self.quotas.forget(node_id)

    @property
    def is_leader(self) -> bool:
        """Whether this master serves: always without etcd, else while it leads."""
        return self.election is None or self.election.is_leader()

    def _start_serving(self) -> None:
        interceptors = [AuthGate(self.access)] if self.access is not None else []
        if self._etcd_options is not None:  # the gate exists before the port opens; the campaign starts after
            interceptors.append(LeaderGate(lambda: self.election))
        server = grpc.server(
            ThreadPoolExecutor(max_workers=self._max_workers, thread_name_prefix="master-rpc"),
            interceptors=interceptors or None,
            options=[
                ("grpc.so_reuseport", 0),  # a second master on a busy port must fail, not share it
                ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ],
        )
        add_services(server, {"Master": self.servicer, "Conductor": self.conductor})
        target = f"[{self.host}]:{self._port}" if ":" in self.host else f"{self.host}:{self._port}"
        try:
            if self.tls is not None:
                bound = server.add_secure_port(target, self.tls.grpc_credentials())
            else:
                bound = server.add_insecure_port(target)
        except RuntimeError as e:
            bound = 0
            log.debug("bind %s failed: %s", target, e)
        if not bound:
            server.stop(None)
            raise ConfigError(f"master cannot listen on {target} (port in use or bad address)")
        self._port = bound
        server.start()
        self._server = server
        self._stopping.clear()
        self._sweeper = threading.Thread(target=self._sweep, name="master-expiry", daemon=True)
        self._sweeper.start()
        if self._conductor_port_number is not None:
            self._conductor_port = ConductorPort.open(
                self.conductor,
                self.servicer.count_rpc,
                self.host,
                self._conductor_port_number,
                access=self.access,
                tls=self.tls.server_context() if self.tls is not None else None,
                serving=self._serving,
            )
        if self._metrics_port is not None:
            self._metrics = MetricsServer(
                self._metrics_port,
                self.collect_metrics,
                host=self.host,
                access=self.access,
                tls=self.tls.server_context() if self.tls is not None else None,  # HTTPS: tokens not in clear
            )

    def stop(self, grace: float | None = 1.0) -> None:
        """Stop accepting RPCs, finish in-flight ones within ``grace`` seconds, stop the threads."""
        self._stopping.set()
        if self.election is not None:  # resign first: a standby takes over while this one drains
            self.election.stop()
            self.election = None
        if self._conductor_port is not None:
            self._conductor_port.stop()
            self._conductor_port = None
        if self._server is not None:
            self._server.stop(grace).wait()
            self._server = None
        if self._sweeper is not None:
            self._sweeper.join()
            self._sweeper = None
        if self._metrics is not None:
            self._metrics.stop()
            self._metrics = None
        self._stop_kv_events()
        self.replicator.stop()

    def _stop_kv_events(self) -> None:
        if self._kv_events is not None:
            self._kv_events.stop()
            self._kv_events = None

    def _data_address(self, node_id: str) -> str | None:
        state = self.membership.get(node_id)
        return None if state is None else state.info.data_address

    def __enter__(self) -> MasterServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def port(self) -> int:
        return self._port

    @property
    def address(self) -> str:
        """host:port clients dial (the bound port once started)."""
        return f"[{self.host}]:{self._port}" if ":" in self.host else f"{self.host}:{self._port}"

    @property
    def conductor_address(self) -> str | None:
        """host:port of the conductor port as routers dial it (the advertised host under etcd), or
        None when there is none."""
        if self._conductor_port is None:
            return None
        host = self._advertise_host or self.host
        port = self._conductor_port.port
        return f"{host}:{port}" if host.startswith("[") or ":" not in host else f"[{host}]:{port}"

    def _serving(self) -> bool:
        """Whether this master answers now: always without etcd, else only while it leads."""
        return self._etcd_options is None or (self.election is not None and self.election.is_leader())

    @property
    def metrics_address(self) -> str | None:
        return self._metrics.address if self._metrics else None

    @property
    def kv_events_address(self) -> str | None:
        """The KV events PUB endpoint as bound (None: no KV events)."""
        return self._kv_events.endpoint if self._kv_events else None

    @property
    def kv_events_replay_address(self) -> str | None:
        """The KV events replay ROUTER endpoint as bound (None: none)."""
        return self._kv_events.replay_endpoint if self._kv_events else None

    def _sweep(self) -> None:
        while not self._stopping.wait(self._sweep_s):
            try:
                for node_id in self.membership.expire():
                    if self.quotas is not None:
                        self.quotas.forget(node_id)
                    log.warning(
                        "node %s missed its heartbeats for %.1f s: dropped with its blocks",
                        node_id,
                        self.membership.ttl_s,
                    )
            except Exception:  # keep sweeping whatever happens
                log.exception("expiry sweep failed")

    # -- metrics -----------------------------------------------------------------------------
    def collect_metrics(self) -> list[Sample]:
        """Samples for the Prometheus endpoint."""
        nodes = self.membership.live_nodes()
        samples: list[Sample] = [
            ("kvstore_master_nodes_alive", "Storage nodes with a live lease.", "gauge", {}, len(nodes)),
            ("kvstore_master_indexed_keys", "Distinct block keys in the global index.", "gauge", {}, self.index.size()),
            (
                "kvstore_master_namespaces",
                "Namespaces with at least one indexed key.",
                "gauge",
                {},
                len(self.index.namespaces()),
            ),
            (
                "kvstore_master_replication_factor",
                "Default copies per put.",
                "gauge",
                {},
                self.placement.replication_factor,
            ),
            (
                "kvstore_master_leader",
                "1 while this master serves (always without --etcd).",
                "gauge",
                {},
                int(self.is_leader),
            ),
        ]
        for node_id, per_tier in sorted(self.index.node_counts().items()):
            for tier, blocks in per_tier.items():
                samples.append(
                    (
                        "kvstore_master_node_keys",
                        "Blocks indexed per node and tier.",
                        "gauge",
                        {"node": node_id, "tier": tier},
                        blocks,
                    )
                )
        for (method, code), calls in sorted(self.servicer.rpc_counts().items()):
            samples.append(
                (
                    "kvstore_master_rpcs_total",
                    "RPCs served, by method and status code.",
                    "counter",
                    {"method": method, "code": code},
                    calls,
                )
            )
        if self._kv_events is not None:
            samples += self._kv_events.samples()
        return samples


def run_master(
    host: str = "127.0.0.1",
    port: int = DEFAULT_PORT,
    *,
    ttl_s: float = DEFAULT_TTL_S,
    heartbeat_interval_s: float = DEFAULT_HEARTBEAT_INTERVAL_S,
    replication_factor: int = 1,
    metrics_port: int | None = None,
    grace_s: float = 2.0,
    on_ready: Callable[[MasterServer], None] | None = None,
    kv_events: KVEventsOptions | None = None,
    access: AccessList | None = None,
    tls: ServerTLS | None = None,
    etcd: EtcdOptions | None = None,
) -> None:
    """Serve until SIGTERM or SIGINT, then shut down cleanly. Blocks.

    Signal handlers are installed only when called from the main thread (and
    restored on return); from another thread, the call blocks until the process
    ends. ``on_ready(server)`` runs once the server listens (e.g. to print its address).
    """
    from kvstore.serving import service_process

    signals = service_process()
    server = MasterServer(
        host,
        port,
        ttl_s=ttl_s,
        heartbeat_interval_s=heartbeat_interval_s,
        replication_factor=replication_factor,
        metrics_port=metrics_port,
        kv_events=kv_events,
        access=access,
        tls=tls,
        etcd=etcd,
    )
    try:
        server.start()
        if on_ready is not None:
            on_ready(server)
        signals.wait()
        log.info("master shutting down")
    finally:
        signals.restore()
        server.stop(grace_s)
