"""Shared memory both ends use: anonymous segments and descriptors passed over Unix sockets.

Memory is anonymous (``memfd_create``) and passed as file descriptors over
the socket (``SCM_RIGHTS``), so it has no name to leak: the kernel frees a
segment when the last process holding it closes it or dies. The server keeps
its snapshot slots in segments; each worker keeps its gradient buffer in one
(see ``shm_server`` and ``shm_client``).
"""

from __future__ import annotations

import array
import itertools
import mmap
import os
import socket
import tempfile
from collections.abc import Sequence

import numpy as np

from ..errors import PayloadSizeMismatch

__all__ = [
    "ANCILLARY_SPACE",
    "Segment",
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
