"""The server's core without I/O: membership, the sync policy, releases.

Transports turn frames into calls on :class:`Engine` (``join``, ``pull``,
``push``, ``leave``) and get answers through callbacks. Keeping the core free
of sockets lets the tests drive every policy through random interleavings
directly, and the simulator run it on a virtual clock.

Ordering. Every change of state (a join, a leave, a gradient's plan and
commit, an aggregate update) goes through one FIFO, the update lane
(``aps._lane``), and runs in arrival order; the jobs that compute live in
``aps._updates`` and report back through the engine's
``gradient_committed``, ``gradient_refused`` and ``aggregate_committed``.
A pull is answered when the policy no longer holds its worker and the table
has published every update decided before the worker's release, so a worker
always sees its own updates.
"""

from __future__ import annotations

import logging
import time
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
from ._lane import CallJob, Offload, UpdateLane
from ._updates import Aggregate, AggregateJob, PushJob, StreamingPush
from .layout import Layout
from .optim import make_optimizer
from .stats import ServerStats
from .sync import Outcome, Plan, PlanKind, make_policy
from .table import ParameterTable, Snapshot

__all__ = ["Engine", "Member", "PushResult"]

log = logging.getLogger("aps.server")

#: ``on_ready(snapshot, clock)``: the worker is released; send it these weights.
ReadyCallback = Callable[[Snapshot, int], None]
ErrorCallback = Callable[[ServerError], None]


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
        "rank", "grad", "grad_bytes", "connected", "joined", "joined_running", "waiter", "gate", "waiting_since",
        "required_version",
    )

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.grad: np.ndarray | None = None
        self.grad_bytes: memoryview | None = None
        self.connected = True
        self.joined = False
        self.joined_running = False  # it joined a model that was already training
        self.waiter: ReadyCallback | None = None
        self.gate = False  # the pending request is a pull (counted), not an init
        self.waiting_since: float | None = None  # when its pull began to wait
        self.required_version = 0


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
        #: Called when a worker joins or leaves before training starts (the server
        #: then tells the workers waiting in INIT who has joined).
        self.on_membership_change: Callable[[], None] | None = None
        self.stats = ServerStats(config.workers, now)
        #: The native module or its reference twin: what the kernels run on.
        self.kernels = kernels
        #: The running sum of gradients (BSP, softsync), once the model exists.
        self.aggregate: Aggregate | None = None
        self._now = now
        self._allocate = allocate
        self._pending_aggregates = 0
        self._waiting: dict[int, Member] = {}
        # The worker sending the initial weights, while no model exists (see claim_registration),
        # and the joins that wait for its model.
        self._registrar: object | None = None
        self._registering_layout: Layout | None = None
        self._parked: list[Callable[[], None]] = []
        self._lane = UpdateLane(offload, offload_threshold)

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
        return self.stats.snapshot(self)

    def join_progress(self) -> tuple[int, list[int]]:
        """How many workers have joined, and the ranks that have not (before training starts)."""
        joined = {rank for rank, member in self.members.items() if member.joined}
        return len(joined), [rank for rank in range(self.num_workers) if rank not in joined]

    def waiting_to_start(self, member: Member) -> bool:
        """True while ``member`` has joined and its INIT waits for the others."""
        return not self.started and member.joined and member.waiter is not None and not member.gate

    # Membership ------------------------------------------------------------
    def check_join(self, rank: int, num_workers: int, layout: Layout | None = None) -> None:
        """Raise the ServerError a join of ``rank`` would meet (worker count, rank, a
        rank taken, a layout other than the model's or the one being registered);
        linear in the layout's size. Transports call it before they read a
        joining worker's values."""
        if num_workers != self.num_workers:
            raise WorkerCountMismatch(
                f"the worker says num_workers={num_workers}, but this server runs --workers {self.num_workers}"
            )
        if not 0 <= rank < self.num_workers:
            raise RankOutOfRange(f"rank {rank} is out of range 0..{self.num_workers - 1}")
        if rank in self.members:
            raise RankTaken(f"rank {rank} is already connected")
        expected = self.layout if self.layout is not None else self._registering_layout
        if layout is not None and expected is not None:
            difference = expected.difference(layout)
            if difference is not None:
                raise LayoutMismatch(f"the model differs from the registered one: {difference}")

    def claim_registration(self, layout: Layout, owner: object) -> bool:
        """True when ``owner`` is to provide the initial weights: no model exists and
        nobody else is sending one. Until it joins (or :meth:`release_registration`),
        other joins of the same layout need no values: they wait for this one."""
        if self.table is not None or self._registrar is not None:
            return False
        self._registrar, self._registering_layout = owner, layout
        return True

    def release_registration(self, owner: object) -> None:
        """``owner``'s values will not come (its INIT failed, its connection died)."""
        if self._registrar is owner:
            self._registrar = self._registering_layout = None
            parked, self._parked = self._parked, []
            for job in parked:
                job()  # with no model and nobody registering one, each is refused

    def join(
        self,
        rank: int,
        num_workers: int,
        layout: Layout,
        values: np.ndarray | None,
        on_ready: ReadyCallback,
        on_error: ErrorCallback,
        *,
        grad: np.ndarray | None = None,
    ) -> Member:
        """Seat ``rank``; ``on_ready`` fires once training has started (at once on a rejoin).

        ``values`` are the worker's initial weights, used if it is the first
        to join; None when the transport did not keep them (the model exists,
        or another worker's are on their way: this join then waits for it).
        ``grad`` is where the worker's gradients will be (its shared segment,
        for the shared-memory transport); by default the engine allocates a
        buffer the transport receives into. Raises a ServerError (and seats
        nobody) when the rank or the worker count is wrong; a layout that
        differs from the model's is reported through ``on_error``.
        """
        self.check_join(rank, num_workers)
        member = Member(rank)
        self.members[rank] = member
        self._lane.submit(CallJob(lambda: self._commit_join(member, layout, values, grad, on_ready, on_error),
                                  lambda exc: self._join_failed(member, exc, on_error)))
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
        self._lane.submit(CallJob(lambda: self._commit_leave(member)))

    def _commit_join(self, member, layout, values, grad, on_ready, on_error) -> None:
        if not member.connected:
            return
        member.joined_running = self.started and self.table is not None
        if self.table is None and values is None and self._registrar is not None:
            # Another worker is sending the initial weights: join once they are in.
            self._parked.append(lambda: self._commit_join(member, layout, values, grad, on_ready, on_error))
            return
        try:
            if self.table is None:
                if values is None:
                    raise InternalServerError(
                        "the worker that was sending the initial weights left before they arrived: init again"
                    )
                self._create_table(layout, values)
                self._registrar = self._registering_layout = None
            else:
                difference = self.layout.difference(layout)
                if difference is not None:
                    raise LayoutMismatch(f"the model differs from the registered one: {difference}")
            if grad is None:
                grad = np.zeros(self.layout.numel, np.float32)
        except Exception as exc:  # refused (a ServerError), or out of memory and the like
            if not isinstance(exc, ServerError):
                log.error("could not seat worker %d", member.rank, exc_info=exc)
                exc = InternalServerError(f"the server could not seat rank {member.rank}: {type(exc).__name__}: {exc}")
            if self.members.get(member.rank) is member:
                del self.members[member.rank]
            member.connected = False
            on_error(exc)
            return
        member.grad = grad
        member.grad_bytes = memoryview(grad).cast("B")
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
        elif not self.started and self.on_membership_change is not None:
            self.on_membership_change()
        if self._parked:  # the model is in: the joins that waited for it go on
            parked, self._parked = self._parked, []
            for job in parked:
                job()

    def _join_failed(self, member: Member, exc: BaseException, on_error: ErrorCallback) -> None:
        """Seating ``member`` raised half-way: take back what was done, refuse the INIT."""
        answered = member.joined and member.waiter is None  # its INIT reply has gone out
        if member.joined:  # seated in the policy already: it leaves like any other
            self.leave(member)
        elif self.members.get(member.rank) is member:
            del self.members[member.rank]
            member.connected = False
        if answered:  # no second reply to one request: the worker learns at its next one
            return
        on_error(InternalServerError(f"the server could not seat rank {member.rank}: {type(exc).__name__}: {exc}"))

    def _commit_leave(self, member: Member) -> None:
        if not member.joined:
            return
        member.joined = False
        outcome = self.policy.leave(member.rank)
        log.info("worker %d left (%d/%d live)", member.rank, self.policy.num_live, self.num_workers)
        if not self.started and self.on_membership_change is not None:
            self.on_membership_change()
        self._after(outcome)

    def _create_table(self, layout: Layout, values: np.ndarray) -> None:
        if not self.kernels.all_finite(values):
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
            kernels=self.kernels,
        )
        # Everything is allocated before anything is kept: a failure (out of
        # memory) leaves the server without a model, as before.
        table = ParameterTable(layout, values, optimizer, self._allocate)
        try:
            aggregate = Aggregate(layout.numel) if self.policy.aggregates else None
        except BaseException:
            table.close()
            raise
        self.table, self.layout, self.aggregate = table, layout, aggregate
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
        job = PushJob(self, member, grad_version, self._now(), on_done, on_error)
        if stream is not None:
            if stream.complete:
                # The update is computed and the lane was reserved for it all
                # along: commit in place of running the job's kernel.
                stream.finish(job)
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
        stream = StreamingPush(table, self._lane, member, plan)
        return stream if stream.start() else None

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

    # Reports from the update lane's jobs (aps._updates.UpdateOwner) -----------
    def gradient_committed(self, rank: int, plan: Plan, arrived: float) -> PushResult:
        """A gradient was applied (and published), accumulated or dropped."""
        policy, stats = self.policy, self.stats
        if plan.kind is PlanKind.APPLY:
            stats.published(self.table.version)
        window = policy.window
        consulted = window.controller_calls
        outcome = policy.commit(rank, plan, arrived)
        self.pushes += 1
        ws = stats.workers[rank]
        ws.pushes += 1
        dropped = plan.kind is PlanKind.DROP
        if dropped:
            ws.dropped += 1
        else:
            ws.staleness.add(plan.staleness)
        if window.controller_calls != consulted:
            ws.r_star.add(window.last_r_star)
        result = PushResult(self.table.version, policy.clock(rank), dropped, plan.staleness, plan.scale)
        self._after(outcome)
        return result

    def gradient_refused(self, rank: int, reason: object) -> ServerError:
        """A gradient's kernel refused it (``reason`` False), or its job failed (an
        exception at any step: nothing of it was adopted)."""
        self.stats.rejected += 1
        self.stats.workers[rank].rejected += 1
        if isinstance(reason, BaseException):
            cause = f"{type(reason).__name__}: {reason}"
            log.error("worker %d: its update failed and changed nothing (%s)", rank, cause)
            return InternalServerError(f"the update failed and changed nothing: {cause}")
        log.warning("worker %d: rejected a gradient holding NaN or infinity", rank)
        return NonFiniteGradient(
            "the gradient holds NaN or infinity (or would make the weights overflow); "
            "it was rejected and changed nothing"
        )

    def aggregate_committed(self, applied: bool) -> None:
        """An aggregate update finished; waiters may need its version."""
        self._pending_aggregates -= 1
        if applied:
            self.stats.published(self.table.version)
        else:  # the version its workers were promised will not come: the one before it will do
            decided = self.decided_version
            for member in self.members.values():
                member.required_version = min(member.required_version, decided)
        self.policy.aggregate_applied()
        self._serve_waiting()

    # Internals -------------------------------------------------------------

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
        try:
            waiter(self.table.snapshot(), self.policy.clock(member.rank))
        except Exception:  # one connection's failure must not keep the others waiting
            log.exception("answering worker %d failed", member.rank)
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
            self._lane.submit(AggregateJob(self, outcome.aggregate_scale), front=True)
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
