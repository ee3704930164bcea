"""Tenant quotas: a node's half (bytes held here per quota'd tenant, and the allowance
the master gave each).

The store reports every change of bytes per namespace (``BlockStore.track_usage``);
this adds it to each quota'd tenant whose namespaces match. A write for a
tenant is refused (QUOTA_EXCEEDED) when it would take the tenant past its
allowance here. Allowances come from the master with each heartbeat
(kvstore.master.quotas); until the first, or with no master, a tenant may hold
its whole quota on this node. Thread-safe: ``changed`` runs under the store
lock, the rest take this object's own lock.
"""

from __future__ import annotations

import threading

from kvstore.security.access import AccessList, Principal

_MAX_NAMESPACES = 65536  # namespace -> tenants verdicts remembered


class TenantUsage:
    def __init__(self, access: AccessList):
        self._tenants = [p for p in access.principals() if p.confined and p.quota is not None]
        self._held = {p.name: 0 for p in self._tenants}
        self._allowance = {p.name: p.quota for p in self._tenants}
        self._owners: dict[str, tuple[str, ...]] = {}
        self._lock = threading.Lock()

    def __bool__(self) -> bool:
        return bool(self._tenants)

    def changed(self, namespace: str, delta: int) -> None:
        owners = self._owners.get(namespace)
        if owners is None:
            if len(self._owners) >= _MAX_NAMESPACES:
                self._owners.clear()
            owners = self._owners[namespace] = tuple(p.name for p in self._tenants if p.may_use(namespace))
        if owners:
            with self._lock:
                for name in owners:
                    self._held[name] += delta

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

    def admits(self, principal: Principal, size: int) -> bool:
        """Whether ``principal`` may write ``size`` more bytes here."""
        limit = self._allowance.get(principal.name)
        if limit is None:
            return True
        with self._lock:
            return self._held[principal.name] + size <= limit
