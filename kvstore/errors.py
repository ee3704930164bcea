"""Typed errors of kvstore's domain code that more than one part raises.

Bad keys raise :class:`kvstore_client.errors.InvalidKey`; everything else a
caller got wrong (an empty node id, an event of unknown kind, a tier the
index does not know, a negative input length given to the conductor) raises
:class:`InvalidRequest`. It lives here, below both the master and the
conductor (``kvstore.scheduler``), so that neither imports the other for it;
``kvstore.master.errors`` re-exports it. The gRPC edge maps it to
INVALID_ARGUMENT (``kvstore.master.service``).
"""

from kvstore_client.errors import KVStoreError


class InvalidRequest(KVStoreError, ValueError):
    """A request to the master is malformed (not a key problem: see InvalidKey)."""
