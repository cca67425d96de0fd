"""TCP transport: the server's connection protocol and the clients' socket drivers.

Server side, :class:`ServerConnection` is an ``asyncio.BufferedProtocol``:
the event loop reads straight into the buffer the frame parser hands out, so
a gradient lands directly in its worker's receive buffer, and a reply goes out
as one vectored write of the header and a view of a snapshot slot. Each
connection handles one request at a time, in order (a worker never has two in
flight); bytes a peer sends early wait in the parser's staging buffer, and
reading pauses if that fills.

Client side, :class:`BlockingConnection` (for ``aps.Worker``) and
:class:`AsyncConnection` (for ``aps.AsyncWorker``) only move bytes: both feed
the same :class:`~aps.transport.framing.FrameReader` and the same request
code in ``aps.worker``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from ..errors import (
    APSConnectionError,
    APSTimeoutError,
    DTypeMismatch,
    InternalServerError,
    MalformedFrame,
    NotInitialized,
    OutOfOrder,
    PayloadSizeMismatch,
    ServerError,
    ShuttingDown,
    UnknownOp,
)
from ..protocol import (
    HEADER_SIZE,
    REQUEST_OPS,
    DType,
    Flag,
    Header,
    Op,
    decode_init,
    encode_error,
    is_known_op,
    pack_header,
)
from .framing import FrameReader

if TYPE_CHECKING:
    from .._engine import Engine, Member, PushResult, StreamingPush
    from ..table import Snapshot

__all__ = ["AsyncConnection", "BlockingConnection", "ServerConnection"]

log = logging.getLogger("aps.server")

_IOV_MAX = 1024
_INIT_HEAD_BYTES = 16
# Gradients at least this large are applied while they arrive, when the
# engine allows it (Engine.begin_streaming_push).
_STREAM_MIN_BYTES = 1 << 20
_GRADIENT_OPS = frozenset({Op.PUSH, Op.PUSH_PULL})
_FLOAT32 = int(DType.FLOAT32)


def _set_nodelay(sock: socket.socket | None) -> None:
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class ServerConnection(asyncio.BufferedProtocol):
    """One worker's TCP connection to the server (see the module docstring).

    Args:
        engine: the server's engine.
        max_payload: the frame limit.
        registry: the server's set of open connections (this adds and removes itself).
    """

    def __init__(self, engine: Engine, max_payload: int, registry: set[ServerConnection]) -> None:
        self.engine = engine
        self._stats = engine.stats
        self.registry = registry
        self.reader = FrameReader(self, max_payload=max_payload)
        self.transport: asyncio.Transport | None = None
        self.member: Member | None = None
        self.peer = "?"
        self._loop = asyncio.get_event_loop()
        self._vectored = type(self._loop).__module__.startswith("uvloop")
        self._leases: list[Snapshot] = []
        self._pending_error: ServerError | None = None
        self._dispatching = False
        self._reading_paused = False
        self._writing = False  # the transport still holds unsent output
        self._deferred = False  # a request finished while writing: resume after the drain
        self._fatal_sent = False
        self._lost = False
        self.last_heard = self._loop.time()
        # A large gradient's update, computed while it arrives when the engine allows it.
        self._stream: StreamingPush | None = None
        # The request being handled (a connection handles one at a time).
        self._rid = 0
        self._dropped = False
        self._handlers = {
            Op.PING: self._on_ping,
            Op.INIT: self._on_init,
            Op.PULL: self._on_pull,
            Op.PUSH: self._on_push,
            Op.PUSH_PULL: self._on_push_pull,
            Op.LEAVE: self._on_leave,
            Op.STATS: self._on_stats,
        }

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
        self.last_heard = self._loop.time()
        self._stats.bytes_in += nbytes
        try:
            self.reader.buffer_updated(nbytes)
        except ServerError as exc:
            self._fatal(exc)
            return
        except Exception as exc:
            log.exception("%s: internal error while reading", self._who())
            self._fatal(InternalServerError(f"internal error: {exc}"))
            return
        self._maybe_pause_reading()

    def eof_received(self) -> bool:
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        if self.reader.in_frame and not self._fatal_sent:
            log.warning("%s: connection lost in the middle of a frame; the partial frame is discarded", self._who())
        elif exc is not None:
            log.info("%s: connection lost: %s", self._who(), exc)
        else:
            log.debug("%s: disconnected", self._who())
        if self._stream is not None:
            self._stream.abort()
            self._stream = None
        if self.member is not None:
            self.engine.leave(self.member)
            self.member = None
        self._lost = True
        self._release_leases()
        self.registry.discard(self)

    def pause_writing(self) -> None:
        self._writing = True

    def resume_writing(self) -> None:
        # Everything written so far has left: leases end, and a request that
        # finished meanwhile lets the next frame in.
        self._writing = False
        self._release_leases()
        if self._deferred:
            self._deferred = False
            self._loop.call_soon(self._resume)

    def close(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()

    def shut_down(self) -> None:
        """The server is stopping: say so, then close."""
        if self.transport is not None and not self.transport.is_closing():
            self._reply_error(0, ShuttingDown("the server is shutting down"))
            self.close()

    def check_heartbeat(self, now: float, timeout: float) -> None:
        """Close the connection if the peer has been silent for ``timeout`` seconds
        while none of its requests is pending (a request waiting at the gate counts
        as alive: the wait is the server's)."""
        if self.reader.held or self._lost or now - self.last_heard <= timeout:
            return
        log.warning("%s: nothing heard for %.0f s (missed heartbeats): closing", self._who(), now - self.last_heard)
        self.close()

    # FrameHandler ---------------------------------------------------------
    def frame_buffer(self, header: Header) -> memoryview | None:
        op, length = header.op, header.length
        error: ServerError | None = None
        dest: memoryview | None = None
        if op not in REQUEST_OPS:
            kind = "a reply" if is_known_op(op) else "unknown"
            error = UnknownOp(f"op code {op} is {kind}, not a request")
        elif op in _GRADIENT_OPS:
            member = self.member
            if member is None or member.grad is None:
                error = NotInitialized(f"{Op(op).name} before a successful INIT")
            elif header.dtype != _FLOAT32:
                error = DTypeMismatch(f"gradient dtype is {_dtype_name(header.dtype)}; the model is float32")
            elif length != member.grad.nbytes:
                error = PayloadSizeMismatch(
                    f"gradient of {length} bytes; the registered model has {member.grad.nbytes} bytes"
                )
            else:
                dest = member.grad_bytes
                if length >= _STREAM_MIN_BYTES:
                    self._stream = self.engine.begin_streaming_push(member, header.version)
        elif op == Op.INIT:
            if self.member is not None:
                error = OutOfOrder(f"this connection already joined as rank {self.member.rank}")
            elif header.dtype != DType.FLOAT32:
                error = DTypeMismatch(f"initial weights dtype is {_dtype_name(header.dtype)}; models are float32")
            elif length < _INIT_HEAD_BYTES:
                error = MalformedFrame(f"INIT payload of {length} bytes is too short")
            else:
                dest = memoryview(np.empty(length, np.uint8))
        elif length:
            error = MalformedFrame(f"{Op(op).name} carries no payload, got {length} bytes")
        self._pending_error = error
        return dest

    def payload_progress(self, filled: int) -> None:
        stream = self._stream
        if stream is not None:
            stream.feed(filled >> 2)  # whole floats only; the update checks each one

    def frame_received(self, header: Header, payload: memoryview) -> None:
        stream, self._stream = self._stream, None
        error = self._pending_error
        if error is not None:
            self._pending_error = None
            self._reply_error(header.request_id, error)
            return
        # One request at a time: later frames wait in the reader until _done().
        self.reader.hold()
        self._rid = header.request_id
        self._dispatching = True
        try:
            self._handlers[header.op](header, payload, stream)
        except ServerError as exc:
            if stream is not None:
                stream.abort()
            self._fail(exc)
        except Exception as exc:
            log.exception("%s: internal error handling %s", self._who(), Op(header.op).name)
            self._fail(InternalServerError(f"internal error: {exc}"))
        finally:
            self._dispatching = False

    # Requests (the current one's id is self._rid) ------------------------------
    def _on_ping(self, header: Header, payload: memoryview, stream) -> None:
        self._reply(Op.PING_REPLY, version=self.engine.version)

    def _on_init(self, header: Header, payload: memoryview, stream) -> None:
        request = decode_init(payload)
        values = np.frombuffer(payload, np.float32, count=request.layout.numel, offset=request.values_offset)
        member = self.engine.join(
            request.rank, request.num_workers, request.layout, values, self._send_init_reply, self._init_failed
        )
        if member.connected:  # not refused while joining
            self.member = member
            log.debug("%s: INIT as rank %d", self.peer, member.rank)

    def _on_pull(self, header: Header, payload: memoryview, stream) -> None:
        self.engine.pull(self._require_member(), self._send_pull_reply)

    def _on_push(self, header: Header, payload: memoryview, stream) -> None:
        self.engine.push(
            self._require_member(), header.version, self._send_push_reply, self._fail, stream=stream
        )

    def _on_push_pull(self, header: Header, payload: memoryview, stream) -> None:
        self.engine.push(
            self._require_member(), header.version, self._pushed_then_pull, self._fail, stream=stream
        )

    def _on_leave(self, header: Header, payload: memoryview, stream) -> None:
        member = self._require_member()
        self.member = None
        self.engine.leave(member)
        self._reply(Op.LEAVE_REPLY)

    def _on_stats(self, header: Header, payload: memoryview, stream) -> None:
        snapshot = self.engine.stats_snapshot()
        self._reply(Op.STATS_REPLY, version=self.engine.version, payload=json.dumps(snapshot).encode())

    def _require_member(self) -> Member:
        if self.member is None:
            raise NotInitialized("request before a successful INIT")
        return self.member

    # Replies: each one ends the current request -----------------------------------
    def _pushed_then_pull(self, result: PushResult) -> None:
        if self.member is None:  # the connection went away while the push was in the lane
            self._done()
            return
        self._dropped = result.dropped
        self.engine.pull(self.member, self._send_push_pull_reply)

    def _send_push_reply(self, result: PushResult) -> None:
        flags = Flag.DROPPED if result.dropped else 0
        self._reply(Op.PUSH_REPLY, clock=result.clock, version=result.version, flags=flags)

    def _send_init_reply(self, snap: Snapshot, clock: int) -> None:
        self._reply_weights(Op.INIT_REPLY, snap, clock, 0)

    def _send_pull_reply(self, snap: Snapshot, clock: int) -> None:
        self._reply_weights(Op.PULL_REPLY, snap, clock, 0)

    def _send_push_pull_reply(self, snap: Snapshot, clock: int) -> None:
        self._reply_weights(Op.PUSH_PULL_REPLY, snap, clock, Flag.DROPPED if self._dropped else 0)

    def _init_failed(self, exc: ServerError) -> None:
        self.member = None
        self._fail(exc)

    def _fail(self, exc: ServerError) -> None:
        self._reply_error(self._rid, exc)
        self._done()

    def _reply(self, op: int, *, clock: int = 0, version: int = 0, flags: int = 0, payload: bytes = b"") -> None:
        transport = self.transport
        if transport is not None and not transport.is_closing():
            frame = pack_header(op, flags, 0, self._rid, clock, version, len(payload)) + payload
            self._stats.bytes_out += len(frame)
            transport.write(frame)
        self._done()

    def _reply_weights(self, op: int, snap: Snapshot, clock: int, flags: int) -> None:
        transport = self.transport
        if transport is None or transport.is_closing():
            snap.release()
            self._done()
            return
        data = snap.bytes
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
        self._done()

    def _reply_error(self, rid: int, exc: ServerError) -> None:
        """Send an error frame (does not end the request: callers decide)."""
        log.warning("%s: %s: %s", self._who(), exc.code.name, exc.message)
        transport = self.transport
        if transport is not None and not transport.is_closing():
            payload = encode_error(exc.code, exc.message)
            self._stats.bytes_out += HEADER_SIZE + len(payload)
            transport.write(pack_header(Op.ERROR, 0, 0, rid, 0, 0, len(payload)) + payload)

    def _fatal(self, exc: ServerError) -> None:
        """Framing is lost: say why, then close this connection (only this one)."""
        if self._fatal_sent:
            return
        self._fatal_sent = True
        self._reply_error(0, exc)
        self.reader.hold()
        self.close()

    def _done(self) -> None:
        """The current request is answered: go on with the next frame.

        Not before the reply has left, though: a client that sends requests
        without reading replies would otherwise pin a snapshot slot per reply.
        """
        if self._writing:
            self._deferred = True
        elif self._dispatching:
            self.reader.release(parse=False)
        else:
            self._loop.call_soon(self._resume)

    def _resume(self) -> None:
        if self._lost or self.transport is None or self.transport.is_closing() or not self.reader.held:
            return
        try:
            self.reader.release()
        except ServerError as exc:
            self._fatal(exc)
            return
        if self._reading_paused and not self.reader.staging_full():
            self._reading_paused = False
            self.transport.resume_reading()
        self._maybe_pause_reading()

    def _maybe_pause_reading(self) -> None:
        if not self._reading_paused and self.reader.held and self.reader.staging_full():
            self._reading_paused = True
            self.transport.pause_reading()

    def _release_leases(self) -> None:
        leases, self._leases = self._leases, []
        for snap in leases:
            snap.release()

    def _who(self, member: Member | None = None) -> str:
        member = member or self.member
        return f"{self.peer} (rank {member.rank})" if member is not None else self.peer


def _dtype_name(code: int) -> str:
    try:
        return DType(code).name.lower()
    except ValueError:
        return f"unknown dtype code {code}"


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

    def send(self, buffers: Sequence) -> None:
        """Send every buffer (bytes or byte views), in order, with vectored writes (no joining)."""
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
