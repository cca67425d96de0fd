"""TCP transport: the server's sessions and the clients' socket drivers.

Server side, :class:`TcpSession` is an ``asyncio.BufferedProtocol`` over the
transport-independent :class:`~aps.transport.session.ServerSession`: the
event loop reads straight into the buffer the frame parser hands out, so a
gradient lands directly in its worker's receive buffer (and is applied while
it arrives, when the engine allows), and a reply goes out as one vectored
write of the header and a view of a snapshot slot, leased until sent.

Client side, :class:`BlockingConnection` (for ``aps.Worker``) and
:class:`AsyncConnection` (for ``aps.AsyncWorker``) only move bytes: both feed
the same :class:`~aps.transport.framing.FrameReader` and the same request
code in ``aps.worker``.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from ..errors import APSConnectionError, APSTimeoutError, MalformedFrame, PayloadSizeMismatch, error_from_code
from ..protocol import HEADER_SIZE, DType, Header, Op, decode_error, pack_header
from .framing import FrameReader
from .session import ServerSession

if TYPE_CHECKING:
    from .._engine import Engine, Member
    from ..table import Snapshot

__all__ = ["AsyncConnection", "BlockingConnection", "TcpSession", "exchange"]

log = logging.getLogger("aps.server")

_IOV_MAX = 1024
# Gradients at least this large are applied while they arrive, when the
# engine allows it (Engine.begin_streaming_push).
_STREAM_MIN_BYTES = 1 << 20


def _set_nodelay(sock: socket.socket | None) -> None:
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class TcpSession(ServerSession, asyncio.BufferedProtocol):
    """One worker's TCP connection to the server (see the module docstring)."""

    kind = "tcp"

    def __init__(self, engine: Engine, max_payload: int, registry: set, unix_path: str = "") -> None:
        super().__init__(engine, max_payload, registry, unix_path)
        self.transport: asyncio.Transport | None = None
        self._vectored = type(self._loop).__module__.startswith("uvloop")
        self._leases: list[Snapshot] = []

    # asyncio callbacks ----------------------------------------------------
    def connection_made(self, transport: asyncio.Transport) -> None:
        self.transport = transport
        _set_nodelay(transport.get_extra_info("socket"))
        # A high-water mark of 0 turns pause_writing/resume_writing into an
        # "everything sent" signal: leases on snapshot slots end there.
        transport.set_write_buffer_limits(high=0)
        peer = transport.get_extra_info("peername")
        self.peer = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer)
        self.registry.add(self)
        log.debug("%s: connected", self.peer)

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.reader.get_buffer(sizehint)

    def buffer_updated(self, nbytes: int) -> None:
        self._bytes_arrived(nbytes)

    def eof_received(self) -> bool:
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self._connection_lost(exc)

    def pause_writing(self) -> None:
        self._writing = True

    def resume_writing(self) -> None:
        self._output_drained()

    # ServerSession transport interface ----------------------------------------------
    def close(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()

    def _can_write(self) -> bool:
        return self.transport is not None and not self.transport.is_closing()

    def _write(self, data: bytes) -> None:
        self.transport.write(data)

    def _pause_reading(self) -> None:
        self.transport.pause_reading()

    def _resume_reading(self) -> None:
        self.transport.resume_reading()

    def _gradient_destination(self, member: Member, header: Header) -> memoryview:
        if header.length != member.grad.nbytes:
            raise PayloadSizeMismatch(
                f"gradient of {header.length} bytes; the registered model has {member.grad.nbytes} bytes"
            )
        if header.length >= _STREAM_MIN_BYTES:
            self._stream = self.engine.begin_streaming_push(member, header.version)
        return member.grad_bytes

    def _send_weights(self, op: int, snap: Snapshot, clock: int, flags: int) -> None:
        transport, data = self.transport, snap.bytes
        header = pack_header(op, flags, DType.FLOAT32, self._rid, clock, snap.version, len(data))
        self._stats.bytes_out += HEADER_SIZE + len(data)
        if self._vectored:
            transport.writelines((header, data))
        else:
            transport.write(header)
            transport.write(data)
        # The transport may still hold a view of the slot: lease it until sent.
        if transport.get_write_buffer_size() == 0:
            snap.release()
        else:
            self._leases.append(snap)

    def _release_leases(self) -> None:
        leases, self._leases = self._leases, []
        for snap in leases:
            snap.release()


# Client drivers -------------------------------------------------------------


def _advance(views: list[memoryview], sent: int) -> list[memoryview]:
    index = 0
    while sent and index < len(views):
        size = len(views[index])
        if sent >= size:
            sent -= size
            index += 1
        else:
            views[index] = views[index][sent:]
            sent = 0
    return views[index:]


class _ClientSocket:
    """What both client drivers share: the socket, its errors, closing."""

    sock: socket.socket
    address: str

    def _lost(self, exc: OSError) -> APSConnectionError:
        return APSConnectionError(f"lost the connection to {self.address}: {exc.strerror or exc}")

    def _closed_by_server(self) -> APSConnectionError:
        return APSConnectionError(f"the server at {self.address} closed the connection")

    def _no_reply(self, timeout: float | None) -> APSTimeoutError:
        return APSTimeoutError(f"no reply from {self.address} within {timeout} s")

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


class BlockingConnection(_ClientSocket):
    """A blocking TCP socket to the server, driving a FrameReader.

    Raises APSConnectionError when the server cannot be reached or the
    connection drops, and APSTimeoutError when a wait runs out.
    """

    def __init__(self, host: str, port: int, connect_timeout: float | None = 30.0) -> None:
        try:
            self.sock = socket.create_connection((host, port), timeout=connect_timeout)
        except TimeoutError:
            raise APSTimeoutError(f"connecting to tcp://{host}:{port} timed out") from None
        except OSError as exc:
            raise APSConnectionError(f"cannot connect to tcp://{host}:{port}: {exc.strerror or exc}") from None
        _set_nodelay(self.sock)
        self.sock.settimeout(None)
        self._timeout: float | None = None
        self.address = f"tcp://{host}:{port}"

    def send(self, buffers: Sequence, fds: Sequence[int] = ()) -> None:
        """Send every buffer (bytes or byte views), in order, with vectored writes (no joining)."""
        if fds:
            raise ValueError("TCP cannot carry file descriptors")
        sock = self.sock
        try:
            if len(buffers) <= _IOV_MAX:
                sent = sock.sendmsg(buffers)
                total = sum(map(len, buffers))
                if sent == total:
                    return
                views = _advance([memoryview(b).cast("B") for b in buffers], sent)
            else:
                views = [memoryview(b).cast("B") for b in buffers if len(b)]
            while views:
                views = _advance(views, sock.sendmsg(views[:_IOV_MAX]))
        except TimeoutError:
            raise APSTimeoutError("sending to the server timed out") from None
        except OSError as exc:
            raise self._lost(exc) from None

    def receive(self, reader: FrameReader, done: Callable[[], bool], timeout: float | None = None) -> None:
        """Read into ``reader`` until ``done()``."""
        sock = self.sock
        if timeout != self._timeout:  # settimeout costs system calls: only on change
            sock.settimeout(timeout)
            self._timeout = timeout
        try:
            while not done():
                nbytes = sock.recv_into(reader.get_buffer())
                if not nbytes:
                    raise self._closed_by_server()
                reader.buffer_updated(nbytes)
        except TimeoutError:
            raise self._no_reply(timeout) from None
        except OSError as exc:
            raise self._lost(exc) from None


class AsyncConnection(_ClientSocket):
    """A non-blocking TCP socket driven by the running asyncio loop."""

    def __init__(self, sock: socket.socket, address: str) -> None:
        self.sock = sock
        self.address = address

    @classmethod
    async def open(cls, host: str, port: int, connect_timeout: float | None = 30.0) -> AsyncConnection:
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
        _set_nodelay(sock)
        return cls(sock, f"tcp://{host}:{port}")

    async def send(self, buffers: Sequence) -> None:
        loop = asyncio.get_running_loop()
        views = [memoryview(b).cast("B") for b in buffers if len(b)]
        try:
            # Try one vectored write first; the loop finishes what the socket
            # buffer could not take.
            try:
                views = _advance(views, self.sock.sendmsg(views[:_IOV_MAX]))
            except (BlockingIOError, InterruptedError):
                pass
            for view in views:
                await loop.sock_sendall(self.sock, view)
        except OSError as exc:
            raise self._lost(exc) from None

    async def receive(self, reader: FrameReader, done: Callable[[], bool], timeout: float | None = None) -> None:
        loop = asyncio.get_running_loop()

        async def read() -> None:
            while not done():
                nbytes = await loop.sock_recv_into(self.sock, reader.get_buffer())
                if not nbytes:
                    raise self._closed_by_server()
                reader.buffer_updated(nbytes)

        try:
            await asyncio.wait_for(read(), timeout)
        except asyncio.TimeoutError:
            raise self._no_reply(timeout) from None
        except OSError as exc:
            raise self._lost(exc) from None


class _OneReply:
    """FrameHandler collecting a single small reply."""

    _LIMIT = 64 << 20

    def __init__(self) -> None:
        self.header: Header | None = None
        self.payload = b""

    def frame_buffer(self, header: Header) -> memoryview:
        if header.length > self._LIMIT:
            raise MalformedFrame(f"reply of {header.length} bytes to a control request")
        return memoryview(bytearray(header.length))

    def frame_received(self, header: Header, payload: memoryview) -> None:
        self.header, self.payload = header, bytes(payload)


def exchange(conn, op: int, timeout: float | None) -> tuple[Header, bytes]:
    """Send one payload-less request on ``conn`` and return its reply; raises the
    server's error if the reply is an error frame."""
    reply = _OneReply()
    conn.send([pack_header(op, request_id=1)])
    conn.receive(FrameReader(reply), lambda: reply.header is not None, timeout)
    if reply.header.op == Op.ERROR:
        raise error_from_code(*decode_error(reply.payload))
    if reply.header.op != op | Op.REPLY:
        raise MalformedFrame(f"reply op {reply.header.op} to request op {op}")
    return reply.header, reply.payload
