"""The master: membership, the global prefix index, placement, admin queries (no block bytes).

Domain modules (``index``, ``membership``, ``placement``) are pure Python;
``service`` adapts them to gRPC and ``server`` runs the process. With
``--kv-events``, ``kv_events`` (what is announced) and its mechanism modules
publish the index as vLLM KV events on ZMQ. Importing
this package stays free of gRPC: ``MasterServer`` and ``run_master`` load on
first use.
"""

__all__ = ["MasterServer", "run_master"]


def __getattr__(name: str):
    if name in __all__:
        from kvstore.master import server

        return getattr(server, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
