"""Shared-memory transport, client side: a worker's Unix socket and its segments (see ``shm_server``)."""

from __future__ import annotations

import os
import select
import socket
import time
from collections import deque
from collections.abc import Sequence

import numpy as np

from ..errors import APSConnectionError, APSTimeoutError, MalformedFrame
from .sockets import BlockingSocket
from ..wire.rows import decode_rows_ref, encode_rows_ref
from ..wire.segments import ANCILLARY_SPACE, Room, Segment, fds_from, map_received

__all__ = ["ShmConnection"]


class ShmConnection(BlockingSocket):
    """A worker's Unix socket to a co-located server, with its shared segments.

    Keeps the worker's gradient segment and the server's slots it has mapped; for rows of
    embedding tables, the worker's rows segment (a request's rows) and the server's reply
    segment (a reply's), see aps.wire.rows.
    """

    def __init__(self, path: str, connect_timeout: float | None = 30.0) -> None:
        address = f"unix:{path}"
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
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
        self.rows_room: Room | None = None
        self._rows_sent = False  # the server of this connection has the rows segment's descriptor
        self._reply_rows: np.ndarray | None = None  # the server's reply segment (uint8, read-only)
        #: Seconds to poll for a reply before sleeping in the kernel (aps.Worker's ``spin``).
        self.spin = 0.0
        self._poll: select.poll | None = None

    def gradient_buffer(self, numel: int, rank: int | None) -> np.ndarray:
        """The worker's gradient vector, in a new shared segment (created once)."""
        if self.grad_segment is None or self.grad_segment.array.size != numel:
            self.grad_segment = Segment.create(numel, f"aps-grad-rank{rank}")
        return self.grad_segment.array

    def adopt(self, previous: ShmConnection) -> None:
        """Keep the gradient segment and mapped slots of a connection being replaced."""
        self.grad_segment, previous.grad_segment = previous.grad_segment, None
        self.rows_room, previous.rows_room = previous.rows_room, None

    def close_segments(self) -> None:
        """Close the descriptors of the worker's own segments (the worker is closed: its
        arrays keep their mappings)."""
        if self.grad_segment is not None:
            self.grad_segment.close()
        if self.rows_room is not None:
            self.rows_room.close()
            self.rows_room = None

    def rows_request(self, parts: Sequence, rank: int | None) -> tuple[bytes, int | None]:
        """Put a request's rows (``parts``, aps.wire.rows) in the rows segment: their rows
        reference, and the segment's descriptor when the server is to map it."""
        nbytes = sum(len(part) for part in parts)
        room = self.rows_room
        if room is None:
            room = self.rows_room = Room(f"aps-rows-rank{rank}")
        into, fresh = room.take(nbytes)
        at = 0
        for part in parts:
            size = len(part)
            into[at : at + size] = np.frombuffer(part, np.uint8)
            at += size
        send = fresh or not self._rows_sent
        self._rows_sent = True
        segment = room.segment
        assert segment is not None  # (take() made it)
        return encode_rows_ref(nbytes, segment.nbytes, send), (segment.fd if send else None)

    def rows_unsent(self) -> None:
        """The next request's rows go with the rows segment's descriptor again (a request
        was refused: the server may not have mapped the segment)."""
        self._rows_sent = False

    def reply_rows(self, ref: memoryview, length: int) -> np.ndarray:
        """The ``length`` bytes of a reply's rows its rows reference ``ref`` names (mapping
        the reply segment if its descriptor came): read them before the next request."""
        got, size, has_fd = decode_rows_ref(ref)
        if got != length:
            raise MalformedFrame(f"a reply's rows of {got} bytes; the rows asked for take {length}")
        if has_fd:
            if not self._fds:
                raise MalformedFrame("a rows reference announced a segment whose descriptor did not come")
            self._reply_rows = map_received(self._fds.popleft(), size, writable=False).view(np.uint8)
        mapped = self._reply_rows
        if not length:
            return np.zeros(0, np.uint8)
        if mapped is None or length > len(mapped):
            raise MalformedFrame(f"a reply's rows of {length} bytes beyond the reply segment mapped")
        return mapped[:length]

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

    def receive(self, reader, done, timeout: float | None = None, idle: float | None = None) -> None:
        if self.spin and not done():
            self._spin()
        super().receive(reader, done, timeout, idle)

    def _spin(self) -> None:
        """Poll the socket without sleeping until it is readable or ``spin`` seconds have
        passed: a reply due within microseconds then needs no wake-up of this process."""
        poll = self._poll
        if poll is None:
            poll = self._poll = select.poll()
            poll.register(self.sock, select.POLLIN)
        clock = time.perf_counter
        end = clock() + self.spin
        while not poll.poll(0) and clock() < end:
            pass

    def _recv_into(self, buffer: memoryview) -> int:
        nbytes, ancdata, _, _ = self.sock.recvmsg_into([buffer], ANCILLARY_SPACE)
        self._fds.extend(fds_from(ancdata))
        return nbytes

    def close(self) -> None:
        super().close()
        while self._fds:
            os.close(self._fds.popleft())
        self.slots.clear()
        self._reply_rows = None
