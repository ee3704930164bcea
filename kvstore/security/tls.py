"""TLS for a service: its certificate for gRPC and the TCP data plane (``--tls-cert/--tls-key``),
the CA it trusts (``--tls-ca``), and, with ``mutual``, client certificates required.

A service that dials others (a node its master and other nodes, the master
its nodes) verifies them against the same CA and, under mutual TLS, shows
its own certificate. The Unix socket stays plain: it never leaves the host.
"""

from __future__ import annotations

import os
import ssl
from dataclasses import dataclass

import grpc

from kvstore_client.credentials import Credentials
from kvstore_client.errors import ConfigError


@dataclass(frozen=True)
class ServerTLS:
    cert: str
    key: str
    ca: str | None = None
    mutual: bool = False

    def __post_init__(self):
        for path in (self.cert, self.key, self.ca):
            if path is not None and not os.path.isfile(path):
                raise ConfigError(f"TLS file {path} does not exist")
        if self.mutual and self.ca is None:
            raise ConfigError("mutual TLS needs --tls-ca: the CA client certificates must be signed by")
        try:
            self.server_context()
        except (ssl.SSLError, OSError) as exc:
            raise ConfigError(f"cannot load TLS certificate {self.cert} with key {self.key}: {exc}") from None

    @classmethod
    def from_flags(cls, cert: str | None, key: str | None, ca: str | None, mutual: bool = False) -> "ServerTLS | None":
        """None when no TLS flag is given; ConfigError when only some are."""
        if cert is None and key is None:
            if mutual:
                raise ConfigError("--tls-mutual needs --tls-cert and --tls-key")
            return None
        if cert is None or key is None:
            raise ConfigError("TLS needs both --tls-cert and --tls-key")
        return cls(cert, key, ca, mutual)

    def grpc_credentials(self) -> grpc.ServerCredentials:
        root = _read(self.ca) if self.mutual else None
        return grpc.ssl_server_credentials(
            [(_read(self.key), _read(self.cert))], root_certificates=root, require_client_auth=self.mutual
        )

    def server_context(self) -> ssl.SSLContext:
        """The TCP data plane's context."""
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        context.load_cert_chain(self.cert, self.key)
        if self.mutual:
            context.load_verify_locations(self.ca)
            context.verify_mode = ssl.CERT_REQUIRED
        return context

    def dialing(self, token: str | None, key=None) -> Credentials:
        """What this service presents when it dials another part of the pool."""
        cert, private = (self.cert, self.key) if self.mutual else (None, None)
        return Credentials(token, self.ca or None, cert, private, key=key)


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()
