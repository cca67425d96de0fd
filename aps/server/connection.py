"""The server side of one worker connection: its frames, its current request, its liveness.

A :class:`Connection` holds its transport (:mod:`aps.server.tcp` or :mod:`aps.server.shm`),
its frame parser (the one :class:`~aps.wire.framing.FrameReader`), its handshake and the
member it joined as. When a header arrives it makes the request a value
(:class:`~aps.server.requests.Request`) and looks its op up in :data:`~aps.server.requests.HANDLERS`;
the handler says where the payload goes, and serves the request once the frame is in. A
connection handles one request at a time, in order (a worker never has two in flight):
bytes a peer sends early wait in the reader's staging buffer, and reading pauses if that
fills. It keeps nothing of any op: what a request needs is on the request.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING

from ..errors import (
    AuthenticationError,
    Evicted,
    InternalServerError,
    MalformedFrame,
    NotInitialized,
    ServerError,
    ServerOverloaded,
    ShuttingDown,
    UnknownOp,
)
from ..wire.framing import FrameReader
from ..wire.protocol import HANDSHAKE_OPS, Flag, Header, Op, encode_error, is_known_op, pack_header
from .admission import ReplyGate, StrangerGuard, _refusals, _strangers
from .handshake import Handshake
from .requests import HANDLERS, Request
from .requests.base import op_name
from .requests.handshake import refuse

if TYPE_CHECKING:
    import numpy as np

    from .engine import Engine
    from .engine.members import Member
    from .engine.table import Snapshot
    from .transport import Transport

__all__ = ["Connection"]

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
#: The replies a replica set's primary sends without waiting for its backups: they tell
#: nothing a failover could take back (the handshake, a PING, the statistics).
_UNGATED = frozenset({Op.HELLO, Op.AUTH, Op.PING, Op.STATS})


class Connection:
    """One worker's connection (see the module docstring).

    Args:
        engine: the server's engine.
        transport: what carries its bytes (it reports its events here).
        max_payload: the frame limit.
        registry: the server's open connections (this adds and removes itself); its
            ``guard`` (:class:`~aps.server.admission.StrangerGuard`) is what strangers share.
        unix_path: the server's Unix socket for co-located workers ("" if none), announced
            in HELLO replies.
        token: the shared secret a peer must prove it knows (HELLO, AUTH) before anything
            else is served; None: no authentication.
    """

    def __init__(
        self,
        engine: Engine,
        transport: Transport,
        max_payload: int,
        registry: set,
        unix_path: str = "",
        token: bytes | None = None,
    ) -> None:
        self.engine = engine
        self.transport = transport
        self.registry = registry
        self.unix_path = unix_path
        self.guard: StrangerGuard = getattr(registry, "guard", None) or StrangerGuard()
        self.replication: ReplyGate | None = getattr(registry, "replication", None)
        self.handshake = Handshake(token, self.guard.throttle)
        self.traffic = engine.stats.traffic[transport.kind]
        self.reader = FrameReader(self, max_payload=max_payload)
        self.loop = asyncio.get_event_loop()
        self.member: Member | None = None
        #: The request being read or served (one at a time), None between requests.
        self.request: Request | None = None
        self._parked: memoryview | None = None  # a stranger's request waiting its turn: its payload
        self._dispatching = False
        self._reading_paused = False
        self._deferred = False  # a request finished while writing: resume after the drain
        self._fatal_sent = False
        self._lost = False
        self._evicted = False  # dropped by the server (see evict), not lost by the peer
        self._silenced = False  # the server is shutting down: no more replies
        self._bad_in_row = 0  # refused frames since the last request that was answered
        now = self.loop.time()
        # Liveness (see watch()): when the worker last sent a byte or was answered,
        # whether the server holds one of its requests, and how its reply drains.
        self.last_heard = now
        self.connected_at = now
        self._open_request = False
        self._last_notice = now
        self._unsent_seen = -1
        self._drain_seen = now
        self._frame_started = now  # when the first byte of the frame being read arrived
        self._frames = 0  # frames read in all
        self._warned = 0  # warnings logged in the current window, and since when
        self._warn_window = now
        self._unlogged = 0  # warnings kept out of the log

    @property
    def peer(self) -> str:
        return self.transport.peer

    @property
    def peer_key(self) -> str:
        """Whom the peer counts as (its user, or its address), for room and turns."""
        return self.transport.peer_key

    @property
    def lost(self) -> bool:
        return self._lost

    @property
    def authenticated(self) -> bool:
        return self.handshake.authenticated

    @property
    def trusted(self) -> bool:
        """The peer has joined, or proved that it knows the server's token."""
        return self.member is not None or self.handshake.proved

    # Events from the transport -------------------------------------------------
    def opened(self) -> bool:
        """Take the connection, unless the server has ``--max-connections`` already: then
        the oldest stranger (see :attr:`trusted`) makes room for it, and when there is
        none, it is told so and closed (False)."""
        limit = self.engine.config.max_connections
        if len(self.registry) >= limit:
            strangers = [c for c in self.registry if not c.trusted and not c.lost]
            if not strangers:
                _refusals.warning(
                    self.loop.time(), "refused a connection from %s: --max-connections %d reached", self.peer, limit
                )
                payload = encode_error(
                    ServerOverloaded.code,
                    f"the server has {limit} connections already (--max-connections); try again later",
                )
                self.transport.write(pack_header(Op.ERROR, 0, 0, 0, 0, 0, len(payload)) + payload)
                self._silenced = True
                self.close()
                return False
            # The oldest of whoever holds the most: a flood of one user's (or one address's)
            # connections makes room with its own, not with another's handshake.
            held = Counter(c.peer_key for c in strangers)
            crowd = max(held, key=held.__getitem__)
            oldest = min((c for c in strangers if c.peer_key == crowd), key=lambda c: c.connected_at)
            oldest.evict("made room for a newer connection (--max-connections reached)", abort=True)
        self.registry.add(self)
        return True

    def get_buffer(self) -> memoryview:
        return self.reader.get_buffer()

    def bytes_arrived(self, nbytes: int) -> None:
        now = self.last_heard = self.loop.time()
        if not self.reader.in_frame:
            self._frame_started = now
        self.traffic.bytes_in += nbytes
        try:
            self.reader.buffer_updated(nbytes)
        except AuthenticationError as exc:  # logged already, rate-limited across connections
            self.fatal(exc, warn=False)
            return
        except ServerError as exc:
            self.fatal(exc)
            return
        except Exception as exc:
            log.exception("%s: internal error while reading", self._who())
            self.fatal(InternalServerError(f"internal error: {exc}"))
            return
        self._maybe_pause_reading()

    def output_drained(self) -> None:
        """Everything written so far has left: a request that finished meanwhile lets the next frame in."""
        if not self._open_request:  # the worker has its reply: its own time starts now
            self.last_heard = self.loop.time()
        self.transport.reply_left()
        if self._deferred:
            self._deferred = False
            self.loop.call_soon(self._resume)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._lost:
            return
        if self.reader.in_frame and not self._fatal_sent:
            self.warn("connection lost in the middle of a frame; the partial frame is discarded")
        elif exc is not None:
            (log.info if self.member is not None else log.debug)("%s: connection lost: %s", self._who(), exc)
        else:
            log.debug("%s: disconnected", self._who())
        request, self.request = self.request, None
        if request is not None:
            if request.stream is not None:  # (a gradient being read, not handed to the engine yet)
                request.stream.abort()
                request.stream = None
            request.end_intake(self.engine, self)
        self._parked = None
        was_member = self.member is not None
        if not was_member:
            self.guard.released(self.loop)
        if self._unlogged and was_member:
            log.warning("%s: closed; %d more warnings about it were not logged", self._who(), self._unlogged)
        if self.member is not None:
            self.engine.membership.leave(self.member, "timed out" if self._evicted else "disconnected")
            self.member = None
        self._lost = True
        self.reader.detach()
        if self._unlogged and not was_member:
            _strangers.warning(
                self.loop.time(), "%s: closed; %d more warnings about it were not logged", self._who(), self._unlogged
            )
        self.transport.release_leases()
        self.registry.discard(self)

    # Server control -------------------------------------------------------------
    def announce_shutdown(self, notice: ShuttingDown, resumable: bool) -> None:
        """The server is stopping: say so (``resumable``: it can be resumed where it stops,
        flag RESUMABLE), and send nothing after (see :meth:`close`).

        The server announces to every connection before closing any, so no worker is
        released by another's departure in between.
        """
        if self.transport.can_write():
            self._reply_error(0, notice, warn=False, flags=Flag.RESUMABLE if resumable else 0)
        self._silenced = True

    def notify_join_progress(self, payload: bytes) -> None:
        """Tell a worker whose INIT waits for the others how many have joined (a JOIN_PROGRESS notice)."""
        member = self.member
        if member is not None and self.engine.membership.waiting_to_start(member) and not self.transport.writing:
            self.notice(Op.JOIN_PROGRESS, payload)

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
            begun = self._frame_started if self.reader.in_frame else (None if self._frames else self.connected_at)
            if begun is not None and now - begun > deadline:
                self.evict(f"completed no frame within {deadline:g} s (--handshake-timeout)", abort=False)
                return
            if not self.trusted and now - self.connected_at > deadline:
                what = "authenticated" if self.handshake.token is not None else "joined"
                self.evict(f"neither {what} nor left within {deadline:g} s (--handshake-timeout)", abort=False)
                return
        if self._open_request:
            every = min(ALIVE_EVERY_S, timeout / 3) if timeout > 0 else ALIVE_EVERY_S
            config = self.engine.config
            if config.replicas is not None:  # (its workers turn to the backups after 2 --failover-timeout)
                every = min(every, config.failover_timeout / 2)
            if now - self._last_notice >= every and not self.transport.writing:
                self.notice(Op.ALIVE)
            return
        if timeout <= 0:
            return
        if self.transport.writing:
            unsent = self.transport.unsent()
            if unsent != self._unsent_seen:
                self._unsent_seen, self._drain_seen = unsent, now
            elif now - self._drain_seen > timeout:
                self.evict(f"read nothing of its reply for {now - self._drain_seen:.0f} s", abort=True)
            return
        if now - self.last_heard > timeout:
            self.evict(f"sent nothing for {now - self.last_heard:.0f} s (missed heartbeats)", abort=False)

    def evict(self, reason: str, *, abort: bool) -> None:
        """Drop the connection (it may reconnect): ``abort``, at once, when its socket takes
        nothing more; else after telling it why."""
        self._evicted = True
        self.warn("%s: dropping it (it may rejoin)", reason)
        if abort:
            self.abort()
            return
        self._reply_error(0, Evicted(f"the server dropped this connection: the worker {reason}; reconnect() rejoins"))
        self.close()

    # The frame parser's handler (aps.wire.framing.FrameHandler) -------------------------------
    def frame_buffer(self, header: Header) -> memoryview | None:
        """A header arrived: make its request, and ask its handler where the payload goes."""
        op = header.op
        handler = HANDLERS.get(op)
        if not self.handshake.authenticated and op not in HANDSHAKE_OPS:
            # Fatal (the reader closes the connection): nothing is served, read or kept for a stranger.
            refuse(self, f"a {op_name(op)} request before the handshake")
        request = self.request = Request(header, handler)
        try:
            if handler is None:
                kind = "a reply" if is_known_op(op) else "unknown"
                raise UnknownOp(f"op code {op} is {kind}, not a request")
            if request.rows and not handler.carries_rows:
                raise MalformedFrame(f"{op_name(op)} carries no rows")
            return handler.admit(self, request)
        except ServerError as exc:
            request.error = exc
            return None

    def frame_more(self, header: Header, got: int) -> memoryview | None:
        """The first ``got`` bytes of the payload are in: where the next go (the handler says)."""
        request = self.request
        if request is None or request.error is not None or request.handler is None:
            return None
        try:
            return request.handler.more(self, request, got)
        except ServerError as exc:
            request.error = exc
            return None

    def payload_progress(self, filled: int) -> None:
        request = self.request
        if request is not None and request.stream is not None:  # (never a request with rows: it does not stream)
            request.stream.feed(filled >> request.grad_shift)  # whole elements only; the update checks each one

    def frame_received(self, header: Header, payload: memoryview) -> None:
        self._frames += 1
        self.transport.frame_arrived(header)
        if self.member is not None:
            self._serve(payload)
            return
        # A stranger's request: served in its turn, after members', within the strangers'
        # share of the loop (see StrangerGuard). It holds its reader meanwhile: one request
        # of a connection at a time, so a pipelining stranger has one parked, no more.
        self.reader.hold()
        guard = self.guard
        if not guard.may_serve_now():
            self._parked = payload
            guard.enqueue(self)
            return
        started = time.perf_counter()
        try:
            self._serve(payload)
        finally:
            guard.charge(time.perf_counter() - started)

    def serve_parked(self) -> None:
        """The stranger's turn has come (StrangerGuard): serve its parked request."""
        parked, self._parked = self._parked, None
        if parked is None or self._lost:
            return
        self._serve(parked)
        if not self._lost and not self.reader.held:  # answered at once: the frames behind it
            self.reader.hold()
            self._resume()

    def _serve(self, payload: memoryview) -> None:
        """The current request's frame is in: its handler serves it (or its error is its reply)."""
        request = self.request
        assert request is not None
        error = request.error
        if error is not None or request.handler is None:
            assert error is not None
            request.end_intake(self.engine, self)
            self._bad_in_row += 1
            if self._bad_in_row >= MAX_BAD_FRAMES:
                self.warn("%d refused frames in a row: closing the connection", self._bad_in_row, force=True)
                self.fatal(
                    error.__class__(
                        f"{error.message} ({self._bad_in_row} refused frames in a row: closing the connection)"
                    )
                )
                return
            # An error is a reply like any other: the next frame waits until it has left,
            # so a peer that sends bad frames and reads nothing fills no queue.
            self.reader.hold()
            self._open_request = True
            self.fail(request, error)
            return
        # One request at a time: later frames wait in the reader until done().
        self.reader.hold()
        self._open_request = True
        self._last_notice = self.loop.time()
        self._dispatching = True
        try:
            request.handler.handle(self, request, payload)
        except AuthenticationError as exc:
            self.fatal(exc, warn=False)
        except ServerError as exc:
            if request.stream is not None:
                request.stream.abort()
                request.stream = None
            self._bad_in_row += 1
            self.fail(request, exc)
        except Exception as exc:
            log.exception("%s: internal error handling %s", self._who(), op_name(request.op))
            self.fail(request, InternalServerError(f"internal error: {exc}"))
        finally:
            self._dispatching = False

    # What handlers are given (aps.server.requests.Exchange) ---------------------------
    def require_member(self) -> Member:
        if self.member is None:
            raise NotInitialized("request before a successful INIT")
        return self.member

    def can_reply(self) -> bool:
        return self.transport.can_write() and not self._silenced

    def _when_replicated(self, send: Callable[..., None], *args: object) -> None:
        """``send(*args)`` now, or (a replica set's primary) once the backups hold what it tells:
        a worker is never told of an update a failover could take back. A PING's and the
        STATS' replies tell nothing of the kind; errors change nothing. (No closure is made
        for a reply that is sent at once: the push/pull path pays nothing without replicas.)"""
        gate, request = self.replication, self.request
        if gate is None or request is None or request.op in _UNGATED:
            send(*args)
        else:
            gate.hold(functools.partial(send, *args))

    def reply(
        self, request: Request, op: int, *, clock: int = 0, version: int = 0, flags: int = 0, payload: bytes = b""
    ) -> None:
        self._when_replicated(self._send_reply, request, op, clock, version, flags, payload)

    def _send_reply(self, request: Request, op: int, clock: int, version: int, flags: int, payload: bytes) -> None:
        if self.can_reply():
            live = self.engine.policy.num_live if self.member is not None else 0  # (said to workers only)
            frame = pack_header(op, flags, 0, request.rid, clock, version, len(payload), live) + payload
            self.traffic.bytes_out += len(frame)
            self.transport.write(frame)
        self.done()

    def reply_parts(self, parts: tuple, nbytes: int, fds: tuple = ()) -> None:
        self._when_replicated(self._send_parts, parts, nbytes, fds)

    def _send_parts(self, parts: tuple, nbytes: int, fds: tuple) -> None:
        if self.can_reply():
            self.traffic.bytes_out += nbytes
            self.transport.write_parts(parts, fds)
        self.done()

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
        self._when_replicated(self._send_weights, request, op, snap, clock, flags, rows, fds, narrowed)

    def _send_weights(
        self,
        request: Request,
        op: int,
        snap: Snapshot,
        clock: int,
        flags: int,
        rows: tuple,
        fds: tuple,
        narrowed: np.ndarray | None,
    ) -> None:
        if not self.can_reply():
            snap.release()
        else:
            try:
                self.transport.send_weights(
                    op,
                    request.rid,
                    snap,
                    clock,
                    flags,
                    self.engine.policy.num_live,
                    rows,
                    fds,
                    narrowed,
                    request.weights_dtype,
                )
            except Exception:  # out of descriptors, say: this connection cannot be answered
                log.exception("%s: sending weights failed; dropping the connection", self._who())
                snap.release()
                self.abort()
                return
        self.done()

    def fail(self, request: Request, exc: ServerError) -> None:
        self._reply_error(request.rid, exc)
        self.done(ok=False)

    def fatal(self, exc: ServerError, *, warn: bool = True) -> None:
        """Framing is lost (or the peer failed the handshake): say why, then close
        this connection (only this one)."""
        if self._fatal_sent:
            return
        self._fatal_sent = True
        self._reply_error(0, exc, warn=warn)
        self.reader.hold()
        self.close()

    def notice(self, op: int, payload: bytes = b"") -> None:
        """A frame for the open request that does not answer it (ALIVE, JOIN_PROGRESS, SEATED)."""
        if not self.can_reply():
            return
        rid = self.request.rid if self.request is not None else 0
        frame = pack_header(op, 0, 0, rid, 0, 0, len(payload)) + payload
        self.traffic.bytes_out += len(frame)
        self._last_notice = self.loop.time()
        self.transport.write(frame)

    def done(self, ok: bool = True) -> None:
        """The current request is answered (``ok``: not with an error): go on with the next frame.

        Not before the reply has left, though: a client that sends requests
        without reading replies would otherwise pin a snapshot slot per reply,
        or pile up error frames.
        """
        if ok:
            self._bad_in_row = 0
        self.request = None
        self._open_request = False
        self.last_heard = self.loop.time()  # answered: the worker's own time starts now
        self._unsent_seen = -1
        if self.transport.writing:
            self._deferred = True
        elif self._dispatching:
            self.reader.release(parse=False)
        else:
            self.loop.call_soon(self._resume)

    def close(self) -> None:
        """Close after what is written has left."""
        self.transport.close()

    def abort(self) -> None:
        """Close at once, dropping whatever is still unsent."""
        self.transport.abort()

    # Inside ---------------------------------------------------------------------------
    def _reply_error(self, rid: int, exc: ServerError, *, warn: bool = True, flags: int = 0) -> None:
        """Send an error frame (does not end the request: callers decide)."""
        if warn:
            self.warn("%s: %s", exc.code.name, exc.message)
        if self.can_reply():
            payload = encode_error(exc.code, exc.message)
            frame = pack_header(Op.ERROR, flags, 0, rid, 0, 0, len(payload)) + payload
            self.traffic.bytes_out += len(frame)
            self.transport.write(frame)

    def _resume(self) -> None:
        if self._lost or not self.transport.can_write() or not self.reader.held:
            return
        try:
            self.reader.release()
        except ServerError as exc:
            self.fatal(exc)
            return
        if self._reading_paused and self.reader.staging_half_empty():
            self._reading_paused = False
            self.transport.resume_reading()
        self._maybe_pause_reading()

    def _maybe_pause_reading(self) -> None:
        if not self._reading_paused and self.reader.held and self.reader.staging_full():
            self._reading_paused = True
            self.transport.pause_reading()

    def warn(self, message: str, *args: object, force: bool = False) -> None:
        """Log a warning about this connection, at most WARNINGS_PER_WINDOW a window
        (a peer sending garbage cannot flood the log); the rest are counted. Warnings
        about peers that have not joined also share one budget across connections;
        ``force`` logs past this connection's budget (not past that one)."""
        now = self.loop.time()
        if now - self._warn_window >= WARNING_WINDOW_S:
            if self._unlogged:
                log.warning(
                    "%s: %d more warnings about it in the last %.0f s were not logged",
                    self._who(),
                    self._unlogged,
                    now - self._warn_window,
                )
            self._warn_window, self._warned, self._unlogged = now, 0, 0
        if self._warned < WARNINGS_PER_WINDOW or force:
            self._warned += 1
            if self.member is None:
                _strangers.warning(now, "%s: " + message, self._who(), *args)
            else:
                log.warning("%s: " + message, self._who(), *args)
        else:
            self._unlogged += 1

    def _who(self) -> str:
        member = self.member
        return f"{self.peer} (rank {member.rank})" if member is not None else self.peer
