"""Tenant quotas across the pool: the master's half (bytes held, summed over nodes, and
each node's allowance).

Nodes report, with every heartbeat, the bytes they hold per quota'd tenant;
the master answers each with an allowance per tenant: what that node may hold
for it until its next heartbeat, its current use plus an equal share of the
quota's headroom (quota minus the pool-wide use):

    allowance(node) = held(node) + max(0, quota - sum of held) / live nodes

The allowances in force at one moment add up to the quota, but they are
computed from reports up to one heartbeat old. So a burst can overshoot by at
most the headroom the other nodes were last given: under (N-1)/N of the
headroom at the last heartbeat, within one heartbeat interval, plus what is
being written at that instant. Place refuses a tenant that already holds its
quota (QuotaExceeded), before any byte moves. Pure Python; thread-safe.
"""

from __future__ import annotations

import threading

from kvstore_client.errors import QuotaExceeded
from kvstore.security.access import AccessList, Principal


class Quotas:
    """Pool-wide use and per-node allowances of the quota'd tenants of one access file."""

    def __init__(self, access: AccessList):
        self._quota = {p.name: p.quota for p in access.principals() if p.quota is not None}
        self._held: dict[str, dict[str, int]] = {}  # node id -> tenant -> bytes
        self._lock = threading.Lock()

    def retarget(self, access: AccessList) -> None:
        """Follow the quotas of a reloaded access file (nodes report the new tenants' bytes with
        their next heartbeats)."""
        quota = {p.name: p.quota for p in access.principals() if p.quota is not None}
        with self._lock:
            self._quota = quota

    def __bool__(self) -> bool:
        return bool(self._quota)

    def report(self, node_id: str, held: dict[str, int]) -> None:
        """A node's latest figures (tenants without a quota are ignored)."""
        figures = {t: int(b) for t, b in held.items() if t in self._quota}
        with self._lock:
            self._held[node_id] = figures

    def forget(self, node_id: str) -> None:
        """A node left or expired: its blocks left the pool with it."""
        with self._lock:
            self._held.pop(node_id, None)

    def used(self, tenant: str) -> int:
        with self._lock:
            return sum(h.get(tenant, 0) for h in self._held.values())

    def allowances(self, node_id: str, live_nodes: int) -> dict[str, int]:
        """What ``node_id`` may hold for each quota'd tenant until its next heartbeat."""
        share = max(1, live_nodes)
        with self._lock:
            mine = self._held.get(node_id, {})
            out = {}
            for tenant, quota in self._quota.items():
                headroom = max(0, quota - sum(h.get(tenant, 0) for h in self._held.values()))
                out[tenant] = mine.get(tenant, 0) + headroom // share
            return out

    def check_place(self, principal: Principal) -> None:
        """QuotaExceeded when ``principal`` already holds its whole quota across the pool."""
        quota = self._quota.get(principal.name)
        if quota is None or not principal.confined:
            return
        used = self.used(principal.name)
        if used >= quota:
            raise QuotaExceeded(
                f"quota exceeded: tenant {principal.name!r} holds {used} of its {quota} bytes; "
                "remove blocks or wait for eviction"
            )
