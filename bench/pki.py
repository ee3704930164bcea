"""A throwaway certificate authority for benchmarks and tests of TLS (needs ``cryptography``).

``make_ca(directory)`` writes a self-signed CA; ``issue(directory, ca, stem, server)`` a
certificate it signs: for a server (SAN IP 127.0.0.1 and DNS localhost, usable to dial out
too, as mutual TLS has services do) or a client only. Keys are EC P-256, written 0600;
certificates last a day. Nothing here is fit for a real deployment.
"""

from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

CA_KEY_USAGE = x509.KeyUsage(
    digital_signature=True,
    key_cert_sign=True,
    crl_sign=True,
    content_commitment=False,
    key_encipherment=False,
    data_encipherment=False,
    key_agreement=False,
    encipher_only=False,
    decipher_only=False,
)


def _name(common: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])


def _valid(builder: x509.CertificateBuilder) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.timezone.utc)
    return builder.not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(
        now + datetime.timedelta(days=1)
    )


def _write_key(key, path: Path) -> None:
    path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    path.chmod(0o600)


def make_ca(directory, name: str = "kvstore test CA"):
    """A self-signed CA: (certificate, key, path of its PEM) in ``directory``."""
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        _valid(x509.CertificateBuilder())
        .subject_name(_name(name))
        .issuer_name(_name(name))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(CA_KEY_USAGE, critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    path = Path(directory) / f"{name.replace(' ', '-')}.pem"
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return cert, key, path


def issue(directory, ca, stem: str, server: bool) -> tuple[str, str]:
    """A certificate ``ca`` signs, for a server or a client: the paths of (stem.pem, stem.key)."""
    ca_cert, ca_key, _ = ca
    key = ec.generate_private_key(ec.SECP256R1())
    usage = (
        [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
        if server
        else [ExtendedKeyUsageOID.CLIENT_AUTH]
    )
    builder = (
        _valid(x509.CertificateBuilder())
        .subject_name(_name(stem))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage(usage), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
    )
    if server:
        builder = builder.add_extension(
            x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
    cert = builder.sign(ca_key, hashes.SHA256())
    cert_path, key_path = Path(directory) / f"{stem}.pem", Path(directory) / f"{stem}.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    _write_key(key, key_path)
    return str(cert_path), str(key_path)
