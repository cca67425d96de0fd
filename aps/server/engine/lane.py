"""The update lane: one FIFO for every change of the server's state.

A join, a leave, a gradient and an aggregate update each become a
:class:`Job` and run in arrival order. A job runs in three steps:

1. ``prepare`` (event loop): decide what to compute and claim the memory
   (a free snapshot slot);
2. ``run`` (the kernel): inline for small models, or on a helper thread for
   large ones while the event loop keeps reading sockets;
3. ``commit`` (event loop): adopt the results, or throw them away.

Only ``prepare`` and ``commit`` touch bookkeeping, and only on the loop; the
kernel touches nothing but the arrays ``prepare`` chose. Every job has a
failure path the lane always takes: when ``prepare`` or ``commit`` raises
(a kernel's exception reaches ``commit`` as its result), the lane calls
``fail``, which gives back what the job claimed and answers whoever waits
for it; then the next job runs. Nothing a job does can stall the lane. While a large
gradient streams in, the lane may be *reserved* for it (see
``aps.server.engine.jobs.updates.StreamingPush``); any other submission cancels the
reservation first, so a slow sender never holds up anyone else.

The jobs see the engine only through the interfaces here: :class:`MemberView` (a
worker's place: its rank, its receive buffer, its values), :class:`UpdateOwner`
(what computing a gradient needs, and three reports back) and :class:`StateOwner`
(what reading and loading the optimizer's state and the weights needs). So the
jobs import the lane, never the engine, and the engine is one implementation.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from types import ModuleType

    import numpy as np

    from ...errors import ServerError
    from ...wire.protocol import StateHead
    from .jobs.state import StateCopies
    from .jobs.updates import Aggregate
    from .optim import HyperGroups
    from .rows import Tables
    from .sync import Plan, SyncPolicy
    from .table import ParameterTable, Snapshot

__all__ = [
    "CallJob", "Job", "Kernel", "Offload", "PushAnswer", "Reservation", "MemberView", "StateOwner", "UpdateLane",
    "UpdateOwner", "run_kernel",
]

log = logging.getLogger("aps.server")

#: A kernel: computes into memory set aside by ``prepare``; False means refused.
Kernel = Callable[[], bool]
#: ``offload(kernel, done)``: runs ``kernel`` off the loop and calls ``done(result)`` back on it.
Offload = Callable[[Kernel, Callable[[object], None]], None]
#: The engine's answer to a committed gradient (its ``PushResult``): a job hands it to its
#: callback unread.
PushAnswer = Any


class MemberView(Protocol):
    """What a job reads of a worker's seat at the server (the engine's ``Member``)."""

    rank: int
    grad: np.ndarray
    grad_dtype: int
    hyper: HyperGroups | None
    connected: bool

    def gradient(self) -> np.ndarray:
        """The received gradient, in the element type it came in."""


class UpdateOwner(Protocol):
    """What a job computing a gradient may see of the engine."""

    table: ParameterTable
    policy: SyncPolicy
    aggregate: Aggregate | None
    kernels: ModuleType
    rows: Tables  # the model's embedding tables

    def gradient_committed(self, member: MemberView, plan: Plan, arrived: float,
                           hyper: HyperGroups | None = None) -> PushAnswer:
        """The gradient was applied, accumulated or dropped: count it, release whom it releases.
        ``hyper``: the values the push came with (an aggregate update it closes uses them)."""

    def weights_pushed_on(self, member: MemberView, version: int) -> Snapshot | None:
        """A lease on the weights of ``version`` ``member`` was given (delay compensation), or None."""

    def gradient_compensated(self, member: MemberView, version: int, compensated: bool) -> None:
        """With delay compensation: ``member``'s gradient (computed on ``version``) was taken,
        compensated or (the weights of ``version`` not kept) not."""

    def gradient_refused(self, rank: int, reason: object) -> ServerError:
        """The kernel refused the gradient (``reason``: False, or the exception it
        raised): count it; returns the error for the worker."""

    def aggregate_committed(self, applied: bool) -> None:
        """An aggregate update finished (``applied``: it was published)."""


class StateOwner(Protocol):
    """What the jobs reading and loading the optimizer's state and the weights may see of the engine."""

    table: ParameterTable
    kernels: ModuleType
    state_copies: StateCopies
    state_generation: int

    def check_state(self, head: StateHead) -> bool:
        """Whether the state ``head`` describes may be loaded (False: the same one is loaded
        already); raises the error for the worker otherwise."""

    def state_loaded(self, head: StateHead) -> None:
        """The state ``head`` describes was loaded."""

    def check_weights(self, digest: bytes, numel: int, version: int) -> bool:
        """Whether these weights may be loaded (False: the same are loaded already); raises
        the error for the worker otherwise."""

    def weights_loaded(self, digest: bytes, slot: Any) -> None:
        """The weights were written into ``slot``: publish them."""


class Job:
    """One entry of the update lane (see the module docstring)."""

    __slots__ = ()

    def prepare(self) -> int | None:
        """Plan the work; returns its size in elements, or None when there is no kernel."""
        return None

    def run(self) -> bool:
        """The kernel: touches only the arrays ``prepare`` chose. False: refused."""
        return True

    def commit(self, result: object) -> None:
        """Adopt or discard what ``run`` computed: ``result`` is its return value,
        or the exception it raised."""
        raise NotImplementedError

    def fail(self, exc: BaseException) -> None:
        """``prepare`` or ``commit`` raised ``exc``: give back what was claimed, answer the waiters."""


class CallJob(Job):
    """A state change without a kernel (a join, a leave): ``fn`` runs at its turn;
    ``on_failure(exc)`` if it raises."""

    __slots__ = ("fn", "on_failure")

    def __init__(self, fn: Callable[[], None], on_failure: Callable[[BaseException], None] | None = None) -> None:
        self.fn = fn
        self.on_failure = on_failure

    def commit(self, result: object) -> None:
        self.fn()

    def fail(self, exc: BaseException) -> None:
        if self.on_failure is not None:
            self.on_failure(exc)


class Reservation(Protocol):
    """Who holds the lane between jobs (a gradient applied while it arrives)."""

    def cancel(self) -> None:
        """The lane is needed: give back whatever was claimed (the lane is already free)."""


def run_kernel(kernel: Kernel) -> object:
    """``kernel()``, or the exception it raised (logged here; reported by the job's commit)."""
    try:
        return kernel()
    except Exception as exc:
        log.error("an update kernel failed", exc_info=exc)
        return exc


class UpdateLane:
    """The FIFO of state changes.

    Args:
        offload: runs a kernel off the loop (None: every kernel runs inline).
        threshold: jobs of at least this many elements are offloaded.
    """

    def __init__(self, offload: Offload | None, threshold: int) -> None:
        self._jobs: deque[Job] = deque()
        self._offload = offload
        self._threshold = threshold
        self._running = False
        self._busy = False
        self._reserved: Reservation | None = None

    @property
    def idle(self) -> bool:
        """True when nothing is queued, running or holding the lane."""
        return not self._jobs and not self._busy and self._reserved is None

    def reserve(self, holder: Reservation) -> bool:
        """Hold the idle lane for ``holder``; False when the lane is not idle."""
        if self._jobs or self._busy or self._running or self._reserved is not None:
            return False
        self._reserved = holder
        return True

    def unreserve(self, holder: Reservation) -> None:
        """``holder`` is done with the lane: run what queued meanwhile."""
        if self._reserved is holder:
            self._reserved = None
            self._run()

    def submit(self, job: Job, *, front: bool = False) -> None:
        """Queue ``job`` (``front``: ahead of everything queued) and run what can run."""
        if self._reserved is not None:
            holder, self._reserved = self._reserved, None
            holder.cancel()
        if front:
            self._jobs.appendleft(job)
        else:
            self._jobs.append(job)
        self._run()

    def _run(self) -> None:
        if self._running or self._busy or self._reserved is not None:
            return
        self._running = True
        try:
            while self._jobs and not self._busy:
                job = self._jobs.popleft()
                try:
                    size = job.prepare()
                    if size is None:
                        job.commit(True)
                    elif self._offload is not None and size >= self._threshold:
                        self._busy = True
                        self._offload(job.run, lambda result, job=job: self._finished(job, result))
                    else:
                        job.commit(run_kernel(job.run))
                except Exception as exc:  # one job's failure must not stall the others
                    self._busy = False
                    self._fail(job, exc)
        finally:
            self._running = False

    def _finished(self, job: Job, result: object) -> None:
        self._busy = False
        try:
            job.commit(result)
        except Exception as exc:
            self._fail(job, exc)
        finally:
            self._run()

    @staticmethod
    def _fail(job: Job, exc: Exception) -> None:
        log.error("%s failed in the update lane: %s: %s", type(job).__name__, type(exc).__name__, exc,
                  exc_info=exc)
        try:
            job.fail(exc)
        except Exception:  # its failure path failed too: what is left of it is lost, the lane goes on
            log.exception("the failure path of %s failed", type(job).__name__)
