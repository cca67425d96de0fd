"""A worker of a model cut across several servers: ``aps.Worker("tcp://ps0:7450,tcp://ps1:7450", ...)``.

Each server is one shard (``aps serve --shard I --shards K``) and holds one
contiguous range of the flat vector (:func:`aps.layout.shard_bounds`, the same
for every party). A :class:`ShardedWorker` is K plain workers, one per shard,
whose weight and gradient buffers are slices of one flat weight buffer and one
flat gradient buffer: its views (and ``aps.torch``'s in-place parameters) are
views into those, exactly as for one server. Each request goes to every shard
at once (one thread per shard beyond the first, each on its own connection), so
no shard waits for another's transfer, and returns once every shard answered.

Each shard runs the sync policy on its own clocks: BSP rounds close alike on
every shard (a sharded BSP run equals an unsharded one), SSP and DSSP bound
staleness on each shard and so overall, and under ASP each shard applies on
arrival: :attr:`ShardedWorker.version` is the smallest of the shards' versions.
At connection the worker checks that the servers are the shards ``0..K-1`` of
one model, started with the same options (ServerConfig.shard_description).
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import os
import re
import threading
from collections.abc import Awaitable, Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from types import MappingProxyType
from typing import Any

import numpy as np

from ..errors import (
    APSConnectionError,
    ConfigurationError,
    InvalidHyperparameters,
    InvalidState,
    LayoutMismatch,
    NotInitialized,
    ServerError,
)
from ..layout import Layout, check_floating, shard_bounds
from ..wire.protocol import (
    MAX_HYPER_GROUPS,
    HyperGroup,
    check_stops,
    decode_state_head,
    encode_hyper,
    encode_state_head,
    negative_second_moment,
    state_digest,
    weights_digest,
)
from .aio import AsyncWorker
from .payloads import checked_state, flat_weights_of, resolve_hyperparameters, server_hyperparameters
from .worker import AS_SHARD, ASYNC_AS_SHARD, ASYNC_SEND_TURN, SEND_TURN, Worker

__all__ = ["AsyncShardedWorker", "ShardedWorker", "split_addresses"]

log = logging.getLogger("aps.worker")

#: A push to one shard waits at most this long for the shards before it to have sent theirs.
TURN_WAIT_S = 5.0


def split_addresses(address: str | Sequence[str]) -> list[str]:
    """The servers an address names: ``"tcp://a:1,tcp://b:2"`` or a list of addresses."""
    parts = address.split(",") if isinstance(address, str) else list(address)
    parts = [p.strip() for p in parts]
    if not parts or any(not p for p in parts):
        raise ConfigurationError(f"an empty server address in {address!r}")
    return parts


class _ShardedViews:
    """What the blocking and the asyncio sharded workers share: the flat buffers and
    their views, the properties that combine the shards', and the checks."""

    _shards: list

    def _no_layout(self) -> None:
        """No model yet: the flat buffers come with the first init."""
        self._layout: Layout | None = None
        self._bounds: tuple[int, ...] = ()
        # Per shard: this worker's clock minus the shard's count (see clock).
        self._clock_offsets = [0] * len(self._shards)
        self._flat_weights: np.ndarray | None = None
        self._flat_grad: np.ndarray | None = None
        self._weights: Mapping[str, np.ndarray] = MappingProxyType({})
        self._grads: Mapping[str, np.ndarray] = MappingProxyType({})

    # What the shards share ------------------------------------------------
    @property
    def shards(self) -> Sequence:
        """The plain worker of each shard, in shard order."""
        return tuple(self._shards)

    @property
    def rank(self) -> int:
        return self._shards[0].rank

    @property
    def timeout(self) -> float | None:
        """Seconds to wait for each reply (see :class:`aps.Worker`); setting it sets every shard's."""
        return self._shards[0].timeout

    @timeout.setter
    def timeout(self, value: float | None) -> None:
        for worker in self._shards:
            worker.timeout = value

    @property
    def server_timeout(self) -> float | None:
        """See :class:`aps.Worker`; setting it sets every shard's."""
        return self._shards[0].server_timeout

    @server_timeout.setter
    def server_timeout(self, value: float | None) -> None:
        for worker in self._shards:
            worker.server_timeout = value

    @property
    def num_workers(self) -> int:
        return self._shards[0].num_workers

    @property
    def version(self) -> int:
        """The smallest of the shards' versions (each shard counts its own updates)."""
        return min(worker.version for worker in self._shards)

    @property
    def clock(self) -> int:
        """The iterations this worker has pushed that some shard still holds (docs/algorithms.md,
        "Sharded resume"): each shard counts its own, and a shard resumed from an older
        checkpoint forgets some, so this is the largest shard count, each shard's counted
        from where this worker found it (a shard that lost iterations does not make the
        worker take them again: the other shards have them)."""
        return max(worker.clock + offset for worker, offset in zip(self._shards, self._clock_offsets))

    def _versions(self) -> list[int]:
        return [worker.version for worker in self._shards]

    def _rewind_target(self, before: list[int]) -> int | None:
        """The version every shard must come back to, when a BSP shard resumed older during the
        last request (its version went back): the smallest shard's; None when nothing went back,
        or under other policies (their shards keep what they hold)."""
        if len(self._shards) < 2 or not any(w.version < v for w, v in zip(self._shards, before)):
            return None
        options = self.server_options or {}
        if options.get("sync") != "bsp":
            return None
        versions = self._versions()
        if len(set(versions)) == 1:
            return None  # every shard is at one round already
        return min(versions)

    def _common_cut(self, versions: list[list[int]], target: int) -> int | None:
        """The newest round at most ``target`` that every shard has a checkpoint of (None, with
        the reason logged, when there is none)."""
        common = set(versions[0]).intersection(*versions[1:])
        cut = max((v for v in common if v <= target), default=None)
        if cut is None:
            log.error("rank %d: shard versions %s after a shard resumed older, and no round that every shard has "
                      "a checkpoint of (at most version %d; the shards' checkpoints: %s): each shard goes on from "
                      "where it is, and the rounds the resumed shard lost stay lost for its range (take "
                      "checkpoints with --checkpoint-every-updates to have the shards' at the same rounds)",
                      self.rank, self._versions(), target, versions)
        else:
            log.warning("rank %d: a shard resumed older; every shard goes back to round %d (shard versions %s)",
                        self.rank, cut, self._versions())
        return cut

    def _cut_reached(self) -> None:
        """Every shard is back at one round: they count alike again, and so does the worker."""
        self._clock_offsets = [0] * len(self._shards)

    def _settle_clock(self) -> None:
        """After a request: each shard's count from now on goes on from :attr:`clock`."""
        clock = self.clock
        self._clock_offsets = [clock - worker.clock for worker in self._shards]

    @property
    def layout(self) -> Layout | None:
        return self._layout

    def half_buffers(self):
        """Not for a sharded model: each shard receives into buffers of its own."""
        raise ConfigurationError("half_buffers is not available for a sharded model")

    @property
    def server_options(self) -> dict[str, Any] | None:
        """As :attr:`Worker.server_options` (every shard runs with the same; checked at connection)."""
        return self._shards[0].server_options if self._shards else None

    @property
    def weights(self) -> Mapping[str, np.ndarray]:
        return self._weights

    @property
    def grads(self) -> Mapping[str, np.ndarray]:
        return self._grads

    @property
    def flat_weights(self) -> np.ndarray | None:
        return self._flat_weights

    @property
    def flat_grad(self) -> np.ndarray | None:
        return self._flat_grad

    @property
    def compression(self) -> str | None:
        """As :attr:`Worker.compression`; with shards on both transports, the TCP shards'."""
        return next((worker.compression for worker in self._shards if worker.compression), None)

    @property
    def last_push_dropped(self) -> bool:
        return any(worker.last_push_dropped for worker in self._shards)

    # Helpers --------------------------------------------------------------
    def _slice(self, flat: np.ndarray, index: int) -> np.ndarray:
        return flat[self._bounds[index] : self._bounds[index + 1]]

    def _require_layout(self) -> None:
        if self._layout is None:
            raise NotInitialized("call init(params) before pull or push")

    def _take(self, grads: Mapping[str, np.ndarray] | np.ndarray) -> None:
        """Put ``grads`` in the flat gradient buffer (nothing to do when they are in it)."""
        self._require_layout()
        flat, layout = self._flat_grad, self._layout
        if grads is flat or grads is self._grads:
            return
        if isinstance(grads, np.ndarray):
            if grads.shape != (layout.numel,):
                raise LayoutMismatch(f"a flat gradient must have shape ({layout.numel},), got {grads.shape}")
            check_floating(grads.dtype, "the flat gradient")
            np.copyto(flat, grads, casting="same_kind")  # float64/float16 converted here, as Worker does
            return
        if not isinstance(grads, Mapping):
            raise ConfigurationError("push takes a mapping of name to array, or a flat float32 array")
        layout.check(grads)
        for name, view in self._grads.items():
            view[...] = grads[name]

    def _adopt_layout(self, params: Mapping[str, Any]) -> Layout:
        """The model ``params`` describes, in the flat buffers (made, and their slices
        given to the shards' workers, at the first init)."""
        if not isinstance(params, Mapping) or not params:
            raise ConfigurationError("init takes a non-empty mapping of name to float32 array")
        layout = Layout.from_arrays(params)
        if self._layout is not None and layout != self._layout:
            raise LayoutMismatch(f"init with a different model than before: {self._layout.difference(layout)}")
        if self._layout is None:
            count = len(self._shards)
            self._bounds = shard_bounds(layout.numel, count)
            self._flat_weights = np.zeros(layout.numel, np.float32)
            self._flat_grad = np.zeros(layout.numel, np.float32)
            for index, worker in enumerate(self._shards):
                worker._core.adopt(self._slice(self._flat_weights, index), self._slice(self._flat_grad, index))
            self._layout = layout
            self._weights = MappingProxyType(layout.views(self._flat_weights))
            self._grads = MappingProxyType(layout.views(self._flat_grad))
        layout.flatten_into(params, self._flat_weights)
        return layout

    def _piece(self, layout: Layout, index: int) -> Mapping[str, np.ndarray]:
        """Shard ``index``'s range of the weights, as the tensors (and pieces) of its layout."""
        return layout.shard(index, len(self._shards)).views(self._slice(self._flat_weights, index))

    def _checked_runs(self) -> list[str] | None:
        """After init: a shard may have come back meanwhile (init reconnects), so check again;
        then the run id of every shard, for every shard to keep (its checkpoints keep them),
        so that shards resumed later from the checkpoints of different runs are told apart."""
        _check_runs(self._shards, [_description(worker) for worker in self._shards])
        runs = [worker.server_info.run_id for worker in self._shards]
        return runs if all(runs) else None

    def _hyper_payloads(self, groups: Sequence[Mapping[str, float]]) -> list[tuple[bytes, list[int]]]:
        """Each shard's HYPER payload for the model-wide ``groups`` (the groups that meet its
        range, their stops made local to it; every shard meets at least one group), with the
        model-wide number of each of its groups (for the messages)."""
        if self._layout is None:
            raise NotInitialized("call init(params) before set_hyperparameters")
        numel = self._layout.numel
        records = resolve_hyperparameters(groups, numel, server_hyperparameters(self._shards[0].server_info))
        if len(records) > MAX_HYPER_GROUPS:
            raise InvalidHyperparameters(f"{len(records)} groups; from 1 to {MAX_HYPER_GROUPS} are accepted")
        # The stops must cut the model for the cut by shard to mean anything; the shards
        # check the values (each sees its groups), as one server would.
        check_stops(records, numel)
        bounds = self._bounds
        return [(encode_hyper(shard_groups(records, bounds[index], bounds[index + 1])),
                 shard_group_numbers(records, bounds[index], bounds[index + 1]))
                for index in range(len(self._shards))]

    def _hyper_call(self, send: bool, payloads: list[tuple[bytes, list[int]]]):
        """``call(index, worker)`` for :meth:`_each`: check (``send`` False) or set shard
        ``index``'s part; a refusal names the group as the caller numbered it."""

        def call(index: int, worker):
            payload, numbers = payloads[index]
            method = worker._send_hyperparameters if send else worker._check_hyperparameters
            try:
                result = method(payload)
            except InvalidHyperparameters as exc:
                raise _renumber(exc, numbers) from None
            return _renumbered(result, numbers) if inspect.isawaitable(result) else result

        return call

    def _state_payloads(self, state: Mapping[str, Any]) -> list[tuple[bytes, list[np.ndarray]]]:
        """Each shard's LOAD_STATE head and arrays: every array of ``state`` cut by the shards'
        bounds (checked whole first, as one server would)."""
        if self._layout is None:
            raise NotInitialized("call init(params) before load_optimizer_state")
        optimizer, steps, names, arrays = checked_state(state, self._layout.numel)  # on the whole model
        payloads = []
        for lo, hi in zip(self._bounds, self._bounds[1:]):
            pieces = [array[lo:hi] for array in arrays]
            payloads.append((encode_state_head(optimizer, steps, hi - lo, names, digest=state_digest(steps, pieces)),
                             pieces))
        return payloads

    def _weights_payloads(self, params: Mapping[str, Any] | np.ndarray) -> list[tuple[bytes, np.ndarray]]:
        """Each shard's LOAD_WEIGHTS digest and weights: the whole model's (checked whole
        first, as one server would) cut by the shards' bounds."""
        if self._layout is None:
            raise NotInitialized("call init(params) before load_weights")
        flat = flat_weights_of(params, self._layout)
        pieces = [flat[lo:hi] for lo, hi in zip(self._bounds, self._bounds[1:])]
        return [(weights_digest((piece,)), piece) for piece in pieces]

    @staticmethod
    def _check_values(payloads: list[tuple[bytes, list[np.ndarray]]]) -> None:
        """Refuse, before any shard loads its piece, what a shard would refuse only once its
        arrays arrived (CHECK sends heads alone): else the others would be loaded.

        Raises:
            InvalidState: a negative second moment (``exp_avg_sq``).
        """
        names = decode_state_head(payloads[0][0]).arrays
        problem = negative_second_moment({name: [pieces[index] for _, pieces in payloads]
                                          for index, name in enumerate(names)})
        if problem is not None:
            raise InvalidState(problem)

    def _joined_state(self, states: list[dict[str, Any]]) -> dict[str, Any]:
        """The shards' states as one: each array the shards' pieces end to end."""
        first = states[0]
        steps = [state["steps"] for state in states]
        if len(set(steps)) > 1:
            raise InvalidState(f"the shards' optimizers have applied different numbers of updates ({steps}, in shard "
                               "order): the state was read while updates were being applied; read it again when no "
                               "worker pushes (after a BSP round, or with the others waiting)")
        for index, state in enumerate(states):
            if state["optimizer"] != first["optimizer"] or list(state["arrays"]) != list(first["arrays"]):
                raise InvalidState(f"shard {index} holds {state['optimizer']} state {list(state['arrays'])}, shard 0 "
                                   f"{first['optimizer']} state {list(first['arrays'])}")
        arrays = {name: np.concatenate([state["arrays"][name] for state in states]) for name in first["arrays"]}
        return {"optimizer": first["optimizer"], "steps": first["steps"],
                "version": min(state["version"] for state in states), "arrays": arrays}

    def _send_order(self) -> list[int]:
        """The order a push leaves this worker in, shard by shard: from shard ``rank % K`` on,
        so that workers start on different shards."""
        count = len(self._shards)
        return [(self.rank + step) % count for step in range(count)]

class ShardedWorker(_ShardedViews, Worker):
    """A blocking worker for a model sharded across several ``aps serve`` processes.

    Made by :class:`aps.Worker` when its address names more than one server
    (a comma-separated string, or a list); takes the same arguments. See the
    module docstring for what sharding means for each paradigm.
    """

    def __init__(self, address: str | Sequence[str] | None = None, rank: int | None = None,
                 num_workers: int | None = None, transport: str = "auto", **options: Any) -> None:
        self._shards: list[Worker] = []
        self._pool: ThreadPoolExecutor | None = None
        if address is None:
            address = os.environ.get("APS_ADDRESS", "")
        addresses = split_addresses(address)
        AS_SHARD.on = True
        try:
            for one in addresses:
                self._shards.append(Worker(one, rank, num_workers, transport, **options))
            self._shards = _in_shard_order(self._shards)
        except BaseException:
            for worker in self._shards:
                worker.close()
            raise
        finally:
            AS_SHARD.on = False
        self._closing = False
        self.reconnect_timeout = self._shards[0].reconnect_timeout
        self.address = ",".join(worker.address for worker in self._shards)
        self.transport = "+".join(sorted({worker.transport for worker in self._shards}))
        self._pool = ThreadPoolExecutor(max_workers=max(1, len(self._shards) - 1), thread_name_prefix="aps-shard")
        self._lock = threading.RLock()
        self._no_layout()

    # Requests -------------------------------------------------------------
    def init(self, params: Mapping[str, Any], *, timeout: float | None = 300.0) -> Mapping[str, np.ndarray]:
        """Join every shard with its range of ``params``; returns the weights (views)."""
        layout = self._adopt_layout(params)

        def join(index: int, worker: Worker) -> None:
            worker.init(self._piece(layout, index), timeout=timeout)

        self._each(join)
        runs = self._checked_runs()
        if runs:
            self._each(lambda index, worker: worker._record_shard_runs(runs))
        return self._weights

    def pull(self) -> Mapping[str, np.ndarray]:
        self._require_layout()
        before = self._versions()
        self._each(lambda index, worker: worker.pull())
        self._one_cut(before)
        return self._weights

    def push(self, grads: Mapping[str, np.ndarray] | np.ndarray) -> None:
        self._take(grads)
        before = self._versions()
        self._each(lambda index, worker: worker.push(self._slice(self._flat_grad, index)), in_turn=True)
        self._one_cut(before)

    def push_pull(self, grads: Mapping[str, np.ndarray] | np.ndarray) -> Mapping[str, np.ndarray]:
        self._take(grads)
        before = self._versions()
        self._each(lambda index, worker: worker.push_pull(self._slice(self._flat_grad, index)), in_turn=True)
        self._one_cut(before)
        return self._weights

    def _one_cut(self, before: list[int]) -> None:
        """After a request in which a BSP shard came back older: bring every shard back to one
        round (docs/algorithms.md, "Sharded resume")."""
        target = self._rewind_target(before)
        if target is None:
            return
        versions: list[list[int]] = [[] for _ in self._shards]

        def listed(index: int, worker: Worker) -> None:
            versions[index] = worker._checkpoint_versions()

        try:
            self._each(listed)
        except ServerError as exc:  # no --checkpoint-dir, an older server: each goes on from where it is
            log.error("rank %d: a shard resumed older, and the shards cannot be brought back to one round: %s",
                      self.rank, exc)
            return
        cut = self._common_cut(versions, target)
        if cut is None:
            return
        try:
            self._each(lambda index, worker: worker._rewind(cut, self.reconnect_timeout))
        except ServerError as exc:
            log.error("rank %d: a shard refused to go back to round %d: %s", self.rank, cut, exc)
            return
        self._cut_reached()

    def ping(self) -> int:
        versions = [0] * len(self._shards)

        def one(index: int, worker: Worker) -> None:
            versions[index] = worker.ping()

        self._each(one)
        return min(versions)

    def set_hyperparameters(self, groups: Sequence[Mapping[str, float]]) -> None:
        """See :meth:`aps.Worker.set_hyperparameters`; ``stop`` counts in the whole model.
        Each shard gets the groups that meet its range, cut to it. Every shard checks its
        part first (Flag.CHECK), and only if all take them are they set on every shard: a
        refused request changes no shard."""
        payloads = self._hyper_payloads(groups)
        self._each(self._hyper_call(False, payloads))
        self._each(self._hyper_call(True, payloads))

    def optimizer_state(self) -> dict[str, Any]:
        """See :meth:`aps.Worker.optimizer_state`: every shard's state, read at once, each
        array the shards' pieces end to end (the whole model's); ``version`` is the
        smallest of the shards'.

        Raises:
            NotInitialized: before :meth:`init`.
            InvalidState: the shards' step counts differ (the state was read while
                updates were being applied).
        """
        self._require_layout()
        states: list[dict[str, Any]] = [{}] * len(self._shards)

        def read(index: int, worker: Worker) -> None:
            states[index] = worker.optimizer_state()

        self._each(read)
        return self._joined_state(states)

    def load_optimizer_state(self, state: Mapping[str, Any]) -> bool:
        """See :meth:`aps.Worker.load_optimizer_state`; each shard gets its range of every
        array. Every shard checks its part first (Flag.CHECK), and only if all would take
        it is it loaded on every shard: a state refused by one shard changes no shard.

        Returns:
            True when a shard loaded it; False when every shard had it loaded already.
        """
        payloads = self._state_payloads(state)
        self._each(lambda index, worker: worker._check_state(payloads[index][0]))
        self._check_values(payloads)
        loaded = [False] * len(self._shards)

        def load(index: int, worker: Worker) -> None:
            loaded[index] = worker._load_state(*payloads[index])

        self._each(load)
        return any(loaded)

    def load_weights(self, params: Mapping[str, Any] | np.ndarray) -> bool:
        """See :meth:`aps.Worker.load_weights`; each shard gets its range. Every shard checks
        its digest first (Flag.CHECK), and only if all would take them are they loaded on
        every shard: weights refused by one shard change no shard.

        Returns:
            True when a shard loaded them; False when every shard had them loaded already.
        """
        payloads = self._weights_payloads(params)
        self._each(lambda index, worker: worker._check_weights(payloads[index][0]))
        loaded = [False] * len(self._shards)

        def load(index: int, worker: Worker) -> None:
            loaded[index] = worker._load_weights(*payloads[index])

        self._each(load)
        return any(loaded)

    def reconnect(self, *, timeout: float | None = 60.0) -> Mapping[str, np.ndarray]:
        self._each(lambda index, worker: worker.reconnect(timeout=timeout))
        return self._weights

    def close(self) -> None:
        """Leave every shard and disconnect."""
        self._closing = True
        for worker in self._shards:
            worker.close()
        if self._pool is not None:
            self._pool.shutdown(wait=False)

    def __enter__(self) -> ShardedWorker:
        return self

    def __del__(self) -> None:
        pass  # each shard's worker frees its own connection

    def _each(self, call: Callable[[int, Worker], None], *, in_turn: bool = False) -> None:
        """``call(index, worker)`` for every shard at once; raises the first failure
        (after every shard finished: none is left half-way in its request).

        ``in_turn`` (pushes): the shards' requests leave this worker one after the
        other, starting with shard ``rank % K`` (so workers start on different
        shards), each as soon as the one before it is sent, while the replies of
        the shards served first come in. Sent all at once, the pieces would share
        the worker's link and arrive together, then their replies would come back
        together: every link busy one way at a time."""
        count = len(self._shards)
        turns: list[_Turn | None] = [None] * count
        if in_turn and count > 1:
            order = self._send_order()
            turnstile = _Turnstile()
            for position, index in enumerate(order):
                turns[index] = _Turn(turnstile, position)

        def run(index: int, worker: Worker) -> None:
            turn = turns[index]
            SEND_TURN.turn = turn
            try:
                call(index, worker)
            finally:
                SEND_TURN.turn = None
                if turn is not None:
                    turn.done()  # sent or failed: the next shard's turn

        with self._lock:
            if self._closing:
                raise APSConnectionError(f"the worker of {self.address} is closed")
            futures = [self._pool.submit(run, index, worker) for index, worker in enumerate(self._shards) if index]
            errors: list[BaseException] = []
            try:
                try:
                    run(0, self._shards[0])
                except Exception as exc:
                    errors.append(exc)
                for future in futures:
                    try:
                        future.result()
                    except Exception as exc:
                        errors.append(exc)
            except BaseException:  # Ctrl-C: every shard's request ends, not the first one's only
                self._interrupt(futures)
                raise
            finally:
                self._settle_clock()
            if errors:
                for extra in errors[1:]:
                    log.warning("rank %d: another shard failed too: %s: %s", self.rank, type(extra).__name__, extra)
                raise errors[0]

    def _interrupt(self, futures: list) -> None:
        """End the requests still running on the other shards (their connections are shut,
        as close() does), and wait for their threads a little."""
        for worker in self._shards:
            conn = worker._conn
            if conn is not None:
                conn.shutdown()
        for future in futures:
            try:
                future.result(timeout=5.0)
            except Exception:  # noqa: S110 - each ends with its connection's error
                pass


class AsyncShardedWorker(_ShardedViews, AsyncWorker):
    """The asyncio twin of :class:`ShardedWorker`: made by ``await AsyncWorker.connect(...)``
    when the address names more than one server; one :class:`aps.AsyncWorker` per shard,
    every request on every shard at once (``asyncio.gather``), pushes sent in turn."""

    def __init__(self, shards: list[AsyncWorker]) -> None:  # see open()
        self._shards = shards
        self._closing = False
        self.reconnect_timeout = shards[0].reconnect_timeout
        self.address = ",".join(worker.address for worker in shards)
        self.transport = "tcp"
        self._lock = asyncio.Lock()
        self._no_layout()

    @classmethod
    async def open(cls, address: str | Sequence[str], rank: int, num_workers: int, transport: str = "auto",
                   **options: Any) -> AsyncShardedWorker:
        """Connect to every shard (at once) and check that they are the shards of one model."""
        shards: list[AsyncWorker] = []
        token = ASYNC_AS_SHARD.set(True)
        try:
            results = await asyncio.gather(
                *(AsyncWorker.connect(one, rank, num_workers, transport, **options)
                  for one in split_addresses(address)), return_exceptions=True)
            shards = [r for r in results if isinstance(r, AsyncWorker)]
            failed = next((r for r in results if isinstance(r, BaseException)), None)
            if failed is not None:
                raise failed
            return cls(_in_shard_order(shards))
        except BaseException:
            for worker in shards:
                await worker.close()
            raise
        finally:
            ASYNC_AS_SHARD.reset(token)

    @property
    def connected(self) -> bool:
        return all(worker._conn is not None for worker in self._shards)

    # Requests -------------------------------------------------------------
    async def init(self, params: Mapping[str, Any], *, timeout: float | None = 300.0) -> Mapping[str, np.ndarray]:
        """See :meth:`ShardedWorker.init`."""
        layout = self._adopt_layout(params)
        await self._each(lambda index, worker: worker.init(self._piece(layout, index), timeout=timeout))
        runs = self._checked_runs()
        if runs:
            await self._each(lambda index, worker: worker._record_shard_runs(runs))
        return self._weights

    async def pull(self) -> Mapping[str, np.ndarray]:
        self._require_layout()
        before = self._versions()
        await self._each(lambda index, worker: worker.pull())
        await self._one_cut(before)
        return self._weights

    async def push(self, grads) -> None:
        self._take(grads)
        before = self._versions()
        await self._each(lambda index, worker: worker.push(self._slice(self._flat_grad, index)), in_turn=True)
        await self._one_cut(before)

    async def push_pull(self, grads) -> Mapping[str, np.ndarray]:
        self._take(grads)
        before = self._versions()
        await self._each(lambda index, worker: worker.push_pull(self._slice(self._flat_grad, index)), in_turn=True)
        await self._one_cut(before)
        return self._weights

    async def _one_cut(self, before: list[int]) -> None:
        """See :meth:`ShardedWorker._one_cut`."""
        target = self._rewind_target(before)
        if target is None:
            return
        try:
            versions = await self._each(lambda index, worker: worker._checkpoint_versions())
        except ServerError as exc:
            log.error("rank %d: a shard resumed older, and the shards cannot be brought back to one round: %s",
                      self.rank, exc)
            return
        cut = self._common_cut(list(versions), target)
        if cut is None:
            return
        try:
            await self._each(lambda index, worker: worker._rewind(cut, self.reconnect_timeout))
        except ServerError as exc:
            log.error("rank %d: a shard refused to go back to round %d: %s", self.rank, cut, exc)
            return
        self._cut_reached()

    async def ping(self) -> int:
        versions = await self._each(lambda index, worker: worker.ping())
        return min(versions)

    async def set_hyperparameters(self, groups: Sequence[Mapping[str, float]]) -> None:
        """See :meth:`ShardedWorker.set_hyperparameters`."""
        payloads = self._hyper_payloads(groups)
        await self._each(self._hyper_call(False, payloads))
        await self._each(self._hyper_call(True, payloads))

    async def optimizer_state(self) -> dict[str, Any]:
        """See :meth:`ShardedWorker.optimizer_state`."""
        self._require_layout()
        return self._joined_state(await self._each(lambda index, worker: worker.optimizer_state()))

    async def load_optimizer_state(self, state: Mapping[str, Any]) -> bool:
        """See :meth:`ShardedWorker.load_optimizer_state`."""
        payloads = self._state_payloads(state)
        await self._each(lambda index, worker: worker._check_state(payloads[index][0]))
        self._check_values(payloads)
        return any(await self._each(lambda index, worker: worker._load_state(*payloads[index])))

    async def load_weights(self, params: Mapping[str, Any] | np.ndarray) -> bool:
        """See :meth:`ShardedWorker.load_weights`."""
        payloads = self._weights_payloads(params)
        await self._each(lambda index, worker: worker._check_weights(payloads[index][0]))
        return any(await self._each(lambda index, worker: worker._load_weights(*payloads[index])))

    async def reconnect(self, *, timeout: float | None = 60.0) -> Mapping[str, np.ndarray]:
        await self._each(lambda index, worker: worker.reconnect(timeout=timeout))
        return self._weights

    async def close(self) -> None:
        """Leave every shard and disconnect."""
        self._closing = True
        await asyncio.gather(*(worker.close() for worker in self._shards), return_exceptions=True)

    async def __aenter__(self) -> AsyncShardedWorker:
        return self

    async def _each(self, call: Callable[[int, AsyncWorker], Awaitable], *, in_turn: bool = False) -> list:
        """Await ``call(index, worker)`` for every shard at once; returns their results in
        shard order, or raises the first failure once every shard finished. ``in_turn``:
        see :meth:`ShardedWorker._each`."""
        count = len(self._shards)
        turns: list[_AsyncTurn | None] = [None] * count
        if in_turn and count > 1:
            events = [asyncio.Event() for _ in range(count)]
            for position, index in enumerate(self._send_order()):
                turns[index] = _AsyncTurn(events[position - 1] if position else None, events[position])

        async def run(index: int, worker: AsyncWorker):
            turn = turns[index]
            ASYNC_SEND_TURN.set(turn)  # this task's own context
            try:
                return await call(index, worker)
            finally:
                if turn is not None:
                    turn.done()

        async with self._lock:
            if self._closing:
                raise APSConnectionError(f"the worker of {self.address} is closed")
            try:
                results = await asyncio.gather(*(run(i, w) for i, w in enumerate(self._shards)),
                                               return_exceptions=True)
            finally:
                self._settle_clock()
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            for extra in errors[1:]:
                log.warning("rank %d: another shard failed too: %s: %s", self.rank, type(extra).__name__, extra)
            raise errors[0]
        return results


class _AsyncTurn:
    """One shard's place in an asyncio push's sending order (see :class:`_Turn`)."""

    __slots__ = ("_before", "_mine")

    def __init__(self, before: asyncio.Event | None, mine: asyncio.Event) -> None:
        self._before, self._mine = before, mine

    async def wait(self) -> None:
        if self._before is not None and not self._mine.is_set():
            try:
                await asyncio.wait_for(self._before.wait(), TURN_WAIT_S)
            except asyncio.TimeoutError:
                pass

    def done(self) -> None:
        self._mine.set()


def shard_group_numbers(groups: list[HyperGroup], start: int, stop: int) -> list[int]:
    """The numbers (in ``groups``) of the groups :func:`shard_groups` keeps for ``[start, stop)``."""
    numbers, begin = [], 0
    for number, group in enumerate(groups):
        if begin < stop and group.stop > start:
            numbers.append(number)
        begin = group.stop
    return numbers


def _renumber(exc: InvalidHyperparameters, numbers: list[int]) -> InvalidHyperparameters:
    """A shard's refusal naming ``group N`` in its own numbering, made the caller's: ``numbers[N]``."""
    match = re.match(r"group (\d+):", str(exc))
    if match is None or int(match.group(1)) >= len(numbers):
        return exc
    return InvalidHyperparameters(f"group {numbers[int(match.group(1))]}:" + str(exc)[match.end():])


async def _renumbered(result: Awaitable, numbers: list[int]):
    """Await ``result`` (a shard's HYPER call); a refusal is renumbered (see :func:`_renumber`)."""
    try:
        return await result
    except InvalidHyperparameters as exc:
        raise _renumber(exc, numbers) from None


def shard_groups(groups: list[HyperGroup], start: int, stop: int) -> list[HyperGroup]:
    """The groups (stops in the whole model, strictly increasing) that meet ``[start, stop)``,
    with stops counted from ``start`` and the last cut at the range's end."""
    local, begin = [], 0
    for group in groups:
        if begin < stop and group.stop > start:
            local.append(group._replace(stop=min(group.stop, stop) - start))
        begin = group.stop
    return local


def _in_shard_order(workers: list[Worker]) -> list[Worker]:
    """``workers`` by their server's shard index, after checking that the servers are
    the shards ``0..K-1`` of one model, started with the same options."""
    count = len(workers)
    described = [_description(worker) for worker in workers]
    by_index: dict[int, tuple[Worker, dict]] = {}
    for worker, description in zip(workers, described):
        index, shards = description.get("shard"), description.get("shards")
        if shards != count:
            raise ConfigurationError(
                f"the server at {worker.address} is shard {index} of {shards} (--shard {index} --shards {shards}), "
                f"but this worker was given {count} servers")
        if index in by_index:
            raise ConfigurationError(f"the servers at {by_index[index][0].address} and {worker.address} are both "
                                     f"shard {index} (--shard {index})")
        by_index[index] = (worker, description)
    first_worker, first = by_index[0]
    for index in range(1, count):
        worker, description = by_index[index]
        for name, value in first.items():
            if name not in ("shard", "runs") and description.get(name) != value:
                flag = "--" + name.replace("_", "-")
                raise ConfigurationError(
                    f"shard {index} at {worker.address} was started with {flag} {description.get(name)}, shard 0 "
                    f"at {first_worker.address} with {flag} {value}: every shard must be started with the same "
                    "options")
    ordered = [by_index[index][0] for index in range(count)]
    _check_runs(ordered, [by_index[index][1] for index in range(count)])
    return ordered


def _description(worker: Worker) -> dict:
    """What ``worker``'s server said of its shard in the handshake."""
    text = worker.server_info.shard
    try:
        described = json.loads(text) if text else None
    except ValueError:
        described = None
    if not isinstance(described, dict) or not isinstance(described.get("shard"), int):
        raise ConfigurationError(f"the server at {worker.address} does not say which shard it is "
                                 "(an older aps?): it cannot serve a sharded model")
    return described


def _check_runs(workers: list[Worker], described: list[dict]) -> None:
    """Each shard's run is the one the others recorded for it (when they recorded one): the
    shards hold one model, not shards of different runs resumed side by side."""
    runs = [worker.server_info.run_id for worker in workers]
    for index, description in enumerate(described):
        recorded = description.get("runs")
        if not isinstance(recorded, list) or len(recorded) != len(workers):
            continue
        for other, (expected, actual) in enumerate(zip(recorded, runs)):
            if expected != actual:
                raise ConfigurationError(
                    f"shard {other} at {workers[other].address} holds run {actual}, but shard {index} at "
                    f"{workers[index].address} was trained beside run {expected} there: shard {other} was started "
                    "without --resume, or resumed from another run's checkpoint")


class _Turnstile:
    """Whose turn it is to send: positions 0, 1, ... in order."""

    def __init__(self) -> None:
        self.condition = threading.Condition()
        self.next = 0


class _Turn:
    """One shard's place in a push's sending order: :meth:`wait` until the shards before
    it have sent (or failed), :meth:`done` once it has (once; waiting again returns at once)."""

    __slots__ = ("_turnstile", "_position", "_done")

    def __init__(self, turnstile: _Turnstile, position: int) -> None:
        self._turnstile = turnstile
        self._position = position
        self._done = False

    def wait(self) -> None:
        """Wait for the turn; at most TURN_WAIT_S (the order only saves time: a shard that takes
        long to send, or is reconnecting, does not keep the others from their servers)."""
        turnstile = self._turnstile
        with turnstile.condition:
            turnstile.condition.wait_for(lambda: self._done or turnstile.next >= self._position, TURN_WAIT_S)

    def done(self) -> None:
        turnstile = self._turnstile
        with turnstile.condition:
            if not self._done:
                self._done = True
                turnstile.next = max(turnstile.next, self._position + 1)
                turnstile.condition.notify_all()
