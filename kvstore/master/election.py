"""Masters that survive failure: leadership through etcd, and fencing on the lease.

    election = Election(Etcd("127.0.0.1:2379"), "/kvstore", "10.0.0.5:50051", ttl_s=5,
                        on_elected=server.reset_state).start()
    election.is_leader()            # checked by LeaderGate before every RPC runs
    election.stop()                 # resign: the key goes, a standby takes over at once

The campaign: every master holds an etcd lease (``ttl_s`` seconds, refreshed
every third of it) and tries to create ``{prefix}/leader`` on that lease with
its gRPC address as the value (a transaction: create only if the key does not
exist). The one that creates it leads; the others are standbys and poll the
key every ``poll_s`` (default 0.1 s; a watch would save those reads, the
takeover time is bounded by the lease TTL either way). When the leader dies its
lease lapses, etcd deletes the key, and the next standby to poll creates it.

A key no master of this pool wrote is ignored (kvstore_client.leader_record):
one on no lease, or, with an access file, one without the proof that the pool
key (derived from the admin and node tokens) gives a leader's address and
lease. A standby deletes such a key and campaigns; a leader writes its own
back. So a client of etcd that may write the key (a tenant, where etcd's roles
allow it) cannot take the pool over; docs/security.md gives the etcd roles
that keep everyone but the masters from writing it at all.

Fencing: ``is_leader()`` is true only while this master created the key, has
not seen it change since, and its lease's *local* deadline has not passed.
The deadline is taken from the moment each keep-alive (or the grant) was
sent, plus the TTL etcd answered, less a margin (10 %, at least 0.25 s): etcd
starts its own count when the request arrives, so the local deadline falls
before etcd could let the key go and another master take it. A leader paused
(SIGSTOP, a long GC, a VM migration) past its lease finds its deadline passed
when it resumes and refuses every RPC before its election thread even runs;
that thread then learns the lease is gone and campaigns again as a standby.
Because the check is local (a clock read, no etcd round trip per RPC), a
leader that cannot reach etcd stops serving within one TTL too.

State: the index lives in the leader only. ``on_elected`` runs before a new
leader serves its first RPC; the master uses it to forget whatever nodes it
knew from an earlier term, so every node hears ``known=false``, registers
again and resends its inventory (the restart path, kvstore.master.service).
Node ids stay unique cluster-wide: the node-id binding of
kvstore.master.membership applies in the one master that serves, and each node
on an etcd:// master holds its id in etcd (kvstore.node.id_claim), so across a
change of leader too a second process with the same id does not serve.

etcd over TLS: ``EtcdOptions.tls`` (``--etcd-ca``, ``--etcd-cert``,
``--etcd-key``) is what the master's etcd client dials with. The master
checks it once before it campaigns (kvstore.master.server): a handshake that
fails (EtcdTLSError) stops the master at start with the reason, while an
etcd merely unreachable then leaves it standing by, campaigning when etcd
comes back.

Thread-safety: one daemon thread ("master-election") runs the campaign; the
fields the gRPC threads read (``_leading``, ``_deadline``, ``_leader``) are
single assignments, read without a lock.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable

import grpc

from kvstore_client.etcd import DEFAULT_PREFIX, Etcd, EtcdTLS, EtcdUnavailable
from kvstore_client.leader_record import address_of, believable, encode

log = logging.getLogger(__name__)

DEFAULT_LEASE_TTL_S = 5
LEADER_METADATA = "kvstore-leader"  # trailing metadata of a standby's UNAVAILABLE: the leader's address


def leader_key(prefix: str) -> bytes:
    return (prefix.rstrip("/") + "/leader").encode()


@dataclass(frozen=True)
class EtcdOptions:
    """``kvstore master --etcd``: where to campaign, and on what lease."""

    endpoints: str  # HOST:PORT[,HOST:PORT...]
    prefix: str = DEFAULT_PREFIX
    lease_ttl_s: int = DEFAULT_LEASE_TTL_S
    advertise: str | None = None  # the address standbys and clients are told (default: the bound one)
    tls: EtcdTLS | None = None  # --etcd-ca/--etcd-cert/--etcd-key: TLS to etcd's client port (None: plain text)


class Election:
    """One master's campaign for leadership (see the module docstring)."""

    def __init__(
        self,
        etcd: Etcd,
        prefix: str,
        address: str,
        ttl_s: int = DEFAULT_LEASE_TTL_S,
        on_elected: Callable[[], None] | None = None,
        poll_s: float = 0.1,
        clock: Callable[[], float] = time.monotonic,
        pool_key: bytes | None = None,
    ):
        if ttl_s < 1:
            raise ValueError(f"the lease TTL must be at least 1 s, got {ttl_s}")
        self._etcd, self.key, self.address = etcd, leader_key(prefix), address
        self.ttl_s, self._poll_s, self._clock = ttl_s, poll_s, clock
        self._on_elected = on_elected
        self.pool_key = pool_key  # signs this master's leader key, checks others' (None: no access file; set on reload)
        self._lease: int | None = None
        self._deadline = 0.0  # local: the lease is surely live before this
        self._next_keepalive = 0.0
        self._leading = False
        self._leader: str | None = None  # the leader's address as last read from etcd
        self._quiet = False  # etcd unreachable: said once
        self._forged_seen = 0  # mod revision of the last forged leader key logged
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="master-election", daemon=True)
        self.terms = 0  # how many times this master was elected

    def start(self) -> Election:
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop campaigning; a leader resigns (deletes the key, revokes its lease)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        leading, self._leading = self._leading, False
        if self._lease is not None:
            try:
                if leading:
                    self._etcd.delete_if_lease(self.key, self._lease)
                self._etcd.revoke(self._lease)
            except (EtcdUnavailable, grpc.RpcError) as exc:
                log.info("could not resign in etcd (%s): the lease lapses on its own", exc)
        self._etcd.close()

    def is_leader(self) -> bool:
        """Whether this master may serve now: it holds the key and its lease is surely live."""
        return self._leading and self._clock() < self._deadline

    def leader(self) -> str | None:
        """The current leader's address as this master last saw it (None: unknown). Never this
        master's own address unless it leads: one deposed (its lease deadline passed, etcd not
        reachable to say who took over) does not know the leader, and must not name itself."""
        if self.is_leader():
            return self.address
        return self._leader if self._leader != self.address else None

    # -- the election thread ---------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._step()
                if self._quiet:
                    log.info("etcd reachable again")
                self._quiet = False
            except (EtcdUnavailable, grpc.RpcError) as exc:
                if not self._quiet:
                    log.warning(
                        "etcd unreachable (%s): %s",
                        exc,
                        "serving until the lease deadline" if self._leading else "standing by",
                    )
                self._quiet = True
            if self._leading and not self.is_leader():
                self._step_down("its lease deadline passed")
            self._stop.wait(self._poll_s)

    def _step(self) -> None:
        now = self._clock()
        if self._lease is None:
            lease, ttl = self._etcd.grant(self.ttl_s)
            self._lease, self._deadline = lease, now + ttl - self._margin(ttl)
            self._next_keepalive = now + ttl / 3
        elif now >= self._next_keepalive:
            ttl = self._etcd.keep_alive(self._lease)
            if ttl <= 0:
                self._lease = None
                self._step_down("its lease expired")
                return
            self._deadline = now + ttl - self._margin(ttl)
            self._next_keepalive = now + ttl / 3
        if self._leading:
            held = self._etcd.get(self.key)
            if held is None:  # deleted (a standby cleaning a forged key, an operator): take it back if free
                created, held = self._etcd.create(self.key, self._value(), self._lease)
            if held is not None and held.lease == self._lease:
                return
            if held is not None and not believable(held, self.pool_key):
                self._ignore(held, "writing its own back")
                self._etcd.replace_if_revision(self.key, held.mod_revision, self._value(), self._lease)
                return
            self._leader = address_of(held.value) if held is not None else None
            self._step_down("the leader key is no longer its own")
            return
        created, held = self._etcd.create(self.key, self._value(), self._lease)
        if created or (held is not None and held.lease == self._lease):
            if self._on_elected is not None:
                self._on_elected()
            self._leader = self.address
            self.terms += 1
            self._leading = True
            log.info("elected leader (%s, lease %x, TTL %d s)", self.address, self._lease, self.ttl_s)
        elif held is not None and not believable(held, self.pool_key):
            self._ignore(held, "deleting it to campaign")
            self._leader = None
            self._etcd.replace_if_revision(self.key, held.mod_revision, None)
        else:
            self._leader = address_of(held.value) if held is not None else None

    def _value(self) -> bytes:
        return encode(self.address, self._lease or 0, self.pool_key)

    def _ignore(self, held, action: str) -> None:
        """Say (once per forged write) that a leader key no master of this pool wrote is ignored."""
        if held.mod_revision != self._forged_seen:
            self._forged_seen = held.mod_revision
            log.warning(
                "ignoring a leader key that no master of this pool wrote (%s, naming %s): %s",
                "on no lease" if held.lease == 0 else "without this pool's proof",
                address_of(held.value)[:80],
                action,
            )

    def _margin(self, ttl: int) -> float:
        return max(0.25, 0.1 * ttl)

    def _step_down(self, why: str) -> None:
        if self._leading:
            self._leading = False
            log.warning("no longer the leader: %s; standing by", why)


class LeaderGate(grpc.ServerInterceptor):
    """Runs an RPC only while ``election.is_leader()``; else UNAVAILABLE naming the leader.

    The check is made when the call is about to run (after the auth gate, before
    the servicer), so a call queued while the leader was paused is refused too.
    The leader's address, when known, is in the trailing metadata under
    ``kvstore-leader`` and in the details; clients of an ``etcd://`` address
    resolve the leader from etcd anyway (kvstore_client.cluster_address).
    """

    def __init__(self, election: Callable[[], Election | None]):
        self._election = election  # None until the campaign starts (the port opens first)

    def intercept_service(self, continuation, details):
        handler = continuation(details)
        if handler is None or handler.unary_unary is None:
            return handler
        behavior, election_of = handler.unary_unary, self._election

        def leader_only(request, context):
            election = election_of()
            if election is None or not election.is_leader():
                leader = election.leader() if election is not None else None
                if leader:
                    context.set_trailing_metadata(((LEADER_METADATA, leader),))
                context.abort(
                    grpc.StatusCode.UNAVAILABLE, f"this master is a standby; the leader is {leader or 'not known yet'}"
                )
            return behavior(request, context)

        return handler._replace(unary_unary=leader_only)
