"""Workers: the client side of aps.

:class:`Worker` is the blocking client for training scripts;
:class:`AsyncWorker` is the same client for asyncio programs. Both are thin
drivers around :class:`_ClientCore`, which builds every request and parses
every reply without doing I/O, so there is one implementation of the
protocol and the transports only move bytes.

Zero copy: a worker keeps one flat float32 weight buffer, which replies are
received into directly, and exposes each tensor as a view into it; gradients
are sent straight from the caller's arrays (or from the worker's own flat
gradient buffer) with vectored writes, never joined into one payload.
"""

from __future__ import annotations

import asyncio
import atexit
import contextvars
import logging
import json
import os
import random
import ssl
import threading
import time
import weakref
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any

import numpy as np

from . import _core
from .errors import (
    APSConnectionError,
    APSError,
    APSTimeoutError,
    AuthenticationError,
    ConfigurationError,
    DTypeMismatch,
    InitTimeout,
    InvalidState,
    LayoutMismatch,
    MalformedFrame,
    NonFiniteGradient,
    NotInitialized,
    ProtocolError,
    RankTaken,
    RunChanged,
    ServerError,
    ServerSilent,
    WeightsRefused,
    error_from_code,
)
from .layout import Layout
from .protocol import (
    MAX_REPLY_STEPS,
    MAX_STEPS,
    MAX_STATE_HEAD_BYTES,
    DType,
    Flag,
    Header,
    HyperGroup,
    Op,
    ServerInfo,
    decode_error,
    decode_join_progress,
    decode_slot,
    decode_state_head,
    describe_join_progress,
    encode_hyper,
    encode_init,
    encode_state_head,
    state_digest,
    weights_digest,
    host_identity,
    pack_header,
)
from .transport._tls import client_context
from .transport.address import Address, parse_address
from .transport.framing import FrameReader
from .transport._client import client_token, find_client_token, handshake, handshake_async, newer_token
from .transport.segments import shm_available
from .transport.shm_client import ShmConnection
from .transport.tcp_client import AsyncConnection, BlockingConnection

__all__ = ["AsyncWorker", "Worker"]

log = logging.getLogger("aps.worker")

_TRANSPORTS = ("auto", "tcp", "shm")
_WEIGHT_REPLIES = frozenset({Op.INIT_REPLY, Op.PULL_REPLY, Op.PUSH_PULL_REPLY})
_COUNTED_REPLIES = _WEIGHT_REPLIES | {Op.PUSH_REPLY}
_PUSH_REPLIES = frozenset({Op.PUSH_REPLY, Op.PUSH_PULL_REPLY})
_ERROR = int(Op.ERROR)
_REWIND_REPLY = int(Op.REWIND_REPLY)
_MAX_REWIND_REPLY = 1 << 20
_REPLY = int(Op.REPLY)
_INIT_REPLY = int(Op.INIT_REPLY)
_JOIN_PROGRESS = int(Op.JOIN_PROGRESS)
_ALIVE = int(Op.ALIVE)
_DROPPED = int(Flag.DROPPED)
_RUNNING = int(Flag.RUNNING)
_FLOAT32 = int(DType.FLOAT32)
_SHM = int(Flag.SHM)
_NARROW = int(Flag.NARROW)
#: ``compression=`` names and the element types they send.
COMPRESSION = {"bf16": int(DType.BFLOAT16), "fp16": int(DType.FLOAT16)}
_HALF = frozenset(COMPRESSION.values())
_MAX_ERROR_PAYLOAD = 1 << 20
_STATE_REPLY = int(Op.STATE_REPLY)
_MAX_STATE_ARRAYS = 4  # a STATE reply holds at most this many model-sized arrays (Adam has 2)
_REJOIN_PATIENCE = 5.0  # seconds reconnect() waits for the server to let the old connection go
_REQUEST_ID_MASK = 0xFFFFFFFF
_FIRST_WAIT_NOTE = 5.0  # seconds init waits in silence before it says what it waits for
_WAIT_NOTE_EVERY = 30.0  # and then how often it says it again
_FAREWELL_S = 0.5  # how long to look for the server's last words when a send fails
#: Seconds without a byte from the server, while a reply is due, after which it is taken to be gone.
DEFAULT_SERVER_TIMEOUT = 60.0
#: Seconds a worker keeps trying to get back to a lost server (``reconnect_timeout``).
DEFAULT_RECONNECT_TIMEOUT = 300.0
# Reconnecting: for the first _EAGER_S seconds (a server restarting takes about one), an attempt
# every 0.1-0.2 s (a refused connection costs the server nothing); then waits that double from
# _BACKOFF_FIRST_S up to _BACKOFF_CAP_S, with jitter, so that many workers do not knock at once.
_EAGER_S = 5.0
_EAGER_WAIT_S = 0.2
_BACKOFF_FIRST_S = 0.2
_BACKOFF_CAP_S = 5.0
_RETRY_NOTE_EVERY = 30.0  # how often a worker that keeps failing to reconnect says so


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
#: (see aps._sharded: one shard's gradient at a time leaves a worker, while replies come in).
SEND_TURN = threading.local()


#: Set while aps._sharded builds the workers of its shards: a plain worker of one shard is refused.
AS_SHARD = threading.local()

#: The asyncio counterparts (per task): set by aps._sharded's AsyncShardedWorker.
ASYNC_SEND_TURN: contextvars.ContextVar = contextvars.ContextVar("aps_send_turn", default=None)
ASYNC_AS_SHARD: contextvars.ContextVar = contextvars.ContextVar("aps_as_shard", default=False)


def _refuse_one_shard(info: ServerInfo, address: str) -> None:
    """A worker given only one shard of a sharded model would train the whole model on it."""
    try:
        described = json.loads(info.shard) if info.shard else {}
    except ValueError:
        described = {}
    shards = described.get("shards", 1) if isinstance(described, dict) else 1
    if isinstance(shards, int) and shards > 1:
        shard = described.get("shard")
        raise ConfigurationError(
            f"the server at {address} is shard {shard} of {shards} (--shard {shard} --shards {shards}): give the "
            "worker every shard's address (comma-separated, or a list)")


#: The keys of a group given to ``set_hyperparameters``.
HYPER_KEYS = ("stop", "lr", "weight_decay", "momentum", "dampening")


def server_options(info: ServerInfo | None) -> dict[str, Any] | None:
    """The run options a server said it was started with in the handshake (its
    ``--optimizer``, ``--lr``, ``--sync`` ...: ServerConfig.shard_description), or None
    when it did not say (an older server)."""
    try:
        described = json.loads(info.shard) if info is not None and info.shard else None
    except ValueError:
        return None
    return described if isinstance(described, dict) else None


def server_hyperparameters(info: ServerInfo | None) -> dict[str, float] | None:
    """The server's own value for each HYPER key but ``stop``, from what it said of its options
    in the handshake (for Adam and AdamW, ``momentum`` and ``dampening`` are its betas);
    None when it did not say (an older server)."""
    described = server_options(info)
    if described is None:
        return None
    try:
        common = {"lr": float(described["lr"]), "weight_decay": float(described["weight_decay"])}
        if described["optimizer"] == "sgd":
            # aps serve has no dampening option: its SGD runs with none.
            return {**common, "momentum": float(described["momentum"]), "dampening": 0.0}
        beta1, beta2 = described["betas"]
        return {**common, "momentum": float(beta1), "dampening": float(beta2)}
    except (KeyError, TypeError, ValueError):
        return None


def resolve_hyperparameters(groups: Any, numel: int, defaults: Mapping[str, float] | None) -> list[HyperGroup]:
    """The records of a HYPER request for ``groups`` (see :meth:`Worker.set_hyperparameters`):
    the last group's ``stop`` is ``numel`` when omitted, and a missing value is the server's
    (``defaults``; without them every value must be given). The values themselves are the
    server's to check."""
    if isinstance(groups, Mapping) or not isinstance(groups, Sequence) or not groups:
        raise ConfigurationError("set_hyperparameters takes a non-empty list of dicts, one per group")
    records = []
    for index, group in enumerate(groups):
        if not isinstance(group, Mapping):
            raise ConfigurationError(f"group {index} is a {type(group).__name__}, not a dict")
        unknown = sorted(set(group) - set(HYPER_KEYS))
        if unknown:
            raise ConfigurationError(f"group {index}: unknown keys {unknown}; a group has {', '.join(HYPER_KEYS)}")
        stop = group.get("stop", numel if index == len(groups) - 1 else None)
        if stop is None:
            raise ConfigurationError(f"group {index}: 'stop' is needed (only the last group may leave it out)")
        if isinstance(stop, bool) or not isinstance(stop, (int, np.integer)) or not 0 <= stop < 1 << 64:
            raise ConfigurationError(f"group {index}: stop must be a non-negative integer, got {stop!r}")
        values = []
        for key in HYPER_KEYS[1:]:
            if key in group:
                value = group[key]
            elif defaults is not None:
                value = defaults[key]
            else:
                raise ConfigurationError(f"group {index}: {key!r} is needed (the server did not say its own values)")
            if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
                raise ConfigurationError(f"group {index}: {key} must be a number, got {value!r}")
            try:
                values.append(float(value))
            except OverflowError:
                raise ConfigurationError(f"group {index}: {key} {value} is too large for a float") from None
        records.append(HyperGroup(int(stop), *values))
    return records


def checked_state(state: Mapping[str, Any], numel: int) -> tuple[str, int, list[str], list[np.ndarray]]:
    """``(optimizer, steps, names, arrays)`` of ``state`` (see :meth:`Worker.load_optimizer_state`)
    for a model of ``numel`` elements, checked here as far as it can be without the server:
    the arrays in the optimizer's order, flat float32 of ``numel`` elements each, every
    value finite.

    Raises:
        InvalidState: a missing key, a bad step count, an array of another size or with
            a value that is not finite.
        DTypeMismatch: an array is not float32.
    """
    from .optim import OPTIMIZERS

    if not isinstance(state, Mapping) or any(key not in state for key in ("optimizer", "steps", "arrays")):
        raise InvalidState("an optimizer state is a mapping of 'optimizer', 'steps' and 'arrays' "
                           "(what optimizer_state() returns)")
    optimizer, steps, given = state["optimizer"], state["steps"], state["arrays"]
    if not isinstance(optimizer, str):
        raise InvalidState(f"the state's optimizer is {optimizer!r}; it must be a name (sgd, adam, adamw)")
    if not isinstance(steps, (int, np.integer)) or isinstance(steps, bool) or not 0 <= steps <= MAX_STEPS:
        raise InvalidState(f"steps is {steps!r}; it must be an integer from 0 to 2**53")
    if not isinstance(given, Mapping):
        raise InvalidState("the state's 'arrays' must be a mapping of name to flat float32 array")
    known = OPTIMIZERS.get(optimizer)
    order = [name for name in (known.state_names if known else ()) if name in given]
    names = order + [name for name in given if name not in order]  # the server refuses any other
    arrays = []
    for name in names:
        array = np.asarray(given[name])
        if array.dtype != np.float32:
            raise DTypeMismatch(f"the state's {name} is {array.dtype}; optimizer state is float32")
        array = np.ascontiguousarray(array).reshape(-1)
        if array.size != numel:
            raise InvalidState(f"the state's {name} has {array.size} elements; the model has {numel}")
        if not _core.all_finite(array):
            index = int(np.flatnonzero(~np.isfinite(array))[0])
            raise InvalidState(f"{name}[{index}] is {array[index]}: every value must be finite")
        arrays.append(array)
    return optimizer, int(steps), names, arrays


def state_payload(state: Mapping[str, Any], numel: int) -> tuple[bytes, list[np.ndarray]]:
    """The head (with its digest) and the arrays of a LOAD_STATE for ``state``, for a model
    of ``numel`` elements (checked: see :func:`checked_state`)."""
    optimizer, steps, names, arrays = checked_state(state, numel)
    return encode_state_head(optimizer, steps, numel, names, digest=state_digest(steps, arrays)), arrays


def flat_weights_of(params: Mapping[str, Any] | np.ndarray, layout: Layout) -> np.ndarray:
    """``params`` (a mapping of name to float32 array in the model's layout, or one flat
    float32 array of its size) as one flat contiguous float32 array (``params`` itself
    when it is one), every value checked finite.

    Raises:
        ConfigurationError: not a mapping or an array.
        LayoutMismatch: other names or shapes, or a flat array of another size.
        DTypeMismatch: not float32.
        WeightsRefused: a value is not finite.
    """
    if isinstance(params, np.ndarray):
        if params.dtype != np.float32:
            raise DTypeMismatch(f"the weights are {params.dtype}; the model is float32")
        if params.shape != (layout.numel,):
            raise LayoutMismatch(f"flat weights must have shape ({layout.numel},), got {params.shape}")
        flat = np.ascontiguousarray(params)
    elif isinstance(params, Mapping):
        layout.check(params, what="weights")
        flat = np.empty(layout.numel, np.float32)
        layout.flatten_into(params, flat)
    else:
        raise ConfigurationError("load_weights takes a mapping of name to float32 array, or a flat float32 array")
    if not _core.all_finite(flat):
        index = int(np.flatnonzero(~np.isfinite(flat))[0])
        raise WeightsRefused(f"weight {index} is {flat[index]}: every value must be finite")
    return flat


def state_from_reply(payload: memoryview, version: int) -> dict[str, Any]:
    """The state a STATE reply carries (see :meth:`Worker.optimizer_state`); the arrays are
    views into the reply's own buffer; its step count may pass 2**53 (a run that loaded a
    state of that many steps counts on), and such a state cannot be loaded again."""
    head = decode_state_head(payload, MAX_REPLY_STEPS)
    if head.payload_bytes != len(payload):
        raise MalformedFrame(f"STATE reply of {len(payload)} bytes; its description says {head.payload_bytes}")
    flat = np.frombuffer(payload, np.float32, offset=head.nbytes)
    numel = head.numel
    arrays = {name: flat[index * numel : (index + 1) * numel] for index, name in enumerate(head.arrays)}
    return {"optimizer": head.optimizer, "steps": head.steps,
            "version": head.version if head.version is not None else version, "arrays": arrays}


def _names_shards(address: Any) -> bool:
    """Whether ``address`` names several servers: the shards of one model."""
    if isinstance(address, (list, tuple)):
        return len(address) > 1
    return isinstance(address, str) and "," in address


def _from_env(address: str | None, rank: int | None, num_workers: int | None) -> tuple[str, int, int]:
    """Fill in what was not given from ``APS_ADDRESS``, ``RANK`` and ``WORLD_SIZE``."""
    values = []
    for given, variable, convert in ((address, "APS_ADDRESS", str), (rank, "RANK", int), (num_workers, "WORLD_SIZE", int)):
        if given is None:
            raw = os.environ.get(variable)
            if raw is None:
                raise ConfigurationError(f"no {variable.lower().replace('aps_', '')} given and ${variable} is not set")
            try:
                given = convert(raw)
            except ValueError:
                raise ConfigurationError(f"${variable}={raw!r} is not valid") from None
        values.append(given)
    return values[0], values[1], values[2]


def _check_heartbeat(heartbeat: float | None, server_timeout: float | None = None) -> None:
    if heartbeat is not None and heartbeat <= 0:
        raise ConfigurationError(f"heartbeat must be a positive number of seconds or None, got {heartbeat}")
    if server_timeout is not None and server_timeout <= 0:
        raise ConfigurationError(f"server_timeout must be a positive number of seconds or None, got {server_timeout}")


def _check_reconnect(reconnect: bool, reconnect_timeout: float | None) -> float | None:
    """Seconds to keep trying to reconnect (None: forever), or 0 when the worker does not."""
    if reconnect_timeout is not None and reconnect_timeout <= 0:
        raise ConfigurationError(f"reconnect_timeout must be a positive number of seconds or None, got "
                                 f"{reconnect_timeout}")
    return reconnect_timeout if reconnect else 0


def _recoverable(exc: BaseException) -> bool:
    """A lost connection that trying again may cure (not a refused token, not another run)."""
    return isinstance(exc, APSConnectionError) and not isinstance(exc, (AuthenticationError, RunChanged))


def _backoff(attempt: int) -> float:
    """Capped exponential backoff with jitter: workers that lost one server do not all knock at once."""
    delay = min(_BACKOFF_CAP_S, _BACKOFF_FIRST_S * 2 ** min(attempt, 16))
    return random.uniform(delay / 2, delay)


def _retry_wait(elapsed: float, attempt: int) -> float:
    """How long to wait before the next attempt, ``elapsed`` seconds into a recovery; ``attempt``
    counts the attempts since the eager phase ended."""
    if elapsed < _EAGER_S:
        return random.uniform(_EAGER_WAIT_S / 2, _EAGER_WAIT_S)
    return _backoff(attempt)


class _Reconnecting:
    """One recovery: the deadline, the attempts, and what is said about them."""

    def __init__(self, worker: _WorkerBase, lost: BaseException, timeout: float | None) -> None:
        self.worker, self.lost = worker, lost
        self.start = time.monotonic()
        self.deadline = None if timeout is None else self.start + timeout
        self.attempt = 0
        self._note_at = self.start + _RETRY_NOTE_EVERY
        log.warning("rank %d: lost the server at %s (%s); reconnecting%s", worker.rank, worker.address, lost,
                    "" if timeout is None else f" for up to {timeout:g} s")

    def remaining(self) -> float | None:
        return None if self.deadline is None else max(self.deadline - time.monotonic(), 0.0)

    def check_closed(self) -> None:
        """Raise if the worker was closed meanwhile (from another thread or task)."""
        if self.worker._closing:
            self.worker._disconnect()
            raise APSConnectionError(f"rank {self.worker.rank}: the worker was closed while it reconnected")

    def failed(self, exc: BaseException) -> float:
        """An attempt failed with ``exc``: raise if it cannot be cured or time is up; else the seconds to wait."""
        self.check_closed()
        if not (_recoverable(exc) or isinstance(exc, (RankTaken, APSTimeoutError))):
            raise exc
        now = time.monotonic()
        if self.deadline is not None and now >= self.deadline:
            raise APSConnectionError(
                f"rank {self.worker.rank}: could not get back to the server at {self.worker.address} within "
                f"{now - self.start:.0f} s (reconnect_timeout): {exc}"
            ) from exc
        if now >= self._note_at:
            self._note_at = now + _RETRY_NOTE_EVERY
            log.warning("rank %d: still reconnecting to %s after %.0f s: %s", self.worker.rank, self.worker.address,
                        now - self.start, exc)
        elapsed = now - self.start
        wait = _retry_wait(elapsed, self.attempt)
        if elapsed >= _EAGER_S:
            self.attempt += 1
        remaining = self.remaining()
        return wait if remaining is None else min(wait, remaining)

    def done(self) -> None:
        core = self.worker._core
        log.warning("rank %d: back at %s after %.1f s (version %d, clock %d)", self.worker.rank, self.worker.address,
                    time.monotonic() - self.start, core.version, core.clock)


def _after_recovery(core: _ClientCore, kind: str, request, address: str = "", as_shard: bool = False):
    """What finishes a call of ``kind`` once its worker has rejoined: ``(kind, request)``,
    or ``(None, None)`` when nothing is left to send."""
    if kind == "init":
        return None, None  # the rejoin was the init
    if kind in ("push", "push_pull") and core.has_pending_push:
        if core.pending_push_version > core.version:
            _note_dropped_after_resume(core, address, as_shard)
            return ("pull", core.pull_request) if kind == "push_pull" else (None, None)
        return kind, core.resend_push
    return kind, request


def _note_dropped_after_resume(core: _ClientCore, address: str, as_shard: bool) -> None:
    """The server came back older than the weights the push in flight was computed on."""
    if as_shard:
        # docs/algorithms.md, "Sharded resume": the other shards keep what they applied (or, under
        # BSP, come back to one round with it).
        log.warning("rank %d: the shard at %s resumed from a checkpoint at version %d, before the weights this "
                    "gradient was computed on (version %d): its piece of the gradient is dropped there (the "
                    "other shards keep theirs; under BSP every shard then goes back to one round, if they have "
                    "checkpoints of one)", core.rank, address, core.version, core.pending_push_version)
    else:
        log.warning("rank %d: the server resumed from a checkpoint at version %d, before the weights this gradient "
                    "was computed on (version %d): the gradient is dropped, and the updates made after that "
                    "checkpoint are lost; going on from the server's weights and clock (%d)", core.rank,
                    core.version, core.pending_push_version, core.clock)
    core.forget_push(dropped=True)


def _compression(compression: str | None, compress_pulls: bool) -> int:
    """The element type ``compression=`` sends gradients as (FLOAT32: none)."""
    if compression is None or compression == "none":
        if compress_pulls:
            raise ConfigurationError("compress_pulls needs compression='bf16' or 'fp16'")
        return _FLOAT32
    try:
        return COMPRESSION[compression]
    except (KeyError, TypeError):
        raise ConfigurationError(
            f"unknown compression {compression!r}: choose 'bf16', 'fp16' or None"
        ) from None


def _check_transport(transport: str) -> None:
    if transport not in _TRANSPORTS:
        raise ConfigurationError(f"unknown transport {transport!r}: choose from {', '.join(_TRANSPORTS)}")


def _with_scheme(address: Address, tls: bool | ssl.SSLContext | None) -> Address:
    """The address as the worker will use it: ``tls://`` when it speaks TLS."""
    if tls is False and address.scheme == "tls":
        raise ConfigurationError(f"{address} is a TLS address, but tls=False")
    return address._replace(scheme="tls") if tls else address


class _Patience:
    """A long wait cut into slices, so that the waiter can say what it waits for:
    ``waiting(seconds so far)`` is called after a few seconds, then every half
    minute, until ``timeout`` (None: no end). A receive that times out at the
    end of a slice leaves any partly read frame in the reader, to be finished
    by the next slice."""

    def __init__(self, timeout: float | None, waiting) -> None:
        self._waiting = waiting
        self._start = time.monotonic()
        self._deadline = None if timeout is None else self._start + timeout
        self._note_at = self._start + _FIRST_WAIT_NOTE

    def next_wait(self) -> float:
        """Seconds the next slice may wait."""
        until = self._note_at if self._deadline is None else min(self._note_at, self._deadline)
        return max(until - time.monotonic(), 1e-3)

    def expired(self) -> bool:
        """A slice ran out: True when the whole wait did; otherwise says what we wait for, when due."""
        now = time.monotonic()
        if self._deadline is not None and now >= self._deadline:
            return True
        if now >= self._note_at:
            self._waiting(now - self._start)
            self._note_at = now + _WAIT_NOTE_EVERY
        return False


def _describe_progress(progress: tuple[int, int, list[int]] | None) -> str:
    if progress is None:
        return "the server has not said who joined yet"
    return describe_join_progress(*progress)


def _farewell(conn, core: _ClientCore) -> None:
    """A send failed: raise what the server said before it closed, if anything
    (a Unix socket refuses a send as soon as the server has closed, while TCP
    takes it and reports later, so without this the two would differ)."""
    try:
        conn.receive(core.reader, core.has_reply, _FAREWELL_S)
    except APSError:
        return
    core.finish()  # raises the error frame that explains the close


class _ClientCore:
    """Requests and replies of one worker, without I/O (see the module docstring)."""

    def __init__(self, rank: int, num_workers: int) -> None:
        if not isinstance(rank, (int, np.integer)) or not isinstance(num_workers, (int, np.integer)):
            raise ConfigurationError("rank and num_workers must be integers")
        if num_workers < 1:
            raise ConfigurationError(f"num_workers must be at least 1, got {num_workers}")
        if not 0 <= rank < num_workers:
            raise ConfigurationError(f"rank {rank} is out of range 0..{num_workers - 1}")
        self.rank = int(rank)
        self.num_workers = int(num_workers)
        self.layout: Layout | None = None
        self.flat_weights: np.ndarray | None = None
        self.flat_grad: np.ndarray | None = None
        self.weights: Mapping[str, np.ndarray] = MappingProxyType({})
        self.grads: Mapping[str, np.ndarray] = MappingProxyType({})
        self.version = 0
        self.clock = 0
        self.dropped = False
        #: The server answered INIT: it counts this worker until it leaves or disconnects.
        self.joined = False
        #: The INIT_REPLY said the model was already training (the values sent were not used).
        self.joined_running = False
        #: The last JOIN_PROGRESS notice while INIT waited: (joined, workers, missing ranks).
        self.join_progress: tuple[int, int, list[int]] | None = None
        self.reader = FrameReader(self, max_payload=None)
        self._weights_bytes: memoryview | None = None
        self._grad_bytes: memoryview | None = None
        self._request_id = 0
        self._expect: int | None = None
        self._reply: Header | None = None
        self._payload: memoryview | None = None
        self._init_block: bytes = b""
        self.connection_lost = False
        #: The server answered an INIT of this worker at least once (it has a place in a run).
        self.ever_joined = False
        #: The run the server holds (from the handshake): a worker that reconnects
        #: to another run refuses to go on (see check_run).
        self.run_id: str | None = None
        # The push in flight (op, request id, clock, version, frames): what to send again
        # if its reply is lost.
        self._push: tuple | None = None
        #: The shared-memory connection, when the worker shares the server's host.
        self.shm: ShmConnection | None = None
        self._fds: tuple[int, ...] = ()
        #: Over TCP, gradients go as this element type (FLOAT32, or BFLOAT16/FLOAT16:
        #: narrowed here, widened by the server's kernel), and with ``compress_pulls``
        #: the weights come back as it too (see docs/design.md, "Wire compression").
        self.compression = _FLOAT32
        self.compress_pulls = False
        self._half_grad: np.ndarray | None = None  # the narrowed gradient being sent
        self._half_weights: np.ndarray | None = None  # narrowed weights being received
        #: The half buffers are the caller's model (see Worker.half_buffers): a push of
        #: ``_half_grad`` goes as it is, and every weights reply ends in ``_half_weights``.
        self.half_views = False
        self._reply_dtype = _FLOAT32  # what the weights reply of the request in flight carries
        #: The HYPER payload the server last accepted from this worker: the values live with
        #: the connection, so the worker sends them again when it reconnects.
        self.hyperparameters: bytes | None = None
        self._state_reply: memoryview | None = None  # the last STATE reply's payload, until taken
        self._rewind_reply: bytes | None = None  # the last REWIND reply's payload, until taken

    @property
    def compressing(self) -> bool:
        """Gradients go narrowed: compression is on and the transport is TCP (shared
        memory moves no bytes a narrower type would save)."""
        return self.compression != _FLOAT32 and self.shm is None

    def take_fds(self) -> tuple[int, ...]:
        """Descriptors the last request must carry (its gradient segment, for INIT over shm)."""
        fds, self._fds = self._fds, ()
        return fds

    # Requests -------------------------------------------------------------
    def _next_request(self, op: int) -> int:
        self._request_id = rid = (self._request_id & _REQUEST_ID_MASK) % _REQUEST_ID_MASK + 1  # 1..2^32-1
        self._expect = op | _REPLY
        self._reply = None
        return rid

    def _header(self, op: int, length: int = 0, dtype: int = 0, flags: int = 0) -> bytes:
        return pack_header(op, flags, dtype, self._next_request(op), self.clock, self.version, length)

    def _weights_request(self) -> tuple[int, int]:
        """(flags, dtype) asking for the weights narrowed, when pulls are compressed;
        notes what the reply will carry."""
        if self.compressing and self.compress_pulls:
            self._reply_dtype = self.compression
            if self._half_weights is None:
                self._half_weights = np.zeros(self.layout.numel, np.uint16)
            return _NARROW, self.compression
        self._reply_dtype = _FLOAT32
        return 0, 0

    def check_run(self, run_id: str, address: str) -> None:
        """The server at ``address`` holds run ``run_id``: refuse to go on in another run."""
        if self.ever_joined and self.run_id is not None and run_id != self.run_id:
            raise RunChanged(
                f"the server at {address} came back serving another run (run id {run_id or 'none'}, this worker's "
                f"is {self.run_id}): it restarted without --resume, or from another run's checkpoint, so this "
                "worker's weights and clock mean nothing there"
            )
        self.run_id = run_id

    def init_request(self, params: Mapping[str, Any] | None, rejoin: bool = False) -> list:
        if params is not None:
            if not isinstance(params, Mapping) or not params:
                raise ConfigurationError("init takes a non-empty mapping of name to float32 array")
            layout = Layout.from_arrays(params)
            if self.layout is not None and layout != self.layout:
                raise LayoutMismatch(f"init with a different model than before: {self.layout.difference(layout)}")
            self._set_layout(layout)
            self.layout.flatten_into(params, self.flat_weights)
            self._init_block = encode_init(self.rank, self.num_workers, self.layout)
        elif self.layout is None:
            raise NotInitialized("no model to join with: call init(params) first")
        block = self._init_block
        self.join_progress = None
        if self.shm is not None:
            self._fds = (self.shm.grad_segment.fd,)
        # The header's version field carries the layout block's length (docs/protocol.md, INIT).
        flags = Flag.REJOIN if rejoin and self.ever_joined else 0
        header = pack_header(Op.INIT, flags, _FLOAT32, self._next_request(Op.INIT), self.clock, len(block),
                             len(block) + self.layout.nbytes)
        self._reply_dtype = _FLOAT32
        return [header, block, self._weights_bytes]

    def pull_request(self) -> list:
        self._require_layout()
        flags, dtype = self._weights_request()
        return [self._header(Op.PULL, 0, dtype, flags)]

    def push_request(self, grads: Any, then_pull: bool) -> list:
        self._require_layout()
        # The caller's own 16-bit gradient (half_views, over TCP only): sent as it is.
        already_half = self.half_views and grads is self._half_grad
        buffers = [] if already_half else self._gradient_buffers(grads)
        op = Op.PUSH_PULL if then_pull else Op.PUSH
        if self.shm is not None:
            # The gradient must be in the shared segment: it is, unless the
            # caller computed it elsewhere (then one copy puts it there).
            if buffers[0] is not self._grad_bytes:
                offset = 0
                for view in buffers:
                    self._grad_bytes[offset : offset + len(view)] = view
                    offset += len(view)
            flags, dtype = _SHM, _FLOAT32
            frames = [pack_header(op, flags, dtype, self._next_request(op), self.clock, self.version, 0)]
        else:
            flags, _ = self._weights_request() if then_pull else (0, 0)
            if self.compressing:
                half = self._half_grad if already_half else self._narrowed(buffers)
                dtype, buffers = self.compression, [memoryview(half).cast("B")]
            else:
                dtype = _FLOAT32
            frames = [self._header(op, sum(len(b) for b in buffers), dtype, flags), *buffers]
        self._push = (op, self._request_id, self.clock, self.version, frames[1:], flags, dtype)
        return frames

    def _narrowed(self, buffers: list) -> np.ndarray:
        """The gradient in ``buffers`` rounded to the compression's 16 bits (to nearest
        even), in this worker's half buffer; refuses one that overflows fp16."""
        if self._half_grad is None:
            self._half_grad = np.zeros(self.layout.numel, np.uint16)
        half, offset, overflowed = self._half_grad, 0, 0
        for view in buffers:
            values = np.frombuffer(view, np.float32)
            overflowed += _core.narrow(half[offset : offset + len(values)], values, self.compression)
            offset += len(values)
        if overflowed:
            raise NonFiniteGradient(
                f"{overflowed} gradient element(s) beyond fp16's range (|x| > 65504): nothing was sent; "
                "scale the loss down, or use compression='bf16' (float32's range)"
            )
        return half

    @property
    def has_pending_push(self) -> bool:
        """A push was sent and its reply has not come."""
        return self._push is not None

    @property
    def pending_push_version(self) -> int:
        """The version of the weights the push in flight was computed on."""
        return self._push[3]

    def forget_push(self, dropped: bool = False) -> None:
        """The push in flight will not be sent again (``dropped``: it was not applied)."""
        self._push = None
        if dropped:
            self.dropped = True

    def resend_push(self) -> list:
        """The push in flight again, exactly as first sent (same request id and clock:
        the server recognises it if it took it already, see docs/protocol.md)."""
        op, rid, clock, version, buffers, flags, dtype = self._push
        self._request_id, self._expect, self._reply = rid, op | _REPLY, None
        if self.shm is not None:
            return [pack_header(op, _SHM, _FLOAT32, rid, clock, version, 0)]
        self._reply_dtype = dtype if flags & _NARROW else _FLOAT32
        nbytes = sum(len(b) for b in buffers)
        return [pack_header(op, flags, dtype, rid, clock, version, nbytes), *buffers]

    def simple_request(self, op: Op) -> list:
        return [self._header(op)]

    def hyper_request(self, payload: bytes, check: bool = False) -> list:
        """HYPER: the per-group optimizer values (an :func:`aps.protocol.encode_hyper` payload);
        ``check``: only have them checked (Flag.CHECK), keeping the ones in force."""
        return [self._header(Op.HYPER, len(payload), flags=Flag.CHECK if check else 0), payload]

    def state_request(self) -> list:
        """STATE: a copy of the server's optimizer state."""
        if self.layout is None:
            raise NotInitialized("call init(params) before optimizer_state")
        self._state_reply = None
        return [self._header(Op.STATE)]

    def load_state_request(self, head: bytes, arrays: list[np.ndarray], check: bool = False) -> list:
        """LOAD_STATE: ``head`` (from :func:`state_payload`) and the arrays; ``check``: the
        head alone, to be checked (Flag.CHECK), nothing loaded."""
        parts = [head] if check else [head, *(memoryview(array).cast("B") for array in arrays if array.size)]
        return [self._header(Op.LOAD_STATE, sum(len(part) for part in parts), _FLOAT32,
                             Flag.CHECK if check else 0), *parts]

    def load_weights_request(self, digest: bytes, values: np.ndarray | None) -> list:
        """LOAD_WEIGHTS: the digest and the flat weights; ``values`` None: the digest alone,
        to be checked (Flag.CHECK), nothing loaded. The header's version is the version of
        the weights this worker holds."""
        parts = [digest] if values is None else [digest, memoryview(values).cast("B")]
        return [self._header(Op.LOAD_WEIGHTS, sum(len(part) for part in parts), _FLOAT32,
                             Flag.CHECK if values is None else 0), *parts]

    def rewind_request(self, version: int | None) -> list:
        """REWIND: the versions of the run's checkpoints (``version`` None, Flag.CHECK), or a
        restart from the one at ``version`` (in the header's version field)."""
        self._rewind_reply = None
        if version is None:
            return [pack_header(Op.REWIND, Flag.CHECK, 0, self._next_request(Op.REWIND), self.clock, 0, 0)]
        return [pack_header(Op.REWIND, 0, 0, self._next_request(Op.REWIND), self.clock, version, 0)]

    def take_rewind(self) -> dict[str, Any]:
        """What the last REWIND reply said (JSON)."""
        payload, self._rewind_reply = self._rewind_reply, None
        if payload is None:
            raise ProtocolError("a REWIND reply without its payload")
        try:
            info = json.loads(payload)
        except ValueError:
            raise ProtocolError("a REWIND reply that is not JSON") from None
        if not isinstance(info, dict):
            raise ProtocolError("a REWIND reply that is not a JSON object")
        return info

    def take_rewind_versions(self) -> list[int]:
        """The checkpoint versions the last REWIND (CHECK) reply listed."""
        versions = self.take_rewind().get("versions")
        if not isinstance(versions, list) or not all(isinstance(v, int) for v in versions):
            raise ProtocolError("a REWIND reply without its list of versions")
        return versions

    def take_state(self, header: Header) -> dict[str, Any]:
        """The state the last STATE reply (``header``'s) carried."""
        payload, self._state_reply = self._state_reply, None
        if payload is None:
            raise ProtocolError("a STATE reply without its payload")
        return state_from_reply(payload, header.version)

    def shards_request(self, runs: list[str]) -> list:
        """SHARDS: the run id of every shard of the model, for this one to keep."""
        payload = json.dumps(runs).encode()
        return [self._header(Op.SHARDS, len(payload)), payload]

    def _gradient_buffers(self, grads: Any) -> list:
        layout = self.layout
        if grads is self.flat_grad or grads is self.grads:
            return [self._grad_bytes]
        if isinstance(grads, np.ndarray):
            if grads.shape != (layout.numel,):
                raise LayoutMismatch(f"a flat gradient must have shape ({layout.numel},), got {grads.shape}")
            return [self._contiguous(grads, "flat gradient")]
        if not isinstance(grads, Mapping):
            raise ConfigurationError("push takes a mapping of name to array, or a flat float32 array")
        layout.check(grads)
        return [self._contiguous(grads[name], name) for name in layout.names]

    @staticmethod
    def _contiguous(array: np.ndarray, name: str) -> memoryview:
        if array.dtype != np.float32:
            raise DTypeMismatch(f"{name} is {array.dtype}, the model is float32")
        if not array.flags.c_contiguous:
            array = np.ascontiguousarray(array)
        return memoryview(array).cast("B")

    def _require_layout(self) -> None:
        if self.layout is None:
            raise NotInitialized("call init(params) before pull or push")

    def adopt(self, weights: np.ndarray, grad: np.ndarray) -> None:
        """Keep the weights and (over TCP) the gradients in these buffers, not in buffers of
        its own: the slices of one shard of a sharded worker's flat buffers."""
        self._adopted = (weights, grad)

    def _set_layout(self, layout: Layout) -> None:
        if self.layout is not None:
            return
        self.layout = layout
        adopted = getattr(self, "_adopted", None)
        self.flat_weights = adopted[0] if adopted is not None else np.zeros(layout.numel, np.float32)
        if self.shm is not None:  # gradients are written straight into shared memory
            self.flat_grad = self.shm.gradient_buffer(layout.numel, self.rank)
        else:
            self.flat_grad = adopted[1] if adopted is not None else np.zeros(layout.numel, np.float32)
        self._weights_bytes = memoryview(self.flat_weights).cast("B")
        self._grad_bytes = memoryview(self.flat_grad).cast("B")
        # Read-only mappings: the views are fixed; write into them, never replace them.
        self.weights = MappingProxyType(layout.views(self.flat_weights))
        self.grads = MappingProxyType(layout.views(self.flat_grad))

    # Replies (FrameHandler) -------------------------------------------------
    def frame_buffer(self, header: Header) -> memoryview | None:
        if header.op == _ALIVE:  # the server holds our request and says it is alive
            if header.length:
                raise MalformedFrame(f"ALIVE notice with a {header.length}-byte payload")
            return None
        if header.op == _ERROR or header.op == _JOIN_PROGRESS:
            if header.length > _MAX_ERROR_PAYLOAD:
                raise MalformedFrame(f"error frame of {header.length} bytes")
            return memoryview(bytearray(header.length))
        if header.op in _WEIGHT_REPLIES:
            if header.flags & _SHM:  # a slot descriptor: the weights are in shared memory
                if self.shm is None or header.length > _MAX_ERROR_PAYLOAD:
                    raise MalformedFrame("unexpected shared-memory weights reply")
                return memoryview(bytearray(header.length))
            if header.dtype in _HALF and header.dtype == self._reply_dtype and header.op != _INIT_REPLY:
                target = memoryview(self._half_weights).cast("B")  # widened into the weights once all here
            elif header.dtype == _FLOAT32:
                target = self._weights_bytes
            else:
                raise MalformedFrame(f"weights reply of dtype {header.dtype}; asked for {self._reply_dtype}")
            if header.length != len(target):
                raise MalformedFrame(f"weights reply of {header.length} bytes; the model has {len(target)}")
            return target
        if header.op == _STATE_REPLY and self.layout is not None:
            limit = 8 + MAX_STATE_HEAD_BYTES + 8 + _MAX_STATE_ARRAYS * self.layout.nbytes
            if header.length > limit:
                raise MalformedFrame(f"STATE reply of {header.length} bytes; at most {limit} are expected")
            return memoryview(np.empty(header.length, np.uint8)) if header.length else None  # 8-aligned
        if header.op == _REWIND_REPLY:  # a small JSON object (the versions of the run's checkpoints)
            if header.length > _MAX_REWIND_REPLY:
                raise MalformedFrame(f"REWIND reply of {header.length} bytes")
            return memoryview(bytearray(header.length))
        if header.length:
            raise MalformedFrame(f"unexpected {header.length}-byte payload on op {header.op}")
        return None

    def frame_received(self, header: Header, payload: memoryview) -> None:
        if header.op == _JOIN_PROGRESS:  # a notice while INIT waits, not its reply
            if header.request_id == self._request_id and self._expect == _INIT_REPLY:
                self.join_progress = decode_join_progress(payload)
            return
        if header.op == _ALIVE:  # its bytes have reset the receive's silence timer: nothing else to do
            return
        if header.op != _ERROR or header.request_id != 0:
            if header.request_id != self._request_id:
                raise ProtocolError(f"reply to request {header.request_id}, expected {self._request_id}")
            if header.op != self._expect and header.op != _ERROR:
                raise ProtocolError(f"reply op {header.op} to a request expecting {self._expect}")
        if header.flags & _SHM and header.op in _WEIGHT_REPLIES:
            # One copy out of the leased snapshot slot into this worker's weights.
            slot_id, nbytes, has_fd, dropped = decode_slot(payload)
            if nbytes != self.flat_weights.nbytes:
                raise MalformedFrame(f"slot of {nbytes} bytes; the model has {self.flat_weights.nbytes}")
            np.copyto(self.flat_weights, self.shm.slot(slot_id, nbytes, has_fd, dropped))
        elif header.dtype in _HALF and header.op in _WEIGHT_REPLIES:
            if not self.half_views:  # (with half views, the 16-bit weights are what the caller reads)
                _core.widen(self.flat_weights, self._half_weights, header.dtype)
        elif self.half_views and header.op in _WEIGHT_REPLIES:  # float32 weights (INIT, a rejoin)
            _core.narrow(self._half_weights, self.flat_weights, self.compression)
        elif header.op == _STATE_REPLY and header.request_id == self._request_id:
            self._state_reply = payload
        elif header.op == _REWIND_REPLY and header.request_id == self._request_id:
            self._rewind_reply = bytes(payload)
        self._reply = header
        self._payload = payload

    def reset_stream(self) -> None:
        """Forget any half-read reply: the next bytes come from a new connection."""
        self.reader = FrameReader(self, max_payload=None)
        self._reply = None
        self._payload = None
        self.connection_lost = False
        self.joined = False

    def has_reply(self) -> bool:
        return self._reply is not None

    def finish(self) -> Header:
        """Check the reply that arrived: raise the server's error, or record version and clock."""
        header, self._reply = self._reply, None
        op = header.op
        if op == _ERROR:
            code, message = decode_error(self._payload)
            self._payload = None
            error = error_from_code(code, message)
            # An error answering no request (id 0) means the server is closing
            # this connection: framing was lost, or it is shutting down.
            self.connection_lost = header.request_id == 0 or isinstance(error, APSConnectionError)
            raise error
        self._payload = None
        if op == _INIT_REPLY:
            self.joined = self.ever_joined = True
            self.joined_running = bool(header.flags & _RUNNING)
        if op in _COUNTED_REPLIES:
            self.clock = header.clock
            if op in _WEIGHT_REPLIES:  # the version of the weights this worker holds
                self.version = header.version
            if op in _PUSH_REPLIES:
                self.dropped = bool(header.flags & _DROPPED)
                self._push = None
        return header


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
            an :class:`aps._sharded.ShardedWorker`.
        rank: this worker's rank, ``0 <= rank < num_workers`` (default: ``$RANK``).
        num_workers: the number of workers P, which must equal the server's
            ``--workers`` (default: ``$WORLD_SIZE``).
        transport: ``"auto"`` (shared memory when co-located, when available;
            TCP otherwise) or ``"tcp"``.
        connect_timeout: seconds to wait for the TCP connection.
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
            from ._sharded import ShardedWorker

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
        self._conn: BlockingConnection | ShmConnection | None = self._open(transport)
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
            params: mapping of tensor name to float32 array, in a fixed order.
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
        """Tell this shard's server the run id of every shard (see aps._sharded)."""
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
        self._core.forget_push()  # only this call's push is ever sent again
        while True:
            try:
                return self._roundtrip(request, timeout, waiting=waiting)
            except APSError as exc:
                if not self._reconnects(kind, exc):
                    raise
                self._recover(exc)
            kind, request = _after_recovery(self._core, kind, request, self.address, self._as_shard)
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

class AsyncWorker(_WorkerBase):
    """The asyncio twin of :class:`Worker`: same arguments, awaitable methods.

    Create it with ``await AsyncWorker.connect(address, rank, num_workers)``.
    It speaks TCP (``transport="auto"`` means TCP here): asyncio's socket
    calls cannot pass the file descriptors the shared-memory transport needs.
    """

    def __init__(
        self,
        conn: AsyncConnection,
        core: _ClientCore,
        address: str,
        timeout: float | None,
        connect_timeout: float | None,
        server_timeout: float | None = DEFAULT_SERVER_TIMEOUT,
    ) -> None:
        self._conn: AsyncConnection | None = conn
        self._core = core
        self.address = address
        self._parsed = parse_address(address)
        self.timeout = timeout
        self.server_timeout = server_timeout
        self._connect_timeout = connect_timeout
        self._lock = asyncio.Lock()  # one request at a time, heartbeats included
        self._last_io = time.monotonic()
        self._heartbeat: float | None = None
        self._heartbeat_task: asyncio.Task | None = None
        self._closed = False
        self.reconnect_timeout: float | None = 0
        self._closing = False
        self._as_shard = False  # one of a sharded worker's
        #: What the server said of itself in the handshake.
        self.server_info: ServerInfo | None = None

    @classmethod
    async def connect(
        cls,
        address: str,
        rank: int,
        num_workers: int,
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
    ) -> AsyncWorker:
        _check_transport(transport)
        narrow = _compression(compression, compress_pulls)
        if transport == "shm":
            raise ConfigurationError("AsyncWorker speaks TCP only; use aps.Worker for shared memory")
        if _names_shards(address):
            from ._sharded import AsyncShardedWorker

            return await AsyncShardedWorker.open(
                address, rank, num_workers, transport, connect_timeout=connect_timeout, timeout=timeout,
                heartbeat=heartbeat, server_timeout=server_timeout, token=token, tls=tls, reconnect=reconnect,
                reconnect_timeout=reconnect_timeout, compression=compression, compress_pulls=compress_pulls)
        if isinstance(address, (list, tuple)) and len(address) == 1:
            address = address[0]
        _check_heartbeat(heartbeat, server_timeout)
        retry = _check_reconnect(reconnect, reconnect_timeout)
        secret = client_token(token)
        parsed = _with_scheme(parse_address(address), tls)
        context = client_context(tls if tls is not None else parsed.scheme == "tls")
        core = _ClientCore(rank, num_workers)
        core.compression, core.compress_pulls = narrow, bool(compress_pulls)
        conn, info = await cls._open(parsed.host, parsed.port, connect_timeout, server_timeout, secret, context,
                                     core)
        worker = cls(conn, core, str(parsed), timeout, connect_timeout, server_timeout)
        worker.server_info = info
        worker._as_shard = ASYNC_AS_SHARD.get()
        worker._token, worker._tls = secret, context
        worker.reconnect_timeout = retry
        worker._heartbeat = heartbeat
        worker._start_heartbeat()
        return worker

    async def init(self, params: Mapping[str, Any], *, timeout: float | None = 300.0) -> Mapping[str, np.ndarray]:
        """See :meth:`Worker.init`."""
        try:
            await self._call("init", lambda: self._core.init_request(params), timeout, waiting=self._note_init_wait)
        except APSTimeoutError:
            raise self._init_timeout(timeout) from None
        self._note_joined(params)
        return self._core.weights

    async def pull(self) -> Mapping[str, np.ndarray]:
        await self._call("pull", lambda: self._core.pull_request())
        return self._core.weights

    async def push(self, grads) -> None:
        await self._call("push", lambda: self._core.push_request(grads, then_pull=False))

    async def push_pull(self, grads) -> Mapping[str, np.ndarray]:
        await self._call("push_pull", lambda: self._core.push_request(grads, then_pull=True))
        return self._core.weights

    async def ping(self) -> int:
        return (await self._call("ping", lambda: self._core.simple_request(Op.PING))).version

    async def set_hyperparameters(self, groups: Sequence[Mapping[str, float]]) -> None:
        """See :meth:`Worker.set_hyperparameters`."""
        await self._send_hyperparameters(self._hyper_payload(groups))

    async def _check_hyperparameters(self, payload: bytes) -> None:
        """See :meth:`Worker._check_hyperparameters`."""
        await self._call("hyper", lambda: self._core.hyper_request(payload, check=True))

    async def _send_hyperparameters(self, payload: bytes) -> None:
        """See :meth:`Worker._send_hyperparameters`."""
        await self._call("hyper", lambda: self._core.hyper_request(payload))
        self._core.hyperparameters = payload

    async def _restore_hyperparameters(self, timeout: float | None) -> None:
        """See :meth:`Worker._restore_hyperparameters`."""
        payload = self._core.hyperparameters
        if payload is not None:
            await self._roundtrip(lambda: self._core.hyper_request(payload), timeout)

    async def _record_shard_runs(self, runs: list[str]) -> None:
        """See :meth:`Worker._record_shard_runs`."""
        await self._call("shards", lambda: self._core.shards_request(runs))

    async def _checkpoint_versions(self) -> list[int]:
        """See :meth:`Worker._checkpoint_versions`."""
        await self._call("rewind", lambda: self._core.rewind_request(None))
        return self._core.take_rewind_versions()

    async def _rewind(self, version: int, timeout: float | None) -> None:
        """See :meth:`Worker._rewind`."""
        await self._call("rewind", lambda: self._core.rewind_request(version))
        if not self._core.take_rewind().get("rewound"):
            return
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._core.version != version:
            if deadline is not None and time.monotonic() > deadline:
                raise APSTimeoutError(f"the server at {self.address} said it would rewind to version {version}, "
                                      f"but is at version {self._core.version} after {timeout:g} s")
            await self.ping()
            await asyncio.sleep(0.02)

    async def optimizer_state(self) -> dict[str, Any]:
        """See :meth:`Worker.optimizer_state`."""
        header = await self._call("state", lambda: self._core.state_request())
        return self._core.take_state(header)

    async def load_optimizer_state(self, state: Mapping[str, Any]) -> bool:
        """See :meth:`Worker.load_optimizer_state`."""
        head, arrays = self._state_payload(state)
        return await self._load_state(head, arrays)

    async def load_weights(self, params: Mapping[str, Any] | np.ndarray) -> bool:
        """See :meth:`Worker.load_weights`."""
        values = self._weights_payload(params)
        return await self._load_weights(weights_digest((values,)), values)

    async def _check_weights(self, digest: bytes) -> None:
        """See :meth:`Worker._check_weights`."""
        await self._call("load_weights", lambda: self._core.load_weights_request(digest, None))

    async def _load_weights(self, digest: bytes, values: np.ndarray) -> bool:
        """See :meth:`Worker._load_weights`."""
        header = await self._call("load_weights", lambda: self._core.load_weights_request(digest, values))
        self._weights_taken(values)
        return not header.flags & _DROPPED

    async def _check_state(self, head: bytes) -> None:
        """See :meth:`Worker._check_state`."""
        await self._call("load_state", lambda: self._core.load_state_request(head, [], check=True))

    async def _load_state(self, head: bytes, arrays: list[np.ndarray]) -> bool:
        """See :meth:`Worker._load_state`."""
        header = await self._call("load_state", lambda: self._core.load_state_request(head, arrays))
        return not header.flags & _DROPPED

    async def reconnect(self, *, timeout: float | None = 60.0) -> Mapping[str, np.ndarray]:
        """See :meth:`Worker.reconnect`."""
        deadline = time.monotonic() + _REJOIN_PATIENCE
        while True:
            async with self._lock:
                self._disconnect()
                self._conn = await self._reopen()
            try:
                await self._roundtrip(lambda: self._core.init_request(None, rejoin=True), timeout,
                                      waiting=self._note_init_wait)
                await self._restore_hyperparameters(timeout)
                weights = self._core.weights
            except APSTimeoutError:
                raise self._init_timeout(timeout) from None
            except RankTaken:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.05)
                continue
            self._start_heartbeat()
            return weights

    async def close(self) -> None:
        self._closed = self._closing = True
        if self._heartbeat_task is not None:
            self._heartbeat_task.cancel()
            self._heartbeat_task = None
        if self._lock.locked() and self._conn is not None:
            self._conn.close()  # another task is in a call (reconnecting, or held): end its wait
        async with self._lock:
            pass
        if self._conn is None:
            return
        if self._core.joined:
            try:
                await self._roundtrip(lambda: self._core.simple_request(Op.LEAVE), 5.0)
            except APSError:
                pass
        conn = self._conn
        self._disconnect()
        if conn is not None:
            await conn.aclose()

    async def __aenter__(self) -> AsyncWorker:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def _call(self, kind: str, request, timeout: float | None = ..., *, waiting=None) -> Header | None:
        """See :meth:`Worker._call`."""
        self._core.forget_push()
        while True:
            try:
                return await self._roundtrip(request, timeout, waiting=waiting)
            except APSError as exc:
                if not self._reconnects(kind, exc):
                    raise
                await self._recover(exc)
            kind, request = _after_recovery(self._core, kind, request, self.address, self._as_shard)
            if kind is None:
                return None

    async def _recover(self, lost: BaseException) -> None:
        """See :meth:`Worker._recover`."""
        attempt = _Reconnecting(self, lost, self.reconnect_timeout)
        while True:
            try:
                async with self._lock:
                    self._disconnect(lost)
                    attempt.check_closed()
                    self._conn = await self._reopen()
                    attempt.check_closed()
                try:
                    await self._roundtrip(lambda: self._core.init_request(None, rejoin=True), attempt.remaining(),
                                          waiting=self._note_init_wait)
                except APSTimeoutError as exc:
                    raise self._rejoin_timeout(attempt, exc) from None
                await self._restore_hyperparameters(attempt.remaining())
                break
            except APSError as exc:
                lost = exc
                await asyncio.sleep(attempt.failed(exc))
        attempt.done()
        self._start_heartbeat()

    async def _reopen(self) -> AsyncConnection:
        token = ASYNC_AS_SHARD.set(self._as_shard)
        try:
            conn, self.server_info = await self._open(self._parsed.host, self._parsed.port, self._connect_timeout,
                                                      self.server_timeout, self._token, self._tls, self._core)
        finally:
            ASYNC_AS_SHARD.reset(token)
        return conn

    async def _roundtrip(self, request, timeout: float | None = ..., *, waiting=None) -> Header:
        if timeout is ...:
            timeout = self.timeout
        async with self._lock:
            conn, core = self._conn, self._core
            if conn is None:
                raise self._disconnected()
            buffers = request()  # under the lock: its request id is the one the reply will carry
            turn = ASYNC_SEND_TURN.get()  # a sharded worker's order of sending to its shards
            try:
                if turn is not None:
                    await turn.wait()
                await conn.send(buffers)
                if turn is not None:
                    turn.done()
                if waiting is None:
                    await conn.receive(core.reader, core.has_reply, timeout, self.server_timeout)
                else:
                    await self._receive_patiently(conn, timeout, waiting)
            except BaseException as exc:
                # Interrupted mid-request (an error, a timeout, cancellation):
                # the stream is no longer in step with the server, so drop it.
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

    async def _receive_patiently(self, conn, timeout: float | None, waiting) -> None:
        """See :meth:`Worker._receive_patiently`."""
        patience = _Patience(timeout, waiting)
        while True:
            try:
                return await conn.receive(
                    self._core.reader, self._core.has_reply, patience.next_wait(), self.server_timeout
                )
            except ServerSilent:
                raise
            except APSTimeoutError:
                if patience.expired():
                    raise

    @staticmethod
    async def _open(host: str, port: int, connect_timeout, server_timeout, token, tls,
                    core) -> tuple[AsyncConnection, ServerInfo]:
        conn = await AsyncConnection.open(host, port, connect_timeout, server_timeout, tls)
        try:
            secret, found = find_client_token(token, host, port)
            try:
                info = await handshake_async(conn, secret, connect_timeout, found=found)
            except AuthenticationError:
                secret = newer_token(secret, found, host, port)  # a restarted server's new token
                if secret is None:
                    raise
                conn.close()
                conn = await AsyncConnection.open(host, port, connect_timeout, server_timeout, tls)
                info = await handshake_async(conn, secret, connect_timeout, found=True)
            core.check_run(info.run_id, str(conn.address))
            if not ASYNC_AS_SHARD.get():
                _refuse_one_shard(info, str(conn.address))
        except BaseException:
            conn.close()
            raise
        return conn, info

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
                    await self._roundtrip(lambda: self._core.simple_request(Op.PING), max(interval, 1.0) * 6)
        except APSError as exc:
            log.warning("rank %d: heartbeat failed: %s", self.rank, exc)
