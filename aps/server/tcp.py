"""TCP transport, server side: one worker's connection.

:class:`TcpTransport` is the ``asyncio.BufferedProtocol`` of one connection: the event
loop reads straight into the buffer its connection's frame parser hands out, so a
gradient lands directly in its worker's receive buffer (and is applied while it arrives,
when the engine allows), and a reply goes out as one vectored write of the header and a
view of a snapshot slot, leased until sent. Rows travel in the frames. The client side
is ``aps.client.tcp``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, cast

import numpy as np

from ..errors import PayloadSizeMismatch
from ..wire.net import set_keepalive, set_nodelay
from ..wire.protocol import HEADER_SIZE, DType, Header, InitRequest, pack_header
from ..wire.rows import reply_rows_parts
from .peers import principal
from .requests.base import dtype_name

if TYPE_CHECKING:
    from .engine.members import Member
    from .engine.stats import Traffic
    from .engine.table import Snapshot
    from .transport import Receiver

__all__ = ["TcpTransport"]

#: Replies up to this size written while one read's requests are handled are held back and
#: written together at the end of it (a header, an error; not weights), up to CORK_LIMIT
#: bytes of them (then they go, and the transport's flow control holds the next requests).
CORKED_BYTES = 4096
CORK_LIMIT = 64 << 10

log = logging.getLogger("aps.server")


class TcpTransport(asyncio.BufferedProtocol):
    """One worker's TCP connection to the server (see the module docstring).

    Args:
        traffic: the server's byte counters for TCP.
        heartbeat_timeout: the keepalive's (seconds; 0: the system's).
        connect: makes the connection this transport carries (its receiver), given the transport.
    """

    kind = "tcp"
    compressed = True
    rows_shared = False
    rows_room = None

    def __init__(self, traffic: Traffic, heartbeat_timeout: float, connect: Callable[[TcpTransport], Receiver]) -> None:
        self.transport: asyncio.Transport | None = None
        self.traffic = traffic
        self.peer = "?"
        self.peer_key = "?"
        self.writing = False
        self._heartbeat_timeout = heartbeat_timeout
        self._addresses: tuple = (None, None)  # (peer, local): whom failed AUTHs count against
        self._vectored = type(asyncio.get_event_loop()).__module__.startswith("uvloop")
        self._leases: list[Snapshot] = []
        self._corked: list[bytes] | None = None  # small replies held back while a read is handled
        self._corked_bytes = 0
        self.receiver = connect(self)

    # asyncio callbacks ----------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport = cast(asyncio.Transport, transport)  # (a stream transport: create_server's)
        sock = transport.get_extra_info("socket")
        set_nodelay(sock)
        set_keepalive(sock, self._heartbeat_timeout)
        # A high-water mark of 0 turns pause_writing/resume_writing into an
        # "everything sent" signal: leases on snapshot slots end there.
        transport.set_write_buffer_limits(high=0)
        peer = transport.get_extra_info("peername")
        self.peer = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer)
        self._addresses = (peer, transport.get_extra_info("sockname"))
        self.peer_key = principal(*self._addresses) or self.peer  # (who it is, for room at --max-connections)
        if self.receiver.opened():
            log.debug("%s: connected", self.peer)

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.receiver.get_buffer()

    def buffer_updated(self, nbytes: int) -> None:
        # Replies written while these bytes are handled (several requests of a pipelining
        # worker, answered at once) go out in one write at the end, not a write each.
        self._corked = []
        try:
            self.receiver.bytes_arrived(nbytes)
        finally:
            self._uncork()
            self._corked = None

    def _uncork(self) -> None:
        """Write the small replies held back so far (see buffer_updated)."""
        corked = self._corked
        if corked:
            self._corked, self._corked_bytes = [], 0
            if self.transport is not None and not self.transport.is_closing():
                self.transport.write(corked[0] if len(corked) == 1 else b"".join(corked))

    def eof_received(self) -> bool:
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.receiver.connection_lost(exc)

    def pause_writing(self) -> None:
        self.writing = True

    def resume_writing(self) -> None:
        self.writing = False
        self.receiver.output_drained()

    # Transport ------------------------------------------------------------------
    def close(self) -> None:
        self._uncork()  # (an error frame before the close goes out first)
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()

    def abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()

    def unsent(self) -> int:
        return self._corked_bytes + (self.transport.get_write_buffer_size() if self.transport is not None else 0)

    def can_write(self) -> bool:
        return self.transport is not None and not self.transport.is_closing()

    def write(self, data: bytes | memoryview, fds: Sequence[int] = ()) -> None:
        assert self.transport is not None
        corked = self._corked
        if corked is not None and len(data) <= CORKED_BYTES and self._corked_bytes + len(data) <= CORK_LIMIT:
            corked.append(bytes(data))
            self._corked_bytes += len(data)
            return
        self._uncork()
        self.transport.write(data)

    def write_parts(self, parts: tuple, fds: Sequence[int] = ()) -> None:
        assert self.transport is not None
        self._uncork()
        if self._vectored:
            self.transport.writelines(parts)
        else:
            for part in parts:
                self.transport.write(part)

    def pause_reading(self) -> None:
        assert self.transport is not None
        self.transport.pause_reading()

    def resume_reading(self) -> None:
        assert self.transport is not None
        self.transport.resume_reading()

    def auth_key(self) -> str | None:
        return principal(*self._addresses)

    def gradient_destination(self, member: Member, header: Header, rows: bool = False) -> memoryview:
        dest = member.receive_gradient(header.dtype)
        if header.length < len(dest) if rows else header.length != len(dest):
            raise PayloadSizeMismatch(
                f"gradient of {header.length} bytes; the registered model has {len(dest)} bytes"
                + (f" as {dtype_name(header.dtype)}" if header.dtype != DType.FLOAT32 else "")
                + (" and rows after them" if rows else "")
            )
        return dest

    def gradient_buffer(self, request: InitRequest) -> None:
        return None

    def check_rows_frame(self, header: Header, rows_at: int) -> None:
        pass  # (the rows are in the frame, whatever their length)

    def rows_payload(self, payload: memoryview) -> memoryview:
        return payload

    def reply_rows(self, read: list[np.ndarray]) -> tuple[tuple, tuple[int, ...]]:
        return tuple(reply_rows_parts(read)), ()

    def send_weights(
        self,
        op: int,
        rid: int,
        snap: Snapshot,
        clock: int,
        flags: int,
        live: int,
        rows: tuple = (),
        fds: Sequence[int] = (),
        narrowed: np.ndarray | None = None,
        dtype: int = DType.FLOAT32,
    ) -> None:
        transport = self.transport
        assert transport is not None
        self._uncork()
        data = snap.bytes
        if narrowed is not None:
            data = narrowed.data.cast("B")  # its own copy: no lease
            snap.release()
        else:
            dtype = DType.FLOAT32
        extra = sum(len(part) for part in rows)
        header = pack_header(op, flags, dtype, rid, clock, snap.version, len(data) + extra, live)
        self.traffic.bytes_out += HEADER_SIZE + len(data) + extra
        if self._vectored:
            transport.writelines((header, data, *rows))
        else:
            for part in (header, data, *rows):
                transport.write(part)
        if narrowed is not None:
            return
        # The transport may still hold a view of the slot: lease it until sent.
        if transport.get_write_buffer_size() == 0:
            snap.release()
        else:
            self._leases.append(snap)

    def frame_arrived(self, header: Header) -> None:
        pass

    def reply_left(self) -> None:
        self.release_leases()

    def release_leases(self) -> None:
        leases, self._leases = self._leases, []
        for snap in leases:
            snap.release()
