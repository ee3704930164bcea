"""docs/grafana/kvstore.json is a Grafana dashboard whose queries use only metrics the code exports.

The exported names are taken from the code two ways: every sample tuple in the
source under kvstore/ that starts with a literal ``"kvstore_..."`` name (the
master, the KV event publisher, the nodes), and the rows a real node's
collector (``kvstore.node.node_metrics``) returns for an in-process store with
both tiers and a block directory, which covers the names it builds with
f-strings. Renaming a metric without updating the dashboard fails here.
"""

from __future__ import annotations

import json
import re
import tempfile
from types import SimpleNamespace

import pytest

from processes import ROOT

DASHBOARD = ROOT / "docs" / "grafana" / "kvstore.json"
# a sample tuple: ("kvstore_name", "help", ...), possibly f"kvstore_x_{y}_total" (those come from the collector)
_SAMPLE_NAME = re.compile(r"""\(\s*(f?)["'](kvstore_[a-z0-9_{}]+)["']\s*,\s*f?["']""")
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_SELECTOR = re.compile(r"\{[^}]*\}|\[[^\]]*\]")
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_NAME = re.compile(r"\bkvstore_[a-zA-Z0-9_:]*")


def exported_by_source() -> set[str]:
    names = set()
    for path in (ROOT / "kvstore").rglob("*.py"):
        for f_prefix, name in _SAMPLE_NAME.findall(path.read_text()):
            if not f_prefix and "{" not in name:
                names.add(name)
    return names


def exported_by_node_collector() -> set[str]:
    from kvstore.node.config import StoreConfig
    from kvstore.node.node_metrics import node_metrics
    from kvstore.node.store import BlockStore

    with (
        tempfile.TemporaryDirectory() as ssd_dir,
        BlockStore(
            StoreConfig(
                dram_capacity="8MiB",
                ssd_path=ssd_dir,
                ssd_capacity="16MiB",
                max_block_bytes="1MiB",
                directory_slots=4096,
            )
        ) as store,
    ):
        store.put(("grafana", b"k"), b"x" * 4096)
        rows = node_metrics(SimpleNamespace(store=store, node_id="node-test"))
    return {row[0] for row in rows}


@pytest.fixture(scope="module")
def exported() -> set[str]:
    return exported_by_source() | exported_by_node_collector()


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads (label values, matchers, ranges and grouping removed)."""
    bare = _GROUPING.sub(" ", _SELECTOR.sub(" ", _STRING.sub(" ", expr)))
    return set(_NAME.findall(bare))


def targets(dashboard: dict):
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            yield panel, target


def test_the_collectors_export_what_the_source_names(exported):
    assert {
        "kvstore_master_nodes_alive",
        "kvstore_master_rpcs_total",
        "kvstore_tier_used_bytes",
        "kvstore_tier_hits_total",
        "kvstore_node_directory_blocks",
        "kvstore_master_kv_events_dropped_total",
    } <= exported


def test_the_dashboard_is_a_grafana_dashboard_with_panels(dashboard):
    assert dashboard["title"] and dashboard["uid"] and isinstance(dashboard["schemaVersion"], int)
    panels = dashboard["panels"]
    assert len(panels) >= 5
    assert len({p["id"] for p in panels}) == len(panels)
    for panel in panels:
        assert panel["type"] and panel["title"]
        assert set(panel["gridPos"]) >= {"x", "y", "w", "h"} and panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24
        assert panel["targets"], panel["title"]
        assert len({t["refId"] for t in panel["targets"]}) == len(panel["targets"])


def test_every_query_reads_only_exported_metrics(dashboard, exported):
    used = set()
    for panel, target in targets(dashboard):
        names = metric_names(target["expr"])
        assert names, f"{panel['title']}: {target['expr']!r} reads no kvstore metric"
        unknown = names - exported
        assert not unknown, f"{panel['title']}: {sorted(unknown)} are not exported by kvstore"
        used |= names
    assert len(used) >= 15  # the dashboard covers the pool, not one corner of it


def test_the_name_extraction_sees_through_promql():
    expr = 'sum by (node, tier) (rate(kvstore_tier_hits_total{tier="dram",x=~"kvstore_fake"}[5m])) / kvstore_b'
    assert metric_names(expr) == {"kvstore_tier_hits_total", "kvstore_b"}
