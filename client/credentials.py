"""What a caller presents to a kvstore pool: a token, and the TLS settings to reach it with.

    Credentials(token="...", tls_ca="ca.pem")           an SDK client
    Credentials(token=..., tls_ca=..., tls_cert=..., tls_key=...)   mutual TLS

One object serves both planes: ``channel(target)`` is the gRPC channel to the
master (TLS when ``tls_ca`` is set; the token as bearer metadata on every
call), ``data_key`` keys the data plane's challenge-response, and
``client_tls()`` is the ssl context for TCP data-plane connections.
``Credentials.resolve(token)`` reads KVSTORE_TOKEN and KVSTORE_TLS_CA when
the caller gives none. ``etcd_tls`` (kvstore_client.etcd.EtcdTLS) is how an
``etcd://`` address reaches etcd itself (its CA and a client certificate);
``resolve`` falls back to KVSTORE_ETCD_CA, KVSTORE_ETCD_CERT and KVSTORE_ETCD_KEY.
"""

from __future__ import annotations

import os
import ssl
from dataclasses import dataclass

import grpc

from kvstore_client.auth import DataKey, bearer_metadata, resolve_token
from kvstore_client.errors import ConfigError
from kvstore_client.etcd import EtcdTLS

TLS_CA_ENV = "KVSTORE_TLS_CA"


@dataclass(frozen=True)
class Credentials:
    """A token (None: none) and TLS files (PEM paths; None: plain TCP). ``data_key`` overrides
    the data-plane key derived from the token (the master holds keys, not tokens, for
    entries the access file stores hashed)."""

    token: str | None = None
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    key: DataKey | None = None
    etcd_tls: EtcdTLS | None = None  # TLS to the etcd of an etcd:// address (None: plain text)

    def __post_init__(self):
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ConfigError("a TLS client certificate needs both tls_cert and tls_key")
        if self.tls_cert is not None and self.tls_ca is None:
            raise ConfigError("a TLS client certificate needs tls_ca (the CA that signed the service's)")
        for path in (self.tls_ca, self.tls_cert, self.tls_key):
            if path is not None and not os.path.isfile(path):
                raise ConfigError(f"TLS file {path} does not exist")

    @classmethod
    def resolve(
        cls,
        token: str | None = None,
        tls_ca: str | None = None,
        tls_cert: str | None = None,
        tls_key: str | None = None,
        etcd_tls: EtcdTLS | None = None,
    ) -> "Credentials":
        """Credentials from arguments, falling back to KVSTORE_TOKEN, KVSTORE_TLS_CA and the
        KVSTORE_ETCD_* variables (EtcdTLS.from_env)."""
        return cls(
            resolve_token(token),
            tls_ca or os.environ.get(TLS_CA_ENV) or None,
            tls_cert,
            tls_key,
            etcd_tls=etcd_tls or EtcdTLS.from_env(),
        )

    @property
    def data_key(self) -> DataKey | None:
        if self.key is not None:
            return self.key
        return None if self.token is None else DataKey.of_token(self.token)

    @property
    def tls(self) -> bool:
        return self.tls_ca is not None

    def metadata(self) -> tuple:
        """gRPC metadata for each call: the bearer token, when there is one."""
        return (bearer_metadata(self.token),) if self.token else ()

    def channel(self, target: str, options: list | None = None) -> grpc.Channel:
        """A channel to ``target`` (the master) that sends the token with every call."""
        if self.tls:
            channel = grpc.secure_channel(target, grpc.ssl_channel_credentials(*self._pem_files()), options=options)
        else:
            channel = grpc.insecure_channel(target, options=options)
        metadata = self.metadata()
        return grpc.intercept_channel(channel, _WithMetadata(metadata)) if metadata else channel

    def client_tls(self) -> ssl.SSLContext | None:
        """The context TCP data-plane connections are wrapped in (None: plain TCP)."""
        if not self.tls:
            return None
        context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=self.tls_ca)
        if self.tls_cert is not None:
            context.load_cert_chain(self.tls_cert, self.tls_key)
        return context

    def _pem_files(self) -> tuple[bytes, bytes | None, bytes | None]:
        def read(path):
            if path is None:
                return None
            with open(path, "rb") as f:
                return f.read()

        return read(self.tls_ca), read(self.tls_key), read(self.tls_cert)


NO_CREDENTIALS = Credentials()


class _WithMetadata(grpc.UnaryUnaryClientInterceptor):
    """Adds fixed metadata (the bearer token) to every unary call of a channel."""

    def __init__(self, metadata: tuple):
        self._metadata = tuple(metadata)

    def intercept_unary_unary(self, continuation, details, request):
        metadata = tuple(details.metadata or ()) + self._metadata
        return continuation(
            _Details(
                details.method,
                details.timeout,
                metadata,
                details.credentials,
                details.wait_for_ready,
                details.compression,
            ),
            request,
        )


class _Details(grpc.ClientCallDetails):
    def __init__(self, method, timeout, metadata, credentials, wait_for_ready, compression):
        self.method, self.timeout, self.metadata = method, timeout, metadata
        self.credentials, self.wait_for_ready, self.compression = credentials, wait_for_ready, compression
