"""The server side of one worker connection, whatever carries its frames.

:class:`ServerSession` parses frames (with the one :class:`FrameReader`),
answers each request through the engine, and writes replies; a subclass
supplies the byte transport: TCP (``aps.transport.tcp_server``) or a Unix socket
with shared memory (``aps.transport.shm_server``). A session handles one request at
a time, in order (a worker never has two in flight): bytes a peer sends
early wait in the reader's staging buffer, and reading pauses if that fills.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import hmac
import json
import logging
import mmap
import os
import time
from collections import OrderedDict, deque
from typing import TYPE_CHECKING, NoReturn

import numpy as np

from ..errors import (
    AuthenticationError,
    CheckpointFailed,
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
from ..protocol import (
    HANDSHAKE_OPS,
    INIT_HEAD_BYTES,
    MAX_HYPER_BYTES,
    MAX_HYPER_GROUPS,
    NONCE_BYTES,
    MAX_LAYOUT_BYTES,
    REQUEST_OPS,
    DType,
    Flag,
    Header,
    InitRequest,
    Op,
    StateHead,
    WEIGHTS_DIGEST_BYTES,
    decode_hyper,
    decode_state_head,
    state_head_bytes,
    decode_layout_block,
    encode_error,
    auth_proof,
    encode_auth_reply,
    encode_hello_reply,
    host_identity,
    is_known_op,
    pack_header,
)
from .framing import FrameReader

if TYPE_CHECKING:
    from .._engine import Engine, Member, PushResult
    from .._state import StateCopy
    from .._updates import StreamingPush
    from ..table import Snapshot

__all__ = ["AuthThrottle", "Connections", "ServerSession", "StrangerGuard", "dtype_name"]

log = logging.getLogger("aps.server")

#: A connection whose frames are refused this many times in a row is closed.
MAX_BAD_FRAMES = 16
#: Warnings about one connection: at most this many per window; the rest are counted and summarized.
WARNINGS_PER_WINDOW = 5
WARNING_WINDOW_S = 60.0



# What strangers may cost ------------------------------------------------------------------
#: Strangers (connections that have not joined as workers) get at most this share of the
#: event loop's time for their requests, all of them together; members' frames go first.
STRANGER_SHARE = 0.10
#: ... and may run ahead of it by this many seconds (a burst), or behind by as many.
STRANGER_BURST_S = 0.05
#: Requests of strangers served in one turn before the loop looks at its sockets again.
STRANGERS_PER_TURN = 8
#: Bytes of INIT layout blocks being read, all connections together, beyond each one's
#: first piece (a layout block costs what its sender has sent, and the sum is bounded).
LAYOUT_BUDGET = 32 << 20
#: Seconds after a stranger's memory is let go before freed heap is handed back to the OS.
TRIM_AFTER_S = 1.0


class AuthThrottle:
    """Failed AUTH attempts by peer address: after :attr:`FREE` failures each attempt waits
    its turn, exponentially longer (from :attr:`BASE_S`, at most :attr:`MAX_DELAY_S`; the
    turns of parallel connections are taken one after the other), and after
    :attr:`LOCKOUT_AFTER` failures every attempt is refused for :attr:`LOCKOUT_S`. An
    address is forgotten :attr:`FORGET_S` after its last failure; at most :attr:`MAX_PEERS`
    are remembered (the least recently failed go first), so the table's memory is bounded.
    """

    FREE = 3
    BASE_S = 0.1
    MAX_DELAY_S = 2.0
    LOCKOUT_AFTER = 8
    LOCKOUT_S = 60.0
    FORGET_S = 600.0
    MAX_PEERS = 4096

    class _Peer:
        __slots__ = ("failures", "next_at", "blocked_until", "last")

        def __init__(self) -> None:
            self.failures = 0
            self.next_at = self.blocked_until = self.last = 0.0

    def __init__(self) -> None:
        self._peers: OrderedDict[str, AuthThrottle._Peer] = OrderedDict()

    def __len__(self) -> int:
        return len(self._peers)

    def _delay(self, failures: int) -> float:
        if failures < self.FREE:
            return 0.0
        return min(self.BASE_S * 2 ** (failures - self.FREE), self.MAX_DELAY_S)

    def _get(self, key: str, now: float) -> AuthThrottle._Peer | None:
        peer = self._peers.get(key)
        if peer is not None and now - peer.last > self.FORGET_S and now >= peer.blocked_until:
            del self._peers[key]
            return None
        return peer

    def refused_for(self, key: str, now: float) -> float:
        """Seconds ``key`` stays refused (0: it may try)."""
        peer = self._get(key, now)
        return max(0.0, peer.blocked_until - now) if peer is not None else 0.0

    def wait(self, key: str, now: float) -> float:
        """Seconds an attempt from ``key`` arriving now waits before it is checked (its turn is taken)."""
        peer = self._get(key, now)
        if peer is None:
            return 0.0
        at = max(now, peer.next_at)
        peer.next_at = at + self._delay(peer.failures)
        return at - now

    def failed(self, key: str, now: float) -> None:
        peer = self._get(key, now)
        if peer is None:
            while len(self._peers) >= self.MAX_PEERS:
                self._peers.popitem(last=False)
            peer = self._peers[key] = self._Peer()
        self._peers.move_to_end(key)
        peer.failures += 1
        peer.last = now
        peer.next_at = max(peer.next_at, now + self._delay(peer.failures))
        if peer.failures >= self.LOCKOUT_AFTER:
            peer.blocked_until = now + self.LOCKOUT_S


class StrangerGuard:
    """What the strangers of one server may cost, all of them together (see
    docs/design.md, "Strangers"): a share of the loop's time for their requests
    (served after members', in turn), a budget for the layout blocks being read,
    the failed-AUTH throttle, and memory handed back to the OS after they go."""

    def __init__(self) -> None:
        self.layout_free = LAYOUT_BUDGET
        self.throttle = AuthThrottle()
        self._waiting: deque[ServerSession] = deque()
        self._credit = STRANGER_BURST_S
        self._refilled = time.perf_counter()
        self._turn: asyncio.Handle | None = None
        self._trim: asyncio.TimerHandle | None = None

    def _refill(self) -> float:
        now = time.perf_counter()
        self._credit = min(STRANGER_BURST_S, self._credit + (now - self._refilled) * STRANGER_SHARE)
        self._refilled = now
        return now

    def may_serve_now(self) -> bool:
        """True when a stranger's request may be served at once (nobody waits, credit is left)."""
        if self._waiting:
            return False
        self._refill()
        return self._credit > 0

    def charge(self, seconds: float) -> None:
        self._credit = max(-STRANGER_BURST_S, self._credit - seconds)

    def enqueue(self, session: ServerSession) -> None:
        """``session`` holds a request for its turn."""
        self._waiting.append(session)
        self._schedule(session._loop)

    def _schedule(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._turn is not None or not self._waiting:
            return
        self._refill()
        if self._credit > 0:
            self._turn = loop.call_soon(self._serve, loop)  # after the callbacks ready now: members' I/O
        else:
            self._turn = loop.call_later(-self._credit / STRANGER_SHARE + 1e-3, self._serve, loop)

    def _serve(self, loop: asyncio.AbstractEventLoop) -> None:
        self._turn = None
        served = 0
        while self._waiting and served < STRANGERS_PER_TURN:
            started = self._refill()
            if self._credit <= 0:
                break
            session = self._waiting.popleft()
            if session._lost:
                continue
            served += 1
            session._serve_parked()
            self.charge(time.perf_counter() - started)
        self._schedule(loop)

    def released(self, loop: asyncio.AbstractEventLoop) -> None:
        """A stranger's buffers were let go: hand freed heap back to the OS soon (once for many)."""
        if self._trim is None and _malloc_trim is not None:
            self._trim = loop.call_later(TRIM_AFTER_S, self._trim_now)

    def _trim_now(self) -> None:
        self._trim = None
        _malloc_trim(0)


class Connections(set):
    """The open sessions of one server, and what they share (:attr:`guard`)."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.guard = StrangerGuard()


def _find_malloc_trim():
    """glibc's ``malloc_trim`` (None elsewhere): freed memory in the middle of the heap is
    kept by the allocator for reuse unless it is asked to give it back."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim


_malloc_trim = _find_malloc_trim()


class RateLimitedLog:
    """Warnings about events that come in floods (refused connections, accept
    failures): at most ``limit`` per ``window`` seconds, then one summary."""

    def __init__(self, limit: int = 5, window: float = 60.0, logger: logging.Logger | None = None) -> None:
        self.limit, self.window = limit, window
        self._log = logger or log
        self._since, self._count, self._dropped = float("-inf"), 0, 0

    def warning(self, now: float, message: str, *args) -> None:
        if now - self._since >= self.window:
            if self._dropped:
                self._log.warning("... and %d more like it in the last %.0f s", self._dropped, now - self._since)
            self._since, self._count, self._dropped = now, 0, 0
        if self._count < self.limit:
            self._count += 1
            self._log.warning(message, *args)
        else:
            self._dropped += 1


_refusals = RateLimitedLog()
_auth_failures = RateLimitedLog()
# Warnings about connections that have not joined (strangers, probes, fuzzers), all of them
# together: many connections must not flood the log any more than one may.
_strangers = RateLimitedLog(limit=50)

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
_FLOAT32 = int(DType.FLOAT32)
_CHECK = int(Flag.CHECK)
_STATE_FIXED = 8  # the fixed bytes that open a STATE reply or a LOAD_STATE payload


def dtype_name(code: int) -> str:
    try:
        return DType(code).name.lower()
    except ValueError:
        return f"unknown dtype code {code}"


class ServerSession:
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
        self._init_rank = -1
        self._intake: _InitIntake | None = None  # the INIT being read
        self._state_intake: _StateIntake | _WeightsIntake | None = None  # the LOAD_STATE (LOAD_WEIGHTS) being read
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

    def _write_parts(self, parts: tuple) -> None:
        """Write a frame given in parts (buffers kept by the transport until sent, not copied here)."""
        for part in parts:
            self._write(part)

    def _send_weights(self, op: int, snap: Snapshot, clock: int, flags: int) -> None:
        """Send the weights of ``snap``, keeping or releasing the lease as the transport needs."""
        raise NotImplementedError

    def _gradient_destination(self, member: Member, header: Header) -> memoryview | None:
        """Where a PUSH payload goes (None: there is none); raises a ServerError if malformed."""
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
            oldest = min(strangers, key=lambda c: c._connected_at)
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
    def announce_shutdown(self) -> None:
        """The server is stopping: say so, and send nothing after (see :meth:`close`).

        The server announces to every session before closing any, so no
        worker is released by another's departure in between.
        """
        if self._can_write():
            self._reply_error(0, ShuttingDown("the server is shutting down"))
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
            if op in _GRADIENT_OPS:
                member = self.member
                if member is None or member.grad is None:
                    raise NotInitialized(f"{Op(op).name} before a successful INIT")
                if header.dtype != _FLOAT32 and not (header.dtype in _HALF and self.compressed):
                    raise DTypeMismatch(f"gradient dtype is {dtype_name(header.dtype)}; the model is float32"
                                        + (f" (16-bit gradients cross TCP only, not {self.kind})"
                                           if header.dtype in _HALF else ""))
                self._grad_shift = 2 if header.dtype == _FLOAT32 else 1
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
                self._intake = _InitIntake(block, self._guard)
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
                self._state_intake = _StateIntake()
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
                self._state_intake = _WeightsIntake(numel)
                dest = self._state_intake.digest
            elif op == Op.SHARDS:
                if length > MAX_SHARDS_BYTES:
                    raise MalformedFrame(f"SHARDS carries {MAX_SHARDS_BYTES} bytes at most, got {length}")
                dest = memoryview(bytearray(length)) if length else None
            elif op in HANDSHAKE_OPS:
                limit = NONCE_BYTES
                if length > limit or (op == Op.AUTH and length != limit):
                    raise MalformedFrame(f"{Op(op).name} carries {limit} bytes at most, got {length}")
                dest = memoryview(bytearray(length)) if length else None
            elif length:
                raise MalformedFrame(f"{Op(op).name} carries no payload, got {length} bytes")
        except ServerError as exc:
            self._pending_error = exc
            return None
        self._pending_error = None
        return dest

    def frame_more(self, header: Header, got: int) -> memoryview | None:
        """An INIT's layout block has arrived: check it, then make room for the values
        only if this worker provides the model's initial weights; else discard them.
        A LOAD_STATE's: see :class:`_StateIntake`."""
        if self._pending_error is not None:
            return None
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
        if stream is not None:
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

    def _on_hello(self, header: Header, payload: memoryview, stream) -> None:
        if not self._authenticated:
            self._hellos += 1
            if self._hellos > 2:
                self._auth_failed("HELLO after HELLO without AUTH")
        self._client_nonce = bytes(payload)
        self._server_nonce = os.urandom(NONCE_BYTES)  # fresh for every HELLO: no proof is reused
        required = not self._authenticated
        self._reply(Op.HELLO_REPLY, payload=encode_hello_reply(required, self._server_nonce, host_identity(),
                                                              self.unix_path, self.engine.run_id,
                                                              self.engine.shard_description))

    def _on_auth(self, header: Header, payload: memoryview, stream) -> None:
        if self._token is None:
            raise AuthenticationError("this server has no token (it was started without --token)")
        if not self._server_nonce or len(self._client_nonce) != NONCE_BYTES:
            self._auth_failed("AUTH without a HELLO carrying a nonce first")
        # Guesses are throttled by the peer's address: every attempt after a few failures
        # waits its turn, longer and longer, and then the address is refused for a while.
        if self._refused():
            return
        wait = self._guard.throttle.wait(self.peer_key, self._loop.time())
        proof = bytes(payload)
        if wait > 0:
            self.engine.stats.auth["throttled"] += 1
            self._loop.call_later(wait, self._check_proof, proof)
        else:
            self._check_proof(proof)

    def _refused(self) -> bool:
        """Refuse the AUTH attempt (and close) while the peer's address is locked out."""
        now = self._loop.time()
        refused = self._guard.throttle.refused_for(self.peer_key, now)
        if not refused:
            return False
        self.engine.stats.auth["refused"] += 1
        _auth_failures.warning(now, "%s: refused an AUTH attempt: too many failed ones from %s", self.peer,
                               self.peer_key)
        self._fatal(ServerOverloaded(
            f"too many failed authentications from {self.peer_key}: refused for {refused:.0f} s more"), warn=False)
        return True

    def _check_proof(self, proof: bytes) -> None:
        # (attempts that waited their turn meet a lockout that began meanwhile)
        if self._lost or self._refused():
            return
        expected = auth_proof(self._token, "client", self._server_nonce, self._client_nonce)
        if not hmac.compare_digest(expected, proof):
            self._guard.throttle.failed(self.peer_key, self._loop.time())
            try:
                self._auth_failed("a wrong token")
            except AuthenticationError as exc:
                self._fatal(exc, warn=False)
            return
        self._authenticated = True
        proof = auth_proof(self._token, "server", self._server_nonce, self._client_nonce)
        self._server_nonce = b""  # one AUTH per nonce
        self._reply(Op.AUTH_REPLY, payload=encode_auth_reply(proof, host_identity(), self.unix_path,
                                                             self.engine.run_id, self.engine.shard_description))

    def _auth_failed(self, what: str) -> NoReturn:
        """The peer failed the handshake: log it (rate-limited, with its address), count it, refuse, close."""
        self.engine.stats.auth["failures"] += 1
        _auth_failures.warning(self._loop.time(), "%s: authentication failed: %s; closing the connection",
                               self.peer, what)
        raise AuthenticationError(
            f"authentication failed: {what}; the server needs its token (aps.Worker(token=...) or $APS_TOKEN)"
        )

    def _on_init(self, header: Header, payload: memoryview, stream) -> None:
        intake = self._intake
        try:
            request = intake.check(self.engine, header.length)  # checked already, unless there were no values
            self._init_rank = request.rank
            values, intake.values = intake.values, None  # the engine's now: not kept here while INIT waits
            member = self.engine.join(
                request.rank,
                request.num_workers,
                request.layout,
                values,
                self._send_init_reply,
                self._init_failed,
                grad=self._gradient_buffer(request),
                rejoin=bool(header.flags & Flag.REJOIN),
            )
        except BaseException:
            self._end_intake()
            raise
        if member.connected:  # not refused while joining
            self.member = member
            log.debug("%s: INIT as rank %d over %s", self.peer, member.rank, self.kind)

    def _on_pull(self, header: Header, payload: memoryview, stream) -> None:
        self.engine.pull(self._require_member(), self._send_pull_reply)

    def _on_push(self, header: Header, payload: memoryview, stream) -> None:
        self.engine.push(self._require_member(), header.version, self._send_push_reply, self._fail, stream=stream,
                         request_id=header.request_id, clock=header.clock)

    def _on_push_pull(self, header: Header, payload: memoryview, stream) -> None:
        self.engine.push(self._require_member(), header.version, self._pushed_then_pull, self._fail, stream=stream,
                         request_id=header.request_id, clock=header.clock)

    def _on_leave(self, header: Header, payload: memoryview, stream) -> None:
        member = self._require_member()
        self.member = None
        self.engine.leave(member, "left")
        self._reply(Op.LEAVE_REPLY)

    def _on_checkpoint(self, header: Header, payload: memoryview, stream) -> None:
        request = self.engine.request_checkpoint
        if request is None:
            raise CheckpointFailed("this server writes no checkpoints (start it with --checkpoint-dir)")
        request("request").add_done_callback(self._checkpoint_written)

    def _checkpoint_written(self, future) -> None:
        if self._lost:
            return
        exc = future.exception()
        if isinstance(exc, ServerError):
            self._fail(exc)
            return
        if exc is not None:
            self._fail(InternalServerError(f"the checkpoint failed: {exc}"))
            return
        info = future.result()
        self._reply(Op.CHECKPOINT_REPLY, version=info["version"], payload=json.dumps(info).encode())

    def _on_rewind(self, header: Header, payload: memoryview, stream) -> None:
        self._require_member()
        request = self.engine.request_rewind
        if request is None:
            raise CheckpointFailed("this server cannot rewind to a checkpoint: it writes none (--checkpoint-dir), "
                                   "or it is not an `aps serve` process (only those restart themselves)")
        request(None if header.flags & _CHECK else header.version).add_done_callback(self._rewind_answered)

    def _rewind_answered(self, future) -> None:
        if self._lost:
            return
        exc = future.exception()
        if exc is not None:
            self._fail(exc if isinstance(exc, ServerError) else InternalServerError(f"the rewind failed: {exc}"))
            return
        info = future.result()
        self._reply(Op.REWIND_REPLY, version=info["version"], payload=json.dumps(info).encode())

    def _on_shards(self, header: Header, payload: memoryview, stream) -> None:
        self._require_member()
        try:
            runs = json.loads(bytes(payload).decode("utf-8"))
        except (ValueError, RecursionError):
            raise MalformedFrame("SHARDS takes a JSON list of the shards' run ids") from None
        self.engine.record_shard_runs(runs)
        self._reply(Op.SHARDS_REPLY)

    def _on_hyper(self, header: Header, payload: memoryview, stream) -> None:
        self.engine.set_hyperparameters(self._require_member(), decode_hyper(payload),
                                        check_only=bool(header.flags & Flag.CHECK))
        self._reply(Op.HYPER_REPLY)

    def _on_state(self, header: Header, payload: memoryview, stream) -> None:
        self.engine.read_optimizer_state(self._require_member(), self._send_state, self._fail)

    def _send_state(self, copy: StateCopy) -> None:
        if self._can_write() and not self._silenced:
            frame = pack_header(Op.STATE_REPLY, 0, _FLOAT32, self._rid, 0, copy.version, copy.nbytes) + copy.head
            self._traffic.bytes_out += len(frame) + copy.arrays.nbytes
            # The transport keeps the copy alive until it has sent it: one reply per connection.
            self._write_parts((frame, memoryview(copy.arrays).cast("B")) if copy.arrays.size else (frame,))
        self._done()

    def _on_load_state(self, header: Header, payload: memoryview, stream) -> None:
        member = self._require_member()
        intake, self._state_intake = self._state_intake, None
        head = intake.check(self.engine, header)
        if header.flags & _CHECK or intake.kept:  # (Flag.CHECK: a sharded worker asks every shard first)
            self._state_loaded(not intake.kept)
            return
        self.engine.load_optimizer_state(member, head, intake.arrays, self._state_loaded, self._fail)

    def _state_loaded(self, loaded: bool) -> None:
        self._reply(Op.LOAD_STATE_REPLY, version=self.engine.version, flags=0 if loaded else Flag.DROPPED)

    def _on_load_weights(self, header: Header, payload: memoryview, stream) -> None:
        member = self._require_member()
        intake, self._state_intake = self._state_intake, None
        intake.check(self.engine, header)
        if header.flags & _CHECK or intake.kept:  # (Flag.CHECK: a sharded worker asks every shard first)
            self._weights_loaded(not intake.kept)
            return
        self.engine.load_weights(member, bytes(intake.digest), intake.values, header.version, self._weights_loaded,
                                 self._fail)

    def _weights_loaded(self, loaded: bool) -> None:
        self._reply(Op.LOAD_WEIGHTS_REPLY, version=self.engine.version, flags=0 if loaded else Flag.DROPPED)

    def _on_stats(self, header: Header, payload: memoryview, stream) -> None:
        snapshot = self.engine.stats_snapshot()
        self._reply(Op.STATS_REPLY, version=self.engine.version, payload=json.dumps(snapshot).encode())

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
        self.engine.pull(self.member, self._send_push_pull_reply)

    def _send_push_reply(self, result: PushResult) -> None:
        flags = Flag.DROPPED if result.dropped else 0
        self._reply(Op.PUSH_REPLY, clock=result.clock, version=result.version, flags=flags)

    def _send_init_reply(self, snap: Snapshot, clock: int) -> None:
        # The reply may come before engine.join() returns: find the member by rank.
        member = self.engine.members.get(self._init_rank)
        self._intake = None
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
            frame = pack_header(op, flags, 0, self._rid, clock, version, len(payload)) + payload
            self._traffic.bytes_out += len(frame)
            self._write(frame)
        self._done()

    def _reply_weights(self, op: int, snap: Snapshot, clock: int, flags: int) -> None:
        if not self._can_write() or self._silenced:
            snap.release()
        else:
            try:
                self._send_weights(op, snap, clock, flags)
            except Exception:  # out of descriptors, say: this connection cannot be answered
                log.exception("%s: sending weights failed; dropping the connection", self._who())
                snap.release()
                self.abort()
                return
        self._done()

    def _reply_error(self, rid: int, exc: ServerError, *, warn: bool = True) -> None:
        """Send an error frame (does not end the request: callers decide)."""
        if warn:
            self._warn("%s: %s", exc.code.name, exc.message)
        if self._can_write() and not self._silenced:
            payload = encode_error(exc.code, exc.message)
            frame = pack_header(Op.ERROR, 0, 0, rid, 0, 0, len(payload)) + payload
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


class _InitIntake:
    """An INIT being read: its layout block first, in pieces that grow only as its
    bytes arrive (a header alone costs nothing), then its values only if needed.

    Every piece but the first is drawn from the server's layout budget
    (:data:`LAYOUT_BUDGET`, all connections together), and is a mapping of its own, so
    that what a sender made the server hold goes back to the OS when it is let go,
    rather than staying in the allocator's heap."""

    __slots__ = ("block_bytes", "pieces", "request", "values", "registering", "_guard", "_charged")

    PIECE = 64 << 10

    def __init__(self, block_bytes: int, guard: StrangerGuard) -> None:
        self.block_bytes = block_bytes
        self.pieces: list = []
        self.request: InitRequest | None = None
        self.values: np.ndarray | None = None
        self.registering = False
        self._guard = guard
        self._charged = 0

    def next_piece(self, got: int) -> memoryview:
        """Room for the next bytes of the layout block (``got`` of it have arrived);
        raises ServerOverloaded when the server's layout budget is spent."""
        size = min(self.PIECE, self.block_bytes - got)
        if not self.pieces:
            piece = bytearray(size)
        else:
            guard = self._guard
            if guard.layout_free < size:
                self.release()
                raise ServerOverloaded(
                    f"the server is reading {LAYOUT_BUDGET >> 20} MiB of INIT layout blocks already (a layout "
                    f"block of {self.block_bytes} bytes is large: it describes tensors, not their values); "
                    "try again later")
            guard.layout_free -= size
            self._charged += size
            piece = mmap.mmap(-1, size)
        self.pieces.append(piece)
        return memoryview(piece)

    def release(self) -> None:
        """Let go of the pieces, and give back what they drew from the budget."""
        self.pieces = []
        if self._charged:
            self._guard.layout_free += self._charged
            self._charged = 0

    def check(self, engine: Engine, payload_bytes: int) -> InitRequest:
        """Parse the layout block and check the join it asks for (raises a ServerError)."""
        if self.request is None:
            block = b"".join(self.pieces)
            self.release()
            request = decode_layout_block(block)
            values = payload_bytes - len(block)
            if values != request.layout.nbytes:
                raise PayloadSizeMismatch(
                    f"INIT carries {values} bytes of values; its layout needs {request.layout.nbytes}"
                )
            engine.check_join(request.rank, request.num_workers, request.layout)
            self.request = request
        return self.request


class _StateIntake:
    """A LOAD_STATE being read: its 8 fixed bytes, its description, checked against the
    model and the run (the arrays' names and sizes, the payload's length, whether this
    state can be loaded now or was loaded already), and only then its arrays, in pieces
    made as their bytes arrive: what a sender makes the server hold is never more than
    it has sent (and at most the frame limit). A state loaded already is read and dropped."""

    __slots__ = ("fixed", "rest", "head", "kept", "arrays", "_numel")

    #: Elements of the largest piece an array is received in (16 MiB).
    PIECE = 4 << 20

    def __init__(self) -> None:
        self.fixed = memoryview(bytearray(_STATE_FIXED))
        self.rest: bytearray | None = None
        self.head: StateHead | None = None
        self.kept = False
        self.arrays: dict[str, list[np.ndarray]] = {}
        self._numel = 0

    def check(self, engine: Engine, header: Header) -> StateHead:
        """Parse the description and check it (raises a ServerError); once the head has arrived."""
        if self.head is None:
            nbytes = state_head_bytes(self.fixed)
            if header.length < nbytes or (self.rest is None and nbytes > _STATE_FIXED):
                raise MalformedFrame(f"LOAD_STATE payload of {header.length} bytes; its description takes {nbytes}")
            head = decode_state_head(bytes(self.fixed) + bytes(self.rest or b""))
            self.kept = engine.check_state(head)
            expected = head.nbytes if header.flags & _CHECK else head.payload_bytes
            if header.length != expected:
                what = "its description alone (CHECK)" if header.flags & _CHECK else \
                    f"{len(head.arrays)} arrays of {head.numel} float32 after a {head.nbytes}-byte head"
                raise PayloadSizeMismatch(f"LOAD_STATE payload of {header.length} bytes; {what} take {expected}")
            self.head, self._numel = head, head.numel
            self.arrays = {name: [] for name in head.arrays}
        return self.head

    def next_part(self, engine: Engine, header: Header, got: int) -> memoryview | None:
        """Where the payload's bytes from ``got`` on go (None: read and drop them)."""
        if self.head is None:
            if self.rest is None:
                size = state_head_bytes(self.fixed) - _STATE_FIXED
                if size > 0:
                    self.rest = bytearray(min(size, header.length - got))
                    return memoryview(self.rest)
            self.check(engine, header)
            if self.kept:
                return None
        offset = (got - self.head.nbytes) // 4  # elements of the arrays received so far
        index, start = divmod(offset, self._numel)
        piece = np.empty(min(self.PIECE, self._numel - start), np.float32)
        self.arrays[self.head.arrays[index]].append(piece)
        return memoryview(piece).cast("B")


class _WeightsIntake:
    """A LOAD_WEIGHTS being read: its digest, checked against the run (whether weights can
    be loaded now, or these were loaded already), and only then room for the weights, made
    when they are to be loaded (the rest is read and dropped)."""

    __slots__ = ("digest", "numel", "kept", "checked", "values")

    def __init__(self, numel: int) -> None:
        self.digest = memoryview(bytearray(WEIGHTS_DIGEST_BYTES))
        self.numel = numel
        self.kept = False
        self.checked = False
        self.values: np.ndarray | None = None

    def check(self, engine: Engine, header: Header) -> None:
        """Check the digest against the run (raises a ServerError); once it has arrived."""
        if not self.checked:
            self.kept = engine.check_weights(bytes(self.digest), self.numel, header.version)
            self.checked = True

    def next_part(self, engine: Engine, header: Header, got: int) -> memoryview | None:
        """Where the weights go, once the digest is in (None: read and drop them)."""
        self.check(engine, header)
        if self.kept:
            return None
        self.values = np.empty(self.numel, np.float32)
        return memoryview(self.values).cast("B")


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
}


def _op_name(op: int) -> str:
    try:
        return Op(op).name
    except ValueError:
        return f"op {op}"
