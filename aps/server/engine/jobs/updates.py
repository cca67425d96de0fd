"""The jobs of the update lane that compute: a gradient, an aggregate update,
and a gradient applied while it arrives.

A job sees the engine only through :class:`UpdateOwner` (the engine's training
part implements it): the pieces it computes with (table, policy, running sum,
tables, kernels) and the reports back (a gradient committed or refused, an
aggregate update done). Training does the bookkeeping behind those reports
(counters, releases, statistics); the jobs do the arithmetic and keep it
transactional: every kernel writes its results aside (a free slot, the
optimizer's spare state, the spare sum), so a refusal or a cancellation simply
throws them away.

Failure discipline: until a job adopts its results (publishes the slot and
the optimizer's state, or swaps in the new sum), a failure at any step
(prepare, kernel, adoption) gives back what it claimed and answers its
worker with an error; nothing of it remains. An aggregate update that fails
is reported done but not applied, so the policy's round closes and the next
one proceeds.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from types import ModuleType
from typing import TYPE_CHECKING, Protocol

import numpy as np

from ..lane import Job, UpdateLane
from ....errors import InternalServerError, NonFiniteGradient
from ....layout import line_aligned
from ....wire.quantized import Quantized
from ..sync import Plan, PlanKind, SyncPolicy
from ..table import ParameterTable

if TYPE_CHECKING:
    from ..members import Member, PushResult
    from ..optim import HyperGroups
    from ..rows import Tables
    from ..table import Snapshot, _Slot
    from ....errors import ServerError

__all__ = ["Aggregate", "AggregateJob", "PushJob", "StreamingPush", "UpdateOwner"]

log = logging.getLogger("aps.server")


class UpdateOwner(Protocol):
    """What a job computing a gradient may see of the engine (its training part)."""

    @property
    def table(self) -> ParameterTable:
        """The model's weights table (a job runs once the model exists)."""

    @property
    def aggregate(self) -> Aggregate | None:
        """The round's running sum (None: the policy keeps none)."""

    @property
    def rows(self) -> Tables:
        """The model's embedding tables."""

    @property
    def policy(self) -> SyncPolicy:
        """The sync policy: it plans each gradient at its turn."""

    @property
    def kernels(self) -> ModuleType:
        """The native module or its reference twin."""

    def gradient_committed(
        self, member: Member, plan: Plan, arrived: float, hyper: HyperGroups | None = None
    ) -> PushResult:
        """The gradient was applied, accumulated or dropped: count it, release whom it releases.
        ``hyper``: the values the push came with (an aggregate update it closes uses them)."""

    def weights_pushed_on(self, member: Member, version: int) -> Snapshot | None:
        """A lease on the weights of ``version`` ``member`` was given (delay compensation), or None."""

    def gradient_compensated(self, member: Member, version: int, compensated: bool) -> None:
        """With delay compensation: ``member``'s gradient (computed on ``version``) was taken,
        compensated or (the weights of ``version`` not kept) not."""

    def gradient_refused(self, rank: int, reason: object) -> ServerError:
        """The kernel refused the gradient (``reason``: False, or the exception it
        raised): count it; returns the error for the worker."""

    def aggregate_committed(self, applied: bool) -> None:
        """An aggregate update finished (``applied``: it was published)."""


class Aggregate:
    """BSP's and softsync's running sum of gradients, kept twice: the accumulate
    kernel reads :attr:`current` and writes the next sum into :attr:`spare`."""

    __slots__ = ("_buffers", "dense")

    def __init__(self, numel: int) -> None:
        self._buffers = [line_aligned(numel), line_aligned(numel)]
        #: Some push of the open round carried a dense gradient (a round of rows alone
        #: leaves the dense weights and their optimizer's state as they are).
        self.dense = True

    @property
    def current(self) -> np.ndarray:
        return self._buffers[0]

    @property
    def spare(self) -> np.ndarray:
        return self._buffers[1]

    def adopt(self) -> None:
        """The spare holds the new sum: make it current."""
        self._buffers.reverse()


class PushJob(Job):
    """One gradient: plan it (apply, accumulate or drop), run its kernel, commit.

    It is applied with the values its worker had set when the push arrived
    (``member.hyper``, a HYPER request), or the optimizer's own without them.
    ``clock`` is the iteration the push says it was computed in, for the policy's
    staleness bound (-1: its rank's clock; see ``SyncPolicy.plan``). ``rows``: the rows
    it pushes to the model's tables (checked sections, aps.wire.rows), applied, kept for
    the round or dropped with the dense gradient, in its commit on the loop (pulls make
    rows there); ``dense`` False: it carries rows alone, no dense gradient. ``skip``: it
    carries nothing, its worker takes no part in the open round (``SyncPolicy.plan_skip``).
    """

    __slots__ = (
        "owner",
        "member",
        "grad_version",
        "arrived",
        "on_done",
        "on_error",
        "plan",
        "slot",
        "w_in",
        "answered",
        "adopted",
        "hyper",
        "clock",
        "rows",
        "dense",
        "skip",
        "then",
    )

    def __init__(
        self,
        owner: UpdateOwner,
        member: Member,
        grad_version: int,
        arrived: float,
        on_done: Callable[[PushResult], None],
        on_error: Callable[[ServerError], None],
        clock: int = -1,
        rows: list | None = None,
        dense: bool = True,
        skip: bool = False,
    ) -> None:
        self.owner = owner
        self.member = member
        self.grad_version = grad_version
        self.arrived = arrived
        self.on_done = on_done
        self.on_error = on_error
        self.plan: Plan | None = None
        self.slot: _Slot | None = None
        self.w_in: np.ndarray | None = None
        self.answered = False
        self.adopted = False
        self.hyper = member.hyper
        self.clock = clock
        self.rows = rows or []
        self.dense = dense and not skip
        self.skip = skip
        #: With delay compensation: a lease on the weights the gradient was computed on.
        self.then: Snapshot | None = None

    def prepare(self) -> int:
        table = self.owner.table
        # Planned at its turn in the lane: the bound is checked against the state it is applied in.
        policy, rank = self.owner.policy, self.member.rank
        if self.skip:
            self.plan = policy.plan_skip(rank, self.grad_version, table.version)
            return 0
        plan = self.plan = policy.plan(rank, self.grad_version, table.version, self.clock)
        if not self.dense:
            return 0
        compensated = table.compensation is not None and plan.kind is not PlanKind.DROP
        if plan.kind is PlanKind.APPLY:
            self.slot = table.begin_update()
        if plan.kind is PlanKind.APPLY or compensated:
            self.w_in = table.current_array()
        if compensated:
            self.then = self.owner.weights_pushed_on(self.member, self.grad_version)
        return len(self.member.gradient)

    def run(self) -> bool:
        # One pass that reads each gradient element once and writes every
        # result aside: False means nothing changed (see aps/server/optim.py).
        owner, member, plan, slot, w_in = self.owner, self.member, self.plan, self.slot, self.w_in
        assert plan is not None, "planned in prepare"
        if not self.dense:
            return True  # (its rows are checked at intake, and applied in the commit)
        grad, dtype = member.gradient, member.grad_dtype
        compensation = owner.table.compensation
        if compensation is not None and plan.kind is not PlanKind.DROP:
            assert w_in is not None, "compensated: prepare chose the weights it reads"
            compensation.begin()
            if self.then is not None and plan.kind is PlanKind.APPLY:
                assert slot is not None, "applied: prepare claimed its slot"
                return compensation.apply(
                    owner.table.optimizer, slot.array, w_in, grad, dtype, self.then.array, plan.scale, self.hyper
                )
            if self.then is not None:  # (none: its worker's weights were not kept; applied as it is)
                compensated = compensation.gradient(grad, dtype, w_in, self.then.array, 0, len(grad))
                if compensated is None:
                    return False
                grad, dtype = compensated, owner.kernels.FLOAT32
        if plan.kind is PlanKind.APPLY:
            assert slot is not None and w_in is not None, "applied: prepare claimed its slot"
            ok = owner.table.optimizer.step(slot.array, w_in, grad, plan.scale, dtype, self.hyper)
            if ok and compensation is not None:
                compensation.stepped(slot.array, w_in, 0, len(grad))
            return ok
        if plan.kind is PlanKind.ACCUMULATE:
            aggregate = owner.aggregate
            assert aggregate is not None, "a policy that accumulates keeps a running sum"
            return owner.table.optimizer.threads.run(
                functools.partial(_accumulate, owner.kernels, aggregate, grad, plan.scale, plan.first, dtype),
                0,
                len(grad),
            )
        return owner.kernels.all_finite(grad, dtype)

    def commit(self, result: object) -> None:
        owner, table, plan = self.owner, self.owner.table, self.plan
        assert plan is not None, "planned in prepare"
        if result is not True:
            self.fail(result)
            return
        # Adoption: the rows are computed aside first (refused, nothing changed), the publish
        # comes next (it raises before it changes anything, if at all); the optimizer's swap
        # of its state and the rows' write cannot fail.
        if plan.kind is PlanKind.APPLY:
            staged = []
            if self.rows:
                try:
                    staged = owner.rows.prepare(self.rows, plan.scale)
                except NonFiniteGradient as exc:
                    self.fail(exc)  # (its message names the table)
                    return
            if self.dense:
                assert self.slot is not None, "applied: prepare claimed its slot"
                table.publish(self.slot)
                self.slot = None  # the table's now
                table.optimizer.commit()
                if table.compensation is not None:
                    table.compensation.commit()
            else:
                table.advance()
            owner.rows.commit(staged)
        elif plan.kind is PlanKind.ACCUMULATE:
            try:  # (the rows the round keeps: copies where read in place, checked as kept)
                kept = owner.rows.kept(self.rows)
            except NonFiniteGradient as exc:
                self.fail(exc)
                return
            aggregate = owner.aggregate
            assert aggregate is not None, "a policy that accumulates keeps a running sum"
            if self.dense:
                aggregate.adopt()
                if table.compensation is not None:
                    table.compensation.commit()
            elif plan.first:  # the round's sum starts from zero (and holds no dense gradient yet)
                aggregate.current.fill(0.0)
            aggregate.dense = self.dense or (aggregate.dense and not plan.first)
            owner.rows.accumulate(kept, plan.scale, plan.first, self.member.rank)
        self.adopted = True  # from here on the gradient is in: a failure must not say otherwise
        if self.dense and table.compensation is not None and plan.kind is not PlanKind.DROP:
            owner.gradient_compensated(self.member, self.grad_version, self.then is not None)
        self._let_go()
        result = owner.gradient_committed(self.member, plan, self.arrived, self.hyper)
        self.answered = True
        self.on_done(result)

    def fail(self, exc: object) -> None:
        """Refused (``exc`` False) or failed: give the slot back, tell the worker (once)."""
        self._let_go()
        if self.slot is not None:
            self.owner.table.abandon(self.slot)
            self.slot = None
        if self.answered:
            return
        self.answered = True
        if self.adopted:  # applied (or accumulated) already: only the bookkeeping or the answer failed
            log.error("worker %d: its gradient was taken, but answering it failed: %s", self.member.rank, exc)
            self.on_error(
                InternalServerError(
                    f"the gradient was taken (do not send it again), but the server failed after: {exc}"
                )
            )
            return
        if exc is False:  # the kernel refused it: say where
            exc = refusal(self.owner.table, self.owner.kernels, self.member.gradient, self.member.grad_dtype)
        self.on_error(self.owner.gradient_refused(self.member.rank, exc))

    def _let_go(self) -> None:
        """End the lease on the weights the gradient was computed on (compensation)."""
        if self.then is not None:
            self.then.release()
            self.then = None


#: The tensors a refusal names one by one (the others are counted).
_NAMED_TENSORS = 3


def refusal(table: ParameterTable, kernels, grad: np.ndarray | Quantized, dtype: int) -> NonFiniteGradient:
    """The error for a dense gradient ``grad`` (float32, or 16-bit words of ``dtype``) the
    kernel refused: the tensors of the model's layout it holds NaN or infinity in, each with
    how many elements and the first one; or, every element finite, that the update would
    make a weight or the optimizer's state overflow (computed on the refusal only)."""
    layout = table.layout
    bad = [
        (name, shape, offset, size)
        for name, shape, offset, size in zip(layout.names, layout.shapes, layout.offsets, layout.sizes)
        if not kernels.all_finite(grad[offset : offset + size], dtype)
    ]
    if not bad:
        compensated = (
            f", compensated for its delay (--compensation {table.compensation.describe()})"
            if table.compensation is not None
            else ""
        )
        return NonFiniteGradient(
            f"the gradient is finite, but the update{compensated} would make a weight or the optimizer's state "
            "NaN or infinity (an overflow: a learning rate or a gradient too large?); it was rejected and changed "
            "nothing"
        )
    described = []
    for name, shape, offset, size in bad[:_NAMED_TENSORS]:
        piece = grad[offset : offset + size]
        values = piece if isinstance(piece, np.ndarray) and dtype == kernels.FLOAT32 else np.empty(size, np.float32)
        if dtype != kernels.FLOAT32:
            kernels.widen(values, piece, dtype)
        where = np.flatnonzero(~np.isfinite(values))
        first = ", ".join(str(int(i)) for i in np.unravel_index(int(where[0]), shape)) if shape else ""
        described.append(f"{name!r} ({len(where)} of {size} elements; {name}[{first}] is {values[where[0]]})")
    more = f" and {len(bad) - _NAMED_TENSORS} more tensors" if len(bad) > _NAMED_TENSORS else ""
    return NonFiniteGradient(
        f"the gradient holds NaN or infinity in {', '.join(described)}{more}; it was rejected and changed nothing"
    )


class AggregateJob(Job):
    """Apply the running sum (a closed BSP round, a full softsync buffer), times ``scale``,
    with ``hyper``: the values of the last gradient added to it (None: the optimizer's own)."""

    __slots__ = ("owner", "scale", "hyper", "slot", "w_in", "reported")

    def __init__(self, owner: UpdateOwner, scale: float, hyper: HyperGroups | None = None) -> None:
        self.owner = owner
        self.scale = scale
        self.hyper = hyper
        self.slot: _Slot | None = None
        self.w_in: np.ndarray | None = None
        self.reported = False

    def prepare(self) -> int:
        if not self._sum().dense:  # a round of rows alone
            return 0
        table = self.owner.table
        self.slot = table.begin_update()
        w_in = self.w_in = table.current_array()
        return len(w_in)

    def run(self) -> bool:
        owner, slot, w_in = self.owner, self.slot, self.w_in
        if slot is None:
            return True
        assert w_in is not None, "prepare chose the weights it reads with its slot"
        compensation = owner.table.compensation
        if compensation is not None:
            compensation.begin()
        ok = owner.table.optimizer.step(slot.array, w_in, self._sum().current, self.scale, groups=self.hyper)
        if ok and compensation is not None:
            compensation.stepped(slot.array, w_in, 0, len(w_in))
        return ok

    def _sum(self) -> Aggregate:
        aggregate = self.owner.aggregate
        assert aggregate is not None, "an aggregate update comes of a policy that keeps a running sum"
        return aggregate

    def commit(self, result: object) -> None:
        owner, table = self.owner, self.owner.table
        if result is not True:
            self.fail(result)
            return
        # The round's rows, applied once (refused: the round is lost, as for a dense sum that would
        # overflow): each id's gradients summed (SGD: applied one after the other, in rank order).
        try:
            staged = owner.rows.prepare(owner.rows.take_round(self.scale))
        except NonFiniteGradient:
            self.fail(False)
            return
        if self.slot is not None:
            table.publish(self.slot)
            self.slot = None
            table.optimizer.commit()
            if table.compensation is not None:
                table.compensation.commit()
        else:
            table.advance()
        owner.rows.commit(staged)
        self.reported = True
        owner.aggregate_committed(True)

    def fail(self, exc: object) -> None:
        """The update is not applied; the round still ends, so the policy goes on."""
        self.owner.rows.forget_round()
        if self.slot is not None:
            self.owner.table.abandon(self.slot)
            self.slot = None
        if isinstance(exc, BaseException):
            log.error("aggregate update failed (%s: %s); the round's gradients are lost", type(exc).__name__, exc)
        else:
            log.error("the aggregated gradient would make the weights overflow: update skipped")
        if not self.reported:
            self.reported = True
            self.owner.aggregate_committed(False)


def _accumulate(
    kernels, aggregate: Aggregate, grad, scale: float, first: bool, dtype: int, start: int, stop: int
) -> bool:
    """The round's running sum plus ``scale * grad`` on ``[start, stop)``, into the spare."""
    current = None if first else aggregate.current[start:stop]
    return kernels.accumulate(aggregate.spare[start:stop], current, grad[start:stop], scale, first, dtype)


class StreamingPush:
    """A gradient being applied piece by piece while it arrives.

    The transport calls :meth:`feed` as each piece lands; the update of that
    piece (and the next optimizer state) is written aside, into a fresh,
    unpublished slot, while the lane is reserved for it. Finished, the push
    commits like any other (``Engine.push`` with ``stream=``). Cancelled (the
    lane is needed elsewhere) or aborted (the gradient was refused, or the
    connection died), the slot is simply given back. Every piece is applied
    with the values the worker had set when the push began (``member.hyper``).
    """

    __slots__ = ("table", "lane", "member", "plan", "hyper", "slot", "w_in", "filled", "active")

    def __init__(self, table: ParameterTable, lane: UpdateLane, member: Member, plan: Plan) -> None:
        self.table = table
        self.lane = lane
        self.member = member
        self.plan = plan
        self.hyper = member.hyper
        self.slot: _Slot | None = None
        self.w_in: np.ndarray | None = None
        self.filled = 0
        self.active = False

    def start(self) -> bool:
        """Reserve the lane and claim a slot; False when the lane is busy."""
        if not self.lane.reserve(self):
            return False
        self.slot = self.table.begin_update()
        self.w_in = self.table.current_array()
        self.active = True
        return True

    @property
    def complete(self) -> bool:
        return self.active and self.filled == len(self.member.gradient)

    def feed(self, stop: int) -> None:
        """Elements ``[0, stop)`` of the gradient have arrived."""
        if self.active and stop > self.filled:
            member, slot = self.member, self.slot
            assert slot is not None, "active: start claimed its slot"
            ok = self.table.optimizer.step_slice(
                slot.array,
                self.w_in,
                member.gradient,
                self.plan.scale,
                self.filled,
                stop,
                member.grad_dtype,
                self.hyper,
            )
            self.filled = stop
            if not ok:  # the ordinary path will refuse it properly
                self.abort()

    def cancel(self) -> None:
        """Give the slot back (called by the lane, which has already dropped the reservation)."""
        if self.active and self.slot is not None:
            self.active = False
            self.table.abandon(self.slot)

    def abort(self) -> None:
        """Give the slot back and free the lane."""
        self.cancel()
        self.lane.unreserve(self)

    def finish(self, job: PushJob) -> None:
        """All of it arrived and was applied: commit ``job`` with this result, free the lane."""
        self.lane.unreserve(self)
        job.plan, job.slot, job.hyper = self.plan, self.slot, self.hyper
        try:
            job.commit(True)
        except Exception as exc:
            log.error("a streamed push failed to commit: %s: %s", type(exc).__name__, exc, exc_info=exc)
            job.fail(exc)
