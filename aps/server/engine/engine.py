"""The server's core without I/O: membership, the sync policy, releases.

Transports turn frames into calls on :class:`Engine` (``join``, ``pull``,
``push``, ``leave``) and get answers through callbacks. Keeping the core free
of sockets lets the tests drive every policy through random interleavings
directly, and the simulator run it on a virtual clock.

Ordering. Every change of state (a join, a leave, a gradient's plan and
commit, an aggregate update) goes through one FIFO, the update lane
(``aps.server.engine.lane``), and runs in arrival order; the jobs that compute live in
``aps.server.engine.jobs.updates`` and report back through the engine's
``gradient_committed``, ``gradient_refused`` and ``aggregate_committed``.
A pull is answered when the policy no longer holds its worker and the table
has published every update decided before the worker's release, so a worker
always sees its own updates.
"""

from __future__ import annotations

import logging
import secrets
import time
import uuid
from collections.abc import Callable
from types import ModuleType

import numpy as np

from ... import _core
from ...config import ServerConfig, parse_compensation
from ...errors import (
    InternalServerError,
    LayoutMismatch,
    MalformedFrame,
    NonFiniteGradient,
    NotInitialized,
    OutOfOrder,
    RankOutOfRange,
    RankTaken,
    ServerError,
    TableMismatch,
    WorkerCountMismatch,
)
from .durable import Durable
from .lane import CallJob, Offload, UpdateLane
from .jobs.state import StateCopies
from .loads import Loads
from .jobs.updates import Aggregate, AggregateJob, PushJob, StreamingPush
from ...layout import Layout
from .compensation import Compensation
from .optim import HyperGroups, KernelThreads, default_kernel_threads, make_optimizer
from ...wire.protocol import ANY_RANK, HyperGroup
from .members import Member, PushResult, ReadyCallback, Seat
from .narrowing import NarrowedWeights
from .stats import EngineView, RankView, ServerStats, TableView
from .sync import CUTOFF, RESUMED, STALE, Outcome, Plan, PlanKind, make_policy
from .memory import TableMemory
from .rows import RowTable, Tables
from .scalars import Scalars
from .table import ParameterTable, Snapshot

__all__ = ["Engine", "Member", "PushResult", "Seat"]

MAX_CLOCK = 1 << 53  #: the largest clock a rejoining worker may say it had

log = logging.getLogger("aps.server")

ErrorCallback = Callable[[ServerError], None]


class Engine(Durable, Loads):
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
            :class:`aps.server.engine.table.HeapBlock`).
        background: runs slow preparations (a spare slot for a worker joining a
            running model) on a thread of their own and calls back on the loop;
            None: slots are made when an update needs them.
    """

    def __init__(
        self,
        config: ServerConfig,
        *,
        now: Callable[[], float] = time.monotonic,
        offload: Offload | None = None,
        offload_threshold: int = 1 << 22,
        kernels: ModuleType = _core,
        window_type: type | None = None,
        allocate: Callable[..., object] | None = None,
        background: Offload | None = None,
    ) -> None:
        self.config = config
        #: The ranks there are (MAX of an elastic ``--workers MIN:MAX``) and the live workers
        #: training needs to start and to go on (MIN; all of them for a fixed size).
        self.num_workers = config.workers
        self.quorum = config.quorum
        #: Called with True when training holds because fewer than MIN workers are live
        #: (elastic), with False when enough are back (the server keeps a deadline).
        self.on_quorum: Callable[[bool], None] | None = None
        #: Training holds: an elastic run has fewer than MIN live workers.
        self.below_quorum = False
        #: A worker left saying its training is done: the run is ending, MIN holds nobody.
        self.draining = False
        self.policy = make_policy(config, window_type or kernels.StalenessWindow)
        self.table: ParameterTable | None = None
        self.layout: Layout | None = None
        #: The bytes the tables' rows may take: --table-memory, or a share of the memory available now.
        self.table_memory = TableMemory.resolve(config.table_memory)
        #: The model's embedding tables: the rows pushed, by table name (aps.server.engine.rows).
        self.rows = Tables()
        self.members: dict[int, Member] = {}
        self.started = False
        self.pushes = 0
        #: Where the server listens (set by it): in the statistics, and kept in checkpoints as
        #: ``served_at`` (a server resumed from them asks there whether the run is still served).
        self.address = ""
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
        self._background = background
        self._pending_aggregates = 0
        # The values of the last gradient added to the open round (BSP, softsync): the
        # round's update is applied with them (None: the optimizer's own).
        self._round_hyper: HyperGroups | None = None
        self._waiting: dict[int, Member] = {}
        # The worker sending the initial weights, while no model exists (see claim_registration),
        # and the joins that wait for its model.
        self._registrar: object | None = None
        self._registering_layout: Layout | None = None
        self._parked: list[Callable[[], None]] = []
        self._lane = UpdateLane(offload, offload_threshold)
        #: This run's identity: new for a new model, kept across checkpoints and resumes.
        self.run_id = uuid.uuid4().hex
        #: This server's own identity within the run, drawn anew at every start, and the run's
        #: incarnations that led to it (its checkpoint's lineage, then its own; at most
        #: durable.MAX_LINEAGE, oldest first): workers refuse a server their last one is not an
        #: ancestor of (two servers of one run, one started from a copy of its checkpoints).
        self.incarnation = secrets.token_hex(8)
        self.lineage: list[str] = [self.incarnation]
        #: The run id of every shard of this model, in shard order, as a sharded worker recorded
        #: them (SHARDS): kept in checkpoints, so that shards resumed from the checkpoints of
        #: different runs are told apart. None until recorded (and when unsharded).
        self.shard_runs: list[str] | None = None
        #: The checkpoint this engine resumed from (its path), if any.
        self.resumed_from: str | None = None
        self._seats: dict[int, Seat] = {}
        self._waited_out = False  # a resumed elastic run stopped waiting for its checkpoint's ranks
        self._left = 0  # leaves so far: each seat notes when its worker left (assign_rank)
        #: The run's counters (CLAIM): name -> value, kept in checkpoints.
        self.counters: dict[str, int] = {}
        self.scalars = Scalars()  #: what the workers' training loops report (LOG)
        # Where each rank that was live in the checkpoint goes when it reconnects (resume).
        self._placements: dict[int, tuple[int, bool, int]] = {}
        # The ranks that must be back before training starts again (None: all of them).
        self._start_ranks: set[int] | None = None
        #: ``request_checkpoint(reason)`` -> a future of the path; set by a server that writes checkpoints.
        self.request_checkpoint: Callable[[str], object] | None = None
        #: ``request_rewind(version)`` -> a future of ``{"versions"|"rewound", "version"}``: the
        #: checkpoints this run can rewind to (version None), or a rewind to one of them (REWIND,
        #: docs/algorithms.md "Sharded resume"); set by a server that can restart itself.
        self.request_rewind: Callable[[int | None], object] | None = None
        #: Called with the new version when a round's update (BSP, softsync) is applied, before
        #: any worker is released into the next: the checkpointer takes a sharded BSP run's
        #: checkpoints there, so that every shard has them at the same rounds.
        self.on_round: Callable[[int], None] | None = None
        #: The weights rounded to 16 bits for compressed pulls (off the loop when large).
        self.narrowed = NarrowedWeights(kernels, background)
        #: The digest of the optimizer state loaded into this run (LOAD_STATE), if any: kept in
        #: checkpoints, so that loading the same state again is a no-op, not a refusal.
        self.loaded_state: bytes | None = None
        #: The digest of the weights loaded into this run (LOAD_WEIGHTS), if any: kept in
        #: checkpoints, so that every rank may load the same weights, once taken.
        self.loaded_weights: bytes | None = None
        #: Counts the loads: a state copy made before one is not the state after it.
        self.state_generation = 0
        #: The newest copy of the optimizer's state that a STATE reply still holds (aps.server.engine.jobs.state).
        self.state_copies = StateCopies()

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
    def skips_lost_iterations(self) -> bool:
        """Resumed older, this shard counts a rejoining rank's lost iterations as done (:meth:`_place`)."""
        return self.config.shards > 1 and self.policy.name != "bsp"

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
        """Everything :mod:`aps.server.engine.stats` counts, as a JSON-able dict (see ``aps status``)."""
        return self.stats.snapshot(self.view())

    def stats_totals(self) -> dict:
        """The few running totals the dashboard's history samples (``ServerStats.totals``)."""
        return self.stats.totals(self.version, self.policy.window.num_live)

    def view(self) -> EngineView:
        """What the statistics read of the engine, copied now (a read-only snapshot)."""
        policy, window, config, table = self.policy, self.policy.window, self.config, self.table
        ranks = []
        for rank in range(len(self.stats.workers)):
            live = window.is_live(rank)
            newest, previous = window.arrivals(rank)
            member = self.members.get(rank)
            ranks.append(RankView(
                live=live, clock=window.clock(rank), gap=window.gap(rank) if live else None,
                held=policy.is_held(rank), credit=window.credit(rank), newest=newest, previous=previous,
                connected=member is not None and member.connected, hyper=member.hyper if member is not None else None,
            ))
        return EngineView(
            address=self.address, shard=config.shard, shards=config.shards, sync=policy.describe(),
            optimizer=table.optimizer.describe() if table is not None else config.optimizer,
            defaults=table.optimizer.defaults if table is not None else None, workers=self.num_workers,
            live=window.num_live, started=self.started, version=self.version, pushes=self.pushes,
            dropped=policy.dropped, dropped_stale=policy.dropped_stale,
            dropped_cutoff=policy.dropped_cutoff, run_id=self.run_id,
            resumed_from=self.resumed_from, parameters=self.layout.numel if self.layout is not None else 0,
            ranks=tuple(ranks), min_workers=self.quorum, draining=self.draining, reports=self.scalars.newest(),
            warnings=tuple(self.scalars.warnings), tables=tuple(TableView(name=name, dim=rows.table.dim, optimizer=rows.table.optimizer, rows=len(rows),
                                   nbytes=rows.nbytes, rows_pulled=rows.rows_pulled, rows_pushed=rows.rows_pushed,
                                   rows_evicted=rows.rows_evicted) for name, rows in self.rows.items()),
            table_memory=(self.rows.used, self.table_memory.limit, self.table_memory.available),
        )

    def join_progress(self) -> tuple[int, int, list[int]]:
        """Before training starts: how many of the workers it waits for have joined, how
        many it waits for, and the ranks still missing. A run resumed from a checkpoint
        waits for the ranks that were live in it; a new run, for all of them; an elastic
        run, for any MIN workers (no rank is missing then)."""
        joined = {rank for rank, member in self.members.items() if member.joined}
        if self.config.elastic and (self._start_ranks is None or self._waited_out):
            return min(len(joined), self.quorum), self.quorum, []
        wanted = range(self.num_workers) if self._start_ranks is None else sorted(self._start_ranks)
        missing = [rank for rank in wanted if rank not in joined]
        return len(wanted) - len(missing), len(wanted), missing

    def _may_start(self) -> bool:
        if self.config.elastic and (self._start_ranks is None or self._waited_out):
            return sum(member.joined for member in self.members.values()) >= self.quorum
        return not self.join_progress()[2]

    def give_up_waiting(self) -> None:
        """A resumed elastic run has waited long enough (``--quorum-timeout``) for the ranks live
        in its checkpoint: it starts with any MIN workers, now or when they are there."""
        if self.started or not self.config.elastic or self._start_ranks is None:
            return
        self._waited_out = True
        missing = self.join_progress()[2]
        log.warning("resumed elastic run: not every rank of the checkpoint came back in time; training goes on "
                    "with any %d workers%s", self.quorum, f" (missing: {missing})" if missing else "")
        if self._may_start():
            self._start()
        elif self.on_membership_change is not None:
            self.on_membership_change()

    def _start(self) -> None:
        self.started = True
        self.policy.resuming = False
        self.stats.training_started = self._now()
        self.stats.start_version = self.version
        if self.resumed_from is None and self.config.elastic:
            log.info("%d workers joined (--workers %s): training starts", self.policy.num_live,
                     self.config.describe_workers())
        elif self.resumed_from is None:
            log.info("all %d workers joined: training starts", self.num_workers)
        else:
            log.info("%d workers back: training goes on from version %d", self.policy.num_live, self.version)
        if self.config.elastic and self._placements:
            # Ranks of the checkpoint not back yet come back as any worker that left does: at the
            # clock they had, unless every live worker has gone past it (_place).
            for rank, (clock, held, credit) in self._placements.items():
                seat = self._seat(rank)
                seat.clock, seat.held, seat.credit = clock, held, credit
            self._placements.clear()
            self.policy.forget_restored()
        self._serve_waiting()

    def waiting_to_start(self, member: Member) -> bool:
        """True while ``member`` has joined and its INIT waits for the others."""
        return not self.started and member.joined and member.waiter is not None and not member.gate

    # Membership ------------------------------------------------------------
    def check_join(self, rank: int, num_workers: int, layout: Layout | None = None) -> None:
        """Raise the ServerError a join of ``rank`` would meet (worker count, rank, a
        rank taken, a layout other than the model's or the one being registered);
        linear in the layout's size. Transports call it before they read a
        joining worker's values. ``rank`` ANY_RANK asks for a free rank (see
        :meth:`assign_rank`); ``num_workers`` 0 takes the server's count; an elastic
        server takes any count up to MAX (a launcher's world size of the moment)."""
        if num_workers != 0 and (not 1 <= num_workers <= self.num_workers if self.config.elastic
                                 else num_workers != self.num_workers):
            raise WorkerCountMismatch(
                f"the worker says num_workers={num_workers}, but this server runs --workers "
                f"{self.config.describe_workers()}"
            )
        if rank == ANY_RANK:
            self.assign_rank()  # (raises when every rank is taken)
        elif not 0 <= rank < self.num_workers:
            raise RankOutOfRange(f"rank {rank} is out of range 0..{self.num_workers - 1}")
        elif rank in self.members:
            raise RankTaken(f"rank {rank} is already connected")
        expected = self.layout if self.layout is not None else self._registering_layout
        if layout is not None and expected is not None:
            _check_model(expected, layout)

    def assign_rank(self) -> int:
        """A free rank for a worker that asks for any (``rank=None``): one never seated first,
        then the one that left longest ago; a rank a resumed run waits for is given last
        (its worker may still come back). Raises RankTaken when all are connected."""
        free = [rank for rank in range(self.num_workers) if rank not in self.members]
        if not free:
            raise RankTaken(f"every rank 0..{self.num_workers - 1} is connected: this server runs --workers "
                            f"{self.config.describe_workers()}")
        seats, placements = self._seats, self._placements

        def order(rank: int) -> tuple[bool, int, int]:
            seat = seats.get(rank)
            return rank in placements, -1 if seat is None else seat.left, rank

        return min(free, key=order)

    def claim_registration(self, layout: Layout, owner: object) -> bool:
        """True when ``owner`` is to provide the initial weights: no model exists and
        nobody else is sending one. Until it joins (or :meth:`release_registration`),
        other joins of the same layout need no values: they wait for this one."""
        if self.table is not None or self._registrar is not None:
            return False
        self._registrar, self._registering_layout = owner, layout
        return True

    @property
    def registering(self) -> bool:
        """A worker is sending the model's initial weights."""
        return self._registrar is not None

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
        rejoin: bool = False,
        clock: int = -1,
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
        ``rejoin``: the worker reconnects after losing its connection, and goes
        on from the clock it had (not the slowest worker's), which it says in ``clock`` (see :meth:`_place`).
        """
        if rank == ANY_RANK:
            rank, rejoin = self.assign_rank(), False
        self.check_join(rank, num_workers)
        if rejoin and clock > MAX_CLOCK:  # (the window's int64 arithmetic stays far from overflow)
            raise MalformedFrame(f"the rejoining INIT says clock {clock}; a clock is at most 2**53")
        if self.table is not None and self._background is not None:
            self.table.add_spare(self._background)  # the slot its lease will hold, made off the lane
        member = Member(rank)
        member.rejoin = rejoin
        member.rejoin_clock = clock if rejoin else -1
        self.members[rank] = member
        self._lane.submit(CallJob(lambda: self._commit_join(member, layout, values, grad, on_ready, on_error),
                                  lambda exc: self._join_failed(member, exc, on_error)))
        return member

    def leave(self, member: Member, how: str = "disconnected") -> None:
        """``member``'s connection is gone: it leaves the live set, nobody waits for it.
        ``how``: "left" (it said so), "disconnected" or "timed out" (dropped by the server)."""
        if not member.connected:
            return
        member.connected = False
        member.waiter = None
        self._waiting.pop(member.rank, None)
        if self.members.get(member.rank) is member:
            del self.members[member.rank]
        self._lane.submit(CallJob(lambda: self._commit_leave(member, how)))

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
                _check_model(self.layout, layout)
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
        clock = self._place(member)
        member.joined = True
        member.required_version = self.decided_version
        # The log line and the membership event say the same thing (docs/metrics.md).
        event = "rejoined" if member.rejoin else "joined"
        log.info("worker %d %s at clock %d (%d/%d live)", member.rank, event, clock, self.policy.num_live,
                 self.num_workers)
        self.stats.membership(member.rank, event, clock, self.policy.num_live)
        # A worker joining a BSP round that is under way waits for it to close (its first
        # weights are the round's update): the policy holds it, and so does its INIT.
        self._wait(member, on_ready, gate=self.started and self.policy.is_held(member.rank))
        if not self.started and self._may_start():
            self._start()
        elif self.started:
            self._check_quorum()
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

    def _commit_leave(self, member: Member, how: str = "disconnected") -> None:
        member.keep_pulled(None)  # (here: after its pushes queued before it left)
        if not member.joined:
            return
        member.joined = False
        rank, policy = member.rank, self.policy
        window = policy.window
        seat = self._seat(rank)
        seat.clock, seat.held, seat.credit = policy.clock(rank), window.is_held(rank), window.credit(rank)
        if self.resumed_from is not None and not self.started:
            # Resuming, before everyone is back: it returns to where the checkpoint had it.
            self._placements[rank] = (seat.clock, seat.held, seat.credit)
        seat.left = self._left = self._left + 1
        outcome = self.policy.leave(member.rank)
        log.info("worker %d %s (%d/%d live)", member.rank, how, self.policy.num_live, self.num_workers)
        if how == "finished" and self.config.elastic and not self.draining:
            self.draining = True
            log.info("rank %d finished training: the run is ending, and fewer than MIN=%d live workers no longer "
                     "hold the others", rank, self.quorum)
        self.stats.membership(rank, how, seat.clock, self.policy.num_live)
        if not self.started and self.on_membership_change is not None:
            self.on_membership_change()
        if self.started:
            self._check_quorum()
        self._after(outcome)

    def _check_quorum(self) -> None:
        """An elastic run holds every worker at the gate while fewer than MIN are live
        (docs/algorithms.md, "Elastic membership"), and goes on when enough are back."""
        below = self.config.elastic and not self.draining and self.policy.num_live < self.quorum
        if below == self.below_quorum:
            return
        self.below_quorum = below
        if below:
            log.warning("only %d workers live, fewer than MIN=%d: training holds (every pull waits) until %d more "
                        "join", self.policy.num_live, self.quorum, self.quorum - self.policy.num_live)
        else:
            log.info("%d workers live again (MIN=%d): training goes on", self.policy.num_live, self.quorum)
        self.stats.quorum(below)
        if self.on_quorum is not None:
            self.on_quorum(below)
        if not below:
            self._serve_waiting()

    def _place(self, member: Member) -> int:
        """Seat ``member`` in the policy; returns its clock. A worker that reconnects
        (``rejoin``) goes on where it was: at its place in the checkpoint the server
        resumed from, or at the clock, gate and DSSP credit it had when its connection
        went (unless every live worker has passed that clock). Anyone else (a new
        process for the rank) starts afresh at the slowest live clock, and its rank's
        last push is forgotten: its request ids start over."""
        rank, policy = member.rank, self.policy
        placement = self._placements.pop(rank, None)
        seat = self._seats.get(rank)
        if not member.rejoin:
            if seat is not None:
                seat.push_id = seat.push_clock = -1
            return policy.join(rank)
        if placement is not None:
            if self.skips_lost_iterations and member.rejoin_clock >= placement[0]:
                # docs/algorithms.md, "Sharded resume": the lost iterations count as done (nothing applied),
                # so every shard's gate orders the ranks alike. Not held: it had its last push's answer.
                return policy.join(rank, member.rejoin_clock, False, placement[2])
            return policy.join(rank, *placement)
        window = policy.window
        if seat is not None and seat.clock > window.min_clock:
            # (held only behind a live worker: the slowest clock of workers gone holds nobody)
            held = (seat.held and window.bounded and window.num_live > 0
                    and seat.clock - window.min_clock > window.lower)
            return policy.join(rank, seat.clock, held, seat.credit)
        return policy.join(rank)

    def _seat(self, rank: int) -> Seat:
        seat = self._seats.get(rank)
        if seat is None:
            seat = self._seats[rank] = Seat()
        return seat

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
            threads=KernelThreads(config.kernel_threads or default_kernel_threads()),
        )
        # Everything is allocated before anything is kept: a failure (out of
        # memory) leaves the server without a model, as before.
        table = ParameterTable(layout, values, optimizer, self._allocate)
        kind, lam = parse_compensation(config.compensation)
        if kind != "none":
            try:
                table.compensation = Compensation(kind, lam, layout.numel, self.kernels)
            except BaseException:
                table.close()
                raise
        try:
            aggregate = Aggregate(layout.numel) if self.policy.aggregates else None
        except BaseException:
            table.close()
            raise
        self.table, self.layout, self.aggregate = table, layout, aggregate
        self.rows = Tables(((name, RowTable(name, declared, kernels=self.kernels)) for name, declared in layout.tables),
                           memory=self.table_memory, max_reply=self.config.max_frame_bytes)
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
        request_id: int | None = None,
        clock: int | None = None,
        rows: list | None = None,
        dense: bool = True,
    ) -> None:
        """Handle the gradient in ``member.grad``, computed on weights of ``grad_version``.

        ``on_done`` gets the result once the gradient is committed (applied,
        accumulated or dropped); ``on_error`` gets the reason it was refused
        (nothing changed then). ``member.grad`` must stay untouched until then.
        The update kernel checks every element as it applies it: a gradient
        holding NaN or infinity is refused and changes nothing. ``stream`` is
        the update already computed while it arrived, if any.

        ``request_id`` and ``clock`` identify the push (the worker's request id,
        and its clock when it sent it): the same push sent again after a lost
        reply is answered with the first one's result and applied only once.

        ``rows``: the rows it pushes to the model's tables (sections checked by
        ``Tables.check``), taken or dropped with the dense gradient, in one
        transaction; ``dense`` False: it carries no dense gradient (rows alone).
        """
        if self._is_duplicate(member, request_id, clock):
            if stream is not None:
                stream.abort()
            self._lane.submit(CallJob(lambda: self._answer_duplicate(member, on_done)))
            return
        member.push_id, member.push_clock = request_id, clock
        try:
            self._check_push(member, grad_version)
        except ServerError:
            if stream is not None:
                stream.abort()
            raise
        job = PushJob(self, member, grad_version, self._now(), on_done, on_error, self._gradient_clock(member, clock),
                      rows, dense)
        if stream is not None:
            if stream.complete:
                # The update is computed and the lane was reserved for it all
                # along: commit in place of running the job's kernel.
                stream.finish(job)
                return
            stream.abort()
        self._lane.submit(job)

    def is_duplicate(self, member: Member, request_id: int | None, clock: int | None) -> bool:
        """Whether this push was taken already (sent again after a lost reply: it will be
        answered, not applied)."""
        return self._is_duplicate(member, request_id, clock)

    def begin_streaming_push(
        self, member: Member, grad_version: int, request_id: int | None = None, clock: int | None = None
    ) -> StreamingPush | None:
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
        if self._is_duplicate(member, request_id, clock):
            return None
        try:
            self._check_push(member, grad_version)
        except ServerError:
            return None
        plan = self.policy.plan(member.rank, grad_version, table.version, self._gradient_clock(member, clock))
        if plan.kind is not PlanKind.APPLY or table.compensation is not None:
            return None  # (compensated: the whole gradient is compensated first, then applied)
        stream = StreamingPush(table, self._lane, member, plan)
        return stream if stream.start() else None

    def set_hyperparameters(self, member: Member, groups: list[HyperGroup], *, check_only: bool = False) -> None:
        """Apply ``member``'s following pushes with ``groups``' values, range by range,
        until it sets others (docs/protocol.md, HYPER).

        Its previous request is answered, so no push of it is in the lane: the
        pushes that see these values are exactly the ones sent after them.

        Raises:
            NotInitialized: ``member`` has not joined.
            InvalidHyperparameters: a value or a stop is refused (see
                :meth:`aps.server.engine.optim.Optimizer.check_groups`); nothing changed.
        """
        if not member.joined or self.table is None:
            raise NotInitialized("HYPER before a successful INIT: the groups are checked against the model")
        checked = self.table.optimizer.check_groups(groups)
        if not check_only:  # (Flag.CHECK: a sharded worker asks every shard before it sets any)
            self.table.optimizer.allocate_for(checked)  # momentum asked of a server started without
            member.hyper = checked

    @staticmethod
    def _gradient_clock(member: Member, clock: int | None) -> int:
        """The iteration a push was computed in, for the policy's bound: on a connection that
        rejoined, the clock its header carries (the push may have been computed before the
        connection went: aps.Worker sends it again with its first clock); else -1, the rank's
        own clock at the server, which is exact for every push computed on weights this
        connection received. The window takes a claim at most at the rank's clock."""
        return clock if member.rejoin and clock is not None and clock >= 0 else -1

    def _check_push(self, member: Member, grad_version: int) -> None:
        if not member.joined:
            raise NotInitialized("push before init")
        if self.policy.is_held(member.rank):
            raise OutOfOrder(
                f"rank {member.rank} is held at the {self.policy.name} gate: pull before pushing again"
            )
        if grad_version > self.decided_version and not (member.rejoin and self.skips_lost_iterations):
            # (else the policy drops it and counts its iteration: docs/algorithms.md, "Sharded resume")
            raise OutOfOrder(
                f"the gradient claims weights of version {grad_version}, but the server is at {self.decided_version}"
            )

    # Reports from the update lane's jobs (aps.server.engine.lane.UpdateOwner) -----------
    def weights_pushed_on(self, member: Member, version: int) -> Snapshot | None:
        """A lease on the weights of ``version`` that ``member`` was given (the ones its
        gradient was computed on: delay compensation), or None when they were not kept."""
        pulled = member.pulled
        return pulled.again() if pulled is not None and pulled.version == version else None

    def gradient_compensated(self, member: Member, version: int, compensated: bool) -> None:
        ws = self.stats.workers[member.rank]
        if compensated:
            ws.compensated += 1
            return
        ws.uncompensated += 1
        if ws.uncompensated == 1 or ws.uncompensated % 1000 == 0:  # (not a line per push)
            log.warning("worker %d: its gradient was computed on version %d, whose weights the server did not keep "
                        "for it: applied without compensation (%d so far)", member.rank, version, ws.uncompensated)

    def _let_go_of_old_weights(self) -> None:
        """The weights a worker was given that are more than --staleness-cutoff versions old:
        a gradient computed on them is dropped, so they are not kept for it."""
        if self.table.compensation is None or self.config.staleness_cutoff is None:
            return
        oldest = self.table.version - self.config.staleness_cutoff
        for member in self.members.values():
            if member.pulled is not None and member.pulled.version < oldest:
                member.keep_pulled(None)

    def gradient_committed(self, member: Member, plan: Plan, arrived: float,
                           hyper: HyperGroups | None = None) -> PushResult:
        """A gradient was applied (and published), accumulated or dropped (``hyper``: the
        values it came with; the round it was added to is applied with the last ones)."""
        policy, stats, rank = self.policy, self.stats, member.rank
        if plan.kind is PlanKind.APPLY:
            stats.published(self.table.version)
            self._let_go_of_old_weights()
        elif plan.kind is PlanKind.ACCUMULATE:
            self._round_hyper = hyper
        window = policy.window
        consulted = window.controller_calls
        outcome = policy.commit(rank, plan, arrived)
        self.pushes += 1
        ws = stats.workers[rank]
        ws.pushes += 1
        dropped = plan.kind is PlanKind.DROP
        if dropped:
            ws.dropped += 1
            if plan.reason == RESUMED:
                ws.dropped_resumed += 1
                log.warning("worker %d: its gradient was computed on weights newer than this shard's (version %d: "
                            "it resumed from an older checkpoint): dropped, its iteration counted", rank,
                            self.table.version)
            elif plan.reason == STALE:
                ws.dropped_stale += 1
                log.warning("worker %d: its gradient (computed on version %d, %d versions ago, before it "
                            "reconnected) is older than the %s bound allows: dropped, not applied; it goes on from "
                            "the newest weights", rank, self.table.version - plan.staleness, plan.staleness,
                            policy.name)
            elif plan.reason == CUTOFF:
                ws.dropped_cutoff += 1
                if ws.dropped_cutoff == 1 or ws.dropped_cutoff % 1000 == 0:  # (not a line per push)
                    log.info("worker %d: a gradient %d versions old, beyond --staleness-cutoff %d: dropped (%d so "
                             "far from this worker)", rank, plan.staleness, self.config.staleness_cutoff,
                             ws.dropped_cutoff)
        else:
            ws.staleness.add(plan.staleness)
        if window.controller_calls != consulted:
            ws.r_star.add(window.last_r_star)
        result = PushResult(self.table.version, policy.clock(rank), dropped, plan.staleness, plan.scale)
        seat = self._seat(rank)
        seat.push_id = -1 if member.push_id is None else member.push_id
        seat.push_clock = -1 if member.push_clock is None else member.push_clock
        seat.result = result
        self._after(outcome)
        return result

    def _is_duplicate(self, member: Member, request_id: int | None, clock: int | None) -> bool:
        """The push is one ``member`` sent before it reconnected, and it was committed then
        (only a worker that reconnected can send a push again)."""
        if not (member.rejoin and member.joined):
            return False
        seat = self._seats.get(member.rank)
        return seat is not None and seat.is_duplicate(request_id, clock)

    def _answer_duplicate(self, member: Member, on_done: Callable[[PushResult], None]) -> None:
        """A push committed already came again: answer as the first time, apply nothing."""
        if not member.connected:
            return
        first = self._seats[member.rank].result
        log.info("worker %d sent a push again that was applied already (its reply was lost): not applied twice",
                 member.rank)
        self.stats.duplicates += 1
        outcome = self.policy.resume_push(member.rank)
        on_done(PushResult(self.table.version, self.policy.clock(member.rank), first.dropped, first.staleness,
                           first.scale))
        self._after(outcome)

    def gradient_refused(self, rank: int, reason: object) -> ServerError:
        """A gradient's kernel refused it (``reason`` False), or its job failed (an
        exception at any step: nothing of it was adopted)."""
        self.stats.rejected += 1
        self.stats.workers[rank].rejected += 1
        if isinstance(reason, ServerError):  # (a row of a table refused: said as it is)
            return reason
        if isinstance(reason, BaseException):
            cause = f"{type(reason).__name__}: {reason}"
            log.error("worker %d: its update failed and changed nothing (%s)", rank, cause)
            return InternalServerError(f"the update failed and changed nothing: {cause}")
        return NonFiniteGradient(
            "the gradient holds NaN or infinity (or would make the weights overflow); "
            "it was rejected and changed nothing"
        )

    def aggregate_committed(self, applied: bool) -> None:
        """An aggregate update finished; waiters may need its version."""
        self._pending_aggregates -= 1
        if applied:
            self.stats.published(self.table.version)
            self._let_go_of_old_weights()
        else:  # the version its workers were promised will not come: the one before it will do
            decided = self.decided_version
            for member in self.members.values():
                member.required_version = min(member.required_version, decided)
        self.policy.aggregate_applied()
        if applied and self.on_round is not None:
            self.on_round(self.table.version)  # before anyone is released into the next round
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
            or (member.gate and (self.below_quorum or self.policy.is_held(member.rank)))
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
            # The rows asked for are read in the same step as the weights: one gate decision for both.
            if member.rows_wanted is not None:
                wanted, member.rows_wanted = member.rows_wanted, None
                try:
                    member.rows_out = self.rows.pull(wanted, member.rows_room)
                except Exception as exc:  # (out of memory, say): the reply says so, nobody waits
                    log.exception("reading the rows worker %d asked for failed", member.rank)
                    member.rows_out = exc
            snapshot = self.table.snapshot()
            if self.table.compensation is not None and member.dense_wanted:
                member.keep_pulled(snapshot.again())  # what its next gradient is computed on
            waiter(snapshot, self.policy.clock(member.rank))
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
            hyper, self._round_hyper = self._round_hyper, None
            self._lane.submit(AggregateJob(self, outcome.aggregate_scale, hyper), front=True)
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


def _check_model(model: Layout, joining: Layout) -> None:
    """Raise unless a joining worker's model is the run's: its tensors (LayoutMismatch)
    and its tables (TableMismatch, naming the table and the field), saying what the server
    holds and what to do."""
    names = [name for name, _ in model.tables]
    tables = ", ".join(names[:5]) + (" ..." if len(names) > 5 else "")
    held = (f"this server holds another model already ({len(model)} tensors, {model.numel} parameters, "
            f"{f'tables {tables}' if tables else 'no tables'})")
    try:
        model.require_same(joining, f"{held}; this model's tensors differ", f"{held}; this model's tables differ")
    except (LayoutMismatch, TableMismatch) as exc:
        raise type(exc)(f"{exc}. Start a fresh server (aps serve) for a new model; the workers of this "
                        "server's run init with the model it holds") from None
