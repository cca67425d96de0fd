"""The server's core without I/O: membership, the sync policy, the table, the update lane.

Transports turn frames into calls on :class:`Engine` (``join``, ``pull``,
``push``, ``leave``) and get answers through callbacks. Keeping the core free
of sockets lets the tests drive every policy through random interleavings
directly, and the simulator run it on a virtual clock.

Ordering. Every change of state (a join, a leave, a gradient's plan and
commit, an aggregate update) goes through one FIFO, the *update lane*, and
runs in arrival order. A gradient's job asks the policy for a plan, runs its
kernel (inline, or on a helper thread for large models, while the event loop
keeps reading sockets), then commits: only a gradient that passed the finite
check changes anything. A pull is answered when the policy no longer holds
its worker and the table has published every update decided before the
worker's release, so a worker always sees its own updates.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import numpy as np

from . import _core
from .config import ServerConfig
from .errors import (
    InternalServerError,
    LayoutMismatch,
    NonFiniteGradient,
    NotInitialized,
    OutOfOrder,
    RankOutOfRange,
    RankTaken,
    ServerError,
    WorkerCountMismatch,
)
from .layout import Layout
from .optim import make_optimizer
from .stats import ServerStats
from .sync import Outcome, Plan, PlanKind, make_policy
from .table import ParameterTable, Snapshot

__all__ = ["Engine", "Member", "PushResult", "StreamingPush"]

log = logging.getLogger("aps.server")

#: ``on_ready(snapshot, clock)``: the worker is released; send it these weights.
ReadyCallback = Callable[[Snapshot, int], None]
ErrorCallback = Callable[[ServerError], None]
Kernel = Callable[[], bool]
Offload = Callable[[Kernel, Callable[[object], None]], None]


@dataclass(slots=True)
class PushResult:
    """The answer to an accepted push.

    Attributes:
        version: the server's version after the push.
        clock: the worker's clock after the push.
        dropped: the gradient arrived for a closed BSP round and was not applied.
        staleness: ``V - v_g`` when the gradient was applied or accumulated.
        scale: the factor the gradient was multiplied by before the optimizer
            (staleness-aware learning rate, ``--async-scale mean``).
    """

    version: int
    clock: int
    dropped: bool
    staleness: int
    scale: float


class Member:
    """One worker's seat at the server, held by its connection.

    Attributes:
        rank: the worker's rank.
        grad: the flat float32 buffer its pushes are received into.
    """

    __slots__ = (
        "rank", "grad", "grad_bytes", "connected", "joined", "waiter", "gate", "waiting_since", "required_version"
    )

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.grad: np.ndarray | None = None
        self.grad_bytes: memoryview | None = None
        self.connected = True
        self.joined = False
        self.waiter: ReadyCallback | None = None
        self.gate = False  # the pending request is a pull (counted), not an init
        self.waiting_since: float | None = None  # when its pull began to wait
        self.required_version = 0


class _Job:
    """One entry of the update lane: ``prepare`` and ``commit`` run on the loop;
    ``run``, the kernel, may run on the helper thread in between."""

    __slots__ = ()

    def prepare(self) -> int | None:
        """Plan the work; returns its size in elements, or None when there is no kernel."""
        return None

    def run(self) -> bool:
        """The kernel: touches only the arrays ``prepare`` chose. False: refused."""
        return True

    def commit(self, result: object) -> None:
        raise NotImplementedError


class _Call(_Job):
    __slots__ = ("fn",)

    def __init__(self, fn: Callable[[], None]) -> None:
        self.fn = fn

    def commit(self, result: object) -> None:
        self.fn()


def _run_kernel(kernel: Kernel) -> object:
    try:
        return kernel()
    except Exception as exc:  # reported by the job's commit
        return exc


class _Lane:
    """The FIFO of state changes (see the module docstring).

    While a gradient streams in, the lane may be *reserved* for it (see
    :class:`StreamingPush`); any other submission cancels the reservation
    first, so a slow sender never holds up anyone else.
    """

    def __init__(self, offload: Offload | None, threshold: int) -> None:
        self._jobs: deque[_Job] = deque()
        self._offload = offload
        self._threshold = threshold
        self._running = False
        self._busy = False
        self._reserved: StreamingPush | None = None

    @property
    def idle(self) -> bool:
        return not self._jobs and not self._busy and self._reserved is None

    def reserve(self, holder: StreamingPush) -> bool:
        if self._jobs or self._busy or self._running or self._reserved is not None:
            return False
        self._reserved = holder
        return True

    def unreserve(self, holder: StreamingPush) -> None:
        if self._reserved is holder:
            self._reserved = None
            self._run()

    def submit(self, job: _Job, *, front: bool = False) -> None:
        if self._reserved is not None:
            holder, self._reserved = self._reserved, None
            holder.cancel()
        if front:
            self._jobs.appendleft(job)
        else:
            self._jobs.append(job)
        self._run()

    def _run(self) -> None:
        if self._running or self._busy or self._reserved is not None:
            return
        self._running = True
        try:
            while self._jobs and not self._busy:
                job = self._jobs.popleft()
                try:
                    size = job.prepare()
                    if size is None:
                        job.commit(True)
                    elif self._offload is not None and size >= self._threshold:
                        self._busy = True
                        self._offload(job.run, lambda result, job=job: self._finished(job, result))
                    else:
                        job.commit(_run_kernel(job.run))
                except Exception:  # a bug in one job must not stall the others
                    self._busy = False
                    log.exception("internal error in the update lane (%s)", type(job).__name__)
        finally:
            self._running = False

    def _finished(self, job: _Job, result: object) -> None:
        self._busy = False
        try:
            job.commit(result)
        except Exception:
            log.exception("internal error in the update lane (%s)", type(job).__name__)
        finally:
            self._run()


class Engine:
    """The server's state machine (see the module docstring).

    Args:
        config: the server's options.
        now: monotonic clock for push arrival times.
        offload: runs a kernel off the loop and calls back with its result on
            the loop; None runs every kernel inline.
        offload_threshold: kernels over at least this many elements are offloaded.
        kernels: the native module or its reference twin.
        window_type: the StalenessWindow implementation (defaults to ``kernels``').
        allocate: allocator of the table's snapshot slots (memory blocks, see
            :class:`aps.table.HeapBlock`).
    """

    def __init__(
        self,
        config: ServerConfig,
        *,
        now: Callable[[], float] = time.monotonic,
        offload: Offload | None = None,
        offload_threshold: int = 1 << 18,
        kernels: ModuleType = _core,
        window_type: type | None = None,
        allocate: Callable[[int], object] | None = None,
    ) -> None:
        self.config = config
        self.num_workers = config.workers
        self.policy = make_policy(config, window_type or kernels.StalenessWindow)
        self.table: ParameterTable | None = None
        self.layout: Layout | None = None
        self.members: dict[int, Member] = {}
        self.started = False
        self.pushes = 0
        self.address = ""  # set by the server, for statistics
        self.stats = ServerStats(config.workers, now)
        self._now = now
        self._kernels = kernels
        self._allocate = allocate
        self._aggregates: list[np.ndarray] | None = None  # the running sum and a spare (BSP, softsync)
        self._pending_aggregates = 0
        self._waiting: dict[int, Member] = {}
        self._lane = _Lane(offload, offload_threshold)

    # Introspection ---------------------------------------------------------
    @property
    def version(self) -> int:
        """The newest published version."""
        return self.table.version if self.table is not None else 0

    @property
    def decided_version(self) -> int:
        """The version once every update decided so far is published."""
        return self.version + self._pending_aggregates

    @property
    def idle(self) -> bool:
        """True when no state change is queued or running."""
        return self._lane.idle

    @property
    def weights(self) -> np.ndarray | None:
        return self.table.weights if self.table is not None else None

    @property
    def rejected(self) -> int:
        """Gradients refused for holding NaN or infinity."""
        return self.stats.rejected

    def stats_snapshot(self) -> dict:
        """Everything :mod:`aps.stats` counts, as a JSON-able dict (see ``aps status``)."""
        stats, policy, window, config = self.stats, self.policy, self.policy.window, self.config
        version = self.version
        recent, mean = stats.update_rates(version)
        workers = []
        for rank, ws in enumerate(stats.workers):
            live = window.is_live(rank)
            newest, previous = window.arrivals(rank)
            interval = newest - previous
            workers.append(
                {
                    "rank": rank,
                    "live": live,
                    "clock": window.clock(rank),
                    "gap": window.gap(rank) if live else None,
                    "held": policy.is_held(rank),
                    "credit": window.credit(rank),
                    "pushes": ws.pushes,
                    "dropped": ws.dropped,
                    "rejected": ws.rejected,
                    "staleness_mean": ws.staleness.mean,
                    "staleness_hist": ws.staleness.to_dict(),
                    "pulls": ws.pulls,
                    "waits": ws.waits,
                    "wait_s_total": ws.wait_total,
                    "wait_s_mean": ws.wait_total / ws.pulls if ws.pulls else None,
                    "wait_s_max": ws.wait_max,
                    "r_star_hist": ws.r_star.to_dict(),
                    "release_gap_hist": ws.release_gap.to_dict(),
                    "max_release_gap": max(ws.release_gap.counts) if ws.release_gap.counts else None,
                    "last_interval_s": interval if interval == interval else None,  # NaN: fewer than 2 pushes
                }
            )
        return {
            "server": {
                "address": self.address,
                "sync": policy.describe(),
                "optimizer": self.table.optimizer.describe() if self.table is not None else config.optimizer,
                "workers": self.num_workers,
                "live": window.num_live,
                "started": self.started,
                "uptime_s": self._now() - stats.created,
                "version": version,
                "updates_per_s": recent,
                "updates_per_s_mean": mean,
                "pushes": self.pushes,
                "dropped": policy.dropped,
                "rejected": stats.rejected,
                "bytes_in": stats.bytes_in,
                "bytes_out": stats.bytes_out,
                "parameters": self.layout.numel if self.layout is not None else 0,
            },
            "workers": workers,
        }

    # Membership ------------------------------------------------------------
    def join(
        self,
        rank: int,
        num_workers: int,
        layout: Layout,
        values: np.ndarray,
        on_ready: ReadyCallback,
        on_error: ErrorCallback,
        *,
        grad: np.ndarray | None = None,
    ) -> Member:
        """Seat ``rank``; ``on_ready`` fires once training has started (at once on a rejoin).

        ``values`` are the worker's initial weights, used if it is the first
        to join. ``grad`` is where the worker's gradients will be (its shared
        segment, for the shared-memory transport); by default the engine
        allocates a buffer the transport receives into. Raises a ServerError
        (and seats nobody) when the rank or the worker count is wrong; a
        layout that differs from the model's is reported through ``on_error``.
        """
        if num_workers != self.num_workers:
            raise WorkerCountMismatch(
                f"the worker says num_workers={num_workers}, but this server runs --workers {self.num_workers}"
            )
        if not 0 <= rank < self.num_workers:
            raise RankOutOfRange(f"rank {rank} is out of range 0..{self.num_workers - 1}")
        if rank in self.members:
            raise RankTaken(f"rank {rank} is already connected")
        member = Member(rank)
        self.members[rank] = member
        self._lane.submit(_Call(lambda: self._commit_join(member, layout, values, grad, on_ready, on_error)))
        return member

    def leave(self, member: Member) -> None:
        """``member``'s connection is gone: it leaves the live set, nobody waits for it."""
        if not member.connected:
            return
        member.connected = False
        member.waiter = None
        self._waiting.pop(member.rank, None)
        if self.members.get(member.rank) is member:
            del self.members[member.rank]
        self._lane.submit(_Call(lambda: self._commit_leave(member)))

    def _commit_join(self, member, layout, values, grad, on_ready, on_error) -> None:
        if not member.connected:
            return
        try:
            if self.table is None:
                self._create_table(layout, values)
            else:
                difference = self.layout.difference(layout)
                if difference is not None:
                    raise LayoutMismatch(f"the model differs from the registered one: {difference}")
        except ServerError as exc:
            del self.members[member.rank]
            member.connected = False
            on_error(exc)
            return
        member.grad = np.zeros(self.layout.numel, np.float32) if grad is None else grad
        member.grad_bytes = memoryview(member.grad).cast("B")
        clock = self.policy.join(member.rank)
        member.joined = True
        member.required_version = self.decided_version
        log.info("worker %d joined at clock %d (%d/%d live)", member.rank, clock, self.policy.num_live, self.num_workers)
        self._wait(member, on_ready, gate=False)
        if not self.started and self.policy.num_live == self.num_workers:
            self.started = True
            self.stats.training_started = self._now()
            log.info("all %d workers joined: training starts", self.num_workers)
            self._serve_waiting()

    def _commit_leave(self, member: Member) -> None:
        if not member.joined:
            return
        member.joined = False
        outcome = self.policy.leave(member.rank)
        log.info("worker %d left (%d/%d live)", member.rank, self.policy.num_live, self.num_workers)
        self._after(outcome)

    def _create_table(self, layout: Layout, values: np.ndarray) -> None:
        if not self._kernels.all_finite(values):
            raise NonFiniteGradient("the initial weights hold NaN or infinity")
        config = self.config
        optimizer = make_optimizer(
            config.optimizer,
            layout.numel,
            lr=config.lr,
            momentum=config.momentum,
            nesterov=config.nesterov,
            weight_decay=config.weight_decay,
            betas=config.betas,
            eps=config.eps,
            kernels=self._kernels,
        )
        self.table = ParameterTable(layout, values, optimizer, self._allocate)
        self.layout = layout
        if self.policy.aggregates:
            self._aggregates = [np.zeros(layout.numel, np.float32), np.zeros(layout.numel, np.float32)]
        log.info(
            "model registered: %d tensors, %d parameters (%.1f MiB); %s; %s",
            len(layout),
            layout.numel,
            layout.nbytes / (1 << 20),
            self.policy.describe(),
            optimizer.describe(),
        )

    # Iterations ------------------------------------------------------------
    def pull(self, member: Member, on_ready: ReadyCallback) -> None:
        """Answer with the weights once the policy releases ``member``."""
        if not member.joined:
            raise NotInitialized("pull before init")
        self._wait(member, on_ready, gate=True)

    def push(
        self,
        member: Member,
        grad_version: int,
        on_done: Callable[[PushResult], None],
        on_error: ErrorCallback,
        *,
        stream: StreamingPush | None = None,
    ) -> None:
        """Handle the gradient in ``member.grad``, computed on weights of ``grad_version``.

        ``on_done`` gets the result once the gradient is committed (applied,
        accumulated or dropped); ``on_error`` gets the reason it was refused
        (nothing changed then). ``member.grad`` must stay untouched until then.
        The update kernel checks every element as it applies it: a gradient
        holding NaN or infinity is refused and changes nothing. ``stream`` is
        the update already computed while it arrived, if any.
        """
        try:
            self._check_push(member, grad_version)
        except ServerError:
            if stream is not None:
                stream.abort()
            raise
        job = _PushJob(self, member, grad_version, self._now(), on_done, on_error)
        if stream is not None:
            if stream.complete:
                # The update is computed and the lane was reserved for it all
                # along: commit in place of running the job's kernel.
                self._lane.unreserve(stream)
                job.plan, job.slot = stream.plan, stream.slot
                job.commit(True)
                return
            stream.abort()
        self._lane.submit(job)

    def begin_streaming_push(self, member: Member, grad_version: int) -> StreamingPush | None:
        """Start applying a gradient piece by piece as it arrives, when that is safe.

        Safe means: the lane is idle (it is reserved for this gradient; any
        other change cancels the reservation) and the gradient will be applied
        alone. Updates are transactions (next weights and next optimizer
        state are written aside), so a cancelled or refused gradient leaves
        nothing behind. Returns None otherwise; the gradient then takes the
        ordinary path.
        """
        table = self.table
        if table is None:
            return None
        try:
            self._check_push(member, grad_version)
        except ServerError:
            return None
        plan = self.policy.plan(member.rank, grad_version, table.version)
        if plan.kind is not PlanKind.APPLY:
            return None
        stream = StreamingPush(self, member, plan)
        if not self._lane.reserve(stream):
            return None
        stream.start()
        return stream

    def _check_push(self, member: Member, grad_version: int) -> None:
        if not member.joined:
            raise NotInitialized("push before init")
        if self.policy.is_held(member.rank):
            raise OutOfOrder(
                f"rank {member.rank} is held at the {self.policy.name} gate: pull before pushing again"
            )
        if grad_version > self.decided_version:
            raise OutOfOrder(
                f"the gradient claims weights of version {grad_version}, but the server is at {self.decided_version}"
            )

    # Internals -------------------------------------------------------------
    def _count_rejected(self, rank: int) -> None:
        self.stats.rejected += 1
        self.stats.workers[rank].rejected += 1

    def _wait(self, member: Member, on_ready: ReadyCallback, *, gate: bool) -> None:
        """Answer ``on_ready`` once ``member`` may go on (``gate``: a pull, counted in the stats)."""
        member.waiter = on_ready
        member.gate = gate
        member.waiting_since = None
        self._waiting[member.rank] = member
        if not self._try_serve(member) and gate:
            member.waiting_since = self._now()

    def _try_serve(self, member: Member) -> bool:
        if (
            not self.started
            or member.waiter is None
            or self.policy.is_held(member.rank)
            or self.table.version < member.required_version
        ):
            return False
        waiter, member.waiter = member.waiter, None
        del self._waiting[member.rank]
        if member.gate:
            ws = self.stats.workers[member.rank]
            ws.waited(0.0 if member.waiting_since is None else self._now() - member.waiting_since)
            ws.release_gap.add(self.policy.window.gap(member.rank))
        waiter(self.table.snapshot(), self.policy.clock(member.rank))
        return True

    def _serve_waiting(self) -> None:
        """Try every waiting worker (after a publish that waiters may need, or the start)."""
        if self._waiting:
            for member in list(self._waiting.values()):
                self._try_serve(member)

    def _after(self, outcome: Outcome) -> None:
        """Apply what a push or a leave changed: queue an aggregate update, serve the released."""
        if outcome.aggregate_scale is not None:
            self._pending_aggregates += 1
            self._lane.submit(_AggregateJob(self, outcome.aggregate_scale), front=True)
        if not outcome.released:
            return
        # A released worker must see every update decided so far.
        required = self.table.version + self._pending_aggregates
        members, waiting = self.members, self._waiting
        for rank in outcome.released:
            member = members.get(rank)
            if member is not None:
                member.required_version = required
                if rank in waiting:
                    self._try_serve(member)


class StreamingPush:
    """A gradient being applied piece by piece while it arrives.

    The transport calls :meth:`feed` as each piece lands; the update of that
    piece (and the next optimizer state) is written aside, into a fresh,
    unpublished slot. Finished, the
    push commits like any other (:meth:`Engine.push` with ``stream=``).
    Cancelled (the lane is needed elsewhere) or aborted (the gradient was
    refused, or the connection died), the slot is simply given back.
    """

    __slots__ = ("engine", "member", "plan", "slot", "w_in", "filled", "active")

    def __init__(self, engine: Engine, member: Member, plan: Plan) -> None:
        self.engine = engine
        self.member = member
        self.plan = plan
        self.slot = None
        self.w_in = None
        self.filled = 0
        self.active = False

    def start(self) -> None:
        table = self.engine.table
        self.slot = table.begin_update()
        self.w_in = table.current_array()
        self.active = True

    @property
    def complete(self) -> bool:
        return self.active and self.filled == len(self.member.grad)

    def feed(self, stop: int) -> None:
        """Elements ``[0, stop)`` of the gradient have arrived."""
        if self.active and stop > self.filled:
            ok = self.engine.table.optimizer.step_slice(
                self.slot.array, self.w_in, self.member.grad, self.plan.scale, self.filled, stop
            )
            self.filled = stop
            if not ok:  # the ordinary path will refuse it properly
                self.abort()

    def cancel(self) -> None:
        """Give the slot back (called by the lane, which has already dropped the reservation)."""
        if self.active:
            self.active = False
            self.engine.table.abandon(self.slot)

    def abort(self) -> None:
        """Give the slot back and free the lane."""
        self.cancel()
        self.engine._lane.unreserve(self)


class _PushJob(_Job):
    __slots__ = ("engine", "member", "grad_version", "now", "on_done", "on_error", "plan", "slot", "w_in")

    def __init__(self, engine, member, grad_version, now, on_done, on_error) -> None:
        self.engine = engine
        self.member = member
        self.grad_version = grad_version
        self.now = now
        self.on_done = on_done
        self.on_error = on_error
        self.plan: Plan | None = None
        self.slot = None
        self.w_in = None

    def prepare(self) -> int:
        table = self.engine.table
        plan = self.plan = self.engine.policy.plan(self.member.rank, self.grad_version, table.version)
        if plan.kind is PlanKind.APPLY:
            self.slot = table.begin_update()
            self.w_in = table.current_array()
        return len(self.member.grad)

    def run(self) -> bool:
        # One pass that reads each gradient element once and writes every
        # result aside: False means nothing changed (see aps/optim.py).
        engine, grad, plan = self.engine, self.member.grad, self.plan
        if plan.kind is PlanKind.APPLY:
            return engine.table.optimizer.step(self.slot.array, self.w_in, grad, plan.scale)
        if plan.kind is PlanKind.ACCUMULATE:
            current, spare = engine._aggregates
            return engine._kernels.accumulate(spare, current, grad, plan.scale, plan.first)
        return engine._kernels.all_finite(grad)

    def commit(self, result: object) -> None:
        engine = self.engine
        table = engine.table
        rank = self.member.rank
        if result is not True:
            if self.slot is not None:
                table.abandon(self.slot)
            engine._count_rejected(rank)
            if isinstance(result, BaseException):
                log.error("update for worker %d failed", rank, exc_info=result)
                self.on_error(InternalServerError(f"the update failed: {result}"))
            else:
                log.warning("worker %d: rejected a gradient holding NaN or infinity", rank)
                self.on_error(
                    NonFiniteGradient(
                        "the gradient holds NaN or infinity (or would make the weights overflow); "
                        "it was rejected and changed nothing"
                    )
                )
            return
        plan, policy = self.plan, engine.policy
        if plan.kind is PlanKind.APPLY:
            table.optimizer.commit()
            engine.stats.published(table.publish(self.slot))
        elif plan.kind is PlanKind.ACCUMULATE:
            engine._aggregates.reverse()
        window = policy.window
        consulted = window.controller_calls
        outcome = policy.commit(rank, plan, self.now)
        engine.pushes += 1
        ws = engine.stats.workers[rank]
        ws.pushes += 1
        dropped = plan.kind is PlanKind.DROP
        if dropped:
            ws.dropped += 1
        else:
            ws.staleness.add(plan.staleness)
        if window.controller_calls != consulted:
            ws.r_star.add(window.last_r_star)
        result = PushResult(table.version, policy.clock(rank), dropped, plan.staleness, plan.scale)
        engine._after(outcome)
        self.on_done(result)


class _AggregateJob(_Job):
    __slots__ = ("engine", "scale", "slot", "w_in")

    def __init__(self, engine: Engine, scale: float) -> None:
        self.engine = engine
        self.scale = scale
        self.slot = None
        self.w_in = None

    def prepare(self) -> int:
        table = self.engine.table
        self.slot = table.begin_update()
        self.w_in = table.current_array()
        return len(self.w_in)

    def run(self) -> bool:
        return self.engine.table.optimizer.step(self.slot.array, self.w_in, self.engine._aggregates[0], self.scale)

    def commit(self, result: object) -> None:
        engine = self.engine
        engine._pending_aggregates -= 1
        if result is True:
            engine.table.optimizer.commit()
            engine.stats.published(engine.table.publish(self.slot))
        else:
            engine.table.abandon(self.slot)
            if isinstance(result, BaseException):
                log.error("aggregate update failed; the round's gradients are lost", exc_info=result)
            else:
                log.error("the aggregated gradient would make the weights overflow: update skipped")
        engine.policy.aggregate_applied()
        engine._serve_waiting()
