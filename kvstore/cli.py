"""The ``kvstore`` command."""

from __future__ import annotations

import json

import click

from kvstore.config_file import config_option
from kvstore.security.service_flags import (
    ServiceSecurity,
    client_security_options,
    etcd_tls_of,
    etcd_tls_options,
    service_security_options,
)
from kvstore.units import format_size, parse_size


class Size(click.ParamType):
    """A byte size with units (8GiB, 512MiB, 4096), at least ``minimum``."""

    name = "size"

    def __init__(self, minimum: int = 0):
        self.minimum = minimum

    def convert(self, value, param, ctx):
        try:
            size = parse_size(value)
        except ValueError as exc:
            self.fail(str(exc), param, ctx)
        if size < self.minimum:
            self.fail(f"{value!r} is too small: at least {format_size(self.minimum)}", param, ctx)
        return size


SIZE = Size()  # 0 allowed (where it means "none")
POSITIVE_SIZE = Size(minimum=1)
PORT = click.IntRange(0, 65535)  # 0: any free port
METRICS_PORT = click.IntRange(-1, 65535)  # -1: off
POSITIVE_INT = click.IntRange(min=1)
POSITIVE_FLOAT = click.FloatRange(min=0, min_open=True)


class DataDir(click.ParamType):
    """A directory this process can write in; created (0700) when missing, as the command would."""

    name = "directory"

    def convert(self, value, param, ctx):
        import os
        import tempfile

        if ctx is not None and ctx.meta.get(DRY_RUN):  # `kvstore config`: say, do not touch
            return value
        try:
            os.makedirs(value, mode=0o700, exist_ok=True)
            fd, probe = tempfile.mkstemp(dir=value, prefix=".kvstore-probe-")
            os.close(fd)
            os.unlink(probe)
        except FileExistsError:
            self.fail(f"{value} is not a directory", param, ctx)
        except OSError as exc:
            self.fail(f"{value} is not a usable directory: {exc.strerror}", param, ctx)
        return value


DATA_DIR = DataDir()
DRY_RUN = "kvstore.dry_run"  # ctx.meta key: parse a command's options without side effects


class ZmqEndpoint(click.ParamType):
    """A ZMQ endpoint the master binds: tcp://HOST:PORT or ipc://PATH."""

    name = "endpoint"

    def convert(self, value, param, ctx):
        from kvstore.master.kv_events import check_endpoint
        from kvstore_client.errors import ConfigError

        try:
            return check_endpoint(value, "endpoint")
        except ConfigError as exc:
            self.fail(str(exc), param, ctx)


ENDPOINT = ZmqEndpoint()


class HostPort(click.ParamType):
    """An address others dial: HOST:PORT (a name, IPv4 or [IPv6]; port 1-65535)."""

    name = "host:port"

    def convert(self, value, param, ctx):
        from kvstore.master.validation import check_address
        from kvstore_client.errors import KVStoreError

        try:
            return check_address(value, "the address", required=True)
        except KVStoreError as exc:
            self.fail(str(exc), param, ctx)


HOST_PORT = HostPort()


class KVStoreGroup(click.Group):
    """Turns the store's typed errors into one clear line and exit status 1."""

    def invoke(self, ctx):
        from kvstore_client.errors import KVStoreError

        try:
            return super().invoke(ctx)
        except KVStoreError as exc:
            raise click.ClickException(f"{type(exc).__name__}: {exc}") from None


def switch_interval_option(f):
    """--switch-interval: how long a thread may keep Python's GIL while another waits for it."""
    return click.option(
        "--switch-interval",
        type=click.FloatRange(min=0.0001, max=0.1),
        default=0.0005,
        show_default=True,
        help="Seconds a thread keeps Python's GIL while another waits for it (sys.setswitchinterval; Python's "
        "default is 0.005). Each pool call the router makes finishes in a thread and is handed back to its "
        "event loop, and every hand-off waits up to this long: on a request's path to its first token, "
        "several times.",
    )(f)


@click.group(
    cls=KVStoreGroup, context_settings={"help_option_names": ["-h", "--help"], "auto_envvar_prefix": "KVSTORE"}
)
@click.version_option(package_name="kvstore")
def main() -> None:
    """kvstore: a distributed KVCache store for LLM serving."""


@main.command()
@click.option(
    "--data-dir",
    type=DATA_DIR,
    default=None,
    help="Where the SSD tier lives  [default: a temporary directory, removed afterwards]",
)
@click.option("--dram", type=POSITIVE_SIZE, default="64MiB", show_default=True, help="DRAM tier capacity.")
@click.option("--ssd", type=POSITIVE_SIZE, default="256MiB", show_default=True, help="SSD tier capacity.")
@click.option("--blocks", type=POSITIVE_INT, default=96, show_default=True, help="How many blocks to store.")
@click.option("--block-size", type=POSITIVE_SIZE, default="1MiB", show_default=True, help="Bytes per block.")
@click.option(
    "--policy",
    type=click.Choice(["lru", "lfu", "length_aware"]),
    default="lru",
    show_default=True,
    help="Eviction policy.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def demo(data_dir, dram, ssd, blocks, block_size, policy, as_json) -> None:
    """Store and read back KV blocks in-process, overflowing DRAM into SSD, and print tier stats."""
    from kvstore.demo import run_demo

    result = run_demo(
        data_dir, dram, ssd, blocks, block_size, policy, echo=(lambda *_: None) if as_json else click.echo
    )
    if as_json:
        click.echo(json.dumps(result, indent=2))
    if result["verified"] != result["matched"]:
        raise SystemExit(1)


# -- services ------------------------------------------------------------------------------


def _use_shm_dir(ctx, param, value):
    """--shm-dir: where this process puts shared-memory arenas (read through KVSTORE_SHM_DIR)."""
    import os

    if value:
        if not os.path.isdir(value):
            raise click.BadParameter(f"{value} is not a directory", ctx, param)
        os.environ["KVSTORE_SHM_DIR"] = value
    return value


advertise_option = click.option(
    "--advertise",
    default=None,
    help="Host name clients should use to reach the node (default: --host; this machine's name for 0.0.0.0).",
)


def store_options(f):
    """Options shared by `node` and `up`: the node's tiers and eviction."""
    options = [
        click.option(
            "--data-dir",
            type=DATA_DIR,
            default="./kvstore-data",
            show_default=True,
            help="Directory for the SSD tier and the node's id.",
        ),
        click.option("--dram", type=POSITIVE_SIZE, default="1GiB", show_default=True, help="DRAM tier capacity."),
        click.option("--ssd", type=SIZE, default="8GiB", show_default=True, help="SSD tier capacity (0: no SSD tier)."),
        click.option(
            "--max-block", type=POSITIVE_SIZE, default="16MiB", show_default=True, help="Largest block accepted."
        ),
        click.option(
            "--policy",
            type=click.Choice(["lru", "lfu", "length_aware"]),
            default="lru",
            show_default=True,
            help="Eviction policy.",
        ),
        click.option(
            "--shm-dir",
            envvar="KVSTORE_SHM_DIR",
            default=None,
            callback=_use_shm_dir,
            expose_value=False,
            help="Directory (a tmpfs) for the shared-memory DRAM arena [default: /dev/shm; env "
            "KVSTORE_SHM_DIR]. One mounted with huge=within_size lets same-host clients copy "
            "blocks at memory speed.",
        ),
    ]
    for option in reversed(options):
        f = option(f)
    return f


def connection_options(f):
    """The data plane's limits per client (kvstore.transport.limits.ConnectionLimits); `node` and `up`."""
    from kvstore.node.config import ConnectionLimits

    defaults = ConnectionLimits()
    options = [
        click.option(
            "--max-connections",
            type=click.IntRange(min=1),
            default=defaults.max_connections,
            show_default=True,
            help="Data-plane connections served at once, TCP and Unix socket together; one more gets a "
            "BUSY error frame and is closed (the SDK raises ServiceUnavailable).",
        ),
        click.option(
            "--idle-timeout",
            type=click.FloatRange(min=0),
            default=defaults.idle_timeout,
            show_default=True,
            help="Seconds a data-plane connection may send nothing (between requests or inside one) "
            "before the node closes it, releasing its leases, reservations and grants (0: never). "
            "A same-host connection holding leases taken with HOLD waits on between requests.",
        ),
        click.option(
            "--write-ttl",
            type=click.FloatRange(min=0),
            default=defaults.write_ttl,
            show_default=True,
            help="Seconds a writer may hold reserved arena space before publishing it (a sliced value "
            "written layer by layer holds it for one model step); older space is revoked and its "
            "COMMIT answered EXPIRED (0: never).",
        ),
        click.option(
            "--max-table",
            type=POSITIVE_SIZE,
            default=format_size(defaults.max_table_bytes),
            show_default=True,
            help="Largest item table one request may carry (FRAME_TOO_LARGE past it).",
        ),
        click.option(
            "--auth-timeout",
            type=POSITIVE_FLOAT,
            default=defaults.auth_timeout,
            show_default=True,
            help="With --auth: seconds, in all, a data-plane connection has to authenticate (TLS "
            "handshake included); closed past them, however it trickles bytes.",
        ),
        click.option(
            "--max-unauthenticated",
            type=click.IntRange(min=1),
            default=defaults.max_unauthenticated,
            show_default=True,
            help="With --auth: data-plane connections that may wait to authenticate at once; one more "
            "closes the oldest of them. They never take a slot of --max-connections from an "
            "authenticated client.",
        ),
    ]
    for option in reversed(options):
        f = option(f)
    return f


def scheduling_options(f):
    """The conductor's settings (see kvstore.scheduler)."""
    options = [
        click.option(
            "--schedule-policy",
            type=click.Choice(["random", "load_balance", "cache_aware", "kvcache_centric"]),
            default="kvcache_centric",
            show_default=True,
            help="How the conductor picks prefill engines.",
        ),
        click.option(
            "--admission",
            type=click.Choice(["off", "none", "early", "prediction"]),
            default="prediction",
            show_default=True,
            help="Overload rejection: off, none (after prefill), early, prediction.",
        ),
        click.option(
            "--ttft-slo", type=POSITIVE_FLOAT, default=float("inf"), help="TTFT SLO in seconds (default: none)."
        ),
        click.option(
            "--tbt-slo", type=POSITIVE_FLOAT, default=float("inf"), help="TBT SLO in seconds (default: none)."
        ),
        click.option(
            "--request-ttl",
            type=click.FloatRange(min=0, min_open=True),
            default=3600.0,
            show_default=True,
            help="Seconds a scheduled request lives without a lifecycle report before it is forgotten.",
        ),
        click.option(
            "--max-requests",
            type=click.IntRange(min=1),
            default=100_000,
            show_default=True,
            help="Requests in flight per namespace; past it Schedule rejects (too_many_requests), so "
            "callers that never report keep the master's memory bounded.",
        ),
    ]
    for option in reversed(options):
        f = option(f)
    return f


def kv_events_options(f):
    """The master's KV events in vLLM's wire format (see kvstore.master.kv_events); `master` and `up`."""
    options = [
        click.option(
            "--kv-events",
            "kv_events",
            type=ENDPOINT,
            default=None,
            metavar="tcp://HOST:PORT",
            help="Publish BlockStored/BlockRemoved/AllBlocksCleared as vLLM KVEventBatch messages on a "
            "ZMQ PUB socket bound here (port 0: any; needs kvstore[events]). Default: off.",
        ),
        click.option(
            "--kv-events-replay",
            type=ENDPOINT,
            default=None,
            metavar="tcp://HOST:PORT",
            help="Also bind vLLM's replay ROUTER socket here (missed messages from a sequence number).",
        ),
        click.option(
            "--kv-events-topic",
            default="",
            metavar="PREFIX",
            help="Fixed prefix in front of each message's topic (the namespace).",
        ),
        click.option(
            "--kv-events-hashes",
            type=click.Choice(["bytes", "int64"]),
            default="int64",
            show_default=True,
            help="Block hashes as the digests' bytes, or as vLLM's int form (low 64 bits, big-endian: "
            "what vLLM emits by default and Dynamo decodes).",
        ),
    ]
    for option in reversed(options):
        f = option(f)
    return f


def cost_model_of(ctx):
    """The conductor's cost model from the config file's [cost_model] table (None: the default)."""
    from kvstore.config_file import shared_table
    from kvstore.scheduler.cost_model import CostModel, CostParams

    params = shared_table(ctx, "cost_model", CostParams)
    return None if params is None else CostModel(params)


def build_kv_events(kv_events, kv_events_replay, kv_events_topic, kv_events_hashes):
    """KVEventsOptions from the flags, or None when --kv-events is absent."""
    if kv_events is None:
        hashes_given = click.get_current_context().get_parameter_source("kv_events_hashes").name != "DEFAULT"
        for flag, given in (
            ("--kv-events-replay", kv_events_replay),
            ("--kv-events-topic", kv_events_topic),
            ("--kv-events-hashes", hashes_given),
        ):
            if given:
                raise click.UsageError(f"{flag} needs --kv-events")
        return None
    from kvstore.master.kv_events import KVEventsOptions
    from kvstore_client.errors import ConfigError

    try:
        return KVEventsOptions(kv_events, kv_events_replay, topic=kv_events_topic, hashes=kv_events_hashes)
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from None


def kv_events_lines(server) -> list[str]:
    if not server.kv_events_address:
        return []
    replay = f", replay on {server.kv_events_replay_address}" if server.kv_events_replay_address else ""
    return [f"KV events (vLLM format) on {server.kv_events_address}{replay}"]


def kv_events_record(server) -> dict:
    """The KV events endpoints for the JSON line (nothing when off, so the line is as before)."""
    if not server.kv_events_address:
        return {}
    return {"kv_events": server.kv_events_address, "kv_events_replay": server.kv_events_replay_address}


def tuning_options(f):
    """Eviction, tiering and lease knobs (kvstore.node.config.StoreConfig); `node` and `up`."""
    from kvstore.node.config import SSD_DAMAGED, StoreConfig
    from kvstore.transport.server import DEFAULT_LEASE_TTL

    d = StoreConfig()
    options = [
        click.option(
            "--high-watermark",
            type=click.FloatRange(0, 1, min_open=True),
            default=d.high_watermark,
            show_default=True,
            help="Fraction of a tier's capacity past which eviction starts.",
        ),
        click.option(
            "--low-watermark",
            type=click.FloatRange(0, 1, min_open=True),
            default=d.low_watermark,
            show_default=True,
            help="Fraction eviction brings a tier back under (<= --high-watermark).",
        ),
        click.option(
            "--eviction-batch",
            type=click.IntRange(min=1),
            default=d.eviction_batch,
            show_default=True,
            help="Blocks evicted or demoted per pass: larger passes take the store lock longer.",
        ),
        click.option(
            "--ssd-policy",
            type=click.Choice(["lru", "lfu", "length_aware"]),
            default=None,
            help="Eviction policy of the SSD tier [default: --policy].",
        ),
        click.option(
            "--ssd-damaged",
            type=click.Choice(SSD_DAMAGED),
            default=d.ssd_damaged,
            show_default=True,
            help="A damaged SSD file at start: refuse to start, or move it aside and start the tier empty.",
        ),
        click.option(
            "--promote/--no-promote",
            "promote_on_hit",
            default=d.promote_on_hit,
            show_default=True,
            help="Bring blocks read from SSD back into DRAM.",
        ),
        click.option(
            "--lease-ttl",
            type=click.FloatRange(min=0),
            default=DEFAULT_LEASE_TTL,
            show_default=True,
            help="Seconds a same-host reader's unreleased lease keeps a block in place (0: until the "
            "reader releases it or disconnects).",
        ),
    ]
    for option in reversed(options):
        f = option(f)
    return f


TUNING_OPTIONS = ("high_watermark", "low_watermark", "eviction_batch", "ssd_policy", "ssd_damaged", "promote_on_hit")


def build_store_config(data_dir, dram, ssd, max_block, policy, limits=None):
    """The node's StoreConfig; ``limits``: --max-connections, --idle-timeout, --max-table and the
    tuning options (by name)."""
    import os

    from kvstore.node.config import ConnectionLimits, StoreConfig

    limits = dict(limits or {})
    tuning = {name: limits.pop(name) for name in TUNING_OPTIONS if name in limits}
    for name in ("idle_timeout", "write_ttl"):
        if limits.get(name) == 0:
            limits[name] = None  # 0 on the command line: never
    if "max_table" in limits:
        limits["max_table_bytes"] = limits.pop("max_table")
    return StoreConfig(
        dram_capacity=dram,
        ssd_path=os.path.join(data_dir, "ssd") if ssd else None,
        ssd_capacity=ssd,
        max_block_bytes=max_block,
        policy=policy,
        connections=ConnectionLimits(**limits),
        **tuning,
    )


def announce(as_json: bool, lines: list[str], record: dict) -> None:
    """Say where things listen: for people, or one JSON line for scripts."""
    click.echo(json.dumps(record) if as_json else "\n".join(lines))


@main.command()
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", type=PORT, default=7700, show_default=True, help="gRPC port (0: any free port).")
@click.option(
    "--metrics-port", type=METRICS_PORT, default=7702, show_default=True, help="Prometheus port (0: any, -1: off)."
)
@click.option(
    "--conductor-port",
    type=METRICS_PORT,
    default=0,
    show_default=True,
    help="Port of the conductor port, where routers send Schedule and ReportRequest as framed TCP "
    "(0: any free port, announced in ClusterStatus; -1: off, routers use gRPC).",
)
@click.option(
    "--ttl",
    type=POSITIVE_FLOAT,
    default=5.0,
    show_default=True,
    help="Seconds without heartbeat before a node is dropped.",
)
@click.option("--replicas", type=POSITIVE_INT, default=1, show_default=True, help="Copies of each block (best effort).")
@click.option(
    "--etcd",
    "etcd_endpoints",
    default=None,
    metavar="HOST:PORT[,HOST:PORT...]",
    help="Campaign for leadership through this etcd cluster: the leader serves, standbys answer "
    "UNAVAILABLE and take over when its lease lapses (nodes and clients then name the cluster "
    "etcd://HOST:PORT[,...]).",
)
@click.option(
    "--etcd-prefix",
    default="/kvstore",
    show_default=True,
    help="etcd key prefix of this cluster's election (the leader key is PREFIX/leader).",
)
@click.option(
    "--etcd-lease-ttl",
    type=POSITIVE_INT,
    default=5,
    show_default=True,
    help="Seconds of the leader's etcd lease: a dead leader is replaced after about this long.",
)
@click.option(
    "--advertise",
    type=HOST_PORT,
    default=None,
    metavar="HOST:PORT",
    help="The gRPC address put in etcd for nodes and clients (default: the address listened on).",
)
@etcd_tls_options
@scheduling_options
@kv_events_options
@service_security_options
@config_option
@click.option("--json", "as_json", is_flag=True, help="Print one JSON line with the addresses.")
def master(
    host,
    port,
    metrics_port,
    conductor_port,
    ttl,
    replicas,
    etcd_endpoints,
    etcd_prefix,
    etcd_lease_ttl,
    advertise,
    as_json,
    kv_events,
    kv_events_replay,
    kv_events_topic,
    kv_events_hashes,
    auth_file,
    insecure,
    token,
    tls_cert,
    tls_key,
    tls_ca,
    tls_mutual,
    etcd_ca,
    etcd_cert,
    etcd_key,
    **scheduling,
) -> None:
    """Run the master: membership, the global prefix index, placement and the conductor."""
    from kvstore.serving import service_process

    events = build_kv_events(kv_events, kv_events_replay, kv_events_topic, kv_events_hashes)
    security = ServiceSecurity.from_flags(auth_file, insecure, token, tls_cert, tls_key, tls_ca, tls_mutual)
    etcd = None
    if etcd_endpoints:
        from kvstore.master.election import EtcdOptions
        from kvstore_client.etcd import parse_endpoints

        try:
            parse_endpoints(etcd_endpoints)
        except ValueError as exc:
            raise click.BadParameter(str(exc), param_hint="--etcd") from None
        etcd = EtcdOptions(
            etcd_endpoints, etcd_prefix, etcd_lease_ttl, advertise, tls=etcd_tls_of(etcd_ca, etcd_cert, etcd_key)
        )
    signals = service_process()
    server = start_master(
        host,
        port,
        metrics_port,
        ttl,
        replicas,
        kv_events=events,
        security=security,
        cost=cost_model_of(click.get_current_context()),
        etcd=etcd,
        conductor_port=None if conductor_port < 0 else conductor_port,
        **scheduling,
    )
    announce(
        as_json,
        [f"kvstore master listening on {server.address}"]
        + ([f"campaigning for leadership in etcd {etcd_endpoints} under {etcd_prefix}"] if etcd else [])
        + (
            [f"metrics on {'https' if security.tls else 'http'}://{server.metrics_address}/metrics"]
            if server.metrics_address
            else []
        )
        + ([f"conductor port on {server.conductor_address}"] if server.conductor_address else [])
        + kv_events_lines(server),
        {
            "master": server.address,
            "metrics": server.metrics_address,
            "conductor": server.conductor_address,
            **kv_events_record(server),
            **({"etcd": f"etcd://{etcd_endpoints}{'' if etcd_prefix == '/kvstore' else etcd_prefix}"} if etcd else {}),
        },
    )
    if security.access is not None:
        signals.on_hangup(security.access.reload)  # kill -HUP: revoke and add tokens without a restart
    signals.serve([server.stop])


def start_master(
    host,
    port,
    metrics_port,
    ttl,
    replicas,
    schedule_policy="kvcache_centric",
    admission="prediction",
    ttft_slo=float("inf"),
    tbt_slo=float("inf"),
    kv_events=None,
    request_ttl=3600.0,
    security=None,
    cost=None,
    etcd=None,
    max_requests=100_000,
    conductor_port=0,
):
    from kvstore.master.conductor_service import SchedulingOptions
    from kvstore.master.server import MasterServer

    security = security or ServiceSecurity()
    security.check_exposure(host, "master")
    if kv_events is not None:
        for endpoint in filter(None, (kv_events.endpoint, kv_events.replay_endpoint)):
            if endpoint.startswith("tcp://"):
                security.check_unguarded(endpoint[len("tcp://") :].rsplit(":", 1)[0], "KV events endpoint")

    scheduling = SchedulingOptions(
        policy=schedule_policy,
        admission=admission,
        ttft_slo_s=ttft_slo,
        tbt_slo_s=tbt_slo,
        request_ttl_s=request_ttl,
        max_requests=max_requests,
    )
    return MasterServer(
        host=host,
        port=port,
        ttl_s=ttl,
        heartbeat_interval_s=min(1.0, ttl / 3),
        replication_factor=replicas,
        scheduling=scheduling,
        kv_events=kv_events,
        metrics_port=None if metrics_port < 0 else metrics_port,
        access=security.access,
        tls=security.tls,
        dialing=security.dialing,
        cost=cost,
        etcd=etcd,
        conductor_port=conductor_port,
    ).start()


@main.command()
@click.option(
    "--master",
    "master_address",
    default="127.0.0.1:7700",
    show_default=True,
    help="The master's host:port, or etcd://HOST:PORT[,...][/PREFIX] (masters with --etcd).",
)
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to serve blocks on.")
@click.option("--port", type=PORT, default=7701, show_default=True, help="Data-plane TCP port (0: any free port).")
@click.option(
    "--metrics-port", type=METRICS_PORT, default=7703, show_default=True, help="Prometheus port (0: any, -1: off)."
)
@advertise_option
@store_options
@tuning_options
@connection_options
@service_security_options
@etcd_tls_options
@config_option
@click.option("--json", "as_json", is_flag=True, help="Print one JSON line with the addresses.")
def node(
    master_address,
    host,
    port,
    metrics_port,
    advertise,
    data_dir,
    dram,
    ssd,
    max_block,
    policy,
    as_json,
    auth_file,
    insecure,
    token,
    tls_cert,
    tls_key,
    tls_ca,
    tls_mutual,
    etcd_ca,
    etcd_cert,
    etcd_key,
    **limits,
) -> None:
    """Run a storage node: DRAM and SSD tiers served to clients, reported to the master."""
    from kvstore.serving import service_process

    security = ServiceSecurity.from_flags(
        auth_file,
        insecure,
        token,
        tls_cert,
        tls_key,
        tls_ca,
        tls_mutual,
        needs_token=True,
        etcd_tls=etcd_tls_of(etcd_ca, etcd_cert, etcd_key),
    )
    signals = service_process()
    storage = start_node(
        master_address,
        host,
        port,
        metrics_port,
        data_dir,
        dram,
        ssd,
        max_block,
        policy,
        advertise,
        limits,
        security,
        stopping=lambda: signals.stopping,
    )
    announce(as_json, node_lines(storage), node_record(storage))
    if security.access is not None:
        signals.on_hangup(security.access.reload)  # kill -HUP: revoke and add tokens without a restart
    signals.serve([storage.stop])


def start_node(
    master_address,
    host,
    port,
    metrics_port,
    data_dir,
    dram,
    ssd,
    max_block,
    policy,
    advertise=None,
    limits=None,
    security=None,
    stopping=None,
):
    from kvstore.node.daemon import NodeOptions, StorageNode

    security = security or ServiceSecurity()
    security.check_exposure(host, "node")
    limits = dict(limits or {})
    lease_ttl = limits.pop("lease_ttl", NodeOptions.lease_ttl)
    config = build_store_config(data_dir, dram, ssd, max_block, policy, limits)
    options = NodeOptions(
        master=master_address,
        host=host,
        port=port,
        data_dir=data_dir,
        advertise=advertise,
        metrics_port=None if metrics_port < 0 else metrics_port,
        access=security.access,
        tls=security.tls,
        credentials=security.dialing,
        lease_ttl=lease_ttl or None,
        stopping=stopping or NodeOptions.stopping,
    )
    return StorageNode(config, options).start()


def node_record(storage) -> dict:
    info = storage.info()
    return {
        "node_id": info.node_id,
        "data": info.data_address,
        "unix_socket": info.unix_socket,
        "shm_arena": info.shm_arena,
        "metrics": info.metrics_address,
    }


def node_lines(storage) -> list[str]:
    from kvstore.units import format_size

    info, cfg = storage.info(), storage.config
    arena = storage.store.dram.arena
    pages = {"huge": "huge pages", "4KiB": "4 KiB pages", "mixed": "partly on huge pages"}.get(
        info.arena_pages, "page size unknown"
    )
    lines = [
        f"kvstore node {info.node_id} serving blocks on {info.data_address}"
        + (f" and {info.unix_socket}" if info.unix_socket else ""),
        f"  DRAM tier {format_size(cfg.dram_capacity)} in shared memory {arena.path} ({pages})",
    ]
    if cfg.ssd_path:
        lines.append(f"  SSD tier {format_size(cfg.ssd_capacity)} under {cfg.ssd_path}")
    if info.metrics_address:
        lines.append(f"  metrics on {storage.metrics.scheme}://{info.metrics_address}/metrics")
    return lines


@main.command()
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", type=PORT, default=7700, show_default=True, help="Master gRPC port (0: any free port).")
@click.option("--data-port", type=PORT, default=7701, show_default=True, help="Node data-plane port (0: any).")
@click.option(
    "--metrics-port",
    type=click.IntRange(-1, 65534),
    default=7702,
    show_default=True,
    help="Master metrics port; the node's is the next one (0: any, -1: off).",
)
@advertise_option
@store_options
@tuning_options
@connection_options
@kv_events_options
@service_security_options
@config_option
@click.option("--json", "as_json", is_flag=True, help="Print one JSON line with the addresses.")
def up(
    host,
    port,
    data_port,
    metrics_port,
    advertise,
    data_dir,
    dram,
    ssd,
    max_block,
    policy,
    as_json,
    kv_events,
    kv_events_replay,
    kv_events_topic,
    kv_events_hashes,
    auth_file,
    insecure,
    token,
    tls_cert,
    tls_key,
    tls_ca,
    tls_mutual,
    **limits,
) -> None:
    """Run the embedded default: a master and one storage node in this process."""
    from kvstore.serving import service_process

    events = build_kv_events(kv_events, kv_events_replay, kv_events_topic, kv_events_hashes)
    security = ServiceSecurity.from_flags(
        auth_file, insecure, token, tls_cert, tls_key, tls_ca, tls_mutual, needs_token=True
    )
    signals = service_process()
    master_server = start_master(
        host,
        port,
        metrics_port,
        5.0,
        1,
        kv_events=events,
        security=security,
        cost=cost_model_of(click.get_current_context()),
    )
    node_metrics = metrics_port + 1 if metrics_port > 0 else metrics_port
    storage = start_node(
        master_server.address,
        host,
        data_port,
        node_metrics,
        data_dir,
        dram,
        ssd,
        max_block,
        policy,
        advertise,
        limits,
        security,
    )
    announce(
        as_json,
        [f"kvstore up: master on {master_server.address}"]
        + node_lines(storage)
        + kv_events_lines(master_server)
        + [f"try: kvstore status --master {master_server.address}"],
        {
            "master": master_server.address,
            "master_metrics": master_server.metrics_address,
            **node_record(storage),
            **kv_events_record(master_server),
        },
    )
    if security.access is not None:  # the master's and the node's: one file, one reload
        signals.on_hangup(security.access.reload)
    signals.serve([storage.stop, master_server.stop])


@main.command()
@click.argument("name")
@click.option(
    "--role",
    type=click.Choice(["admin", "node", "tenant", "metrics"]),
    required=True,
    help="What the token may do (metrics: scrape the Prometheus endpoints, nothing else).",
)
@click.option(
    "--namespace",
    "namespaces",
    multiple=True,
    metavar="NS",
    help="A namespace the tenant may use (repeat; a prefix ends in *). Tenants only.",
)
@click.option("--quota", type=SIZE, default=None, help="Bytes the tenant may hold across the pool.")
@click.option(
    "--hashed",
    is_flag=True,
    help="Write secret_sha256 (the token then goes to stderr, once, and the file never holds it).",
)
def token(name, role, namespaces, quota, hashed) -> None:
    """Make a token: print its access-file entry (append it to the file given to --auth)."""
    from kvstore.security.tokens import new_entry

    entry, secret = new_entry(name, role, list(namespaces), quota, hashed)
    click.echo(entry)
    if hashed:
        click.echo(f"token for {name}: {secret}", err=True)


# -- inspection --------------------------------------------------------------------------------


@main.command(context_settings={"ignore_unknown_options": True, "allow_extra_args": True, "help_option_names": []})
@click.argument("command_name", metavar="COMMAND")
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def config(command_name, args, as_json) -> None:
    """Print the settings COMMAND would run with given ARGS, and where each comes from
    (command line, environment, config file, default), without running it."""
    from kvstore.config_file import effective

    ctx = click.get_current_context()
    command = main.commands.get(command_name)
    if command is None or command_name == "config":
        raise click.BadParameter(f"no such command {command_name!r} (commands: {', '.join(sorted(main.commands))})")
    ctx.meta[DRY_RUN] = True
    records = effective(command, command_name, list(args), ctx.find_root())
    if as_json:
        click.echo(json.dumps(records, indent=2, default=str))
        return
    width = max(len(r["option"]) for r in records)
    for r in records:
        click.echo(f"{r['option']:<{width}}  {r['value']!s:<24}  {r['source']:<12}  {r['env']}")


@main.command()
@click.option(
    "--master",
    "master_address",
    default="127.0.0.1:7700",
    show_default=True,
    help="The master's host:port, or etcd://HOST:PORT[,...][/PREFIX] (masters with --etcd).",
)
@client_security_options
@etcd_tls_options
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
def status(master_address, as_json, **credentials) -> None:
    """Show the pool: nodes, their tiers, use, blocks and hit rates."""
    from kvstore.admin import cluster_status_record, format_status

    with connect(master_address, **credentials) as client:
        record = cluster_status_record(client.cluster_status())
    click.echo(json.dumps(record, indent=2) if as_json else format_status(record))


@main.command()
@click.argument("node_id")
@click.option(
    "--master",
    "master_address",
    default="127.0.0.1:7700",
    show_default=True,
    help="The master's host:port, or etcd://HOST:PORT[,...][/PREFIX] (masters with --etcd).",
)
@click.option("--cancel", is_flag=True, help="Put the node back in service instead.")
@click.option(
    "--wait",
    "wait_s",
    type=click.FloatRange(min=0),
    default=0,
    show_default=True,
    help="Seconds to wait until the node's blocks have left the index (0: do not wait).",
)
@client_security_options
@etcd_tls_options
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def drain(node_id, master_address, cancel, wait_s, as_json, **credentials) -> None:
    """Take storage node NODE_ID out of service before stopping it (admin token): no new
    placements on it; blocks only it holds are copied to other nodes, then its blocks leave
    the index. It keeps serving until it is stopped."""
    from kvstore.admin import wait_drained

    with connect(master_address, **credentials) as client:
        reply = client.drain(node_id, cancel=cancel)
        if not reply.known:
            raise click.ClickException(f"the master knows no node {node_id!r} (see kvstore status)")
        record = {
            "node_id": node_id,
            "draining": not cancel,
            "indexed_blocks": reply.indexed_blocks,
            "copying": reply.copying,
        }
        if wait_s and not cancel:
            record["drained"] = wait_drained(client, node_id, wait_s)
    if as_json:
        click.echo(json.dumps(record))
    elif cancel:
        click.echo(f"node {node_id} is back in service")
    else:
        click.echo(
            f"draining node {node_id}: {reply.indexed_blocks} blocks indexed, {reply.copying} held by no "
            f"other node are being copied" + {True: "; done", False: "; not done yet", None: ""}[record.get("drained")]
        )
    if record.get("drained") is False:
        raise SystemExit(1)


@main.command()
@click.option(
    "--master",
    "master_address",
    default="127.0.0.1:7700",
    show_default=True,
    help="The master's host:port, or etcd://HOST:PORT[,...][/PREFIX] (masters with --etcd).",
)
@click.option("--namespace", default="", help="Only this namespace (default: all).")
@click.option("--limit", type=POSITIVE_INT, default=50, show_default=True, help="How many keys to list.")
@client_security_options
@etcd_tls_options
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
def keys(master_address, namespace, limit, as_json, **credentials) -> None:
    """List blocks in the pool with the nodes and tiers that hold them."""
    from kvstore.admin import format_keys, keys_record

    with connect(master_address, **credentials) as client:
        record = keys_record(client.list_keys(namespace=namespace, limit=limit))
    if namespace and namespace not in record["namespaces"]:
        raise click.ClickException(
            f"no block in the pool is in namespace {namespace!r} "
            f"(namespaces: {', '.join(record['namespaces']) or 'none yet'})"
        )
    click.echo(json.dumps(record, indent=2) if as_json else format_keys(record))


@main.command()
@click.option(
    "--master",
    "master_address",
    default=None,
    help="Benchmark this pool (default: start one, master and node in a process of their own).",
)
@click.option("--sizes", default="64KiB,1MiB,4MiB", show_default=True, help="Comma-separated value sizes.")
@click.option(
    "--ops",
    default=None,
    help="Comma-separated ops, e.g. put,get_into [default: all; an unknown name lists them]. "
    "put_nowait: puts that do not wait for the node (put(wait=False)), timed until all are answered.",
)
@click.option("--transports", default="tcp,shm", show_default=True, help="Data paths: tcp, shm.")
@click.option("--clients", default="1,4", show_default=True, help="Client process counts, e.g. 1,2,4.")
@click.option(
    "--bytes",
    "bytes_per_client",
    type=POSITIVE_SIZE,
    default="64MiB",
    show_default=True,
    help="Working set of each client at each size.",
)
@click.option(
    "--batch", type=POSITIVE_INT, default=64, show_default=True, help="Blocks per batch call and Redis pipeline."
)
@click.option(
    "--rounds", type=POSITIVE_INT, default=5, show_default=True, help="Interleaved rounds (figures are medians)."
)
@click.option(
    "--dram", type=POSITIVE_SIZE, default=None, help="DRAM of the pool started here (default: twice the working set)."
)
@click.option("--no-redis", is_flag=True, help="Skip the Redis baselines (redis-py and redis-benchmark).")
@click.option(
    "--shm-dir",
    envvar="KVSTORE_SHM_DIR",
    default=None,
    callback=_use_shm_dir,
    expose_value=False,
    help="Directory (a tmpfs) for the arena of the pool started here [default: /dev/shm].",
)
@click.option("--quiet", is_flag=True, help="No progress bar.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON: one record per (size, op, transport, clients).")
@click.option("--plot", "plot_path", default=None, metavar="FILE", help="Write a PNG of GB/s against value size.")
def bench(
    master_address,
    sizes,
    ops,
    transports,
    clients,
    bytes_per_client,
    batch,
    rounds,
    dram,
    no_redis,
    quiet,
    as_json,
    plot_path,
) -> None:
    """Throughput and latency through the SDK next to memcpy, a raw socket and Redis."""
    from kvstore.benchmark import OPS, TRANSPORTS, Settings, emit, parse_list, run

    try:
        settings = Settings(
            sizes=[parse_size(s) for s in parse_list(sizes)],
            ops=parse_list(ops, OPS) if ops else list(OPS),
            transports=parse_list(transports, TRANSPORTS),
            clients=[int(c) for c in parse_list(clients)],
            bytes_per_client=bytes_per_client,
            batch=batch,
            rounds=rounds,
            master=master_address,
            dram=dram,
            redis=not no_redis,
            progress=not quiet,
        )
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None
    emit(run(settings), as_json, plot_path, echo=click.echo)


@main.command()
@click.option(
    "--master",
    "master_address",
    default="127.0.0.1:7700",
    show_default=True,
    help="The master's host:port, or etcd://HOST:PORT[,...][/PREFIX] (masters with --etcd).",
)
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to serve HTTP on.")
@click.option("--port", type=PORT, default=8000, show_default=True, help="HTTP port (0: any free port).")
@click.option(
    "--namespace",
    default="vllm",
    show_default=True,
    help="The engines' connector namespace (kv_connector_extra_config 'namespace'): where their records are.",
)
@click.option(
    "--connect-timeout", type=POSITIVE_FLOAT, default=5.0, show_default=True, help="Seconds to connect to an engine."
)
@click.option(
    "--read-timeout",
    type=POSITIVE_FLOAT,
    default=60.0,
    show_default=True,
    help="Seconds an engine may send nothing (between stream chunks, or before its answer) before the request fails.",
)
@click.option(
    "--prefill-timeout",
    type=POSITIVE_FLOAT,
    default=300.0,
    show_default=True,
    help="Seconds one prefill call may take in all.",
)
@click.option(
    "--index-wait",
    type=click.FloatRange(min=0),
    default=1.0,
    show_default=True,
    help="Seconds to wait after a prefill for the master's index to list the prompt's blocks.",
)
@switch_interval_option
@client_security_options
@etcd_tls_options
@config_option
@click.option("--json", "as_json", is_flag=True, help="Print one JSON line with the address.")
def router(
    master_address,
    host,
    port,
    namespace,
    connect_timeout,
    read_timeout,
    prefill_timeout,
    index_wait,
    switch_interval,
    as_json,
    **credentials,
) -> None:
    """Serve an OpenAI-compatible API that runs prefill and decode on the engines the conductor picks."""
    from kvstore.router.server import PoolBackend, Router, serve
    from kvstore.serving import service_process

    signals = service_process(switch_interval)
    backend = PoolBackend(connect(master_address, **credentials), namespace)
    routing = Router(
        backend,
        connect_timeout=connect_timeout,
        read_timeout=read_timeout,
        prefill_timeout=prefill_timeout,
        index_wait_s=index_wait,
    )

    import concurrent.futures
    import threading

    listening: concurrent.futures.Future = concurrent.futures.Future()
    loop = router_event_loop()
    task = loop.create_task(serve(routing, host, port, listening.set_result))

    def run() -> None:
        try:
            loop.run_until_complete(task)
        except BaseException as exc:  # noqa: BLE001 - a failed start is reported by the main thread
            if not listening.done():
                listening.set_exception(exc)

    thread = threading.Thread(target=run, name="kvstore-router", daemon=True)
    thread.start()
    try:
        url = listening.result()
    except OSError as exc:
        raise click.ClickException(f"router: cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    announce(as_json, [f"kvstore router listening on {url} (master {master_address})"], {"router": url})
    signals.serve([lambda: loop.call_soon_threadsafe(task.cancel), lambda: thread.join(timeout=10)])


def router_event_loop():
    """uvloop's event loop when it is installed (the router extra brings it), else asyncio's."""
    import asyncio

    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def connect(master_address: str, etcd_ca=None, etcd_cert=None, etcd_key=None, **credentials):
    """A Client of the pool at ``master_address``; ``credentials``: token, tls_ca, tls_cert, tls_key;
    the etcd_* files: TLS to the etcd of an etcd:// address."""
    from kvstore_client.client import Client

    return Client(master_address, etcd_tls=etcd_tls_of(etcd_ca, etcd_cert, etcd_key), **credentials)


if __name__ == "__main__":
    main()
