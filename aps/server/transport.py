"""What a connection needs of the bytes' carrier, and what the carrier tells it.

A :class:`~aps.server.connection.Connection` holds one :class:`Transport`: TCP
(:class:`aps.server.tcp.TcpTransport`) or a Unix socket with shared memory
(:class:`aps.server.shm.ShmTransport`). The transport moves bytes and says where a
request's arrays lie (in the frame over TCP, in a segment over shared memory); the
connection and the request handlers decide everything else. The transport reports its
events to a :class:`Receiver` (the connection), and imports nothing of it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import numpy as np

    from ..errors import ServerError
    from ..wire.protocol import Header, InitRequest
    from .engine.members import Member
    from .engine.table import Snapshot

__all__ = ["Receiver", "Transport"]


class Transport(Protocol):
    """One worker's byte carrier, as its connection uses it."""

    #: The transport's name, in logs and in the traffic counters.
    kind: str
    #: Whether gradients and weights may cross as 16-bit values (they do over TCP; shared
    #: memory moves no bytes they would save).
    compressed: bool
    #: Who is at the other end: an address or a process, in logs.
    peer: str
    #: Whom the peer's connections count as, for room at --max-connections and turns.
    peer_key: str
    #: A request's rows lie in memory the worker may write again (its shared rows segment).
    rows_shared: bool
    #: Output is waiting for the socket to take it (it says so to its receiver when it has left).
    writing: bool

    @property
    def rows_room(self) -> Callable[[int], np.ndarray] | None:
        """Where a reply's rows are gathered (``room(nbytes)``: a uint8 array); None: new arrays."""
        ...

    def can_write(self) -> bool:
        """Whether anything written now would leave."""
        ...

    def write(self, data: bytes | memoryview, fds: Sequence[int] = ()) -> None:
        """Write a frame (header and short payload); ``fds``: descriptors to pass with it."""
        ...

    def write_parts(self, parts: tuple, fds: Sequence[int] = ()) -> None:
        """Write a frame given in parts (kept by the transport until sent, not copied)."""
        ...

    def unsent(self) -> int:
        """Bytes written and not yet taken by the socket."""
        ...

    def pause_reading(self) -> None: ...

    def resume_reading(self) -> None: ...

    def close(self) -> None:
        """Close after what is written has left."""
        ...

    def abort(self) -> None:
        """Close at once, dropping whatever is still unsent."""
        ...

    def auth_key(self) -> str | None:
        """Whom the peer's failed AUTH attempts count against (None: the peer is gone)."""
        ...

    def gradient_destination(self, member: Member, header: Header, rows: bool = False) -> memoryview | None:
        """Where a push's dense gradient goes (None: it is not in the frame); raises a ServerError
        if the frame is malformed. ``rows``: the payload goes on with rows."""
        ...

    def gradient_buffer(self, request: InitRequest) -> np.ndarray | None:
        """The buffer a joining worker's gradients will be in (None: the engine allocates one)."""
        ...

    def check_rows_frame(self, header: Header, rows_at: int) -> None:
        """Raise a ServerError if a request's rows, from byte ``rows_at`` of its payload on, are
        not what this transport carries rows as."""
        ...

    def rows_payload(self, payload: memoryview) -> memoryview | np.ndarray:
        """The rows of a request, from the rows part of its payload."""
        ...

    def reply_rows(self, read: list[np.ndarray]) -> tuple[tuple, tuple[int, ...]]:
        """What a reply carries for the rows ``read``: buffers, and descriptors to pass."""
        ...

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
        dtype: int = 1,  # DType.FLOAT32
    ) -> None:
        """Send the weights of ``snap`` (then ``rows`` and ``fds``), keeping or releasing the
        lease as the transport needs; ``narrowed``: send these 16-bit words of them instead,
        as ``dtype`` (a compressed pull, TCP)."""
        ...

    def frame_arrived(self, header: Header) -> None:
        """A whole frame arrived, before it is handled (a LEAVE lets go of the leased slot)."""
        ...

    def reply_left(self) -> None:
        """The last reply's bytes have all left."""
        ...

    def release_leases(self) -> None:
        """End every lease the transport still holds."""
        ...


class Receiver(Protocol):
    """What a transport tells its connection."""

    @property
    def authenticated(self) -> bool:
        """Whether the peer may send more than the handshake (descriptors, say)."""
        ...

    def opened(self) -> bool:
        """The peer is known: take the connection (False: refused, and closed)."""
        ...

    def get_buffer(self) -> memoryview:
        """Where the next bytes read go."""
        ...

    def bytes_arrived(self, nbytes: int) -> None: ...

    def output_drained(self) -> None: ...

    def fatal(self, exc: ServerError, *, warn: bool = True) -> None:
        """The peer broke the protocol below the frames (descriptors): refuse and close."""
        ...

    def connection_lost(self, exc: Exception | None) -> None: ...
