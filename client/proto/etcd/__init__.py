"""Stubs for the subset of etcd's v3 gRPC API in proto/etcd/ (generated: python -m kvstore_client.proto.generate)."""
