"""Shared-memory transport for workers on the server's host.

Control frames (the same protocol as TCP) travel over a Unix socket; the
arrays never do. Memory is anonymous (``memfd_create``) and passed as file
descriptors over the socket (``SCM_RIGHTS``), so it has no name to leak: the
kernel frees a segment when the last process holding it closes it or dies.

- Each worker creates its gradient segment and sends it with its INIT. It
  computes gradients straight into it; a PUSH is a bare header, and the
  server's update kernel reads the gradient in place (each element exactly
  once, so a worker still writing cannot sneak a bad value past the check).
- The server keeps its snapshot slots in segments. A weights reply names a
  slot (with its descriptor, the first time this worker sees it); the worker
  copies the weights out: one copy. The slot stays leased to the worker until
  its next request, so the copy always reads exactly one version.
"""

from __future__ import annotations

import array
import asyncio
import itertools
import logging
import mmap
import os
import socket
import stat
import sys
import tempfile
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from ..errors import APSConnectionError, APSTimeoutError, ConfigurationError, MalformedFrame, PayloadSizeMismatch
from ..protocol import HEADER_SIZE, DType, Flag, Header, InitRequest, encode_slot, pack_header
from .session import ServerSession
from .tcp import _IOV_MAX, _advance, _ClientSocket

if TYPE_CHECKING:
    from .._engine import Engine, Member
    from ..table import Snapshot

__all__ = [
    "Segment",
    "ShmConnection",
    "ShmSession",
    "UnixListener",
    "default_socket_path",
    "shm_available",
]

log = logging.getLogger("aps.server")

_MAX_FDS = 16  # descriptors accepted with one message
_MAX_HELD_FDS = 4  # descriptors waiting for an INIT to claim them
_ANCILLARY = socket.CMSG_SPACE(_MAX_FDS * array.array("i").itemsize) if hasattr(socket, "CMSG_SPACE") else 0
_SHM = int(Flag.SHM)
_segment_ids = itertools.count(1)


def shm_available() -> bool:
    """True where the shared-memory transport works (Linux: memfd and Unix sockets)."""
    return hasattr(os, "memfd_create") and hasattr(socket, "AF_UNIX") and hasattr(socket, "SCM_RIGHTS")


def default_socket_path(port: int) -> str:
    """Where a server on TCP ``port`` puts its Unix socket unless told otherwise."""
    base = os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()
    return os.path.join(base, f"aps-{os.getuid()}", f"{port}.sock")


class Segment:
    """A float32 vector in anonymous shared memory (a memfd), with its descriptor.

    Attributes:
        id: unique within this process, for naming slots in replies.
        fd: the memfd (closed with :meth:`close`; the mapping lives on until
            every view of ``array`` is gone).
        array: the flat float32 view of the mapping.
    """

    __slots__ = ("id", "fd", "array", "nbytes")

    def __init__(self, fd: int, array: np.ndarray) -> None:
        self.id = next(_segment_ids)
        self.fd = fd
        self.array = array
        self.nbytes = array.nbytes

    @classmethod
    def create(cls, numel: int, name: str) -> Segment:
        fd = os.memfd_create(name, os.MFD_CLOEXEC)
        try:
            nbytes = 4 * numel
            os.ftruncate(fd, nbytes)
            return cls(fd, _map(fd, nbytes, writable=True))
        except BaseException:
            os.close(fd)
            raise

    def close(self) -> None:
        fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)


def _map(fd: int, nbytes: int, *, writable: bool) -> np.ndarray:
    if nbytes == 0:
        return np.zeros(0, np.float32)
    prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
    mapping = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=prot)
    return np.frombuffer(mapping, np.float32)


def map_received(fd: int, nbytes: int, *, writable: bool) -> np.ndarray:
    """Map a segment that came over the socket; checks its size; closes ``fd``."""
    try:
        size = os.fstat(fd).st_size
        if size < nbytes:
            raise PayloadSizeMismatch(f"shared segment of {size} bytes; {nbytes} needed")
        return _map(fd, nbytes, writable=writable)
    finally:
        os.close(fd)


def _fds_from(ancdata) -> list[int]:
    fds: list[int] = []
    for level, kind, data in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            received = array.array("i")
            received.frombytes(data[: len(data) - len(data) % received.itemsize])
            fds.extend(received)
    return fds


def _rights(fds: Sequence[int]):
    return [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []


# Server side -------------------------------------------------------------------------


class UnixListener:
    """The server's Unix socket for co-located workers: owner-only, removed on close."""

    def __init__(self, path: str, on_connection: Callable[[socket.socket], None]) -> None:
        self.path = path
        self._on_connection = on_connection
        directory = os.path.dirname(path)
        os.makedirs(directory, mode=0o700, exist_ok=True)
        info = os.stat(directory)
        if info.st_uid != os.getuid() or stat.S_IMODE(info.st_mode) & 0o077:
            raise ConfigurationError(f"{directory} must belong to this user and be private (mode 0700)")
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
        self._loop.add_reader(self.sock.fileno(), self._accept)

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                log.warning("unix socket accept failed: %s", exc)
                return
            conn.setblocking(False)
            self._on_connection(conn)

    def close(self) -> None:
        self._loop.remove_reader(self.sock.fileno())
        self.sock.close()
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


def _live(path: str) -> bool:
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
        return True
    except OSError:
        return False
    finally:
        probe.close()


class ShmSession(ServerSession):
    """One co-located worker: control frames on a Unix socket, arrays in shared memory."""

    kind = "shm"

    def __init__(self, engine: Engine, max_payload: int, registry: set, sock: socket.socket) -> None:
        super().__init__(engine, max_payload, registry)
        self.sock = sock
        self.peer = f"unix:{sock.fileno()}"
        try:
            creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12)
            self.peer = f"pid {int.from_bytes(creds[:4], sys.byteorder)}"
        except (OSError, AttributeError):
            pass
        self._fds: deque[int] = deque()  # descriptors received and not yet claimed
        self._out: deque[tuple[memoryview, tuple[int, ...]]] = deque()  # frames the socket could not take yet
        self._sent_slots: set[int] = set()  # slots this worker has mapped
        self._lease: Snapshot | None = None  # the slot the worker is copying from
        self._reading = True
        registry.add(self)
        self._loop.add_reader(sock.fileno(), self._readable)
        log.debug("%s: connected (shared memory)", self.peer)

    # Socket events ---------------------------------------------------------------
    def _readable(self) -> None:
        try:
            nbytes, ancdata, msg_flags, _ = self.sock.recvmsg_into([self.reader.get_buffer()], _ANCILLARY)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self._teardown(exc)
            return
        self._fds.extend(_fds_from(ancdata))
        if msg_flags & socket.MSG_CTRUNC or len(self._fds) > _MAX_HELD_FDS:
            self._fatal(MalformedFrame("too many file descriptors: only INIT carries one"))
            return
        if not nbytes:
            self._teardown(None)
            return
        self._bytes_arrived(nbytes)

    def _writable(self) -> None:
        self._flush()
        if not self._out and self._can_write():
            self._loop.remove_writer(self.sock.fileno())
            self._output_drained()

    def _flush(self) -> None:
        """Send what is queued, each frame's descriptors with its first byte."""
        try:
            while self._out:
                data, fds = self._out[0]
                sent = self.sock.sendmsg([data], _rights(fds))
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
        self._out.clear()
        while self._fds:
            os.close(self._fds.popleft())
        self._connection_lost(exc)

    # ServerSession transport interface ------------------------------------------------
    def close(self) -> None:
        self._teardown(None)

    def _can_write(self) -> bool:
        return not self._lost and self.sock.fileno() >= 0

    def _write(self, data: bytes, fds: Sequence[int] = ()) -> None:
        waiting = bool(self._out)
        self._out.append((memoryview(data), tuple(fds)))
        if not waiting:
            self._flush()
            if self._out and self._can_write():  # the socket is full: finish when it has room
                self._writing = True
                self._loop.add_writer(self.sock.fileno(), self._writable)

    def _pause_reading(self) -> None:
        if self._reading:
            self._reading = False
            self._loop.remove_reader(self.sock.fileno())

    def _resume_reading(self) -> None:
        if not self._reading and self._can_write():
            self._reading = True
            self._loop.add_reader(self.sock.fileno(), self._readable)

    def _gradient_destination(self, member: Member, header: Header) -> None:
        if not header.flags & _SHM or header.length:
            raise MalformedFrame("over shared memory a push carries no payload: set the SHM flag")
        return None

    def _gradient_buffer(self, request: InitRequest) -> np.ndarray:
        if not self._fds:
            raise MalformedFrame("INIT over shared memory needs the gradient segment's descriptor")
        fd = self._fds.popleft()
        while self._fds:  # anything else that came along is not ours to keep
            os.close(self._fds.popleft())
        return map_received(fd, request.layout.nbytes, writable=False)

    def frame_received(self, header: Header, payload: memoryview) -> None:
        # Any new request means the worker has finished copying the last weights.
        self._release_leases()
        super().frame_received(header, payload)

    def _send_weights(self, op: int, snap: Snapshot, clock: int, flags: int) -> None:
        segment = snap.segment
        live = self.engine.table.slot_ids()
        dropped = [sid for sid in self._sent_slots if sid not in live]
        self._sent_slots.difference_update(dropped)
        fresh = segment.id not in self._sent_slots
        payload = encode_slot(segment.id, segment.nbytes, fresh, dropped)
        frame = pack_header(op, flags | _SHM, DType.FLOAT32, self._rid, clock, snap.version, len(payload)) + payload
        self._stats.bytes_out += HEADER_SIZE + len(payload)
        # The slot stays leased to this worker until its next request, which is
        # read only once this frame has left: its descriptor stays valid meanwhile.
        self._write(frame, [segment.fd] if fresh else ())
        self._sent_slots.add(segment.id)
        self._lease = snap

    def _release_leases(self) -> None:
        lease, self._lease = self._lease, None
        if lease is not None:
            lease.release()


# Client side -----------------------------------------------------------------------------


class ShmConnection(_ClientSocket):
    """A worker's Unix socket to a co-located server, with its shared segments.

    Keeps the worker's gradient segment and the server's slots it has mapped.
    """

    def __init__(self, path: str, connect_timeout: float | None = 30.0) -> None:
        self.address = f"unix:{path}"
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self.sock.settimeout(connect_timeout)
            self.sock.connect(path)
        except TimeoutError:
            self.sock.close()
            raise APSTimeoutError(f"connecting to {self.address} timed out") from None
        except OSError as exc:
            self.sock.close()
            raise APSConnectionError(f"cannot connect to {self.address}: {exc.strerror or exc}") from None
        self.sock.settimeout(None)
        self._timeout: float | None = None
        self._fds: deque[int] = deque()
        self.slots: dict[int, np.ndarray] = {}
        self.grad_segment: Segment | None = None

    def gradient_buffer(self, numel: int, rank: int) -> np.ndarray:
        """The worker's gradient vector, in a new shared segment (created once)."""
        if self.grad_segment is None or self.grad_segment.array.size != numel:
            self.grad_segment = Segment.create(numel, f"aps-grad-rank{rank}")
        return self.grad_segment.array

    def adopt(self, previous: ShmConnection) -> None:
        """Keep the gradient segment and mapped slots of a connection being replaced."""
        self.grad_segment, previous.grad_segment = previous.grad_segment, None

    def slot(self, slot_id: int, nbytes: int, has_fd: bool, dropped: Sequence[int]) -> np.ndarray:
        """The server's slot ``slot_id``, mapping it if its descriptor came with this reply."""
        for sid in dropped:
            self.slots.pop(sid, None)
        if has_fd:
            if not self._fds:
                raise MalformedFrame("a weights reply announced a slot descriptor that did not come")
            self.slots[slot_id] = map_received(self._fds.popleft(), nbytes, writable=False)
        try:
            return self.slots[slot_id]
        except KeyError:
            raise MalformedFrame(f"weights in slot {slot_id}, which this worker has not mapped") from None

    def send(self, buffers: Sequence, fds: Sequence[int] = ()) -> None:
        views = [memoryview(b).cast("B") for b in buffers if len(b)]
        sock = self.sock
        try:
            sent = sock.sendmsg(views[:_IOV_MAX], _rights(fds))
            views = _advance(views, sent)
            while views:
                views = _advance(views, sock.sendmsg(views[:_IOV_MAX]))
        except TimeoutError:
            raise APSTimeoutError("sending to the server timed out") from None
        except OSError as exc:
            raise self._lost(exc) from None

    def receive(self, reader, done: Callable[[], bool], timeout: float | None = None) -> None:
        sock = self.sock
        if timeout != self._timeout:
            sock.settimeout(timeout)
            self._timeout = timeout
        try:
            while not done():
                nbytes, ancdata, msg_flags, _ = sock.recvmsg_into([reader.get_buffer()], _ANCILLARY)
                self._fds.extend(_fds_from(ancdata))
                if not nbytes:
                    raise self._closed_by_server()
                reader.buffer_updated(nbytes)
        except TimeoutError:
            raise self._no_reply(timeout) from None
        except OSError as exc:
            raise self._lost(exc) from None

    def close(self) -> None:
        super().close()
        while self._fds:
            os.close(self._fds.popleft())
        self.slots.clear()
