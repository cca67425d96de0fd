"""Server statistics: what the server counts per worker and overall.

The engine records events as they happen (cheap counters and sparse
histograms); :meth:`ServerStats.snapshot` turns them into a plain JSON-able
dict (``Server.stats()``, the payload of a STATS reply, see
docs/protocol.md), which ``aps status`` renders. What it reads of the engine comes
as an :class:`EngineView`, a read-only copy of the moment the engine makes
(``Engine.view``): the statistics never reach into the engine or its policy's window.
"""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import psutil

from ... import _core

if TYPE_CHECKING:
    from .optim import HyperGroups

__all__ = [
    "EngineView",
    "Histogram",
    "RankView",
    "RowRates",
    "ServerStats",
    "TableView",
    "Traffic",
    "WorkerStats",
    "lr_range",
    "merge_counts",
]

#: The recent update rate counts the updates of the last this many seconds.
RATE_WINDOW_S = 10
#: The transports, as statistics name them.
TRANSPORTS = ("tcp", "shm")


#: Histograms count each value below this exactly; larger ones in power-of-two buckets
#: (keyed by their lower end), so a histogram holds at most about 300 keys whatever it is fed.
EXACT_BELOW = 256
#: Upper bounds (seconds) of the buckets that count how long pulls waited at the gate.
WAIT_BUCKETS_S = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 60.0)
#: Membership events kept (the newest; each kind is also counted for ever).
EVENTS_KEPT = 200
#: What can happen to a rank's membership: it joined (a new process, or the same one
#: reconnecting), said goodbye (its training finished, or not), its connection was lost, or the server dropped it
#: for silence (missed heartbeats, or a reply it never read).
MEMBERSHIP_EVENTS = ("joined", "rejoined", "left", "finished", "disconnected", "timed out")
#: The counts a checkpoint carries over to the run's next process (see ServerStats.carry).
CARRIED_COUNTERS = ("rejected", "duplicates")


@dataclass(frozen=True, slots=True)
class RankView:
    """One rank as the sync policy and the engine see it at one moment.

    Attributes:
        live: the rank is in the policy's live set; clock: its iterations;
        gap: how far ahead of the slowest live rank it is (None when not live);
        held: the policy holds its pull; credit: DSSP's extra iterations;
        newest, previous: when its last two pushes arrived (NaN: none yet);
        connected: a worker holds the rank; hyper: the values its pushes are applied
        with (None: the server's own).
    """

    live: bool
    clock: int
    gap: int | None
    held: bool
    credit: int
    newest: float
    previous: float
    connected: bool
    hyper: HyperGroups | None


@dataclass(frozen=True, slots=True)
class TableView:
    """One embedding table as the engine holds it at one moment (aps.server.engine.rows.RowTable).

    Attributes:
        name, dim, optimizer: its declaration's; rows: the rows held; nbytes: the bytes
        they take (values, optimizer state, index); rows_pulled, rows_pushed, rows_evicted:
        ids pulled and pushed (duplicates counted) and rows evicted by this process.
    """

    name: str
    dim: int
    optimizer: str
    rows: int
    nbytes: int
    rows_pulled: int
    rows_pushed: int
    rows_evicted: int


@dataclass(frozen=True, slots=True)
class EngineView:
    """What the statistics read of the engine, copied at one moment (``Engine.view``)."""

    address: str | None
    shard: int
    shards: int
    sync: str
    optimizer: str
    defaults: Any
    workers: int
    live: int
    started: bool
    version: int
    pushes: int
    dropped: int
    dropped_stale: int
    dropped_cutoff: int
    run_id: Any
    resumed_from: Any
    parameters: int
    ranks: tuple[RankView, ...]
    #: The model's embedding tables, in their declared order (none: a model without tables).
    tables: tuple[TableView, ...] = ()
    #: The bytes the tables' rows take as --table-memory counts them, the limit (0: none), and
    #: the memory available at start the limit is half of (None: --table-memory was given).
    table_memory: tuple[int, int, int | None] = (0, 0, None)
    #: MIN of an elastic run (``workers`` is MAX); equal to ``workers`` for a fixed size.
    min_workers: int = 0
    #: A worker finished training (LEAVE, Flag.FINISHED): fewer than MIN live hold nobody.
    draining: bool = False
    #: What each rank's training loop reported last (LOG; aps.server.engine.scalars.Scalars.newest).
    reports: dict = field(default_factory=dict)
    #: Warnings about what the workers report (two ranks training on the same batches).
    warnings: tuple = ()


#: The keys of each group in a worker's ``hyperparameters`` (HyperGroup's fields).
HYPER_KEYS = ("stop", "lr", "weight_decay", "momentum", "dampening")


def lr_range(groups: list[dict] | None) -> tuple[float, float] | None:
    """The smallest and largest learning rate of a worker's ``hyperparameters`` (None: none)."""
    if not groups:
        return None
    rates = [group["lr"] for group in groups]
    return min(rates), max(rates)


def merge_counts(histograms) -> dict[int, int]:
    """The sum of ``{value: count}`` histograms (keys as ints, or as the strings of a JSON
    record), by increasing value."""
    total: dict[int, int] = {}
    for hist in histograms:
        for value, count in hist.items():
            total[int(value)] = total.get(int(value), 0) + count
    return dict(sorted(total.items()))


class Histogram:
    """Counts of non-negative integers (sparse and bounded: see EXACT_BELOW)."""

    __slots__ = ("counts", "total", "n", "max")

    def __init__(self) -> None:
        self.counts: dict[int, int] = {}
        self.total = 0
        self.n = 0
        self.max: int | None = None

    def add(self, value: int) -> None:
        key = value if value < EXACT_BELOW else 1 << (value.bit_length() - 1)
        self.counts[key] = self.counts.get(key, 0) + 1
        self.total += value
        self.n += 1
        if self.max is None or value > self.max:
            self.max = value

    @property
    def mean(self) -> float | None:
        return self.total / self.n if self.n else None

    def to_dict(self) -> dict[str, int]:
        return {str(k): self.counts[k] for k in sorted(self.counts)}


class WorkerStats:
    """Counters for one rank (kept across reconnects)."""

    __slots__ = (
        "pushes",
        "dropped",
        "dropped_stale",
        "dropped_resumed",
        "dropped_cutoff",
        "rejected",
        "staleness",
        "r_star",
        "release_gap",
        "waits",
        "wait_total",
        "wait_max",
        "pulls",
        "wait_buckets",
        "compensated",
        "uncompensated",
    )

    def __init__(self) -> None:
        self.pushes = 0  # gradients accepted (applied, accumulated or dropped)
        self.dropped = 0  # for any reason (BSP's closed round, or older than the bound)
        self.dropped_stale = 0  # older than the staleness bound (computed before a reconnect)
        self.dropped_resumed = 0  # computed on weights newer than a shard that resumed older holds
        self.dropped_cutoff = 0  # older than --staleness-cutoff
        # --compensation: gradients compensated, and taken without the weights they were computed on
        self.compensated = self.uncompensated = 0
        self.rejected = 0
        self.staleness = Histogram()
        self.r_star = Histogram()
        self.release_gap = Histogram()  # t_i - min_j t_j each time a pull was answered
        self.pulls = 0
        self.waits = 0  # pulls that had to wait at the gate
        self.wait_total = 0.0
        self.wait_max = 0.0
        self.wait_buckets = [0] * len(WAIT_BUCKETS_S)  # pulls by wait, not cumulative (beyond the last: none)

    def waited(self, seconds: float) -> None:
        self.pulls += 1
        for i, bound in enumerate(WAIT_BUCKETS_S):
            if seconds <= bound:
                self.wait_buckets[i] += 1
                break
        if seconds > 0.0:
            self.waits += 1
            self.wait_total += seconds
            if seconds > self.wait_max:
                self.wait_max = seconds


class Traffic:
    """Bytes one transport moved: over its sockets, and (shared memory) through
    its segments: a gradient read in place, weights copied out of a slot."""

    __slots__ = ("bytes_in", "bytes_out")

    def __init__(self) -> None:
        self.bytes_in = 0
        self.bytes_out = 0


class ServerStats:
    """Server-wide counters and a recent update rate."""

    def __init__(self, num_workers: int, now=time.monotonic) -> None:
        self.workers = [WorkerStats() for _ in range(num_workers)]
        self.traffic = {name: Traffic() for name in TRANSPORTS}
        # Every counter here starts at 0 with the process (what /metrics exports as counters: a
        # counter that went back on a resume would read as a reset and count phantom events).
        #: Gradients refused (NaN or infinity, or a failed update) by this process.
        self.rejected = 0
        #: Pushes sent again after a lost reply, recognised and not applied twice, by this process.
        self.duplicates = 0
        #: Updates this process published (the version counts those of the run's earlier processes too).
        self.updates = 0
        #: The run's counts before this process (a resumed run's checkpoint's): ``rejected``, ``duplicates``.
        self.carried = dict.fromkeys(CARRIED_COUNTERS, 0)
        #: Returns the checkpointer's state (``Checkpointer.status``); None: no --checkpoint-dir.
        self.checkpoint_status: Callable[[], dict] | None = None
        #: The replica set's state (aps.server.replicas: role, term, backups, lag), set by a replica.
        self.replica_status: Callable[[], dict] | None = None
        #: The version when training started (a resumed run starts at its checkpoint's).
        self.start_version = 0
        #: The last checkpoint written, as the checkpointer reports it (None before the first).
        self.checkpoint: dict | None = None
        self._now = now
        self.created = now()
        #: When this process's statistics began (wall clock): what its counters count from.
        self.created_unix = time.time()
        self.training_started: float | None = None
        #: The newest membership events (dicts, see :meth:`membership`), oldest first.
        self.events: deque[dict] = deque(maxlen=EVENTS_KEPT)
        #: Every membership event since the server started, by kind.
        self.event_counts = dict.fromkeys(MEMBERSHIP_EVENTS, 0)
        self._event_seq = 0
        #: Since when training holds for want of MIN live workers (None: it does not), and how often it has.
        self.quorum_since: float | None = None
        self.quorum_holds = 0
        #: Handshakes: failed (any reason), AUTH attempts held back for their turn, and
        #: refused (too many of theirs waiting after failures); see aps.server.admission.AuthThrottle.
        self.auth = {"failures": 0, "throttled": 0, "refused": 0}
        #: INITs refused because the layout blocks being read used up the server's budget.
        self.strangers = {"layout_refused": 0}
        # Updates per whole second of the clock, for the last RATE_WINDOW_S seconds.
        self._recent: deque[list[int]] = deque()

    def carry(self, counters: dict) -> None:
        """Take up the run's counts before this process (a checkpoint's ``counters``): they
        join the run's totals (:meth:`run_counters`), never this process's counters.

        Raises:
            TypeError, ValueError: ``counters`` is not a mapping of counts (nothing is taken).
        """
        if not isinstance(counters, dict):
            raise TypeError(f"the counters are {type(counters).__name__}, not an object")
        carried = {key: int(counters.get(key, 0)) for key in CARRIED_COUNTERS}
        if any(count < 0 for count in carried.values()):
            raise ValueError(f"negative counts: {carried}")
        self.carried = carried

    def run_counters(self) -> dict[str, int]:
        """The run's totals over all its processes (what a checkpoint keeps)."""
        return {
            "rejected": self.carried["rejected"] + self.rejected,
            "duplicates": self.carried["duplicates"] + self.duplicates,
        }

    @property
    def bytes_in(self) -> int:
        return sum(t.bytes_in for t in self.traffic.values())

    @property
    def bytes_out(self) -> int:
        return sum(t.bytes_out for t in self.traffic.values())

    def membership(self, rank: int, event: str, clock: int | None, live: int) -> None:
        """``rank`` joined, rejoined, left, was disconnected or timed out (MEMBERSHIP_EVENTS);
        ``clock``: its clock then; ``live``: the live workers after it."""
        self._event_seq += 1
        self.event_counts[event] += 1
        self.events.append(
            {"seq": self._event_seq, "t": time.time(), "rank": rank, "event": event, "clock": clock, "live": live}
        )

    def quorum(self, below: bool) -> None:
        """An elastic run went below MIN live workers (training holds) or back to MIN."""
        if below:
            self.quorum_since = self._now()
            self.quorum_holds += 1
        else:
            self.quorum_since = None

    def events_after(self, seq: int) -> list[dict]:
        """The kept membership events newer than ``seq`` (0: all kept), oldest first."""
        if not self.events or self.events[-1]["seq"] <= seq:
            return []
        return [e for e in self.events if e["seq"] > seq]

    def totals(self, version: int, live: int) -> dict:
        """A few running totals, cheap to read every second (the dashboard's history):
        the ``version``, the ``live`` workers, and staleness and gate-wait sums and counts."""
        workers = self.workers
        return {
            "version": version,
            "live": live,
            "staleness_sum": sum(w.staleness.total for w in workers),
            "staleness_n": sum(w.staleness.n for w in workers),
            "wait_s": sum(w.wait_total for w in workers),
            "pulls": sum(w.pulls for w in workers),
        }

    def published(self, version: int) -> None:
        """An update was published (counted, and for the recent rate)."""
        self.updates += 1
        second = int(self._now())
        recent = self._recent
        if recent and recent[-1][0] == second:
            recent[-1][1] += 1
            return
        recent.append([second, 1])
        while recent[0][0] <= second - RATE_WINDOW_S:
            recent.popleft()

    def update_rates(self, version: int) -> tuple[float, float]:
        """(updates/s over the last RATE_WINDOW_S seconds, mean updates/s since training started).

        The recent rate falls to 0 once nothing has been published for a whole window."""
        now = self._now()
        first = int(now) - (RATE_WINDOW_S - 1)  # the window: this second and the RATE_WINDOW_S - 1 before
        counted = sum(n for second, n in self._recent if second >= first)
        span = now - max(first, self.created)
        recent = counted / span if counted and span > 0 else 0.0
        mean = 0.0
        if self.training_started is not None and now > self.training_started:
            mean = (version - self.start_version) / (now - self.training_started)
        return recent, mean

    def snapshot(self, engine: EngineView) -> dict:
        """Everything counted, with what ``engine`` shows of the moment, as a JSON-able dict
        (``Server.stats()``, the STATS reply, ``aps status``)."""
        version = engine.version
        recent, mean = self.update_rates(version)
        run = self.run_counters()
        workers = []
        for rank, ws in enumerate(self.workers):
            seat = engine.ranks[rank]
            interval = seat.newest - seat.previous
            workers.append(
                {
                    "rank": rank,
                    "live": seat.live,
                    "clock": seat.clock,
                    "gap": seat.gap,
                    "held": seat.held,
                    "credit": seat.credit,
                    "pushes": ws.pushes,
                    "dropped": ws.dropped,
                    "dropped_stale": ws.dropped_stale,
                    "dropped_resumed": ws.dropped_resumed,
                    "dropped_cutoff": ws.dropped_cutoff,
                    "compensated": ws.compensated,
                    "uncompensated": ws.uncompensated,
                    "rejected": ws.rejected,
                    "staleness_mean": ws.staleness.mean,
                    "staleness_hist": ws.staleness.to_dict(),
                    "pulls": ws.pulls,
                    "waits": ws.waits,
                    "wait_s_total": ws.wait_total,
                    "wait_s_mean": ws.wait_total / ws.pulls if ws.pulls else None,
                    "wait_s_max": ws.wait_max,
                    "wait_buckets": list(ws.wait_buckets),
                    "r_star_hist": ws.r_star.to_dict(),
                    "release_gap_hist": ws.release_gap.to_dict(),
                    "max_release_gap": ws.release_gap.max,
                    "last_interval_s": interval if interval == interval else None,  # NaN: fewer than 2 pushes
                    # what its training loop logged last (aps.Worker.log), its process's CPU and memory
                    "reported": engine.reports.get(rank),
                    **self._hyperparameters(seat, engine.defaults),
                }
            )
        return {
            "server": {
                "address": engine.address,
                "shard": engine.shard,
                "shards": engine.shards,
                "sync": engine.sync,
                "optimizer": engine.optimizer,
                # what the update kernels run on: their instruction set (APS_KERNEL_ISA) and SGD's rounding
                "kernels": {"isa": _core.kernel_isa(), "fused_multiply_add": _core.fused_multiply_add()},
                "workers": engine.workers,
                "min_workers": engine.min_workers or engine.workers,
                "live": engine.live,
                # an elastic run with fewer than min_workers live holds every pull (since when, on
                # this process's monotonic clock: None when it does not hold)
                "quorum_held_s": None if self.quorum_since is None else self._now() - self.quorum_since,
                "quorum_holds": self.quorum_holds,
                # a worker left saying its training is done: the run is ending, MIN holds nobody
                "draining": engine.draining,
                "started": engine.started,
                "uptime_s": self._now() - self.created,
                "version": version,
                "updates_per_s": recent,
                "updates_per_s_mean": mean,
                "pushes": engine.pushes,
                "dropped": engine.dropped,
                "dropped_stale": engine.dropped_stale,
                "dropped_cutoff": engine.dropped_cutoff,
                "rejected": run["rejected"],
                "duplicates": run["duplicates"],
                # what this process counted (from 0 when it started; the figures above are the run's)
                "counters": {
                    "since_unix": self.created_unix,
                    "updates": self.updates,
                    "pushes": sum(ws.pushes for ws in self.workers),
                    "rejected": self.rejected,
                    "duplicates": self.duplicates,
                },
                "run_id": engine.run_id,
                "resumed_from": engine.resumed_from,
                "checkpoint": self.checkpoint,
                "checkpoints": self.checkpoint_status() if self.checkpoint_status is not None else None,
                "replicas": self.replica_status() if self.replica_status is not None else None,
                "bytes_in": self.bytes_in,
                "bytes_out": self.bytes_out,
                "transports": {
                    name: {"bytes_in": t.bytes_in, "bytes_out": t.bytes_out} for name, t in self.traffic.items()
                },
                "process": _process(),
                "parameters": engine.parameters,
                "membership_events": dict(self.event_counts),
                "auth": dict(self.auth),
                "strangers": dict(self.strangers),
                # name -> rows held, their bytes, and this process's counts (from 0 when it started)
                "tables": {table.name: _table(table) for table in engine.tables},
                "table_memory": _table_memory(*engine.table_memory),
            },
            "workers": workers,
            "events": list(self.events),
            "warnings": list(engine.warnings),
        }

    @staticmethod
    def _hyperparameters(seat: RankView, defaults) -> dict:
        """``hyperparameters``: the optimizer values ``seat``'s pushes are applied with, one
        dict per group (its own, or ``defaults`` as one group), and ``hyperparameters_own``:
        whether it set its own; both None with no worker connected or no model yet."""
        if not seat.connected or defaults is None:
            return {"hyperparameters": None, "hyperparameters_own": None}
        own = seat.hyper is not None
        groups = seat.hyper.groups if seat.hyper is not None else (defaults,)  # at most MAX_HYPER_GROUPS
        return {"hyperparameters": [dict(zip(HYPER_KEYS, group)) for group in groups], "hyperparameters_own": own}


def _table(table: TableView) -> dict:
    """One table of the snapshot's ``tables``."""
    return {
        "dim": table.dim,
        "optimizer": table.optimizer,
        "rows": table.rows,
        "bytes": table.nbytes,
        "rows_pulled": table.rows_pulled,
        "rows_pushed": table.rows_pushed,
        "rows_evicted": table.rows_evicted,
    }


def _table_memory(used: int, limit: int, available: int | None) -> dict:
    """The snapshot's ``table_memory``: the bytes the rows take as the limit counts them, the
    limit (None: no limit), and whether it is the default (half the memory available at start)."""
    return {"bytes": used, "limit": limit or None, "default": available is not None, "available_at_start": available}


class RowRates:
    """The rows each table had pulled and pushed per second over the last RATE_WINDOW_S
    seconds, measured between the snapshots shown to it (the dashboard's frames, twice a
    second) on the statistics' own clock (``uptime_s``)."""

    def __init__(self) -> None:
        #: (uptime, {table: (rows pulled, rows pushed)}) of the snapshots of the last window.
        self._samples: deque[tuple[float, dict[str, tuple[int, int]]]] = deque()

    def rated(self, server: dict) -> dict:
        """The ``tables`` of a snapshot's ``server``, each with ``rows_pulled_per_s`` and
        ``rows_pushed_per_s`` (None until a snapshot after this table's first)."""
        tables, now = server["tables"], server["uptime_s"]
        counts = {name: (table["rows_pulled"], table["rows_pushed"]) for name, table in tables.items()}
        samples = self._samples
        if samples and now < samples[-1][0]:
            samples.clear()  # another process's clock: nothing to measure against
        if not samples or now > samples[-1][0]:
            samples.append((now, counts))
        while len(samples) > 2 and samples[1][0] <= now - RATE_WINDOW_S:
            samples.popleft()  # the oldest kept is RATE_WINDOW_S old (or the first sample)
        if samples[0][0] < now - RATE_WINDOW_S - 2.0:
            samples.popleft()  # none shown for a while: a rate since then would not be over the window
        since, before = samples[0]
        out = {}
        for name, table in tables.items():
            then = before.get(name)
            pulled = pushed = None
            if now > since and then is not None:
                pulled, pushed = (max(0, count - old) / (now - since) for count, old in zip(counts[name], then))
            out[name] = {**table, "rows_pulled_per_s": pulled, "rows_pushed_per_s": pushed}
        return out


_PROCESS: psutil.Process | None = None


def _process() -> dict:
    """This (the server's) process: resident memory, CPU time, threads."""
    global _PROCESS
    if _PROCESS is None or _PROCESS.pid != os.getpid():
        _PROCESS = psutil.Process()
    with _PROCESS.oneshot():
        cpu = _PROCESS.cpu_times()
        return {
            "pid": _PROCESS.pid,
            "rss_bytes": _PROCESS.memory_info().rss,
            "cpu_s": cpu.user + cpu.system,
            "threads": _PROCESS.num_threads(),
        }
