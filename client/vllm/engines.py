"""An engine with a ``role`` joins the master's conductor: registered, its load reported, gone at stop.

The scheduler's connector (in the engine's main process: vLLM's EngineCore) holds one
:class:`EngineAnnouncement`. At start it

- finds the storage node the engine's KV lands on: the node the SDK places its puts on, a
  live node on this machine first (``machine_id``), else the first live node;
- registers the engine with the conductor of the engine's pool namespace for its last layer
  (the namespace whose keys decide a hit, so the conductor's prefix lookup reads the very
  blocks the connector looks up): as ``engine_id`` for one role, as ``engine_id#prefill`` and
  ``engine_id#decode`` for ``both`` (the conductor keeps one role per id);
- writes an engine record, JSON, into the pool at ``(<namespace>/engines, sha256(engine_id))``:
  the URL, the conductor ids and namespace, the hashing settings and whether the engine stores
  prompts' partial last blocks (``partial_blocks``), which is how ``kvstore router`` finds
  engines, hashes prompts exactly as they do and knows which keys to wait for.

A thread then reports the load the connector sees every ``load_report_interval`` seconds
(:class:`LoadTracker`) and puts the record back if the pool lost it. ``close`` (connector
shutdown, or at exit) deregisters and removes the record.

The conductor keeps its engines in the leader's memory only: a master restarted, or a
standby that took over through etcd, knows none. It answers a load report from an engine
it does not know with INVALID_ARGUMENT, "unknown engine ...: register it first"
(``UNKNOWN_ENGINE``); the reporter then registers that id again at once, on the same node,
and sends the report again, so an engine is back in the new leader's schedule within one
report interval of the master serving (a report that finds no master at all just fails
and is retried at the next interval). An engine killed outright stays registered until
a router finds it unreachable and tells the conductor (kvstore.router.server), or else
until the conductor's request TTL ends its requests.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import logging
import threading
from typing import Any

from kvstore_client.errors import InvalidValue, KVStoreError

log = logging.getLogger(__name__)

RECORDS = "engines"  # the records' namespace under the connector's namespace
#: in the conductor's INVALID_ARGUMENT answer to a report from an engine it does not know
#: (kvstore.scheduler.conductor.Conductor.report_load): the reporter registers again
UNKNOWN_ENGINE = "unknown engine"


def record_key(namespace: str, engine_id: str) -> tuple[str, bytes]:
    return f"{namespace}/{RECORDS}", hashlib.sha256(engine_id.encode()).digest()


def conductor_ids(engine_id: str, role: str) -> dict[str, str]:
    """Conductor role -> the id the engine registers under."""
    if role == "both":
        return {"prefill": f"{engine_id}#prefill", "decode": f"{engine_id}#decode"}
    return {role: engine_id}


def engine_of(conductor_id: str) -> str:
    """The engine id of a conductor id (``#prefill``/``#decode`` dropped)."""
    return conductor_id.split("#", 1)[0]


def local_node(cluster_status, machine: str) -> str:
    """The node the SDK would place this machine's puts on: a live one here first, else the first live one."""
    alive = [n.info for n in cluster_status.nodes if n.alive]
    if not alive:
        raise KVStoreError("no live storage node: the engine cannot register with the conductor")
    here = [info for info in alive if info.machine_id == machine]
    return (here or alive)[0].node_id


class LoadTracker:
    """The requests the scheduler's connector has been told about, as the conductor wants them:
    waiting (looked up, no blocks yet) and running (blocks allocated, not finished)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiting: dict[str, Any] = {}
        self._running: dict[str, Any] = {}

    def seen(self, request) -> None:
        with self._lock:
            if request.request_id not in self._running:
                self._waiting[request.request_id] = request

    def allocated(self, request) -> None:
        with self._lock:
            self._waiting.pop(request.request_id, None)
            self._running[request.request_id] = request

    def finished(self, request_id: str) -> None:
        with self._lock:
            self._waiting.pop(request_id, None)
            self._running.pop(request_id, None)

    def load(self) -> dict[str, int]:
        with self._lock:
            waiting, running = list(self._waiting.values()), list(self._running.values())
        tokens = sum(int(getattr(r, "num_tokens", 0)) for r in running)
        # prefill reads queue_length (busy_s: the connector cannot time the engine; 0 lets the
        # conductor use its own estimate of what it assigned); decode reads running_batch, context_tokens
        return {"queue_length": len(waiting) + len(running), "running_batch": len(running), "context_tokens": tokens}


class EngineAnnouncement:
    """Registration, load reports and the engine record of one engine (see the module doc)."""

    def __init__(
        self,
        client,
        settings,
        conductor_namespace: str,
        *,
        block_size: int,
        hash_algo: str,
        hash_seed: str | None,
        model: str,
    ):
        self._client = client
        self._settings = settings
        self.conductor_namespace = conductor_namespace
        self.engine_id = settings.engine_id
        self.ids = conductor_ids(self.engine_id, settings.role)
        self.tracker = LoadTracker()
        self._key = record_key(settings.namespace, self.engine_id)
        self.record = {
            "engine_id": self.engine_id,
            "url": settings.engine_url,
            "role": settings.role,
            "ids": self.ids,
            "conductor_namespace": conductor_namespace,
            "block_size": block_size,
            "hash_algo": hash_algo,
            "hash_seed": hash_seed,
            "model": model,
            "partial_blocks": settings.partial_blocks,
        }
        self._value = json.dumps(self.record, sort_keys=True).encode()
        self._stop = threading.Event()
        self._closed = False
        self._thread: threading.Thread | None = None
        self.reregistered = 0  # registrations again after a conductor forgot this engine

    def start(self) -> None:
        from kvstore_client.hostid import machine_id

        self.node_id = local_node(self._client.cluster_status(), machine_id())
        for role, conductor_id in self.ids.items():
            self._register(role, conductor_id)
        self._client.put(self._key, self._value)
        log.info(
            "kvstore: engine %s registered with the conductor as %s in %s on node %s",
            self.engine_id,
            ", ".join(f"{r} {i}" for r, i in self.ids.items()),
            self.conductor_namespace,
            self.node_id,
        )
        self._thread = threading.Thread(target=self._report_loop, name="kvstore-load-reports", daemon=True)
        self._thread.start()
        atexit.register(self.close)

    def _report_loop(self) -> None:
        failing = False
        ticks = 0
        while not self._stop.wait(self._settings.load_report_interval):
            try:
                self.report()
                ticks += 1
                if ticks % 20 == 0 and not self._client.exists(self._key):
                    self._client.put(self._key, self._value)  # evicted: the router must still find us
                if failing:
                    log.warning("kvstore: load reports reach the conductor again")
                failing = False
            except (KVStoreError, OSError) as exc:
                if not failing:
                    log.warning(
                        "kvstore: load report failed (%s); retrying every %.1f s",
                        exc,
                        self._settings.load_report_interval,
                    )
                failing = True

    def _register(self, role: str, conductor_id: str) -> None:
        self._client.scheduling.register_engine(self.conductor_namespace, conductor_id, role, self.node_id)

    def report(self) -> None:
        """Report the load under every conductor id; an id the conductor does not know (a new
        master) is registered again and its report sent once more."""
        load = self.tracker.load()
        for role, conductor_id in self.ids.items():
            try:
                self._client.scheduling.report_load(self.conductor_namespace, conductor_id, **load)
            except InvalidValue as exc:
                if UNKNOWN_ENGINE not in str(exc):
                    raise
                self._register(role, conductor_id)
                self.reregistered += 1
                log.warning(
                    "kvstore: the conductor did not know engine %s (a new master): registered again as "
                    "%s %s on node %s",
                    self.engine_id,
                    role,
                    conductor_id,
                    self.node_id,
                )
                self._client.scheduling.report_load(self.conductor_namespace, conductor_id, **load)

    def close(self) -> None:
        """Deregister and remove the record; safe to call twice (shutdown, then at exit)."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        try:
            for conductor_id in self.ids.values():
                self._client.scheduling.deregister_engine(self.conductor_namespace, conductor_id)
            self._client.remove(self._key)
        except (KVStoreError, OSError) as exc:
            log.warning("kvstore: could not deregister engine %s: %s", self.engine_id, exc)
        try:
            atexit.unregister(self.close)
        except Exception:  # pragma: no cover - interpreter shutting down
            pass
