"""The one frame parser of aps, shared by every transport and by both ends.

:class:`FrameReader` is sans-I/O: a driver asks it for a buffer to read into
(:meth:`FrameReader.get_buffer`), reads from its socket straight into that
buffer, then reports how many bytes arrived (:meth:`FrameReader.buffer_updated`).
The same two calls serve an ``asyncio.BufferedProtocol`` (the server), a
blocking ``socket.recv_into`` loop (``aps.Worker``) and
``loop.sock_recv_into`` (``aps.AsyncWorker``).

Small frames are read through a staging buffer, so one read can deliver a
header and its payload, or several frames. A large payload is read straight
into the destination its handler chose: no intermediate copy. A handler may
take a payload in parts: it gives a destination for the first part, looks at
it when it has arrived, and only then decides where the rest goes (the
server reads an INIT's layout block, checks it, and only then allocates room
for the values, or none).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from .protocol import HEADER_SIZE, Header, unpack_header

__all__ = ["FrameHandler", "FrameReader"]

_EMPTY = memoryview(b"")


class FrameHandler(Protocol):
    def frame_buffer(self, header: Header) -> memoryview | None:
        """Where the payload of ``header`` goes: a writable byte view of
        ``header.length`` bytes, or None to read and discard it. A shorter view
        takes the first part only; then ``frame_more`` is called when it is
        full. Raising here is fatal for the connection."""

    def frame_received(self, header: Header, payload: memoryview) -> None:
        """A whole frame arrived; ``payload`` is the view ``frame_buffer`` gave
        (or an empty view)."""

    # Optional: ``frame_more(header, got)`` is called when the destination of
    # the first ``got`` payload bytes is full and more are to come: it returns
    # where the next part goes (at most the rest), or None to discard the rest.
    # Optional: ``payload_progress(filled)`` is called whenever the first
    # ``filled`` bytes of the current payload have landed in its destination,
    # while they are still warm in the cache (the server checks gradients for
    # NaN there, chunk by chunk, instead of in a separate pass).


class FrameReader:
    """Incremental frame parser (see the module docstring).

    Args:
        handler: chooses payload destinations and receives whole frames.
        max_payload: frames announcing a longer payload raise FrameTooLarge.
        staging_size: size of the staging buffer for headers and small payloads.
    """

    __slots__ = (
        "_handler",
        "_progress",
        "_more",
        "_max",
        "_buf",
        "_view",
        "_start",
        "_end",
        "_header",
        "_dest",
        "_base",
        "_got",
        "_direct",
        "_held",
    )

    def __init__(self, handler: FrameHandler, *, max_payload: int | None = None, staging_size: int = 1 << 16) -> None:
        if staging_size < HEADER_SIZE:
            raise ValueError("staging buffer smaller than a header")
        self._handler: FrameHandler | None = handler  # None once detached
        self._progress: Callable[[int], object] | None = getattr(handler, "payload_progress", None)
        self._more: Callable[[Header, int], memoryview | None] | None = getattr(handler, "frame_more", None)
        self._max = max_payload
        self._buf = bytearray(staging_size)
        self._view = memoryview(self._buf)
        self._start = 0
        self._end = 0
        self._header: Header | None = None
        self._dest: memoryview | None = None
        self._base = 0  # payload offset at which _dest begins
        self._got = 0
        self._direct = False
        self._held = False

    @property
    def held(self) -> bool:
        """True while parsing is suspended (the handler is busy with a frame)."""
        return self._held

    @property
    def idle(self) -> bool:
        """True between frames with nothing buffered."""
        return self._header is None and self._start == self._end

    @property
    def in_frame(self) -> bool:
        """True when part of a frame has arrived but not all of it."""
        return self._header is not None or self._start != self._end

    def hold(self) -> None:
        """Stop delivering frames (bytes keep accumulating in the staging buffer)."""
        self._held = True

    def release(self, parse: bool = True) -> None:
        """Resume delivering frames, starting with any already buffered.

        With ``parse=False`` buffered frames wait for the next read or
        ``release()``: for a handler finishing a frame from inside
        ``frame_received``, whose parse loop then simply goes on.
        """
        self._held = False
        if parse:
            self._parse()

    def hand_to(self, handler: FrameHandler) -> None:
        """Deliver the frames from the next one on to ``handler`` (an asyncio worker's pipeline
        takes its acknowledgements this way, then hands the reader back). Only between frames:
        a frame whose header was parsed is its handler's to the end."""
        if self._header is not None:
            raise RuntimeError("a frame is being read: its handler keeps it")
        self._handler = handler
        self._progress = getattr(handler, "payload_progress", None)
        self._more = getattr(handler, "frame_more", None)

    def detach(self) -> None:
        """The connection is gone: let go of the handler and every buffer at once
        (a reader and its handler refer to each other; without this, a dropped
        connection's payload buffers would live until the garbage collector ran)."""
        self._handler = self._progress = self._more = None
        self._dest = None
        self._header = None
        self._buf = bytearray()
        self._view = memoryview(self._buf)
        self._start = self._end = self._got = self._base = 0
        self._held = True

    def staging_half_empty(self) -> bool:
        """True when at least half the staging buffer is free (a paused driver may read again:
        resuming at the first free byte would cost a read per frame)."""
        return (self._end - self._start) * 2 <= len(self._buf)

    def staging_full(self) -> bool:
        """True when the staging buffer has no room left: the driver must stop reading."""
        return self._end - self._start >= len(self._buf)

    def get_buffer(self, sizehint: int = -1) -> memoryview:
        """The buffer the next read must fill (never empty unless ``staging_full``)."""
        if self._dest is not None and self._start == self._end and not self._held:
            self._direct = True
            return self._dest[self._got - self._base :]
        self._direct = False
        if self._start == self._end:
            self._start = self._end = 0
        elif self._end == len(self._buf):
            size = self._end - self._start
            self._buf[:size] = self._view[self._start : self._end]
            self._start, self._end = 0, size
        return self._view[self._end :]

    def buffer_updated(self, nbytes: int) -> None:
        """Account for ``nbytes`` read into the last buffer; delivers complete frames."""
        if self._direct:
            self._direct = False
            header, dest = self._header, self._dest
            assert header is not None and dest is not None  # a direct read goes into the current frame's _dest
            self._got += nbytes
            if self._progress is not None:
                self._progress(self._got)
            if self._got == header.length:
                self._finish()
            elif self._got - self._base == len(dest):
                self._next_part()
            return
        self._end += nbytes
        self._parse()

    def _parse(self) -> None:
        view = self._view
        while not self._held:
            header = self._header
            if header is None:
                if self._end - self._start < HEADER_SIZE:
                    return
                header = unpack_header(view[self._start : self._start + HEADER_SIZE], self._max)
                self._start += HEADER_SIZE
                self._header = header
                self._got = 0
                self._base = 0
                assert self._handler is not None  # a detached reader is held: it parses no more
                self._dest = self._checked(self._handler.frame_buffer(header), header.length)
                if self._dest is not None and not len(self._dest) and header.length:
                    self._next_part()
            take = min(header.length - self._got, self._end - self._start)
            dest = self._dest
            if dest is not None:
                take = min(take, len(dest) - (self._got - self._base))
            if take:
                self._got += take
                self._start += take
                if dest is not None:
                    at = self._got - self._base
                    dest[at - take : at] = view[self._start - take : self._start]
                    if self._progress is not None:
                        self._progress(self._got)
            if self._got < header.length:
                if dest is not None and self._got - self._base == len(dest):
                    self._next_part()
                    continue
                return
            self._finish()

    def _checked(self, dest: memoryview | None, room: int) -> memoryview | None:
        if dest is not None and (len(dest) > room or (len(dest) < room and self._more is None)):
            raise ValueError(f"frame buffer of {len(dest)} bytes for {room} bytes of payload")
        return dest

    def _next_part(self) -> None:
        """The current destination is full and more payload is to come: ask where it goes."""
        header, more = self._header, self._more
        assert header is not None and more is not None  # _checked allows a short destination only with frame_more
        while True:
            self._base = self._got
            self._dest = self._checked(more(header, self._got), header.length - self._got)
            if self._dest is None or len(self._dest):
                return

    def _finish(self) -> None:
        header, dest = self._header, self._dest
        assert header is not None and self._handler is not None  # a whole frame arrived on an attached reader
        self._header = None
        self._dest = None
        self._got = self._base = 0
        self._handler.frame_received(header, _EMPTY if dest is None else dest)
