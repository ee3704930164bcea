"""Typed errors shared by the SDK and the server.

Every rejected call raises one of these; a rejected call never changes what
is already stored.  Services map each class to one status code at their edge.
"""


class KVStoreError(Exception):
    """Base class of every error kvstore raises on purpose."""

    # Set on the error ``Client.batch_put`` raises (see CapacityError); absent on the others.
    stored: list
    failures: list


class InvalidKey(KVStoreError, ValueError):
    """A key is malformed: wrong type, empty, or longer than allowed."""


class UnknownNamespace(KVStoreError, KeyError):
    """The namespace was not declared on a store that declares namespaces."""

    def __str__(self) -> str:  # KeyError quotes its argument; keep the message plain
        return str(self.args[0]) if self.args else "unknown namespace"


class InvalidValue(KVStoreError, ValueError):
    """A value is empty, too large, or not a contiguous buffer."""


class DeviceUnavailable(InvalidValue):
    """A buffer lies in memory this process cannot copy to or from: a tensor on a device other
    than the CPU and CUDA, on a CUDA device this process does not see, or any device tensor
    where torch has no CUDA. ``device`` names it ("meta", "cuda:3", ...)."""

    def __init__(self, message: str, device: str = ""):
        super().__init__(message)
        self.device = device


class BufferTooSmall(KVStoreError, ValueError):
    """The caller's buffer cannot hold the block; ``needed`` says how many bytes it must have."""

    def __init__(self, message: str, needed: int):
        super().__init__(message)
        self.needed = needed


class ConfigError(KVStoreError, ValueError):
    """A configuration cannot work, e.g. a tier smaller than one block."""


class CapacityError(KVStoreError):
    """No space could be made for a block: everything evictable is pinned or being read.

    Raised by ``Client.batch_put`` (like any error it raises once blocks were sent) it
    carries ``stored``, the keys stored, and ``failures``, (key, node_id, error) for each
    key not stored (PutFailed's shape): retry those."""


class SameHostSpaceFull(CapacityError):
    """A node's space for same-host writers (arena space reserved before the bytes are written)
    is all held by other writers: send the block over the socket instead. The SDK does so
    itself; a caller sees this only from the wire layer."""


class LayoutMismatch(ConfigError):
    """Two KV cache layouts do not store a block's bytes in the same order (or a layout is one
    the vLLM connector cannot move), so blocks of one must not be read into the other."""


class ReservationError(KVStoreError):
    """A two-phase put was used out of order: committed twice, written after revoke, etc."""


class QuotaExceeded(CapacityError):
    """The tenant already holds its quota of bytes across the pool (a CapacityError: the same
    remedy, remove or wait for eviction, applies)."""


class Unauthenticated(KVStoreError):
    """The service wants a valid token and got none or a wrong one (``Client(token=...)`` or
    the KVSTORE_TOKEN environment variable)."""


class PermissionDenied(KVStoreError):
    """The token is valid but does not allow this call: another tenant's namespace, or a
    call reserved to nodes or admins."""


class ChecksumMismatch(KVStoreError):
    """Bytes read back do not match the checksum stored with them."""


class ServiceUnavailable(KVStoreError):
    """The master (or every node that could serve the call) cannot be reached."""


class TransportError(KVStoreError, ConnectionError):
    """The connection to a node failed or died mid-transfer; open a new one."""


class ProtocolError(KVStoreError):
    """A frame broke the data-plane protocol (bad magic, unknown op, inconsistent
    table, unknown lease...). ``status`` is the wire status code; the node closes
    the connection after reporting one, so the connection is unusable afterwards."""

    def __init__(self, message: str, status: int = 7):
        super().__init__(message)
        self.status = status


class RemoteError(KVStoreError):
    """The node failed internally while serving a request (a bug or a broken disk)."""


class Overloaded(KVStoreError):
    """The conductor rejected a request to protect its SLOs (the HTTP 429 of the store).

    ``reason`` says which check failed: ttft_slo, decode_overloaded,
    decode_predicted_overloaded, no_instance or too_many_requests; the SDK takes it from the
    master's structured reply, and the message is for people.
    """

    def __init__(self, message: str, reason: str = ""):
        super().__init__(message)
        self.reason = reason


class PutFailed(KVStoreError):
    """Puts sent without waiting (``wait=False``) that a node did not store. ``failures``
    lists (key, node_id, error) for each; the caller still holds the values, or not."""

    def __init__(self, failures: list):
        key, node_id, error = failures[0]
        super().__init__(
            f"{len(failures)} put(s) sent without waiting were not stored; "
            f"the first, {key!r} on node {node_id}: {error}"
        )
        self.failures = failures


class ClientClosed(KVStoreError):
    """A call on a Client (or AsyncClient) after its ``close()``: open a new one."""
