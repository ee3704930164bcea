"""What `kvstore status`, `kvstore keys` and `kvstore drain` show: master replies as records and tables."""

from __future__ import annotations

import time

from kvstore_client.proto import kvstore_pb2 as pb
from kvstore_client.tiers import TIER_NAMES
from kvstore.units import format_size


def cluster_status_record(reply: pb.ClusterStatusReply) -> dict:
    """Plain-data view of ClusterStatus (what --json prints)."""
    nodes = []
    for node in reply.nodes:
        tiers = {}
        for t in node.tiers:
            lookups = t.hits + t.misses
            tiers[t.tier] = {
                "capacity": t.capacity,
                "used": t.used,
                "blocks": t.blocks,
                "hits": t.hits,
                "misses": t.misses,
                "hit_rate": round(t.hits / lookups, 4) if lookups else None,
                "evictions": t.evictions,
                "demotions": t.demotions,
                "promotions": t.promotions,
                "checksum_failures": t.checksum_failures,
            }
        nodes.append(
            {
                "node_id": node.info.node_id,
                "alive": node.alive,
                "host": node.info.host,
                "data_address": node.info.data_address,
                "metrics_address": node.info.metrics_address,
                "arena_pages": node.info.arena_pages or None,
                "seconds_since_heartbeat": round(node.seconds_since_heartbeat, 2),
                "indexed_blocks": node.indexed_blocks,
                "draining": node.draining,
                "tiers": tiers,
            }
        )
    return {"nodes": nodes, "indexed_keys": reply.indexed_keys, "replication_factor": reply.replication_factor}


def wait_drained(client, node_id: str, timeout: float) -> bool:
    """Poll ClusterStatus until the node has no block in the index (True) or ``timeout`` passes (False)."""
    deadline = time.monotonic() + timeout
    while True:
        node = next((n for n in client.cluster_status().nodes if n.info.node_id == node_id), None)
        if node is None or node.indexed_blocks == 0:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.2)


def _table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(r[i])) for r in [header] + rows) for i in range(len(header))]
    return "\n".join("  ".join(str(v).ljust(w) for v, w in zip(r, widths)).rstrip() for r in [header] + rows)


def format_status(record: dict) -> str:
    header = ["node", "alive", "address", "tier", "used / capacity", "blocks", "hit rate", "evictions"]
    rows = []
    for node in record["nodes"]:
        alive = ("yes" if node["alive"] else "no") + (", draining" if node.get("draining") else "")
        first = [node["node_id"], alive, node["data_address"]]
        for i, (name, t) in enumerate(sorted(node["tiers"].items())):
            hit = "-" if t["hit_rate"] is None else f"{100 * t['hit_rate']:.1f}%"
            if name == "dram" and node.get("arena_pages"):  # huge pages: same-host copies at memory speed
                name = f"dram ({node['arena_pages']} pages)"
            rows.append(
                (first if i == 0 else ["", "", ""])
                + [
                    name,
                    f"{format_size(t['used'])} / {format_size(t['capacity'])}",
                    str(t["blocks"]),
                    hit,
                    str(t["evictions"]),
                ]
            )
        if not node["tiers"]:
            rows.append(first + ["-", "-", "-", "-", "-"])
    summary = (
        f"{len(record['nodes'])} node(s), {record['indexed_keys']} indexed block(s), "
        f"replication factor {record['replication_factor']}"
    )
    return (_table(header, rows) + "\n" if rows else "") + summary


def keys_record(reply: pb.ListKeysReply) -> dict:
    return {
        "namespaces": list(reply.namespaces),
        "keys": [
            {
                "namespace": k.namespace,
                "digest": k.digest.hex(),
                "replicas": [{"node_id": r.node_id, "tier": TIER_NAMES.get(r.tier, "?")} for r in k.replicas],
            }
            for k in reply.keys
        ],
    }


def format_keys(record: dict) -> str:
    rows = [
        [k["namespace"], k["digest"], ", ".join(f"{r['node_id']}:{r['tier']}" for r in k["replicas"])]
        for k in record["keys"]
    ]
    footer = f"{len(rows)} key(s) shown; namespaces: {', '.join(record['namespaces']) or '-'}"
    return (_table(["namespace", "digest", "held by"], rows) + "\n" if rows else "") + footer
