"""kvstore for vLLM: ``KVStoreConnector``, the KV connector that loads prefix KV from the pool
and stores new KV into it, layer by layer.

The connector (and with it vLLM) loads on first use of the name, so the engine-free parts
(``naming``, ``plans``, ``settings``) import without vLLM; ``import kvstore_client`` never
touches this package.
"""

__all__ = ["KVStoreConnector", "KVStoreConnectorMetadata"]


def __getattr__(name: str):
    if name in __all__:
        from kvstore_client.vllm import connector

        return getattr(connector, name)
    raise AttributeError(f"module 'kvstore_client.vllm' has no attribute {name!r}")
