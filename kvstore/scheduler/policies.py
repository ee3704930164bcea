"""Prefill placement policies behind one interface, and decode selection.

Every prefill policy sees the same inputs: the request (input length), the
prefix each storage node holds (from the master's PrefixIndex), the prefill
instances with their loads, the cost model and the time. It returns a
:class:`PrefillChoice`. Every policy lets the engine reuse the prefix its own node
holds (an engine always loads what is local); they differ in how they pick:

- ``random``: uniformly at random (seeded).
- ``load_balance``: the fewest assigned, unfinished requests (the paper's
  baseline); ties at random (seeded).
- ``cache_aware``: the smallest queue time + prefill time with the local
  prefix; never fetches.
- ``kvcache_centric``: Algorithm 1 of FAST'25. For each instance, the
  estimated TTFT with its local prefix, and, when the longest prefix held by
  any node is more than ``balancing_threshold`` blocks longer, also the TTFT
  when that prefix is fetched first (transfer + queue + prefill of the rest);
  the cheaper of the two (fetch only when it beats recomputing). The instance
  with the smallest estimate wins. Fetched blocks are to be replicated to the
  chosen instance's node (the conductor's Decision lists them).

Policies hold no locks; the conductor calls them under its lock. ``random``
and ``load_balance`` keep a seeded generator, the others are stateless.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Sequence

from kvstore.scheduler.cost_model import CostModel
from kvstore.scheduler.registry import DecodeInstance, PrefillInstance
from kvstore_client.errors import ConfigError


@dataclass(frozen=True)
class Prefix:
    """What the index says about one request: per node, the leading blocks it holds."""

    per_node: dict  # node id -> leading blocks held by that node
    best_node: str | None = None  # the node holding the longest prefix (ties: smallest id)
    best_blocks: int = 0

    @classmethod
    def from_match(cls, per_node: dict) -> "Prefix":
        if not per_node:
            return cls({})
        best = max(sorted(per_node), key=per_node.__getitem__)
        return cls(per_node, best, per_node[best])


@dataclass(frozen=True)
class PrefillChoice:
    """Where one request's prefill runs and what it reuses."""

    instance: PrefillInstance
    local_blocks: int  # prefix blocks on the instance's own node
    prefix_blocks: int  # blocks reused in total (local, or fetched up to this)
    fetch_from: str | None  # node the missing prefix blocks come from
    queue_s: float
    transfer_s: float
    prefill_s: float

    @property
    def fetch_blocks(self) -> int:
        return self.prefix_blocks - self.local_blocks if self.fetch_from else 0

    @property
    def service_s(self) -> float:
        """Time the instance is busy with the request: fetch, then prefill."""
        return self.transfer_s + self.prefill_s

    @property
    def ttft_s(self) -> float:
        return self.queue_s + self.transfer_s + self.prefill_s


class PrefillPolicy:
    """Chooses a prefill instance for one request."""

    name = ""

    def choose(
        self, input_len: int, prefix: Prefix, instances: Sequence[PrefillInstance], cost: CostModel, now: float
    ) -> PrefillChoice:
        raise NotImplementedError

    @staticmethod
    def local(inst: PrefillInstance, input_len: int, prefix: Prefix, cost: CostModel, now: float) -> PrefillChoice:
        """PrefillChoice on ``inst`` reusing only what its node holds."""
        blocks = prefix.per_node.get(inst.node_id, 0)
        prefill = cost.prefill_time(input_len, cost.cached_tokens(input_len, blocks))
        return PrefillChoice(inst, blocks, blocks, None, inst.queue_time(now), 0.0, prefill)


class RandomPolicy(PrefillPolicy):
    name = "random"

    def __init__(self, seed: int = 0) -> None:
        self._rng = random.Random(seed)

    def choose(self, input_len, prefix, instances, cost, now):
        return self.local(self._rng.choice(instances), input_len, prefix, cost, now)


class LoadBalancePolicy(PrefillPolicy):
    """Fewest assigned, unfinished requests; ties at random (the count is the only load signal)."""

    name = "load_balance"

    def __init__(self, seed: int = 0) -> None:
        self._rng = random.Random(seed)

    def choose(self, input_len, prefix, instances, cost, now):
        fewest = min(i.load() for i in instances)
        inst = self._rng.choice([i for i in instances if i.load() == fewest])
        return self.local(inst, input_len, prefix, cost, now)


class CacheAwarePolicy(PrefillPolicy):
    name = "cache_aware"

    def choose(self, input_len, prefix, instances, cost, now):
        return min((self.local(i, input_len, prefix, cost, now) for i in instances), key=lambda p: p.ttft_s)


class KVCacheCentricPolicy(PrefillPolicy):
    """Algorithm 1: fetch a longer prefix when that beats recomputing it."""

    name = "kvcache_centric"

    def __init__(self, balancing_threshold: int = 0) -> None:
        if balancing_threshold < 0:
            raise ConfigError("balancing_threshold is a number of blocks >= 0")
        self.balancing_threshold = balancing_threshold

    def choose(self, input_len, prefix, instances, cost, now):
        best_blocks, best_node = prefix.best_blocks, prefix.best_node
        full_prefill = cost.prefill_time(input_len, cost.cached_tokens(input_len, best_blocks))
        best: PrefillChoice | None = None
        for inst in instances:
            option = self.local(inst, input_len, prefix, cost, now)
            missing = best_blocks - option.local_blocks
            if missing > self.balancing_threshold:
                fetched = PrefillChoice(
                    inst,
                    option.local_blocks,
                    best_blocks,
                    best_node,
                    option.queue_s,
                    cost.transfer_time(missing),
                    full_prefill,
                )
                if fetched.ttft_s < option.ttft_s:
                    option = fetched
            if best is None or option.ttft_s < best.ttft_s:
                best = option
        return best


PREFILL_POLICIES = {
    "random": RandomPolicy,
    "load_balance": LoadBalancePolicy,
    "cache_aware": CacheAwarePolicy,
    "kvcache_centric": KVCacheCentricPolicy,
}


def make_prefill_policy(name: str, **options) -> PrefillPolicy:
    """A prefill policy by name; ``seed`` (random, load_balance ties) and ``balancing_threshold`` (kvcache_centric)
    go to the policy that takes them and are ignored by the others."""
    try:
        cls = PREFILL_POLICIES[name]
    except KeyError:
        raise ConfigError(f"unknown prefill policy {name!r}; choose one of {sorted(PREFILL_POLICIES)}") from None
    if cls is RandomPolicy or cls is LoadBalancePolicy:
        return cls(options.get("seed", 0))
    if cls is KVCacheCentricPolicy:
        return cls(options.get("balancing_threshold", 0))
    return cls()


@dataclass(frozen=True)
class DecodePick:
    """A decode instance for a request: its step time with the request on top, whether that is
    within the instance's limit, and the instance's load before the request."""

    instance: DecodeInstance | None
    tbt_s: float
    fits: bool
    load: float = float("inf")

    @property
    def full(self) -> bool:
        """The instance is at its limit already: Algorithm 1's decode check, which looks at the
        selected instance's TBT (its load), not at the request."""
        return self.load >= 1.0


def decode_fit(inst: DecodeInstance, tokens: int, cost: CostModel) -> DecodePick:
    """``inst`` with ``tokens`` more context tokens on top of what it runs now."""
    now_tokens = inst.tokens() + tokens
    return DecodePick(inst, cost.tbt(now_tokens), now_tokens <= inst.token_limit, inst.load())


def select_decode(instances: Sequence[DecodeInstance], tokens: int, cost: CostModel) -> DecodePick:
    """The least-loaded decode instance for a request of ``tokens`` context tokens.

    Load = (running + reserved + ``tokens``) / token limit, so requests paired
    while still in prefill spread out; ``fits`` says whether the chosen
    instance meets its limit with the request on top of what it runs now,
    ``full`` whether it is at its limit already. None when there is no decode
    instance.
    """
    best = None
    best_load = 0.0
    for inst in instances:
        load = (inst.tokens() + inst.reserved_tokens + tokens) / (inst.token_limit or 1)
        if best is None or load < best_load:
            best, best_load = inst, load
    if best is None:
        return DecodePick(None, float("inf"), False)
    return decode_fit(best, tokens, cost)
