"""The server side of one worker connection, whatever carries its frames.

:class:`ServerSession` parses frames (with the one :class:`FrameReader`),
answers each request through the engine, and writes replies; a subclass
supplies the byte transport: TCP (``aps.server.tcp``) or a Unix socket
with shared memory (``aps.server.shm``). A session handles one request at
a time, in order (a worker never has two in flight): bytes a peer sends
early wait in the reader's staging buffer, and reading pauses if that fills.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections import Counter
from typing import TYPE_CHECKING

import numpy as np

from ..errors import (
    AuthenticationError,
    DTypeMismatch,
    Evicted,
    InternalServerError,
    InvalidHyperparameters,
    MalformedFrame,
    NotInitialized,
    OutOfOrder,
    PayloadSizeMismatch,
    ServerError,
    ServerOverloaded,
    ShuttingDown,
    UnknownOp,
)
from ..wire.protocol import (
    HANDSHAKE_OPS,
    INIT_HEAD_BYTES,
    MAX_HYPER_BYTES,
    MAX_HYPER_GROUPS,
    NONCE_BYTES,
    MAX_LAYOUT_BYTES,
    MAX_CLAIM_BYTES,
    MAX_COUNTER_NAME,
    PROOF_BYTES,
    REQUEST_OPS,
    ANY_RANK,
    DType,
    Flag,
    Header,
    InitRequest,
    Op,
    WEIGHTS_DIGEST_BYTES,
    encode_error,
    encode_seated,
    is_known_op,
    pack_header,
)
from ..wire.framing import FrameReader
from ..wire.scalars import MAX_LOG_BYTES
from .admission import StrangerGuard, _refusals, _strangers
from .handshake import Handshake
from .session_rows import RowRequests
from .session_state import RunRequests
from .intake import _STATE_FIXED, InitIntake, StateIntake, WeightsIntake

if TYPE_CHECKING:
    from .engine import Engine
    from .engine.members import Member, PushResult
    from .engine.jobs.updates import StreamingPush
    from .engine.table import Snapshot

__all__ = ["ServerSession", "dtype_name"]

log = logging.getLogger("aps.server")

#: A connection whose frames are refused this many times in a row is closed.
MAX_BAD_FRAMES = 16
#: Warnings about one connection: at most this many per window; the rest are counted and summarized.
WARNINGS_PER_WINDOW = 5
WARNING_WINDOW_S = 60.0




#: While the server holds a request (a pull at the gate, a push in the lane),
#: it tells the worker this often that it is alive (an ALIVE notice), or every
#: third of the heartbeat timeout if that is shorter.
ALIVE_EVERY_S = 5.0

_GRADIENT_OPS = frozenset({Op.PUSH, Op.PUSH_PULL})
#: Requests answered with the weights, which may ask for them narrowed (Flag.NARROW).
_PULL_OPS = frozenset({Op.PULL, Op.PUSH_PULL})
_NARROW = int(Flag.NARROW)
#: Element types a gradient or the weights may cross TCP as (wire compression).
_HALF = frozenset({int(DType.BFLOAT16), int(DType.FLOAT16)})
#: A SHARDS request (the shards' run ids, JSON) is at most this long.
MAX_SHARDS_BYTES = 16 << 10
#: Requests with a small payload, read whole: the most bytes each may carry (a counter's name, the
#: shards' run ids, a handshake's nonce or proof, a LOG).
_SMALL_PAYLOADS = {Op.CLAIM: MAX_COUNTER_NAME, Op.SHARDS: MAX_SHARDS_BYTES, Op.HELLO: NONCE_BYTES,
                   Op.AUTH: PROOF_BYTES + MAX_CLAIM_BYTES, Op.LOG: MAX_LOG_BYTES}
_FLOAT32 = int(DType.FLOAT32)
_CHECK = int(Flag.CHECK)
_ROWS = int(Flag.ROWS)


def dtype_name(code: int) -> str:
    try:
        return DType(code).name.lower()
    except ValueError:
        return f"unknown dtype code {code}"


class ServerSession(Handshake, RowRequests, RunRequests):
    """Requests and replies of one connection; subclasses move the bytes.

    Subclasses implement :meth:`_can_write`, :meth:`_write`,
    :meth:`_send_weights`, :meth:`close`, :meth:`abort`, :meth:`_unsent`,
    :meth:`_pause_reading`, :meth:`_resume_reading` and
    :meth:`_gradient_destination`, and call :meth:`_bytes_arrived`,
    :meth:`_output_drained` and :meth:`_connection_lost`.

    Args:
        engine: the server's engine.
        max_payload: the frame limit.
        registry: the server's set of open sessions (this adds and removes itself).
        unix_path: the server's Unix socket for co-located workers ("" if none),
            announced in HELLO replies.
        token: the shared secret a peer must prove it knows (HELLO, AUTH)
            before anything else is served; None: no authentication.
    """

    #: The transport's name, in logs.
    kind = "?"
    #: Whether gradients and weights may cross as 16-bit values (they do over TCP;
    #: shared memory moves no bytes they would save).
    compressed = False

    def __init__(
        self, engine: Engine, max_payload: int, registry: set, unix_path: str = "", token: bytes | None = None
    ) -> None:
        self.engine = engine
        # With a token, nothing but the handshake is served until the peer has proved it knows it.
        self._token = token
        self._authenticated = token is None
        self._server_nonce = b""
        self._client_nonce = b""
        self._hellos = 0
        self._traffic = engine.stats.traffic[self.kind]
        self.registry = registry
        self.unix_path = unix_path
        self.reader = FrameReader(self, max_payload=max_payload)
        self.member: Member | None = None
        self.peer = "?"
        #: The peer's address as failed AUTH attempts are counted by (its host, or its user).
        self.peer_key = "?"
        self._auth_key: str | None = None  # whom failed AUTHs count against, found at the first
        self._guard: StrangerGuard = getattr(registry, "guard", None) or StrangerGuard()
        self._parked: tuple[Header, memoryview] | None = None  # a stranger's request waiting its turn
        self._loop = asyncio.get_event_loop()
        self._pending_error: ServerError | None = None
        self._dispatching = False
        self._reading_paused = False
        self._writing = False  # the transport still holds unsent output
        self._deferred = False  # a request finished while writing: resume after the drain
        self._fatal_sent = False
        self._lost = False
        self._evicted = False  # dropped by the server (see _evict), not lost by the peer
        self._silenced = False  # the server is shutting down: no more replies
        now = self._loop.time()
        # Liveness (see watch()): when the worker last sent a byte or was answered,
        # whether the server holds one of its requests, and how its reply drains.
        self.last_heard = now
        self._open_request = False
        self._last_notice = now
        self._unsent_seen = -1
        self._drain_seen = now
        # A large gradient's update, computed while it arrives when the engine allows it.
        self._stream: StreamingPush | None = None
        self._grad_shift = 2  # log2 of the gradient being read's element size
        #: The element type the current request's weights reply goes as (Flag.NARROW).
        self._weights_dtype = _FLOAT32
        # The request being handled (a session handles one at a time).
        self._rid = 0
        self._dropped = False
        self._rows_at: int | None = None  # where the rows of the request being read begin (Flag.ROWS)
        self._rows_request = False  # the request being served carries rows (its reply does too)
        self._dense_reply = True  # its reply carries the dense weights
        self._init_rank = -1
        self._seat_notice = False  # the INIT asked for a SEATED notice before its reply
        self._intake: InitIntake | None = None  # the INIT being read
        self._state_intake: StateIntake | WeightsIntake | None = None  # the LOAD_STATE (LOAD_WEIGHTS) being read
        self._bad_in_row = 0  # refused frames since the last request that was answered
        self._connected_at = now
        self._frame_started = now  # when the first byte of the frame being read arrived
        self._frames = 0  # frames read in all
        self._warned = 0  # warnings logged in the current window, and since when
        self._warn_window = now
        self._unlogged = 0  # warnings kept out of the log

    # Transport interface ------------------------------------------------------
    def _can_write(self) -> bool:
        raise NotImplementedError

    def _write(self, data: bytes) -> None:
        """Write a small frame (header and short payload)."""
        raise NotImplementedError

    def _write_parts(self, parts: tuple, fds: tuple = ()) -> None:
        """Write a frame given in parts (buffers kept by the transport until sent, not copied
        here; ``fds``: descriptors to pass with it, over a Unix socket)."""
        for part in parts:
            self._write(part)

    def _send_weights(self, op: int, snap: Snapshot, clock: int, flags: int, rows: tuple = (),
                      fds: tuple = (), narrowed: np.ndarray | None = None) -> None:
        """Send the weights of ``snap`` (then ``rows``: buffers of a reply's rows, and ``fds``
        to pass with them), keeping or releasing the lease as the transport needs; ``narrowed``:
        send these 16-bit words of them instead (a compressed pull, TCP)."""
        raise NotImplementedError

    def _gradient_destination(self, member: Member, header: Header, rows: bool = False) -> memoryview | None:
        """Where a PUSH payload's dense gradient goes (None: it is not in the payload); raises a
        ServerError if malformed. ``rows``: the payload goes on with rows (it does not stream)."""
        raise NotImplementedError

    def _gradient_buffer(self, request: InitRequest) -> np.ndarray | None:
        """The buffer this worker's gradients will be in (None: the engine allocates one)."""
        return None

    def _pause_reading(self) -> None:
        raise NotImplementedError

    def _resume_reading(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        """Close after what is written has left."""
        raise NotImplementedError

    def abort(self) -> None:
        """Close at once, dropping whatever is still unsent."""
        raise NotImplementedError

    def _unsent(self) -> int:
        """Bytes written and not yet taken by the socket."""
        raise NotImplementedError

    def _release_leases(self) -> None:
        """End every lease the transport still holds."""

    def _reply_left(self) -> None:
        """The last reply's bytes have all left (TCP: the slot it was sent from is free;
        shared memory: the worker still copies out of it until its next request)."""

    # Events from the transport ------------------------------------------------
    @property
    def trusted(self) -> bool:
        """The peer has joined, or proved that it knows the server's token."""
        return self.member is not None or (self._token is not None and self._authenticated)

    def _admit(self) -> bool:
        """Take the connection, unless the server has ``--max-connections`` already: then
        the oldest stranger (see :attr:`trusted`) makes room for it, and when there is
        none, it is told so and closed (the caller stops there)."""
        limit = self.engine.config.max_connections
        if len(self.registry) < limit:
            return True
        strangers = [c for c in self.registry if not c.trusted and not c._lost]
        if strangers:
            # The oldest of whoever holds the most: a flood of one user's (or one address's)
            # connections makes room with its own, not with another's handshake.
            held = Counter(c.peer_key for c in strangers)
            crowd = max(held, key=held.__getitem__)
            oldest = min((c for c in strangers if c.peer_key == crowd), key=lambda c: c._connected_at)
            oldest._evict("made room for a newer connection (--max-connections reached)", abort=True)
            return True
        _refusals.warning(self._loop.time(), "refused a connection from %s: --max-connections %d reached",
                          self.peer, limit)
        payload = encode_error(ServerOverloaded.code, f"the server has {limit} connections already "
                               "(--max-connections); try again later")
        self._write(pack_header(Op.ERROR, 0, 0, 0, 0, 0, len(payload)) + payload)
        self._silenced = True
        self.close()
        return False

    def _bytes_arrived(self, nbytes: int) -> None:
        now = self.last_heard = self._loop.time()
        if not self.reader.in_frame:
            self._frame_started = now
        self._traffic.bytes_in += nbytes
        try:
            self.reader.buffer_updated(nbytes)
        except AuthenticationError as exc:  # logged already, rate-limited across connections
            self._fatal(exc, warn=False)
            return
        except ServerError as exc:
            self._fatal(exc)
            return
        except Exception as exc:
            log.exception("%s: internal error while reading", self._who())
            self._fatal(InternalServerError(f"internal error: {exc}"))
            return
        self._maybe_pause_reading()

    def _connection_lost(self, exc: Exception | None) -> None:
        if self._lost:
            return
        if self.reader.in_frame and not self._fatal_sent:
            self._warn("connection lost in the middle of a frame; the partial frame is discarded")
        elif exc is not None:
            (log.info if self.member is not None else log.debug)("%s: connection lost: %s", self._who(), exc)
        else:
            log.debug("%s: disconnected", self._who())
        if self._stream is not None:
            self._stream.abort()
            self._stream = None
        self._end_intake()
        self._state_intake = None
        self._parked = None
        was_member = self.member is not None
        if not was_member:
            self._guard.released(self._loop)
        if self._unlogged and was_member:
            log.warning("%s: closed; %d more warnings about it were not logged", self._who(), self._unlogged)
        if self.member is not None:
            self.engine.leave(self.member, "timed out" if self._evicted else "disconnected")
            self.member = None
        self._lost = True
        self.reader.detach()
        if self._unlogged and not was_member:
            _strangers.warning(self._loop.time(), "%s: closed; %d more warnings about it were not logged",
                               self._who(), self._unlogged)
        self._release_leases()
        self.registry.discard(self)

    def _output_drained(self) -> None:
        """Everything written so far has left: a request that finished meanwhile lets the next frame in."""
        self._writing = False
        if not self._open_request:  # the worker has its reply: its own time starts now
            self.last_heard = self._loop.time()
        self._reply_left()
        if self._deferred:
            self._deferred = False
            self._loop.call_soon(self._resume)

    # Server control -------------------------------------------------------------
    def announce_shutdown(self, notice: ShuttingDown, resumable: bool) -> None:
        """The server is stopping: say so (``resumable``: it can be resumed where it stops,
        flag RESUMABLE), and send nothing after (see :meth:`close`).

        The server announces to every session before closing any, so no
        worker is released by another's departure in between.
        """
        if self._can_write():
            self._reply_error(0, notice, warn=False, flags=Flag.RESUMABLE if resumable else 0)
        self._silenced = True

    def notify_join_progress(self, payload: bytes) -> None:
        """Tell a worker whose INIT waits for the others how many have joined (a JOIN_PROGRESS notice)."""
        member = self.member
        if member is not None and self.engine.waiting_to_start(member) and not self._writing:
            self._notice(Op.JOIN_PROGRESS, payload)

    def watch(self, now: float, timeout: float) -> None:
        """Liveness, checked by the server every second or so (``timeout``: the
        heartbeat timeout, 0 for none).

        - While the server holds a request of this worker (its wait is the
          server's: a pull at the gate, a push in the lane, an INIT waiting for
          the others), it says it is alive every ALIVE_EVERY_S seconds.
        - A reply that has made no progress leaving for ``timeout`` seconds: the
          worker does not read (stopped, hung, or its host is gone): it is
          dropped, whatever the reply's size.
        - A worker that sent nothing for ``timeout`` seconds since its last
          reply is dropped. A dropped worker leaves the live set at once.
        """
        if self._lost:
            return
        if self.member is None and not self._open_request:
            # A stranger (not joined, and not proved the token): each frame, the first one
            # included, has a deadline, and so has the stranger itself: slow peers, and
            # peers that only keep a connection, are closed.
            deadline = self.engine.config.handshake_timeout
            begun = self._frame_started if self.reader.in_frame else (None if self._frames else self._connected_at)
            if begun is not None and now - begun > deadline:
                self._evict(f"completed no frame within {deadline:g} s (--handshake-timeout)", abort=False)
                return
            if not self.trusted and now - self._connected_at > deadline:
                what = "authenticated" if self._token is not None else "joined"
                self._evict(f"neither {what} nor left within {deadline:g} s (--handshake-timeout)", abort=False)
                return
        if self._open_request:
            every = min(ALIVE_EVERY_S, timeout / 3) if timeout > 0 else ALIVE_EVERY_S
            if now - self._last_notice >= every and not self._writing:
                self._notice(Op.ALIVE)
            return
        if timeout <= 0:
            return
        if self._writing:
            unsent = self._unsent()
            if unsent != self._unsent_seen:
                self._unsent_seen, self._drain_seen = unsent, now
            elif now - self._drain_seen > timeout:
                self._evict(f"read nothing of its reply for {now - self._drain_seen:.0f} s", abort=True)
            return
        if now - self.last_heard > timeout:
            self._evict(f"sent nothing for {now - self.last_heard:.0f} s (missed heartbeats)", abort=False)

    def _evict(self, reason: str, *, abort: bool) -> None:
        self._evicted = True
        self._warn("%s: dropping it (it may rejoin)", reason)
        if abort:  # its socket takes nothing more: telling it is impossible
            self.abort()
            return
        self._reply_error(0, Evicted(f"the server dropped this connection: the worker {reason}; reconnect() rejoins"))
        self.close()

    def _notice(self, op: int, payload: bytes = b"") -> None:
        """A frame for the open request that does not answer it (ALIVE, JOIN_PROGRESS)."""
        if not self._can_write() or self._silenced:
            return
        frame = pack_header(op, 0, 0, self._rid, 0, 0, len(payload)) + payload
        self._traffic.bytes_out += len(frame)
        self._last_notice = self._loop.time()
        self._write(frame)

    # FrameHandler ---------------------------------------------------------
    def frame_buffer(self, header: Header) -> memoryview | None:
        op, length = header.op, header.length
        dest: memoryview | None = None
        self._rows_at = None
        if not self._authenticated and op not in HANDSHAKE_OPS:
            # Fatal (the reader closes the connection): nothing is served, read or kept for a stranger.
            self._auth_failed(f"a {_op_name(op)} request before the handshake")
        try:
            if op not in REQUEST_OPS:
                kind = "a reply" if is_known_op(op) else "unknown"
                raise UnknownOp(f"op code {op} is {kind}, not a request")
            if op in _PULL_OPS and header.flags & _NARROW:
                if header.dtype not in _HALF:
                    raise DTypeMismatch(f"a narrowed pull is BFLOAT16 or FLOAT16, not {dtype_name(header.dtype)}")
                if not self.compressed:
                    raise DTypeMismatch(f"narrowed weights cross TCP only, not {self.kind}")
            if header.flags & _ROWS:
                dest = self._rows_destination(header)
            elif op in _GRADIENT_OPS:
                member = self.member
                if member is None or member.grad is None:
                    raise NotInitialized(f"{Op(op).name} before a successful INIT")
                self._check_gradient_dtype(header)
                dest = self._gradient_destination(member, header)
            elif op == Op.INIT:
                if self.member is not None:
                    raise OutOfOrder(f"this connection already joined as rank {self.member.rank}")
                if header.dtype != _FLOAT32:
                    raise DTypeMismatch(f"initial weights dtype is {dtype_name(header.dtype)}; models are float32")
                if length < INIT_HEAD_BYTES:
                    raise MalformedFrame(f"INIT payload of {length} bytes is too short")
                block = header.version  # the INIT header's version field: the layout block's length
                if not INIT_HEAD_BYTES <= block <= min(length, MAX_LAYOUT_BYTES) or block % 8:
                    raise MalformedFrame(
                        f"INIT layout block of {block} bytes in a {length}-byte payload: it must be a multiple "
                        f"of 8 from {INIT_HEAD_BYTES} to {MAX_LAYOUT_BYTES} bytes"
                    )
                # Only the layout block, for now: room for the values is made once
                # the block is checked, and only if they are needed (frame_more).
                self._intake = InitIntake(block, self._guard)
                dest = self._intake.next_piece(0)
            elif op == Op.HYPER:
                # Checked against the model once it arrives; nothing is read for a stranger.
                if self.member is None:
                    raise NotInitialized("HYPER before a successful INIT: the groups are checked against the model")
                if length > MAX_HYPER_BYTES:
                    raise InvalidHyperparameters(
                        f"HYPER of {length} bytes: at most {MAX_HYPER_GROUPS} groups ({MAX_HYPER_BYTES} bytes) "
                        "are accepted")
                dest = memoryview(bytearray(length)) if length else None
            elif op == Op.LOAD_STATE:
                # Its description first, checked against the model and the run; room for
                # the arrays only then, and only as their bytes arrive (frame_more).
                if self.member is None:
                    raise NotInitialized("LOAD_STATE before a successful INIT")
                if header.dtype != _FLOAT32:
                    raise DTypeMismatch(f"an optimizer state is float32, not {dtype_name(header.dtype)}")
                if length < _STATE_FIXED:
                    raise MalformedFrame(f"LOAD_STATE payload of {length} bytes is too short")
                self._state_intake = StateIntake()
                dest = self._state_intake.fixed
            elif op == Op.LOAD_WEIGHTS:
                # Its digest first, checked against the run; room for the weights only then,
                # and only when they are to be loaded (frame_more).
                member = self.member
                if member is None or not member.joined or self.engine.table is None:
                    raise NotInitialized("LOAD_WEIGHTS before a successful INIT")
                if header.dtype != _FLOAT32:
                    raise DTypeMismatch(f"weights are float32, not {dtype_name(header.dtype)}")
                numel = self.engine.table.numel
                expected = WEIGHTS_DIGEST_BYTES + (0 if header.flags & _CHECK else 4 * numel)
                if length != expected:
                    what = "its digest alone (CHECK)" if header.flags & _CHECK else \
                        f"a {WEIGHTS_DIGEST_BYTES}-byte digest and {numel} float32 weights"
                    raise PayloadSizeMismatch(f"LOAD_WEIGHTS payload of {length} bytes; {what} take {expected}")
                self._state_intake = WeightsIntake(numel)
                dest = self._state_intake.digest
            elif op in _SMALL_PAYLOADS:  # read whole, within the op's limit
                limit = _SMALL_PAYLOADS[op]
                if length > limit or (op == Op.AUTH and length < PROOF_BYTES):
                    raise MalformedFrame(f"{Op(op).name} carries {limit} bytes at most, got {length}")
                dest = memoryview(bytearray(length)) if length else None
            elif length:
                raise MalformedFrame(f"{Op(op).name} carries no payload, got {length} bytes")
        except ServerError as exc:
            self._pending_error = exc
            return None
        self._pending_error = None
        return dest

    def _check_gradient_dtype(self, header: Header) -> None:
        if header.dtype != _FLOAT32 and not (header.dtype in _HALF and self.compressed):
            raise DTypeMismatch(f"gradient dtype is {dtype_name(header.dtype)}; the model is float32"
                                + (f" (16-bit gradients cross TCP only, not {self.kind})"
                                   if header.dtype in _HALF else ""))
        self._grad_shift = 2 if header.dtype == _FLOAT32 else 1

    def frame_more(self, header: Header, got: int) -> memoryview | None:
        """An INIT's layout block has arrived: check it, then make room for the values
        only if this worker provides the model's initial weights; else discard them.
        A LOAD_STATE's: see :class:`StateIntake`. A request's rows: room for them (a
        member's, within the frame limit: 8-aligned, for the arrays read in place)."""
        if self._pending_error is not None:
            return None
        if self._rows_at is not None and got == self._rows_at:
            return memoryview(np.empty(header.length - got, np.uint8))
        if header.op in (Op.LOAD_STATE, Op.LOAD_WEIGHTS):
            try:
                return self._state_intake.next_part(self.engine, header, got)
            except ServerError as exc:
                self._pending_error = exc
                return None
        intake = self._intake
        try:
            if got < intake.block_bytes:
                return intake.next_piece(got)
            request = intake.check(self.engine, header.length)
        except ServerOverloaded as exc:
            self.engine.stats.strangers["layout_refused"] += 1
            self._pending_error = exc
            intake.release()
            return None
        except ServerError as exc:
            self._pending_error = exc
            return None
        if not self.engine.claim_registration(request.layout, self):
            return None  # the model exists, or another worker's values are on their way
        intake.registering = True
        intake.values = np.empty(request.layout.numel, np.float32)
        return memoryview(intake.values).cast("B")

    def payload_progress(self, filled: int) -> None:
        stream = self._stream
        if stream is not None:  # (never for a request with rows: it does not stream)
            stream.feed(filled >> self._grad_shift)  # whole elements only; the update checks each one

    def frame_received(self, header: Header, payload: memoryview) -> None:
        self._frames += 1
        if self.member is not None:
            self._handle_frame(header, payload)
            return
        # A stranger's request: served in its turn, after members', within the strangers'
        # share of the loop (see StrangerGuard). It holds its reader meanwhile: one request
        # of a connection at a time, so a pipelining stranger has one parked, no more.
        self.reader.hold()
        guard = self._guard
        if not guard.may_serve_now():
            self._parked = (header, payload)
            guard.enqueue(self)
            return
        started = time.perf_counter()
        try:
            self._handle_frame(header, payload)
        finally:
            guard.charge(time.perf_counter() - started)

    def _serve_parked(self) -> None:
        """The stranger's turn has come (StrangerGuard): serve its parked request."""
        parked, self._parked = self._parked, None
        if parked is None or self._lost:
            return
        self._handle_frame(*parked)
        if not self._lost and not self.reader.held:  # answered at once: the frames behind it
            self.reader.hold()
            self._resume()

    def _handle_frame(self, header: Header, payload: memoryview) -> None:
        stream, self._stream = self._stream, None
        error = self._pending_error
        if error is not None:
            self._pending_error = None
            if header.op == Op.INIT:
                self._end_intake()
            self._state_intake = None
            self._bad_in_row += 1
            if self._bad_in_row >= MAX_BAD_FRAMES:
                self._warn("%d refused frames in a row: closing the connection", self._bad_in_row, force=True)
                self._fatal(error.__class__(
                    f"{error.message} ({self._bad_in_row} refused frames in a row: closing the connection)"
                ))
                return
            # An error is a reply like any other: the next frame waits until it has left,
            # so a peer that sends bad frames and reads nothing fills no queue.
            self.reader.hold()
            self._open_request = True
            self._rid = header.request_id
            self._reply_error(header.request_id, error)
            self._done(ok=False)
            return
        # One request at a time: later frames wait in the reader until _done().
        self.reader.hold()
        self._open_request = True
        self._last_notice = self._loop.time()
        self._rid = header.request_id
        self._weights_dtype = header.dtype if header.op in _PULL_OPS and header.flags & _NARROW else _FLOAT32
        self._rows_request = bool(header.flags & _ROWS)
        self._dense_reply = not self._rows_request or header.dtype != DType.NONE
        self._dispatching = True
        try:
            _HANDLERS[header.op](self, header, payload, stream)
        except AuthenticationError as exc:
            self._fatal(exc, warn=False)
        except ServerError as exc:
            if stream is not None:
                stream.abort()
            self._bad_in_row += 1
            self._fail(exc)
        except Exception as exc:
            log.exception("%s: internal error handling %s", self._who(), Op(header.op).name)
            self._fail(InternalServerError(f"internal error: {exc}"))
        finally:
            self._dispatching = False

    # Requests (the current one's id is self._rid) ------------------------------
    def _on_ping(self, header: Header, payload: memoryview, stream) -> None:
        self._reply(Op.PING_REPLY, version=self.engine.version)

    def _on_init(self, header: Header, payload: memoryview, stream) -> None:
        intake = self._intake
        try:
            request = intake.check(self.engine, header.length)  # checked already, unless there were no values
            if request.rank == ANY_RANK and not header.flags & Flag.SEAT:
                raise MalformedFrame("an INIT asking for any rank must ask for its seat (Flag.SEAT): it would not "
                                     "learn its rank")
            self._seat_notice = bool(header.flags & Flag.SEAT)
            rank = self.engine.assign_rank() if request.rank == ANY_RANK else request.rank
            self._init_rank = rank
            values, intake.values = intake.values, None  # the engine's now: not kept here while INIT waits
            member = self.engine.join(
                rank,
                request.num_workers,
                request.layout,
                values,
                self._send_init_reply,
                self._init_failed,
                grad=self._gradient_buffer(request),
                rejoin=bool(header.flags & Flag.REJOIN) and rank == request.rank,
                clock=header.clock,
            )
        except BaseException:
            self._end_intake()
            raise
        if member.connected:  # not refused while joining
            self.member = member
            log.debug("%s: INIT as rank %d over %s", self.peer, member.rank, self.kind)

    def _on_pull(self, header: Header, payload: memoryview, stream) -> None:
        member = self._require_member()
        self._request_rows(member, header, payload)
        member.dense_wanted = self._dense_reply  # (rows alone: it keeps the weights it had)
        self.engine.pull(member, self._send_pull_reply)

    def _on_push(self, header: Header, payload: memoryview, stream) -> None:
        member = self._require_member()
        rows = self._request_rows(member, header, payload)
        self.engine.push(member, header.version, self._send_push_reply, self._fail, stream=stream,
                         request_id=header.request_id, clock=header.clock, rows=rows, dense=self._dense_reply)

    def _on_push_pull(self, header: Header, payload: memoryview, stream) -> None:
        member = self._require_member()
        rows = self._request_rows(member, header, payload)
        self.engine.push(member, header.version, self._pushed_then_pull, self._fail, stream=stream,
                         request_id=header.request_id, clock=header.clock, rows=rows, dense=self._dense_reply)

    def _on_leave(self, header: Header, payload: memoryview, stream) -> None:
        member = self._require_member()
        self.member = None
        self.engine.leave(member, "finished" if header.flags & Flag.FINISHED else "left")
        self._reply(Op.LEAVE_REPLY)

    def _require_member(self) -> Member:
        if self.member is None:
            raise NotInitialized("request before a successful INIT")
        return self.member

    # Replies: each one ends the current request -----------------------------------
    def _pushed_then_pull(self, result: PushResult) -> None:
        if self.member is None:  # the connection went away while the push was in the lane
            self._done()
            return
        self._dropped = result.dropped
        self.member.dense_wanted = self._dense_reply  # (rows alone: it keeps the weights it had)
        self.engine.pull(self.member, self._send_push_pull_reply)

    def _send_push_reply(self, result: PushResult) -> None:
        flags = Flag.DROPPED if result.dropped else 0
        self._reply(Op.PUSH_REPLY, clock=result.clock, version=result.version, flags=flags)

    def _send_init_reply(self, snap: Snapshot, clock: int) -> None:
        # The reply may come before engine.join() returns: find the member by rank.
        engine = self.engine
        member = engine.members.get(self._init_rank)
        self._intake = None
        if self._seat_notice:
            self._notice(Op.SEATED, encode_seated(self._init_rank, engine.quorum, engine.num_workers))
        self._reply_weights(Op.INIT_REPLY, snap, clock, Flag.RUNNING if member and member.joined_running else 0)

    def _send_pull_reply(self, snap: Snapshot, clock: int) -> None:
        self._reply_weights(Op.PULL_REPLY, snap, clock, 0)

    def _send_push_pull_reply(self, snap: Snapshot, clock: int) -> None:
        self._reply_weights(Op.PUSH_PULL_REPLY, snap, clock, Flag.DROPPED if self._dropped else 0)

    def _init_failed(self, exc: ServerError) -> None:
        self.member = None
        self._end_intake()
        self._fail(exc)

    def _end_intake(self) -> None:
        """The INIT is over, one way or another: if this worker was to provide the
        initial weights and they did not make it in, others may now."""
        intake, self._intake = self._intake, None
        if intake is not None:
            intake.release()
            if intake.registering and self.engine.table is None:
                self.engine.release_registration(self)

    def _fail(self, exc: ServerError) -> None:
        self._reply_error(self._rid, exc)
        self._done(ok=False)

    def _reply(self, op: int, *, clock: int = 0, version: int = 0, flags: int = 0, payload: bytes = b"") -> None:
        if self._can_write() and not self._silenced:
            live = self.engine.policy.num_live if self.member is not None else 0  # (said to workers only)
            frame = pack_header(op, flags, 0, self._rid, clock, version, len(payload), live)
            frame += payload
            self._traffic.bytes_out += len(frame)
            self._write(frame)
        self._done()

    def _reply_weights(self, op: int, snap: Snapshot, clock: int, flags: int) -> None:
        rows: tuple = ()
        fds: tuple = ()
        if self._rows_request and op != Op.INIT_REPLY:
            reply = self._rows_of_reply(op, snap, clock, flags)
            if reply is None:  # (sent: rows alone, or an error)
                return
            (rows, fds), flags = reply, flags | _ROWS
        if self._weights_dtype != _FLOAT32 and op != Op.INIT_REPLY and self._can_write() and not self._silenced:
            # Rounded to 16 bits first (off the loop for a large model): answered when ready.
            self.engine.narrowed.get(snap, self._weights_dtype,
                                     functools.partial(self._send_reply_weights, op, snap, clock, flags, rows, fds))
            return
        self._send_reply_weights(op, snap, clock, flags, rows, fds)

    def _send_reply_weights(self, op: int, snap: Snapshot, clock: int, flags: int, rows: tuple, fds: tuple,
                            narrowed: np.ndarray | None = None) -> None:
        if not self._can_write() or self._silenced:
            snap.release()
        else:
            try:
                self._send_weights(op, snap, clock, flags, rows, fds, narrowed)
            except Exception:  # out of descriptors, say: this connection cannot be answered
                log.exception("%s: sending weights failed; dropping the connection", self._who())
                snap.release()
                self.abort()
                return
        self._done()

    def _reply_error(self, rid: int, exc: ServerError, *, warn: bool = True, flags: int = 0) -> None:
        """Send an error frame (does not end the request: callers decide)."""
        if warn:
            self._warn("%s: %s", exc.code.name, exc.message)
        if self._can_write() and not self._silenced:
            payload = encode_error(exc.code, exc.message)
            frame = pack_header(Op.ERROR, flags, 0, rid, 0, 0, len(payload)) + payload
            self._traffic.bytes_out += len(frame)
            self._write(frame)

    def _fatal(self, exc: ServerError, *, warn: bool = True) -> None:
        """Framing is lost (or the peer failed the handshake): say why, then close
        this connection (only this one)."""
        if self._fatal_sent:
            return
        self._fatal_sent = True
        self._reply_error(0, exc, warn=warn)
        self.reader.hold()
        self.close()

    def _done(self, ok: bool = True) -> None:
        """The current request is answered (``ok``: not with an error): go on with the next frame.

        Not before the reply has left, though: a client that sends requests
        without reading replies would otherwise pin a snapshot slot per reply,
        or pile up error frames.
        """
        if ok:
            self._bad_in_row = 0
        self._open_request = False
        self.last_heard = self._loop.time()  # answered: the worker's own time starts now
        self._unsent_seen = -1
        if self._writing:
            self._deferred = True
        elif self._dispatching:
            self.reader.release(parse=False)
        else:
            self._loop.call_soon(self._resume)

    def _resume(self) -> None:
        if self._lost or not self._can_write() or not self.reader.held:
            return
        try:
            self.reader.release()
        except ServerError as exc:
            self._fatal(exc)
            return
        if self._reading_paused and self.reader.staging_half_empty():
            self._reading_paused = False
            self._resume_reading()
        self._maybe_pause_reading()

    def _maybe_pause_reading(self) -> None:
        if not self._reading_paused and self.reader.held and self.reader.staging_full():
            self._reading_paused = True
            self._pause_reading()

    def _warn(self, message: str, *args, force: bool = False) -> None:
        """Log a warning about this connection, at most WARNINGS_PER_WINDOW a window
        (a peer sending garbage cannot flood the log); the rest are counted. Warnings
        about peers that have not joined also share one budget across connections;
        ``force`` logs past this connection's budget (not past that one)."""
        now = self._loop.time()
        if now - self._warn_window >= WARNING_WINDOW_S:
            if self._unlogged:
                log.warning("%s: %d more warnings about it in the last %.0f s were not logged",
                            self._who(), self._unlogged, now - self._warn_window)
            self._warn_window, self._warned, self._unlogged = now, 0, 0
        if self._warned < WARNINGS_PER_WINDOW or force:
            self._warned += 1
            if self.member is None:
                _strangers.warning(now, "%s: " + message, self._who(), *args)
            else:
                log.warning("%s: " + message, self._who(), *args)
        else:
            self._unlogged += 1

    def _who(self, member: Member | None = None) -> str:
        member = member or self.member
        return f"{self.peer} (rank {member.rank})" if member is not None else self.peer


#: The request handlers by op (functions, not bound methods: no reference cycle through the session).
_HANDLERS = {
    Op.PING: ServerSession._on_ping,
    Op.HELLO: ServerSession._on_hello,
    Op.AUTH: ServerSession._on_auth,
    Op.INIT: ServerSession._on_init,
    Op.PULL: ServerSession._on_pull,
    Op.PUSH: ServerSession._on_push,
    Op.PUSH_PULL: ServerSession._on_push_pull,
    Op.LEAVE: ServerSession._on_leave,
    Op.STATS: ServerSession._on_stats,
    Op.CHECKPOINT: ServerSession._on_checkpoint,
    Op.SHARDS: ServerSession._on_shards,
    Op.HYPER: ServerSession._on_hyper,
    Op.STATE: ServerSession._on_state,
    Op.LOAD_STATE: ServerSession._on_load_state,
    Op.LOAD_WEIGHTS: ServerSession._on_load_weights,
    Op.REWIND: ServerSession._on_rewind,
    Op.CLAIM: ServerSession._on_claim,
    Op.LOG: ServerSession._on_log,
}


def _op_name(op: int) -> str:
    try:
        return Op(op).name
    except ValueError:
        return f"op {op}"
