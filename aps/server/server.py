"""The aps server: listeners, the connection registry, the event loop.

One asyncio loop (uvloop when importable) runs everything: the TCP listener,
every worker connection and the engine's bookkeeping. Large update kernels
run on one helper thread (they release the GIL) so the loop keeps reading
sockets meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import signal
import sys
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from .. import _core
from .checkpointer import Checkpointer
from .engine.compensation import check_lambda
from .engine import Engine
from .engine.lane import run_kernel
from .engine.optim import check_kernel_values
from ..checkpoint import (
    checkpoint_key,
)
from ..wire.tokens import new_token, remove_token_file, token_path, write_token_file
from ..config import ServerConfig, generates_token, parse_compensation, resolve_token
from ..errors import APSError, CheckpointFailed, ConfigurationError, ShuttingDown
from ..wire.protocol import encode_join_progress
from ..wire.net import server_context
from ..wire.net import connect_failure, format_address
from ..wire.segments import Segment, shm_available
from .admission import Connections
from .connection import Connection
from .shm import ShmTransport, UnixListener, listen_unix
from .resume import Resume, Rewind
from .replicas import ReplicaSet, Replicator, SetRetired
from .tcp import TcpTransport

if TYPE_CHECKING:
    from .engine.engine import Answer
    from .http import HttpSide

__all__ = ["Server", "new_event_loop"]

log = logging.getLogger("aps.server")

_T = TypeVar("_T")

# Workers waiting in INIT hear who has joined soon after each change (changes
# close together are told once) and every few seconds in any case.
_JOIN_PROGRESS_EVERY_S = 2.0
_JOIN_PROGRESS_COALESCE_S = 0.2


def _busy_hint(exc: OSError, flag: str) -> str:
    """What to do about a port in use: the likely cause and the way out."""
    if exc.errno != errno.EADDRINUSE:
        return ""
    return (
        f" (another aps server may be running there: stop it, choose another {flag}, or give {flag} 0 to "
        "pick a free port, printed when it starts)"
    )


def new_event_loop() -> asyncio.AbstractEventLoop:
    """A uvloop event loop when uvloop is installed, else the stock asyncio loop."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on POSIX
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


class Server:
    """An aps parameter server.

    Takes a :class:`~aps.config.ServerConfig` and/or its fields as keyword
    arguments (the same options as ``aps serve``). With ``resume``, the run's
    options (:data:`aps.config.RUN_OPTIONS`) come from the checkpoint; those
    in ``given`` (default: those not at their default value) must agree with it.

    Example::

        with aps.Server(workers=2, sync="ssp", staleness=3, port=0).run_in_background() as server:
            print(server.address)  # tcp://127.0.0.1:PORT
    """

    def __init__(self, config: ServerConfig | None = None, *, given: set[str] | None = None, **options: Any) -> None:
        if config is None:
            config = ServerConfig(**options)
        elif options:
            config = config.replace(**options)
        self.config = config
        if config.kernel_isa is not None:  # (one for the process: the kernels are the process's)
            try:
                _core.set_kernel_isa(config.kernel_isa)
            except ValueError as exc:
                raise ConfigurationError(f"--kernel-isa {config.kernel_isa}: {exc}") from None
        # The options given (resume checks them against the checkpoint): the keywords passed,
        # or with a config object, the fields that differ from the defaults.
        self._given = given if given is not None else (set(options) if options or config is None else None)
        self.checkpointer: Checkpointer | None = None
        self.http: HttpSide | None = None  # the HTTP side, with --http-port
        self.engine: Engine | None = None
        self.connections = Connections()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._listener: asyncio.base_events.Server | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._stopping: asyncio.Event | None = None
        self._watchdog: asyncio.Task | None = None
        self._progress: asyncio.Task | None = None
        self._quorum_deadline: asyncio.TimerHandle | None = None  # (elastic: see _quorum_changed)
        self._unix: UnixListener | None = None
        self._port: int | None = None
        self._resume = Resume(self._given, None)  # (its key, the token's, is set at start)
        #: The Unix socket co-located workers reach the server by ("" without one).
        self.unix_path = ""
        #: The command that started this server (``aps serve`` sets it): with it, the server
        #: can restart itself from one of its checkpoints (REWIND, docs/algorithms.md
        #: "Sharded resume"); an embedded server has none and refuses to rewind.
        self.restart_command: list[str] | None = None
        #: The file holding the token this server made itself (None: it was given one, or none).
        self.token_file: str | None = None
        self._token: bytes | None = None
        self._checkpoint_key: bytes | None = None
        #: This server's replica set (--replicas) and, as its primary, what replicates its state.
        self.replica_set: ReplicaSet | None = None
        self.replicator: Replicator | None = None
        #: Set before stopping when the run is over (aps slurm): the backups stop too, none takes over.
        self.retire_replicas = False

    @property
    def address(self) -> str:
        """``tcp://HOST:PORT`` (``tls://`` with TLS) the server listens on (after it started)."""
        if self._port is None:
            raise APSError("the server is not running")
        return format_address(self.config.host, self._port, "tls" if self.config.tls_cert else "tcp")

    @property
    def port(self) -> int | None:
        return self._port

    @property
    def http_address(self) -> str | None:
        """``http://HOST:PORT/`` of the HTTP side (``--http-port``; ``https`` with
        ``--tls-cert``), or None."""
        if self.http is None or self.http.port is None:
            return None
        host = f"[{self.config.host}]" if ":" in self.config.host else self.config.host
        return f"{self.http.scheme}://{host}:{self.http.port}/"

    # Lifecycle ------------------------------------------------------------
    async def start(self) -> None:
        """Bind the listener and get ready to serve (inside a running loop)."""
        _raise_descriptor_limit(self.config.max_connections)
        token = resolve_token(self.config)
        # On loopback without a token given: one of its own, in a file only this user can
        # read (written once the port is known); strangers on this machine cannot join.
        generated = token is None and generates_token(self.config)
        if generated:
            token = new_token().encode("utf-8")
        self._token = token
        # A token of the operator's (given, so the same at every start) signs the run's
        # checkpoints, and a resume reads only those it signed (--resume-unsigned aside).
        self._checkpoint_key = None if token is None or generated else checkpoint_key(token)
        self._resume.key = self._checkpoint_key
        if self.config.replicas is not None:
            # One replica of a set: primary now, or a backup until the primary is lost; a backup
            # that takes over resumes from the state it held (aps.server.replicas).
            assert token is not None, "ServerConfig requires a token of the operator's with --replicas"
            self.replica_set = ReplicaSet(self.config, token)
            held = await self._take_role(self.replica_set)
            if held is not None:
                self.config = self.config.replace(resume=held, fork_run=False)
        # Before anything starts: a bad checkpoint changes nothing.
        self.config, checkpoint = self._resume.find(self.config)
        try:
            _check_kernel_values(self.config)  # (the run's values: a resumed run's are the checkpoint's)
        except BaseException:
            self._resume.release()
            raise
        loop = self._loop = asyncio.get_running_loop()
        if self.replica_set is None or self._stopping is None:  # (a replica made it in _take_role)
            self._stopping = asyncio.Event()
        stopping = self._stopping
        executor = self._executor = ThreadPoolExecutor(1, thread_name_prefix="aps-update")
        config = self.config
        shared = config.unix_socket != "none" and shm_available()
        allocate = (
            (lambda numel, populate=False: Segment.create(numel, "aps-slot", shared_read_only=True, populate=populate))
            if shared
            else None
        )
        engine = self.engine = Engine(config, offload=self._offload, allocate=allocate, background=self._background)
        engine.membership.on_quorum = self._quorum_changed
        try:
            if checkpoint is not None:
                taken_over = self.replica_set is not None and self.replica_set.failovers > 0
                engine.durability.restore(checkpoint, taken_over=taken_over)
                await self._resume.take_up(engine, checkpoint, config, token)
            if config.checkpoint_dir is not None:
                if self._resume.holds(config.checkpoint_dir):
                    # The checkpointer takes the same lock on the same file (a second flock of
                    # one file conflicts even within a process): it holds the directory from now.
                    self._resume.release()
                self.checkpointer = Checkpointer(config, engine, key=self._checkpoint_key)
                self.checkpointer.start()
                engine.request_checkpoint = self.checkpointer.request
                rewind = Rewind(
                    engine,
                    config.checkpoint_dir,
                    lambda: self.restart_command,
                    self._stop_listening,
                    self._restart_options,
                )
                engine.request_rewind = rewind.request
        except BaseException:
            executor.shutdown(wait=False)
            self._resume.release()
            if engine.model.table is not None:
                engine.model.table.close()
            raise
        if self.replica_set is not None:
            self.replicator = self.replica_set.replicator(engine, self._deposed)
            self.connections.replication = self.replicator
            engine.stats.replica_status = self.replicator.status
            self.replicator.start()
        max_payload = config.max_frame_bytes
        traffic = engine.stats.traffic
        tls = server_context(config.tls_cert, config.tls_key, config.tls_ca) if config.tls_cert else None
        try:
            self._listener = await loop.create_server(
                lambda: TcpTransport(
                    traffic["tcp"],
                    config.heartbeat_timeout,
                    lambda transport: Connection(
                        engine, transport, max_payload, self.connections, self.unix_path, token
                    ),
                ),
                config.host,
                config.port,
                reuse_address=True,
                ssl=tls,
                ssl_handshake_timeout=config.handshake_timeout if tls else None,
            )
        except OSError as exc:
            await self._abandon_start()
            raise ConfigurationError(
                f"cannot listen on {config.host}:{config.port}: "
                f"{connect_failure(config.host, exc)}{_busy_hint(exc, '--port')}"
            ) from None
        port = self._port = self._listener.sockets[0].getsockname()[1]
        engine.durability.address = self.address
        try:
            self._publish_token(port, token if generated else None)
        except ConfigurationError:
            self._listener.close()
            await self._abandon_start()
            raise
        if shared:
            try:
                self._unix = listen_unix(
                    config.unix_socket,
                    port,
                    lambda sock: ShmTransport(
                        sock,
                        traffic["shm"],
                        max_payload,
                        self._table_slots,
                        lambda transport: Connection(engine, transport, max_payload, self.connections, token=token),
                    ),
                )
            except ConfigurationError:
                self._listener.close()
                await self._abandon_start()
                raise
            self.unix_path = self._unix.path if self._unix is not None else ""
        if config.http_port is not None:
            from .http import HttpSide

            stats = engine.stats
            # The token guards the HTTP side too, made here or given: what the run is (its id, its
            # workers, its curves) is no business of the host's other users.
            http = self.http = HttpSide(
                config,
                engine.stats_snapshot,
                token,
                tls=tls,
                totals=engine.stats_totals,
                events_after=stats.events_after,
                ready=lambda: "the server is stopping" if stopping.is_set() else None,
                scalars=engine.scalars,
                throttle=self.connections.guard.throttle,
                auth_counts=stats.auth,
            )
            try:
                await http.start()
            except OSError as exc:
                self._listener.close()
                self._close_unix()
                await self._abandon_start()
                raise ConfigurationError(
                    f"cannot listen on {config.host}:{config.http_port} (--http-port): "
                    f"{connect_failure(config.host, exc)}{_busy_hint(exc, '--http-port')}"
                ) from None
        self._watchdog = loop.create_task(self._watch_connections(self.config.heartbeat_timeout))
        self._progress = loop.create_task(self._report_join_progress(engine))
        resumed = engine.durability.resumed_from is not None
        if resumed and config.elastic and not (config.shards > 1 and config.sync == "bsp"):
            # A resumed elastic run waits for its checkpoint's ranks this long, then for any MIN
            # (a sharded BSP run keeps waiting: its shards must find one common round).
            self._quorum_deadline = loop.call_later(config.quorum_timeout, engine.membership.give_up_waiting)
        log.info(
            "listening on %s%s%s: %s workers, sync %s, optimizer %s lr=%g; %s",
            self.address,
            f" and {self.unix_path} (shared memory)" if self.unix_path else "",
            (
                f" (a token is required: made for this run, in {self.token_file}, where this user's workers and "
                "aps status find it)"
                if self.token_file
                else " (a token is required)"
            )
            if token is not None
            else " (no token: anyone who reaches the port can join)",
            self.config.describe_workers(),
            self.config.sync,
            self.config.optimizer,
            self.config.lr,
            engine.model.table_memory.describe(),
        )

    def _stop_listening(self) -> bool:
        """No new connection reaches this process (a rewind restarts it); False: it was stopping."""
        if self._listener is None:
            return False
        self._listener.close()
        self._close_unix()
        return True

    def _restart_options(self) -> list[str]:
        """What a restarted process is told to listen on: the same ports."""
        options = ["--port", str(self._port)]
        if self.http is not None and self.http.port is not None:
            options += ["--http-port", str(self.http.port)]
        return options

    def _table_slots(self) -> set[int]:
        """The ids of the weights table's snapshot slots now (a shared-memory worker's mapped ones go)."""
        assert self.engine is not None, "the shared-memory listener starts after the engine"
        table = self.engine.model.table
        return table.slot_ids() if table is not None else set()

    def _close_unix(self) -> None:
        """Stop listening on the Unix socket (and remove the directory made for it, if any)."""
        if self._unix is not None:
            self._unix.close()
            self._unix = None

    def _publish_token(self, port: int, token: bytes | None) -> None:
        """Write the token this server made to its file (see :mod:`aps.wire.tokens`); without
        one, remove a file left at this address by a server that is gone (this one
        holds the port now: that token is no one's)."""
        if token is not None:
            self.token_file = write_token_file(self.config.host, port, token.decode("utf-8"))
        else:
            remove_token_file(token_path(self.config.host, port), None)

    def _unpublish_token(self) -> None:
        if self.token_file is not None:
            assert self._token is not None, "a token file is written only with the token made for it"
            remove_token_file(self.token_file, self._token.decode("utf-8"))
            self.token_file = None

    async def _abandon_start(self) -> None:
        self._unpublish_token()
        if self.checkpointer is not None:
            await self.checkpointer.close_without_checkpoint()
            self.checkpointer = None
        self._resume.release()
        assert self._executor is not None, "a start is abandoned after its executor was made"
        self._executor.shutdown(wait=False)

    async def wait_stopped(self) -> None:
        """Wait until :meth:`stop` is called."""
        if self._stopping is None:
            raise APSError("the server is not running")
        await self._stopping.wait()

    def stats(self, timeout: float = 10.0) -> dict:
        """A snapshot of the server's statistics (see ``aps status``); safe from any thread.

        Returns:
            ``{"server": {...}, "workers": [{...}, ...]}``: version, update rate,
            bytes in and out, and per worker its clock, gap, pushes, staleness
            histogram, time waited at the gate, DSSP ``r*`` histogram and last
            iteration interval.
        """
        return self._on_loop(lambda engine: engine.stats_snapshot(), timeout)

    def weights(self, timeout: float = 10.0) -> tuple[int, np.ndarray | None]:
        """A copy of the current weights (flat float32, in the model's order) and their version.

        Safe from any thread; ``(0, None)`` before the first worker joined.
        """

        def grab(engine: Engine) -> tuple[int, np.ndarray | None]:
            table = engine.model.table
            return (0, None) if table is None else (table.version, table.current_array().copy())

        return self._on_loop(grab, timeout)

    def checkpoint(self, timeout: float = 60.0) -> str:
        """Write a checkpoint now and return its path (see ``--checkpoint-dir``); safe from any thread.

        Raises:
            CheckpointFailed: the server has no ``--checkpoint-dir``, no model yet, or
                the write failed (a full or read-only directory); training goes on.
        """
        loop = self._loop
        if loop is None or self.engine is None:
            raise APSError("the server is not running")

        async def request() -> str:
            if self.checkpointer is None:
                raise CheckpointFailed("this server writes no checkpoints (start it with --checkpoint-dir)")
            return (await self.checkpointer.request("request"))["path"]

        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            raise APSError(
                "Server.checkpoint() waits for the write, so it cannot run on the server's own loop: "
                "call it from another thread, or await server.checkpointer.request()"
            )
        return asyncio.run_coroutine_threadsafe(request(), loop).result(timeout)

    def _on_loop(self, fn: Callable[[Engine], _T], timeout: float) -> _T:
        """``fn(engine)`` on the server's loop, from any thread."""
        loop, engine = self._loop, self.engine
        if loop is None or engine is None:
            raise APSError("the server is not running")
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            return fn(engine)

        async def call() -> _T:
            return fn(engine)

        return asyncio.run_coroutine_threadsafe(call(), loop).result(timeout)

    def stop(self) -> None:
        """Ask the server to shut down (thread-safe, idempotent)."""
        loop, stopping = self._loop, self._stopping
        if loop is None or stopping is None or loop.is_closed():
            return
        try:
            loop.call_soon_threadsafe(stopping.set)
        except RuntimeError:  # the loop closed meanwhile
            pass

    async def _take_role(self, replica_set: ReplicaSet) -> str | None:
        """The replica's role (ReplicaSet.take_role), given up when the server is asked to stop
        while it waits as a backup (SIGTERM, Ctrl-C: SetRetired, a clean exit)."""
        self._loop = asyncio.get_running_loop()
        stopping = self._stopping = asyncio.Event()
        role = asyncio.ensure_future(replica_set.take_role(self._checkpoint_key))
        stop = asyncio.ensure_future(stopping.wait())
        done, _ = await asyncio.wait({role, stop}, return_when=asyncio.FIRST_COMPLETED)
        stop.cancel()
        if role in done:
            return role.result()
        role.cancel()
        with contextlib.suppress(BaseException):
            await role
        raise SetRetired(f"replica set {self.config.replica_set}: this backup was stopped")

    def _deposed(self, why: str) -> None:
        """Another replica of the set took over (aps.server.replicas): this one stops."""
        self.stop()

    def _quorum_changed(self, below: bool) -> None:
        """An elastic run went below MIN live workers (training holds: after --quorum-timeout
        seconds, the server checkpoints and goes on waiting) or back to MIN."""
        deadline, self._quorum_deadline = self._quorum_deadline, None
        if deadline is not None:
            deadline.cancel()
        if below:
            assert self._loop is not None, "the engine that calls this is made in start, on the loop"
            self._quorum_deadline = self._loop.call_later(self.config.quorum_timeout, self._quorum_expired)

    def _quorum_expired(self) -> None:
        self._quorum_deadline = None
        engine, timeout = self.engine, self.config.quorum_timeout
        assert engine is not None, "the quorum's deadline is set by the engine, made in start"
        if not engine.roster.below_quorum:
            return
        request_checkpoint = engine.request_checkpoint
        if request_checkpoint is None:
            log.warning(
                "training has held for %.0f s with %d of MIN=%d workers live; no --checkpoint-dir, so no "
                "checkpoint: still waiting",
                timeout,
                engine.policy.num_live,
                engine.membership.quorum,
            )
            return
        log.warning(
            "training has held for %.0f s with %d of MIN=%d workers live: checkpointing, then still waiting",
            timeout,
            engine.policy.num_live,
            engine.membership.quorum,
        )

        def written(future: Answer) -> None:
            exc = future.exception()
            if exc is not None:
                log.error("the checkpoint taken while training holds failed: %s", exc)
            else:
                log.warning(
                    "checkpoint %s written at version %d while training holds; waiting for workers",
                    future.result()["path"],
                    future.result()["version"],
                )

        request_checkpoint("quorum").add_done_callback(written)

    async def close(self) -> None:
        """Stop listening, tell every connection and close it, stop the helper thread."""
        for task in (self._watchdog, self._progress, self._quorum_deadline):
            if task is not None:
                task.cancel()
        self._quorum_deadline = None
        if self.http is not None:
            await self.http.close()
        self._watchdog = self._progress = None
        if self._listener is not None:
            self._listener.close()
        self._close_unix()
        connections = list(self.connections)
        notice, resumable = self._shutdown_notice()
        if any(conn.member is not None for conn in connections):
            log.info("telling the workers: %s", notice.message)
        for conn in connections:
            conn.announce_shutdown(notice, resumable)
        if self.replicator is not None:
            await self.replicator.close(retire=self.retire_replicas)
        if self.checkpointer is not None and self.replicator is not None and self.replicator.deposed:
            # (what it holds may be behind what the new primary acknowledged: no checkpoint of it)
            await self.checkpointer.close_without_checkpoint()
            self.checkpointer = None
        if self.checkpointer is not None:
            # After the announcement (nothing more is answered: a push taken from now on
            # is in the checkpoint, or is sent again after the restart) and before the
            # connections go (their leaving would empty the live set it saves).
            await self.checkpointer.close()
            self.checkpointer = None
        self._resume.release()
        for conn in connections:
            conn.close()
        if self._listener is not None:
            await self._listener.wait_closed()
            self._listener = None
        # Let the transports deliver their connection_lost callbacks.
        for _ in range(3):
            await asyncio.sleep(0)
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
        if self.engine is not None and self.engine.model.table is not None:
            self.engine.model.table.close()
        self._unpublish_token()
        log.info("server stopped")

    def _shutdown_notice(self) -> tuple[ShuttingDown, bool]:
        """What the workers are told as the server stops, and whether it can be resumed: with
        --checkpoint-dir it checkpoints now, and a server resumed from there takes them back
        (they wait for it); without, nothing can take the run up again (their calls end)."""
        replicator = self.replicator
        if replicator is not None and not self.retire_replicas and not replicator.deposed and replicator.listed:
            return ShuttingDown(
                "the server is shutting down; a backup of its replica set takes over, and its workers "
                f"follow it ({', '.join(sorted(replicator.listed))})"
            ), True
        directory = self.config.checkpoint_dir if self.checkpointer is not None else None
        if directory is None:
            return ShuttingDown(
                "the server is shutting down, for good: it keeps no checkpoints (no "
                "--checkpoint-dir), so no server can take this run up again"
            ), False
        return ShuttingDown(
            f"the server is shutting down; it checkpoints to {directory}, and a server resumed from "
            f"there (aps serve --checkpoint-dir {directory} --resume) takes its workers back"
        ), True

    async def serve(self, announce: Callable[[str], None] | None = None) -> None:
        """Start, call ``announce(address)``, serve until :meth:`stop`, then close."""
        await self.start()
        try:
            if announce is not None:
                announce(self.address)
            await self.wait_stopped()
        finally:
            await self.close()

    def run(
        self,
        *,
        handle_signals: bool = True,
        announce: bool = True,
        loop_factory: Callable[[], asyncio.AbstractEventLoop] = new_event_loop,
    ) -> int:
        """Serve in this thread until SIGINT/SIGTERM (or :meth:`stop`); returns the exit status 0.

        With ``announce``, prints ``aps: serving on tcp://HOST:PORT`` to
        stdout as the first line of output once the listener is bound.
        ``loop_factory`` makes the event loop (uvloop when installed).
        """

        async def main() -> None:
            loop = asyncio.get_running_loop()
            if handle_signals:
                for signum in (signal.SIGINT, signal.SIGTERM):
                    loop.add_signal_handler(signum, self.stop)
            await self.serve(self._announce if announce else None)

        with asyncio.Runner(loop_factory=loop_factory) as runner:
            runner.run(main())
        return 0

    def run_in_background(
        self, *, loop_factory: Callable[[], asyncio.AbstractEventLoop] = new_event_loop
    ) -> _Background:
        """Serve on a background thread; use as a context manager (see the class example)."""
        return _Background(self, loop_factory)

    # Internals ------------------------------------------------------------
    def _announce(self, address: str) -> None:
        _print_address(address)
        dashboard = self.http_address
        if self.http is not None and dashboard is not None:
            sys.stdout.write(f"aps: dashboard on {dashboard}\n")
            if (hint := self.http.token_hint(dashboard, self.token_file)) is not None:
                sys.stdout.write(hint + "\n")
        if self.token_file is not None:
            sys.stdout.write(f"aps: token in {self.token_file} (workers and aps status of this user find it)\n")
        sys.stdout.flush()

    async def _watch_connections(self, timeout: float) -> None:
        """Every second (or a quarter of the heartbeat timeout): notices for held
        requests, and workers that went silent or stopped reading are dropped
        (see Connection.watch)."""
        loop = asyncio.get_running_loop()
        period = min(1.0, timeout / 4) if timeout > 0 else 1.0
        if self.config.replicas is not None:  # (ALIVE twice per --failover-timeout: Connection.watch)
            period = min(period, self.config.failover_timeout / 4)
        while True:
            await asyncio.sleep(max(0.05, period))
            now = loop.time()
            for conn in list(self.connections):
                conn.watch(now, timeout)

    async def _report_join_progress(self, engine: Engine) -> None:
        """Until training starts, tell the workers waiting in INIT who has joined."""
        changed = asyncio.Event()
        engine.membership.on_membership_change = changed.set
        try:
            while not engine.roster.started:
                try:
                    await asyncio.wait_for(changed.wait(), _JOIN_PROGRESS_EVERY_S)
                except TimeoutError:
                    pass
                await asyncio.sleep(_JOIN_PROGRESS_COALESCE_S)
                changed.clear()
                joined, wanted, missing = engine.membership.join_progress()
                if joined and not engine.roster.started:
                    payload = encode_join_progress(joined, wanted, missing)
                    for conn in list(self.connections):
                        conn.notify_join_progress(payload)
        finally:
            engine.membership.on_membership_change = None

    def _background(self, work: Callable[[], object], done: Callable[[object], None]) -> None:
        """``work()`` on the loop's default executor (not the update lane's thread), then
        ``done`` on the loop with its result or the exception it raised."""

        def run() -> object:
            try:
                return work()
            except Exception as exc:
                log.warning("background work failed: %s: %s", type(exc).__name__, exc)
                return exc

        assert self._loop is not None, "the engine that calls this is made in start, on the loop"
        future = self._loop.run_in_executor(None, run)
        future.add_done_callback(lambda fut: None if fut.cancelled() else done(fut.result()))

    def _offload(self, kernel: Callable[[], object], done: Callable[[object], None]) -> None:
        loop, executor = self._loop, self._executor
        assert loop is not None and executor is not None, "the engine that calls this is made in start, after both"
        future = executor.submit(run_kernel, kernel)

        def finished(fut: Future[object]) -> None:
            try:
                loop.call_soon_threadsafe(done, fut.result())
            except RuntimeError:  # the loop is closed: shutting down
                pass

        future.add_done_callback(finished)


def _check_kernel_values(config: ServerConfig) -> None:
    """Refuse (ConfigurationError) a learning rate, momentum, betas, eps, weight decay or
    compensation LAMBDA the update kernels cannot compute with in their float32, before
    anything listens: such a run would refuse every gradient as not finite."""
    check_kernel_values(
        config.optimizer,
        lr=config.lr,
        momentum=config.momentum,
        weight_decay=config.weight_decay,
        betas=config.betas,
        eps=config.eps,
    )
    check_lambda(*parse_compensation(config.compensation))


def _raise_descriptor_limit(connections: int) -> None:
    """Let the process hold ``connections`` sockets and the rest it needs (the soft
    descriptor limit is raised as far as the hard one allows)."""
    try:
        import resource
    except ImportError:  # pragma: no cover - not POSIX
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    # a connection's socket, up to four descriptors waiting for an INIT (shared memory), and
    # the server's own: listeners, slots, files
    wanted = connections * 6 + 256
    if soft != resource.RLIM_INFINITY and soft < wanted:
        target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        if target > soft:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
    if soft != resource.RLIM_INFINITY and soft < connections + 64:
        log.warning(
            "the descriptor limit (%d) is below --max-connections %d: some connections will fail", soft, connections
        )


def _print_address(address: str) -> None:
    sys.stdout.write(f"aps: serving on {address}\n")
    sys.stdout.flush()


class _Background:
    """A server running on its own thread and loop (from ``Server.run_in_background``)."""

    def __init__(self, server: Server, loop_factory: Callable[[], asyncio.AbstractEventLoop]) -> None:
        self.server = server
        self._loop_factory = loop_factory
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, name="aps-server", daemon=True)

    @property
    def address(self) -> str:
        return self.server.address

    def start(self, timeout: float | None = 30.0) -> _Background:
        self._thread.start()
        if not self._ready.wait(timeout):
            raise APSError("the server did not start in time")
        if self._error is not None:
            raise self._error
        return self

    def stop(self, timeout: float = 30.0) -> None:
        self.server.stop()
        self._thread.join(timeout)

    def _main(self) -> None:
        async def main() -> None:
            await self.server.serve(lambda _address: self._ready.set())

        try:
            with asyncio.Runner(loop_factory=self._loop_factory) as runner:
                runner.run(main())
        except BaseException as exc:  # reported to the starting thread
            self._error = exc
        finally:
            self._ready.set()

    def __enter__(self) -> _Background:
        return self if self._thread.ident is not None else self.start()  # started already, or now

    def __exit__(self, *exc) -> None:
        self.stop()
