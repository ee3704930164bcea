"""kvstore for vLLM: ``KVStoreConnector``, the KV connector that loads prefix KV from the pool
and stores new KV into it, layer by layer.

Importing this package imports vLLM; ``import kvstore_client`` never does.
"""

from kvstore_client.vllm.connector import KVStoreConnector, KVStoreConnectorMetadata

__all__ = ["KVStoreConnector", "KVStoreConnectorMetadata"]
