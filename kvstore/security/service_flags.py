"""The security flags of `kvstore master`, `node` and `up`, and what they build.

    --auth FILE          the access file (auth is on whenever one is given)
    --insecure           serve a non-loopback address without one (warns)
    --token TOKEN        what this service presents to the others (env KVSTORE_TOKEN);
                         default: the access file's first node (else admin) token held in full
    --tls-cert/--tls-key this service's certificate (gRPC and the TCP data plane)
    --tls-ca             the CA it trusts when it dials the pool (and checks clients with)
    --tls-mutual         require client certificates signed by --tls-ca
    --etcd-ca/--etcd-cert/--etcd-key
                         TLS to etcd's client port, for `master --etcd` and for every command
                         that takes --master etcd://... (env KVSTORE_ETCD_CA/CERT/KEY)

A master or node bound to anything but loopback without an access file would
answer anyone who can reach it: ``ServiceSecurity.check_exposure`` refuses to
start then, unless --insecure says so.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import logging
from dataclasses import dataclass

import click

from kvstore_client.auth import TOKEN_ENV, resolve_token
from kvstore_client.credentials import NO_CREDENTIALS, Credentials
from kvstore_client.errors import ConfigError
from kvstore.security.access import AccessList
from kvstore.security.tls import ServerTLS

log = logging.getLogger(__name__)


def service_security_options(f):
    """The flags above, for the service commands."""
    options = [
        click.option(
            "--auth",
            "auth_file",
            default=None,
            metavar="FILE",
            help="Access file (TOML): tokens, roles, namespaces, quotas. Every RPC and data-plane "
            "connection must then prove a token. See docs/security.md.",
        ),
        click.option(
            "--insecure",
            is_flag=True,
            help="Serve a non-loopback address without --auth (anyone who reaches it may read, write "
            "and remove every block).",
        ),
        click.option(
            "--token",
            envvar=TOKEN_ENV,
            default=None,
            metavar="TOKEN",
            help="The token this service presents to the master and other nodes [env KVSTORE_TOKEN; "
            "default: the access file's first node (else admin) secret].",
        ),
        click.option("--tls-cert", default=None, metavar="PEM", help="This service's TLS certificate."),
        click.option("--tls-key", default=None, metavar="PEM", help="Its private key."),
        click.option(
            "--tls-ca",
            default=None,
            metavar="PEM",
            help="The CA this service trusts when it dials the pool (and, with --tls-mutual, checks "
            "client certificates with).",
        ),
        click.option("--tls-mutual", is_flag=True, help="Require client certificates signed by --tls-ca."),
    ]
    for option in reversed(options):
        f = option(f)
    return f


def etcd_tls_options(f):
    """--etcd-ca, --etcd-cert and --etcd-key: how this command reaches etcd (the masters' --etcd,
    or an etcd:// --master) over TLS; plain text when none is given."""
    from kvstore_client.etcd import ETCD_CA_ENV, ETCD_CERT_ENV, ETCD_KEY_ENV

    options = [
        click.option(
            "--etcd-ca",
            envvar=ETCD_CA_ENV,
            default=None,
            metavar="PEM",
            help=f"CA of etcd's certificate: talk TLS (https) to etcd's client port [env {ETCD_CA_ENV}].",
        ),
        click.option(
            "--etcd-cert",
            envvar=ETCD_CERT_ENV,
            default=None,
            metavar="PEM",
            help="Client certificate for an etcd with --client-cert-auth (signed by its "
            f"--trusted-ca-file) [env {ETCD_CERT_ENV}].",
        ),
        click.option(
            "--etcd-key",
            envvar=ETCD_KEY_ENV,
            default=None,
            metavar="PEM",
            help=f"Its private key [env {ETCD_KEY_ENV}].",
        ),
    ]
    for option in reversed(options):
        f = option(f)
    return f


def etcd_tls_of(etcd_ca=None, etcd_cert=None, etcd_key=None):
    """The EtcdTLS of those flags (None: plain text); ConfigError for a missing file or half a pair."""
    from kvstore_client.etcd import EtcdTLS

    return EtcdTLS.of(etcd_ca, etcd_cert, etcd_key)


def client_security_options(f):
    """--token and --tls-ca (and a client certificate) for the commands that call a pool."""
    options = [
        click.option(
            "--token",
            envvar=TOKEN_ENV,
            default=None,
            metavar="TOKEN",
            help="Token from the pool's access file [env KVSTORE_TOKEN].",
        ),
        click.option(
            "--tls-ca",
            envvar="KVSTORE_TLS_CA",
            default=None,
            metavar="PEM",
            help="CA of a pool that speaks TLS [env KVSTORE_TLS_CA].",
        ),
        click.option("--tls-cert", default=None, metavar="PEM", help="Client certificate (mutual TLS)."),
        click.option("--tls-key", default=None, metavar="PEM", help="Its private key."),
    ]
    for option in reversed(options):
        f = option(f)
    return f


@dataclass(frozen=True)
class ServiceSecurity:
    """What one service process enforces and presents."""

    access: AccessList | None = None
    tls: ServerTLS | None = None
    insecure: bool = False
    dialing: Credentials = NO_CREDENTIALS  # what it presents when it dials another part of the pool

    @classmethod
    def from_flags(
        cls,
        auth_file=None,
        insecure=False,
        token=None,
        tls_cert=None,
        tls_key=None,
        tls_ca=None,
        tls_mutual=False,
        needs_token=False,
        etcd_tls=None,
    ) -> "ServiceSecurity":
        """Build and check; ``needs_token``: this service dials the master (a node), so it
        must have a token when auth is on. ``etcd_tls`` (EtcdTLS): how it reaches the etcd of
        an etcd:// master address."""
        access = AccessList.load(auth_file) if auth_file else None
        tls = ServerTLS.from_flags(tls_cert, tls_key, tls_ca, tls_mutual)
        token = resolve_token(token)
        if token is None and access is not None:
            token = access.service_token()
        if needs_token and access is not None and token is None:
            raise ConfigError(
                f"{auth_file} holds no node or admin secret in full (only hashes): give this node "
                "its token with --token or KVSTORE_TOKEN"
            )
        if token is not None and access is not None:
            principal = access.bearer(token)
            if principal is None:
                raise ConfigError(f"--token (or KVSTORE_TOKEN) is not a token of {auth_file}")
            if principal.confined:
                raise ConfigError(
                    f"--token (or KVSTORE_TOKEN) is {principal.role} {principal.name!r}'s; a service runs with a "
                    "node or admin token"
                )
        if tls is not None:
            dialing = tls.dialing(token)
        else:
            dialing = Credentials(token, tls_ca, None, None) if (token or tls_ca) else NO_CREDENTIALS
        if etcd_tls is not None:
            dialing = dataclasses.replace(dialing, etcd_tls=etcd_tls)
        return cls(access, tls, insecure, dialing)

    def check_exposure(self, host: str, what: str) -> None:
        """Refuse to serve ``host`` beyond loopback with no access file, unless --insecure."""
        if self.access is not None or is_loopback(host):
            return
        if not self.insecure:
            raise ConfigError(
                f"the {what} would listen on {host} with no access file: anyone who reaches it could "
                "read, overwrite and remove every block. Give --auth FILE, or --insecure to do it "
                "anyway"
            )
        log.warning("%s listening on %s with no access file (--insecure): every caller is trusted", what, host)

    def check_unguarded(self, host: str, what: str) -> None:
        """An endpoint that checks no tokens (KV events) may face only loopback while auth is
        on, unless --insecure: it would tell anyone what the access file hides."""
        if self.access is None or is_loopback(host):
            return
        if not self.insecure:
            raise ConfigError(
                f"the {what} checks no tokens and would listen on {host}: bind it to 127.0.0.1, or give --insecure"
            )
        log.warning("%s on %s checks no tokens (--insecure)", what, host)


def is_loopback(host: str) -> bool:
    if host in ("localhost", ""):
        return host == "localhost"
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
