"""TCP transport, client side: the sockets of ``aps.Worker`` and ``aps.AsyncWorker``.

:class:`BlockingConnection` (for ``aps.Worker``) and :class:`AsyncConnection`
(for ``aps.AsyncWorker``) only move bytes: both feed the same
:class:`~aps.transport.framing.FrameReader` and the same request code in
``aps.worker``. The server side is ``tcp_server``.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable, Sequence

from ..errors import APSConnectionError, APSError, APSTimeoutError
from ._client import IOV_MAX, BlockingSocket, ClientSocket, advance
from ._sockets import set_keepalive, set_nodelay
from .framing import FrameReader

__all__ = ["AsyncConnection", "BlockingConnection"]


class BlockingConnection(BlockingSocket):
    """A blocking TCP socket to the server, driving a FrameReader.

    Raises APSConnectionError when the server cannot be reached or the
    connection drops, and APSTimeoutError when a wait runs out.
    """

    def __init__(
        self, host: str, port: int, connect_timeout: float | None = 30.0, keepalive: float | None = None
    ) -> None:
        try:
            sock = socket.create_connection((host, port), timeout=connect_timeout)
        except TimeoutError:
            raise APSTimeoutError(f"connecting to tcp://{host}:{port} timed out") from None
        except OSError as exc:
            raise APSConnectionError(f"cannot connect to tcp://{host}:{port}: {exc.strerror or exc}") from None
        set_nodelay(sock)
        set_keepalive(sock, keepalive)
        super().__init__(sock, f"tcp://{host}:{port}")


class AsyncConnection(ClientSocket):
    """A non-blocking TCP socket driven by the running asyncio loop."""

    def __init__(self, sock: socket.socket, address: str) -> None:
        self.sock = sock
        self.address = address

    @classmethod
    async def open(
        cls, host: str, port: int, connect_timeout: float | None = 30.0, keepalive: float | None = None
    ) -> AsyncConnection:
        loop = asyncio.get_running_loop()
        try:
            infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
            family, kind, proto, _, sockaddr = infos[0]
            sock = socket.socket(family, kind, proto)
            sock.setblocking(False)
            try:
                await asyncio.wait_for(loop.sock_connect(sock, sockaddr), connect_timeout)
            except BaseException:
                sock.close()
                raise
        except asyncio.TimeoutError:
            raise APSTimeoutError(f"connecting to tcp://{host}:{port} timed out") from None
        except OSError as exc:
            raise APSConnectionError(f"cannot connect to tcp://{host}:{port}: {exc.strerror or exc}") from None
        set_nodelay(sock)
        set_keepalive(sock, keepalive)
        return cls(sock, f"tcp://{host}:{port}")

    async def send(self, buffers: Sequence) -> None:
        loop = asyncio.get_running_loop()
        views = [memoryview(b).cast("B") for b in buffers if len(b)]
        try:
            # Try one vectored write first; the loop finishes what the socket
            # buffer could not take.
            try:
                views = advance(views, self.sock.sendmsg(views[:IOV_MAX]))
            except (BlockingIOError, InterruptedError):
                pass
            for view in views:
                await loop.sock_sendall(self.sock, view)
        except OSError as exc:
            raise self._lost(exc) from None

    async def receive(
        self, reader: FrameReader, done: Callable[[], bool], timeout: float | None = None, idle: float | None = None
    ) -> None:
        """See :meth:`aps.transport._client.BlockingSocket.receive`."""
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        try:
            while not done():
                wait = idle
                if deadline is not None:
                    remaining = deadline - loop.time()
                    if remaining <= 0:
                        raise self._no_reply(timeout)
                    wait = remaining if wait is None else min(wait, remaining)
                try:
                    nbytes = await asyncio.wait_for(loop.sock_recv_into(self.sock, reader.get_buffer()), wait)
                except TimeoutError:
                    if deadline is not None and loop.time() >= deadline:
                        raise self._no_reply(timeout) from None
                    raise self._silent(idle) from None
                if not nbytes:
                    raise self._closed_by_server()
                reader.buffer_updated(nbytes)
        except APSError:  # ours already (timeouts, a closed connection)
            raise
        except OSError as exc:
            raise self._lost(exc) from None
