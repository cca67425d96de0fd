"""What every request handler is, and what it is handed.

- :class:`Request`: one request, a value made when its header arrives and dropped when it
  is answered: its header, where its rows begin, the gradient it streams, what is read of
  it before it is handled (its intake), the element type of its reply's weights.
- :class:`Exchange`: the connection as a handler sees it (its engine, its member, its
  transport, and the replies it can send); :class:`aps.server.connection.Connection` is one.
- :class:`Handler`: the family of handlers, one per op. A handler owns its op from the
  header to the reply: where its payload goes (:meth:`Handler.admit`, :meth:`Handler.more`),
  its checks, its engine call and its reply (:meth:`Handler.handle`). Handlers keep no
  state: what one request needs is on the :class:`Request`, what a connection keeps across
  requests on the connection (its member) or on a part it holds (its handshake).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from ...errors import DTypeMismatch, MalformedFrame
from ...wire import quantized
from ...wire.protocol import DType, Flag, Header, Op
from .intake import InitIntake

if TYPE_CHECKING:
    import asyncio

    import numpy as np

    from ...errors import ServerError
    from ..admission import StrangerGuard
    from ..engine import Engine
    from ..engine.jobs.updates import StreamingPush
    from ..engine.members import Member
    from ..engine.stats import Traffic
    from ..engine.table import Snapshot
    from ..handshake import Handshake
    from .intake import StateIntake, WeightsIntake
    from ..transport import Transport

__all__ = ["Exchange", "Handler", "Request", "check_gradient_dtype", "dtype_name", "op_name", "read_whole"]

FLOAT32 = int(DType.FLOAT32)
NONE = int(DType.NONE)
#: Element types a gradient or the weights may cross TCP as (wire compression).
HALF = frozenset({int(DType.BFLOAT16), int(DType.FLOAT16)})
#: Element types a gradient alone (no rows) may cross TCP as: block-quantized (aps.wire.quantized).
QUANTIZED = frozenset(quantized.QUANTIZED)
GRADIENT_OPS = frozenset({Op.PUSH, Op.PUSH_PULL})
#: Requests answered with the weights, which may ask for them narrowed (Flag.NARROW).
PULL_OPS = frozenset({Op.PULL, Op.PUSH_PULL})
# (plain ints: an IntFlag's `&` makes a new IntFlag, a cost on every request)
ROWS = int(Flag.ROWS)
NARROW = int(Flag.NARROW)
CHECK = int(Flag.CHECK)
GATE = int(Flag.GATE)
SKIP = int(Flag.SKIP)
DROPPED = int(Flag.DROPPED)


def dtype_name(code: int) -> str:
    try:
        return DType(code).name.lower()
    except ValueError:
        return f"unknown dtype code {code}"


def op_name(op: int) -> str:
    try:
        return Op(op).name
    except ValueError:
        return f"op {op}"


class Request:
    """One request, from its header to its reply (see the module docstring)."""

    __slots__ = (
        "header",
        "handler",
        "error",
        "stream",
        "rows_at",
        "grad_shift",
        "weights_dtype",
        "intake",
        "dropped",
        "rank",
        "seat_notice",
        "rows",
        "dense_reply",
    )

    def __init__(self, header: Header, handler: Handler | None) -> None:
        self.header = header
        self.handler = handler
        #: Why it is refused, found while its frame was read: its reply, once the frame is in.
        self.error: ServerError | None = None
        #: A large gradient's update, computed while it arrives (until the engine takes it).
        self.stream: StreamingPush | None = None
        #: Where its rows begin in its payload (Flag.ROWS), once admitted.
        self.rows_at: int | None = None
        #: log2 of the element size of the gradient it carries.
        self.grad_shift = 2
        #: The element type its weights reply goes as (Flag.NARROW).
        self.weights_dtype = header.dtype if header.op in PULL_OPS and header.flags & NARROW else FLOAT32
        #: What is read of it before it is handled (an INIT's layout and values, a load's arrays).
        self.intake: InitIntake | StateIntake | WeightsIntake | None = None
        #: The push was dropped (a PUSH_PULL's pull says so).
        self.dropped = False
        #: The rank an INIT joins as.
        self.rank = -1
        #: The INIT asked for a SEATED notice before its reply.
        self.seat_notice = False
        #: It carries rows (and its reply does).
        self.rows = bool(header.flags & ROWS)
        #: Its reply carries the dense weights (a request with rows whose dtype is NONE: rows alone).
        self.dense_reply = not self.rows or header.dtype != NONE

    @property
    def op(self) -> int:
        return self.header.op

    @property
    def rid(self) -> int:
        return self.header.request_id

    def end_intake(self, engine: Engine, owner: object) -> None:
        """What was read of it is let go of: an INIT's pieces give back what they drew from the
        layout budget, and if this worker was to provide the model's initial weights (``owner``
        registering them) and they did not make it in, others may now."""
        intake, self.intake = self.intake, None
        if isinstance(intake, InitIntake):
            intake.release()
            if intake.registering and engine.model.table is None:
                engine.membership.release_registration(owner)


class Exchange(Protocol):
    """The connection, as a request handler sees it."""

    engine: Engine
    member: Member | None
    transport: Transport
    traffic: Traffic
    handshake: Handshake
    unix_path: str
    loop: asyncio.AbstractEventLoop

    @property
    def peer(self) -> str: ...

    @property
    def lost(self) -> bool: ...

    def require_member(self) -> Member:
        """The member this connection joined as (raises NotInitialized before its INIT)."""
        ...

    def can_reply(self) -> bool:
        """Whether a reply would reach the worker (the connection is open, the server not stopping)."""
        ...

    def reply(
        self, request: Request, op: int, *, clock: int = 0, version: int = 0, flags: int = 0, payload: bytes = b""
    ) -> None:
        """Answer ``request`` with a small frame (its end)."""
        ...

    def reply_parts(self, parts: tuple, nbytes: int, fds: tuple = ()) -> None:
        """Answer the current request with a frame in parts, ``nbytes`` in all (its end)."""
        ...

    def reply_weights(
        self,
        request: Request,
        op: int,
        snap: Snapshot,
        clock: int,
        flags: int,
        rows: tuple,
        fds: tuple,
        narrowed: np.ndarray | None = None,
    ) -> None:
        """Answer ``request`` with the weights of ``snap`` (its end)."""
        ...

    def fail(self, request: Request, exc: ServerError) -> None:
        """Answer ``request`` with an error (its end)."""
        ...

    def done(self, ok: bool = True) -> None:
        """The current request is over without a reply of its own (the connection went away)."""
        ...

    def fatal(self, exc: ServerError, *, warn: bool = True) -> None:
        """Say why, then close this connection."""
        ...

    def notice(self, op: int, payload: bytes = b"") -> None:
        """A frame for the open request that does not answer it."""
        ...

    def close(self) -> None: ...

    def abort(self) -> None: ...

    @property
    def guard(self) -> StrangerGuard:
        """What the server's strangers may cost, all together (the layout budget among it)."""
        ...


class Handler(ABC):
    """The handler of one op (the family: one subclass per op; see the module docstring)."""

    #: The op it handles.
    op: ClassVar[Op]
    #: The most bytes its payload may have, read whole (0: it carries none), and the fewest.
    payload_limit: ClassVar[int] = 0
    payload_min: ClassVar[int] = 0
    #: It may carry rows (Flag.ROWS); a request of any other op that says so is refused.
    carries_rows: ClassVar[bool] = False

    def admit(self, conn: Exchange, request: Request) -> memoryview | None:
        """Where the payload of ``request`` goes, its header just arrived: a writable view (a
        shorter one takes the first part: :meth:`more` is asked for the rest), or None to read
        and drop it. Raises a ServerError to refuse the request (its payload is dropped, the
        error is its reply); an AuthenticationError closes the connection."""
        return read_whole(request.header, self.payload_limit, self.payload_min)

    def more(self, conn: Exchange, request: Request, got: int) -> memoryview | None:
        """Where the payload's bytes from ``got`` on go, the first ``got`` having arrived where
        :meth:`admit` (or this) said (None: read and drop the rest). A ServerError raised here
        refuses the request, as in :meth:`admit`."""
        return None

    @abstractmethod
    def handle(self, conn: Exchange, request: Request, payload: memoryview) -> Any:
        """Serve ``request``, its whole frame in: check it, ask the engine, and reply (now or
        when the engine calls back). A ServerError raised here is its reply."""


def read_whole(header: Header, limit: int, least: int = 0) -> memoryview | None:
    """Room for a small payload read whole (at most ``limit`` bytes, at least ``least``)."""
    length = header.length
    if not limit:
        if length:
            raise MalformedFrame(f"{op_name(header.op)} carries no payload, got {length} bytes")
        return None
    if length > limit:
        raise MalformedFrame(f"{op_name(header.op)} carries {limit} bytes at most, got {length}")
    if length < least:
        raise MalformedFrame(f"{op_name(header.op)} carries {least} bytes at least, got {length}")
    return memoryview(bytearray(length)) if length else None


def check_gradient_dtype(transport: Transport, request: Request) -> None:
    """Refuse a gradient whose element type the model or the transport does not take; note
    its element size on the request."""
    dtype = request.header.dtype
    if dtype != FLOAT32 and not ((dtype in HALF or dtype in QUANTIZED) and transport.compressed):
        raise DTypeMismatch(
            f"gradient dtype is {dtype_name(dtype)}; the model is float32"
            + (f" (16-bit gradients cross TCP only, not {transport.kind})" if dtype in HALF else "")
            + (f" (quantized gradients cross TCP only, not {transport.kind})" if dtype in QUANTIZED else "")
        )
    if dtype in QUANTIZED and request.rows:
        raise DTypeMismatch(f"a push with rows carries a float32 gradient, not {dtype_name(dtype)}")
    request.grad_shift = 2 if dtype == FLOAT32 else 1
