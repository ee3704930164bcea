"""The writable half of a two-phase put."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from kvstore_client.errors import InvalidValue, ReservationError

if TYPE_CHECKING:
    from kvstore.tiers.dram import Extent


class ReservationOwner:
    """What a Reservation calls back into, named: the store that made it hands one of these
    to each of its reservations (one per store), so a reservation reaches no attribute of
    the store. Each field is a callable, bound once when the store is built:

    - ``writable(extent)``: a writable view of the reserved bytes;
    - ``abort(extent)``: give an uncommitted extent back to the DRAM tier;
    - ``check_key(key)``: the key checked (``BlockStore.check_key``);
    - ``publish(key, extent, depth, checksum, trusted)``: commit the written extent
      (``trusted``: take ``checksum`` without reading the bytes back);
    - ``grant_ended(size)``: a grant was bound to a key or given back;
    - ``charge(namespace, size)``: count ``size`` bytes against the quotas of ``namespace``'s
      tenants before they land (QuotaExceeded when one would go past what it may hold here);
    - ``settle(namespace, size)``: the charged bytes were published (and are now held) or
      given back.
    """

    __slots__ = ("writable", "abort", "check_key", "publish", "grant_ended", "charge", "settle")

    def __init__(
        self,
        *,
        writable: Callable,
        abort: Callable,
        check_key: Callable,
        publish: Callable,
        grant_ended: Callable,
        charge: Callable,
        settle: Callable,
    ):
        self.writable, self.abort, self.check_key = writable, abort, check_key
        self.publish, self.grant_ended = publish, grant_ended
        self.charge, self.settle = charge, settle


class Reservation:
    """Space reserved in the DRAM arena for one block, not yet visible to readers.

    Write the value into ``buffer`` (a writable memoryview of exactly the
    reserved size), then ``commit()`` to publish it or ``revoke()`` to free the
    space. A granted reservation has no key until ``bind``. As a context
    manager it commits on success and revokes on error; a reservation dropped
    without either is revoked when collected. Its bytes count against the quotas
    of its namespace's tenants from the moment its namespace is known (``charge``:
    at reserve, or before the first byte of a same-host write, else at ``bind``)
    until it is published (then they are held) or revoked.
    Not meant to be shared between threads.
    """

    __slots__ = ("key", "size", "depth", "buffer", "_owner", "_extent", "_granted", "_charged", "__weakref__")

    def __init__(
        self,
        owner: ReservationOwner,
        key,
        extent: "Extent",
        depth: int,
        granted: bool = False,
        charged: str | None = None,
    ):
        self.key = key
        self.size = extent.size
        self.depth = depth
        self._owner = owner
        self._extent: "Extent | None" = extent
        self._granted = granted  # counted in the store's grant budget until bound or revoked
        self._charged = charged  # the namespace whose tenants' quotas count these bytes (None: not yet)
        self.buffer = owner.writable(extent)

    @property
    def open(self) -> bool:
        return self._extent is not None

    @property
    def offset(self) -> int:
        """Where the reserved bytes start in the DRAM arena (for same-host writers)."""
        if self._extent is None:
            raise ReservationError("reservation is closed")
        return self._extent.offset

    def charge(self, namespace: str) -> None:
        """Count the reserved bytes against the quotas of ``namespace``'s tenants now, before any
        byte lands (QuotaExceeded when that would take one past what it may hold here)."""
        if self._extent is None:
            raise ReservationError("reservation is closed")
        if self._charged == namespace:
            return
        self._owner.charge(namespace, self.size)
        self._settle()
        self._charged = namespace

    def bind(self, key, depth: int = 0) -> None:
        """Name the block a keyless reservation (``BlockStore.grant``) will hold; charged to its
        namespace's quotas now unless ``charge`` named it before (QuotaExceeded, unbound)."""
        if self._extent is None:
            raise ReservationError("reservation is closed")
        if depth < 0:
            raise InvalidValue("depth cannot be negative")
        key = self._owner.check_key(key)
        self.charge(key[0])
        self.key, self.depth = key, depth
        self._end_grant()

    def commit(self, expected_checksum: int | None = None) -> None:
        """Publish the written bytes under the key (checksummed now).

        With ``expected_checksum`` (the writer's XXH3-64 of what it sent), bytes
        that arrived damaged are revoked instead and ChecksumMismatch raised.
        """
        self._publish(expected_checksum, trusted=False)

    def commit_written(self, checksum: int) -> None:
        """Publish bytes a same-host writer copied in itself, under the XXH3-64 it computed over
        its own source, without reading them back: reading a megabyte another core just wrote
        costs more than the rest of the put, and every reader verifies the checksum anyway (a
        writer whose buffer changed under the copy leaves a block that no reader accepts)."""
        self._publish(checksum, trusted=True)

    def _publish(self, checksum: int | None, trusted: bool) -> None:
        if self.key is None:
            raise ReservationError("a granted reservation must be bound to a key before it is committed")
        extent = self._take()
        self.buffer.release()
        try:
            self._owner.publish(self.key, extent, self.depth, checksum, trusted)
        finally:
            self._settle()  # published: held (counted as such) now; or failed and given back

    def revoke(self) -> None:
        """Give the space back; nothing becomes visible."""
        extent = self._take()
        self.buffer.release()
        self._end_grant()
        self._settle()
        self._owner.abort(extent)

    def _end_grant(self) -> None:
        if self._granted:
            self._granted = False
            self._owner.grant_ended(self.size)

    def _settle(self) -> None:
        if self._charged is not None:
            namespace, self._charged = self._charged, None
            self._owner.settle(namespace, self.size)

    def _take(self) -> "Extent":
        extent, self._extent = self._extent, None
        if extent is None:
            raise ReservationError(f"reservation for {self.key!r:.60} was already committed or revoked")
        return extent

    def __enter__(self) -> "Reservation":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if self._extent is None:
            return
        if exc_type is None:
            self.commit()
        else:
            self.revoke()

    def __del__(self) -> None:
        if getattr(self, "_extent", None) is not None:
            try:
                self.revoke()
            except Exception:  # interpreter shutdown or a closed store: nothing to give back to
                pass
