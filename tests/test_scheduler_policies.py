"""Each prefill policy's decision on small hand-built clusters, and decode selection.

The cluster: four prefill instances p0..p3, each on its own storage node
n0..n3, indexed in a real PrefixIndex. A request of 20 blocks (10,240
tokens); n0 holds all 20 of them.
"""

from __future__ import annotations

from collections import Counter

import pytest

from kvstore.master.index import DRAM, STORED, PrefixIndex
from kvstore.scheduler import Conductor, CostModel, CostParams, Decision, SimClock
from kvstore_client.errors import ConfigError

NS = "test"
BLOCKS = [i.to_bytes(16, "big") for i in range(1, 21)]
INPUT = 20 * 512


def make(policy: str, *, bandwidth: float = 25e9, holders=None, threshold: int = 0, decode: int = 1) -> Conductor:
    index = PrefixIndex()
    holders = {"n0": 20} if holders is None else holders
    for i in range(4):
        index.add_node(f"n{i}")
    for node, count in holders.items():
        index.apply(node, [(NS, [(STORED, DRAM, d) for d in BLOCKS[:count]])])
    cost = CostModel(CostParams(transfer_bandwidth=bandwidth))
    c = Conductor(index, cost, policy=policy, namespace=NS, clock=SimClock(), balancing_threshold=threshold)
    for i in range(4):
        c.register_prefill(f"p{i}", f"n{i}")
    for i in range(decode):
        c.register_decode(f"d{i}", f"dn{i}")
    return c


def overload(c: Conductor, instance: str, seconds: float = 100.0) -> None:
    c.report_prefill_load(instance, queue_len=10, busy_s=seconds, now=0.0)


def test_kvcache_centric_goes_to_the_longest_prefix_when_it_is_free():
    d = make("kvcache_centric").schedule(BLOCKS, INPUT, 100, now=0.0)
    assert isinstance(d, Decision)
    assert (d.prefill, d.prefix_blocks, d.local_blocks, d.fetch_from, d.fetch_blocks) == ("p0", 20, 20, None, ())


def test_kvcache_centric_fetches_when_the_holder_is_overloaded_and_transfer_is_cheap():
    c = make("kvcache_centric")
    overload(c, "p0")
    d = c.schedule(BLOCKS, INPUT, 100, now=0.0)
    assert d.prefill != "p0" and d.prefill_node != "n0"
    assert (d.fetch_from, d.prefix_blocks, d.local_blocks) == ("n0", 20, 0)
    assert d.fetch_blocks == tuple(BLOCKS)  # to be replicated to the chosen node (hotspot migration)
    assert d.est_transfer_s == pytest.approx(c.cost.transfer_time(20))
    assert d.est_ttft_s < c.cost.prefill_time(INPUT)  # cheaper than recomputing


def test_kvcache_centric_fetches_only_the_missing_suffix():
    c = make("kvcache_centric", holders={"n0": 20, "n2": 5})
    overload(c, "p0")
    d = c.schedule(BLOCKS, INPUT, 100, now=0.0)
    assert (d.prefill, d.local_blocks, d.prefix_blocks, d.fetch_from) == ("p2", 5, 20, "n0")
    assert d.fetch_blocks == tuple(BLOCKS[5:])


def test_kvcache_centric_recomputes_when_transfer_is_slower():
    c = make("kvcache_centric", bandwidth=1e6)  # 1 MB/s: 160 MiB blocks take minutes
    overload(c, "p0")
    d = c.schedule(BLOCKS, INPUT, 100, now=0.0)
    assert d.prefill != "p0"
    assert (d.fetch_from, d.fetch_blocks, d.prefix_blocks) == (None, (), 0)
    assert d.est_ttft_s == pytest.approx(c.cost.prefill_time(INPUT))


def test_kvcache_centric_waits_for_the_holder_when_that_beats_both():
    c = make("kvcache_centric", bandwidth=1e6)
    overload(c, "p0", seconds=0.5)  # short queue: waiting beats recomputing ~2.5 s
    assert c.schedule(BLOCKS, INPUT, 100, now=0.0).prefill == "p0"


def test_balancing_threshold_suppresses_small_fetches():
    c = make("kvcache_centric", holders={"n0": 20, "n1": 18, "n2": 18, "n3": 18}, threshold=2)
    overload(c, "p0")
    d = c.schedule(BLOCKS, INPUT, 100, now=0.0)
    assert (d.fetch_from, d.prefix_blocks) == (None, 18)
    c = make("kvcache_centric", holders={"n0": 20, "n1": 18, "n2": 18, "n3": 18}, threshold=1)
    overload(c, "p0")
    assert c.schedule(BLOCKS, INPUT, 100, now=0.0).fetch_from == "n0"


def test_cache_aware_uses_the_local_prefix_and_never_fetches():
    c = make("cache_aware")
    assert c.schedule(BLOCKS, INPUT, 100, now=0.0, request_id="a").prefill == "p0"
    c = make("cache_aware")
    overload(c, "p0")
    d = c.schedule(BLOCKS, INPUT, 100, now=0.0)
    assert d.prefill != "p0" and (d.fetch_from, d.prefix_blocks) == (None, 0)


def test_cache_aware_prefers_a_partial_local_prefix_among_idle_instances():
    c = make("cache_aware", holders={"n0": 20, "n3": 10})
    overload(c, "p0")
    d = c.schedule(BLOCKS, INPUT, 100, now=0.0)
    assert (d.prefill, d.prefix_blocks, d.fetch_from) == ("p3", 10, None)


def test_load_balance_picks_the_fewest_assigned_requests():
    c = make("load_balance")
    for _ in range(3):  # p0..p2 get one request each, in some order; p3 is then the only empty one
        c.schedule(BLOCKS, INPUT, 100, now=0.0)
    loads = {k: v["assigned"] for k, v in c.loads(0.0)["prefill"].items()}
    assert sorted(loads.values()) == [0, 1, 1, 1]
    empty = next(k for k, v in loads.items() if v == 0)
    d = c.schedule(BLOCKS, INPUT, 100, now=0.0)
    assert d.prefill == empty and d.fetch_from is None
    assert d.prefix_blocks == (20 if empty == "p0" else 0)  # the engine reuses what its node holds


def test_random_is_seeded_spreads_and_never_fetches():
    def picks(seed):
        c = make("random")
        c.policy = type(c.policy)(seed)
        return [c.schedule(BLOCKS, INPUT, 100, now=0.0) for _ in range(200)]

    first = picks(1)
    assert [d.prefill for d in first] == [d.prefill for d in picks(1)]
    assert set(Counter(d.prefill for d in first)) == {"p0", "p1", "p2", "p3"}
    assert all(d.fetch_from is None for d in first)


def test_unknown_policy_is_a_config_error():
    with pytest.raises(ConfigError):
        make("fastest")


def test_decode_goes_to_the_least_loaded_instance_within_the_slo():
    c = make("kvcache_centric", decode=3)
    rids = []
    for i in range(3):
        c.schedule(BLOCKS, INPUT, 100, now=0.0, request_id=i)
        c.prefill_started(i, now=0.0)
        rids.append(c.prefill_finished(i, now=1.0).decode)
    assert sorted(rids) == ["d0", "d1", "d2"]  # one each: always the least loaded
    c.decode_finished(1, now=2.0)
    c.schedule(BLOCKS, INPUT, 100, now=2.0, request_id=9)
    c.prefill_started(9, now=2.0)
    assert c.prefill_finished(9, now=3.0).decode == rids[1]
