"""A model cut across several servers: what :class:`aps.Worker` does when its address
names more than one (``aps.Worker("tcp://ps0:7450,tcp://ps1:7450", ...)``).

Each server is one shard (``aps serve --shard I --shards K``) and holds one
contiguous range of the flat vector (:func:`aps.layout.shard_bounds`, the same
for every party). The worker keeps one flat weight buffer and one flat gradient
buffer, and each shard's channel receives into and sends from its slice of them:
its views (and ``aps.torch``'s in-place parameters) are views into those, exactly
as for one server. Each request goes to every shard at once (one thread per shard
beyond the first, or one task each under asyncio), and returns once every shard
answered. This module holds what only K > 1 needs: the check that the servers are
the shards ``0..K-1`` of one model started with the same options
(ServerConfig.shard_description) and of one run, each shard's part of a request
cut from the whole (checked whole first, as one server would; then every shard
checks its part before any takes it), the shards' answers joined, and the order a
push leaves the worker in (:class:`_Turn`).

Each shard runs the sync policy on its own clocks: BSP rounds close alike on
every shard (a sharded BSP run equals an unsharded one), SSP and DSSP bound
staleness on each shard and so overall, and under ASP each shard applies on
arrival: the worker's version is the smallest of the shards' versions.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import queue
import re
import threading
from concurrent.futures import Future
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from .. import _core
from ..errors import ConfigurationError, InvalidHyperparameters, InvalidState, NonFiniteGradient, NotInitialized
from ..layout import Layout
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
from .arguments import _names_shards
from .payloads import checked_state, flat_weights_of, resolve_hyperparameters

__all__ = ["split_addresses"]

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


def server_addresses(address: Any) -> list:
    """The server of each channel a worker opens: ``address``, or ``$APS_ADDRESS`` when it is
    None, cut into the shards it names (one element, the address as given, when it names one)."""
    named = address if address is not None else os.environ.get("APS_ADDRESS", "")
    return split_addresses(named) if _names_shards(named) else [address]


def send_order(rank: int, count: int) -> list[int]:
    """The order a push leaves a worker in, shard by shard: from shard ``rank % K`` on,
    so that workers start on different shards."""
    return [(rank + step) % count for step in range(count)]


def hyper_payloads(
    groups: Sequence[Mapping[str, float]], numel: int, defaults: Mapping[str, float] | None, bounds: Sequence[int]
) -> list[tuple[bytes, list[int]]]:
    """Each shard's HYPER payload for the model-wide ``groups`` (the groups that meet its
    range, their stops made local to it; every shard meets at least one group), with the
    model-wide number of each of its groups (for the messages)."""
    records = resolve_hyperparameters(groups, numel, defaults)
    if len(records) > MAX_HYPER_GROUPS:
        raise InvalidHyperparameters(f"{len(records)} groups; from 1 to {MAX_HYPER_GROUPS} are accepted")
    # The stops must cut the model for the cut by shard to mean anything; the shards
    # check the values (each sees its groups), as one server would.
    check_stops(records, numel)
    return [
        (encode_hyper(shard_groups(records, lo, hi)), shard_group_numbers(records, lo, hi))
        for lo, hi in zip(bounds, bounds[1:])
    ]


def state_payloads(state: Mapping[str, Any], numel: int, bounds: Sequence[int]) -> list[tuple[bytes, list[np.ndarray]]]:
    """Each shard's LOAD_STATE head and arrays: every array of ``state`` cut by the shards'
    bounds (checked whole first, as one server would)."""
    optimizer, steps, names, arrays = checked_state(state, numel)  # on the whole model
    payloads = []
    for lo, hi in zip(bounds, bounds[1:]):
        pieces = [array[lo:hi] for array in arrays]
        payloads.append(
            (encode_state_head(optimizer, steps, hi - lo, names, digest=state_digest(steps, pieces)), pieces)
        )
    return payloads


def check_values(payloads: list[tuple[bytes, list[np.ndarray]]]) -> None:
    """Refuse, before any shard loads its piece, what a shard would refuse only once its
    arrays arrived (CHECK sends heads alone): else the others would be loaded.

    Raises:
        InvalidState: a negative second moment (``exp_avg_sq``).
    """
    names = decode_state_head(payloads[0][0]).arrays
    problem = negative_second_moment(
        {name: [pieces[index] for _, pieces in payloads] for index, name in enumerate(names)}
    )
    if problem is not None:
        raise InvalidState(problem)


def weights_payloads(
    params: Mapping[str, Any] | np.ndarray, layout: Layout | None, bounds: Sequence[int]
) -> list[tuple[bytes, np.ndarray]]:
    """Each shard's LOAD_WEIGHTS digest and weights: the whole model's (checked whole
    first, as one server would) cut by the shards' bounds."""
    if layout is None:
        raise NotInitialized("call init(params) before load_weights")
    flat = flat_weights_of(params, layout)
    pieces = [flat[lo:hi] for lo, hi in zip(bounds, bounds[1:])]
    return [(weights_digest((piece,)), piece) for piece in pieces]


def joined_state(states: list[dict[str, Any]]) -> dict[str, Any]:
    """The shards' optimizer states as one: each array the shards' pieces end to end."""
    first = states[0]
    steps = [state["steps"] for state in states]
    if len(set(steps)) > 1:
        raise InvalidState(
            f"the shards' optimizers have applied different numbers of updates ({steps}, in shard "
            "order): the state was read while updates were being applied; read it again when no "
            "worker pushes (after a BSP round, or with the others waiting)"
        )
    for index, state in enumerate(states):
        if state["optimizer"] != first["optimizer"] or list(state["arrays"]) != list(first["arrays"]):
            raise InvalidState(
                f"shard {index} holds {state['optimizer']} state {list(state['arrays'])}, shard 0 "
                f"{first['optimizer']} state {list(first['arrays'])}"
            )
    arrays = {name: np.concatenate([state["arrays"][name] for state in states]) for name in first["arrays"]}
    return {
        "optimizer": first["optimizer"],
        "steps": first["steps"],
        "version": min(state["version"] for state in states),
        "arrays": arrays,
    }


def check_fp16_range(pieces: list, channels: list) -> None:
    """Refuse a push whole, before any shard sends its piece, when a piece that goes as fp16
    holds a finite element beyond fp16's range (from 65520 up it rounds to infinity): each
    shard's channel would refuse only its own piece, after the shards before it had sent
    theirs. (A piece that is already 16-bit words, the caller's half buffer, goes as it is.)"""
    overflowed = 0
    for piece, channel in zip(pieces, channels):
        core = channel._core
        if core.compressing and core.compression == _core.FLOAT16 and piece.dtype == np.float32:
            overflowed += int(np.count_nonzero(np.abs(piece[np.isfinite(piece)]) >= 65520.0))
    if overflowed:
        raise NonFiniteGradient(
            f"{overflowed} gradient element(s) beyond fp16's range (|x| > 65504): nothing was sent; "
            "scale the loss down, or use compression='bf16' (float32's range)"
        )


def common_cut(rank: int | None, now: list[int], versions: list[list[int]], target: int) -> int | None:
    """The newest round at most ``target`` that every shard has a checkpoint of (None, with
    the reason logged, when there is none); ``now``: the shards' versions."""
    common = set(versions[0]).intersection(*versions[1:])
    cut = max((v for v in common if v <= target), default=None)
    if cut is None:
        log.error(
            "rank %s: shard versions %s after a shard resumed older, and no round that every shard has "
            "a checkpoint of (at most version %d; the shards' checkpoints: %s): each shard goes on from "
            "where it is, and the rounds the resumed shard lost stay lost for its range (take "
            "checkpoints with --checkpoint-every-updates to have the shards' at the same rounds)",
            rank,
            now,
            target,
            versions,
        )
    else:
        log.warning(
            "rank %s: a shard resumed older; every shard goes back to round %d (shard versions %s)", rank, cut, now
        )
    return cut


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
    return InvalidHyperparameters(f"group {numbers[int(match.group(1))]}:" + str(exc)[match.end() :])


def shard_groups(groups: list[HyperGroup], start: int, stop: int) -> list[HyperGroup]:
    """The groups (stops in the whole model, strictly increasing) that meet ``[start, stop)``,
    with stops counted from ``start`` and the last cut at the range's end."""
    local, begin = [], 0
    for group in groups:
        if begin < stop and group.stop > start:
            local.append(group._replace(stop=min(group.stop, stop) - start))
        begin = group.stop
    return local


#: What a shard's description says of itself alone, not options every shard must share.
_NOT_SHARED = frozenset(
    {"shard", "runs", "registered", "heartbeat_timeout", "pipelining", "pace", "replicas", "failover_timeout"}
)


def in_shard_order(workers: list) -> list:
    """``workers`` by their server's shard index, after checking that the servers are
    the shards ``0..K-1`` of one model, started with the same options."""
    count = len(workers)
    described = [_description(worker) for worker in workers]
    by_index: dict[int, tuple[Any, dict]] = {}
    for worker, description in zip(workers, described):
        index, shards = description.get("shard"), description.get("shards")
        if shards != count or not isinstance(index, int) or not 0 <= index < count:
            raise ConfigurationError(
                f"the server at {worker.address} is shard {index} of {shards} (--shard {index} --shards {shards}), "
                f"but this worker was given {count} servers"
            )
        if index in by_index:
            raise ConfigurationError(
                f"the servers at {by_index[index][0].address} and {worker.address} are both "
                f"shard {index} (--shard {index})"
            )
        by_index[index] = (worker, description)
    first_worker, first = by_index[0]
    for index in range(1, count):
        worker, description = by_index[index]
        for name, value in first.items():
            if name not in _NOT_SHARED and description.get(name) != value:
                flag = "--" + name.replace("_", "-")
                raise ConfigurationError(
                    f"shard {index} at {worker.address} was started with {flag} {description.get(name)}, shard 0 "
                    f"at {first_worker.address} with {flag} {value}: every shard must be started with the same "
                    "options"
                )
    ordered = [by_index[index][0] for index in range(count)]
    check_runs(ordered, [by_index[index][1] for index in range(count)])
    return ordered


def check_fragment(channel, index: int | None, count: int) -> None:
    """``channel``'s server is shard ``index`` (None: any) of ``count`` (two or more): the worker
    of one fragment of streaming local SGD (:mod:`aps.torch.streaming`), whose layout is that
    shard's range alone, may reach one shard of a sharded model."""
    described = _description(channel)
    shard = described.get("shard") if index is None else index
    if count < 2 or (described.get("shard"), described.get("shards")) != (shard, count):
        raise ConfigurationError(
            f"the server at {channel.address} is shard {described.get('shard')} of {described.get('shards')}, "
            + (f"not one of {count} shards" if index is None else f"not shard {index} of {count}")
        )


def _description(worker) -> dict:
    """What ``worker``'s server said of its shard in the handshake."""
    text = worker.server_info.shard
    try:
        described = json.loads(text) if text else None
    except ValueError:
        described = None
    if not isinstance(described, dict) or not isinstance(described.get("shard"), int):
        raise ConfigurationError(
            f"the server at {worker.address} does not say which shard it is "
            "(an older aps?): it cannot serve a sharded model"
        )
    return described


def check_runs(workers: list, described: list[dict] | None = None) -> None:
    """Each shard's run is the one the others recorded for it (when they recorded one): the
    shards hold one model, not shards of different runs resumed side by side."""
    if described is None:
        described = [_description(worker) for worker in workers]
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
                    "without --resume, or resumed from another run's checkpoint"
                )


class _ShardThreads:
    """The blocking worker's threads for shards 1..K-1: one daemon thread each, running
    what it is handed. Daemon threads, unlike a ThreadPoolExecutor's (joined at interpreter
    exit before the atexit hooks run): a shard's request held at the gate cannot hold the
    process's exit, and the exit hook still says goodbye for every channel."""

    def __init__(self, count: int) -> None:
        self._queues: list[queue.SimpleQueue] = [queue.SimpleQueue() for _ in range(count)]
        for index, jobs in enumerate(self._queues):
            threading.Thread(target=self._serve, args=(jobs,), name=f"aps-shard-{index + 1}", daemon=True).start()

    def submit(self, index: int, function, *args) -> Future:
        """``function(*args)`` on shard ``index``'s thread (1..K-1)."""
        future: Future = Future()
        self._queues[index - 1].put((future, function, args))
        return future

    def shutdown(self) -> None:
        for jobs in self._queues:
            jobs.put(None)

    @staticmethod
    def _serve(jobs: queue.SimpleQueue) -> None:
        while (job := jobs.get()) is not None:
            future, function, args = job
            try:
                future.set_result(function(*args))
            except BaseException as exc:  # the caller's to raise
                future.set_exception(exc)
            del job, future, function, args


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


class _AsyncTurn:
    """One shard's place in an asyncio push's sending order (see :class:`_Turn`)."""

    __slots__ = ("_before", "_mine")

    def __init__(self, before: asyncio.Event | None, mine: asyncio.Event) -> None:
        self._before, self._mine = before, mine

    async def wait(self) -> None:
        if self._before is not None and not self._mine.is_set():
            try:
                await asyncio.wait_for(self._before.wait(), TURN_WAIT_S)
            except TimeoutError:
                pass

    def done(self) -> None:
        self._mine.set()
