"""Pushes in flight: an :class:`aps.AsyncWorker` made with ``pipeline=N`` sends a dense push
and goes on without waiting for its answer, with up to N pushes unanswered on each server's
connection. The server answers them in order (it serves one request of a connection at a
time, and reads the next from its staging buffer at once), so one worker keeps its server's
update lane busy instead of waiting a round trip for each push.

A :class:`Pipeline` is one channel's: it sends under the channel's lock (a request the
steps send waits until every push in flight is answered, see
:meth:`aps.client.channel.AsyncChannel.drain`), and while pushes are in flight a task of
its own reads their answers, taking the channel's frame reader for that time
(:meth:`aps.wire.framing.FrameReader.hand_to`). A refused push (a NaN in it, say) is
raised at the worker's next call, and the pushes after it are applied. A connection that
is lost with pushes in flight is opened again and joined again as any call's would be, and
every push that was not answered is sent again, as first sent: the server answers those it
took already without applying them again (docs/protocol.md, "Duplicates"). Each one is
kept until answered for that: ``N`` copies of the gradient at most.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

from ..errors import APSError, ConfigurationError, MalformedFrame, ProtocolError, ShuttingDown, error_from_code
from ..wire.protocol import MAX_IN_FLIGHT, Flag, Header, Op, decode_error

__all__ = ["MAX_PIPELINE", "Pipeline", "check_pipeline", "pipelines_allowed"]

log = logging.getLogger("aps.worker")

#: The most pushes one connection may keep in flight.
MAX_PIPELINE = MAX_IN_FLIGHT
_MAX_ERROR_PAYLOAD = 1 << 20
_ALIVE, _ERROR, _PUSH_REPLY = int(Op.ALIVE), int(Op.ERROR), int(Op.PUSH_REPLY)


def check_pipeline(depth: Any) -> int:
    """``pipeline=``'s value, checked: pushes in flight per connection, 1 (none) to MAX_PIPELINE."""
    if isinstance(depth, bool) or not isinstance(depth, int) or not 1 <= depth <= MAX_PIPELINE:
        raise ConfigurationError(f"pipeline must be an int from 1 to {MAX_PIPELINE} (pushes in flight), got {depth!r}")
    return depth


def pipelines_allowed(options: dict[str, Any] | None) -> str | None:
    """Why a server run with ``options`` (its handshake's) cannot take pipelined pushes, or None
    when it can: every policy but BSP, whose round takes one gradient per worker computed on
    the round's weights (a push sent before the answer to the one before was computed on
    older weights: the round would drop it). Under SSP and DSSP a pipelined push that finds
    its worker held at the gate waits there (Flag.GATE): the worker runs at most the bound ahead."""
    if options is None or not options.get("pipelining"):
        return "the server does not say it takes pipelined pushes (an older aps serve): upgrade it"
    if options.get("sync") == "bsp":
        return (
            "the server runs bsp, whose rounds take one gradient per worker computed on the round's "
            "weights; pipelined pushes need asp, ssp, dssp or softsync"
        )
    return None


@dataclass(slots=True)
class _Sent:
    request_id: int
    clock: int
    version: int  # of the weights it was computed on
    frame: bytes  # the whole frame, sent again as it is after a reconnect


class Pipeline:
    """The pushes in flight on one :class:`~aps.client.channel.AsyncChannel` (see the module
    docstring).

    Args:
        channel: the channel whose connection carries them.
        depth: how many may be unanswered at once.
    """

    def __init__(self, channel: Any, depth: int) -> None:
        self._channel = channel  # (an AsyncChannel: typed loosely, the channel module imports this one)
        self.depth = depth
        self._sent: deque[_Sent] = deque()
        self._changed = asyncio.Event()
        self._queued: list[bytes] = []  # frames not written on the connection yet
        self._sending: asyncio.Task | None = None
        self._reading: asyncio.Task | None = None
        self._recovering = False
        self._failure: BaseException | None = None
        # The clock of the next push: one above the last one sent, whatever the answers said
        # meanwhile (the server tells a push sent again from a new one by its request id and
        # clock, both of which only go up: docs/protocol.md, "Duplicates").
        self._next_clock = 0
        #: Pushes sent, answered, refused, sent again after a reconnect, and given up (for the curious).
        self.counts = {"sent": 0, "answered": 0, "refused": 0, "resent": 0, "dropped": 0}

    @property
    def in_flight(self) -> int:
        """Pushes sent and not answered yet."""
        return len(self._sent)

    def is_reader(self) -> bool:
        """Whether the running task is this pipeline's reader (which may run steps that take
        the channel's lock while pushes are in flight: a reconnect)."""
        return self._reading is not None and asyncio.current_task() is self._reading

    # Sending ---------------------------------------------------------------------------
    async def push(self, grads: Any) -> None:
        """Queue ``grads`` as a PUSH once fewer than :attr:`depth` are unanswered; the sender
        task writes what is queued in one vectored write (pushes made while it writes go in the
        next one)."""
        channel = self._channel
        while True:
            self.raise_failure()
            if len(self._sent) >= self.depth or self._recovering:
                await self._next_change()  # (room; or the reconnect done: nothing is built meanwhile)
            elif channel._lock.locked() or channel.requests_waiting:
                await channel.request_passed()  # a request of the steps goes first
            elif channel._conn is None:
                lost = channel._disconnected()
                if not channel._reconnects("push", lost):
                    raise lost
                await channel.recover(lost)  # (as any call of a dropped worker does)
            else:
                break
        core = channel._core
        clock = max(self._next_clock, core.clock + len(self._sent))
        self._next_clock = clock + 1
        frames, request_id = core.pipelined_push(grads, clock)
        sent = _Sent(request_id, clock, core.version, b"".join(frames))  # (the gradient's buffer is the caller's)
        self._sent.append(sent)
        self.counts["sent"] += 1
        frame, conn = sent.frame, channel._conn
        if not self._queued and self._sending is None and not self._recovering and conn is not None:
            try:  # the socket takes it at once, mostly: no task switch, no wait
                frame = conn.send_now(frame)
                channel._last_io = time.monotonic()
            except APSError:
                conn.shutdown()  # (the reader finds the loss: it reconnects and sends it again)
                frame = b""
        if frame:
            self._queued.append(frame)
        self._start()

    def _start(self) -> None:
        """Start the sender and the reader, where they are not running."""
        loop = asyncio.get_running_loop()
        if self._sending is None and self._queued and not self._recovering:
            self._sending = loop.create_task(self._send())
        if self._reading is None and self._sent:
            self._reading = loop.create_task(self._read())

    async def _send(self) -> None:
        channel = self._channel
        try:
            while self._queued and not self._recovering:
                conn = channel._conn
                if conn is None:
                    return  # (the reader finds the loss; every unanswered push is sent again)
                frames, self._queued = self._queued, []
                try:
                    await conn.send(frames)
                except APSError:
                    conn.shutdown()  # (the reader's wait ends: it reconnects and sends them again)
                    return
                channel._last_io = time.monotonic()
        finally:
            self._sending = None

    async def drain(self) -> None:
        """Wait until every push in flight is answered (or the pipeline failed)."""
        while self._sent:
            await self._next_change()

    def raise_failure(self) -> None:
        """Raise what went wrong since the last call, once: a refused push's error, or the loss
        of the connection that could not be cured."""
        failure, self._failure = self._failure, None
        if failure is not None:
            raise failure

    async def abandon(self) -> None:
        """Give up the pushes still in flight (the worker closes): its tasks stopped, the
        connection dropped (nothing may be sent behind them). Nothing to do when none is."""
        if not self._sent:
            return
        tasks = [task for task in (self._sending, self._reading) if task is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._sent:
            self._fail(APSError("the worker was closed with pushes in flight"))
        self._failure = None  # (said by the caller)

    def take_failure(self) -> BaseException | None:
        """What went wrong since the last call, taken without raising it (the worker
        reconnects by hand: it is logged there)."""
        failure, self._failure = self._failure, None
        return failure

    async def _next_change(self) -> None:
        event = self._changed
        await event.wait()

    def _changed_now(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    # Reading the answers ---------------------------------------------------------------
    async def _read(self) -> None:
        channel = self._channel
        try:
            while self._sent:
                conn = channel._conn
                try:
                    if conn is None:
                        raise channel._disconnected()
                    reader = channel._core.reader
                    reader.hand_to(self)
                    try:
                        await conn.receive(reader, self._answered, None, channel.silence_limit)
                    finally:
                        if channel._core.reader is reader and not reader.in_frame:
                            reader.hand_to(channel._core)
                except APSError as exc:
                    if not self._sent:
                        break
                    if not channel._reconnects("push", exc):
                        self._fail(exc)
                        break
                    if not await self._recover(exc):
                        break
        except asyncio.CancelledError:
            self._fail(APSError("the worker was closed with pushes in flight"))
            raise
        except BaseException as exc:  # a bug: raised at the next call, not lost in a task
            log.exception("rank %s: reading pipelined answers failed", channel.rank)
            self._fail(exc)
        finally:
            self._reading = None
            self._changed_now()

    def _answered(self) -> bool:
        return not self._sent

    async def _recover(self, lost: APSError) -> bool:
        """Reconnect and rejoin (as any call does), then send every unanswered push again;
        False if that failed (then the pipeline failed with the reason)."""
        channel = self._channel
        log.warning(
            "rank %s: lost %s with %d push(es) in flight (%s); reconnecting",
            channel.rank,
            channel.address,
            len(self._sent),
            lost,
        )
        sender = self._sending
        if sender is not None:  # (it may wait on the lost connection's socket for good)
            sender.cancel()
            await asyncio.gather(sender, return_exceptions=True)
        self._recovering = True
        try:
            await channel.recover(lost)
        except APSError as exc:
            self._recovering = False
            self._fail(exc)
            return False
        self._recovering = False
        self._after_rejoin()
        self._queued = [sent.frame for sent in self._sent]  # in order, before anything new
        self.counts["resent"] += len(self._sent)
        self._changed_now()
        self._start()
        return True

    def _after_rejoin(self) -> None:
        """Which unanswered pushes go again, by the rules a call's push follows
        (:func:`aps.client.recovery._after_recovery`): none under a new rank (its old rank's
        record is not this seat's: one taken before would be applied twice), and none computed
        on weights newer than the server's (it resumed from an older checkpoint), but to a
        shard under an asynchronous policy (which drops it and counts its iteration, as the
        other shards count it)."""
        channel, core = self._channel, self._channel._core
        if core.reseated:
            core.reseated = False
            self._give_up(
                len(self._sent), "they are not sent again under the new rank (the server may have applied some)"
            )
            self._sent.clear()
            return
        sync = (channel.server_options or {}).get("sync")
        if channel._as_shard and sync not in (None, "bsp"):
            return
        newer = [sent for sent in self._sent if sent.version > core.version]
        if newer:
            self._give_up(
                len(newer),
                f"they were computed on weights newer than the server's (version {core.version}: it resumed "
                "from an older checkpoint)",
            )
            self._sent = deque(sent for sent in self._sent if sent.version <= core.version)

    def _give_up(self, count: int, why: str) -> None:
        self.counts["dropped"] += count
        log.warning(
            "rank %s: %d pipelined push(es) unanswered when %s was lost are dropped: %s",
            self._channel.rank,
            count,
            self._channel.address,
            why,
        )

    def _fail(self, exc: BaseException) -> None:
        """Every push in flight is lost with ``exc`` (raised at the next call)."""
        if self._sent:
            exc.add_note(f"{len(self._sent)} pipelined push(es) went unanswered: applied or not, it is unknown")
        self._sent.clear()
        self._queued = []
        if self._failure is None:
            self._failure = exc
        self._channel._disconnect(exc)
        self._changed_now()

    # FrameHandler (the answers) --------------------------------------------------------
    def frame_buffer(self, header: Header) -> memoryview | None:
        op = header.op
        if op == _PUSH_REPLY or op == _ALIVE:
            if header.length:
                raise MalformedFrame(f"a {header.length}-byte payload on op {op}")
            return None
        if op == _ERROR:
            if header.length > _MAX_ERROR_PAYLOAD:
                raise MalformedFrame(f"error frame of {header.length} bytes")
            return memoryview(bytearray(header.length))
        raise ProtocolError(f"op {op} while pipelined pushes were being answered")

    def frame_received(self, header: Header, payload: memoryview) -> None:
        op = header.op
        if op == _ALIVE:
            return
        if op == _ERROR and header.request_id == 0:  # the server closes this connection
            code, message = decode_error(payload)
            error = error_from_code(code, message)
            if isinstance(error, ShuttingDown):
                error.resumable = bool(header.flags & Flag.RESUMABLE)
            raise error
        sent = self._sent[0] if self._sent else None
        if sent is None or header.request_id != sent.request_id:
            raise ProtocolError(
                f"answer to request {header.request_id}; the next push in flight is "
                f"{'none' if sent is None else sent.request_id}"
            )
        self._sent.popleft()
        if op == _ERROR:
            code, message = decode_error(payload)
            self.counts["refused"] += 1
            if self._failure is None:
                self._failure = error_from_code(code, f"a pipelined push (clock {sent.clock}) was refused: {message}")
        else:
            self.counts["answered"] += 1
            self._channel._core.push_acknowledged(header)
        self._changed_now()
