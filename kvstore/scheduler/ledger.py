"""Who holds what in the master's conductors, counted against each caller's limits.

Every engine is charged to the caller that registered it and every request in flight to the
caller that scheduled it, whichever namespace they are in, so a token's share of the master is
bounded however many namespaces it names (:mod:`kvstore.scheduler.limits` has the limits). A
charge is given back when the engine deregisters or the request ends (finished, cancelled,
rejected at decode, expired, or ended with its engine), and an owner that holds nothing leaves
the ledger: the ledger itself never grows with callers that came and went.

Thread-safe: ``_lock`` guards every table; the ledger calls nothing outside itself, so callers
may hold their own locks around it (the Conductor's lock, the servicer's lock).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from kvstore.errors import InvalidRequest
from kvstore.scheduler.limits import ConductorLimitExceeded, ConductorLimits


@dataclass(frozen=True)
class Owner:
    """Whom conductor state is charged to: a token's name ("" in a pool without an access
    file) and the limits that token has."""

    name: str
    limits: ConductorLimits

    def describe(self) -> str:
        return f"token {self.name!r}" if self.name else "this pool"


@dataclass(frozen=True)
class Usage:
    """What one owner (or everyone) holds: namespaces with its engines, engines, requests in flight."""

    namespaces: int = 0
    engines: int = 0
    requests: int = 0


class Ledger:
    """Engines and namespaces per owner, requests in flight per owner. See the module doc."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._engine_owner: dict[tuple[str, str], str] = {}  # (namespace, engine id) -> owner name
        self._namespaces: dict[str, dict[str, int]] = {}  # owner name -> {namespace: its engines there}
        self._requests: dict[str, int] = {}  # owner name -> requests in flight

    # -- engines ----------------------------------------------------------------------------
    def add_engine(self, owner: Owner, namespace: str, engine_id: str) -> None:
        """Charge a new engine to ``owner``: ConductorLimitExceeded past its engines or namespaces,
        InvalidRequest when the id is registered already; nothing is charged then."""
        with self._lock:
            if (namespace, engine_id) in self._engine_owner:
                raise InvalidRequest(f"engine {engine_id!r} is already registered in {namespace!r}")
            held = self._namespaces.get(owner.name, {})
            limits = owner.limits
            if sum(held.values()) >= limits.engines:
                raise ConductorLimitExceeded(
                    f"quota exceeded: {owner.describe()} has {limits.engines} engines registered, its limit"
                )
            if namespace not in held and len(held) >= limits.namespaces:
                raise ConductorLimitExceeded(
                    f"quota exceeded: {owner.describe()} has engines in {limits.namespaces} namespaces, its limit"
                )
            self._engine_owner[(namespace, engine_id)] = owner.name
            self._namespaces.setdefault(owner.name, {})[namespace] = held.get(namespace, 0) + 1

    def remove_engine(self, namespace: str, engine_id: str) -> None:
        """Give an engine's charge back to whoever registered it (nothing if it was not charged)."""
        with self._lock:
            name = self._engine_owner.pop((namespace, engine_id), None)
            if name is None:
                return
            held = self._namespaces[name]
            held[namespace] -= 1
            if not held[namespace]:
                del held[namespace]
            if not held:
                del self._namespaces[name]

    # -- requests ---------------------------------------------------------------------------
    def admit(self, owner: Owner) -> str | None:
        """Count one more request in flight for ``owner``: None when counted, else why not."""
        with self._lock:
            n = self._requests.get(owner.name, 0)
            if n >= owner.limits.requests:
                return f"{owner.describe()} has {n} requests in flight, its limit"
            self._requests[owner.name] = n + 1
            return None

    def release(self, owner: Owner) -> None:
        """One request of ``owner`` ended."""
        with self._lock:
            n = self._requests.get(owner.name, 0) - 1
            if n > 0:
                self._requests[owner.name] = n
            else:
                self._requests.pop(owner.name, None)

    # -- views ------------------------------------------------------------------------------
    def usage(self, name: str | None = None) -> Usage:
        """What the owner called ``name`` holds; with None, everyone together."""
        with self._lock:
            if name is not None:
                held = self._namespaces.get(name, {})
                return Usage(len(held), sum(held.values()), self._requests.get(name, 0))
            namespaces = {ns for held in self._namespaces.values() for ns in held}
            return Usage(len(namespaces), len(self._engine_owner), sum(self._requests.values()))
