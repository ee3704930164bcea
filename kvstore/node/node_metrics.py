"""Prometheus metrics of a storage node, read from its store's stats."""

from __future__ import annotations

_COUNTERS = ("hits", "misses", "evictions", "demotions", "promotions", "checksum_failures")


def node_metrics(node) -> list[tuple[str, str, str, dict, float]]:
    """(name, help, type, labels, value) rows for kvstore.metrics.MetricsServer."""
    stats = node.store.stats()
    base = {"node": node.node_id}
    rows = []
    for tier in ("dram", "ssd"):
        if tier not in stats:
            continue
        labels = {**base, "tier": tier}
        s = stats[tier]
        rows.append(("kvstore_tier_capacity_bytes", "Tier capacity in bytes.", "gauge", labels, s["capacity"]))
        rows.append(("kvstore_tier_used_bytes", "Bytes held by the tier.", "gauge", labels, s["used"]))
        rows.append(("kvstore_tier_blocks", "Blocks held by the tier.", "gauge", labels, s["blocks"]))
        for name in _COUNTERS:
            rows.append(
                (f"kvstore_tier_{name}_total", f"Tier {name.replace('_', ' ')} so far.", "counter", labels, s[name])
            )
    if "ssd" in stats:
        rows.append(
            (
                "kvstore_ssd_written_bytes_total",
                "Payload bytes written to the SSD tier since the node started.",
                "counter",
                base,
                stats["ssd"]["bytes_written"],
            )
        )
        rows.append(
            (
                "kvstore_ssd_disk_full_total",
                "SSD writes that found the file system full (the tier then holds at most what it held).",
                "counter",
                base,
                stats["ssd"]["disk_full"],
            )
        )
    store = stats["store"]
    rows.append(("kvstore_node_blocks", "Blocks stored on the node.", "gauge", base, store["blocks"]))
    rows.append(("kvstore_node_pinned_blocks", "Pinned blocks.", "gauge", base, store["pinned"]))
    rows.append(
        (
            "kvstore_node_inline_evictions_total",
            "Puts that had to evict inline.",
            "counter",
            base,
            store["inline_evictions"],
        )
    )
    rows.append(
        (
            "kvstore_node_granted_bytes",
            "DRAM set aside for same-host writers' next puts (grants).",
            "gauge",
            base,
            store["granted_bytes"],
        )
    )
    directory = node.store.dram.directory
    if directory is not None:
        rows.append(
            (
                "kvstore_node_directory_blocks",
                "DRAM blocks same-host clients can read without a round trip.",
                "gauge",
                base,
                len(directory),
            )
        )
        rows.append(
            (
                "kvstore_node_directory_unpublished_total",
                "Blocks left out of the block directory (bucket full: read with a lease instead).",
                "counter",
                base,
                directory.unpublished,
            )
        )
    return rows
