"""One server's requests, written once for the blocking and the asyncio drivers.

A :class:`_ChannelSteps` is the client of one server: its settings, its
:class:`aps.client.core._ClientCore` (every request built, every reply parsed,
no I/O), its connection, and every call as a generator of I/O steps: connect,
handshake, send, receive, wait for a push's turn, sleep, or run some steps
under the connection's lock. The generator decides (retry, rejoin, backoff,
what is left of a call after a rejoin); a driver does the I/O it asks for:
:func:`aps.client.channel.run` in the calling thread, or
:func:`aps.client.channel.arun` on the running asyncio loop (the handshake in
:mod:`aps.client.sockets` is built the same way). So each verb exists once,
and so does getting back to a lost server (:mod:`aps.client.recovery` holds its
schedule). :class:`aps.Worker` and :class:`aps.AsyncWorker` run these over one
channel per server.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Generator, Mapping
from types import EllipsisType
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
    NotPrimary,
    RankTaken,
    ServerError,
    ServerSilent,
    ServerUnproven,
    ShuttingDown,
    error_from_code,
)
from ..layout import Layout
from ..wire.net import Address, client_context, parse_address
from ..wire.protocol import Flag, Op, ServerInfo, encode_claim, encode_hyper, host_identity
from ..wire.segments import shm_available
from .arguments import _check_heartbeat, _check_reconnect, _check_transport, from_env, _refuse_one_shard, _with_scheme
from .core import _DROPPED, COMPRESSION, _ClientCore, _compression
from .payloads import flat_weights_of, resolve_hyperparameters, server_hyperparameters, server_options, state_payload
from .recovery import _after_recovery, _describe_progress, _Patience, _Reconnecting, _recoverable, _WaitingForServer
from .rowsets import RowsCall
from .sockets import client_token, find_client_token, newer_token
from .tcp import NoServerYet

__all__ = []

log = logging.getLogger("aps.worker")

# The I/O steps a generator yields, each a tuple (step, ...), and what the driver sends back.
CONNECT = 0  # (CONNECT, channel): a new TCP (or TLS) connection to the channel's server
HANDSHAKE = 1  # (HANDSHAKE, channel, conn, token, found): the handshake on conn; its ServerInfo
CONNECT_SHM = 2  # (CONNECT_SHM, channel, path): a Unix-socket connection for shared memory
SEND = 3  # (SEND, conn, buffers, fds)
RECEIVE = 4  # (RECEIVE, conn, core, timeout, idle): until the core holds a reply
TURN = 5  # (TURN, turn): wait for a push's turn to send (see aps.client.shards)
SLEEP = 6  # (SLEEP, channel, seconds): True when the channel was closed meanwhile
LOCKED = 7  # (LOCKED, channel, steps): run the steps holding the channel's lock; their result
EACH = 8  # (EACH, worker, call, in_turn): call(index, channel, turn)'s steps on every channel at once

#: The longest ``spin`` a worker may ask for (seconds): polling longer only burns a core.
_MAX_SPIN = 0.01

#: A generator of steps returning ``T``.
Steps = Generator[tuple, Any, Any]

_REJOIN_PATIENCE = 5.0  # seconds reconnect() waits for the server to let the old connection go
#: How long a rank the server gave a worker may stay taken when that server did not say its
#: --heartbeat-timeout (an older one, or none set), before the worker asks for another: the default.
_SEAT_PATIENCE = 30.0
#: The most it waits, whatever timeout the server says (a bound on reconnect()'s loop).
_SEAT_PATIENCE_MAX = 300.0
_FAREWELL_S = 0.5  # how long to look for the server's last words when a send fails
#: Seconds without a byte from the server, while a reply is due, after which it is taken to be gone.
DEFAULT_SERVER_TIMEOUT = 60.0
#: How many times a connection follows a backup to the primary it names before it gives up.
_MAX_REDIRECTS = 3
#: Seconds a worker keeps trying to get back to a lost server (``reconnect_timeout``).
DEFAULT_RECONNECT_TIMEOUT = 300.0


class _ChannelSteps:
    """One server: its settings and state, its views, and every call's steps. The drivers'
    subclasses (:class:`aps.client.channel.Channel`, :class:`~aps.client.channel.AsyncChannel`)
    add the lock, the connection's kind, the heartbeat and closing."""

    #: The connection (None while disconnected).
    _conn: Any = None
    #: Set by a sharded worker's fan-out when the caller was interrupted (Ctrl-C): the call
    #: in progress does not get back to its server by itself (cleared at the next fan-out).
    _interrupted = False

    def __init__(
        self,
        address: Any,
        rank: int | None,
        num_workers: int | None,
        transport: str = "auto",
        *,
        connect_timeout: float | None = 30.0,
        timeout: float | None = None,
        heartbeat: float | None = 5.0,
        server_timeout: float | None = DEFAULT_SERVER_TIMEOUT,
        token: str | None = None,
        tls: Any = None,
        reconnect: bool = True,
        reconnect_timeout: float | None = DEFAULT_RECONNECT_TIMEOUT,
        compression: str | None = None,
        compress_pulls: bool = False,
        as_shard: bool = False,
        zero_copy: bool = False,
        spin: float = 0.0,
    ) -> None:
        _check_transport(transport)
        _check_heartbeat(heartbeat, server_timeout)
        narrow = _compression(compression, compress_pulls)
        self.reconnect_timeout = _check_reconnect(reconnect, reconnect_timeout)
        self._closing = False
        self._as_shard = as_shard  # one of a sharded worker's servers
        self._fragment = False  # (as_shard) the server of one fragment of streaming local SGD: aps.torch.streaming
        self._token = client_token(token)
        self._proven: bytes | None = None  # the token the server proved at the last handshake
        if isinstance(address, (list, tuple)) and len(address) == 1:
            address = address[0]
        address, rank, num_workers = from_env(address, rank, num_workers)
        self._parsed = _with_scheme(parse_address(address), tls)
        self._tls = client_context(tls if tls is not None else self._parsed.scheme == "tls")
        self.address = str(self._parsed)
        #: The server's replica set, as its handshake said (empty: it has none), and how long
        #: its primary may be silent before the worker turns to the others (None: no set).
        self._replicas: list[Address] = []
        self._replica_patience: float | None = None
        self._core = _ClientCore(rank, num_workers)
        self._core.compression, self._core.compress_pulls = narrow, bool(compress_pulls)
        self._core.zero_copy = bool(zero_copy)
        if not isinstance(spin, (int, float)) or not 0.0 <= spin <= _MAX_SPIN:
            raise ConfigurationError(f"spin must be from 0 to {_MAX_SPIN} seconds, got {spin!r}")
        self._spin = float(spin)
        self._connect_timeout = connect_timeout
        self.timeout = timeout
        self.server_timeout = server_timeout
        self._heartbeat = heartbeat
        self._last_io = time.monotonic()
        self._requested_transport = transport  # "auto" stays "auto" when the worker reconnects
        #: "shm" or "tcp": what this channel uses (``transport="auto"`` decides at connection).
        self.transport = "tcp"
        #: What the server said of itself in the handshake.
        self.server_info = None

    # The driver's part ------------------------------------------------------
    def _start_heartbeat(self) -> None:  # pragma: no cover - each driver has its own
        raise NotImplementedError

    # Views ------------------------------------------------------------------
    @property
    def rank(self) -> int | None:
        return self._core.rank

    @property
    def num_workers(self) -> int | None:
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

    @property
    def server_options(self) -> dict[str, Any] | None:
        """The options that define the server's run, as it said in the handshake."""
        return server_options(self.server_info)

    @property
    def weights(self) -> Mapping[str, np.ndarray]:
        return self._core.weights

    @property
    def grads(self) -> Mapping[str, np.ndarray]:
        return self._core.grads

    @property
    def flat_weights(self) -> np.ndarray | None:
        return self._core.flat_weights

    @property
    def flat_grad(self) -> np.ndarray | None:
        return self._core.flat_grad

    @property
    def compression(self) -> str | None:
        """``"bf16"``/``"fp16"`` when pushes go compressed (over TCP), else None."""
        core = self._core
        if not core.compressing:
            return None
        return next(name for name, dtype in COMPRESSION.items() if dtype == core.compression)

    @property
    def last_push_dropped(self) -> bool:
        return self._core.dropped

    def half_buffers(
        self, weights: np.ndarray | None = None, grad: np.ndarray | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """See :meth:`aps.Worker.half_buffers`; ``weights``/``grad``: the 16-bit buffers to
        use (a sharded worker's slices of its own), made here when not given."""
        core = self._core
        layout, flat_weights = core.layout, core.flat_weights
        if layout is None or flat_weights is None or not core.compressing or not core.compress_pulls:
            raise ConfigurationError(
                "half_buffers needs an initialized worker over TCP with compression and compress_pulls"
            )
        if grad is not None and grad is not core._half_grad:  # the slices given are the buffers from now on
            core._half_grad, core.half_views = grad, False
        if weights is not None and weights is not core._half_weights:
            core._half_weights, core.half_views = weights, False
        half_grad, half_weights = core._half_grad, core._half_weights
        if half_grad is None:
            half_grad = core._half_grad = np.zeros(layout.numel, np.uint16)
        if half_weights is None:
            half_weights = core._half_weights = np.zeros(layout.numel, np.uint16)
        if not core.half_views:
            _core.narrow(half_weights, flat_weights, core.compression)
            core.half_views = True
        return half_weights, half_grad

    # Verbs ------------------------------------------------------------------
    def _init(
        self, params: Mapping[str, Any] | None, timeout: float | None, tables: Mapping[str, Any] | None = None
    ) -> Steps:
        try:
            yield from self._call(
                "init",
                lambda: self._core.init_request(params, tables=tables, values=not self._registered()),
                timeout,
                waiting=self._note_init_wait,
            )
        except APSTimeoutError:
            raise self._init_timeout(timeout) from None
        if params is not None and self._core.joined_running:
            log.warning(
                "rank %s joined a running model at %s at version %d: the values passed to init() were "
                "not used; the server's weights were returned",
                self.rank,
                self.address,
                self.version,
            )
        return self._core.weights

    def _pull(self, rows: RowsCall | None = None) -> Steps:
        """The weights (and ``rows``' rows, into its out arrays; or those alone)."""
        yield from self._call("pull", lambda: self._core.pull_request(rows))
        return self._core.weights

    def _push(self, grads: Any, then_pull: bool, turn: Any = None, rows: RowsCall | None = None) -> Steps:
        """Push ``grads`` (and ``rows``' rows; or those alone), then pull if ``then_pull``."""
        yield from self._call(
            "push_pull" if then_pull else "push",
            lambda: self._core.push_request(grads, then_pull=then_pull, rows=rows),
            turn=turn,
        )
        return self._core.weights

    def _skip_round(self) -> Steps:
        """Take no part in this shard's open BSP round (Flag.SKIP); returns its weights."""
        yield from self._call("push_pull", self._core.skip_request)
        return self._core.weights

    def _ping(self) -> Steps:
        return (yield from self._call("ping", lambda: self._core.simple_request(Op.PING))).version

    def _hyper(self, payload: bytes, check: bool = False) -> Steps:
        """A HYPER payload: checked by the server without taking it (``check``, Flag.CHECK),
        or set and remembered (sent again after a reconnect)."""
        yield from self._call("hyper", lambda: self._core.hyper_request(payload, check=check))
        if not check:
            self._core.hyperparameters = payload

    def _hyper_payload(self, groups: Any) -> bytes:
        """The HYPER payload for ``groups`` (see :meth:`aps.Worker.set_hyperparameters`)."""
        layout = self._core.layout
        if layout is None:
            raise NotInitialized("call init(params) before set_hyperparameters")
        return encode_hyper(resolve_hyperparameters(groups, layout.numel, server_hyperparameters(self.server_info)))

    def _registered(self) -> bool:
        """The server said in the handshake that it has the model: an INIT need not send values."""
        return bool((server_options(self.server_info) or {}).get("registered"))

    def _claim(self, name: str, count: int) -> Steps:
        """The run's counter ``name`` before ``count`` was added (CLAIM)."""
        return (yield from self._call("claim", lambda: self._core.claim_request(name, count))).version

    def _pace(self, steps: int, seconds: float) -> Steps:
        """This worker's step rate and the fastest live worker's, once it has said it took
        ``steps`` in all in ``seconds`` (PACE)."""
        yield from self._call("pace", lambda: self._core.pace_request(steps, seconds))
        return self._core.take_pace()

    def _log(self, payload: bytes) -> Steps:
        """Send what the training loop logged (LOG)."""
        yield from self._call("log", lambda: self._core.log_request(payload))

    def _record_shard_runs(self, runs: list[str]) -> Steps:
        """Tell this shard's server the run id of every shard (see aps.client.shards)."""
        yield from self._call("shards", lambda: self._core.shards_request(runs))

    def _checkpoint_versions(self) -> Steps:
        """The versions of the checkpoints this shard's server holds of its run (REWIND, CHECK)."""
        yield from self._call("rewind", lambda: self._core.rewind_request(None))
        return self._core.take_rewind_versions()

    def _rewind(self, version: int, timeout: float | None) -> Steps:
        """Have this shard's server restart from its checkpoint at ``version``, and rejoin it there
        (docs/algorithms.md, "Sharded resume"): once the server has said yes, its process
        restarts and this connection goes; the rejoin that follows returns the weights of ``version``."""
        yield from self._call("rewind", lambda: self._core.rewind_request(version))
        if not self._core.take_rewind().get("rewound"):
            return  # it is there already
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._core.version != version:
            if deadline is not None and time.monotonic() > deadline:
                raise APSTimeoutError(
                    f"the server at {self.address} said it would rewind to version {version}, "
                    f"but is at version {self._core.version} after {timeout:g} s"
                )
            yield from self._ping()  # answered until the process restarts; then the worker rejoins it
            yield SLEEP, self, 0.02

    def _optimizer_state(self) -> Steps:
        header = yield from self._call("state", self._core.state_request)
        return self._core.take_state(header)

    def _state_payload(self, state: Mapping[str, Any]) -> tuple[bytes, list[np.ndarray]]:
        """The LOAD_STATE head and arrays for ``state`` (see :meth:`aps.Worker.load_optimizer_state`)."""
        layout = self._core.layout
        if layout is None:
            raise NotInitialized("call init(params) before load_optimizer_state")
        return state_payload(state, layout.numel)

    def _load_state(self, head: bytes, arrays: list[np.ndarray], check: bool = False) -> Steps:
        """Send a LOAD_STATE; with ``check`` the head alone, checked, nothing loaded (Flag.CHECK).
        True when loaded, False when this state was loaded already."""
        header = yield from self._call("load_state", lambda: self._core.load_state_request(head, arrays, check=check))
        return not header.flags & _DROPPED

    def _weights_payload(self, params: Mapping[str, Any] | np.ndarray) -> np.ndarray:
        """The flat float32 weights of ``params`` (see :meth:`aps.Worker.load_weights`), checked."""
        layout = self.layout
        if layout is None:
            raise NotInitialized("call init(params) before load_weights")
        return flat_weights_of(params, layout)

    def _load_weights(self, digest: bytes, values: np.ndarray | None) -> Steps:
        """Send a LOAD_WEIGHTS (``values`` None: the digest alone, checked, Flag.CHECK);
        once loaded (or loaded already) this worker holds them too."""
        header = yield from self._call("load_weights", lambda: self._core.load_weights_request(digest, values))
        if values is None:
            return True
        if self.flat_weights is not None:
            self._core.hold(values)
        return not header.flags & _DROPPED

    def _leave(self, timeout: float | None, finished: bool = False) -> Steps:
        """LEAVE (the server stops counting this worker; ``finished``: its training is done,
        Flag.FINISHED); errors are the connection's end anyway."""
        if self._conn is not None and self._core.joined:
            self._core.keep_weights()  # (while the slot is still this worker's)
            flags = Flag.FINISHED if finished else 0
            try:
                yield from self._roundtrip(lambda: self._core.simple_request(Op.LEAVE, flags), timeout)
            except APSError:
                pass

    def _reconnect(self, timeout: float | None) -> Steps:
        """Open a new connection and rejoin under the same rank (see :meth:`aps.Worker.reconnect`)."""
        deadline = time.monotonic() + _REJOIN_PATIENCE
        taken_since = None
        tried = 0  # (replicas of the server's set tried in turn, when its address is down)
        while True:
            try:
                yield LOCKED, self, self._reopen(None, None, self.transport)
            except APSConnectionError:
                tried += 1
                if tried >= len(self._replicas) or not self._next_replica():
                    raise
                continue
            try:
                yield from self._rejoin(timeout)
                weights = self._core.weights
            except APSTimeoutError:
                raise self._init_timeout(timeout) from None
            except RankTaken:
                taken_since = taken_since or time.monotonic()
                if self._reseat(taken_since):
                    continue
                if time.monotonic() > deadline and not self._may_reseat():
                    raise
                yield SLEEP, self, 0.05 if time.monotonic() < deadline else 0.25
                continue
            self._start_heartbeat()  # the old connection's heartbeat stopped with it
            return weights

    # Getting there and back -------------------------------------------------
    def _call(
        self, kind: str, request, timeout: float | EllipsisType | None = ..., *, waiting=None, turn=None
    ) -> Steps:
        """:meth:`_roundtrip`, getting back to a lost server and finishing the call when
        the worker reconnects by itself (``kind``: init, pull, push, push_pull, ping...).
        Each loss of the server gets ``reconnect_timeout`` seconds."""
        self._core.begin_call()  # only this call's push is ever sent again
        while True:
            try:
                return (yield from self._roundtrip(request, timeout, waiting=waiting, turn=turn))
            except APSError as exc:
                if not self._reconnects(kind, exc):
                    raise
                yield from self._recover(exc)
            kind, request = _after_recovery(
                self._core,
                kind,
                request,
                self.address,
                self._as_shard,
                (self.server_options or {}).get("sync"),
                fragment=self._fragment,
            )
            if kind is None:
                return None

    def _reconnects(self, kind: str, exc: APSError) -> bool:
        """Whether a call of ``kind`` that failed with ``exc`` gets back to the server by itself."""
        return (
            self.reconnect_timeout != 0
            and _recoverable(exc)
            and not self._closing
            and not self._interrupted
            and (self._core.ever_joined or kind == "init")
        )

    def _recover(self, lost: BaseException) -> Steps:
        """Reconnect and rejoin under this rank, with backoff, within ``reconnect_timeout``."""
        attempt = _Reconnecting(self, lost, self.reconnect_timeout)
        taken_since = None  # (when a rejoin first found this worker's rank taken)
        # Within a replica set the primary that was lost has most likely been replaced: the
        # others first (a backup refuses at once; the whole set is tried in turn).
        self._next_replica()
        while True:
            try:
                yield LOCKED, self, self._reopen(lost, attempt, self._requested_transport)
                try:
                    yield from self._rejoin(attempt.remaining())
                except RankTaken:
                    taken_since = taken_since or time.monotonic()
                    if not self._reseat(taken_since):
                        raise  # (tried again after a wait, while the reconnect's time lasts)
                    yield from self._rejoin(attempt.remaining())
                except APSTimeoutError:
                    raise APSTimeoutError(
                        f"the server at {self.address} is back, but waits for the other workers: "
                        f"{_describe_progress(self._core.join_progress)}"
                    ) from None
                break
            except APSError as exc:
                lost = exc
                wait = attempt.failed(exc)
                if self._next_replica():  # another replica of the set may have taken over: try it at once
                    wait = min(wait, 0.02)
                if (yield SLEEP, self, wait):  # close() was called meanwhile
                    attempt.check_closed()
        attempt.done()
        self._start_heartbeat()

    def _learn_replicas(self, info: ServerInfo) -> None:
        """The addresses of the server's replica set (``aps serve --replicas``), if it has one:
        after a failover the worker finds the new primary among them by itself."""
        given = (server_options(info) or {}).get("replicas")
        if not isinstance(given, list) or not all(isinstance(a, str) for a in given) or len(given) > 64:
            return
        replicas = []
        for address in given:
            try:
                parsed = parse_address(address if "://" in address else f"{self._parsed.scheme}://{address}")
            except (APSError, ValueError):
                continue
            replicas.append(parsed._replace(scheme=self._parsed.scheme))
        if len(replicas) > 1:
            self._replicas = replicas
            failover = (server_options(info) or {}).get("failover_timeout")
            if isinstance(failover, (int, float)) and not isinstance(failover, bool) and 0 < failover <= 60:
                # It says it is alive 4 times in that (ALIVE while it holds a request): silent twice as
                # long, it has stopped or is cut off, and a backup has taken over meanwhile.
                self._replica_patience = max(0.2, 2.0 * float(failover))

    @property
    def silence_limit(self) -> float | None:
        """Seconds without a byte from the server, while a reply is due, before it is taken
        for gone: ``server_timeout``, or less from a replica set's primary."""
        patience, limit = self._replica_patience, self.server_timeout
        if patience is None:
            return limit
        return patience if limit is None else min(limit, patience)

    @property
    def connect_patience(self) -> float | None:
        """How long a connection and its handshake may take: ``connect_timeout``, or within a
        replica set the primary's patience (a stopped primary's kernel still accepts)."""
        patience, limit = self._replica_patience, self._connect_timeout
        if patience is None or not self._core.ever_joined:
            return limit
        return patience if limit is None else min(limit, patience)

    def _next_replica(self) -> bool:
        """Turn to the next address of the replica set (False: the server has none); from the
        last one a full turn has passed, and the caller's backoff applies."""
        replicas = self._replicas
        if not replicas:
            return False
        at = next((i for i, r in enumerate(replicas) if (r.host, r.port) == (self._parsed.host, self._parsed.port)), -1)
        self._parsed = replicas[(at + 1) % len(replicas)]
        self.address = str(self._parsed)
        return at + 1 < len(replicas)

    def _may_reseat(self) -> bool:
        """Whether this worker may take another rank when its own is taken: the server had
        chosen it (rank=None) and the worker is not one shard's part of a sharded worker
        (every shard seats it under the same rank)."""
        core = self._core
        return core.rank_assigned and not self._as_shard and core.rank is not None

    def _seat_patience(self) -> float:
        """How long this worker's rank may stay taken before it was given to another worker.
        The holder may be this worker's own old connection, which the server drops once it
        has been silent for its --heartbeat-timeout (checked every second at most)."""
        timeout = (self.server_options or {}).get("heartbeat_timeout")
        if isinstance(timeout, (int, float)) and not isinstance(timeout, bool) and timeout > 0:
            return min(float(timeout) + 1.5, _SEAT_PATIENCE_MAX)
        return _SEAT_PATIENCE

    def _reseat(self, taken_since: float) -> bool:
        """A rejoin has found this worker's rank taken since ``taken_since`` (monotonic): once
        that has lasted past :meth:`_seat_patience` and :meth:`_may_reseat`, ask for any rank
        again; True if so."""
        if not self._may_reseat() or time.monotonic() - taken_since < self._seat_patience():
            return False
        lost = self._core.reseat()
        log.warning(
            "rank %d was given to another worker while this one reconnected to %s: asking for another rank",
            lost,
            self.address,
        )
        return True

    def _reopen(self, lost: BaseException | None, attempt: _Reconnecting | None, transport: str) -> Steps:
        """(Under the lock.) Drop the connection and open a new one."""
        self._disconnect(lost)
        if attempt is not None:
            attempt.check_closed()
        self._conn = yield from self._open(transport)
        self.transport = "shm" if self._core.shm is not None else "tcp"
        if attempt is not None:
            attempt.check_closed()

    def _rejoin(self, timeout: float | None) -> Steps:
        """INIT again under this rank; then the values this connection had (set_hyperparameters)."""
        yield from self._roundtrip(
            lambda: self._core.init_request(None, rejoin=True, values=not self._registered()),
            timeout,
            waiting=self._note_init_wait,
        )
        payload = self._core.hyperparameters
        if payload is not None:
            yield from self._roundtrip(lambda: self._core.hyper_request(payload), timeout)

    def _roundtrip(self, request, timeout: float | EllipsisType | None = ..., *, waiting=None, turn=None) -> Steps:
        """Build a request with ``request()``, send it (once ``turn`` says so, when given),
        return its reply. ``waiting(seconds)`` is called now and then while the reply takes long."""
        return (yield LOCKED, self, self._exchange(request, self.timeout if timeout is ... else timeout, waiting, turn))

    def _exchange(self, request, timeout: float | None, waiting, turn) -> Steps:
        """(Under the lock: the request's id is the one the reply will carry.)"""
        conn, core = self._conn, self._core
        if conn is None:
            raise self._disconnected()
        buffers = request()
        try:
            try:
                if turn is not None:
                    yield TURN, turn
                yield SEND, conn, buffers, core.take_fds()
            except APSConnectionError:
                yield from self._farewell(conn)
                raise
            finally:
                if turn is not None:
                    turn.done()  # sent or failed: the next shard's turn
            if waiting is None:
                yield RECEIVE, conn, core, timeout, self.silence_limit
            else:
                patience = _Patience(timeout, waiting)  # saying now and then what the wait is for
                while True:
                    try:
                        yield RECEIVE, conn, core, patience.next_wait(), self.silence_limit
                        break
                    except ServerSilent:
                        raise
                    except APSTimeoutError:
                        if patience.expired():
                            raise
        except BaseException as exc:
            # Interrupted mid-request (an error, a timeout, Ctrl-C, cancellation): the
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

    def _farewell(self, conn) -> Steps:
        """A send failed: raise what the server said before it closed, if anything (a Unix
        socket refuses a send as soon as the server has closed, while TCP takes it and reports
        later, so without this the two would differ)."""
        try:
            yield RECEIVE, conn, self._core, _FAREWELL_S, None
        except APSError:
            return
        self._core.finish()  # raises the error frame that explains the close

    def _connect_first(self) -> Steps:
        """The first connection: waits up to ``connect_timeout`` for a server that does not
        listen yet (see :class:`aps.client.recovery._WaitingForServer`)."""
        waiting = _WaitingForServer(self._core.rank, self.address, self._connect_timeout)
        while True:
            try:
                conn = yield LOCKED, self, self._open(self._requested_transport)
            except NoServerYet as exc:
                yield SLEEP, self, waiting.failed(exc)
            else:
                waiting.done()
                self._conn = conn
                self.transport = "shm" if self._core.shm is not None else "tcp"
                return

    def _open(self, transport: str) -> Steps:
        """Connect (:meth:`_open_here`), following a backup of a replica set to the primary it
        names (NotPrimary), a few times at most."""
        for _ in range(_MAX_REDIRECTS):
            try:
                return (yield from self._open_here(transport))
            except NotPrimary as exc:
                if exc.primary is None or not self._follow(exc.primary):
                    raise
        raise APSConnectionError(
            f"the replica set of {self.address} sent this worker from backup to backup {_MAX_REDIRECTS} times: "
            "its primary is changing, or its replicas disagree on who it is"
        )

    def _follow(self, primary: str) -> bool:
        """Turn to ``primary`` (``HOST:PORT``, as a backup named it); False if it cannot be read."""
        try:
            parsed = parse_address(f"{self._parsed.scheme}://{primary}")
        except (APSError, ValueError):
            return False
        log.info(
            "rank %s: %s is a backup of its replica set; its primary is at %s", self._core.rank, self.address, primary
        )
        self._parsed = parsed
        self.address = str(parsed)
        return True

    def _open_here(self, transport: str) -> Steps:
        """Connect by ``transport``: shared memory when asked or when ``auto`` finds the
        server on this host, TCP otherwise."""
        host, port = self._parsed.host, self._parsed.port
        tcp = yield CONNECT, self
        try:
            # Read again at every connection: a server restarted on this port made a new token.
            token, found = find_client_token(self._token, host, port)
            if token is None and self._proven is not None:
                # Its file is gone (a clean shutdown removes it): whoever serves here now must
                # still prove the token this worker's server proved, or be somebody else.
                token, found = self._proven, True
            try:
                info = yield HANDSHAKE, self, tcp, token, found
            except AuthenticationError:
                token = newer_token(token, found, host, port)
                if token is None:
                    raise
                tcp.close()
                tcp = yield CONNECT, self
                info = yield HANDSHAKE, self, tcp, token, True
            self._proven = token
            self._check_same_shard(info)
            self._core.check_run(info.run_id, self.address, info.incarnations)
            self.server_info = info
            self._learn_replicas(info)
            if not self._as_shard:
                _refuse_one_shard(info, self.address)
        except BaseException:
            tcp.close()
            raise
        if transport == "tcp":
            self._core.shm = None
            return tcp
        path = info.unix_path if shm_available() and info.host == host_identity() else ""
        if path:
            try:
                shm = yield CONNECT_SHM, self, path
            except APSConnectionError:
                if transport == "shm":
                    tcp.close()
                    raise
            except BaseException:
                tcp.close()
                raise
            else:
                tcp.close()
                try:
                    yield HANDSHAKE, self, shm, token, found  # the Unix socket asks the same
                except BaseException:
                    shm.close()
                    raise
                if self._core.shm is not None:
                    shm.adopt(self._core.shm)
                shm.spin = self._spin
                self._core.shm = shm
                return shm
        if transport == "shm":
            tcp.close()
            where = (
                "does not share this host (or offers it no Unix socket)"
                if shm_available()
                else "cannot be reached by shared memory here"
            )
            raise ConfigurationError(f"the server at {self.address} {where}: use transport='tcp' or 'auto'")
        return tcp

    def _check_same_shard(self, info) -> None:
        """The server that answered is the shard this worker reached here before: another shard
        of the model (a relay on this address to a live shard, or shards started again at each
        other's addresses) is not its server (ServerUnproven: a reconnecting worker waits)."""
        before = server_options(self.server_info) if self.server_info is not None else None
        now = server_options(info)
        if not before or not now:
            return
        was, is_ = (before.get("shard"), before.get("shards")), (now.get("shard"), now.get("shards"))
        if was != is_:
            raise ServerUnproven(
                f"the server answering at {self.address} is shard {is_[0]} of {is_[1]}, not shard "
                f"{was[0]} of {was[1]} that this worker reached there: not its server"
            )

    def claim(self) -> bytes:
        """What this channel's handshake vouches for (aps.wire.protocol.encode_claim): the run
        and shard it was connected to before, once it has been; nothing the first time."""
        info = self.server_info
        if info is None or not info.run_id:
            return b""
        options = server_options(info) or {}
        shard, shards = options.get("shard", 0), options.get("shards", 1)
        if not isinstance(shard, int) or not isinstance(shards, int):
            return b""
        return encode_claim(info.run_id, shard, shards)

    def _disconnect(self, reason: BaseException | None = None) -> None:
        conn, self._conn = self._conn, None
        self._core.keep_weights()  # (the server may write the leased slot again)
        if conn is not None:
            conn.close()
            self._lost_because = reason
        self._core.reset_stream()

    def _disconnected(self) -> APSError:
        """The error for a request on a dropped connection: why it was dropped, when known."""
        reason = getattr(self, "_lost_because", None)
        if isinstance(reason, ServerError) and isinstance(reason, APSConnectionError):  # ShuttingDown, Evicted
            error = error_from_code(reason.code, f"{reason.message}; call reconnect()")
            if isinstance(reason, ShuttingDown):
                error.resumable = reason.resumable  # (a server gone for good is not waited for by a later call)
            return error
        if isinstance(reason, APSConnectionError):  # the same kind of error as when it happened
            return type(reason)(f"{reason}; call reconnect()")
        why = f" ({reason})" if isinstance(reason, APSError) else ""
        return APSConnectionError(f"the worker is disconnected{why}; call reconnect()")

    def _init_timeout(self, timeout: float | None) -> InitTimeout:
        what = "not enough" if self.num_workers is None else f"not all {self.num_workers}"
        return InitTimeout(
            f"{what} workers joined {self.address} within {timeout} s: {_describe_progress(self._core.join_progress)}"
        )

    def _note_init_wait(self, waited: float) -> None:
        """``init`` has waited ``waited`` seconds: say for what (one line, now and then)."""
        log.warning(
            "rank %s: waiting for the other workers at %s for %.0f s: %s",
            self.rank,
            self.address,
            waited,
            _describe_progress(self._core.join_progress),
        )
