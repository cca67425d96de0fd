"""TCP transport, client side: the sockets of ``aps.Worker`` and ``aps.AsyncWorker``.

:class:`BlockingConnection` (for ``aps.Worker``) and :class:`AsyncConnection`
(for ``aps.AsyncWorker``) only move bytes: both feed the same
:class:`~aps.wire.framing.FrameReader` and the same request code in
``aps.client.worker``; :func:`control_request` is one request on a connection of its
own (``aps status``, ``aps checkpoint``). The server side is ``aps.server.tcp``.
"""

from __future__ import annotations

import asyncio
import errno
import socket
import ssl
from collections.abc import Callable, Sequence

from ..errors import APSConnectionError, APSError, APSTimeoutError, AuthenticationError
from ..wire.framing import FrameReader
from ..wire.net import client_context, connect_failure, parse_address, set_keepalive, set_nodelay
from .sockets import (
    IOV_MAX,
    BlockingSocket,
    ClientSocket,
    advance,
    client_token,
    exchange,
    find_client_token,
    handshake,
    newer_token,
)

__all__ = ["AsyncConnection", "BlockingConnection", "NoServerYet", "control_request"]

#: What a connect to a server that is not (yet) listening fails with: refused (the host is
#: up, nothing listens on the port), unreachable (its network or its address not up yet),
#: reset or aborted (a listener that went away in the handshake).
_NOT_YET = frozenset({errno.ECONNREFUSED, errno.ENETUNREACH, errno.EHOSTUNREACH, errno.ECONNRESET, errno.ECONNABORTED})


class NoServerYet(APSConnectionError):
    """Nothing listens at the address yet (the connect was refused or unreachable).

    A worker's first connection waits for the server on this, up to its
    ``connect_timeout``: a worker started before its server (torchrun, a job
    scheduler) is the normal case, not an error."""


def _cannot_connect(address: str, exc: OSError) -> APSConnectionError:
    kind = NoServerYet if exc.errno in _NOT_YET else APSConnectionError
    # (asyncio's sock_connect puts "Connect call failed (...)" where the reason goes: say the reason)
    return kind(f"cannot connect to {address}: {connect_failure(parse_address(address).host, exc)}")


class BlockingConnection(BlockingSocket):
    """A blocking TCP socket to the server, driving a FrameReader.

    Raises APSConnectionError when the server cannot be reached or the
    connection drops, and APSTimeoutError when a wait runs out.
    """

    def __init__(
        self,
        host: str,
        port: int,
        connect_timeout: float | None = 30.0,
        keepalive: float | None = None,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        address = f"{'tls' if tls else 'tcp'}://{host}:{port}"
        try:
            sock = socket.create_connection((host, port), timeout=connect_timeout)
        except TimeoutError:
            raise APSTimeoutError(f"connecting to {address} timed out") from None
        except OSError as exc:
            raise _cannot_connect(address, exc) from None
        set_nodelay(sock)
        set_keepalive(sock, keepalive)
        if tls is not None:
            try:
                sock = tls.wrap_socket(sock, server_hostname=host)
            except (ssl.SSLError, OSError) as exc:
                sock.close()
                raise _tls_failure(address, exc) from None
        self._tls = tls is not None
        super().__init__(sock, address)

    def send(self, buffers: Sequence, fds: Sequence[int] = ()) -> None:
        if not self._tls:
            return super().send(buffers, fds)
        try:  # TLS sockets have no vectored write: one record per buffer
            for buffer in buffers:
                self.sock.sendall(buffer)
        except TimeoutError:
            raise APSTimeoutError("sending to the server timed out") from None
        except OSError as exc:
            raise self._lost(exc) from None


class AsyncConnection(ClientSocket):
    """A non-blocking TCP socket driven by the running asyncio loop."""

    def __init__(self, sock: socket.socket, address: str) -> None:
        self.sock = sock
        self.address = address

    async def aclose(self) -> None:
        """:meth:`close`, for a connection whose close takes the loop (TLS)."""
        self.close()

    @classmethod
    async def open(
        cls,
        host: str,
        port: int,
        connect_timeout: float | None = 30.0,
        keepalive: float | None = None,
        tls: ssl.SSLContext | None = None,
    ) -> AsyncConnection:
        if tls is not None:
            return await AsyncTlsConnection.open_tls(host, port, connect_timeout, keepalive, tls)
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
        except TimeoutError:
            raise APSTimeoutError(f"connecting to tcp://{host}:{port} timed out") from None
        except OSError as exc:
            raise _cannot_connect(f"tcp://{host}:{port}", exc) from None
        set_nodelay(sock)
        set_keepalive(sock, keepalive)
        return cls(sock, f"tcp://{host}:{port}")

    def send_now(self, data: bytes) -> bytes:
        """Write what the socket takes of ``data`` without waiting; what is left (a pipelined
        push's frame: the rest goes by :meth:`send`)."""
        try:
            sent = self.sock.send(data)
        except (BlockingIOError, InterruptedError):
            return data
        except OSError as exc:
            raise self._lost(exc) from None
        return data[sent:] if sent < len(data) else b""

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
        """See :meth:`aps.client.sockets.BlockingSocket.receive`."""
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        try:
            while not done():
                wait = self._next_wait(deadline, loop.time(), timeout, idle)
                try:
                    nbytes = await asyncio.wait_for(self._recv_into(reader.get_buffer()), wait)
                except TimeoutError:
                    raise self._waited_out(deadline, loop.time(), timeout, idle) from None
                if not nbytes:
                    raise self._closed_by_server()
                reader.buffer_updated(nbytes)
        except APSError:  # ours already (timeouts, a closed connection)
            raise
        except OSError as exc:
            raise self._lost(exc) from None

    async def _recv_into(self, buffer: memoryview) -> int:
        return await asyncio.get_running_loop().sock_recv_into(self.sock, buffer)


class AsyncTlsConnection(AsyncConnection):
    """An asyncio TLS connection (the loop's socket calls cannot do TLS: streams can)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, address: str) -> None:
        super().__init__(writer.get_extra_info("socket"), address)
        self._reader, self._writer = reader, writer

    @classmethod
    async def open_tls(cls, host, port, connect_timeout, keepalive, tls: ssl.SSLContext) -> AsyncTlsConnection:
        address = f"tls://{host}:{port}"
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection(host, port, ssl=tls, server_hostname=host), connect_timeout
            )
        except TimeoutError:
            raise APSTimeoutError(f"connecting to {address} timed out") from None
        except ssl.SSLError as exc:
            raise _tls_failure(address, exc) from None
        except OSError as exc:
            raise _cannot_connect(address, exc) from None
        sock = writer.get_extra_info("socket")
        set_nodelay(sock)
        set_keepalive(sock, keepalive)
        return cls(reader, writer, address)

    def send_now(self, data: bytes) -> bytes:
        self._writer.write(data)  # (buffered by the stream: its drain is the next send's)
        return b""

    async def send(self, buffers: Sequence) -> None:
        try:
            self._writer.writelines([b for b in buffers if len(b)])
            await self._writer.drain()
        except OSError as exc:
            raise self._lost(exc) from None

    async def _recv_into(self, buffer: memoryview) -> int:
        data = await self._reader.read(len(buffer))
        buffer[: len(data)] = data
        return len(data)

    def close(self) -> None:
        self._writer.close()

    async def aclose(self, timeout: float = 1.0) -> None:
        """Close and wait until the TLS transport has let go of its socket (a loop that
        ends first would leave it open); a peer that does not answer the TLS close in
        ``timeout`` seconds is cut off."""
        self._writer.close()
        try:
            await asyncio.wait_for(self._writer.wait_closed(), timeout)
        except (TimeoutError, OSError, ssl.SSLError):
            self._writer.transport.abort()


def _tls_failure(address: str, exc: BaseException) -> APSConnectionError:
    """A failed TLS handshake: a certificate that does not verify is an authentication
    failure (trying again will not help), anything else a lost connection."""
    message = f"the TLS handshake with {address} failed: {exc}"
    if isinstance(exc, ssl.SSLCertVerificationError) or "CERTIFICATE" in str(exc).upper():
        return AuthenticationError(message)
    return APSConnectionError(message)


def control_request(address: str, op: int, token: str | bytes | None = None, timeout: float = 10.0) -> bytes:
    """One request that needs no INIT (STATS, CHECKPOINT) to the server at ``address``
    (``tcp://`` or ``tls://``), on a connection of its own: the handshake, the request,
    its reply's payload. Raises the server's error, or APSConnectionError."""
    parsed = parse_address(address)
    secret, found = find_client_token(client_token(token or None), parsed.host, parsed.port)
    conn = BlockingConnection(parsed.host, parsed.port, timeout, tls=client_context(parsed.scheme == "tls"))
    try:
        try:
            handshake(conn, secret, timeout, found=found)
        except AuthenticationError:
            secret = newer_token(secret, found, parsed.host, parsed.port)
            if secret is None:
                raise
            conn.close()
            conn = BlockingConnection(parsed.host, parsed.port, timeout, tls=client_context(parsed.scheme == "tls"))
            handshake(conn, secret, timeout, found=True)
        _, payload = exchange(conn, op, timeout)
    finally:
        conn.close()
    return payload
