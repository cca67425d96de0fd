"""The interface every sync policy implements, and the policies that apply on arrival.

A policy decides two things (docs/algorithms.md): what happens to each gradient
(applied at once, added to an aggregate, or dropped) and when each worker may
start its next iteration (the gate). It never touches arrays: the server's
engine asks it for a :class:`Plan` before a gradient's kernel runs and tells it
the outcome after, in one strict order, so a policy is plain bookkeeping.
Clocks, the live set and staleness-bounded gate decisions live in the native
``StalenessWindow``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from enum import Enum
from typing import ClassVar

from .... import _core
from ....config import ServerConfig

__all__ = ["CLOSED_ROUND", "CUTOFF", "RESUMED", "STALE", "ApplyOnArrival", "Outcome", "Plan", "PlanKind", "SyncPolicy"]


class PlanKind(Enum):
    APPLY = "apply"  # one update with this gradient alone
    ACCUMULATE = "accumulate"  # add to the aggregate buffer
    DROP = "drop"  # count it, apply nothing
    SKIP = "skip"  # (BSP) its worker is in the round without a gradient


#: Why a gradient is dropped (Plan.reason): it arrived for a BSP round that closed already,
#: it is older than the staleness bound allows (computed before its worker reconnected),
#: or it was computed on weights newer than this shard holds (the shard resumed from an
#: older checkpoint while the push was in flight: docs/algorithms.md, "Sharded resume").
CLOSED_ROUND = "closed_round"
STALE = "stale"
RESUMED = "resumed"
#: ... or it was computed more than ``--staleness-cutoff`` versions before the one it would meet.
CUTOFF = "cutoff"


@dataclass(slots=True)
class Plan:
    """What to do with one gradient.

    Attributes:
        kind: apply, accumulate or drop.
        scale: factor the gradient is multiplied by before the optimizer sees it.
        first: for ACCUMULATE, the gradient starts a new aggregate.
        staleness: ``V - v_g`` in server versions when the gradient is applied.
        reason: for DROP, why: :data:`CLOSED_ROUND`, :data:`STALE`, :data:`RESUMED` or :data:`CUTOFF`.
    """

    kind: PlanKind
    scale: float = 1.0
    first: bool = False
    staleness: int = 0
    reason: str | None = None


class Outcome:
    """What a push (or a leave) changed.

    Attributes:
        released: workers released by this event (the pusher first, if released).
        aggregate_scale: when not None, apply the aggregate buffer now as one
            update, scaled by this factor (a BSP round closed).
    """

    __slots__ = ("released", "aggregate_scale")

    def __init__(self, released: list[int] | tuple[int, ...] = (), aggregate_scale: float | None = None) -> None:
        self.released = released
        self.aggregate_scale = aggregate_scale


class SyncPolicy(ABC):
    """The family of sync policies (see the module docstring)."""

    name: ClassVar[str] = ""
    #: True when the policy sums gradients into an aggregate buffer.
    aggregates: ClassVar[bool] = False

    def __init__(self, config: ServerConfig, window_type: type = _core.StalenessWindow) -> None:
        self.config = config
        self.num_workers = config.workers
        bounds = config.staleness_bounds()
        self.window = window_type(self.num_workers, *bounds) if bounds else window_type(self.num_workers)
        #: Gradients dropped (for any reason), and among them those older than the bound,
        #: and those older than the cut-off.
        self.dropped = 0
        self.dropped_stale = 0
        self.dropped_cutoff = 0
        #: Restored from a checkpoint, and not every worker is back yet: no round closes
        #: (no update is formed from a part of the cluster); the engine clears it at the start.
        self.resuming = False
        self._inverse_lr = config.lr_staleness == "inverse"

    def staleness_scale(self, staleness: int) -> float:
        """``alpha(tau) / lr``: 1, or ``1 / tau`` for ``--lr-staleness inverse`` and ``tau >= 1``."""
        if self._inverse_lr and staleness >= 1:
            return 1.0 / staleness
        return 1.0

    @property
    def num_live(self) -> int:
        return self.window.num_live

    def clock(self, rank: int) -> int:
        return self.window.clock(rank)

    def is_held(self, rank: int) -> bool:
        """True while ``rank`` must not start its next iteration (its pull waits)."""
        return self.window.is_held(rank)

    def join(self, rank: int, clock: int = -1, held: bool = False, credit: int = 0) -> int:
        """``rank`` joins (or rejoins) the live set; returns its clock. By default it
        starts at the slowest live clock; ``clock >= 0`` places it there (see
        ``StalenessWindow.join``)."""
        return self.window.join(rank, clock, held, credit)

    #: True when a worker may take no part in a round (Flag.SKIP): BSP only.
    skips_rounds: ClassVar[bool] = False

    def plan_skip(self, rank: int, grad_version: int, version: int) -> Plan:
        """``rank``'s push of no gradient (Flag.SKIP): only a policy that :attr:`skips_rounds`
        takes one (the request handler refuses it otherwise)."""
        raise NotImplementedError(f"{self.name} has no rounds to skip")

    def resume_push(self, rank: int) -> Outcome:
        """``rank`` sent again a push that was committed already (it lost the reply and
        reconnected): nothing is applied again; the policy only takes note that the
        rank is back with it (BSP counts it present in its round)."""
        return Outcome()

    def state(self) -> dict:
        """The policy's state as plain data, for a checkpoint (taken between updates)."""
        clocks, live, held, credits, minimum, r_star, calls, released_max = self.window.state()
        return {
            "name": self.name,
            "min_clock": minimum,
            "released_max": released_max,
            "last_r_star": r_star,
            "controller_calls": calls,
            "dropped": self.dropped,
            "dropped_stale": self.dropped_stale,
            "dropped_cutoff": self.dropped_cutoff,
            "clocks": list(clocks),
            "live": [bool(x) for x in live],
            "held": [bool(x) for x in held],
            "credits": list(credits),
        }

    def restore(self, state: dict) -> dict[int, tuple[int, bool, int]]:
        """Take up a :meth:`state` (nobody live yet); returns where each rank that
        was live goes when it rejoins: ``{rank: (clock, held, credit)}``. The
        DSSP controller's arrival times are not kept: they were measured on the
        old process's clock, and refill within two pushes of each worker."""
        if state.get("name") != self.name:
            raise ValueError(f"the checkpoint's sync policy is {state.get('name')!r}, this server runs {self.name}")
        columns = [state[key] for key in ("clocks", "live", "held", "credits")]
        if any(len(column) != self.num_workers for column in columns):
            raise ValueError(
                f"the checkpoint holds {len(columns[0])} workers' clocks, this server has {self.num_workers} workers"
            )
        # (a checkpoint without released_max: the window takes the strictest value it may)
        self.window.restore(
            int(state["min_clock"]),
            int(state["last_r_star"]),
            int(state["controller_calls"]),
            int(state.get("released_max", -1)),
        )
        self.dropped = int(state.get("dropped", 0))
        self.dropped_stale = int(state.get("dropped_stale", 0))
        self.dropped_cutoff = int(state.get("dropped_cutoff", 0))
        self.resuming = True
        return {
            rank: (int(clock), bool(held) and self.window.bounded, int(credit))
            for rank, (clock, live, held, credit) in enumerate(zip(*columns))
            if live
        }

    def forget_restored(self) -> None:  # noqa: B027  (a hook: only BSP keeps a round to forget)
        """Training started without some ranks of the checkpoint (an elastic run): they come
        back as new arrivals, not into the round the checkpoint caught open."""

    def leave(self, rank: int) -> Outcome:
        """``rank`` leaves the live set; nobody waits for it any more."""
        return Outcome(self.window.leave(rank))

    @abstractmethod
    def plan(self, rank: int, grad_version: int, version: int, clock: int = -1) -> Plan:
        """What to do with a gradient ``rank`` computed on ``grad_version`` when the server is at ``version``.

        ``clock``: the iteration the gradient was computed in, as its push says, when
        it may predate the rank's connection (a worker that reconnected); -1: the
        rank's own clock. A bounded policy drops a gradient older than its bound
        allows (:meth:`admits`)."""

    def admits(self, rank: int, clock: int = -1) -> bool:
        """False when a gradient ``rank`` computed in iteration ``clock`` is older than
        the staleness bound allows: some worker has been released into an iteration
        that had to see it already (``StalenessWindow.admits``; docs/algorithms.md,
        "The bound across a reconnect"). Always True for an unbounded policy."""
        return self.window.admits(rank, clock)

    def _stale(self, grad_version: int, version: int) -> Plan:
        return Plan(PlanKind.DROP, staleness=version - grad_version, reason=STALE)

    def _cut(self, grad_version: int, version: int) -> Plan | None:
        """A DROP for a gradient more than ``--staleness-cutoff`` versions old (docs/algorithms.md,
        "Staleness cut-off"), else None. Like every dropped push it ends its iteration."""
        cutoff = self.config.staleness_cutoff
        if cutoff is not None and version - grad_version > cutoff:
            return Plan(PlanKind.DROP, staleness=version - grad_version, reason=CUTOFF)
        return None

    @staticmethod
    def _newer(grad_version: int, version: int) -> Plan | None:
        """A DROP for a gradient computed on weights newer than this shard's (it resumed
        older; the engine lets such a push in only as the one a rejoining sharded worker had
        in flight), else None. It still ends its iteration, as every dropped push does."""
        return Plan(PlanKind.DROP, reason=RESUMED) if grad_version > version else None

    def _count_drop(self, plan: Plan) -> None:
        self.dropped += 1
        if plan.reason == STALE:
            self.dropped_stale += 1
        elif plan.reason == CUTOFF:
            self.dropped_cutoff += 1

    @abstractmethod
    def commit(self, rank: int, plan: Plan, now: float) -> Outcome:
        """The gradient was accepted and ``plan`` carried out; count the push."""

    def aggregate_applied(self) -> None:  # noqa: B027  (a hook: the policies that sum gradients close a round)
        """The update requested by ``Outcome.aggregate_scale`` has been published."""

    def describe(self) -> str:
        return self.config.describe_sync()


class ApplyOnArrival(SyncPolicy):
    """The family of policies that apply every gradient on arrival, alone (ASP, SSP, DSSP:
    they differ only in their window's bounds, which the configuration sets).

    The gradient is scaled by ``alpha(tau) / lr`` (``--lr-staleness``) and,
    with ``--async-scale mean``, by ``1 / P`` over the live workers.
    """

    def __init__(self, config: ServerConfig, window_type: type = _core.StalenessWindow) -> None:
        super().__init__(config, window_type)
        self._mean = config.async_scale == "mean"

    def plan(self, rank: int, grad_version: int, version: int, clock: int = -1) -> Plan:
        newer = self._newer(grad_version, version)
        if newer is not None:
            return newer
        if not self.admits(rank, clock):
            return self._stale(grad_version, version)
        cut = self._cut(grad_version, version)
        if cut is not None:
            return cut
        staleness = version - grad_version
        scale = self.staleness_scale(staleness)
        if self._mean:
            scale /= max(1, self.window.num_live)
        return Plan(PlanKind.APPLY, scale=scale, staleness=staleness)

    def commit(self, rank: int, plan: Plan, now: float) -> Outcome:
        # A dropped push still ends its iteration (as under BSP): the worker is told,
        # and the gate decides as after any push when it may start the next one.
        if plan.kind is PlanKind.DROP:
            self._count_drop(plan)
        return Outcome(self.window.push(rank, now))
