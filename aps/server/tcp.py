"""TCP transport, server side: one worker's connection.

:class:`TcpSession` is an ``asyncio.BufferedProtocol`` over the
transport-independent :class:`~aps.server.session.ServerSession`: the
event loop reads straight into the buffer the frame parser hands out, so a
gradient lands directly in its worker's receive buffer (and is applied while
it arrives, when the engine allows), and a reply goes out as one vectored
write of the header and a view of a snapshot slot, leased until sent. The
client side is ``tcp_client``.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

import numpy as np

from ..errors import PayloadSizeMismatch
from ..wire.protocol import HEADER_SIZE, DType, Header, pack_header
from ..wire.net import set_keepalive, set_nodelay
from .peers import principal
from .session import ServerSession, dtype_name

if TYPE_CHECKING:
    from .engine import Engine
    from .engine.members import Member
    from .engine.table import Snapshot

__all__ = ["TcpSession"]

log = logging.getLogger("aps.server")

class TcpSession(ServerSession, asyncio.BufferedProtocol):
    """One worker's TCP connection to the server (see the module docstring)."""

    kind = "tcp"
    compressed = True

    def __init__(
        self, engine: Engine, max_payload: int, registry: set, unix_path: str = "", token: bytes | None = None
    ) -> None:
        super().__init__(engine, max_payload, registry, unix_path, token)
        self.transport: asyncio.Transport | None = None
        self._addresses: tuple = (None, None)  # (peer, local): whom failed AUTHs count against
        self._vectored = type(self._loop).__module__.startswith("uvloop")
        self._leases: list[Snapshot] = []
        # Gradients at least this large are applied while they arrive, when the
        # engine allows it (Engine.begin_streaming_push).
        self._stream_min = engine.config.stream_min_bytes or None

    # asyncio callbacks ----------------------------------------------------
    def connection_made(self, transport: asyncio.Transport) -> None:
        self.transport = transport
        sock = transport.get_extra_info("socket")
        set_nodelay(sock)
        set_keepalive(sock, self.engine.config.heartbeat_timeout)
        # A high-water mark of 0 turns pause_writing/resume_writing into an
        # "everything sent" signal: leases on snapshot slots end there.
        transport.set_write_buffer_limits(high=0)
        peer = transport.get_extra_info("peername")
        self.peer = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer)
        self._addresses = (peer, transport.get_extra_info("sockname"))
        self.peer_key = principal(*self._addresses) or self.peer  # (who it is, for room at --max-connections)
        if not self._admit():
            return
        self.registry.add(self)
        log.debug("%s: connected", self.peer)

    def _find_auth_key(self) -> str | None:
        return principal(*self._addresses)

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

    def abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()

    def _unsent(self) -> int:
        return self.transport.get_write_buffer_size() if self.transport is not None else 0

    def _can_write(self) -> bool:
        return self.transport is not None and not self.transport.is_closing()

    def _write(self, data: bytes) -> None:
        self.transport.write(data)

    def _write_parts(self, parts: tuple, fds: tuple = ()) -> None:
        if self._vectored:
            self.transport.writelines(parts)
        else:
            for part in parts:
                self.transport.write(part)

    def _pause_reading(self) -> None:
        self.transport.pause_reading()

    def _resume_reading(self) -> None:
        self.transport.resume_reading()

    def _gradient_destination(self, member: Member, header: Header, rows: bool = False) -> memoryview:
        dest = member.receive_gradient(header.dtype)
        if header.length < len(dest) if rows else header.length != len(dest):
            raise PayloadSizeMismatch(
                f"gradient of {header.length} bytes; the registered model has {len(dest)} bytes"
                + (f" as {dtype_name(header.dtype)}" if header.dtype != DType.FLOAT32 else "")
                + (" and rows after them" if rows else "")
            )
        if not rows and self._stream_min is not None and header.length >= self._stream_min:
            self._stream = self.engine.begin_streaming_push(member, header.version, header.request_id, header.clock)
        return dest

    def _send_weights(self, op: int, snap: Snapshot, clock: int, flags: int, rows: tuple = (),
                      fds: tuple = (), narrowed: np.ndarray | None = None) -> None:
        transport, data, dtype = self.transport, snap.bytes, DType.FLOAT32
        if narrowed is not None:
            dtype = self._weights_dtype
            data = memoryview(narrowed).cast("B")  # its own copy: no lease
            snap.release()
        extra = sum(len(part) for part in rows)
        header = pack_header(op, flags, dtype, self._rid, clock, snap.version, len(data) + extra,
                             self.engine.policy.num_live)
        self._traffic.bytes_out += HEADER_SIZE + len(data) + extra
        if self._vectored:
            transport.writelines((header, data, *rows))
        else:
            for part in (header, data, *rows):
                transport.write(part)
        # The transport may still hold a view of the slot: lease it until sent.
        if transport.get_write_buffer_size() == 0:
            snap.release()
        else:
            self._leases.append(snap)

    def _reply_left(self) -> None:
        self._release_leases()

    def _release_leases(self) -> None:
        leases, self._leases = self._leases, []
        for snap in leases:
            snap.release()
