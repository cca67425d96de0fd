"""A worker's place at the server: :class:`Member` (held by its connection while it is
joined), :class:`Seat` (what the server remembers of a rank across connections and
checkpoints), :class:`PushResult` (the answer to an accepted push) and :class:`Roster`
(every member and seat, and whether training goes: the record the engine's parts share,
which membership writes and training reads)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from ... import _core
from ...wire.protocol import request_before
from ...wire.quantized import QUANTIZED, Quantized, quantized_nbytes
from .optim import HyperGroups

if TYPE_CHECKING:
    from ...errors import ServerError
    from .table import Snapshot

__all__ = ["ErrorCallback", "Member", "PushResult", "ReadyCallback", "Roster", "Seat"]

#: ``on_ready(snapshot, clock)``: the worker is released; send it these weights.
ReadyCallback = Callable[["Snapshot", int], None]
#: ``on_error(error)``: the request is refused (nothing changed), with the error for the worker.
ErrorCallback = Callable[["ServerError"], None]


@dataclass(slots=True)
class PushResult:
    """The answer to an accepted push.

    Attributes:
        version: the server's version after the push.
        clock: the worker's clock after the push.
        dropped: the gradient was not applied: it arrived for a closed BSP round, or
            it is older than the staleness bound allows (computed before its worker
            reconnected, docs/algorithms.md); the worker goes on from the newest weights.
        staleness: ``V - v_g`` when the gradient was applied or accumulated.
        scale: the factor the gradient was multiplied by before the optimizer
            (staleness-aware learning rate, ``--async-scale mean``).
    """

    version: int
    clock: int
    dropped: bool
    staleness: int
    scale: float


class Seat:
    """What the server remembers of a rank across its connections (and checkpoints):
    its clock when it last left, and its last committed push, by which a push sent
    again after a lost reply is recognised (docs/protocol.md, "Duplicates")."""

    __slots__ = ("clock", "held", "credit", "push_id", "push_clock", "result", "left")

    def __init__(self) -> None:
        self.left = -1  # when its worker last left, counted in leaves (not kept in checkpoints)
        self.clock = -1
        self.held = False  # held at the gate when it left
        self.credit = 0  # DSSP iterations it had been granted and not used
        self.push_id = -1
        self.push_clock = -1
        self.result: PushResult | None = None

    def is_duplicate(self, request_id: int | None, clock: int | None) -> bool:
        # Request id 0 names no request (aps.Worker never uses it): never a duplicate. A push
        # sent before the last one taken, by request id (a few at most before it) and by clock,
        # was taken before it: a worker numbers its requests and its pushes in the order it
        # sends them, and sends again, in that order, only the pushes never answered (an asyncio
        # worker's pipeline: several; docs/protocol.md, "Duplicates").
        if not request_id or clock is None or self.push_clock < 0 or self.push_id <= 0:
            return False
        if request_id == self.push_id:
            return clock == self.push_clock
        return request_before(request_id, self.push_id) and 0 <= clock < self.push_clock

    def to_json(self) -> dict:
        result = self.result
        return {
            "clock": self.clock,
            "held": self.held,
            "credit": self.credit,
            "push_id": self.push_id,
            "push_clock": self.push_clock,
            "push_result": None
            if result is None
            else [result.version, result.clock, result.dropped, result.staleness, result.scale],
        }

    @classmethod
    def from_json(cls, data: dict) -> Seat:
        seat = cls()
        seat.clock, seat.push_id, seat.push_clock = int(data["clock"]), int(data["push_id"]), int(data["push_clock"])
        seat.held, seat.credit = bool(data.get("held", False)), int(data.get("credit", 0))
        if data.get("push_result") is not None:
            version, clock, dropped, staleness, scale = data["push_result"]
            seat.result = PushResult(int(version), int(clock), bool(dropped), int(staleness), float(scale))
        return seat


class Member:
    """One worker's seat at the server, held by its connection.

    Attributes:
        rank: the worker's rank.
        grad: the flat float32 buffer its pushes are received into.
        grad16: the buffer of its compressed pushes (16-bit words), made at the first one.
        gradq: the buffer of its quantized pushes (aps.wire.quantized), made at the first one.
        grad_dtype: the element type of the push being received (a ``_core`` dtype:
            FLOAT32 in ``grad``, BFLOAT16 or FLOAT16 in ``grad16``, INT8Q or INT4Q in ``gradq``).
        hyper: the per-group optimizer values its pushes are applied with (set by a
            HYPER request); None: the server's own. They belong to the connection:
            a worker that reconnects sends them again.
    """

    __slots__ = (
        "rank",
        "grad",
        "grad_bytes",
        "grad16",
        "grad16_bytes",
        "gradq",
        "gradq_view",
        "grad_dtype",
        "connected",
        "joined",
        "joined_running",
        "waiter",
        "gate",
        "waiting_since",
        "required_version",
        "rejoin",
        "rejoin_clock",
        "push_id",
        "push_clock",
        "hyper",
        "rows_wanted",
        "rows_out",
        "rows_room",
        "pulled",
        "dense_wanted",
    )

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.grad: np.ndarray | None = None
        self.grad_bytes: memoryview | None = None
        self.grad16: np.ndarray | None = None
        self.grad16_bytes: memoryview | None = None
        self.gradq: np.ndarray | None = None
        self.gradq_view: Quantized | None = None  # the quantized push being received, as the kernels take it
        self.grad_dtype = _core.FLOAT32
        self.connected = True
        self.joined = False
        self.joined_running = False  # it joined a model that was already training
        self.waiter: ReadyCallback | None = None
        self.gate = False  # the pending request is a pull (counted), not an init
        self.waiting_since: float | None = None  # when its pull began to wait
        self.required_version = 0
        self.rejoin = False  # a worker reconnecting: it goes on from the clock it had
        self.rejoin_clock = -1  # the clock its rejoining INIT said it had
        self.push_id: int | None = None  # request id and clock of the push in the lane
        self.push_clock: int | None = None
        self.hyper: HyperGroups | None = None
        #: The rows its pull asks for (sections of ids, aps.wire.rows), read when it is
        #: served (rows_out: one array of rows a section, or why reading them failed), for its
        #: reply to carry.
        self.rows_wanted: list | None = None
        self.rows_out: list | Exception | None = None
        #: Where its connection wants a reply's rows gathered (shared memory: the reply
        #: segment; a callable giving ``nbytes`` of room), or None (new arrays).
        self.rows_room: Callable[[int], np.ndarray] | None = None
        #: With delay compensation: a lease on the weights it was last given (its next
        #: gradient is computed on them), or None (docs/algorithms.md, "Delay compensation").
        self.pulled: Snapshot | None = None
        #: Its pending reply carries the dense weights (False: rows alone).
        self.dense_wanted = True

    def keep_pulled(self, snapshot: Snapshot | None) -> None:
        """Hold ``snapshot`` (a lease; None: none) as the weights it was last given."""
        if self.pulled is not None:
            self.pulled.release()
        self.pulled = snapshot

    def receive_gradient(self, dtype: int) -> memoryview:
        """Where the next push's payload goes: ``grad``, or (for a compressed push,
        ``dtype`` BFLOAT16 or FLOAT16) ``grad16``, made the first time."""
        self.grad_dtype = dtype
        grad_bytes, grad16_bytes = self.grad_bytes, self.grad16_bytes
        assert self.grad is not None and grad_bytes is not None, "a member receives pushes once joined"
        if dtype == _core.FLOAT32:
            return grad_bytes
        if dtype in QUANTIZED:
            n = len(self.grad)
            if self.gradq is None:  # (sized for int8, the larger: a 4-bit push takes the start of it)
                self.gradq = np.zeros(quantized_nbytes(n, _core.INT8Q), np.uint8)
            payload = self.gradq[: quantized_nbytes(n, dtype)]
            self.gradq_view = Quantized(payload, n, dtype)
            return memoryview(payload).cast("B")  # type: ignore[arg-type]  # numpy arrays are buffers; its stubs do not say so
        if grad16_bytes is None:
            self.grad16 = np.zeros(len(self.grad), np.uint16)
            grad16_bytes = self.grad16_bytes = memoryview(self.grad16).cast("B")  # type: ignore[arg-type]  # numpy arrays are buffers; its stubs do not say so
        return grad16_bytes

    @property
    def gradient(self) -> np.ndarray | Quantized:
        """The push received last, as its kernel takes it (see :attr:`grad_dtype`)."""
        if self.grad_dtype in QUANTIZED:
            assert self.gradq_view is not None, "a member's gradient is read once it pushed"
            return self.gradq_view
        gradient = self.grad if self.grad_dtype == _core.FLOAT32 else self.grad16
        assert gradient is not None, "a member's gradient is read once it pushed"
        return gradient


class Roster:
    """Who is at the server: the members by rank (live connections), the seats by rank
    (what is remembered of every rank that was ever seated), and whether training goes.

    The engine's parts share it: membership (:mod:`aps.server.engine.membership`) is the
    only one that seats and unseats, training (:mod:`aps.server.engine.training`) reads it
    to release workers and records each rank's last push in its seat, durability keeps the
    seats in checkpoints. A record, not a rule: its one method makes a seat.
    """

    __slots__ = ("members", "seats", "started", "below_quorum", "draining")

    def __init__(self) -> None:
        #: The joined (or joining) workers, by rank: each held by its connection.
        self.members: dict[int, Member] = {}
        #: What is remembered of each rank across its connections and checkpoints.
        self.seats: dict[int, Seat] = {}
        #: Training has started: the workers it waited for have joined.
        self.started = False
        #: Training holds: an elastic run has fewer than MIN live workers.
        self.below_quorum = False
        #: A worker left saying its training is done: the run is ending, MIN holds nobody.
        self.draining = False

    def seat(self, rank: int) -> Seat:
        """The seat of ``rank``, made when it has none."""
        seat = self.seats.get(rank)
        if seat is None:
            seat = self.seats[rank] = Seat()
        return seat
