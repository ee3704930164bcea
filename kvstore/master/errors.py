"""Typed errors of the master's domain code.

Bad keys raise :class:`kvstore_client.errors.InvalidKey`; everything else a
caller got wrong (an empty node id, an event of unknown kind, a tier the
index does not know) raises :class:`InvalidRequest`. The gRPC edge maps both
to INVALID_ARGUMENT (``kvstore.master.service``).
"""

from kvstore_client.errors import KVStoreError


class InvalidRequest(KVStoreError, ValueError):
    """A request to the master is malformed (not a key problem: see InvalidKey)."""
