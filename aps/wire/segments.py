"""Shared memory both ends use: anonymous segments and descriptors passed over Unix sockets.

Memory is anonymous (``memfd_create``) and passed as file descriptors over
the socket (``SCM_RIGHTS``), so it has no name to leak: the kernel frees a
segment when the last process holding it closes it or dies. The server keeps
its snapshot slots in segments; each worker keeps its gradient buffer in one
(see ``shm_server`` and ``shm_client``).

Every segment is sealed against shrinking and growing (and against further
seals) as soon as it has its size, so a peer holding it cannot truncate it
under a reader (which would kill the reader with SIGBUS); a received
descriptor is refused unless it carries those seals and the size promised.
Slots go to workers through a read-only descriptor: mapping one writable
fails. (A process of the same user can always reach another's memory, with
ptrace or /proc; the seals and read-only descriptors stop accidents and
buggy peers, not that user.)
"""

from __future__ import annotations

import array
import fcntl
import itertools
import mmap
import os
import socket
import tempfile
from collections.abc import Sequence

import numpy as np

from ..errors import MalformedFrame, PayloadSizeMismatch

__all__ = [
    "ANCILLARY_SPACE",
    "Room",
    "SEALS",
    "Segment",
    "check_sealed",
    "default_socket_path",
    "fds_from",
    "map_received",
    "scm_rights",
    "shm_available",
]

MAX_FDS = 16  # descriptors accepted with one message
#: Room for the ancillary data of one message (``recvmsg``'s ``ancbufsize``).
ANCILLARY_SPACE = socket.CMSG_SPACE(MAX_FDS * array.array("i").itemsize) if hasattr(socket, "CMSG_SPACE") else 0
_segment_ids = itertools.count(1)
#: The seals every segment carries: no shrinking, no growing, no further seals.
SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL if hasattr(fcntl, "F_SEAL_SHRINK") else 0


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

    __slots__ = ("id", "fd", "array", "nbytes", "_read_only_fd")

    def __init__(self, fd: int, array: np.ndarray) -> None:
        self.id = next(_segment_ids)
        self.fd = fd
        self.array = array
        self.nbytes = array.nbytes
        self._read_only_fd = -1

    @classmethod
    def create(cls, numel: int, name: str, *, shared_read_only: bool = False, populate: bool = False) -> Segment:
        """A new sealed segment of ``numel`` float32 elements, mapped writable here
        (``shared_read_only``: with a read-only descriptor for readers, opened now, so
        that nothing can fail later while it is handed out; ``populate``: its pages
        allocated and mapped now, not by the first write)."""
        fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            nbytes = 4 * numel
            os.ftruncate(fd, nbytes)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
            segment = cls(fd, _map(fd, nbytes, writable=True))
            if populate:  # (a write, not MAP_POPULATE: mmap() holds the GIL, numpy lets go of it)
                segment.array.fill(0)
        except BaseException:
            os.close(fd)
            raise
        if shared_read_only:
            try:
                segment.read_only_fd()
            except BaseException:
                segment.close()
                raise
        return segment

    def read_only_fd(self) -> int:
        """A descriptor of this segment opened read-only (to hand to a reader): a
        mapping of it cannot be writable. Opened once, closed with the segment."""
        if self._read_only_fd < 0:
            self._read_only_fd = os.open(f"/proc/self/fd/{self.fd}", os.O_RDONLY | os.O_CLOEXEC)
        return self._read_only_fd

    def close(self) -> None:
        fd, self.fd = self.fd, -1
        ro, self._read_only_fd = self._read_only_fd, -1
        for each in (fd, ro):
            if each >= 0:
                os.close(each)


class Room:
    """A segment that holds one message's bytes at a time (the rows of a request, or of a
    reply), made on the first message and made again, at twice the need, when a message
    needs more than it has, or (``shrink``) after a long run of messages that used a
    quarter of a large one at most (so that one large message does not keep its memory for
    the connection's life). Whoever holds the old segment keeps its mapping; it is freed
    when both ends have let it go."""

    MIN_BYTES = 1 << 16
    SHRINK_ABOVE = 16 << 20
    SHRINK_AFTER = 64

    def __init__(
        self, name: str, *, shared_read_only: bool = False, shrink: bool = True, limit: int | None = None
    ) -> None:
        self.segment: Segment | None = None
        self._limit = limit  # made no larger than this (or than the need, if larger)
        self._name = name
        self._shared_read_only = shared_read_only
        self._shrink = shrink  # False: made again only to grow
        self._small = 0  # messages in a row that used a quarter of the segment at most

    def take(self, nbytes: int) -> tuple[np.ndarray, bool]:
        """The first ``nbytes`` of the segment (uint8, writable), and whether the segment is
        new (its descriptor is then to go with the message)."""
        segment = self.segment
        if segment is not None and segment.nbytes >= nbytes:
            large = self._shrink and segment.nbytes > self.SHRINK_ABOVE and 4 * nbytes <= segment.nbytes
            self._small = self._small + 1 if large else 0
            if self._small < self.SHRINK_AFTER:
                return segment.array.view(np.uint8)[:nbytes], False
        size = -(-max(2 * nbytes, self.MIN_BYTES) // self.MIN_BYTES) * self.MIN_BYTES
        if self._limit is not None and size > self._limit:
            size = max(-(-nbytes // 8) * 8, self._limit - self._limit % 8)
        fresh = Segment.create(size // 4, self._name, shared_read_only=self._shared_read_only)
        if segment is not None:
            segment.close()
        self.segment, self._small = fresh, 0
        return fresh.array.view(np.uint8)[:nbytes], True

    def close(self) -> None:
        if self.segment is not None:
            self.segment.close()
            self.segment = None


_HUGE_PAGE = 2 << 20


def _map(fd: int, nbytes: int, *, writable: bool) -> np.ndarray:
    if nbytes == 0:
        return np.zeros(0, np.float32)
    prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
    mapping = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=prot)
    if nbytes >= _HUGE_PAGE:
        # Huge pages where the host allows them for shared memory
        # (/sys/kernel/mm/transparent_hugepage/shmem_enabled "advise"): an update pass over
        # 4 KiB pages spends a quarter of its time on TLB misses (docs/operations.md).
        try:
            mapping.madvise(mmap.MADV_HUGEPAGE)
        except (AttributeError, OSError):  # (a kernel without transparent huge pages)
            pass
    return np.frombuffer(mapping, np.float32)


def check_sealed(fd: int, nbytes: int) -> None:
    """Raise unless ``fd`` is a memory segment sealed against resizing, of ``nbytes`` at least."""
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:
        raise MalformedFrame("the descriptor is not a sealable memory segment (memfd)") from None
    needed = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
    if seals & needed != needed:
        raise MalformedFrame("the shared segment is not sealed against shrinking and growing")
    size = os.fstat(fd).st_size
    if size < nbytes:
        raise PayloadSizeMismatch(f"shared segment of {size} bytes; {nbytes} needed")


def map_received(fd: int, nbytes: int, *, writable: bool) -> np.ndarray:
    """Map a segment that came over the socket; checks its seals and size; closes ``fd``."""
    try:
        check_sealed(fd, nbytes)
        return _map(fd, nbytes, writable=writable)
    finally:
        os.close(fd)


def fds_from(ancdata) -> list[int]:
    """The descriptors in ``recvmsg`` ancillary data."""
    fds: list[int] = []
    for level, kind, data in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            received = array.array("i")
            received.frombytes(data[: len(data) - len(data) % received.itemsize])
            fds.extend(received)
    return fds


def scm_rights(fds: Sequence[int]) -> list:
    """``sendmsg`` ancillary data carrying ``fds`` (none when empty)."""
    return [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
