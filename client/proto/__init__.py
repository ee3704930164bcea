"""Generated protobuf and gRPC code for proto/kvstore.proto (do not edit by hand)."""
