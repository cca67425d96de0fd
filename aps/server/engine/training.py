"""Training: the iterations' requests (pull, push, HYPER) and what follows each one.

A part of the engine of its own because it is the path every iteration takes,
and the only one the update lane's gradient jobs report to: it implements their
:class:`~aps.server.engine.jobs.updates.UpdateOwner`. A push is checked, planned
at its turn by the sync policy, computed by a job, and committed here (counted,
its rank's seat told, whoever it releases served); a push sent again after a
lost reply is answered from its seat and applied once; a pull waits here until
the policy no longer holds its worker and the table has published every update
decided before the worker's release, so a worker always sees its own updates.

It reads who is seated from the :class:`~aps.server.engine.members.Roster` and
seats nobody: membership does (:mod:`aps.server.engine.membership`), and asks
this part to hold a joining worker's INIT, serve the waiting and apply what a
leave changed, through the :class:`~aps.server.engine.membership.Gate` it
implements.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from types import ModuleType

from ...config import ServerConfig
from ...errors import InternalServerError, NonFiniteGradient, NotInitialized, OutOfOrder, ServerError
from ...wire.protocol import HyperGroup
from .jobs.updates import Aggregate, AggregateJob, PushJob, StreamingPush
from .lane import CallJob, UpdateLane
from .members import ErrorCallback, Member, PushResult, ReadyCallback, Roster
from .model import Model
from .optim import HyperGroups
from .rows import Tables
from .stats import ServerStats
from .sync import CUTOFF, RESUMED, STALE, Outcome, Plan, PlanKind, SyncPolicy
from .table import ParameterTable, Snapshot

__all__ = ["Training"]

log = logging.getLogger("aps.server")


class Training:
    """Pulls, pushes and the waiting workers (see the module docstring).

    Args:
        config: the server's options.
        model: the model trained (its table exists before any push or pull is taken).
        roster: who is seated (read; membership writes it).
        policy: the sync policy.
        stats: the counters.
        lane: the update lane every gradient goes through.
        now: monotonic clock for push arrival times and waits.
    """

    def __init__(
        self,
        config: ServerConfig,
        model: Model,
        roster: Roster,
        policy: SyncPolicy,
        stats: ServerStats,
        lane: UpdateLane,
        now: Callable[[], float],
    ) -> None:
        self.config = config
        self.model = model
        self.roster = roster
        self.policy = policy
        self.stats = stats
        self.lane = lane
        self.kernels: ModuleType = model.kernels
        #: Gradients committed (applied, accumulated or dropped) in this run: kept in checkpoints.
        self.pushes = 0
        #: Called with the new version when a round's update (BSP, softsync) is applied, before
        #: any worker is released into the next: the checkpointer takes a sharded BSP run's
        #: checkpoints there, so that every shard has them at the same rounds.
        self.on_round: Callable[[int], None] | None = None
        self._now = now
        self._pending_aggregates = 0
        # The values of the last gradient added to the open round (BSP, softsync): the
        # round's update is applied with them (None: the optimizer's own).
        self._round_hyper: HyperGroups | None = None
        self._waiting: dict[int, Member] = {}

    # What the jobs compute with (UpdateOwner) ---------------------------------
    @property
    def table(self) -> ParameterTable:
        """The model's weights table: training takes requests only once it exists."""
        table = self.model.table
        assert table is not None, "training takes requests once the model exists"
        return table

    @property
    def aggregate(self) -> Aggregate | None:
        return self.model.aggregate

    @property
    def rows(self) -> Tables:
        return self.model.rows

    @property
    def decided_version(self) -> int:
        """The version once every update decided so far is published."""
        return self.model.version + self._pending_aggregates

    @property
    def skips_lost_iterations(self) -> bool:
        """Resumed older, this shard counts a rejoining rank's lost iterations as done
        (``Membership._place``; docs/algorithms.md, "Sharded resume")."""
        return self.config.shards > 1 and self.policy.name != "bsp"

    @property
    def rejoins_at_own_clock(self) -> bool:
        """A reconnecting rank goes on at its own clock (``Membership._place``): a shard of a sharded
        BSP run, where the rounds it missed must be the same on every shard (docs/algorithms.md,
        "Sharded BSP across reconnects")."""
        return self.config.shards > 1 and self.policy.name == "bsp"

    # Iterations ------------------------------------------------------------
    def pull(self, member: Member, on_ready: ReadyCallback) -> None:
        """Answer with the weights once the policy releases ``member``."""
        if not member.joined:
            raise NotInitialized("pull before init")
        self.wait(member, on_ready, gate=True)

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
        skip: bool = False,
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
        transaction; ``dense`` False: it carries no dense gradient (rows alone). ``skip``: it
        carries nothing: its worker takes no part in the open BSP round (Flag.SKIP,
        ``SyncPolicy.plan_skip``).
        """
        if self.is_duplicate(member, request_id, clock):
            if stream is not None:
                stream.abort()
            self.lane.submit(CallJob(lambda: self._answer_duplicate(member, on_done)))
            return
        member.push_id, member.push_clock = request_id, clock
        try:
            self._check_push(member, grad_version)
        except ServerError:
            if stream is not None:
                stream.abort()
            raise
        computed_in = self._gradient_clock(member, clock)
        job = PushJob(self, member, grad_version, self._now(), on_done, on_error, computed_in, rows, dense, skip)
        if stream is not None:
            if stream.complete:
                # The update is computed and the lane was reserved for it all
                # along: commit in place of running the job's kernel.
                stream.finish(job)
                return
            stream.abort()
        self.lane.submit(job)

    def is_duplicate(self, member: Member, request_id: int | None, clock: int | None) -> bool:
        """Whether this push was taken already: one ``member`` sent before it reconnected, and
        committed then (only a worker that reconnected can send a push again); it will be
        answered, not applied."""
        if not (member.rejoin and member.joined):
            return False
        seat = self.roster.seats.get(member.rank)
        return seat is not None and seat.is_duplicate(request_id, clock)

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
        table = self.model.table
        if table is None:
            return None
        if self.is_duplicate(member, request_id, clock):
            return None
        try:
            self._check_push(member, grad_version)
        except ServerError:
            return None
        plan = self.policy.plan(member.rank, grad_version, table.version, self._gradient_clock(member, clock))
        if plan.kind is not PlanKind.APPLY or table.compensation is not None:
            return None  # (compensated: the whole gradient is compensated first, then applied)
        stream = StreamingPush(table, self.lane, member, plan)
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
        table = self.model.table
        if not member.joined or table is None:
            raise NotInitialized("HYPER before a successful INIT: the groups are checked against the model")
        checked = table.optimizer.check_groups(groups)
        if not check_only:  # (Flag.CHECK: a sharded worker asks every shard before it sets any)
            table.optimizer.allocate_for(checked)  # momentum asked of a server started without
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
            raise OutOfOrder(f"rank {member.rank} is held at the {self.policy.name} gate: pull before pushing again")
        if grad_version > self.decided_version and not (member.rejoin and self.skips_lost_iterations):
            # (else the policy drops it and counts its iteration: docs/algorithms.md, "Sharded resume")
            raise OutOfOrder(
                f"the gradient claims weights of version {grad_version}, but the server is at {self.decided_version}"
            )

    # Reports from the update lane's jobs (UpdateOwner) ----------------------
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
            log.warning(
                "worker %d: its gradient was computed on version %d, whose weights the server did not keep "
                "for it: applied without compensation (%d so far)",
                member.rank,
                version,
                ws.uncompensated,
            )

    def _let_go_of_old_weights(self) -> None:
        """The weights a worker was given that are more than --staleness-cutoff versions old:
        a gradient computed on them is dropped, so they are not kept for it."""
        if self.table.compensation is None or self.config.staleness_cutoff is None:
            return
        oldest = self.table.version - self.config.staleness_cutoff
        for member in self.roster.members.values():
            if member.pulled is not None and member.pulled.version < oldest:
                member.keep_pulled(None)

    def gradient_committed(
        self, member: Member, plan: Plan, arrived: float, hyper: HyperGroups | None = None
    ) -> PushResult:
        """A gradient was applied (and published), accumulated or dropped (``hyper``: the
        values it came with; the round it was added to is applied with the last ones)."""
        policy, stats, rank, table = self.policy, self.stats, member.rank, self.table
        if plan.kind is PlanKind.APPLY:
            stats.published(table.version)
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
        if plan.kind is PlanKind.SKIP:
            log.info(
                "worker %d takes no part in this shard's round at clock %d: another shard seated it in the next "
                '(docs/algorithms.md, "Sharded BSP: a worker that joins")',
                rank,
                policy.clock(rank) - 1,
            )
        if dropped:
            ws.dropped += 1
            if plan.reason == RESUMED:
                ws.dropped_resumed += 1
                log.warning(
                    "worker %d: its gradient was computed on weights newer than this shard's (version %d: "
                    "it resumed from an older checkpoint): dropped, its iteration counted",
                    rank,
                    table.version,
                )
            elif plan.reason == STALE:
                ws.dropped_stale += 1
                log.warning(
                    "worker %d: its gradient (computed on version %d, %d versions ago, before it "
                    "reconnected) is older than the %s bound allows: dropped, not applied; it goes on from "
                    "the newest weights",
                    rank,
                    table.version - plan.staleness,
                    plan.staleness,
                    policy.name,
                )
            elif plan.reason == CUTOFF:
                ws.dropped_cutoff += 1
                if ws.dropped_cutoff == 1 or ws.dropped_cutoff % 1000 == 0:  # (not a line per push)
                    log.info(
                        "worker %d: a gradient %d versions old, beyond --staleness-cutoff %d: dropped (%d so "
                        "far from this worker)",
                        rank,
                        plan.staleness,
                        self.config.staleness_cutoff,
                        ws.dropped_cutoff,
                    )
        else:
            ws.staleness.add(plan.staleness)
        if window.controller_calls != consulted:
            ws.r_star.add(window.last_r_star)
        result = PushResult(table.version, policy.clock(rank), dropped, plan.staleness, plan.scale)
        seat = self.roster.seat(rank)
        seat.push_id = -1 if member.push_id is None else member.push_id
        seat.push_clock = -1 if member.push_clock is None else member.push_clock
        seat.result = result
        self.after(outcome)
        return result

    def _answer_duplicate(self, member: Member, on_done: Callable[[PushResult], None]) -> None:
        """A push committed already came again: answer as the first time, apply nothing."""
        if not member.connected:
            return
        first = self.roster.seats[member.rank].result
        assert first is not None, "a duplicate is one of a committed push"
        log.info(
            "worker %d sent a push again that was applied already (its reply was lost): not applied twice", member.rank
        )
        self.stats.duplicates += 1
        outcome = self.policy.resume_push(member.rank)
        on_done(
            PushResult(self.table.version, self.policy.clock(member.rank), first.dropped, first.staleness, first.scale)
        )
        self.after(outcome)

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
            for member in self.roster.members.values():
                member.required_version = min(member.required_version, decided)
        self.policy.aggregate_applied()
        if applied and self.on_round is not None:
            self.on_round(self.table.version)  # before anyone is released into the next round
        self.serve_waiting()

    # The waiting workers (membership's Gate) ----------------------------------
    def wait(self, member: Member, on_ready: ReadyCallback, *, gate: bool) -> None:
        """Answer ``on_ready`` once ``member`` may go on (``gate``: a pull, counted in the stats)."""
        member.waiter = on_ready
        member.gate = gate
        member.waiting_since = None
        self._waiting[member.rank] = member
        if not self._try_serve(member) and gate:
            member.waiting_since = self._now()

    def stop_waiting(self, rank: int) -> None:
        """``rank``'s worker left: nobody answers it."""
        self._waiting.pop(rank, None)

    def _try_serve(self, member: Member) -> bool:
        roster, table = self.roster, self.model.table
        if (
            not roster.started
            or member.waiter is None
            or (member.gate and (roster.below_quorum or self.policy.is_held(member.rank)))
            or table is None
            or table.version < member.required_version
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
                    member.rows_out = self.model.rows.pull(wanted, member.rows_room)
                except Exception as exc:  # (out of memory, say): the reply says so, nobody waits
                    log.exception("reading the rows worker %d asked for failed", member.rank)
                    member.rows_out = exc
            snapshot = table.snapshot()
            if table.compensation is not None and member.dense_wanted:
                member.keep_pulled(snapshot.again())  # what its next gradient is computed on
            waiter(snapshot, self.policy.clock(member.rank))
        except Exception:  # one connection's failure must not keep the others waiting
            log.exception("answering worker %d failed", member.rank)
        return True

    def serve_waiting(self) -> None:
        """Try every waiting worker (after a publish that waiters may need, or the start)."""
        if self._waiting:
            for member in list(self._waiting.values()):
                self._try_serve(member)

    def after(self, outcome: Outcome) -> None:
        """Apply what a push or a leave changed: queue an aggregate update, serve the released."""
        if outcome.aggregate_scale is not None:
            self._pending_aggregates += 1
            hyper, self._round_hyper = self._round_hyper, None
            self.lane.submit(AggregateJob(self, outcome.aggregate_scale, hyper), front=True)
        if not outcome.released:
            return
        # A released worker must see every update decided so far.
        required = self.model.version + self._pending_aggregates
        members, waiting = self.roster.members, self._waiting
        for rank in outcome.released:
            member = members.get(rank)
            if member is not None:
                member.required_version = required
                if rank in waiting:
                    self._try_serve(member)
