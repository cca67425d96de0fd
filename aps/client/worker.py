"""The worker: :class:`Worker`, the client for training scripts, over one channel per server.

One server is the case K = 1; a model sharded across K servers (a comma-separated
address, or a list) is the same worker over K channels, each request sliced over
the shards' ranges (:mod:`aps.client.shards`), as ps-lite's ``KVWorker`` slices
every request over its servers' key ranges. Each verb is written once, as a
generator of steps (:class:`aps.client.verbs._Workers`, each server's part in
:mod:`aps.client.steps`); :class:`Worker` runs them in the calling thread,
:class:`aps.AsyncWorker` on the asyncio loop (:mod:`aps.client.aio`).
"""

from __future__ import annotations

import atexit
import logging
import os
import ssl
import threading
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ..errors import ConfigurationError
from ..tables import Table
from .channel import Channel, run
from .fanout import ThreadedFanOut
from .shards import _ShardThreads, check_fragment, in_shard_order, server_addresses
from .steps import DEFAULT_RECONNECT_TIMEOUT, DEFAULT_SERVER_TIMEOUT
from .verbs import _Workers

__all__ = ["Worker"]

log = logging.getLogger("aps.worker")

#: The blocking workers that have logged something (held weakly): what they have not sent yet
#: goes out at interpreter exit, before their channels leave (_log_rest_at_exit).
_LOGGING: weakref.WeakSet = weakref.WeakSet()


def _log_rest_at_exit() -> None:
    """At interpreter exit, before the channels' own hook (registered first: atexit runs the
    last one first) makes them leave: each worker's last logged points go out, as close()
    sends them. A script rarely calls close(): its last second of curves would be lost."""
    for worker in list(_LOGGING):
        try:
            worker._send_log_rest()
        except Exception as exc:  # the exit goes on whatever one worker does
            log.debug("rank %s: sending what was logged at exit failed: %s", worker.rank, exc)


atexit.register(_log_rest_at_exit)


class Worker(ThreadedFanOut, _Workers):
    """A blocking client for one training process.

    Args:
        address: the server, ``tcp://HOST:PORT`` (default: ``$APS_ADDRESS``);
            several servers (comma-separated, or a list) for a model sharded
            across them (``aps serve --shard I --shards K``, see
            :mod:`aps.client.shards`): the same worker, over one channel per
            server (:attr:`shards`).
        rank: this worker's rank, ``0 <= rank < num_workers`` (default: ``$RANK``;
            without it, the server assigns a free rank at :meth:`init`).
        num_workers: the number of workers P, which must equal the server's
            ``--workers`` (an elastic server's ``MIN:MAX`` takes any count up to MAX;
            default: ``$WORLD_SIZE``; without it, the server's count).
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
        compression: ``"bf16"``/``"fp16"``: over TCP, send gradients as 16-bit values (rounded
            to nearest even; widened to float32 in the server's update kernel), half the bytes;
            ``"int8"``/``"int4"``: block-quantized, with error feedback (:attr:`compression_residual`),
            a quarter and an eighth (default: ``$APS_COMPRESSION``, else None: float32). fp16
            overflows beyond 65504 (such a push raises :class:`aps.NonFiniteGradient`, nothing
            sent); bf16 has float32's range. Over shared memory gradients stay float32.
        compress_pulls: with ``compression``, the weights come back as 16-bit
            values too (the server keeps float32 master weights; the worker
            computes on weights rounded to 16 bits: see docs/design/wire.md, "Wire
            compression", for the cost).
        zero_copy: over shared memory, a pull moves no weight bytes: :attr:`weights`
            and :attr:`flat_weights` are read-only views into the server's snapshot
            slot the reply named, which stays unchanged until the next weights
            reply replaces them (read them again after each call: a view kept
            past the next reply may show another version, so ``.copy()`` what
            you keep; a write raises ``ValueError``). On ``close()`` the worker
            keeps a copy of its last weights. Over TCP they are read-only views
            of the worker's own buffer. One server only (a sharded worker copies).
        spin: over shared memory, seconds to poll for each reply before sleeping
            in the kernel (at most 0.01; 0, the default: sleep at once). A reply
            due within that time then costs no wake-up of this process: a 4 KiB
            push_pull in about two thirds of the time, for a core kept busy
            while waiting. For hosts with a core to spare per worker.

    Raises:
        ConfigurationError: bad address, rank or transport; servers that are not
            the shards of one model.
        APSConnectionError: the server cannot be reached.

    Example::

        with aps.Worker("tcp://127.0.0.1:7450", rank=0, num_workers=2) as worker:
            weights = worker.init({"w": np.zeros(10, np.float32)})
            for step in range(100):
                grads = {"w": compute_gradient(weights)}
                weights = worker.push_pull(grads)
    """

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
        zero_copy: bool = False,
        spin: float = 0.0,
        _fragment: tuple[int | None, int] | None = None,
    ) -> None:
        self._pool: _ShardThreads | None = None
        if compression is None:
            compression = os.environ.get("APS_COMPRESSION") or None
        options = dict(
            connect_timeout=connect_timeout,
            timeout=timeout,
            heartbeat=heartbeat,
            server_timeout=server_timeout,
            token=token,
            tls=tls,
            reconnect=reconnect,
            reconnect_timeout=reconnect_timeout,
            compression=compression,
            compress_pulls=compress_pulls,
        )
        addresses = server_addresses(address)
        if zero_copy and len(addresses) > 1:
            raise ConfigurationError("zero_copy needs one server: a sharded worker joins its shards' weights")
        if _fragment is not None and len(addresses) > 1:
            raise ConfigurationError("a fragment's worker has one server: give one shard's address")
        channels: list[Channel] = []
        try:
            for one in addresses:
                channels.append(
                    Channel(
                        one,
                        rank,
                        num_workers,
                        transport,
                        as_shard=len(addresses) > 1 or _fragment is not None,
                        zero_copy=zero_copy,
                        spin=spin,
                        **options,
                    )
                )
            if len(channels) > 1:
                channels = in_shard_order(channels)
            elif _fragment is not None:  # (streaming local SGD's worker of one shard: aps.torch.streaming)
                check_fragment(channels[0], *_fragment)
                channels[0]._fragment = True
        except BaseException:
            for channel in channels:
                channel.close()
            raise
        self._setup(channels)
        if len(channels) > 1:
            self._pool = _ShardThreads(len(channels) - 1)
            weakref.finalize(self, self._pool.shutdown)  # a worker dropped without close() lets them go
        self._lock = threading.RLock()  # one sharded request at a time

    @classmethod
    def from_env(cls, **options: Any) -> Worker:
        """A worker for ``APS_ADDRESS``, ``RANK`` and ``WORLD_SIZE`` (set by ``torchrun`` or ``aps launch``)."""
        return cls(None, None, None, **options)

    # Requests -------------------------------------------------------------
    def init(
        self, params: Mapping[str, Any], *, tables: Mapping[str, Table] | None = None, timeout: float | None = 300.0
    ) -> Mapping[str, np.ndarray]:
        """Join the training and return the server's initial weights.

        The first worker to join provides the initial weights; later workers
        must send the same names, shapes and order. Blocks until all
        ``num_workers`` workers have joined (at once when training is already
        running: a rejoin). Sharded, every shard gets its range of ``params``.

        Args:
            params: mapping of tensor name to float array, in a fixed order (float64
                and float16 values make the float32 model).
            tables: the model's embedding tables, a mapping of name to
                :class:`aps.tables.Table`, the same from every worker (the first
                worker's declaration is the run's; every shard holds rows of every table).
            timeout: seconds to wait for every worker to join.

        Returns:
            The weights, as views into :attr:`flat_weights`.

        Raises:
            InitTimeout: not every worker joined in time (the connection is closed).
            LayoutMismatch, TableMismatch, RankTaken, RankOutOfRange, WorkerCountMismatch:
                the server refused the join (a table mismatch names the table and field).
        """
        return run(self._init(params, timeout, tables))

    def pull(self, *, rows: Mapping[str, Any] | None = None, out: Mapping[str, np.ndarray] | None = None):
        """Wait until the sync policy releases this worker; return the newest weights (views).

        With ``rows`` (``{table: ids}``), the rows of those ids too, read at the same moment
        as the weights: returns ``(weights, {table: rows})`` (see :meth:`pull_rows`).
        """
        return run(self._pull(rows, out))

    def pull_rows(
        self, table: str | Mapping[str, Any], ids: Any = None, *, out: Any = None, keep_version: bool = False
    ) -> Any:
        """The rows of ``ids`` of embedding table ``table``: a float32 array of shape
        ``(len(ids), dim)`` (duplicates allowed, order kept), into ``out`` when given (a
        C-contiguous float32 array of that shape: no other copy is made). Several tables in one
        request: ``pull_rows({table: ids, ...}, out={table: array, ...})`` returns ``{table: rows}``.

        Rows follow the sync policy as the weights do: the call waits until the policy releases
        this worker (docs/algorithms.md, "Rows"). Rows never pushed read as their initial
        values (the server keeps nothing for them: a row is made by its first push). With
        ``--shards K``, each shard is asked for the ids it holds, at once.

        Args:
            table: the table's name, or ``{table: ids}`` for several tables in one request.
            ids: the ids (integers in ``[0, rows)``; duplicates allowed).
            out: where the rows go (``{table: array}`` for several tables).
            keep_version: leave :attr:`version` as it is: the version of the dense weights
                this worker holds, which its next push says its gradient was computed on (a
                forward that reads rows between two steps, as :class:`aps.torch.Embedding`
                does). By default :attr:`version` becomes the version the rows were read at,
                as a :meth:`pull` sets it (under the asynchronous policies, pull the dense
                weights too).

        Returns:
            The rows (``out`` itself when given), or ``{table: rows}`` for several tables.

        Raises:
            InvalidIds: an unknown table, ids that are not integers or not in ``[0, rows)``, a
                bad ``out`` (nothing is sent, nothing changes).

        Example::

            rows = worker.pull_rows("items", ids, keep_version=True)  # the next push says the weights held
        """
        return run(self._pull_rows(table, ids, out, versioned=not keep_version))

    def push_rows(self, table: str | Mapping[str, Any], ids: Any = None, grads: Any = None) -> None:
        """Push gradient rows ``grads`` (shape ``(len(ids), dim)``) for ``ids`` of table ``table``
        (a duplicate id's rows are summed, as PyTorch's sparse gradients coalesce), or for
        several tables at once: ``push_rows({table: (ids, grads), ...})``.

        It is one iteration, as :meth:`push` is (the clock advances; the dense weights stay as
        they are). To push rows with the dense gradient, use ``push(grads, rows=...)`` or
        ``push_pull(grads, rows=..., pull_rows=...)``.

        Raises:
            InvalidIds: an unknown table, bad ids, rows of the wrong shape (nothing is sent).
            NonFiniteGradient: a row holds NaN or infinity (nothing changes on the server).
        """
        run(self._push_rows(table, ids, grads))

    def push(self, grads: Mapping[str, np.ndarray] | np.ndarray, *, rows: Mapping[str, Any] | None = None) -> None:
        """Send one gradient (ends this worker's iteration), and with ``rows``
        (``{table: (ids, grads)}``) gradient rows of the model's tables in the same request.

        Args:
            grads: mapping of name to float32 array matching the model, a flat
                float32 array of the model's size, or :attr:`grads` itself.
                float64 and float16 arrays are converted to float32 (into
                :attr:`grads`, which they overwrite); other dtypes raise
                DTypeMismatch.
        """
        run(self._push(grads, False, rows))

    def push_pull(
        self,
        grads: Mapping[str, np.ndarray] | np.ndarray,
        *,
        rows: Mapping[str, Any] | None = None,
        pull_rows: Mapping[str, Any] | None = None,
        out: Mapping[str, np.ndarray] | None = None,
    ):
        """:meth:`push` then :meth:`pull` in one round trip.

        With ``rows`` (``{table: (ids, grads)}``: the last batch's gradient rows) and
        ``pull_rows`` (``{table: ids}``: the next batch's), the training loop's whole step in
        one round trip: returns ``(weights, {table: rows})`` when ``pull_rows`` is given
        (into ``out``'s arrays, where given).
        """
        return run(self._push(grads, True, rows, pull_rows, out))

    def ping(self) -> int:
        """One empty round trip; returns the server's version (sharded: the smallest)."""
        return run(self._ping())

    def log(self, scalars: Mapping[str, Any], step: int | None = None, *, batch: Any = None) -> None:
        """Report the training loop's scalars (``{"loss": 0.41, "lr": 0.1}``: numbers, numpy scalars,
        one-element tensors) at ``step`` (default: this worker's :attr:`clock`).

        The server keeps them per rank as curves over the run, drawn on its dashboard beside this
        process's CPU and memory, and exports the newest in ``/metrics``. No round trip: they are
        sent about once a second, and on :meth:`close` (or at exit). ``batch`` (the step's input: an
        array, or bytes) sends a digest of it, by which the server warns when two ranks train on the
        same data. At most 32 names a worker, each 1 to 64 characters of ``A-Z a-z 0-9 _ . : / -``;
        a bad one raises ``ValueError`` and nothing is kept."""
        run(self._log(scalars, step, batch))
        _LOGGING.add(self)  # (its last points go out at exit, if it is never closed)

    def pace(self, steps: int, seconds: float) -> tuple[float | None, float | None]:
        """Say this worker took ``steps`` local steps in all in ``seconds``: its step rate and the
        fastest live worker's, as the server keeps them (docs/protocol.md, "Step rates")."""
        return run(self._pace(steps, seconds))

    def claim(self, name: str, count: int = 1) -> int:
        """Add ``count`` to the run's counter ``name`` (0 at first; adding 0 reads it) and return
        its value before: an atomic fetch-and-add on the server (shard 0), kept in checkpoints,
        so each value goes to one worker (:class:`aps.torch.ElasticSampler` claims chunks so).
        A name is 1 to 256 UTF-8 bytes; a run keeps 4,096 counters of at most 2**53."""
        return run(self._claim(name, count))

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
        with the server's own. Sharded, ``stop`` counts in the whole model and
        each shard gets the groups that meet its range, cut to it; every shard
        checks its part first (Flag.CHECK), and only if all take them are they
        set on every shard: a refused request changes no shard.

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
        run(self._set_hyperparameters(groups))

    def optimizer_state(self) -> dict[str, Any]:
        """A copy of the server's optimizer state, taken between two updates.

        Returns:
            ``{"optimizer": name, "steps": int, "version": int, "arrays": {name: array}}``:
            the optimizer's name (``sgd``, ``adam``, ``adamw``), its step count (the
            updates it has applied), the weights version the state belongs to, and its
            arrays, each flat float32 of the model's size in the layout's order: SGD's
            ``momentum_buffer`` (none without momentum), Adam's and AdamW's ``exp_avg``
            and ``exp_avg_sq``. The arrays are this caller's own. Sharded: every shard's
            state, read at once, each array the shards' pieces end to end; ``version``
            is the smallest of the shards'.

        Raises:
            NotInitialized: before :meth:`init`.
            InvalidState: (sharded) the shards' step counts differ (the state was read
                while updates were being applied).

        Example::

            state = worker.optimizer_state()
            np.savez("opt.npz", **state["arrays"])
        """
        return run(self._optimizer_state())

    def load_optimizer_state(self, state: Mapping[str, Any]) -> bool:
        """Load an optimizer state (as :meth:`optimizer_state` returns it) into the server,
        so that training goes on as if it had never stopped.

        It is taken only by a run that has not applied an update yet (version 0),
        or as a no-op when the very same state was loaded into this run already
        (every rank of a job may load the same checkpoint, in any order, and a
        retried load changes nothing). The server checks everything first and
        changes nothing when it refuses. The ``version`` of ``state`` is ignored.
        Sharded, each shard gets its range of every array; every shard checks its
        part first, and only if all would take it is it loaded on every shard.

        Args:
            state: ``optimizer`` (the server's optimizer's name), ``steps`` (an
                integer from 0 to 2**53), and ``arrays``: every array of the
                server's optimizer, each flat (or any shape) float32 with the
                model's number of elements.

        Returns:
            True when the state was loaded (by some shard); False when this state
            was loaded already (nothing changed).

        Raises:
            NotInitialized: before :meth:`init`.
            InvalidState: another optimizer, other arrays, an array of another size,
                a value that is not finite, a negative exp_avg_sq, a bad step count
                (sgd: a step count of 0 with a momentum buffer that is not zero), or
                another state when the server has applied updates already.
            DTypeMismatch: an array is not float32.
        """
        return run(self._load_optimizer_state(state))

    def load_weights(self, params: Mapping[str, Any] | np.ndarray) -> bool:
        """Make ``params`` the server's weights: the run starts from them, as if they had
        been the first worker's initial weights.

        For weights loaded after the workers joined (a checkpoint loaded into the model
        once the optimizer exists, as training scripts resume). They are taken only before
        the server has applied an update or taken a gradient, and only once per run: every
        rank may load the same weights (a no-op after the first, which returns False),
        while other weights than those loaded already are refused. The server checks
        everything first and changes nothing when it refuses. This worker then holds them.
        Sharded, each shard gets its range, after every shard checked its digest.

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
        return run(self._load_weights(params))

    def reconnect(self, *, timeout: float | None = 60.0) -> Mapping[str, np.ndarray]:
        """Open a new connection and rejoin under the same rank; returns the newest weights.

        Retries for a few seconds while the server still holds the rank (it has
        not yet noticed the old connection go). Workers made with
        ``reconnect=True`` (the default) do this by themselves.
        """
        return run(self._reconnect(timeout))

    def close(self) -> None:
        """Leave the training (the server stops counting this worker) and disconnect.

        A worker still open when its process exits leaves by itself (an ``atexit`` hook
        does what this does, within a few seconds in all), so that a script that ends
        without calling it is counted as having left, not as a crash."""
        self.leave()

    def _send_log_rest(self) -> None:
        """What is left to log, sent now unless the worker is closing, or another thread holds
        its channel in a call (nothing waits at exit)."""
        channel = self._channels[0]
        if self._closing or channel._closing or not channel._lock.acquire(blocking=False):
            return
        try:
            run(self._log_rest())
        finally:
            channel._lock.release()

    def leave(self, *, finished: bool = False) -> None:
        """Leave the run for good (the server stops counting this worker at once) and
        disconnect: :meth:`close` by its elastic name. ``finished``: this worker's
        training is done and the run is ending: an elastic server then holds the
        workers still training below MIN no more (they finish their part), where a
        plain leave (a worker scaled away) holds them until MIN are back."""
        if not self._closing:
            run(self._log_rest())
        self._closing = True
        for channel in self._channels:
            channel.close(finished=finished)
        if self._pool is not None:
            self._pool.shutdown()

    def __enter__(self) -> Worker:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
