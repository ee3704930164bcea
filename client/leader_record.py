"""The leader key's value in etcd, and which values to believe.

    value = address                       (a pool without an access file)
    value = address + " " + proof (hex)   (with one: HMAC-SHA256 under the pool key)

A leader writes its key on its own etcd lease, so the key goes when the leader
does. Anyone with write access to etcd could write the key too; two checks keep
such a key from taking a pool over:

- a key on no lease (lease 0) is never believed, by masters or clients;
- with an access file, masters (and nodes) hold the pool key, derived from the
  file's admin and node tokens (``pool_key``), and believe a key only with a
  proof that binds its address to the lease it is on. A key that fails is
  forged: a standby deletes it and campaigns, a leader writes its own back.

Clients hold no pool key; before they send a token to the master etcd names,
the master proves it holds the client's own token (``Master/Prove``,
``master_proof``), bound to the address the client dialled.
"""

from __future__ import annotations

import hashlib
import hmac

_RECORD = b"kvstore leader v1\0"
_MASTER = b"kvstore master v1\0"
NONCE_BYTES = 32


def pool_key(keys) -> bytes:
    """The pool key from the data-plane keys (``DataKey.key``) of the access file's admin and
    node tokens: every master and node of a pool derives the same one; tenants cannot."""
    return hashlib.sha256(b"kvstore pool key\0" + b"".join(sorted(keys))).digest()


def encode(address: str, lease: int, key: bytes | None) -> bytes:
    """The value a leader on ``lease`` writes (with a proof when there is a pool key)."""
    if key is None:
        return address.encode()
    return address.encode() + b" " + _record_proof(key, address, lease).hex().encode()


def address_of(value: bytes) -> str:
    return value.split(b" ", 1)[0].decode(errors="replace")


def believable(kv, key: bytes | None) -> bool:
    """Whether a leader key as read from etcd (a KeyValue) may be a real leader's: on a lease,
    and, with a pool key, proved for its address and that lease."""
    if kv is None or kv.lease == 0:
        return False
    if key is None:
        return True
    address, _, proof = kv.value.partition(b" ")
    try:
        given = bytes.fromhex(proof.decode())
    except (UnicodeDecodeError, ValueError):
        return False
    return hmac.compare_digest(given, _record_proof(key, address.decode(errors="replace"), kv.lease))


def master_proof(data_key: bytes, nonce: bytes, address: str) -> bytes:
    """What a master that holds a token's data-plane key answers to ``Prove(nonce)`` when it
    serves at ``address``: the client checks it before sending that token."""
    return hmac.new(data_key, _MASTER + nonce + address.encode(), hashlib.sha256).digest()


def _record_proof(key: bytes, address: str, lease: int) -> bytes:
    return hmac.new(
        key, _RECORD + address.encode() + b"\0" + lease.to_bytes(8, "little", signed=True), "sha256"
    ).digest()
