"""The router's per-request conductor calls: the master's conductor port when it has one, else gRPC.

``Schedule`` is on every request's time to first token. Over the conductor port (a
``ConductorLink`` in the router's own event loop) it costs a fraction of a millisecond; over the
pool client's gRPC, run in a thread, one to three. The port's address comes from the master's
ClusterStatus; a master without one (``--conductor-port -1``), a link that cannot be had or
that a standby refuses (UNAVAILABLE) sends the call over gRPC, which follows the leader, and the
address is asked again at most once every ``RESOLVE_EVERY_S``. A call that broke after it was
sent is not made again (the conductor may have acted on it): it fails with ServiceUnavailable,
and a Schedule is reported cancelled over gRPC, so the conductor does not hold it.
"""

from __future__ import annotations

import asyncio
import logging
import time

from kvstore_client.conductor_link import ConductorLink, LinkDown
from kvstore_client.errors import KVStoreError, ServiceUnavailable

log = logging.getLogger(__name__)

RESOLVE_EVERY_S = 1.0


class ConductorCalls:
    """``backend``: the router's PoolBackend (its ``schedule`` and ``report`` are the gRPC way;
    ``conductor_port()``, when it has one, gives (address, token, tls context) or None)."""

    def __init__(self, backend):
        self._backend = backend
        self._link: ConductorLink | None = None
        self._resolved_at = -1e9

    @property
    def link_address(self) -> str | None:
        """The conductor port the calls go to now (None: gRPC)."""
        return self._link.address if self._link is not None else None

    async def prepare(self) -> None:
        """Find the conductor port and connect, so that the first request does not wait for it
        (best effort: the calls fall back to gRPC anyway)."""
        link = await self._current_link()
        if link is not None:
            try:
                await link.connect()
            except KVStoreError as exc:
                self._lost(link, exc)

    async def schedule(self, keys, input_length: int, output_length: int, request_id: str, namespace: str):
        """The conductor's placement; the prefill goes out at once, so it counts as started."""
        link = await self._current_link()
        if link is not None:
            try:
                return await link.schedule(
                    keys, input_length, output_length, request_id=request_id, namespace=namespace, start_prefill=True
                )
            except LinkDown as exc:
                self._lost(link, exc)
                if exc.sent:  # it may have been placed: take it back, the request fails
                    await self._cancel_over_grpc(namespace, request_id)
                    raise ServiceUnavailable(f"the conductor port broke during Schedule: {exc}") from None
            except ServiceUnavailable as exc:  # a standby: nothing was done
                self._lost(link, exc)
        return await asyncio.to_thread(self._backend.schedule, keys, input_length, output_length, request_id, namespace)

    async def _cancel_over_grpc(self, namespace: str, request_id: str) -> None:
        try:
            await asyncio.to_thread(self._backend.report, namespace, request_id, "cancelled")
        except (KVStoreError, OSError) as exc:
            log.warning("router: could not cancel %s after the conductor port broke: %s", request_id, exc)

    async def report(self, namespace: str, request_id: str, stage: str):
        link = await self._current_link()
        if link is not None:
            try:
                return await link.report_request(namespace, request_id, stage)
            except LinkDown as exc:
                self._lost(link, exc)
                if exc.sent:
                    raise
            except ServiceUnavailable as exc:
                self._lost(link, exc)
        return await asyncio.to_thread(self._backend.report, namespace, request_id, stage)

    async def close(self) -> None:
        if self._link is not None:
            await self._link.close()
            self._link = None

    async def _current_link(self) -> ConductorLink | None:
        if self._link is not None or time.monotonic() - self._resolved_at < RESOLVE_EVERY_S:
            return self._link
        self._resolved_at = time.monotonic()
        find = getattr(self._backend, "conductor_port", None)
        if find is None:
            return None
        try:
            found = await asyncio.to_thread(find)
        except (KVStoreError, OSError) as exc:
            log.warning("router: cannot ask the master for its conductor port (%s): using gRPC", exc)
            return None
        if found is not None:
            address, token, tls = found
            self._link = ConductorLink(address, token=token, tls=tls)
            log.info("router: conductor calls go to the conductor port %s", address)
        return self._link

    def _lost(self, link: ConductorLink, exc: Exception) -> None:
        log.warning("router: conductor port %s: %s; using gRPC until it is found again", link.address, exc)
        if self._link is link:
            self._link = None
            self._resolved_at = time.monotonic()
            asyncio.get_running_loop().create_task(link.close())
