"""KV events out of the pool, in vLLM's wire format: what the master announces and why.

``kvstore master --kv-events tcp://HOST:PORT`` publishes the pool's contents as
vLLM's ``KVEventBatch`` messages (``BlockStored`` / ``BlockRemoved`` /
``AllBlocksCleared``) on a ZMQ PUB socket, and serves vLLM's replay protocol on
a ROUTER socket (``--kv-events-replay``), so a router that already consumes
vLLM engines' KV events (NVIDIA Dynamo, llm-d) can index what the pool holds.
This module is the policy, pure Python: the options, and how index changes
become events. The mechanism lives apart: ``kv_events_buffers`` (bounded
queue and replay buffer), ``kv_events_wire`` (msgspec encoding),
``kv_events_publisher`` (the ZMQ thread); msgspec and pyzmq load only when
the flag is given.

Semantics, seen from a router:

- One block is one pool key (namespace, digest). ``block_hashes`` carry the
  digests in vLLM's int form by default (the low 64 bits of the big-endian
  digest: what vLLM emits with its default ``VLLM_KV_EVENTS_USE_INT_BLOCK_
  HASHES=1``, and what Dynamo's decoder reads), or as the digests' bytes with
  ``--kv-events-hashes bytes`` (vLLM's connector stores vLLM's own sha256 block
  hashes, 32 bytes), so a router can join the pool's events with the engines'.
- Topic = ``--kv-events-topic`` (a fixed prefix, default empty) + the namespace,
  one KVEventBatch per namespace per flush (split at ``max_block_hashes``).
  ZMQ's own prefix SUBSCRIBE filters: one namespace (e.g. one attention layer's
  ``<prefix>/<model>/layer<i>``) or a tenant prefix. It matches prefixes only,
  so ``.../layer1`` also receives ``.../layer10``: compare the topic frame to
  keep exactly one namespace.
- A block is *stored* when its first copy appears (any node, any tier) and
  *removed* when its last copy goes (the node removed it, evicted it, was
  dropped after its lease ran out, or re-registered and its inventory lacks
  it). Replicas are one block: a second copy, or losing one of two, says
  nothing.
- ``medium`` is ``"CPU"`` while some copy is in DRAM, else ``"STORAGE"``
  (vLLM's MEDIUM_CPU / MEDIUM_STORAGE). When a block's medium changes (its last
  DRAM copy demoted to SSD, or an SSD-only block promoted) the master sends
  ``BlockRemoved`` in the old medium, then ``BlockStored`` in the new one, in
  the same message (vLLM's offloading connector likewise reports each medium
  with its own stores and removals): a router keyed by (hash, medium) moves
  it, and one that ignores the medium ends with the block present.
- Fields the pool does not know take the values vLLM's own offloading
  placeholders use: ``parent_block_hash=None``, ``token_ids=[]``,
  ``block_size=0``, ``lora_id=None``, ``lora_name=None``; the optional trailing
  fields are left out (their defaults). So the hashes of one event are a set,
  not a chain: a consumer that rebuilds a tree from parent links or tokens
  cannot use them; one that looks hashes up (as the pool is queried) can.
- ``AllBlocksCleared`` on the bare prefix topic means "nothing is held": it
  is the first message (seq 0) after the master starts (its index starts
  empty) and follows the removals whenever the index becomes empty (e.g.
  every node is gone). A subscriber filtering one namespace does not get
  these: it sees a master restart as the sequence number going back, and can
  replay from 0.
- Sequence numbers count every message of this master (8 bytes, big-endian,
  from 0), not per topic, as vLLM's replay protocol has one number for the
  stream: a subscriber of everything sees +1 steps and a gap means loss; a
  filtered one sees gaps that are other topics. ``data_parallel_rank`` is 0
  (vLLM's publisher always sends its rank, and Dynamo's decoder expects it).
- Overload never blocks the master: index changes wait in a bounded queue.
  When it overflows they are dropped (counted, logged) and the next flush
  resyncs: ``AllBlocksCleared`` on the bare topic and on each namespace
  subscribers may hold blocks of (all before anything else, so a consumer
  that ignores topics is right too), then ``BlockStored`` for every block
  the index holds, then the changes since the drop. So no subscriber keeps a
  block that is gone: replaying changes over a later snapshot converges,
  since each change states its result.
- Events are derived from each index call's net effect, per key and without
  state of their own: a key stored and removed within one flush gives both
  events; a call that leaves a key as it was (an inventory resent) gives none.

The replay ROUTER answers vLLM's request (frames: identity, empty, 8-byte
big-endian start seq) with each buffered message from that seq as (identity,
empty, topic, seq, payload), then the end marker (identity, empty, b"", -1 as
8 signed big-endian bytes, b""). The buffer keeps the last
``replay_messages`` messages (vLLM's buffer_steps, 10,000) and at most
``replay_bytes``. Unlike vLLM's publisher, which connects a PUB to a tcp
address that names no wildcard, the master always binds both endpoints
(port 0: any free port; the bound address is announced).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Sequence

from kvstore.master.index import DRAM, Change, Holders
from kvstore_client.errors import ConfigError

MEDIUM_CPU, MEDIUM_STORAGE = "CPU", "STORAGE"  # vLLM's MEDIUM_CPU / MEDIUM_STORAGE
STORED, REMOVED, CLEARED = "BlockStored", "BlockRemoved", "AllBlocksCleared"
HASH_FORMATS = ("bytes", "int64")
_INT64_MASK = (1 << 64) - 1

Event = tuple  # (kind, medium or None, list of digests); CLEARED: (CLEARED, None, [])
CLEAR: Event = (CLEARED, None, [])

_TCP = re.compile(r"tcp://(\*|\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9]([A-Za-z0-9.-]*[A-Za-z0-9])?):(\d{1,5})")
_IPC = re.compile(r"ipc://[^\0\s]+")


def check_endpoint(endpoint: str, what: str = "endpoint") -> str:
    """``endpoint`` if it is ``tcp://HOST:PORT`` (HOST: a name, an IPv4 address, ``*``
    or ``[IPv6]``; PORT 0..65535, 0: any free port) or ``ipc://PATH``; else ConfigError."""
    if not isinstance(endpoint, str):
        raise ConfigError(f"{what} must be a string like tcp://127.0.0.1:5557")
    tcp = _TCP.fullmatch(endpoint)
    if tcp and int(tcp.group(3)) <= 65535 or _IPC.fullmatch(endpoint):
        return endpoint
    raise ConfigError(
        f"{what} {endpoint!r} is not tcp://HOST:PORT (e.g. tcp://127.0.0.1:5557, tcp://*:5557, "
        "port 0..65535) or ipc://PATH"
    )


@dataclass(frozen=True)
class KVEventsOptions:
    """Where and how the master publishes KV events (see the module doc)."""

    endpoint: str
    replay_endpoint: str | None = None
    topic: str = ""  # prefix in front of every namespace
    hashes: str = "int64"  # or "bytes"; int64 is vLLM's default form
    flush_interval_s: float = 0.05
    max_block_hashes: int = 4096  # per message; more are split over several
    max_pending: int = 1_000_000  # index changes queued for the publisher; more are dropped (then a resync)
    replay_messages: int = 10_000
    replay_bytes: int = 64 << 20
    hwm: int = 100_000  # ZMQ send high-water mark: a subscriber further behind loses messages
    replay_rate: int = 20_000  # messages replayed a second, all requesters together (a burst: replay_messages)

    def __post_init__(self) -> None:
        check_endpoint(self.endpoint, "--kv-events endpoint")
        if self.replay_endpoint is not None:
            check_endpoint(self.replay_endpoint, "--kv-events-replay endpoint")
            if self.replay_endpoint == self.endpoint and not self.endpoint.endswith(":0"):
                raise ConfigError("the replay endpoint must differ from the events endpoint")
        if not isinstance(self.topic, str) or "\0" in self.topic:
            raise ConfigError("the kv events topic must be a string without NUL")
        if self.hashes not in HASH_FORMATS:
            raise ConfigError(f"kv events hashes must be one of {', '.join(HASH_FORMATS)}, got {self.hashes!r}")
        if not self.flush_interval_s > 0:
            raise ConfigError("flush_interval_s must be positive")
        for name in ("max_block_hashes", "max_pending", "replay_messages", "replay_bytes", "hwm", "replay_rate"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ConfigError(f"{name} must be a positive integer")


def medium_of(holders: Holders) -> str | None:
    """The medium a router sees for a key: CPU while some copy is in DRAM, else STORAGE; None: absent."""
    if not holders:
        return None
    for _node, tier in holders:
        if tier == DRAM:
            return MEDIUM_CPU
    return MEDIUM_STORAGE


def events_for(changes: Sequence[Change]) -> list[Event]:
    """Events for one namespace's net changes of one index call (each digest once).

    Removals come first, then stores, each grouped by medium: digests differ, so
    only a digest's own order matters, and a medium change is Removed(old) then
    Stored(new).
    """
    removed: dict[str, list[bytes]] = {MEDIUM_CPU: [], MEDIUM_STORAGE: []}
    stored: dict[str, list[bytes]] = {MEDIUM_CPU: [], MEDIUM_STORAGE: []}
    for digest, old, new in changes:
        was, now = medium_of(old), medium_of(new)
        if was == now:
            continue
        if was is not None:
            removed[was].append(digest)
        if now is not None:
            stored[now].append(digest)
    return [(REMOVED, m, d) for m, d in removed.items() if d] + [(STORED, m, d) for m, d in stored.items() if d]


def append_events(out: list[Event], events: Sequence[Event]) -> None:
    """Append ``events`` to ``out``, merging into the last event when kind and medium match."""
    for kind, medium, digests in events:
        if out and kind != CLEARED and out[-1][0] == kind and out[-1][1] == medium:
            out[-1][2].extend(digests)
        else:
            out.append((kind, medium, list(digests)))


def split_events(events: Sequence[Event], max_hashes: int) -> list[list[Event]]:
    """``events`` cut into messages of at most ``max_hashes`` block hashes each (order kept)."""
    messages: list[list[Event]] = [[]]
    room = max_hashes
    for kind, medium, digests in events:
        if kind == CLEARED:
            messages[-1].append((kind, medium, []))
            continue
        start = 0
        while start < len(digests):
            if room == 0:
                messages.append([])
                room = max_hashes
            take = digests[start : start + room]
            messages[-1].append((kind, medium, take))
            start += len(take)
            room -= len(take)
    return [m for m in messages if m]


def hash_value(digest: bytes, hashes: str):
    """A digest as a block hash on the wire: the bytes, or vLLM's int form (low 64 bits, big-endian)."""
    if hashes == "int64":
        return int.from_bytes(digest, "big") & _INT64_MASK
    return digest


def open_publisher(options: KVEventsOptions, index, access=None):
    """A started KVEventsPublisher over ``index`` (with an access file, ``access``, subscribers
    must present an admin token); ConfigError if pyzmq or msgspec is missing or an endpoint
    cannot be bound."""
    try:
        from kvstore.master.kv_events_publisher import KVEventsPublisher
    except ImportError as exc:
        raise ConfigError(f"--kv-events needs pyzmq and msgspec: pip install 'kvstore[events]' ({exc})") from None
    return KVEventsPublisher(options, index, access).start()
