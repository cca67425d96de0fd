"""The server's core without I/O: the sum of its parts.

Transports turn frames into calls on the engine's parts (``membership.join``,
``training.pull``, ``training.push``, ``membership.leave``, ...) and get answers
through callbacks. Keeping the core free of sockets lets the tests drive every
policy through random interleavings directly, and the simulator run it on a
virtual clock.

:class:`Engine` makes the parts, hands each the others it needs (behind the
narrow Protocols each part declares: ``membership.Gate``, ``loads.Taken``,
``durability.Resumable``, ``Counted`` and ``Loaded``, and the lane's job owners
``jobs.updates.UpdateOwner`` and ``jobs.state.StateOwner``), and holds them:

- :attr:`Engine.model` (:mod:`.model`): the weights table, layout, running sum and
  embedding tables, made at registration or restore;
- :attr:`Engine.roster` (:mod:`.members`): the members and seats, whether training goes;
- :attr:`Engine.membership` (:mod:`.membership`): joins, leaves, registration, the start, the quorum;
- :attr:`Engine.training` (:mod:`.training`): pulls, pushes, duplicates, serving the waiting;
- :attr:`Engine.loads` (:mod:`.loads`): reading and loading the optimizer's state and the weights;
- :attr:`Engine.durability` (:mod:`.durability`): checkpoints, the run's identity, the claims;
- :attr:`Engine.lane` (:mod:`.lane`), :attr:`Engine.policy` (:mod:`.sync`),
  :attr:`Engine.stats` (:mod:`.stats`), :attr:`Engine.scalars` (:mod:`.scalars`) and
  :attr:`Engine.paces` (:mod:`.paces`).

Ordering. Every change of state (a join, a leave, a gradient's plan and
commit, an aggregate update) goes through one FIFO, the update lane, and runs
in arrival order; the jobs that compute live in ``aps.server.engine.jobs`` and
report back to training. A pull is answered when the policy no longer holds its
worker and the table has published every update decided before the worker's
release, so a worker always sees its own updates.

The engine itself keeps what reads every part at once (:meth:`Engine.view`, the
statistics' snapshot) and, while the connections move to the parts, one-line
delegations under the names they call.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from types import ModuleType
from typing import Any, Protocol, Self

import numpy as np

from ... import _core
from ...config import ServerConfig
from .durability import Durability
from .lane import Offload, UpdateLane
from .loads import Loads
from .members import Member, PushResult, Roster, Seat
from .membership import Membership
from .model import Model
from .paces import Paces
from .scalars import Scalars
from .stats import EngineView, RankView, ServerStats, TableView
from .sync import make_policy
from .training import Training

__all__ = ["Answer", "Engine", "Member", "PushResult", "Seat"]


class Answer(Protocol):
    """What the server's ``request_checkpoint`` and ``request_rewind`` return: an answer to come
    (an asyncio future, which the engine does not name: it knows no event loop). Its callback
    runs once it is done, with a result or an exception."""

    def add_done_callback(self, fn: Callable[[Self], object], /) -> None: ...

    def result(self) -> Any: ...

    def exception(self) -> BaseException | None: ...


class Engine:
    """The server's state machine: its parts, made and wired (see the module docstring).

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
        self.policy = make_policy(config, window_type or kernels.StalenessWindow)
        self.stats = ServerStats(config.workers, now)
        self.scalars = Scalars()  #: what the workers' training loops report (LOG)
        self.paces = Paces()  #: the workers' step rates (PACE)
        self.lane = UpdateLane(offload, offload_threshold)
        self.model = Model(config, self.policy, kernels, allocate, background)
        self.roster = Roster()
        self.training = Training(config, self.model, self.roster, self.policy, self.stats, self.lane, now)
        self.membership = Membership(
            config, self.model, self.roster, self.policy, self.stats, self.lane, self.training, now, background
        )
        self.loads = Loads(config, self.model, self.roster, self.training, self.lane)
        self.durability = Durability(
            config,
            self.model,
            self.roster,
            self.membership,
            self.training,
            self.loads,
            self.policy,
            self.stats,
            self.scalars,
            self.lane,
        )
        #: ``request_checkpoint(reason)`` -> an answer of ``{"path", "version"}``; set by a server that
        #: writes checkpoints.
        self.request_checkpoint: Callable[[str], Answer] | None = None
        #: ``request_rewind(version)`` -> an answer of ``{"versions"|"rewound", "version"}``: the
        #: checkpoints this run can rewind to (version None), or a rewind to one of them (REWIND,
        #: docs/algorithms.md "Sharded resume"); set by a server that can restart itself.
        self.request_rewind: Callable[[int | None], Answer] | None = None

    # What reads every part ---------------------------------------------------
    @property
    def version(self) -> int:
        """The newest published version."""
        return self.model.version

    @property
    def weights(self) -> np.ndarray | None:
        """The newest published weights (None before the model exists)."""
        return self.model.weights

    @property
    def idle(self) -> bool:
        """True when no state change is queued or running."""
        return self.lane.idle

    def stats_snapshot(self) -> dict:
        """Everything :mod:`aps.server.engine.stats` counts, as a JSON-able dict (see ``aps status``)."""
        return self.stats.snapshot(self.view())

    def stats_totals(self) -> dict:
        """The few running totals the dashboard's history samples (``ServerStats.totals``)."""
        return self.stats.totals(self.version, self.policy.window.num_live)

    def view(self) -> EngineView:
        """What the statistics read of the engine, copied now (a read-only snapshot)."""
        policy, window, config, table = self.policy, self.policy.window, self.config, self.model.table
        model, roster, durability = self.model, self.roster, self.durability
        ranks = []
        for rank in range(len(self.stats.workers)):
            live = window.is_live(rank)
            newest, previous = window.arrivals(rank)
            member = roster.members.get(rank)
            ranks.append(
                RankView(
                    live=live,
                    clock=window.clock(rank),
                    gap=window.gap(rank) if live else None,
                    held=policy.is_held(rank),
                    credit=window.credit(rank),
                    newest=newest,
                    previous=previous,
                    connected=member is not None and member.connected,
                    hyper=member.hyper if member is not None else None,
                )
            )
        return EngineView(
            address=durability.address,
            shard=config.shard,
            shards=config.shards,
            sync=policy.describe(),
            optimizer=table.optimizer.describe() if table is not None else config.optimizer,
            defaults=table.optimizer.defaults if table is not None else None,
            workers=self.membership.num_workers,
            live=window.num_live,
            started=roster.started,
            version=self.version,
            pushes=self.training.pushes,
            dropped=policy.dropped,
            dropped_stale=policy.dropped_stale,
            dropped_cutoff=policy.dropped_cutoff,
            run_id=durability.run_id,
            resumed_from=durability.resumed_from,
            parameters=model.layout.numel if model.layout is not None else 0,
            ranks=tuple(ranks),
            min_workers=self.membership.quorum,
            draining=roster.draining,
            reports=self.scalars.newest(),
            warnings=tuple(self.scalars.warnings),
            tables=tuple(
                TableView(
                    name=name,
                    dim=rows.table.dim,
                    optimizer=rows.table.optimizer,
                    rows=len(rows),
                    nbytes=rows.nbytes,
                    rows_pulled=rows.rows_pulled,
                    rows_pushed=rows.rows_pushed,
                    rows_evicted=rows.rows_evicted,
                )
                for name, rows in model.rows.items()
            ),
            table_memory=(model.rows.used, model.table_memory.limit, model.table_memory.available),
        )
