"""``kvstore router``: an OpenAI-compatible front end that runs each request's prefill on one vLLM
engine and its decode on another, where the master's conductor places them (see server.py)."""

from kvstore.router.server import Router, build_app

__all__ = ["Router", "build_app"]
