"""Tenant quotas: a node's half (bytes held here per quota'd tenant, and the allowance
the master gave each).

The store reports every change of bytes per namespace (``BlockStore.track_usage``);
this adds it to each quota'd tenant whose namespaces match. Before a write's
bytes land the store charges them to those tenants (``charge``), and they stay
charged until they are published (and held) or given back (``settle``): a
write is refused (QUOTA_EXCEEDED) when held plus charged bytes would take a
tenant past its allowance here, however many frames, connections or
replications are in flight. Whoever writes (the tenant, an admin, a node
pulling a replica) the bytes count against the namespace's tenants. Allowances come from the master with each heartbeat
(kvstore.master.quotas); until the first, or with no master, a tenant may hold
its whole quota on this node. Thread-safe: ``changed`` runs under the store
lock, the rest take this object's own lock.
"""

from __future__ import annotations

import threading

from kvstore.security.access import AccessList

_MAX_NAMESPACES = 65536  # namespace -> tenants verdicts remembered


class TenantUsage:
    def __init__(self, access: AccessList):
        self._lock = threading.Lock()
        self._tenants: list = []
        self._held: dict[str, int] = {}
        self._charged: dict[str, int] = {}  # bytes on their way in, not yet held
        self._allowance: dict[str, int] = {}
        self._owners: dict[str, tuple[str, ...]] = {}
        self.retarget(access)

    def retarget(self, access: AccessList) -> None:
        """Follow the quota'd tenants of ``access`` (a reloaded file): every tenant's held bytes
        start again from 0, to be summed anew (``BlockStore.track_usage`` does both under its
        lock); writes in flight stay charged to the tenants that remain."""
        tenants = [p for p in access.principals() if p.confined and p.quota is not None]
        with self._lock:
            allowance = {p.name: self._allowance.get(p.name, p.quota) for p in tenants}
            for p in tenants:
                previous = next((t for t in self._tenants if t.name == p.name), None)
                if previous is not None and previous.quota != p.quota:
                    allowance[p.name] = p.quota  # until the master shares the new quota out
            self._tenants, self._allowance = tenants, allowance
            self._held = {p.name: 0 for p in tenants}
            self._charged = {p.name: self._charged.get(p.name, 0) for p in tenants}
            self._owners = {}

    def __bool__(self) -> bool:
        return bool(self._tenants)

    def _owners_of(self, namespace: str) -> tuple[str, ...]:
        owners = self._owners.get(namespace)
        if owners is None:
            if len(self._owners) >= _MAX_NAMESPACES:
                self._owners.clear()
            owners = self._owners[namespace] = tuple(p.name for p in self._tenants if p.may_use(namespace))
        return owners

    def changed(self, namespace: str, delta: int) -> None:
        owners = self._owners_of(namespace)
        if owners:
            with self._lock:
                for name in owners:
                    self._held[name] += delta

    def charge(self, namespace: str, size: int) -> bool:
        """Count ``size`` bytes about to land in ``namespace`` against its tenants' allowances
        here; False (nothing counted) when one would go past its allowance."""
        owners = self._owners_of(namespace)
        if not owners:
            return True
        with self._lock:
            for name in owners:
                if self._held[name] + self._charged[name] + size > self._allowance[name]:
                    return False
            for name in owners:
                self._charged[name] += size
        return True

    def settle(self, namespace: str, size: int) -> None:
        """Charged bytes were published (now counted as held) or given back."""
        owners = self._owners_of(namespace)
        if owners:
            with self._lock:
                for name in owners:  # at least 0: a tenant added by a reload was not charged before it
                    self._charged[name] = max(0, self._charged[name] - size)

    def charged(self) -> dict[str, int]:
        """Bytes charged per tenant and not yet settled (writes in flight)."""
        with self._lock:
            return dict(self._charged)

    def held(self) -> dict[str, int]:
        with self._lock:
            return dict(self._held)

    def allow(self, allowances: dict[str, int]) -> None:
        """The master's allowances (tenants it does not name keep theirs)."""
        with self._lock:
            for name, limit in allowances.items():
                if name in self._allowance:
                    self._allowance[name] = int(limit)

    def allowance(self, tenant: str) -> int | None:
        """What ``tenant`` may hold here now (None: it has no quota)."""
        with self._lock:
            return self._allowance.get(tenant)
