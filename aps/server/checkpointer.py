"""Writing checkpoints while training goes on (``aps serve --checkpoint-dir``).

A checkpoint is taken in two steps, so that neither the event loop nor the
update lane waits for the disk:

1. *Capture*, a job of the update lane (so it sees the state between two
   updates, never half of one): the small state (version, clocks, the
   policy's rounds, the optimizer's step count) is read on the loop, the
   weights are a lease on the current snapshot slot (as a pull takes: no
   copy, and no update writes into a leased slot), and the optimizer's
   state (and BSP's or softsync's running sum, when a round is open) is
   copied into buffers kept for the purpose, on the helper thread the update
   kernels use: that copy is the only time the lane is held.
2. *Write*, on a thread of its own: safetensors files and a JSON manifest
   with their checksums, into a temporary directory, fsynced, then renamed
   into place (:mod:`aps.checkpoint`); the oldest beyond ``--checkpoint-keep``
   are deleted. Only then is the lease given back.

At most one checkpoint is written at a time. A timer's checkpoint that falls
due while one is being written is skipped; requests (``aps checkpoint now``,
``Server.checkpoint()``) made meanwhile share the next one.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, TextIO

import numpy as np

from .engine.lane import Job
from ..checkpoint import (
    check_writable,
    checkpoint_name,
    list_checkpoints,
    lock_directory,
    next_sequence,
    prune,
    record_incarnation,
    remove_temporaries,
    write_checkpoint,
)
from ..errors import CheckpointError, CheckpointFailed

if TYPE_CHECKING:
    from collections.abc import Callable

    from .engine import Engine
    from ..config import ServerConfig
    from ..layout import Layout
    from .engine.table import Snapshot

__all__ = ["Checkpointer", "checkpoint_arrays"]

log = logging.getLogger("aps.server")

_POLL_S = 0.25  # how often --checkpoint-every-updates looks at the version
_REQUEST_SPACING_S = 1.0  # checkpoints asked for (CHECKPOINT) start at most this often
_ERROR_CHARS = 500  # the newest error is kept (and shown) up to this long
_SHUTDOWN_WAIT_S = 120.0  # how long a shutdown waits for its checkpoint (a hung disk must not hang it)


@dataclass
class Capture:
    """The state of one moment, ready to be written off the loop."""

    manifest: dict
    snapshot: Snapshot
    state: dict[str, np.ndarray]  # flat copies, by optimizer state name (and "aggregate", "tables/NAME/KEY",
    # "round/NAME/KEY", "scalars/steps" and "scalars/values")
    loop_seconds: float = 0.0  # time the event loop spent on this checkpoint so far


class CaptureJob(Job):
    """The lane's part of a checkpoint (see the module docstring)."""

    __slots__ = ("engine", "buffers", "done", "manifest", "snapshot", "pairs", "loop_seconds")

    def __init__(
        self, engine: Engine, buffers: dict[str, np.ndarray], done: Callable[[Capture | BaseException], None]
    ) -> None:
        self.engine = engine
        self.buffers = buffers
        self.done = done
        self.manifest: dict | None = None
        self.snapshot: Snapshot | None = None
        self.pairs: list[tuple[str, np.ndarray, np.ndarray]] = []
        self.loop_seconds = 0.0

    def prepare(self) -> int | None:
        started = time.perf_counter()
        try:
            return self._prepare()
        finally:
            self.loop_seconds += time.perf_counter() - started

    def _prepare(self) -> int | None:
        engine = self.engine
        if engine.model.table is None:
            raise CheckpointFailed("there is no model to checkpoint yet (no worker has sent its initial weights)")
        self.manifest, sources = engine.durability.checkpoint_state()
        for name, source in sources.items():
            buffer = self.buffers.get(name)
            if buffer is None or buffer.shape != source.shape:
                buffer = self.buffers[name] = np.empty_like(source)
            self.pairs.append((name, buffer, source))
        self.snapshot = engine.model.table.snapshot()
        return sum(source.size for _, _, source in self.pairs) or None

    def run(self) -> bool:
        for _, buffer, source in self.pairs:
            np.copyto(buffer, source)  # numpy lets go of the GIL for a plain copy
        return True

    def commit(self, result: object) -> None:
        if result is not True:
            self.fail(result if isinstance(result, BaseException) else CheckpointFailed("copying the state failed"))
            return
        snapshot, self.snapshot = self.snapshot, None
        assert self.manifest is not None and snapshot is not None, "commit follows a prepare that set both"
        self.done(Capture(self.manifest, snapshot, {name: buffer for name, buffer, _ in self.pairs}, self.loop_seconds))

    def fail(self, exc: BaseException) -> None:
        if self.snapshot is not None:
            self.snapshot.release()
            self.snapshot = None
        self.done(exc)


def checkpoint_arrays(
    layout: Layout, weights: np.ndarray, flat_state: dict[str, np.ndarray]
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """The files' arrays of a capture: the flat weights and each flat optimizer state cut
    into the model's tensors (``key/tensor``); the aggregate, the tables' rows, an open
    round's rows and the curves as they are."""
    state: dict[str, np.ndarray] = {}
    for key, flat in flat_state.items():
        if key == "aggregate" or key.startswith(("tables/", "round/", "scalars/")):  # (as they are)
            state[key] = flat
        else:
            state.update((f"{key}/{tensor}", view) for tensor, view in layout.views(flat).items())
    return layout.views(weights), state


class Checkpointer:
    """The server's checkpoints: when, how, and what became of the last one.

    Args:
        config: the server's options (``checkpoint_*``).
        engine: the engine whose state is saved.
    """

    def __init__(self, config: ServerConfig, engine: Engine, *, key: bytes | None = None) -> None:
        self.config = config
        self.engine = engine
        self._key = key  # what its checkpoints are signed with (checkpoint_key of the operator's token)
        assert config.checkpoint_dir is not None, "a server makes its checkpointer only with --checkpoint-dir"
        self.directory: str = config.checkpoint_dir
        self._buffers: dict[str, np.ndarray] = {}
        self._executor: ThreadPoolExecutor | None = None
        self._timer: asyncio.Task | None = None
        self._busy = False
        self._next: asyncio.Future | None = None  # what requests made while busy wait for
        self._sequence = 1
        self._due = time.monotonic()  # when the next timed checkpoint starts
        self._last_version = 0  # the version of the last checkpoint taken
        self._last_start = float("-inf")  # when the last one was begun
        self._lock: TextIO | None = None  # the directory's lock file, held while the server runs
        self._by_round = False  # checkpoints at rounds (a sharded BSP run), see start()
        self._pending: asyncio.TimerHandle | None = None  # a request spaced out (_REQUEST_SPACING_S)
        # Counted from 0 by this process (as /metrics exports them).
        self.written = 0
        self.failed = 0
        self.skipped = 0
        #: Failures since the last checkpoint written (0: the last one was written, or none was tried).
        self.failed_in_a_row = 0
        #: The newest failure: ``{"error", "unix", "version", "reason"}`` (None: none yet).
        self.last_error: dict | None = None
        self._last_written: tuple[float, int] | None = None  # (wall time, version) of the newest written
        self._since_unix = time.time()  # when this server began to keep checkpoints
        engine.stats.checkpoint_status = self.status

    def status(self) -> dict:
        """What became of this server's checkpoints, from its start (the ``checkpoints`` of
        the statistics): counts, whether the newest attempt failed, and the newest error.

        ``failing`` is True while the newest attempt failed; ``last_written_unix`` is None
        until one is written (then ``since_unix``, when the server started keeping them,
        bounds how long the run has gone without one)."""
        written = self._last_written
        return {
            "directory": str(self.directory),
            "written": self.written,
            "failed": self.failed,
            "skipped": self.skipped,
            "failing": self.failed_in_a_row > 0,
            "failed_in_a_row": self.failed_in_a_row,
            "last_error": dict(self.last_error) if self.last_error is not None else None,
            "last_written_unix": written[0] if written is not None else None,
            "last_written_version": written[1] if written is not None else None,
            "since_unix": self._since_unix,
        }

    def start(self) -> None:
        """Take the directory and start the timer (inside the running loop).

        Raises:
            CheckpointError: the directory cannot be written, another server writes
                there, or it holds checkpoints of another run and this one is new.
        """
        check_writable(self.directory)
        lock = self._lock = lock_directory(self.directory)
        try:
            self._take_directory()
        except BaseException:
            lock.close()
            self._lock = None
            raise
        self._sequence = next_sequence(self.directory)
        self._since_unix = time.time()
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="aps-checkpoint")
        self._last_version = self.engine.version
        self._due = time.monotonic() + self.config.checkpoint_every
        config = self.config
        # A sharded BSP run: every shard takes its checkpoints at the same rounds, so that a shard
        # resumed older can be joined by the others at one round (docs/algorithms.md, "Sharded resume").
        self._by_round = config.shards > 1 and config.sync == "bsp" and config.checkpoint_every_updates > 0
        if self._by_round:
            self.engine.training.on_round = self._round_applied
        if config.checkpoint_every > 0 or (config.checkpoint_every_updates > 0 and not self._by_round):
            self._timer = asyncio.get_running_loop().create_task(self._tick())

    def _round_applied(self, version: int) -> None:
        """A sharded BSP round was applied: a checkpoint at every ``--checkpoint-every-updates``
        rounds, exactly (captured before any worker pushes into the next round)."""
        if version % self.config.checkpoint_every_updates or self._executor is None:
            return
        if self._busy or self._pending is not None:
            self.skipped += 1
            log.warning(
                "checkpoint at round %d skipped: the one before is still being written (the disk is slower "
                "than --checkpoint-every-updates %d rounds); a shard that resumes older can only be joined "
                "by the others at a round that every shard has a checkpoint of",
                version,
                self.config.checkpoint_every_updates,
            )
            return
        self._begin("periodic", None)

    def _take_directory(self) -> None:
        engine = self.engine
        for leftover in remove_temporaries(self.directory, every=True):  # ours alone now: all are stale
            log.warning(
                "removed %s, a checkpoint that was never finished (the server stopped while writing it)", leftover
            )
        if engine.durability.resumed_from is None:
            found = list_checkpoints(self.directory)
            if found:
                raise CheckpointError(
                    f"--checkpoint-dir {self.directory} holds checkpoints of another run (the newest is {found[0]}): "
                    "give --resume to go on with it, or another --checkpoint-dir to start a new run"
                )
        # (a fork is a new run: its journal starts with it, as its lineage does)
        durability = engine.durability
        try:
            record_incarnation(
                self.directory,
                durability.incarnation,
                new_run=durability.lineage == [durability.incarnation],
                key=self._key,
                run_id=durability.run_id,
            )
        except CheckpointError as exc:  # (a record: a full disk must not keep the server from starting)
            log.warning(
                "%s: a server resumed from here before this one checkpoints will not be one its workers follow", exc
            )

    def request(self, reason: str = "request") -> asyncio.Future:
        """Write a checkpoint as soon as possible; the future gets ``{"path", "version"}``
        (or the error). Requests share a checkpoint being written or about to be, and
        start at most one a second; while a resumed run waits for its workers, nothing
        has changed since the checkpoint it resumed from, which is the answer."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        engine = self.engine
        refusal = None
        if self._executor is None:
            refusal = "this server writes no checkpoints (start it with --checkpoint-dir)"
        elif engine.model.table is None:
            refusal = "there is no model to checkpoint yet (no worker has sent its initial weights)"
        if refusal is not None:
            future.set_exception(CheckpointFailed(refusal))
            return future
        if engine.durability.resumed_from is not None and not engine.roster.started:
            future.set_result({"path": engine.durability.resumed_from, "version": engine.version})
            return future
        if self._busy or self._pending is not None:  # share the next one
            if self._next is None:
                self._next = future
            return self._next
        wait = self._last_start + _REQUEST_SPACING_S - time.monotonic()
        if reason == "request" and wait > 0:
            self._next = future
            self._pending = loop.call_later(wait, self._begin_pending)
            return future
        self._begin(reason, future)
        return future

    def _begin_pending(self) -> None:
        self._pending = None
        if not self._busy and self._next is not None:
            waiting, self._next = self._next, None
            self._begin("request", waiting)

    async def close(self) -> None:
        """Write the shutdown checkpoint (when there is a model) and wait for every write."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._executor is None:
            return
        if self._pending is not None:
            self._pending.cancel()
            self._begin_pending()
        engine = self.engine
        resuming = engine.durability.resumed_from is not None and not engine.roster.started
        if engine.model.table is not None and not resuming:
            try:
                written = await asyncio.wait_for(asyncio.shield(self.request("shutdown")), _SHUTDOWN_WAIT_S)
                log.info("checkpoint at shutdown: %s", written["path"])
            except (CheckpointError, CheckpointFailed) as exc:
                log.error("no checkpoint at shutdown: %s", exc)
            except TimeoutError:
                log.error(
                    "the checkpoint at shutdown is not written after %.0f s (a hung disk?): stopping without "
                    "it; the newest complete checkpoint is still intact",
                    _SHUTDOWN_WAIT_S,
                )
                self._release()
                return
        while self._busy:
            await asyncio.sleep(0.01)
        self._release()

    def _release(self, wait: bool = True) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=wait and not self._busy, cancel_futures=True)
            self._executor = None
        if self._lock is not None:
            self._lock.close()
            self._lock = None

    async def close_without_checkpoint(self) -> None:
        """Stop the timer and the writer (the server failed to start)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._release()

    # Internals --------------------------------------------------------------
    async def _tick(self) -> None:
        """Timed checkpoints start every ``--checkpoint-every`` seconds, measured from one
        start to the next (however long the writes take): a crash costs at most the
        updates of one interval and one write."""
        config, engine = self.config, self.engine
        every, every_n = config.checkpoint_every, config.checkpoint_every_updates
        while True:
            now = time.monotonic()
            wait = self._due - now if every > 0 else _POLL_S
            await asyncio.sleep(max(0.0, min(wait, _POLL_S) if every_n > 0 else wait))
            now = time.monotonic()
            timed = every > 0 and now >= self._due
            counted = every_n > 0 and engine.version - self._last_version >= every_n
            if not (timed or counted) or engine.model.table is None or not engine.roster.started:
                continue
            if timed:
                # From one start to the next, however long the writes take (beginning them
                # earlier would bound the loss tighter, at the price of more writes: see
                # docs/design/checkpoint.md).
                self._due = max(self._due + every, now)
            if engine.version == self._last_version:
                continue  # nothing changed since the last one
            if self._busy or self._pending is not None:
                self.skipped += timed
                continue
            self._begin("periodic", None)

    def _begin(self, reason: str, future: asyncio.Future | None) -> None:
        loop = asyncio.get_running_loop()
        self._busy = True
        started = self._last_start = time.monotonic()

        def captured(capture: Capture | BaseException) -> None:
            if isinstance(capture, BaseException):
                self._finished(reason, future, capture, started, self.engine.version)
                return
            executor = self._executor
            if executor is None:  # stopped meanwhile: a shutdown that gave up waiting for a hung disk
                capture.snapshot.release()
                self._finished(
                    reason,
                    future,
                    CheckpointFailed("the checkpoint writer has stopped"),
                    started,
                    capture.manifest["version"],
                )
                return
            began = time.perf_counter()
            from .._version import __version__

            self._last_version = capture.manifest["version"]
            capture.manifest.update(
                reason=reason,
                sequence=self._sequence,
                aps_version=__version__,
                created=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                created_unix=time.time(),
            )
            name = checkpoint_name(self._sequence, capture.manifest["version"])
            self._sequence += 1
            work = executor.submit(self._write, name, capture)
            capture.loop_seconds += time.perf_counter() - began

            def written(fut) -> None:
                exc = fut.exception()
                try:
                    loop.call_soon_threadsafe(self._written, reason, future, capture, exc or fut.result(), started)
                except RuntimeError:  # the loop is closed: shutting down
                    pass

            work.add_done_callback(written)

        self.engine.durability.capture_checkpoint(CaptureJob(self.engine, self._buffers, captured))

    def _write(self, name: str, capture: Capture) -> str:
        """On the writer thread: the files, then the pruning."""
        layout = self.engine.model.layout
        assert layout is not None, "a capture is taken only of a model (CaptureJob.prepare)"
        weights, state = checkpoint_arrays(layout, capture.snapshot.array, capture.state)
        path = write_checkpoint(self.directory, name, capture.manifest, weights, state, key=self._key)
        for old in prune(self.directory, self.config.checkpoint_keep, self.engine.durability.run_id):
            log.debug("removed old checkpoint %s", old)
        return str(path)

    def _written(self, reason, future, capture: Capture, result, started: float) -> None:
        began = time.perf_counter()
        capture.snapshot.release()
        version = capture.manifest["version"]
        if isinstance(result, BaseException):
            self._finished(reason, future, result, started, version)
            return
        self.written += 1
        finished = time.monotonic()
        if self.failed_in_a_row:
            log.warning(
                "checkpoints are written again (%s, version %d) after %d failed", result, version, self.failed_in_a_row
            )
        self.failed_in_a_row = 0
        self._last_written = (time.time(), version)
        self.engine.stats.checkpoint = {
            "path": result,
            "version": capture.manifest["version"],
            "reason": reason,
            "written_unix": time.time(),
            "seconds": finished - started,
            # what this checkpoint cost the event loop (capture, hand-over, bookkeeping)
            "loop_ms": 1e3 * (capture.loop_seconds + time.perf_counter() - began),
            "written": self.written,
            "failed": self.failed,
            "skipped": self.skipped,
        }
        log.log(
            logging.DEBUG if reason == "periodic" else logging.INFO,
            "checkpoint %s (version %d) written in %.2f s",
            result,
            capture.manifest["version"],
            finished - started,
        )
        self._finished(reason, future, {"path": result, "version": version}, started, version)

    def _finished(self, reason: str, future: asyncio.Future | None, result, started: float, version: int) -> None:
        """A checkpoint (of ``version``) was written, or failed (``result`` an exception)."""
        if isinstance(result, BaseException):
            self.failed += 1
            self.failed_in_a_row += 1
            self._last_version = -1  # the next one is due even if nothing changed
            if not isinstance(result, (CheckpointError, CheckpointFailed)):
                # the first of a run of failures with its traceback; the others in a line each
                log.error(
                    "checkpoint of version %d failed: %s: %s",
                    version,
                    type(result).__name__,
                    result,
                    exc_info=result if self.failed_in_a_row == 1 else None,
                )
                result = CheckpointFailed(f"the checkpoint failed: {type(result).__name__}: {result}")
            else:
                log.error("checkpoint of version %d failed: %s", version, result)
            if isinstance(result, CheckpointError):  # a server error travels on the wire
                result = CheckpointFailed(str(result))
            self.last_error = {
                "error": str(result)[:_ERROR_CHARS],
                "unix": time.time(),
                "version": version,
                "reason": reason,
            }
        if future is not None and not future.done():
            if isinstance(result, BaseException):
                future.set_exception(result)
            else:
                future.set_result(result)
        self._busy = False
        if self._next is not None and self._executor is not None and self._pending is None:
            wait = max(0.0, self._last_start + _REQUEST_SPACING_S - time.monotonic())
            self._pending = asyncio.get_running_loop().call_later(wait, self._begin_pending)
