"""Shared-memory transport, client side: a worker's Unix socket and its segments (see ``shm_server``)."""

from __future__ import annotations

import os
import socket
from collections import deque
from collections.abc import Sequence

import numpy as np

from ..errors import APSConnectionError, APSTimeoutError, MalformedFrame
from .sockets import BlockingSocket
from ..wire.segments import ANCILLARY_SPACE, Segment, fds_from, map_received

__all__ = ["ShmConnection"]


class ShmConnection(BlockingSocket):
    """A worker's Unix socket to a co-located server, with its shared segments.

    Keeps the worker's gradient segment and the server's slots it has mapped.
    """

    def __init__(self, path: str, connect_timeout: float | None = 30.0) -> None:
        address = f"unix:{path}"
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        _roomy(sock)
        try:
            sock.settimeout(connect_timeout)
            sock.connect(path)
        except TimeoutError:
            sock.close()
            raise APSTimeoutError(f"connecting to {address} timed out") from None
        except OSError as exc:
            sock.close()
            raise APSConnectionError(f"cannot connect to {address}: {exc.strerror or exc}") from None
        super().__init__(sock, address)
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

    def _recv_into(self, buffer: memoryview) -> int:
        nbytes, ancdata, _, _ = self.sock.recvmsg_into([buffer], ANCILLARY_SPACE)
        self._fds.extend(fds_from(ancdata))
        return nbytes

    def close(self) -> None:
        super().close()
        while self._fds:
            os.close(self._fds.popleft())
        self.slots.clear()


#: What a Unix socket may hold queued (its default, some 200 KiB, would cut the rows of a
#: request or a reply, which cross the socket, into many writes and wake-ups).
SOCKET_BUFFER_BYTES = 4 << 20


def _roomy(sock: socket.socket) -> None:
    """Let ``sock`` queue :data:`SOCKET_BUFFER_BYTES` (as far as the system allows)."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER_BYTES)
    except OSError:  # (a limit of the system's: the default will do)
        pass

