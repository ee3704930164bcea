"""The master's global prefix index, as plain Python (no gRPC)."""

from __future__ import annotations

import random
import threading

import pytest

from kvstore.master.errors import InvalidRequest
from kvstore.master.index import DRAM, REMOVED, SSD, STORED, PrefixIndex
from kvstore_client.errors import InvalidKey

NS = "llama/acme"


def d(i: int) -> bytes:
    return i.to_bytes(16, "big")


def stored(digests, tier=DRAM):
    return [(STORED, tier, x) for x in digests]


@pytest.fixture
def index() -> PrefixIndex:
    idx = PrefixIndex()
    for node in ("a", "b", "c"):
        idx.add_node(node)
    return idx


def as_dicts(located):
    return [dict(h) for h in located]


def test_events_store_move_and_remove(index):
    assert index.apply("a", [(NS, stored([d(1), d(2)]))])
    assert index.apply("b", [(NS, stored([d(2)], SSD))])
    assert as_dicts(index.locate(NS, [d(1), d(2), d(3)])) == [{"a": DRAM}, {"a": DRAM, "b": SSD}, {}]
    index.apply("a", [(NS, [(STORED, SSD, d(2))])])  # a moved block 2 down to SSD
    assert dict(index.locate(NS, [d(2)])[0]) == {"a": SSD, "b": SSD}
    assert index.node_counts()["a"] == {"dram": 1, "ssd": 1}
    index.apply("a", [(NS, [(REMOVED, 0, d(2)), (REMOVED, 0, d(9))])])  # removing an absent block is a no-op
    assert as_dicts(index.locate(NS, [d(1), d(2)])) == [{"a": DRAM}, {"b": SSD}]
    assert index.node_counts() == {"a": {"dram": 1, "ssd": 0}, "b": {"dram": 0, "ssd": 1}, "c": {"dram": 0, "ssd": 0}}
    assert index.size() == 2


def test_events_apply_in_order_within_a_batch(index):
    index.apply("a", [(NS, [(STORED, DRAM, d(1)), (REMOVED, 0, d(1)), (STORED, SSD, d(1))])])
    assert dict(index.locate(NS, [d(1)])[0]) == {"a": SSD}
    index.apply("a", [(NS, [(REMOVED, 0, d(1))])])
    assert index.size() == 0 and index.namespaces() == []


def test_namespaces_never_mix(index):
    index.apply("a", [("m1", stored([d(1)])), ("m2", stored([d(2)]))])
    assert index.locate("m1", [d(1), d(2)]) == [(("a", DRAM),), ()]
    assert index.locate("m3", [d(1)]) == [()]
    assert index.namespaces() == ["m1", "m2"]


def test_unknown_node_is_refused_and_nothing_changes(index):
    assert not index.apply("zzz", [(NS, stored([d(1)]))])
    assert not index.replace_inventory("zzz", [(NS, stored([d(1)]))])
    assert index.size() == 0


@pytest.mark.parametrize(
    "batch, error",
    [
        (("", stored([d(1)])), InvalidKey),
        ((NS, stored([b""])), InvalidKey),
        ((NS, stored([b"x" * 65])), InvalidKey),
        ((NS, [(STORED, 0, d(1))]), InvalidRequest),
        ((NS, [(STORED, 7, d(1))]), InvalidRequest),
        ((NS, [(0, DRAM, d(1))]), InvalidRequest),
    ],
)
def test_bad_events_reject_the_whole_report(index, batch, error):
    with pytest.raises(error):
        index.apply("a", [(NS, stored([d(5)])), batch])
    assert index.size() == 0


def test_replace_inventory(index):
    index.apply("a", [(NS, stored([d(1), d(2), d(3)]))])
    index.apply("b", [(NS, stored([d(1)]))])
    assert index.replace_inventory("a", [(NS, stored([d(3)], SSD)), ("other", stored([d(4)]))])
    assert as_dicts(index.locate(NS, [d(1), d(2), d(3)])) == [{"b": DRAM}, {}, {"a": SSD}]
    assert index.locate("other", [d(4)]) == [(("a", DRAM),)]
    assert index.node_counts()["a"] == {"dram": 1, "ssd": 1}
    assert index.replace_inventory("a", [])
    assert index.node_blocks("a") == 0 and index.namespaces() == [NS]


def test_drop_node_removes_only_its_blocks(index):
    index.apply("a", [(NS, stored([d(1), d(2)]))])
    index.apply("b", [(NS, stored([d(2), d(3)], SSD))])
    assert index.drop_node("a")
    assert not index.has_node("a") and not index.drop_node("a")
    assert as_dicts(index.locate(NS, [d(1), d(2), d(3)])) == [{}, {"b": SSD}, {"b": SSD}]
    assert "a" not in index.node_counts()
    assert not index.apply("a", [(NS, stored([d(1)]))])  # dropped means unknown
    index.add_node("a")
    index.apply("a", [(NS, stored([d(1)]))])  # interned holders stay consistent after a drop
    assert as_dicts(index.locate(NS, [d(1), d(2)])) == [{"a": DRAM}, {"b": SSD}]


def test_reset_node_keeps_it_known_but_empty(index):
    index.apply("a", [(NS, stored([d(1)]))])
    index.reset_node("a")
    assert index.has_node("a") and index.size() == 0
    index.reset_node("new")  # a first registration
    assert index.apply("new", [(NS, stored([d(1)]))])


def test_match_prefix_over_several_nodes(index):
    chain = [d(i) for i in range(10)]
    index.apply("a", [(NS, stored(chain[:6]))])  # a: blocks 0-5
    index.apply("b", [(NS, stored(chain[:3]))])  # b: blocks 0-2
    index.apply("c", [(NS, stored(chain[5:8], SSD))])  # c: blocks 5-7, not the head
    counts, longest = index.match_prefix(NS, chain)
    assert counts == {"a": 6, "b": 3}  # c does not hold block 0: absent
    assert longest == 8  # 0-5 on a, 6-7 on c
    assert index.match_prefix(NS, chain[:4]) == ({"a": 4, "b": 3}, 4)
    assert index.match_prefix(NS, [d(99)] + chain) == ({}, 0)
    assert index.match_prefix(NS, []) == ({}, 0)
    assert index.match_prefix("elsewhere", chain) == ({}, 0)


def test_match_prefix_hole_in_the_middle(index):
    chain = [d(i) for i in range(6)]
    index.apply("a", [(NS, stored(chain[:2] + chain[3:]))])  # a misses block 2
    index.apply("b", [(NS, stored(chain[2:3]))])
    assert index.match_prefix(NS, chain) == ({"a": 2}, 6)
    index.apply("b", [(NS, [(REMOVED, 0, chain[2])])])
    assert index.match_prefix(NS, chain) == ({"a": 2}, 2)


def test_match_prefix_against_a_brute_force_model():
    rng = random.Random(7)
    idx, held = PrefixIndex(), {}
    nodes = ["n0", "n1", "n2"]
    chain = [d(i) for i in range(40)]
    for n in nodes:
        idx.add_node(n)
        held[n] = {x for x in chain if rng.random() < 0.85}
        idx.apply(n, [(NS, stored(sorted(held[n]), rng.choice([DRAM, SSD])))])
    for length in range(0, 41, 3):
        query = chain[:length]
        counts, longest = idx.match_prefix(NS, query)

        def run(holds):
            return next((i for i, x in enumerate(query) if not holds(x)), len(query))

        assert longest == run(lambda x: any(x in held[n] for n in nodes))
        assert counts == {n: run(held[n].__contains__) for n in nodes if run(held[n].__contains__) > 0}


def test_lookups_validate_keys(index):
    with pytest.raises(InvalidKey):
        index.locate("", [d(1)])
    with pytest.raises(InvalidKey):
        index.locate(NS, [b""])
    with pytest.raises(InvalidKey):
        index.match_prefix(NS, [d(1), "not bytes"])
    with pytest.raises(InvalidKey):
        index.match_prefix("bad\0ns", [d(1)])


def test_list_keys_pages_in_order(index):
    digests = [d(i) for i in range(25)]
    index.apply("a", [(NS, stored(digests)), ("z-other", stored([d(1)]))])
    index.apply("b", [(NS, stored(digests[:3], SSD))])
    seen, cursor = [], b""
    while True:
        page = index.list_keys(NS, 10, cursor)
        seen += page
        if len(page) < 10:
            break
        cursor = page[-1][1]
    assert [x for _, x, _ in seen] == sorted(digests)
    assert dict(seen[0][2]) == {"a": DRAM, "b": SSD}
    everything = index.list_keys(None, 100)
    assert [(ns, x) for ns, x, _ in everything] == [(NS, x) for x in sorted(digests)] + [("z-other", d(1))]
    assert len(index.list_keys(None, 3)) == 3 and index.list_keys(NS, 0) == []
    with pytest.raises(InvalidRequest):
        index.list_keys(None, 10, d(3))


def test_list_keys_scan_survives_changes(index):
    index.apply("a", [(NS, stored([d(i) for i in range(10)]))])
    first = index.list_keys(NS, 4)
    index.apply("a", [(NS, [(REMOVED, 0, d(5)), (STORED, DRAM, d(100))])])  # during the scan
    rest = index.list_keys(NS, 100, first[-1][1])
    listed = [x for _, x, _ in first + rest]
    assert d(5) not in listed  # removed keys are not listed once gone
    assert set(listed) >= {d(i) for i in range(10) if i != 5}  # keys present throughout: all listed, once
    assert len(listed) == len(set(listed))
    assert d(100) in [x for _, x, _ in index.list_keys(NS, 100)]  # a new scan sees new keys


def test_concurrent_updates_and_lookups_stay_consistent():
    idx = PrefixIndex()
    chains = {n: [d(1000 * k + i) for i in range(200)] for k, n in enumerate(["a", "b", "c", "d"])}
    for n in chains:
        idx.add_node(n)
    errors = []

    def writer(node):
        try:
            for _ in range(20):
                idx.apply(node, [(NS, stored(chains[node]))])
                idx.apply(node, [(NS, [(REMOVED, 0, x) for x in chains[node][100:]])])
                idx.replace_inventory(node, [(NS, stored(chains[node][:150], SSD))])
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    def reader():
        try:
            for _ in range(200):
                for node, chain in chains.items():
                    counts, longest = idx.match_prefix(NS, chain)
                    assert longest in (0, 100, 150, 200) and counts.get(node, 0) == longest
                    located = idx.locate(NS, chain)
                    assert all(h == () or h[0][0] == node for h in located)
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=writer, args=(n,)) for n in chains] + [threading.Thread(target=reader)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert idx.node_counts() == {n: {"dram": 0, "ssd": 150} for n in chains}


def test_packed_blocks_index_exactly_as_their_events():
    """The bulk path (keys no node holds, keys other nodes hold, keys the node holds in the
    other tier, duplicates) ends in the same index as the per-event path, change feed included."""
    rng = random.Random(5)
    keys = [d(i) for i in range(2000)]

    def build(packed: bool):
        idx, feed = PrefixIndex(), []
        idx.watch(lambda changes, emptied: feed.append(changes)) if packed == "watched" else None
        for node in ("a", "b"):
            idx.add_node(node)
        idx.apply("b", [(NS, stored(keys[:500], SSD))])
        idx.apply("a", [(NS, stored(keys[400:600], SSD))])
        batch = rng.sample(keys, 1500) + keys[:10]
        if packed:
            idx.replace_inventory("a", [], [(NS, DRAM, batch)])
        else:
            idx.replace_inventory("a", [(NS, stored(batch))])
        return idx, feed

    for variant in (True, "watched"):
        rng.seed(5)
        expected, _ = build(False)
        rng.seed(5)
        got, feed = build(variant)
        assert got.locate(NS, keys) == expected.locate(NS, keys)
        assert got.node_counts() == expected.node_counts()
        assert got.list_keys(NS, 5000) == expected.list_keys(NS, 5000)
    assert feed  # the watched index reported its changes


def test_packed_blocks_are_validated_before_anything_changes(index):
    index.apply("a", [(NS, stored([d(1)]))])
    for bad, error in (
        ((NS, 0, [d(2)]), InvalidRequest),
        (("", DRAM, [d(2)]), InvalidKey),
        ((NS, DRAM, [d(2), b""]), InvalidKey),
    ):
        with pytest.raises(error):
            index.replace_inventory("a", [], [bad])
    assert as_dicts(index.locate(NS, [d(1), d(2)])) == [{"a": DRAM}, {}]
