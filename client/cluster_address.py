"""``etcd://HOST:PORT[,HOST:PORT...][/PREFIX]``: a cluster named by its etcd, following its leader.

    channel = master_channel("etcd://10.0.0.1:2379,10.0.0.2:2379", credentials, GRPC_OPTIONS)
    channel = master_channel("10.0.0.5:7700", credentials, GRPC_OPTIONS)   # a plain channel, as before

With several masters (``kvstore master --etcd``) only the leader serves; its
gRPC address is the value of ``{PREFIX}/leader`` in etcd (PREFIX defaults to
/kvstore, as ``--etcd-prefix`` does). ``LeaderChannel`` is a grpc.Channel that
reads that key, dials the address through ``credentials`` (token and TLS as for
any master), and when a call fails with UNAVAILABLE (a standby's refusal, a
refused connection, a dead leader) reads the key again and retries on the new
leader until the call's timeout (default 10 s) runs out. Calls that were
refused by a standby never ran; a call lost with a dying leader is retried,
which the master's RPCs allow (registration, heartbeats and reports are
idempotent; a Place retried reserves its bytes again, released by the
placement's expiry).

etcd itself is reached as ``credentials.etcd_tls`` says (kvstore_client.etcd.EtcdTLS:
its CA, a client certificate), else as KVSTORE_ETCD_CA/CERT/KEY say, else in
plain text. A TLS handshake with etcd that fails is configuration, not an
outage: calls fail at once with UNAVAILABLE and the reason (the SDK raises
ServiceUnavailable with it) instead of waiting out their timeout.

A leader key on no lease is not believed (no master wrote it), and with a
token, the master etcd names must prove it holds that token's key before the
channel sends it anything (``MasterCheck``): someone able to write the key in
etcd can stall a client, but never learn its token.

``future()`` calls are not retried: their failure only marks the leader for a
fresh lookup by the next call.

Thread-safety: the current (address, channel) pair is swapped under ``_lock``;
calls in flight on the old channel finish or fail there (it is closed a moment
later, once no new calls are started on it).
"""

from __future__ import annotations

import dataclasses
import hmac
import logging
import secrets
import threading
import time

import grpc

from kvstore_client.etcd import DEFAULT_PREFIX, Etcd, EtcdTLS, EtcdTLSError, EtcdUnavailable, parse_endpoints
from kvstore_client.leader_record import NONCE_BYTES, address_of, believable, master_proof
from kvstore_client.proto import kvstore_pb2 as pb

log = logging.getLogger(__name__)

SCHEME = "etcd://"
_RETRY_PAUSE_S = 0.05


def is_etcd_address(address: str) -> bool:
    return address.startswith(SCHEME)


def parse_etcd_address(address: str) -> tuple[list[str], str]:
    """ "etcd://h1:2379,h2:2379/kv" -> (["h1:2379", "h2:2379"], "/kv"); ValueError if malformed."""
    if not is_etcd_address(address):
        raise ValueError(f"not an etcd:// address: {address!r}")
    rest = address[len(SCHEME) :]
    hosts, slash, prefix = rest.partition("/")
    return parse_endpoints(hosts), ("/" + prefix.strip("/")) if slash and prefix.strip("/") else DEFAULT_PREFIX


def master_channel(address: str, credentials, options: list | None = None) -> grpc.Channel:
    """A channel to the master at ``address``: host:port, or an etcd:// cluster (a LeaderChannel)."""
    if is_etcd_address(address):
        endpoints, prefix = parse_etcd_address(address)
        tls = getattr(credentials, "etcd_tls", None) or EtcdTLS.from_env()
        key = getattr(credentials, "data_key", None)
        check = None if key is None else MasterCheck(key, credentials, options)
        return LeaderChannel(
            Etcd(endpoints, tls=tls), prefix, lambda target: credentials.channel(target, options), check=check
        )
    return credentials.channel(address, options)


class MasterCheck:
    """Before a token goes to the master etcd names, that master proves it holds the token's
    key (``Master/Prove``, bound to the address dialled): a master put there by someone who
    could write to etcd gets no credential. Called with the address; NoLeader when it fails."""

    def __init__(self, key, credentials, options: list | None = None, timeout: float = 5.0):
        self._key, self._timeout = key, timeout
        self._warned: set[str] = set()  # addresses already logged as refused (once each: etcd writers can flood)
        self._anonymous = lambda target: dataclasses.replace(credentials, token=None, key=None).channel(target, options)

    def __call__(self, address: str) -> None:
        nonce = secrets.token_bytes(NONCE_BYTES)
        with self._anonymous(address) as channel:
            prove = channel.unary_unary(
                "/kvstore.v1.Master/Prove",
                request_serializer=pb.ProveRequest.SerializeToString,
                response_deserializer=pb.ProveReply.FromString,
            )
            try:
                reply = prove(pb.ProveRequest(key_id=self._key.key_id, nonce=nonce), timeout=self._timeout)
            except grpc.RpcError as exc:
                if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    raise NoLeader(f"the master at {address} is not serving: {exc.details()}") from None
                raise self._refused(address, f"{exc.code().name}: {exc.details()}") from None
        if not hmac.compare_digest(reply.proof, master_proof(self._key.key, nonce, address)):
            raise self._refused(address, "a wrong proof" if reply.proof else "no proof (it checks no tokens)")

    def _refused(self, address: str, why: str) -> NoLeader:
        if address not in self._warned and len(self._warned) < 1024:  # once each: etcd writers could flood the log
            self._warned.add(address)
            log.warning(
                "the master etcd names, %s, did not prove it holds this token's key (%s): not using it", address, why
            )
        return NoLeader(f"the master at {address} named by etcd could not prove it belongs to this pool ({why})")


class NoLeader(Exception):
    """etcd names no leader (none elected yet, or etcd unreachable)."""


class EtcdMisconfigured(NoLeader):
    """etcd cannot be reached as configured (a TLS handshake failed): not worth retrying."""


class LeaderChannel(grpc.Channel):
    """A channel to whichever master leads (see the module docstring)."""

    def __init__(self, etcd: Etcd, prefix: str, dial, default_timeout: float = 10.0, check=None):
        self._etcd, self._key, self._dial = etcd, (prefix.rstrip("/") + "/leader").encode(), dial
        self._check = check  # verifies a new leader before it is dialled with credentials (MasterCheck)
        self._default_timeout = default_timeout
        self._lock = threading.Lock()
        self._address: str | None = None
        self._channel: grpc.Channel | None = None
        self._generation = 0  # bumped on every swap: a stale failure does not re-resolve twice
        self._stale = True
        self._closed = False

    @property
    def leader(self) -> str | None:
        return self._address

    def current(self, resolve: bool = True) -> tuple[grpc.Channel, int]:
        """The channel to the leader (looked up again when marked stale, unless not ``resolve``
        and there is one) and its generation; NoLeader when etcd names none."""
        with self._lock:
            if self._closed:
                raise ValueError("Cannot invoke RPC on closed channel!")
            if (not self._stale or not resolve) and self._channel is not None:
                return self._channel, self._generation
        try:
            held = self._etcd.get(self._key)
        except EtcdTLSError as exc:
            raise EtcdMisconfigured(str(exc)) from None
        except (EtcdUnavailable, grpc.RpcError) as exc:
            raise NoLeader(f"etcd {','.join(self._etcd.endpoints)} unreachable: {exc}") from None
        if held is None:
            raise NoLeader(f"no leader in etcd under {self._key.decode()}")
        if not believable(held, None):
            raise NoLeader(f"the leader key {self._key.decode()} is on no lease: no master wrote it")
        address = address_of(held.value)
        if self._check is not None and address != self._address:
            self._check(address)
        old = None
        with self._lock:
            if address != self._address or self._channel is None:
                old, self._channel, self._address = self._channel, self._dial(address), address
                self._generation += 1
                log.info("master leader: %s", address)
            self._stale = False
            channel, generation = self._channel, self._generation
        if old is not None:
            threading.Timer(1.0, old.close).start()  # let calls in flight on it finish
        return channel, generation

    def mark_stale(self, generation: int) -> None:
        with self._lock:
            if generation == self._generation:
                self._stale = True

    # -- grpc.Channel ----------------------------------------------------------------------------
    def unary_unary(self, method, request_serializer=None, response_deserializer=None, **kwargs):
        return _FollowingCall(self, method, request_serializer, response_deserializer, kwargs)

    def unary_stream(self, method, request_serializer=None, response_deserializer=None, **kwargs):
        channel, _ = self.current()
        return channel.unary_stream(method, request_serializer, response_deserializer, **kwargs)

    def stream_unary(self, method, request_serializer=None, response_deserializer=None, **kwargs):
        channel, _ = self.current()
        return channel.stream_unary(method, request_serializer, response_deserializer, **kwargs)

    def stream_stream(self, method, request_serializer=None, response_deserializer=None, **kwargs):
        channel, _ = self.current()
        return channel.stream_stream(method, request_serializer, response_deserializer, **kwargs)

    def subscribe(self, callback, try_to_connect=False):
        pass

    def unsubscribe(self, callback):
        pass

    def close(self):
        with self._lock:
            self._closed = True
            channel, self._channel = self._channel, None
        if channel is not None:
            channel.close()
        self._etcd.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


class _Unavailable(grpc.RpcError, grpc.Call):
    """What a call raises when no leader could be found before its timeout."""

    def __init__(self, details: str):
        self._details = details

    def code(self):
        return grpc.StatusCode.UNAVAILABLE

    def details(self):
        return self._details

    def initial_metadata(self):
        return ()

    def trailing_metadata(self):
        return ()

    def is_active(self):
        return False

    def time_remaining(self):
        return None

    def cancel(self):
        return False

    def add_callback(self, callback):
        return False

    def __str__(self):
        return f"UNAVAILABLE: {self._details}"


class _Failed(grpc.Future):
    """A future that failed before it started."""

    def __init__(self, error: grpc.RpcError):
        self._error = error

    def cancel(self):
        return False

    def cancelled(self):
        return False

    def running(self):
        return False

    def done(self):
        return True

    def result(self, timeout=None):
        raise self._error

    def exception(self, timeout=None):
        return self._error

    def traceback(self, timeout=None):
        return None

    def add_done_callback(self, fn):
        fn(self)

    def code(self):
        return self._error.code()


class _FollowingCall:
    """A unary-unary multicallable that follows the leader (retries UNAVAILABLE on the new one)."""

    def __init__(self, owner: LeaderChannel, method, serializer, deserializer, kwargs):
        self._owner, self._method, self._args = owner, method, (serializer, deserializer)
        self._kwargs = kwargs
        self._calls: dict[int, object] = {}  # generation -> multicallable on that channel

    def _callable(self, resolve: bool = True):
        channel, generation = self._owner.current(resolve)
        call = self._calls.get(generation)
        if call is None:
            call = channel.unary_unary(self._method, *self._args, **self._kwargs)
            self._calls = {generation: call}
        return call, generation

    def __call__(self, request, timeout=None, **kwargs):
        deadline = time.monotonic() + (timeout if timeout is not None else self._owner._default_timeout)
        while True:
            remaining = deadline - time.monotonic()
            try:
                call, generation = self._callable()
            except NoLeader as exc:
                if isinstance(exc, EtcdMisconfigured) or remaining <= _RETRY_PAUSE_S:
                    raise _Unavailable(str(exc)) from None
                time.sleep(_RETRY_PAUSE_S)
                continue
            try:
                return call(request, timeout=max(remaining, 0.001), **kwargs)
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.UNAVAILABLE:
                    raise
                self._owner.mark_stale(generation)
                if deadline - time.monotonic() <= _RETRY_PAUSE_S:
                    raise
                time.sleep(_RETRY_PAUSE_S)

    def with_call(self, request, timeout=None, **kwargs):
        call, _ = self._callable()
        return call.with_call(request, timeout=timeout, **kwargs)

    def future(self, request, timeout=None, **kwargs):
        """Never blocks on etcd (it may be called under a lock; the last known leader is used)
        and never raises: a failed future when no leader was ever found."""
        try:
            call, generation = self._callable(resolve=False)
        except NoLeader as exc:
            return _Failed(_Unavailable(str(exc)))
        future = call.future(request, timeout=timeout, **kwargs)

        def on_done(f):
            if f.code() == grpc.StatusCode.UNAVAILABLE:
                self._owner.mark_stale(generation)

        future.add_done_callback(on_done)
        return future
