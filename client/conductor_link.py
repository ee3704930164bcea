"""ConductorLink: Schedule and ReportRequest over a master's conductor port, from an asyncio loop.

What a router uses for its per-request conductor calls (``kvstore.router``): one TCP connection
(TLS when the credentials say so), opened on first use and again after it breaks, with calls
pipelined on it and matched to their replies by request id, and no thread hand-off on either
side. The frames are ``kvstore_client.conductor_wire``'s; spec: ``proto/conductor.md``.

Errors are the SDK's typed ones: a rejection is Overloaded with its reason; a link that cannot
be had or breaks is LinkDown, whose ``sent`` says whether the call may have reached the
conductor (False: it did not, so it may be made again another way).
"""

from __future__ import annotations

import asyncio
import itertools
import socket
import ssl

from kvstore_client.conductor_wire import (
    BODIES,
    GRPC_NAMES,
    HEADER_SIZE,
    Method,
    Status,
    error_of,
    pack_header,
    unpack_header,
)
from kvstore_client.errors import ProtocolError, ServiceUnavailable
from kvstore_client.keys import BlockKey
from kvstore_client.proto import kvstore_pb2 as pb
from kvstore_client.scheduling import STAGES, EngineAssignment, assignment_of, schedule_request

DEFAULT_TIMEOUT_S = 10.0


class LinkDown(ServiceUnavailable):
    """The conductor port could not be reached, or the connection broke. ``sent``: whether the
    call had been sent (then the conductor may have acted on it)."""

    def __init__(self, message: str, sent: bool):
        super().__init__(message)
        self.sent = sent


def split_address(address: str) -> tuple[str, int]:
    """ "host:port" or "[v6]:port" -> (host, port)."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"not a host:port address: {address!r}")
    return host.strip("[]"), int(port)


class ConductorLink:
    """Calls to the conductor port at ``address``. ``token``: sent once per connection, in the
    AUTH frame each connection opens with (empty without one);
    ``tls``: the client context (``Credentials.client_tls()``), None for plain TCP."""

    def __init__(
        self,
        address: str,
        token: str | None = None,
        tls: ssl.SSLContext | None = None,
        timeout: float = DEFAULT_TIMEOUT_S,
    ):
        self.address = address
        self._host, self._port = split_address(address)
        self._token, self._tls, self._timeout = token, tls, timeout
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future] = {}
        self._writer: asyncio.StreamWriter | None = None
        self._reader_task: asyncio.Task | None = None
        self._connecting = asyncio.Lock()
        self._closed = False

    async def schedule(
        self,
        keys: list[BlockKey],
        input_length: int,
        output_length: int = 0,
        request_id: str = "",
        namespace: str | None = None,
        start_prefill: bool = False,
    ) -> EngineAssignment:
        """As ``SchedulingCalls.schedule``."""
        request = schedule_request(keys, input_length, output_length, request_id, namespace, start_prefill)
        return assignment_of(await self.call(Method.SCHEDULE, request))

    async def report_request(self, namespace: str, request_id: str, stage: str) -> pb.RequestEventReply:
        """As ``SchedulingCalls.report_request``."""
        return await self.call(
            Method.REPORT_REQUEST, pb.RequestEvent(namespace=namespace, request_id=request_id, stage=STAGES[stage])
        )

    async def connect(self) -> None:
        """Open the connection now (and prove the token), not on the first call."""
        await self._connected()

    async def call(self, method: Method, message):
        """Send one request and wait for its reply (the method's reply message)."""
        writer = await self._connected()
        status, body = await self._exchange(writer, method, message.SerializeToString())
        if status != Status.OK:
            raise error_of(status, body, GRPC_NAMES[method].split("/", 1)[1])
        return BODIES[method][1].FromString(body)

    async def close(self) -> None:
        self._closed = True
        self._drop(LinkDown("the link was closed", sent=True))

    # -- the connection -------------------------------------------------------------------
    async def _connected(self) -> asyncio.StreamWriter:
        if self._closed:
            raise LinkDown("the link was closed", sent=False)
        async with self._connecting:
            if self._writer is not None:
                return self._writer
            try:
                reader, writer = await asyncio.wait_for(
                    asyncio.open_connection(
                        self._host, self._port, ssl=self._tls, server_hostname=self._host if self._tls else None
                    ),
                    self._timeout,
                )
            except (OSError, asyncio.TimeoutError, ssl.SSLError) as exc:
                raise LinkDown(f"conductor port {self.address} is unreachable: {exc!r}", sent=False) from None
            sock = writer.get_extra_info("socket")
            if sock is not None:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._writer = writer
            self._reader_task = asyncio.get_running_loop().create_task(self._read_replies(reader, writer))
            # AUTH first, with or without a token: a connection turned away (BUSY) or lost fails
            # here, before any call of the caller's was sent on it
            token = (self._token or "").encode()
            status, body = await self._exchange(writer, Method.AUTH, token, sent=False)
            if status != Status.OK:
                refused = error_of(status, body, "AUTH")  # refused, or BUSY: the port's limit
                self._drop(LinkDown(f"conductor port {self.address}: {refused}", sent=False))
                raise refused
            return writer

    async def _exchange(self, writer, method: int, body: bytes, sent: bool = True) -> tuple[int, bytes]:
        """(status, body) of one frame's reply; LinkDown if the link breaks or the reply is late
        (``sent``: what LinkDown says of a call that broke after it went out)."""
        request_id = next(self._ids) & 0xFFFFFFFF
        future = asyncio.get_running_loop().create_future()
        self._pending[request_id] = future
        try:
            writer.write(pack_header(method, request_id, len(body)) + body)
            await writer.drain()
        except (OSError, ssl.SSLError, RuntimeError) as exc:
            self._pending.pop(request_id, None)
            self._drop(LinkDown(f"conductor port {self.address}: {exc!r}", sent=True))
            raise LinkDown(f"conductor port {self.address}: {exc!r}", sent=sent) from None
        try:
            return await asyncio.wait_for(future, self._timeout)
        except asyncio.TimeoutError:
            self._drop(LinkDown(f"conductor port {self.address} did not answer in {self._timeout:g} s", sent=True))
            raise LinkDown(f"conductor port {self.address} did not answer in {self._timeout:g} s", sent=sent) from None
        except LinkDown as exc:
            raise LinkDown(str(exc), sent=sent and exc.sent) from None
        finally:
            self._pending.pop(request_id, None)

    async def _read_replies(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        reason = LinkDown(f"conductor port {self.address} closed the connection", sent=True)
        try:
            while True:
                status, request_id, body_len = unpack_header(await reader.readexactly(HEADER_SIZE))
                body = await reader.readexactly(body_len)
                future = self._pending.get(request_id)
                if future is not None and not future.done():
                    future.set_result((status, body))
                elif status != Status.OK:  # BUSY, or BAD_FRAME of a frame it could not read: why it closes
                    # BUSY comes before any frame is read: nothing sent was acted on
                    reason = LinkDown(f"conductor port {self.address}: {error_of(status, body)}", status != Status.BUSY)
        except (asyncio.IncompleteReadError, OSError, ssl.SSLError, ProtocolError) as exc:
            if not isinstance(exc, asyncio.IncompleteReadError):
                reason = LinkDown(f"conductor port {self.address}: {exc!r}", sent=True)
        finally:
            if self._writer is writer:
                self._drop(reason)

    def _drop(self, reason: LinkDown) -> None:
        """Forget the connection; every call waiting on it fails with ``reason``."""
        writer, self._writer = self._writer, None
        task, self._reader_task = self._reader_task, None
        pending, self._pending = self._pending, {}
        for future in pending.values():
            if not future.done():
                future.set_exception(reason)
        if writer is not None:
            writer.close()
        if task is not None and task is not asyncio.current_task():
            task.cancel()
