"""One server's connection, driven: :func:`run` does the I/O steps of
:mod:`aps.client.steps` in the calling thread (TCP or shared memory), :func:`arun`
on the running asyncio loop (TCP). :class:`Channel` and :class:`AsyncChannel` are
the client of one server for each driver: the steps' state, a lock (one request
at a time, heartbeats included), a heartbeat, closing, and the calls a sharded
worker's :attr:`aps.Worker.shards` offer for one shard.
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import os
import sys
import threading
import time
import weakref
from typing import Any

from ..errors import APSError
from .pipeline import Pipeline
from .shm import ShmConnection
from .sockets import handshake, handshake_async
from .steps import CONNECT, CONNECT_SHM, EACH, HANDSHAKE, LOCKED, RECEIVE, SEND, SLEEP, TURN, Steps, _ChannelSteps
from ..wire.protocol import Op, weights_digest
from .tcp import AsyncConnection, BlockingConnection

__all__ = ["AsyncChannel", "Channel", "arun", "run"]

log = logging.getLogger("aps.worker")

#: Seconds the exit hook spends in all saying goodbye for the channels still open (see _leave_at_exit).
EXIT_LEAVE_S = 3.0
#: Seconds a channel its script let go of (collected without close()) spends saying goodbye.
DROP_LEAVE_S = 1.0
#: The blocking channels that are open, held weakly: a worker its script dropped is not kept alive
#: here (it leaves and frees its socket when collected, see Channel.__del__).
_OPEN: weakref.WeakSet = weakref.WeakSet()


def run(steps: Steps) -> Any:
    """Do the I/O ``steps`` asks for, in this thread, until it returns; its result."""
    value: Any = None
    error: BaseException | None = None
    while True:
        try:
            step = steps.send(value) if error is None else steps.throw(error)
        except StopIteration as end:
            return end.value
        value = error = None
        try:
            kind = step[0]
            if kind == SEND:
                step[1].send(step[2], step[3])
            elif kind == RECEIVE:
                core = step[2]
                step[1].receive(core.reader, core.has_reply, step[3], step[4])
            elif kind == LOCKED:
                with step[1]._lock:
                    value = run(step[2])
            elif kind == EACH:
                value = step[1]._fan_out(step[2], step[3])
            elif kind == TURN:
                step[1].wait()
            elif kind == SLEEP:
                stop = step[1]._stop
                if stop.is_set():  # closed before: the steps are paced all the same
                    time.sleep(step[2])
                    value = True
                else:
                    value = stop.wait(step[2])  # close() meanwhile ends the wait
            elif kind == CONNECT:
                channel = step[1]
                value = BlockingConnection(
                    channel._parsed.host,
                    channel._parsed.port,
                    channel.connect_patience,
                    channel.silence_limit,
                    channel._tls,
                )
            elif kind == HANDSHAKE:
                value = handshake(step[2], step[3], step[1].connect_patience, found=step[4], claim=step[1].claim())
            elif kind == CONNECT_SHM:
                value = ShmConnection(step[2], step[1].connect_patience)
            else:  # pragma: no cover - a step this driver does not know is a bug
                raise AssertionError(f"unknown step {step!r}")
        except BaseException as exc:  # handed to the steps, which decide
            error = exc
        del step


async def arun(steps: Steps) -> Any:
    """:func:`run` on the running asyncio loop (TCP only). A cancellation thrown into the
    steps ends them: steps that went on after it (none do) are closed and it is raised."""
    value: Any = None
    error: BaseException | None = None
    while True:
        try:
            step = steps.send(value) if error is None else steps.throw(error)
        except StopIteration as end:
            if isinstance(error, asyncio.CancelledError):
                raise error from None
            return end.value
        if isinstance(error, asyncio.CancelledError):
            steps.close()
            raise error
        value = error = None
        try:
            kind = step[0]
            if kind == SEND:
                await step[1].send(step[2])
            elif kind == RECEIVE:
                core = step[2]
                await step[1].receive(core.reader, core.has_reply, step[3], step[4])
            elif kind == LOCKED:
                channel = step[1]
                await channel.acquire()
                try:
                    value = await arun(step[2])
                finally:
                    channel.release()
            elif kind == EACH:
                value = await step[1]._fan_out(step[2], step[3])
            elif kind == TURN:
                await step[1].wait()
            elif kind == SLEEP:
                await asyncio.sleep(step[2])
                value = step[1]._closing
            elif kind == CONNECT:
                channel = step[1]
                value = await AsyncConnection.open(
                    channel._parsed.host,
                    channel._parsed.port,
                    channel.connect_patience,
                    channel.silence_limit,
                    channel._tls,
                )
            elif kind == HANDSHAKE:
                value = await handshake_async(
                    step[2], step[3], step[1].connect_patience, found=step[4], claim=step[1].claim()
                )
            else:  # pragma: no cover - CONNECT_SHM: an asyncio channel speaks TCP only
                raise AssertionError(f"unknown step {step!r}")
        except BaseException as exc:  # handed to the steps, which decide
            error = exc
        del step


class _OneServer(_ChannelSteps):
    """The calls of one server, as a sharded worker's :attr:`~aps.Worker.shards` offer them
    (each as the driver runs it; :class:`aps.Worker` has them all, documented): the base of
    the two drivers' channels."""

    @staticmethod
    def _run_steps(steps: Steps) -> Any:  # pragma: no cover - each driver has its own
        """Run ``steps`` as the driver does (:func:`run`, or :func:`arun`'s awaitable)."""
        raise NotImplementedError

    def optimizer_state(self):
        return self._run_steps(self._optimizer_state())

    def load_optimizer_state(self, state):
        return self._run_steps(self._load_state(*self._state_payload(state)))

    def load_weights(self, params):
        values = self._weights_payload(params)
        return self._run_steps(self._load_weights(weights_digest((values,)), values))

    def ping(self):
        return self._run_steps(self._ping())

    def pull(self):
        return self._run_steps(self._pull())


def _leave_at_exit() -> None:
    """At interpreter exit: every channel still open leaves its server (LEAVE), as close() does.

    Training scripts rarely call close(): without this every rank that ends normally would
    be counted as a crash (a "disconnected" membership event). Bounded: EXIT_LEAVE_S in all,
    whatever the servers do; a channel whose connection is gone, or that another thread
    holds in a call, is just disconnected."""
    deadline = time.monotonic() + EXIT_LEAVE_S
    for channel in list(_OPEN):
        try:
            channel._leave_at_exit(max(deadline - time.monotonic(), 0.0))
        except Exception as exc:  # the exit goes on whatever one channel does
            log.debug("rank %s: leaving at exit failed: %s", channel.rank, exc)


atexit.register(_leave_at_exit)


class Channel(_OneServer):
    """The blocking client of one server (see :class:`aps.Worker` for the arguments),
    connected when made: TCP, or shared memory when the server shares this host."""

    _run_steps = staticmethod(run)

    def __init__(self, *args: Any, **options: Any) -> None:
        super().__init__(*args, **options)
        # One request at a time, heartbeats included: a request is built (its id taken)
        # and sent and answered under this lock.
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._heartbeat_thread: threading.Thread | None = None
        self._pid = os.getpid()
        run(self._connect_first())
        self._start_heartbeat()
        _OPEN.add(self)

    def _start_heartbeat(self) -> None:
        """Start the heartbeat thread, unless there is none to run or it still runs."""
        thread = self._heartbeat_thread
        if self._heartbeat is None or self._stop.is_set() or (thread is not None and thread.is_alive()):
            return
        self._heartbeat_thread = threading.Thread(
            target=_heartbeats, args=(weakref.ref(self), self._stop, self._heartbeat), name="aps-heartbeat", daemon=True
        )
        self._heartbeat_thread.start()

    def _ping_if_idle(self, interval: float) -> bool:
        """Heartbeat: one PING when nothing was sent for ``interval`` seconds. False: stop."""
        if self._conn is None:
            return False
        if not self._lock.acquire(blocking=False):
            return True  # a request is in flight: the server knows we are here
        try:
            if self._conn is not None and time.monotonic() - self._last_io >= interval:
                run(self._roundtrip(lambda: self._core.simple_request(Op.PING), max(interval, 1.0) * 6))
        except APSError as exc:
            log.warning("rank %s: heartbeat failed: %s", self.rank, exc)
            return False
        finally:
            self._lock.release()
        return True

    def close(self, budget: float = 5.0, wait: bool = True, finished: bool = False) -> None:
        """Leave the server (LEAVE, within ``budget`` seconds; ``finished``: this worker's
        training is done) and disconnect. A call
        another thread is in (reconnecting, or held at the gate) is ended after half a
        second (its connection shut), and waited for unless ``wait`` is False (the exit
        hook: it cannot be asked to leave in between)."""
        _OPEN.discard(self)
        self._closing = True
        self._stop.set()
        if not self._lock.acquire(timeout=min(budget, 0.5)):
            conn = self._conn
            if conn is not None:
                conn.shutdown()
            if not wait:
                return
            self._lock.acquire()
        try:
            if budget > 0:
                run(self._leave(budget, finished))
            self._disconnect()
            if self._core.shm is not None:  # (a closed worker makes no request again)
                self._core.shm.close_segments()
        finally:
            self._lock.release()

    def _leave_at_exit(self, budget: float) -> None:
        self.close(budget, wait=False)

    def __del__(self) -> None:
        # Dropped without close(), as a worker or optimizer local to a script's main() is when
        # main() returns: it leaves, as the exit hook has those still held at exit leave (not
        # while the interpreter finalizes, nor in a forked child, which shares the socket).
        stop, conn = getattr(self, "_stop", None), getattr(self, "_conn", None)
        if stop is not None:
            stop.set()
        if (
            conn is not None
            and not self._closing
            and getattr(self, "_pid", None) == os.getpid()
            and not sys.is_finalizing()
            and self._lock.acquire(blocking=False)
        ):
            try:
                run(self._leave(DROP_LEAVE_S))
            except Exception as exc:  # a finalizer raises nothing
                log.debug("rank %s: leaving when dropped failed: %s", self.rank, exc)
            finally:
                self._lock.release()
            conn = self._conn
        if conn is not None:
            conn.close()


def _heartbeats(ref: weakref.ref, stop: threading.Event, interval: float) -> None:
    """The heartbeat thread of a Channel (holds it only weakly)."""
    while not stop.wait(interval / 2):
        channel = ref()
        if channel is None or not channel._ping_if_idle(interval):
            return
        del channel


class AsyncChannel(_OneServer):
    """The asyncio client of one server over TCP: made by :meth:`open`."""

    _run_steps = staticmethod(arun)

    @classmethod
    async def open(cls, *args: Any, **options: Any) -> AsyncChannel:
        channel = cls(*args, **options)
        await arun(channel._connect_first())
        channel._start_heartbeat()
        return channel

    def __init__(self, *args: Any, **options: Any) -> None:  # see open()
        super().__init__(*args, **options)
        self._requested_transport = "tcp"  # asyncio's sockets cannot pass the descriptors shm needs
        self._lock = asyncio.Lock()
        #: Its pushes in flight (``AsyncWorker.connect(pipeline=N)``, N > 1), or None.
        self.pipeline: Pipeline | None = None
        #: Requests of the steps waiting for the pushes in flight to be answered (pushes wait
        #: for them in turn, so that a pull is not put off for ever by a task that pushes).
        self.requests_waiting = 0
        self._request_turn = asyncio.Event()
        self._heartbeat_task: asyncio.Task | None = None
        self._closed = False

    async def acquire(self) -> None:
        """Take the lock for a request of the steps, once every push in flight is answered (the
        answers come first on the connection; a push is only sent under the lock, so none is
        sent after). Waits outside the lock: the pipeline's reader may need it to reconnect.
        The reader itself takes it at once (it reconnects with pushes in flight)."""
        pipeline = self.pipeline
        if pipeline is None or pipeline.is_reader():
            await self._lock.acquire()
            return
        self.requests_waiting += 1
        try:
            while True:
                if pipeline.in_flight:
                    await pipeline.drain()
                await self._lock.acquire()
                if not pipeline.in_flight:
                    return
                self._lock.release()
        finally:
            self.requests_waiting -= 1
            if not self.requests_waiting and not self._lock.locked():  # (cancelled while waiting)
                self._turn_now()

    def _turn_now(self) -> None:
        self._request_turn.set()
        self._request_turn = asyncio.Event()

    def release(self) -> None:
        """Let go of the lock a request of the steps held; pipelined pushes go on."""
        self._lock.release()
        self._turn_now()

    async def request_passed(self) -> None:
        """(A pipelined push.) Wait until no request of the steps holds the lock or waits for it."""
        while self._lock.locked() or self.requests_waiting:
            await self._request_turn.wait()

    async def recover(self, lost: APSError) -> None:
        """Get back to the server after ``lost`` (as a call does: reconnect, rejoin)."""
        await arun(self._recover(lost))

    def _start_heartbeat(self) -> None:
        """Start the heartbeat task, unless there is none to run or it still runs."""
        task = self._heartbeat_task
        if self._heartbeat is None or self._closed or (task is not None and not task.done()):
            return
        self._heartbeat_task = asyncio.get_running_loop().create_task(self._heartbeats(self._heartbeat))

    async def _heartbeats(self, interval: float) -> None:
        try:
            while self._conn is not None:
                await asyncio.sleep(interval / 2)
                if not self._lock.locked() and time.monotonic() - self._last_io >= interval:
                    await arun(self._roundtrip(lambda: self._core.simple_request(Op.PING), max(interval, 1.0) * 6))
        except APSError as exc:
            log.warning("rank %s: heartbeat failed: %s", self.rank, exc)

    async def close(self, finished: bool = False) -> None:
        """Leave the server (``finished``: this worker's training is done) and disconnect (a
        call another task is in is ended first)."""
        self._closed = self._closing = True
        if self._heartbeat_task is not None:
            self._heartbeat_task.cancel()
            self._heartbeat_task = None
        if self._lock.locked() and self._conn is not None:
            # Another task is in a call (reconnecting, or held at the gate): end its wait. A
            # shutdown wakes its pending read at once (the call then drops the connection);
            # closing the socket under it would not: the loop stops watching a closed descriptor.
            self._conn.shutdown()
        await self._lock.acquire()
        self.release()
        if self._conn is None:
            return
        await arun(self._leave(5.0, finished))
        conn = self._conn
        self._disconnect()
        if conn is not None:
            await conn.aclose()
