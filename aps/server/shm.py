"""Shared-memory transport, server side: the Unix listener and a co-located worker's transport.

Control frames (the same protocol as TCP) travel over a Unix socket; the
gradients and weights never do (see ``segments``). The optimizer's state
(STATE, LOAD_STATE: rare, a checkpoint's worth) crosses it as bytes, as over TCP.

- Each worker creates its gradient segment and sends it with its INIT. It
  computes gradients straight into it; a PUSH is a bare header, and the
  server's update kernel reads the gradient in place (each element exactly
  once, so a worker still writing cannot sneak a bad value past the check).
- The server keeps its snapshot slots in segments. A weights reply names a
  slot (with its descriptor, the first time this worker sees it); the worker
  copies the weights out (one copy), or reads them where they lie (a worker with
  ``zero_copy``: its weights are read-only views into the slot). The slot stays
  leased to the worker until the next weights reply replaces it, or until it
  leaves or its connection ends: whatever the worker does meanwhile (a push, a
  heartbeat, a refused request) it reads exactly one version.
- Rows of embedding tables (Flag.ROWS) do not cross the socket either: a
  request's lie in the worker's rows segment (the worker may write there again
  at any time: the server copies the ids it checks, and its update kernels read
  each gradient value once, refusing one that is not finite, as they do the
  dense gradient); a reply's are gathered straight into this
  connection's reply segment, which the worker copies them out of before its
  next request (the segment is written only to answer one). The frames carry a
  rows reference (aps.wire.rows), with a segment's descriptor when it is new.

asyncio transports cannot pass descriptors, so the transports drive their
sockets with ``loop.add_reader`` and ``recvmsg_into``/``sendmsg``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import socket
import stat
import sys
import tempfile
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from ..errors import AuthenticationError, ConfigurationError, FrameTooLarge, MalformedFrame, ServerError
from ..wire.protocol import HEADER_SIZE, DType, Flag, Header, InitRequest, Op, encode_slot, pack_header
from ..wire.rows import ROWS_REF_BYTES, decode_rows_ref, encode_rows_ref, padded
from ..wire.segments import ANCILLARY_SPACE, Room, default_socket_path, fds_from, map_received, scm_rights
from .admission import RateLimitedLog

if TYPE_CHECKING:
    from .engine.members import Member
    from .engine.stats import Traffic
    from .engine.table import Snapshot
    from .transport import Receiver

__all__ = ["ShmTransport", "UnixListener", "listen_unix"]

log = logging.getLogger("aps.server")

_MAX_HELD_FDS = 4  # descriptors waiting for an INIT to claim them
#: After a failed accept (out of descriptors), the listener rests this long.
ACCEPT_RETRY_S = 0.5
_accept_failures = RateLimitedLog()
_SHM = int(Flag.SHM)
_LEAVE = int(Op.LEAVE)


class UnixListener:
    """The server's Unix socket for co-located workers: owner-only, removed on close.

    A socket file left behind by a server that was killed is replaced (a live
    one is not); with ``sweep``, stale ones beside it in the server's private
    directory are removed too (servers on port 0 get a new name every time).
    """

    def __init__(self, path: str, on_connection: Callable[[socket.socket], object], *, sweep: bool = False) -> None:
        self.path = path
        self._on_connection = on_connection
        directory = os.path.dirname(path)
        os.makedirs(directory, mode=0o700, exist_ok=True)
        info, link = os.stat(directory), os.lstat(directory)  # (a link another user made to a dir of ours: refused)
        if info.st_uid != os.getuid() or link.st_uid != os.getuid() or stat.S_IMODE(info.st_mode) & 0o077:
            raise ConfigurationError(f"{directory} must belong to this user and be private (mode 0700)")
        if sweep:
            _sweep_stale_sockets(directory, keep=path)
        if os.path.exists(path):
            if not stat.S_ISSOCK(os.stat(path).st_mode):
                raise ConfigurationError(f"{path} exists and is not a socket")
            if _live(path):
                raise ConfigurationError(f"another server listens on {path}")
            os.unlink(path)  # left over by a server that died
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old_umask = os.umask(0o177)  # created owner-only, not made so after the fact
        try:
            self.sock.bind(path)
        finally:
            os.umask(old_umask)
        os.chmod(path, 0o600)
        self.sock.listen(128)
        self.sock.setblocking(False)
        self._loop = asyncio.get_running_loop()
        self._paused: asyncio.TimerHandle | None = None
        #: A private directory made for the socket, removed on close (see :func:`listen_unix`).
        self.owned_directory: str | None = None
        self._loop.add_reader(self.sock.fileno(), self._accept)

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                # Out of descriptors (or memory): the pending connection stays pending and
                # the socket stays readable, so retrying at once would spin. Pause instead.
                _accept_failures.warning(
                    self._loop.time(),
                    "%s: accepting a connection failed (%s): pausing the listener for %.1f s",
                    self.path,
                    exc,
                    ACCEPT_RETRY_S,
                )
                self._loop.remove_reader(self.sock.fileno())
                self._paused = self._loop.call_later(ACCEPT_RETRY_S, self._resume)
                return
            conn.setblocking(False)
            self._on_connection(conn)

    def _resume(self) -> None:
        self._paused = None
        if self.sock.fileno() >= 0:
            self._loop.add_reader(self.sock.fileno(), self._accept)

    def close(self) -> None:
        if self._paused is not None:
            self._paused.cancel()
        self._loop.remove_reader(self.sock.fileno())
        self.sock.close()
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        if self.owned_directory is not None:
            shutil.rmtree(self.owned_directory, ignore_errors=True)
            self.owned_directory = None


def listen_unix(where: str, port: int, on_connection: Callable[[socket.socket], object]) -> UnixListener | None:
    """The Unix socket co-located workers reach the server by (shared memory), ``where``
    ``--unix-socket`` says: at a path (or a ConfigurationError saying why not); with ``auto``,
    in this user's private directory (:func:`~aps.wire.segments.default_socket_path`), else,
    when that cannot be used (another local user made it first, say), in a fresh private
    directory beside it (removed when the listener closes); else none, with a warning:
    co-located workers then use TCP."""
    if where != "auto":
        try:
            return UnixListener(where, on_connection)
        except (OSError, ConfigurationError) as exc:
            raise ConfigurationError(f"cannot listen on {where}: {exc}") from None
    path = default_socket_path(port)
    try:
        return UnixListener(path, on_connection, sweep=True)
    except (OSError, ConfigurationError) as exc:
        refused = exc
    base = os.path.dirname(os.path.dirname(path))
    directory = None
    try:
        directory = tempfile.mkdtemp(prefix=f"aps-{os.getuid()}-", dir=base)  # (made private, 0700, ours)
        listener = UnixListener(os.path.join(directory, f"{port}.sock"), on_connection)
    except (OSError, ConfigurationError) as exc:
        if directory is not None:
            shutil.rmtree(directory, ignore_errors=True)
        log.warning(
            "cannot use %s (%s), nor a new private directory in %s (%s): no shared memory; workers on this "
            "host use TCP",
            path,
            refused,
            base,
            exc,
        )
        return None
    log.warning(
        "cannot use %s (%s): the Unix socket for shared memory is %s instead (workers learn it when they connect)",
        path,
        refused,
        listener.path,
    )
    listener.owned_directory = directory
    return listener


def _sweep_stale_sockets(directory: str, keep: str) -> None:
    """Remove the socket files in ``directory`` that no server listens on."""
    try:
        names = os.listdir(directory)
    except OSError:
        return
    for name in names:
        path = os.path.join(directory, name)
        try:
            if not name.endswith(".sock") or path == keep or not stat.S_ISSOCK(os.lstat(path).st_mode):
                continue
            if not _live(path):
                os.unlink(path)
                log.info("removed %s, left behind by a server that is gone", path)
        except OSError:
            continue


def _live(path: str) -> bool:
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
        return True
    except OSError:
        return False
    finally:
        probe.close()


class ShmTransport:
    """One co-located worker: control frames on a Unix socket, arrays in shared memory.

    Args:
        sock: the accepted socket (non-blocking).
        traffic: the server's byte counters for shared memory.
        max_payload: the frame limit (a request's rows are no longer, nor a reply segment).
        table_slots: the ids of the snapshot slots the weights table has now.
        connect: makes the connection this transport carries (its receiver), given the transport.
    """

    kind = "shm"
    compressed = False
    rows_shared = True  # (Tables.intake copies the ids, reads the gradient rows in place)

    def __init__(
        self,
        sock: socket.socket,
        traffic: Traffic,
        max_payload: int,
        table_slots: Callable[[], set],
        connect: Callable[[ShmTransport], Receiver],
    ) -> None:
        self.sock = sock
        self.traffic = traffic
        self.peer = f"unix:{sock.fileno()}"
        self.peer_key = "?"
        try:
            creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12)
            self.peer = f"pid {int.from_bytes(creds[:4], sys.byteorder)}"
            self.peer_key = f"uid {int.from_bytes(creds[4:8], sys.byteorder)}"  # failed AUTHs count by user
        except (OSError, AttributeError):
            pass
        self._loop = asyncio.get_event_loop()
        self._table_slots = table_slots
        self._fds: deque[int] = deque()  # descriptors received and not yet claimed
        self._out: deque[tuple[memoryview, tuple[int, ...]]] = deque()  # frames the socket could not take yet
        self._sent_slots: set[int] = set()  # slots this worker has mapped
        self._lease: Snapshot | None = None  # the slot of the last weights this worker was sent
        self._max_payload = max_payload
        self._rows_in: np.ndarray | None = None  # the worker's rows segment (uint8, read-only)
        # Replies' rows. It never shrinks: a worker may keep the descriptor of every segment it
        # was sent, so a server that made smaller ones again and again could be made to hold
        # them all; as it is, the segments a connection was sent add up to at most twice the
        # frame limit (each at most the limit, or its reply: replies are no longer).
        self._reply_room = Room("aps-rows-reply", shared_read_only=True, shrink=False, limit=max_payload)
        self._reply_fresh = False  # the reply segment is new: its descriptor goes with the next rows
        self._reading = True
        self._closed = False
        self.writing = False  # the socket holds frames it could not take yet
        self.receiver = connect(self)
        if not self.receiver.opened():
            return
        self._loop.add_reader(sock.fileno(), self._readable)
        log.debug("%s: connected (shared memory)", self.peer)

    # Socket events ---------------------------------------------------------------
    def _readable(self) -> None:
        try:
            nbytes, ancdata, msg_flags, _ = self.sock.recvmsg_into([self.receiver.get_buffer()], ANCILLARY_SPACE)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self._teardown(exc)
            return
        self._fds.extend(fds_from(ancdata))
        if self._fds and not self.receiver.authenticated:  # nothing is kept for a stranger
            while self._fds:
                os.close(self._fds.popleft())
            self.receiver.fatal(AuthenticationError("descriptors sent before the handshake"), warn=False)
            return
        if msg_flags & socket.MSG_CTRUNC or len(self._fds) > _MAX_HELD_FDS:
            self.receiver.fatal(
                MalformedFrame(
                    "too many file descriptors: a request carries one at most (INIT "
                    "its gradient segment, a request with rows a new rows segment)"
                )
            )
            return
        if not nbytes:
            self._teardown(None)
            return
        self.receiver.bytes_arrived(nbytes)

    def _writable(self) -> None:
        self._flush()
        if not self._out and self.can_write():
            self._loop.remove_writer(self.sock.fileno())
            self.writing = False
            self.receiver.output_drained()

    def _flush(self) -> None:
        """Send what is queued, each frame's descriptors with its first byte."""
        try:
            while self._out:
                data, fds = self._out[0]
                sent = self.sock.sendmsg([data], scm_rights(fds))
                if sent < len(data):
                    self._out[0] = (data[sent:], ())
                    return
                self._out.popleft()
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self._out.clear()
            self._loop.call_soon(self._teardown, exc)

    def _teardown(self, exc: Exception | None) -> None:
        if self.sock.fileno() >= 0:
            self._loop.remove_reader(self.sock.fileno())
            self._loop.remove_writer(self.sock.fileno())
            self.sock.close()
        self._closed = True
        self._out.clear()
        while self._fds:
            os.close(self._fds.popleft())
        self._rows_in = None
        self._reply_room.close()
        self.receiver.connection_lost(exc)

    # Transport ------------------------------------------------------------------
    def close(self) -> None:
        self._flush()  # what the socket can still take (a last error frame)
        self._teardown(None)

    def abort(self) -> None:
        self._teardown(None)

    def unsent(self) -> int:
        return sum(len(data) for data, _ in self._out)

    def can_write(self) -> bool:
        return not self._closed and self.sock.fileno() >= 0

    def write(self, data: bytes | memoryview, fds: Sequence[int] = ()) -> None:
        waiting = bool(self._out)
        self._out.append((memoryview(data), tuple(fds)))
        if not waiting:
            self._flush()
            if self._out and self.can_write():  # the socket is full: finish when it has room
                self.writing = True
                self._loop.add_writer(self.sock.fileno(), self._writable)

    def write_parts(self, parts: tuple, fds: Sequence[int] = ()) -> None:
        if sum(len(part) for part in parts) <= 1 << 16:  # (one message: the worker wakes once)
            self.write(b"".join(parts), fds)
            return
        for i, part in enumerate(parts):
            self.write(part, fds if i == 0 else ())

    def pause_reading(self) -> None:
        if self._reading:
            self._reading = False
            self._loop.remove_reader(self.sock.fileno())

    def resume_reading(self) -> None:
        if not self._reading and self.can_write():
            self._reading = True
            self._loop.add_reader(self.sock.fileno(), self._readable)

    def auth_key(self) -> str | None:
        return self.peer_key

    def gradient_destination(self, member: Member, header: Header, rows: bool = False) -> None:
        if not header.flags & _SHM or (header.length and not rows):
            raise MalformedFrame("over shared memory a push carries no payload but its rows: set the SHM flag")
        assert member.grad is not None
        self.traffic.bytes_in += member.grad.nbytes  # read in place from the worker's segment
        return None

    def gradient_buffer(self, request: InitRequest) -> np.ndarray:
        if not self._fds:
            raise MalformedFrame("INIT over shared memory needs the gradient segment's descriptor")
        return map_received(self._claim_fd(), request.layout.nbytes, writable=False)

    def _claim_fd(self) -> int:
        """The descriptor of the request being handled: the last one received (it came with
        the request's first byte; any before it were left by requests refused unclaimed, and
        are closed)."""
        fd = self._fds.pop()
        while self._fds:
            os.close(self._fds.popleft())
        return fd

    def frame_arrived(self, header: Header) -> None:
        if header.op == _LEAVE:  # (any other request may come while the worker reads its weights)
            self.release_leases()

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
        segment = snap.segment
        slots = self._table_slots()
        dropped = [sid for sid in self._sent_slots if sid not in slots]
        self._sent_slots.difference_update(dropped)
        fresh = segment.id not in self._sent_slots
        payload = encode_slot(segment.id, segment.nbytes, fresh, dropped) + b"".join(rows)  # (rows: a reference)
        frame = pack_header(op, flags | _SHM, DType.FLOAT32, rid, clock, snap.version, len(payload), live) + payload
        # The frame crosses the socket; the weights are copied out of the slot.
        self.traffic.bytes_out += HEADER_SIZE + len(payload) + segment.nbytes
        # The slot stays leased to this worker until the next weights reply (or its leave):
        # its descriptor stays valid while this frame waits to leave.
        self.write(frame, ([segment.read_only_fd()] if fresh else []) + list(fds))
        self._sent_slots.add(segment.id)
        if self._lease is not snap:
            self.release_leases()
        self._lease = snap

    def reply_left(self) -> None:
        pass  # (the worker still copies out of the slot until its next request)

    def release_leases(self) -> None:
        lease, self._lease = self._lease, None
        if lease is not None:
            lease.release()

    # Rows -----------------------------------------------------------------------------
    def check_rows_frame(self, header: Header, rows_at: int) -> None:
        if header.length - rows_at != ROWS_REF_BYTES:
            raise MalformedFrame(
                f"over shared memory a request's rows are in its rows segment: the frame carries "
                f"a {ROWS_REF_BYTES}-byte rows reference, not {header.length - rows_at} bytes"
            )

    def rows_payload(self, payload: memoryview) -> np.ndarray:
        """The request's rows, in the worker's rows segment (mapped when its descriptor
        comes); the worker may write there again at any time (see Tables.intake)."""
        length, size, has_fd = decode_rows_ref(payload)
        if has_fd:
            if not self._fds:
                raise MalformedFrame("a rows reference announced a segment whose descriptor did not come")
            fd = self._claim_fd()
            self._rows_in = None
            if size % 8:
                os.close(fd)
                raise MalformedFrame(f"a rows segment of {size} bytes: its size is a multiple of 8")
            mapped = min(size, self._max_payload - self._max_payload % 8)  # (no request's rows are longer)
            try:
                self._rows_in = map_received(fd, mapped, writable=False).view(np.uint8)
            except ServerError:  # (not sealed, or smaller than it says)
                raise
            except (OSError, ValueError) as exc:
                raise MalformedFrame(f"the rows segment cannot be mapped: {exc}") from None
        if length > self._max_payload:
            raise FrameTooLarge(f"{length} bytes of rows; at most {self._max_payload} (--max-frame-bytes)")
        rows_in = self._rows_in
        if rows_in is None or length > len(rows_in):
            raise MalformedFrame(
                f"{length} bytes of rows in a segment of {'none' if rows_in is None else len(rows_in)} mapped bytes"
            )
        self.traffic.bytes_in += length
        return rows_in[:length]

    def rows_room(self, nbytes: int) -> np.ndarray:
        """Room for a reply's rows, at the start of the reply segment (made or made again)."""
        into, fresh = self._reply_room.take(nbytes)
        self._reply_fresh |= fresh
        return into

    def reply_rows(self, read: list[np.ndarray]) -> tuple[tuple, tuple[int, ...]]:
        """A reference to the rows ``read``, which the engine gathered into the reply
        segment (or are copied there now, if it could not)."""
        total = sum(padded(rows.nbytes) for rows in read)
        segment = self._reply_room.segment
        if total and not _laid_out(read, segment):
            into, at = self.rows_room(total), 0
            for rows in read:
                into[at : at + rows.nbytes] = rows.reshape(-1).view(np.uint8)
                at += padded(rows.nbytes)
            segment = self._reply_room.segment
        fresh, self._reply_fresh = self._reply_fresh, False
        self.traffic.bytes_out += total
        size = segment.nbytes if segment is not None else 0
        return (encode_rows_ref(total, size, fresh),), ((segment.read_only_fd(),) if fresh and segment else ())


def _laid_out(read: list[np.ndarray], segment) -> bool:
    """Whether the arrays ``read`` lie one after the other (8-aligned) from the start of
    ``segment``, as a reply's rows do there."""
    if segment is None:
        return False
    start = at = _address(segment.array)
    for rows in read:
        if _address(rows) != at or not rows.flags.c_contiguous:
            return False
        at += padded(rows.nbytes)
    return at - start <= segment.nbytes


def _address(array: np.ndarray) -> int:
    return array.__array_interface__["data"][0]
