"""TLS under the data plane: an SSLSocket that takes the calls the framing code makes.

The data plane moves bulk bytes with ``sendmsg`` (gather writes),
``recvmsg_into`` (scatter reads) and ``recv_into`` with MSG_WAITALL or
MSG_DONTWAIT; an SSLSocket has none of these. ``TLSSocket`` gives them the
same meaning on top of its record layer (``sendall`` of each large
buffer, small ones gathered into a record's worth first; looped reads;
MSG_DONTWAIT is read as a blocking call, which only turns a client's
brief poll into a wait). Everything else goes to the SSLSocket.
"""

from __future__ import annotations

import socket
import ssl

_WAITALL = socket.MSG_WAITALL
_RECORD = 16384  # the most plaintext one TLS record carries


class TLSSocket:
    """Wraps a connected ``ssl.SSLSocket`` (see the module docstring)."""

    def __init__(self, sock: ssl.SSLSocket):
        self._sock = sock
        self.family = sock.family

    def recv_into(self, view, nbytes: int = 0, flags: int = 0) -> int:
        view = memoryview(view).cast("B")
        nbytes = nbytes or len(view)
        if not flags & _WAITALL:
            return self._sock.recv_into(view, nbytes)
        got = 0
        while got < nbytes:
            n = self._sock.recv_into(view[got:nbytes], nbytes - got)
            if not n:
                break
            got += n
        return got

    def recvmsg_into(self, views, ancbufsize: int = 0, flags: int = 0):
        """Fill each view in turn (MSG_WAITALL semantics); (bytes, [], 0, None) like recvmsg_into."""
        total = 0
        for view in views:
            view = memoryview(view).cast("B")
            got = self.recv_into(view, len(view), _WAITALL)
            total += got
            if got < len(view):
                break
        return total, [], 0, None

    def sendmsg(self, buffers, *_) -> int:
        """Send every buffer (all of them: the count is their total). Buffers smaller than a
        record travel together: they are gathered, topped up with the head of the next one,
        into a record's worth of bytes (of a big buffer at most 16 KiB is copied), so a
        reply's header and item table do not each cost a record, a write and the reader's
        wake-up of their own."""
        total, pending, send = 0, bytearray(), self._sock.sendall
        for buffer in buffers:
            view = memoryview(buffer).cast("B")
            total += len(view)
            if pending or len(view) < _RECORD:
                take = _RECORD - len(pending)
                pending += view[:take]
                if len(pending) < _RECORD:
                    continue
                send(pending)
                pending, view = bytearray(), view[take:]
            if len(view) >= _RECORD:
                send(view)
            elif view:
                pending += view
        if pending:
            send(pending)
        return total

    def sendall(self, data) -> None:
        self._sock.sendall(data)

    def __getattr__(self, name):
        return getattr(self._sock, name)


def wrap_client(sock: socket.socket, context: ssl.SSLContext, host: str) -> TLSSocket:
    """TLS over a connected TCP socket, verifying the node's certificate for ``host``."""
    return TLSSocket(context.wrap_socket(sock, server_hostname=host))


def wrap_server(sock: socket.socket, context: ssl.SSLContext) -> TLSSocket:
    """The node's side of the handshake (in the connection's own thread: it blocks)."""
    return TLSSocket(context.wrap_socket(sock, server_side=True))
