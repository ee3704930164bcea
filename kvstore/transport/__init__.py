"""The node's data plane: bulk block bytes over TCP, a Unix socket and shared memory.

``DataPlaneServer`` (server.py) accepts connections; each is served by a
``Connection`` (connection.py) running the ops in ops.py. The frame format
is ``proto/dataplane.md``; its codec lives in the SDK (``kvstore_client.wire``)
and the client side in ``kvstore_client.transport``.

Nothing is imported here, so that ``kvstore.transport.limits`` (which the node's
configuration re-exports) comes without the server and grpc.
"""
