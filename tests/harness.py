"""Drive the server's engine directly, without sockets, on a virtual clock."""

from __future__ import annotations

import numpy as np

from aps import _core
from aps.server.engine import Engine
from aps.config import ServerConfig
from aps.errors import ServerError
from aps.layout import Layout


class Worker:
    """What the harness knows about one rank."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.member = None
        self.version = 0  # version of the weights it last received
        self.weights: np.ndarray | None = None
        self.waiting = False  # a pull or init is pending
        self.released = 0  # how many times it was answered
        self.rows = None  # the rows its last answered pull asked for (one array a section)
        self.errors: list[ServerError] = []
        self.results = []  # push results


class Harness:
    """An Engine with P workers, a virtual clock and a log of every release.

    ``on_release(harness, rank, snapshot_version)`` is called at each release
    (inside the engine), so invariants can be checked at that very moment.
    """

    def __init__(self, kernels=_core, numel: int | None = None, on_release=None, offload=None, tables=(),
                 **options) -> None:
        options.setdefault("lr", 1.0)
        self.config = ServerConfig(**options)
        self.P = self.config.workers
        self.numel = numel or self.P
        self.layout = Layout(("w",), ((self.numel,),), tuple(tables))
        self.now = 0.0
        self.engine = Engine(self.config, now=lambda: self.now, kernels=kernels, offload=offload)
        self.workers = [Worker(r) for r in range(self.P)]
        self.on_release = on_release
        self.releases: list[tuple[int, int, int]] = []  # (rank, version, clock)

    @property
    def policy(self):
        return self.engine.policy

    @property
    def window(self):
        return self.engine.policy.window

    def tick(self, dt: float = 1.0) -> None:
        self.now += dt

    def _ready(self, worker: Worker):
        def ready(snapshot, clock):
            worker.weights = snapshot.array.copy()
            worker.version = snapshot.version
            if worker.member is not None and worker.member.rows_out is not None:
                worker.rows, worker.member.rows_out = worker.member.rows_out, None
            snapshot.release()
            worker.waiting = False
            worker.released += 1
            self.releases.append((worker.rank, worker.version, clock))
            if self.on_release is not None:
                self.on_release(self, worker.rank, worker.version)

        return ready

    def join(self, rank: int, values: np.ndarray | None = None, *, rejoin: bool = False, clock: int = -1) -> None:
        worker = self.workers[rank]
        if values is None:
            values = np.zeros(self.numel, np.float32)
        worker.waiting = True
        worker.member = self.engine.membership.join(
            rank, self.P, self.layout, values, self._ready(worker), lambda exc: worker.errors.append(exc),
            rejoin=rejoin, clock=clock,
        )

    def join_all(self, values: np.ndarray | None = None) -> None:
        for rank in range(self.P):
            self.join(rank, values)

    def leave(self, rank: int) -> None:
        worker = self.workers[rank]
        self.engine.membership.leave(worker.member)
        worker.member = None
        worker.waiting = False

    def pull(self, rank: int, rows=None) -> None:
        """A pull of ``rank`` (``rows``: sections of ids, aps.wire.rows, read with the weights)."""
        worker = self.workers[rank]
        worker.waiting = True
        worker.member.rows_wanted = rows
        self.engine.training.pull(worker.member, self._ready(worker))

    def push(self, rank: int, grad, *, version: int | None = None, then_pull: bool = False,
             request_id: int | None = None, clock: int | None = None, rows=None, pull_rows=None) -> None:
        """Push ``grad`` from ``rank`` (None: rows alone), computed on ``version`` (default: the
        weights it last received); ``request_id`` and ``clock`` are what the push's header would
        carry; ``rows`` and ``pull_rows``: sections of rows pushed and pulled (then_pull)."""
        worker = self.workers[rank]
        member = worker.member
        if grad is not None:
            member.grad[:] = grad
        self.tick(0.0)

        def done(result):
            worker.results.append(result)
            if then_pull:
                self.pull(rank, pull_rows)

        self.engine.training.push(
            member,
            worker.version if version is None else version,
            done,
            lambda exc: worker.errors.append(exc),
            request_id=request_id,
            clock=clock,
            rows=rows,
            dense=grad is not None,
        )

    def held(self, rank: int) -> bool:
        return self.policy.is_held(rank)

    def live(self, rank: int) -> bool:
        member = self.workers[rank].member
        return member is not None and member.joined

    def state(self):
        """Everything that must agree between the native and reference engines."""
        engine = self.engine
        return (
            engine.version,
            engine.training.decided_version,
            engine.training.pushes,
            engine.stats.rejected,
            engine.policy.dropped,
            engine.policy.window.state(),
            tuple(engine.policy.is_held(r) for r in range(self.P)),
        )
