"""Eviction policies behind one interface; ``make_policy(name)`` builds one by name."""

from kvstore.policy.base import EvictionPolicy
from kvstore.policy.lfu import LFUPolicy
from kvstore.policy.length_aware import LengthAwarePolicy
from kvstore.policy.lru import LRUPolicy

POLICIES: dict[str, type[EvictionPolicy]] = {
    "lru": LRUPolicy,
    "lfu": LFUPolicy,
    "length_aware": LengthAwarePolicy,
}


def make_policy(name: str) -> EvictionPolicy:
    """A fresh policy by its name: lru, lfu or length_aware."""
    try:
        return POLICIES[name]()
    except KeyError:
        from kvstore_client.errors import ConfigError

        raise ConfigError(f"unknown eviction policy {name!r}; choose one of {sorted(POLICIES)}") from None


__all__ = ["EvictionPolicy", "LFUPolicy", "LRUPolicy", "LengthAwarePolicy", "POLICIES", "make_policy"]
