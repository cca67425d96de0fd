"""The blocking worker: :class:`Worker`, the client for training scripts.

It is a thin driver around :class:`aps.client.core._ClientCore`, which builds
every request and parses every reply without doing I/O (one implementation of
the protocol; the transports only move bytes), and shares with
:class:`aps.client.aio.AsyncWorker` what does not depend on blocking
(:class:`_WorkerBase`): the views, the properties and the checks. Getting back
to a lost server is in :mod:`aps.client.recovery`, what calls carry besides
weights and gradients in :mod:`aps.client.payloads`, the checks of what a
worker is given in :mod:`aps.client.arguments`.
"""

from __future__ import annotations

import atexit
import contextvars
import logging
import os
import ssl
import threading
import time
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from .. import _core
from ..errors import (
    APSConnectionError,
    APSError,
    APSTimeoutError,
    AuthenticationError,
    ConfigurationError,
    InitTimeout,
    NotInitialized,
    RankTaken,
    ServerError,
    ServerSilent,
    error_from_code,
)
from ..layout import Layout
from ..wire.protocol import (
    Header,
    Op,
    encode_hyper,
    weights_digest,
    host_identity,
)
from ..wire.net import client_context
from ..wire.net import parse_address
from .channel import client_token, find_client_token, handshake, newer_token
from ..wire.segments import shm_available
from .shm import ShmConnection
from .tcp import BlockingConnection, NoServerYet

from .core import _DROPPED, COMPRESSION, _ClientCore, _compression
from .payloads import (
    flat_weights_of,
    resolve_hyperparameters,
    server_hyperparameters,
    server_options,
    state_payload,
)
from .recovery import _after_recovery, _describe_progress, _Patience, _Reconnecting, _recoverable, _WaitingForServer

from .arguments import (
    _check_heartbeat,
    _check_reconnect,
    _check_transport,
    _from_env,
    _names_shards,
    _refuse_one_shard,
    _with_scheme,
)

__all__ = ["Worker"]

log = logging.getLogger("aps.worker")

_REJOIN_PATIENCE = 5.0  # seconds reconnect() waits for the server to let the old connection go
_FAREWELL_S = 0.5  # how long to look for the server's last words when a send fails
#: Seconds without a byte from the server, while a reply is due, after which it is taken to be gone.
DEFAULT_SERVER_TIMEOUT = 60.0
#: Seconds a worker keeps trying to get back to a lost server (``reconnect_timeout``).
DEFAULT_RECONNECT_TIMEOUT = 300.0
#: Seconds the exit hook spends in all saying goodbye for the workers still open (see _leave_at_exit).
EXIT_LEAVE_S = 3.0
#: The blocking workers that are open, held weakly: a worker its script dropped is not kept alive
#: here (it frees its socket when collected, see Worker.__del__).
_OPEN_WORKERS: weakref.WeakSet = weakref.WeakSet()


def _leave_at_exit() -> None:
    """At interpreter exit: every worker still open leaves its server (LEAVE), as close() does.

    Training scripts rarely call close(): without this every rank that ends normally would
    be counted as a crash (a "disconnected" membership event). Bounded: EXIT_LEAVE_S in all,
    whatever the servers do; a worker whose connection is gone, or that another thread
    holds in a call, is just disconnected."""
    deadline = time.monotonic() + EXIT_LEAVE_S
    for worker in list(_OPEN_WORKERS):
        remaining = deadline - time.monotonic()
        try:
            worker._leave_at_exit(max(remaining, 0.0))
        except Exception as exc:  # noqa: BLE001 - the exit goes on whatever one worker does
            log.debug("rank %d: leaving at exit failed: %s", worker.rank, exc)


atexit.register(_leave_at_exit)


#: Per thread: the turn a sharded worker's push to one shard waits for before it sends
#: (see aps.client.shards: one shard's gradient at a time leaves a worker, while replies come in).
SEND_TURN = threading.local()


#: Set while aps.client.shards builds the workers of its shards: a plain worker of one shard is refused.
AS_SHARD = threading.local()

#: The asyncio counterparts (per task): set by aps.client.shards's AsyncShardedWorker.
ASYNC_SEND_TURN: contextvars.ContextVar = contextvars.ContextVar("aps_send_turn", default=None)
ASYNC_AS_SHARD: contextvars.ContextVar = contextvars.ContextVar("aps_as_shard", default=False)


def _farewell(conn, core: _ClientCore) -> None:
    """A send failed: raise what the server said before it closed, if anything
    (a Unix socket refuses a send as soon as the server has closed, while TCP
    takes it and reports later, so without this the two would differ)."""
    try:
        conn.receive(core.reader, core.has_reply, _FAREWELL_S)
    except APSError:
        return
    core.finish()  # raises the error frame that explains the close


class _WorkerBase:
    """What the blocking and the asyncio worker share: state and read-only views."""

    _core: _ClientCore

    @property
    def rank(self) -> int:
        return self._core.rank

    @property
    def num_workers(self) -> int:
        return self._core.num_workers

    @property
    def version(self) -> int:
        """Version of the weights last received (the version a push says its gradient used)."""
        return self._core.version

    @property
    def clock(self) -> int:
        """This worker's clock at the server: how many gradients it has pushed."""
        return self._core.clock

    @property
    def layout(self) -> Layout | None:
        return self._core.layout

    def half_buffers(self) -> tuple[np.ndarray, np.ndarray]:
        """For a model trained in the compression's 16-bit type over TCP with compressed
        pulls: this worker's 16-bit weight and gradient buffers (``uint16`` words, one per
        element in the layout's order), to be the model's storage. From then on every
        weights reply lands in the weight buffer (the server's float32 weights rounded to
        nearest even; a float32 reply, as at a rejoin, is rounded here the same way), and
        ``push(grad)`` of the returned gradient buffer sends it as it is. :attr:`flat_weights`
        is no longer kept current (it would cost a widening pass per pull).

        Raises:
            ConfigurationError: not initialized, not over TCP, or without ``compression``
                and ``compress_pulls``.
        """
        core = self._core
        if core.layout is None or not core.compressing or not core.compress_pulls:
            raise ConfigurationError("half_buffers needs an initialized worker over TCP with compression "
                                     "and compress_pulls")
        if core._half_grad is None:
            core._half_grad = np.zeros(core.layout.numel, np.uint16)
        if core._half_weights is None:
            core._half_weights = np.zeros(core.layout.numel, np.uint16)
        if not core.half_views:
            _core.narrow(core._half_weights, core.flat_weights, core.compression)
            core.half_views = True
        return core._half_weights, core._half_grad

    @property
    def server_options(self) -> dict[str, Any] | None:
        """The options that define the server's run, as it said in the handshake:
        ``optimizer``, ``lr``, ``momentum``, ``nesterov``, ``weight_decay``, ``betas``,
        ``eps``, ``sync``, ``workers`` ... (None before connecting, or from an older server)."""
        return server_options(getattr(self, "server_info", None))

    @property
    def weights(self) -> Mapping[str, np.ndarray]:
        """The last weights received, as views into :attr:`flat_weights` (updated in place by every pull)."""
        return self._core.weights

    @property
    def grads(self) -> Mapping[str, np.ndarray]:
        """Gradient buffers, as views into :attr:`flat_grad`: write gradients here and ``push(worker.grads)``."""
        return self._core.grads

    @property
    def flat_weights(self) -> np.ndarray | None:
        return self._core.flat_weights

    @property
    def flat_grad(self) -> np.ndarray | None:
        return self._core.flat_grad

    def _disconnect(self, reason: BaseException | None = None) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()
            self._lost_because = reason
        self._core.reset_stream()

    def _disconnected(self) -> APSConnectionError:
        """The error for a request on a dropped connection: why it was dropped, when known."""
        reason = getattr(self, "_lost_because", None)
        if isinstance(reason, ServerError) and isinstance(reason, APSConnectionError):  # ShuttingDown, Evicted
            return error_from_code(reason.code, f"{reason.message}; call reconnect()")
        if isinstance(reason, APSConnectionError):  # the same kind of error as when it happened
            return type(reason)(f"{reason}; call reconnect()")
        why = f" ({reason})" if isinstance(reason, APSError) else ""
        return APSConnectionError(f"the worker is disconnected{why}; call reconnect()")

    def _init_timeout(self, timeout: float | None) -> InitTimeout:
        return InitTimeout(
            f"not all {self.num_workers} workers joined {self.address} within {timeout} s: "
            f"{_describe_progress(self._core.join_progress)}"
        )

    def _note_init_wait(self, waited: float) -> None:
        """``init`` has waited ``waited`` seconds: say for what (one line, now and then)."""
        log.warning("rank %d: waiting for the other workers at %s for %.0f s: %s", self.rank, self.address,
                    waited, _describe_progress(self._core.join_progress))

    def _note_joined(self, params: Any) -> None:
        if params is not None and self._core.joined_running:
            log.warning("rank %d joined a running model at %s at version %d: the values passed to init() were "
                        "not used; the server's weights were returned", self.rank, self.address, self.version)

    def _reconnects(self, kind: str, exc: APSError) -> bool:
        """Whether a call of ``kind`` that failed with ``exc`` gets back to the server by itself."""
        return (self.reconnect_timeout != 0 and _recoverable(exc) and not self._closing
                and (self._core.ever_joined or kind == "init"))

    def _rejoin_timeout(self, attempt: _Reconnecting, exc: APSTimeoutError) -> APSTimeoutError:
        """The rejoin's INIT waited in vain: say for whom."""
        return APSTimeoutError(f"the server at {self.address} is back, but waits for the other workers: "
                               f"{_describe_progress(self._core.join_progress)}")

    @property
    def compression(self) -> str | None:
        """``"bf16"``/``"fp16"`` when pushes go compressed (over TCP), else None."""
        core = self._core
        if not core.compressing:
            return None
        return next(name for name, dtype in COMPRESSION.items() if dtype == core.compression)

    @property
    def last_push_dropped(self) -> bool:
        """True when the server dropped the last gradient, not applied: it arrived for a closed
        BSP round, or (SSP, DSSP) it was computed before a reconnect and is older than the
        staleness bound allows. The next pull brings the newest weights."""
        return self._core.dropped

    def _hyper_payload(self, groups: Sequence[Mapping[str, float]]) -> bytes:
        """The HYPER payload for ``groups`` (see :meth:`Worker.set_hyperparameters`)."""
        layout = self._core.layout
        if layout is None:
            raise NotInitialized("call init(params) before set_hyperparameters")
        return encode_hyper(resolve_hyperparameters(groups, layout.numel, server_hyperparameters(self.server_info)))


    def _weights_payload(self, params: Mapping[str, Any] | np.ndarray) -> np.ndarray:
        """The flat float32 weights of ``params`` (see :meth:`Worker.load_weights`), checked."""
        layout = self.layout
        if layout is None:
            raise NotInitialized("call init(params) before load_weights")
        return flat_weights_of(params, layout)

    def _weights_taken(self, values: np.ndarray) -> None:
        """The server holds ``values`` now (loaded, or loaded already): so does this worker."""
        flat = self.flat_weights
        if flat is not None and values is not flat and not np.shares_memory(values, flat):
            np.copyto(flat, values)

    def _state_payload(self, state: Mapping[str, Any]) -> tuple[bytes, list[np.ndarray]]:
        """The LOAD_STATE head and arrays for ``state`` (see :meth:`Worker.load_optimizer_state`)."""
        layout = self._core.layout
        if layout is None:
            raise NotInitialized("call init(params) before load_optimizer_state")
        return state_payload(state, layout.numel)


class Worker(_WorkerBase):
    """A blocking client for one training process.

    Args:
        address: the server, ``tcp://HOST:PORT`` (default: ``$APS_ADDRESS``);
            several servers (comma-separated, or a list) for a model sharded
            across them (``aps serve --shard I --shards K``): the worker is then
            an :class:`aps.client.shards.ShardedWorker`.
        rank: this worker's rank, ``0 <= rank < num_workers`` (default: ``$RANK``).
        num_workers: the number of workers P, which must equal the server's
            ``--workers`` (default: ``$WORLD_SIZE``).
        transport: ``"auto"`` (shared memory when co-located, when available;
            TCP otherwise) or ``"tcp"``.
        connect_timeout: seconds to wait for the server at the first
            connection (None: no limit). A server that does not listen yet
            (refused, unreachable: it is still starting) is tried again
            with a short backoff until then, said once in the log; each
            shard's server of a sharded worker gets its own.
        timeout: seconds to wait for each reply after ``init`` (None: as long as
            the server is alive; a sync policy may hold a pull for as long as
            slower workers need).
        heartbeat: seconds between pings while idle, so the server keeps this
            worker's seat (None: no pings).
        token: the server's shared secret, when it has one (``--token``); the
            worker proves it knows it and checks that the server does too
            (default: ``$APS_TOKEN``, else the token file of a server this user
            started on loopback without a token, read at every connection).
        tls: TCP over TLS: True (the system's CAs, or ``$APS_TLS_CA``; a client
            certificate from ``$APS_TLS_CERT``/``$APS_TLS_KEY`` when set), or an
            ``ssl.SSLContext``. A ``tls://`` address implies True.
        server_timeout: seconds without a byte from the server while a reply is
            due, after which it is taken to have hung or gone: the request
            raises :class:`aps.ServerSilent` (a ``TimeoutError`` and a
            ``ConnectionError``) instead of blocking forever. The server says
            it is alive every few seconds while it holds a request (None: wait
            forever).
        reconnect: when the server is lost (it crashed, restarted, dropped
            this worker, or the network failed), keep trying to get back for
            ``reconnect_timeout`` seconds (None: forever) with capped
            exponential backoff, rejoin under the same rank and finish the
            call in progress: a push whose reply never came is sent again and
            the server applies it only once. A server that resumed from an
            older checkpoint is taken as it is: its weights and this worker's
            clock there; a gradient computed on weights it no longer has is
            dropped (:attr:`last_push_dropped`). Raises
            :class:`aps.RunChanged` if the server came back with another run,
            and :class:`aps.APSConnectionError` when time is up. False: every
            lost connection raises at once (call :meth:`reconnect` yourself).
        reconnect_timeout: see ``reconnect``.
        compression: ``"bf16"`` or ``"fp16"``: over TCP, send gradients as 16-bit
            values (rounded to nearest even; the server widens them to float32
            in its update kernel, and the update stays float32), halving the
            bytes a push moves (default: ``$APS_COMPRESSION``, else None: float32).
            fp16 keeps 3 more bits of precision but overflows beyond 65504 (such a
            push raises :class:`aps.NonFiniteGradient`, nothing sent); bf16 has
            float32's range. Over shared memory gradients stay float32.
        compress_pulls: with ``compression``, the weights come back as 16-bit
            values too (the server keeps float32 master weights; the worker
            computes on weights rounded to 16 bits: see docs/design.md, "Wire
            compression", for the cost).

    Raises:
        ConfigurationError: bad address, rank or transport.
        APSConnectionError: the server cannot be reached.

    Example::

        with aps.Worker("tcp://127.0.0.1:7450", rank=0, num_workers=2) as worker:
            weights = worker.init({"w": np.zeros(10, np.float32)})
            for step in range(100):
                grads = {"w": compute_gradient(weights)}
                weights = worker.push_pull(grads)
    """

    def __new__(cls, address: str | Sequence[str] | None = None, *args: Any, **kwargs: Any) -> Worker:
        if cls is Worker and _names_shards(address if address is not None else os.environ.get("APS_ADDRESS", "")):
            from .shards import ShardedWorker

            return super().__new__(ShardedWorker)
        return super().__new__(cls)

    def __init__(
        self,
        address: str | Sequence[str] | None = None,
        rank: int | None = None,
        num_workers: int | None = None,
        transport: str = "auto",
        *,
        connect_timeout: float | None = 30.0,
        timeout: float | None = None,
        heartbeat: float | None = 5.0,
        server_timeout: float | None = DEFAULT_SERVER_TIMEOUT,
        token: str | None = None,
        tls: bool | ssl.SSLContext | None = None,
        reconnect: bool = True,
        reconnect_timeout: float | None = DEFAULT_RECONNECT_TIMEOUT,
        compression: str | None = None,
        compress_pulls: bool = False,
    ) -> None:
        _check_transport(transport)
        _check_heartbeat(heartbeat, server_timeout)
        if compression is None:
            compression = os.environ.get("APS_COMPRESSION") or None
        narrow = _compression(compression, compress_pulls)
        self.reconnect_timeout = _check_reconnect(reconnect, reconnect_timeout)
        self._closing = False
        self._as_shard = getattr(AS_SHARD, "on", False)  # one of a sharded worker's
        self._token = client_token(token)
        if isinstance(address, (list, tuple)) and len(address) == 1:
            address = address[0]
        address, rank, num_workers = _from_env(address, rank, num_workers)
        self._parsed = _with_scheme(parse_address(address), tls)
        self._tls = client_context(tls if tls is not None else self._parsed.scheme == "tls")
        self.address = str(self._parsed)
        self._core = _ClientCore(rank, num_workers)
        self._core.compression, self._core.compress_pulls = narrow, bool(compress_pulls)
        self._connect_timeout = connect_timeout
        self.timeout = timeout
        self.server_timeout = server_timeout
        # One request at a time, heartbeats included: a request is built (its id
        # taken) and sent and answered under this lock.
        self._lock = threading.RLock()
        self._last_io = time.monotonic()
        self._requested_transport = transport  # "auto" stays "auto" when the worker reconnects
        self._conn: BlockingConnection | ShmConnection | None = self._open_first(transport)
        #: "shm" or "tcp": what this worker uses (``transport="auto"`` decides at connection).
        self.transport = "shm" if self._core.shm is not None else "tcp"
        self._stop = threading.Event()
        self._heartbeat = heartbeat
        self._heartbeat_thread: threading.Thread | None = None
        self._start_heartbeat()
        _OPEN_WORKERS.add(self)

    @classmethod
    def from_env(cls, **options: Any) -> Worker:
        """A worker for ``APS_ADDRESS``, ``RANK`` and ``WORLD_SIZE`` (set by ``torchrun`` or ``aps launch``)."""
        return cls(None, None, None, **options)

    # Requests -------------------------------------------------------------
    def init(self, params: Mapping[str, Any], *, timeout: float | None = 300.0) -> Mapping[str, np.ndarray]:
        """Join the training and return the server's initial weights.

        The first worker to join provides the initial weights; later workers
        must send the same names, shapes and order. Blocks until all
        ``num_workers`` workers have joined (at once when training is already
        running: a rejoin).

        Args:
            params: mapping of tensor name to float array, in a fixed order (float64
                and float16 values make the float32 model).
            timeout: seconds to wait for every worker to join.

        Returns:
            The weights, as views into :attr:`flat_weights`.

        Raises:
            InitTimeout: not every worker joined in time (the connection is closed).
            LayoutMismatch, RankTaken, RankOutOfRange, WorkerCountMismatch:
                the server refused the join.
        """
        try:
            self._call("init", lambda: self._core.init_request(params), timeout, waiting=self._note_init_wait)
        except APSTimeoutError:
            raise self._init_timeout(timeout) from None
        self._note_joined(params)
        return self._core.weights

    def pull(self) -> Mapping[str, np.ndarray]:
        """Wait until the sync policy releases this worker; return the newest weights (views)."""
        self._call("pull", lambda: self._core.pull_request())
        return self._core.weights

    def push(self, grads: Mapping[str, np.ndarray] | np.ndarray) -> None:
        """Send one gradient (ends this worker's iteration).

        Args:
            grads: mapping of name to float32 array matching the model, a flat
                float32 array of the model's size, or :attr:`grads` itself.
                float64 and float16 arrays are converted to float32 (into
                :attr:`grads`, which they overwrite); other dtypes raise
                DTypeMismatch.
        """
        self._call("push", lambda: self._core.push_request(grads, then_pull=False))

    def push_pull(self, grads: Mapping[str, np.ndarray] | np.ndarray) -> Mapping[str, np.ndarray]:
        """:meth:`push` then :meth:`pull` in one round trip."""
        self._call("push_pull", lambda: self._core.push_request(grads, then_pull=True))
        return self._core.weights

    def ping(self) -> int:
        """One empty round trip; returns the server's version."""
        return self._call("ping", lambda: self._core.simple_request(Op.PING)).version

    def set_hyperparameters(self, groups: Sequence[Mapping[str, float]]) -> None:
        """Set the optimizer values the server applies this worker's following pushes with,
        per group of parameters (torch's param groups), until they are set again.

        The groups cut the flat parameter vector (the layout's order) into
        consecutive ranges: the first starts at 0, each ends at its ``stop``
        (exclusive) where the next begins, and the last ends at the model's
        size. All are sent in one request; the server checks every value and
        refuses the whole request if one is wrong (nothing changes). The
        staleness-aware scale still multiplies the gradient. In BSP rounds
        and softsync groups, the one update is applied with the values of the
        push that closed it. The values belong to this connection: the worker
        sends them again when it reconnects, and a new worker process starts
        with the server's own.

        Args:
            groups: one dict per group, in order: ``stop`` (int; may be left out
                for the last group), ``lr``, ``weight_decay``, ``momentum``,
                ``dampening`` (for Adam and AdamW, ``momentum`` and
                ``dampening`` are beta1 and beta2). A value left out is the
                server's (``--lr``, ``--weight-decay``, ``--momentum`` or
                ``--betas``; SGD's dampening is 0).

        Raises:
            NotInitialized: before :meth:`init`.
            ConfigurationError: a group is not a dict, has unknown keys, or lacks a ``stop``.
            InvalidHyperparameters: the server refused a value or a stop (the
                message names the group); momentum with a server started
                without ``--momentum`` is refused too (it keeps no momentum state).

        Example::

            worker.set_hyperparameters([
                {"stop": 1000, "lr": 0.1, "weight_decay": 5e-4},  # elements 0..999
                {"lr": 0.1, "weight_decay": 0.0},                  # the rest (biases)
            ])
        """
        self._send_hyperparameters(self._hyper_payload(groups))

    def _check_hyperparameters(self, payload: bytes) -> None:
        """Have the server check a HYPER payload without taking it (Flag.CHECK)."""
        self._call("hyper", lambda: self._core.hyper_request(payload, check=True))

    def _send_hyperparameters(self, payload: bytes) -> None:
        """Send a HYPER payload and remember it (sent again after a reconnect)."""
        self._call("hyper", lambda: self._core.hyper_request(payload))
        self._core.hyperparameters = payload

    def _restore_hyperparameters(self, timeout: float | None) -> None:
        """After a rejoin: the new connection gets the values the old one had."""
        payload = self._core.hyperparameters
        if payload is not None:
            self._roundtrip(lambda: self._core.hyper_request(payload), timeout)

    def _record_shard_runs(self, runs: list[str]) -> None:
        """Tell this shard's server the run id of every shard (see aps.client.shards)."""
        self._call("shards", lambda: self._core.shards_request(runs))

    def _checkpoint_versions(self) -> list[int]:
        """The versions of the checkpoints this shard's server holds of its run (REWIND, CHECK)."""
        self._call("rewind", lambda: self._core.rewind_request(None))
        return self._core.take_rewind_versions()

    def _rewind(self, version: int, timeout: float | None) -> None:
        """Have this shard's server restart from its checkpoint at ``version``, and rejoin it there
        (docs/algorithms.md, "Sharded resume"): once the server has said yes, its process
        restarts and this worker's connection goes; the rejoin that follows returns the
        weights of ``version``."""
        self._call("rewind", lambda: self._core.rewind_request(version))
        info = self._core.take_rewind()
        if not info.get("rewound"):
            return  # it is there already
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._core.version != version:
            if deadline is not None and time.monotonic() > deadline:
                raise APSTimeoutError(f"the server at {self.address} said it would rewind to version {version}, "
                                      f"but is at version {self._core.version} after {timeout:g} s")
            self.ping()  # answered until the process restarts; then the worker rejoins it
            time.sleep(0.02)

    def optimizer_state(self) -> dict[str, Any]:
        """A copy of the server's optimizer state, taken between two updates.

        Returns:
            ``{"optimizer": name, "steps": int, "version": int, "arrays": {name: array}}``:
            the optimizer's name (``sgd``, ``adam``, ``adamw``), its step count (the
            updates it has applied), the weights version the state belongs to, and its
            arrays, each flat float32 of the model's size in the layout's order: SGD's
            ``momentum_buffer`` (none without momentum), Adam's and AdamW's ``exp_avg``
            and ``exp_avg_sq``. The arrays are this caller's own.

        Raises:
            NotInitialized: before :meth:`init`.

        Example::

            state = worker.optimizer_state()
            np.savez("opt.npz", **state["arrays"])
        """
        header = self._call("state", lambda: self._core.state_request())
        return self._core.take_state(header)

    def load_optimizer_state(self, state: Mapping[str, Any]) -> bool:
        """Load an optimizer state (as :meth:`optimizer_state` returns it) into the server,
        so that training goes on as if it had never stopped.

        It is taken only by a run that has not applied an update yet (version 0),
        or as a no-op when the very same state was loaded into this run already
        (every rank of a job may load the same checkpoint, in any order, and a
        retried load changes nothing). The server checks everything first and
        changes nothing when it refuses. The ``version`` of ``state`` is ignored.

        Args:
            state: ``optimizer`` (the server's optimizer's name), ``steps`` (an
                integer from 0 to 2**53), and ``arrays``: every array of the
                server's optimizer, each flat (or any shape) float32 with the
                model's number of elements.

        Returns:
            True when the state was loaded; False when this state was loaded already
            (nothing changed).

        Raises:
            NotInitialized: before :meth:`init`.
            InvalidState: another optimizer, other arrays, an array of another size,
                a value that is not finite, a negative exp_avg_sq, a bad step count
                (sgd: a step count of 0 with a momentum buffer that is not zero), or
                another state when the server has applied updates already.
            DTypeMismatch: an array is not float32.
        """
        return self._load_state(*self._state_payload(state))

    def load_weights(self, params: Mapping[str, Any] | np.ndarray) -> bool:
        """Make ``params`` the server's weights: the run starts from them, as if they had
        been the first worker's initial weights.

        For weights loaded after the workers joined (a checkpoint loaded into the model
        once the optimizer exists, as training scripts resume). They are taken only before
        the server has applied an update or taken a gradient, and only once per run: every
        rank may load the same weights (a no-op after the first, which returns False),
        while other weights than those loaded already are refused. The server checks
        everything first and changes nothing when it refuses. This worker then holds them.

        Args:
            params: a mapping of name to float32 array in the model's layout, or one flat
                float32 array of the model's size.

        Returns:
            True when they were loaded; False when these very weights were loaded already.

        Raises:
            NotInitialized: before :meth:`init`.
            LayoutMismatch, DTypeMismatch: not the model's names, shapes or float32.
            WeightsRefused: the server has applied updates or taken gradients already,
                other weights were loaded into this run, or a value is not finite.

        Example::

            worker.init(initial)  # every rank joins
            worker.load_weights(checkpoint_weights)  # every rank, before its first push
        """
        values = self._weights_payload(params)
        return self._load_weights(weights_digest((values,)), values)

    def _check_weights(self, digest: bytes) -> None:
        """Have the server check a LOAD_WEIGHTS digest without loading anything (Flag.CHECK)."""
        self._call("load_weights", lambda: self._core.load_weights_request(digest, None))

    def _load_weights(self, digest: bytes, values: np.ndarray) -> bool:
        """Send a LOAD_WEIGHTS (see :meth:`load_weights`)."""
        header = self._call("load_weights", lambda: self._core.load_weights_request(digest, values))
        self._weights_taken(values)
        return not header.flags & _DROPPED

    def _check_state(self, head: bytes) -> None:
        """Have the server check a LOAD_STATE head without loading anything (Flag.CHECK)."""
        self._call("load_state", lambda: self._core.load_state_request(head, [], check=True))

    def _load_state(self, head: bytes, arrays: list[np.ndarray]) -> bool:
        """Send a LOAD_STATE (see :meth:`load_optimizer_state`)."""
        return not self._call("load_state", lambda: self._core.load_state_request(head, arrays)).flags & _DROPPED

    def reconnect(self, *, timeout: float | None = 60.0) -> Mapping[str, np.ndarray]:
        """Open a new connection and rejoin under the same rank; returns the newest weights.

        Retries for a few seconds while the server still holds the rank (it has
        not yet noticed the old connection go). Workers made with
        ``reconnect=True`` (the default) do this by themselves.
        """
        deadline = time.monotonic() + _REJOIN_PATIENCE
        while True:
            with self._lock:
                self._disconnect()
                self._conn = self._open(self.transport)
            try:
                self._roundtrip(lambda: self._core.init_request(None, rejoin=True), timeout,
                                waiting=self._note_init_wait)
                self._restore_hyperparameters(timeout)
                weights = self._core.weights
            except APSTimeoutError:
                raise self._init_timeout(timeout) from None
            except RankTaken:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
                continue
            self._start_heartbeat()  # the old connection's heartbeat stopped with it
            return weights

    def close(self) -> None:
        """Leave the training (the server stops counting this worker) and disconnect.

        A worker still open when its process exits leaves by itself (an ``atexit`` hook
        does what this does, within a few seconds in all), so that a script that ends
        without calling it is counted as having left, not as a crash."""
        _OPEN_WORKERS.discard(self)
        self._closing = True
        self._stop.set()
        if not self._lock.acquire(timeout=0.5):
            # Another thread is in a call (reconnecting, or held at the gate): end its wait.
            conn = self._conn
            if conn is not None:
                conn.shutdown()
            self._lock.acquire()
        try:
            if self._conn is None:
                return
            if self._core.joined:
                try:
                    self._roundtrip(lambda: self._core.simple_request(Op.LEAVE), 5.0)
                except APSError:
                    pass
            self._disconnect()
        finally:
            self._lock.release()

    def _leave_at_exit(self, budget: float) -> None:
        """:meth:`close` for the exit hook, within ``budget`` seconds: a connection another
        thread holds in a call (it cannot be asked to leave in between) is shut, not waited for."""
        _OPEN_WORKERS.discard(self)
        self._closing = True
        self._stop.set()
        if not self._lock.acquire(timeout=min(budget, 0.5)):
            conn = self._conn
            if conn is not None:
                conn.shutdown()
            return
        try:
            if self._conn is None:
                return
            if self._core.joined and budget > 0:
                try:
                    self._roundtrip(lambda: self._core.simple_request(Op.LEAVE), budget)
                except APSError:
                    pass
            self._disconnect()
        finally:
            self._lock.release()

    def __enter__(self) -> Worker:
        return self

    def __del__(self) -> None:
        # Dropped without close(): free the socket (the server sees the worker leave).
        stop, conn = getattr(self, "_stop", None), getattr(self, "_conn", None)
        if stop is not None:
            stop.set()
        if conn is not None:
            conn.close()

    def __exit__(self, *exc) -> None:
        self.close()

    # Internals ------------------------------------------------------------
    def _call(self, kind: str, request, timeout: float | None = ..., *, waiting=None) -> Header | None:
        """:meth:`_roundtrip`, getting back to a lost server and finishing the call when
        the worker reconnects by itself (``kind``: init, pull, push, push_pull, ping).
        Each loss of the server gets ``reconnect_timeout`` seconds."""
        self._core.begin_call()  # only this call's push is ever sent again
        while True:
            try:
                return self._roundtrip(request, timeout, waiting=waiting)
            except APSError as exc:
                if not self._reconnects(kind, exc):
                    raise
                self._recover(exc)
            kind, request = _after_recovery(self._core, kind, request, self.address, self._as_shard,
                                            (self.server_options or {}).get("sync"))
            if kind is None:
                return None

    def _recover(self, lost: BaseException) -> None:
        """Reconnect and rejoin under this rank (see ``reconnect`` in the class docstring)."""
        attempt = _Reconnecting(self, lost, self.reconnect_timeout)
        while True:
            try:
                with self._lock:
                    self._disconnect(lost)
                    attempt.check_closed()
                    self._conn = self._open(self._requested_transport)
                    self.transport = "shm" if self._core.shm is not None else "tcp"
                    attempt.check_closed()
                try:
                    self._roundtrip(lambda: self._core.init_request(None, rejoin=True), attempt.remaining(),
                                    waiting=self._note_init_wait)
                except APSTimeoutError as exc:
                    raise self._rejoin_timeout(attempt, exc) from None
                self._restore_hyperparameters(attempt.remaining())
                break
            except APSError as exc:
                lost = exc
                wait = attempt.failed(exc)
                if self._stop.wait(wait):  # close() was called meanwhile
                    attempt.check_closed()
        attempt.done()
        self._start_heartbeat()

    def _roundtrip(self, request, timeout: float | None = ..., *, waiting=None) -> Header:
        """Build a request with ``request()``, send it, return its reply. ``waiting(seconds)``
        is called now and then while the reply takes long (see :meth:`_receive_patiently`)."""
        if timeout is ...:
            timeout = self.timeout
        with self._lock:
            conn, core = self._conn, self._core
            if conn is None:
                raise self._disconnected()
            buffers = request()  # under the lock: its request id is the one the reply will carry
            turn = getattr(SEND_TURN, "turn", None)  # a sharded worker's order of sending to its shards
            try:
                try:
                    if turn is not None:
                        turn.wait()
                    conn.send(buffers, core.take_fds())
                except APSConnectionError:
                    _farewell(conn, core)
                    raise
                finally:
                    if turn is not None:
                        turn.done()
                if waiting is None:
                    conn.receive(core.reader, core.has_reply, timeout, self.server_timeout)
                else:
                    self._receive_patiently(conn, timeout, waiting)
            except BaseException as exc:
                # Interrupted mid-request (an error, a timeout, Ctrl-C): the
                # stream is no longer in step with the server, so drop it.
                self._disconnect(exc)
                raise
            finally:
                self._last_io = time.monotonic()
            try:
                return core.finish()
            except APSError as exc:
                if core.connection_lost:
                    self._disconnect(exc)
                raise

    def _receive_patiently(self, conn, timeout: float | None, waiting) -> None:
        """Receive the reply within ``timeout``, saying now and then what we wait for (see :class:`_Patience`)."""
        patience = _Patience(timeout, waiting)
        while True:
            try:
                return conn.receive(self._core.reader, self._core.has_reply, patience.next_wait(), self.server_timeout)
            except ServerSilent:
                raise
            except APSTimeoutError:
                if patience.expired():
                    raise

    def _open_first(self, transport: str) -> BlockingConnection | ShmConnection:
        """The first connection: waits up to ``connect_timeout`` for a server that does
        not listen yet (see :class:`_WaitingForServer`)."""
        waiting = _WaitingForServer(self._core.rank, self.address, self._connect_timeout)
        while True:
            try:
                conn = self._open(transport)
            except NoServerYet as exc:
                time.sleep(waiting.failed(exc))
            else:
                waiting.done()
                return conn

    def _open(self, transport: str) -> BlockingConnection | ShmConnection:
        """Connect by ``transport``: shared memory when asked or when ``auto`` finds
        the server on this host, TCP otherwise."""
        where = (self._parsed.host, self._parsed.port)
        tcp = BlockingConnection(*where, self._connect_timeout, self.server_timeout, self._tls)
        try:
            # Read again at every connection: a server restarted on this port made a new token.
            token, found = find_client_token(self._token, *where)
            try:
                info = handshake(tcp, token, self._connect_timeout, found=found)
            except AuthenticationError:
                token = newer_token(token, found, *where)
                if token is None:
                    raise
                tcp.close()
                tcp = BlockingConnection(*where, self._connect_timeout, self.server_timeout, self._tls)
                info = handshake(tcp, token, self._connect_timeout, found=True)
            host, path, run_id = info.host, info.unix_path, info.run_id
            self._core.check_run(run_id, self.address)
            self.server_info = info
            if not self._as_shard:
                _refuse_one_shard(info, self.address)
        except BaseException:
            tcp.close()
            raise
        if transport == "tcp":
            self._core.shm = None
            return tcp
        if not shm_available() or host != host_identity():
            path = ""
        if path:
            try:
                shm = ShmConnection(path, self._connect_timeout)
            except APSConnectionError:
                if transport == "shm":
                    tcp.close()
                    raise
            else:
                tcp.close()
                try:
                    handshake(shm, token, self._connect_timeout, found=found)  # the Unix socket asks the same
                except BaseException:
                    shm.close()
                    raise
                if self._core.shm is not None:
                    shm.adopt(self._core.shm)
                self._core.shm = shm
                return shm
        if transport == "shm":
            tcp.close()
            where = "does not share this host" if shm_available() else "cannot be reached by shared memory here"
            raise ConfigurationError(f"the server at {self.address} {where}: use transport='tcp' or 'auto'")
        return tcp

    def _start_heartbeat(self) -> None:
        """Start the heartbeat thread, unless there is none to run or it still runs."""
        thread = self._heartbeat_thread
        if self._heartbeat is None or self._stop.is_set() or (thread is not None and thread.is_alive()):
            return
        self._heartbeat_thread = threading.Thread(
            target=_heartbeats, args=(weakref.ref(self), self._stop, self._heartbeat), name="aps-heartbeat",
            daemon=True,
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
                self._roundtrip(lambda: self._core.simple_request(Op.PING), max(interval, 1.0) * 6)
        except APSError as exc:
            log.warning("rank %d: heartbeat failed: %s", self.rank, exc)
            return False
        finally:
            self._lock.release()
        return True


def _heartbeats(ref: weakref.ref, stop: threading.Event, interval: float) -> None:
    """The heartbeat thread of a Worker (holds it only weakly)."""
    while not stop.wait(interval / 2):
        worker = ref()
        if worker is None or not worker._ping_if_idle(interval):
            return
        del worker

