"""kvstore: a distributed KVCache store for LLM serving (server side)."""

__version__ = "0.1.0"
