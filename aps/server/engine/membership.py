"""Membership: who may join, at which rank and clock, when training starts, and what a
leave changes (docs/algorithms.md, "Elastic membership").

A part of the engine of its own because it is the one that seats and unseats: it
writes the :class:`~aps.server.engine.members.Roster` (members, seats, whether
training started, holds below MIN or drains), registers the model with the first
worker's values (:meth:`aps.server.engine.model.Model.create`), places a worker
that reconnects where it was (or where the checkpoint had it), and starts training
once the workers it waits for are there. Every join and leave is a job of the update
lane, so it happens in order with the gradients.

What it needs of training (hold a joining worker's INIT until it may go on, serve
the waiting once training starts or goes on, apply what a leave changed) goes
through :class:`Gate`, which training implements; durability hands it a
checkpoint's places through :meth:`Membership.resume`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Protocol

import numpy as np

from ...config import ServerConfig
from ...errors import InternalServerError, MalformedFrame, RankOutOfRange, RankTaken, ServerError, WorkerCountMismatch
from ...layout import Layout
from ...wire.protocol import ANY_RANK
from .lane import CallJob, Offload, UpdateLane
from .members import ErrorCallback, Member, ReadyCallback, Roster
from .model import Model, check_model
from .stats import ServerStats
from .sync import Outcome, SyncPolicy

__all__ = ["MAX_CLOCK", "Gate", "Membership", "Placements"]

MAX_CLOCK = 1 << 53  #: the largest clock a rejoining worker may say it had

log = logging.getLogger("aps.server")

#: Where each rank that was live in a checkpoint goes when it reconnects: ``{rank: (clock, held, credit)}``.
Placements = dict[int, tuple[int, bool, int]]


class Gate(Protocol):
    """What membership asks of training (:class:`aps.server.engine.training.Training`)."""

    @property
    def decided_version(self) -> int:
        """The version once every update decided so far is published: a joining worker's first weights."""

    @property
    def skips_lost_iterations(self) -> bool:
        """A rejoining rank of a shard resumed older goes on at its own clock (its lost iterations count)."""

    @property
    def rejoins_at_own_clock(self) -> bool:
        """A rank that reconnects goes on at the clock it had here, behind the round if it missed some."""

    def wait(self, member: Member, on_ready: ReadyCallback, *, gate: bool) -> None:
        """Answer ``on_ready`` once ``member`` may go on (``gate``: held by the policy, as a pull)."""

    def stop_waiting(self, rank: int) -> None:
        """``rank``'s worker left: nobody answers it."""

    def serve_waiting(self) -> None:
        """Answer every waiting worker that may go on now."""

    def after(self, outcome: Outcome) -> None:
        """Apply what a leave changed: an aggregate update to queue, workers released."""


class Membership:
    """Joins, leaves, the start and the quorum (see the module docstring).

    Args:
        config: the server's options (``--workers``, elastic MIN:MAX).
        model: the model (registered by the first worker that brings its values).
        roster: who is seated (written here only).
        policy: the sync policy (each rank's place in its window).
        stats: the counters (membership events, the start).
        lane: the update lane joins and leaves go through.
        gate: training, as membership sees it.
        now: monotonic clock (when training started).
        background: runs slow preparations off the loop (a spare slot for a worker joining a
            running model); None: slots are made when an update needs them.
    """

    def __init__(
        self,
        config: ServerConfig,
        model: Model,
        roster: Roster,
        policy: SyncPolicy,
        stats: ServerStats,
        lane: UpdateLane,
        gate: Gate,
        now: Callable[[], float],
        background: Offload | None = None,
    ) -> None:
        self.config = config
        self.model = model
        self.roster = roster
        self.policy = policy
        self.stats = stats
        self.lane = lane
        self.gate = gate
        #: The ranks there are (MAX of an elastic ``--workers MIN:MAX``) and the live workers
        #: training needs to start and to go on (MIN; all of them for a fixed size).
        self.num_workers = config.workers
        self.quorum = config.quorum
        #: Called with True when training holds because fewer than MIN workers are live
        #: (elastic), with False when enough are back (the server keeps a deadline).
        self.on_quorum: Callable[[bool], None] | None = None
        #: Called when a worker joins or leaves before training starts (the server
        #: then tells the workers waiting in INIT who has joined).
        self.on_membership_change: Callable[[], None] | None = None
        #: The run was taken up from a checkpoint: its live ranks return to their places.
        self.resumed = False
        self._now = now
        self._background = background
        # The worker sending the initial weights, while no model exists (see claim_registration),
        # and the joins that wait for its model.
        self._registrar: object | None = None
        self._registering_layout: Layout | None = None
        self._parked: list[Callable[[], None]] = []
        # Where each rank that was live in the checkpoint goes when it reconnects (resume).
        self._placements: Placements = {}
        # The ranks that must be back before training starts again (None: all of them).
        self._start_ranks: set[int] | None = None
        self._waited_out = False  # a resumed elastic run stopped waiting for its checkpoint's ranks
        self._left = 0  # leaves so far: each seat notes when its worker left (assign_rank)

    # The start -------------------------------------------------------------
    def join_progress(self) -> tuple[int, int, list[int]]:
        """Before training starts: how many of the workers it waits for have joined, how
        many it waits for, and the ranks still missing. A run resumed from a checkpoint
        waits for the ranks that were live in it; a new run, for all of them; an elastic
        run, for any MIN workers (no rank is missing then)."""
        joined = {rank for rank, member in self.roster.members.items() if member.joined}
        if self.config.elastic and (self._start_ranks is None or self._waited_out):
            return min(len(joined), self.quorum), self.quorum, []
        wanted = range(self.num_workers) if self._start_ranks is None else sorted(self._start_ranks)
        missing = [rank for rank in wanted if rank not in joined]
        return len(wanted) - len(missing), len(wanted), missing

    def _may_start(self) -> bool:
        if self.config.elastic and (self._start_ranks is None or self._waited_out):
            return sum(member.joined for member in self.roster.members.values()) >= self.quorum
        return not self.join_progress()[2]

    def give_up_waiting(self) -> None:
        """A resumed elastic run has waited long enough (``--quorum-timeout``) for the ranks live
        in its checkpoint: it starts with any MIN workers, now or when they are there."""
        if self.roster.started or not self.config.elastic or self._start_ranks is None:
            return
        self._waited_out = True
        missing = self.join_progress()[2]
        log.warning(
            "resumed elastic run: not every rank of the checkpoint came back in time; training goes on "
            "with any %d workers%s",
            self.quorum,
            f" (missing: {missing})" if missing else "",
        )
        if self._may_start():
            self._start()
        elif self.on_membership_change is not None:
            self.on_membership_change()

    def _start(self) -> None:
        self.roster.started = True
        self.policy.resuming = False
        self.stats.training_started = self._now()
        self.stats.start_version = self.model.version
        if not self.resumed and self.config.elastic:
            log.info(
                "%d workers joined (--workers %s): training starts",
                self.policy.num_live,
                self.config.describe_workers(),
            )
        elif not self.resumed:
            log.info("all %d workers joined: training starts", self.num_workers)
        else:
            log.info("%d workers back: training goes on from version %d", self.policy.num_live, self.model.version)
        if self.config.elastic and self._placements:
            # Ranks of the checkpoint not back yet come back as any worker that left does: at the
            # clock they had, unless every live worker has gone past it (_place).
            for rank, (clock, held, credit) in self._placements.items():
                seat = self.roster.seat(rank)
                seat.clock, seat.held, seat.credit = clock, held, credit
            self._placements.clear()
            self.policy.forget_restored()
        self.gate.serve_waiting()

    def waiting_to_start(self, member: Member) -> bool:
        """True while ``member`` has joined and its INIT waits for the others."""
        return not self.roster.started and member.joined and member.waiter is not None and not member.gate

    def resume(self, placements: Placements | None) -> None:
        """Go on from a checkpoint (durability restores it before anyone joins): each rank of
        ``placements`` returns to its clock, gate and DSSP credit, and training starts again
        once they are back. None: no checkpoint after all (its restore failed)."""
        self.resumed = placements is not None
        self._placements = placements or {}
        self._start_ranks = set(self._placements) or None

    # Joins -----------------------------------------------------------------
    def check_join(self, rank: int, num_workers: int, layout: Layout | None = None) -> None:
        """Raise the ServerError a join of ``rank`` would meet (worker count, rank, a
        rank taken, a layout other than the model's or the one being registered);
        linear in the layout's size. Transports call it before they read a
        joining worker's values. ``rank`` ANY_RANK asks for a free rank (see
        :meth:`assign_rank`); ``num_workers`` 0 takes the server's count; an elastic
        server takes any count up to MAX (a launcher's world size of the moment)."""
        if num_workers != 0 and (
            not 1 <= num_workers <= self.num_workers if self.config.elastic else num_workers != self.num_workers
        ):
            raise WorkerCountMismatch(
                f"the worker says num_workers={num_workers}, but this server runs --workers "
                f"{self.config.describe_workers()}"
            )
        if rank == ANY_RANK:
            self.assign_rank()  # (raises when every rank is taken)
        elif not 0 <= rank < self.num_workers:
            raise RankOutOfRange(f"rank {rank} is out of range 0..{self.num_workers - 1}")
        elif rank in self.roster.members:
            raise RankTaken(f"rank {rank} is already connected")
        expected = self.model.layout if self.model.layout is not None else self._registering_layout
        if layout is not None and expected is not None:
            check_model(expected, layout)

    def assign_rank(self) -> int:
        """A free rank for a worker that asks for any (``rank=None``): one never seated first,
        then the one that left longest ago; a rank a resumed run waits for is given last
        (its worker may still come back). Raises RankTaken when all are connected."""
        members = self.roster.members
        free = [rank for rank in range(self.num_workers) if rank not in members]
        if not free:
            raise RankTaken(
                f"every rank 0..{self.num_workers - 1} is connected: this server runs --workers "
                f"{self.config.describe_workers()}"
            )
        seats, placements = self.roster.seats, self._placements

        def order(rank: int) -> tuple[bool, int, int]:
            seat = seats.get(rank)
            return rank in placements, -1 if seat is None else seat.left, rank

        return min(free, key=order)

    def claim_registration(self, layout: Layout, owner: object) -> bool:
        """True when ``owner`` is to provide the initial weights: no model exists and
        nobody else is sending one. Until it joins (or :meth:`release_registration`),
        other joins of the same layout need no values: they wait for this one."""
        if self.model.table is not None or self._registrar is not None:
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
        if self.model.table is not None and self._background is not None:
            self.model.table.add_spare(self._background)  # the slot its lease will hold, made off the lane
        member = Member(rank)
        member.rejoin = rejoin
        member.rejoin_clock = clock if rejoin else -1
        self.roster.members[rank] = member
        self.lane.submit(
            CallJob(
                lambda: self._commit_join(member, layout, values, grad, on_ready, on_error),
                lambda exc: self._join_failed(member, exc, on_error),
            )
        )
        return member

    def _commit_join(
        self,
        member: Member,
        layout: Layout,
        values: np.ndarray | None,
        grad: np.ndarray | None,
        on_ready: ReadyCallback,
        on_error: ErrorCallback,
    ) -> None:
        if not member.connected:
            return
        model, roster = self.model, self.roster
        member.joined_running = roster.started and model.table is not None
        if model.table is None and values is None and self._registrar is not None:
            # Another worker is sending the initial weights: join once they are in.
            self._parked.append(lambda: self._commit_join(member, layout, values, grad, on_ready, on_error))
            return
        try:
            if model.layout is None:
                if values is None:
                    raise InternalServerError(
                        "the worker that was sending the initial weights left before they arrived: init again"
                    )
                model.create(layout, values)
                self._registrar = self._registering_layout = None
            else:
                check_model(model.layout, layout)
            if grad is None:
                grad = np.zeros(layout.numel, np.float32)
        except Exception as exc:  # refused (a ServerError), or out of memory and the like
            if not isinstance(exc, ServerError):
                log.error("could not seat worker %d", member.rank, exc_info=exc)
                exc = InternalServerError(f"the server could not seat rank {member.rank}: {type(exc).__name__}: {exc}")
            if roster.members.get(member.rank) is member:
                del roster.members[member.rank]
            member.connected = False
            on_error(exc)
            return
        member.grad = grad
        member.grad_bytes = memoryview(grad).cast("B")  # type: ignore[arg-type]  # numpy arrays are buffers; its stubs do not say so
        clock = self._place(member)
        member.joined = True
        member.required_version = self.gate.decided_version
        # The log line and the membership event say the same thing (docs/metrics.md).
        event = "rejoined" if member.rejoin else "joined"
        log.info(
            "worker %d %s at clock %d (%d/%d live)", member.rank, event, clock, self.policy.num_live, self.num_workers
        )
        self.stats.membership(member.rank, event, clock, self.policy.num_live)
        # A worker joining a BSP round that is under way waits for it to close (its first
        # weights are the round's update): the policy holds it, and so does its INIT.
        self.gate.wait(member, on_ready, gate=roster.started and self.policy.is_held(member.rank))
        if not roster.started and self._may_start():
            self._start()
        elif roster.started:
            self._check_quorum()
        elif not roster.started and self.on_membership_change is not None:
            self.on_membership_change()
        if self._parked:  # the model is in: the joins that waited for it go on
            parked, self._parked = self._parked, []
            for job in parked:
                job()

    def _join_failed(self, member: Member, exc: BaseException, on_error: ErrorCallback) -> None:
        """Seating ``member`` raised half-way: take back what was done, refuse the INIT."""
        answered = member.joined and member.waiter is None  # its INIT reply has gone out
        members = self.roster.members
        if member.joined:  # seated in the policy already: it leaves like any other
            self.leave(member)
        elif members.get(member.rank) is member:
            del members[member.rank]
            member.connected = False
        if answered:  # no second reply to one request: the worker learns at its next one
            return
        on_error(InternalServerError(f"the server could not seat rank {member.rank}: {type(exc).__name__}: {exc}"))

    def _place(self, member: Member) -> int:
        """Seat ``member`` in the policy; returns its clock. A worker that reconnects
        (``rejoin``) goes on where it was: at its place in the checkpoint the server
        resumed from, or at the clock, gate and DSSP credit it had when its connection
        went (unless every live worker has passed that clock). Anyone else (a new
        process for the rank) starts afresh at the slowest live clock, and its rank's
        last push is forgotten: its request ids start over."""
        rank, policy = member.rank, self.policy
        placement = self._placements.pop(rank, None)
        seat = self.roster.seats.get(rank)
        if not member.rejoin:
            if seat is not None:
                seat.push_id = seat.push_clock = -1
            return policy.join(rank)
        if placement is not None:
            if self.gate.skips_lost_iterations and member.rejoin_clock >= placement[0]:
                # docs/algorithms.md, "Sharded resume": the lost iterations count as done (nothing applied),
                # so every shard's gate orders the ranks alike. Not held: it had its last push's answer.
                return policy.join(rank, member.rejoin_clock, False, placement[2])
            return policy.join(rank, *placement)
        if seat is not None and self.gate.rejoins_at_own_clock:
            # docs/algorithms.md, "Sharded BSP across reconnects": the rounds that closed here without
            # it drop its next pushes, one each, so its iterations fall into the same rounds on every shard.
            return policy.join(rank, seat.clock, False, seat.credit)
        window = policy.window
        if seat is not None and seat.clock > window.min_clock:
            # (held only behind a live worker: the slowest clock of workers gone holds nobody)
            held = seat.held and window.bounded and window.num_live > 0 and seat.clock - window.min_clock > window.lower
            return policy.join(rank, seat.clock, held, seat.credit)
        return policy.join(rank)

    # Leaves ----------------------------------------------------------------
    def leave(self, member: Member, how: str = "disconnected") -> None:
        """``member``'s connection is gone: it leaves the live set, nobody waits for it.
        ``how``: "left" (it said so), "finished" (it said its training is done),
        "disconnected" or "timed out" (dropped by the server)."""
        if not member.connected:
            return
        member.connected = False
        member.waiter = None
        self.gate.stop_waiting(member.rank)
        members = self.roster.members
        if members.get(member.rank) is member:
            del members[member.rank]
        self.lane.submit(CallJob(lambda: self._commit_leave(member, how)))

    def _commit_leave(self, member: Member, how: str = "disconnected") -> None:
        member.keep_pulled(None)  # (here: after its pushes queued before it left)
        if not member.joined:
            return
        member.joined = False
        rank, policy, roster = member.rank, self.policy, self.roster
        window = policy.window
        seat = roster.seat(rank)
        seat.clock, seat.held, seat.credit = policy.clock(rank), window.is_held(rank), window.credit(rank)
        if self.resumed and not roster.started:
            # Resuming, before everyone is back: it returns to where the checkpoint had it.
            self._placements[rank] = (seat.clock, seat.held, seat.credit)
        seat.left = self._left = self._left + 1
        outcome = policy.leave(member.rank)
        log.info("worker %d %s (%d/%d live)", member.rank, how, policy.num_live, self.num_workers)
        if how == "finished" and self.config.elastic and not roster.draining:
            roster.draining = True
            log.info(
                "rank %d finished training: the run is ending, and fewer than MIN=%d live workers no longer "
                "hold the others",
                rank,
                self.quorum,
            )
        self.stats.membership(rank, how, seat.clock, policy.num_live)
        if not roster.started and self.on_membership_change is not None:
            self.on_membership_change()
        if roster.started:
            self._check_quorum()
        self.gate.after(outcome)

    def _check_quorum(self) -> None:
        """An elastic run holds every worker at the gate while fewer than MIN are live
        (docs/algorithms.md, "Elastic membership"), and goes on when enough are back."""
        roster = self.roster
        below = self.config.elastic and not roster.draining and self.policy.num_live < self.quorum
        if below == roster.below_quorum:
            return
        roster.below_quorum = below
        if below:
            log.warning(
                "only %d workers live, fewer than MIN=%d: training holds (every pull waits) until %d more join",
                self.policy.num_live,
                self.quorum,
                self.quorum - self.policy.num_live,
            )
        else:
            log.info("%d workers live again (MIN=%d): training goes on", self.policy.num_live, self.quorum)
        self.stats.quorum(below)
        if self.on_quorum is not None:
            self.on_quorum(below)
        if not below:
            self.gate.serve_waiting()
