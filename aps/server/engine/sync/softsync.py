"""n-softsync: one update per ``c = max(1, P // n)`` gradients, staleness-scaled."""

from __future__ import annotations

from .... import _core
from ....config import ServerConfig
from .base import Outcome, Plan, PlanKind, SyncPolicy

__all__ = ["Softsync"]


class Softsync(SyncPolicy):
    """n-softsync (Zhang et al.; docs/algorithms.md, n-softsync).

    Gradients from any workers are added to the aggregate buffer, each scaled
    by ``alpha(tau) / lr`` with ``tau`` its staleness in versions; once the
    buffer holds ``c = max(1, floor(P / n))`` of them (``P`` the live
    workers, but no more than were live at the aggregate's first gradient: a worker
    that joins meanwhile counts from the next one), one update applies their mean:
    ``w <- w - (1/c) * sum_l alpha(tau_l) * g_l``. There is no barrier:
    pulls are answered at once, unless ``--staleness`` adds an SSP bound.
    ``n = 1`` collects ``P`` gradients per update; ``n = P`` applies each alone.
    """

    name = "softsync"
    aggregates = True

    def __init__(self, config: ServerConfig, window_type: type = _core.StalenessWindow) -> None:
        super().__init__(config, window_type)
        self.n = config.softsync_n or 1
        self._count = 0  # gradients in the aggregate
        self._closing = False  # an aggregate update is pending
        self._started_live = 0  # the live workers at the aggregate's first gradient (0: it is empty)

    @property
    def group_size(self) -> int:
        """``c``: gradients per update, for the live workers now, but no more than were live
        at the aggregate's first gradient (joins count from the next aggregate)."""
        live = self.window.num_live
        if self._started_live:
            live = min(live, self._started_live)
        return max(1, live // self.n)

    def plan(self, rank: int, grad_version: int, version: int, clock: int = -1) -> Plan:
        newer = self._newer(grad_version, version)
        if newer is not None:
            return newer
        if not self.admits(rank, clock):  # (only with --staleness: otherwise unbounded)
            return self._stale(grad_version, version)
        cut = self._cut(grad_version, version)
        if cut is not None:
            return cut
        staleness = version - grad_version
        return Plan(
            PlanKind.ACCUMULATE, scale=self.staleness_scale(staleness), first=self._count == 0, staleness=staleness
        )

    def commit(self, rank: int, plan: Plan, now: float) -> Outcome:
        released = self.window.push(rank, now)
        if plan.kind is PlanKind.DROP:
            self._count_drop(plan)
        else:
            if self._count == 0:
                self._started_live = self.window.num_live
            self._count += 1
        return self._maybe_apply(released)

    def leave(self, rank: int) -> Outcome:
        return self._maybe_apply(self.window.leave(rank))

    def state(self) -> dict:
        if self._closing:
            raise RuntimeError("softsync state taken while an update is pending")
        return {**super().state(), "count": self._count, "started_live": self._started_live}

    def restore(self, state: dict) -> dict[int, tuple[int, bool, int]]:
        placements = super().restore(state)
        self._count = int(state["count"])
        self._started_live = int(state.get("started_live", 0)) if self._count else 0
        self._closing = False
        return placements

    def aggregate_applied(self) -> None:
        self._count = 0
        self._started_live = 0
        self._closing = False

    def _maybe_apply(self, released: list[int]) -> Outcome:
        if self._closing or self._count == 0 or self._count < self.group_size or self.resuming:
            return Outcome(released)
        self._closing = True
        return Outcome(released, aggregate_scale=1.0 / self._count)
