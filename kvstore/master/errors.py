"""Typed errors of the master's domain code.

Bad keys raise :class:`kvstore_client.errors.InvalidKey`; everything else a
caller got wrong (an empty node id, an event of unknown kind, a tier the
index does not know) raises :class:`InvalidRequest`, defined in
:mod:`kvstore.errors` (the conductor raises it too) and re-exported here. The
gRPC edge maps both to INVALID_ARGUMENT (``kvstore.master.service``).
"""

from kvstore.errors import InvalidRequest

__all__ = ["InvalidRequest"]
