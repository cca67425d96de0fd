"""BSP, bulk synchronous parallel, with optional backup workers."""

from __future__ import annotations

from .... import _core
from ....config import ServerConfig
from .base import CLOSED_ROUND, Outcome, Plan, PlanKind, SyncPolicy

__all__ = ["BSP"]


class BSP(SyncPolicy):
    """One update per round with the mean of the round's gradients (docs/algorithms.md, BSP).

    A round is identified by the server version its gradients were computed
    on. Its members are the workers live when its first gradient arrives. A
    worker that pushed into the open round is held until the round closes:
    when every member still live has pushed into it, or, with ``k`` backup
    workers, when ``max(1, P - k)`` of them have (``P`` the members still live).
    A worker that joins after the round's first gradient is held until it
    closes and takes part in the next one, unless every member has left: then
    it joins the open round (docs/algorithms.md, "Elastic membership"). The round's gradients
    (including any from workers that pushed and then left) are summed in the
    aggregate buffer and applied as one update with their mean; each rank
    contributes at most one gradient per round. A gradient computed on an
    older version arrives for a closed round: it is dropped, counted, and its
    worker released at once to pull the newest weights. A worker that left
    after pushing and rejoined before its round closed pushes again like the
    others (so clocks stay in lockstep), but that second gradient is dropped:
    its first one is in the round already.

    Clocks count rounds: the open round's members push at its clock (the round
    clock), a worker held for a round under way goes on at the next one's, and
    a push from a clock behind the round clock is for a round that closed
    without it: dropped, its worker released at once. A shard of a sharded run
    seats a worker that reconnects at its own clock (``Membership._place``), so
    the rounds it missed there are dropped one push at a time and its
    iterations fall into the same rounds on every shard (docs/algorithms.md,
    "Sharded BSP across reconnects"). There a new arrival joins the round under
    way rather than wait for its close ("Sharded BSP: a worker that joins").
    """

    name = "bsp"
    aggregates = True
    skips_rounds = True

    def __init__(self, config: ServerConfig, window_type: type = _core.StalenessWindow) -> None:
        super().__init__(config, window_type)
        self.backup = config.backup_workers
        self._contributed: set[int] = set()  # ranks whose gradient is in the open round
        self._skipped: set[int] = set()  # ranks in the open round without a gradient (Flag.SKIP)
        self._pushed: set[int] = set()  # the live ones among them
        self._closed = False  # the round closed; its update is pending
        self._held: set[int] = set()
        self._members: set[int] = set()  # the open round's members: live at its first gradient
        # Restored from a checkpoint: ranks whose gradient is in the open round and that had not
        # left; they count as present (and held) again once they reconnect.
        self._restored_present: set[int] = set()
        self.round_clock = 0  # the clock the open round's members push at
        # A shard of a sharded run seats a new arrival in the round under way (docs/algorithms.md,
        # "Sharded BSP: a worker that joins"): held there for its close, it would wait on one shard
        # for a round that another shard's round, waiting for it, keeps open.
        self._joins_round_under_way = config.shards > 1

    def is_held(self, rank: int) -> bool:
        return rank in self._held

    def plan(self, rank: int, grad_version: int, version: int, clock: int = -1) -> Plan:
        # A closed round, an older round, or a second gradient from a rank that
        # already contributed to this one (it left and rejoined): dropped. (BSP's
        # window is unbounded: this is its whole staleness rule.)
        if (
            self._closed
            or grad_version != version
            or rank in self._contributed
            or self.window.clock(rank) < self.round_clock  # (a round it missed, which closed without it)
        ):
            return Plan(PlanKind.DROP, staleness=version - grad_version, reason=CLOSED_ROUND)
        return Plan(PlanKind.ACCUMULATE, first=not self._contributed)

    def plan_skip(self, rank: int, grad_version: int, version: int) -> Plan:
        """A push of no gradient: its worker is in the open round without one (it is in the
        next round on another shard), or, where it would be dropped, released at once."""
        plan = self.plan(rank, grad_version, version)
        return plan if plan.kind is PlanKind.DROP else Plan(PlanKind.SKIP)

    def commit(self, rank: int, plan: Plan, now: float) -> Outcome:
        self.window.push(rank, now)
        if plan.kind is PlanKind.DROP:
            self._count_drop(plan)
            if rank in self._contributed and not self._closed:
                # It rejoined after contributing to this round: its gradient is in
                # already, so this one only marks it present; it waits for the round.
                self._pushed.add(rank)
                self._held.add(rank)
                return self._maybe_close()
            return Outcome([rank])
        if plan.kind is PlanKind.SKIP:  # there, without a gradient: it waits for the round like the others
            self._skipped.add(rank)
            self._pushed.add(rank)
            self._held.add(rank)
            return self._maybe_close()
        if not self._contributed:  # the round's first gradient: its members are the live workers now
            window = self.window
            self._members = {r for r in range(self.num_workers) if window.is_live(r)}
        self._contributed.add(rank)
        self._pushed.add(rank)
        self._held.add(rank)
        return self._maybe_close()

    def leave(self, rank: int) -> Outcome:
        self.window.leave(rank)
        self._held.discard(rank)
        self._pushed.discard(rank)  # its gradient stays in the round's sum
        return self._maybe_close()

    def resume_push(self, rank: int) -> Outcome:
        took_part = rank in self._contributed or rank in self._skipped  # (its gradient, or its SKIP)
        if took_part and not self._closed and rank not in self._pushed:
            self._pushed.add(rank)
            self._held.add(rank)
            return self._maybe_close()
        return Outcome()

    def state(self) -> dict:
        if self._closed:
            raise RuntimeError("BSP state taken while a round's update is pending")
        return {
            **super().state(),
            "contributed": sorted(self._contributed),
            "skipped": sorted(self._skipped),
            "pushed": sorted(self._pushed),
            "round_held": sorted(self._held),
            "round_clock": self.round_clock,
        }

    def restore(self, state: dict) -> dict[int, tuple[int, bool, int]]:
        placements = super().restore(state)
        ranks = range(self.num_workers)
        self._contributed = {int(r) for r in state["contributed"] if int(r) in ranks}
        self._skipped = {int(r) for r in state.get("skipped", ()) if int(r) in ranks}
        self._restored_present = {int(r) for r in state["pushed"] if int(r) in placements}
        self._pushed, self._held, self._closed = set(), set(), False
        self._members = set(placements) if self._contributed else set()  # (the workers live in the checkpoint)
        # BSP holds at its own gate (the window is unbounded): the placement's flag says so.
        held = {int(r) for r in state["round_held"]}
        # (a checkpoint from before the round clock was kept: the open round's clock is its
        # slowest member's, the clock of those that had not pushed into it)
        round_clock = int(
            state.get("round_clock", min((c for c, _, _ in placements.values()), default=int(state["min_clock"])))
        )
        if not 0 <= round_clock <= 2**53:
            raise ValueError(f"its round clock {round_clock} is not a clock (0 to 2**53)")
        self.round_clock = round_clock
        return {rank: (clock, rank in held, credit) for rank, (clock, _, credit) in placements.items()}

    def forget_open_round(
        self, placements: dict[int, tuple[int, bool, int]]
    ) -> tuple[dict[int, tuple[int, bool, int]], set[int]]:
        """Right after :meth:`restore`: leave out the round the checkpoint caught open (a
        shard resumed beside shards that kept their rounds, docs/algorithms.md "Sharded
        resume": its workers do not take their iterations again, so the round's gradients
        would be paired with later ones). Its contributors go back one clock, to the last
        closed round, with every other rank. Returns the placements and the ranks whose
        gradient was left out (their last push is no longer applied)."""
        dropped = set(self._contributed)
        out = {
            rank: ((clock - 1, False, credit) if rank in dropped else (clock, held, credit))
            for rank, (clock, held, credit) in placements.items()
        }
        # (a rank that skipped it keeps its clock: its next gradient goes into the round taken again,
        # beside the contributors' next ones, as on the shards where that round closed without it)
        self._contributed, self._skipped, self._restored_present, self._members = set(), set(), set(), set()
        return out, dropped

    def join(self, rank: int, clock: int = -1, held: bool = False, credit: int = 0) -> int:
        present = rank in self._restored_present
        self._restored_present.discard(rank)
        if clock >= 0 and present:  # back where the checkpoint had it: present in the round
            self._pushed.add(rank)
            if held:
                self._held.add(rank)
        elif clock < 0:  # a new arrival: at the round clock, or the next round's
            clock = self.round_clock
            if self._closed:  # the round closed and its update is pending (its weights are the INIT's): the next
                clock += 1
            elif self._contributed and rank not in self._members and not self.resuming:
                if self._joins_round_under_way:
                    self._members.add(rank)  # the round waits for its first gradient
                elif any(self.window.is_live(member) for member in self._members):
                    # A round is under way without it: it waits for that round's update, and joins the next.
                    self._held.add(rank)
                    clock += 1
                else:  # every member of the round left: nobody else would close it, so it takes part
                    self._members.add(rank)
        return self.window.join(rank, clock, False, credit)

    def forget_restored(self) -> None:
        self._restored_present.clear()

    def aggregate_applied(self) -> None:
        self.round_clock += 1
        self._closed = False
        self._contributed.clear()
        self._skipped.clear()
        self._pushed.clear()
        self._members.clear()

    def _maybe_close(self) -> Outcome:
        # (a round of SKIPs alone waits for a gradient: those who would give one come back, or
        # join, as after any round whose members all left)
        if self._closed or not self._contributed or self.resuming:
            return Outcome()
        window = self.window
        live = sum(1 for rank in self._members if window.is_live(rank))
        if live == 0 and window.num_live == 0:
            return Outcome()  # nobody is left to wait for it: it stays open for those who come back
        if live and len(self._pushed & self._members) < max(1, live - self.backup):
            return Outcome()
        self._closed = True
        released = sorted(self._held)
        self._held.clear()
        return Outcome(released, aggregate_scale=1.0 / len(self._contributed))
