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

The jobs see the engine only through the owner each kind of job declares
beside it (``aps.server.engine.jobs.updates.UpdateOwner``: what computing a
gradient needs, and its reports back, which training implements;
``aps.server.engine.jobs.state.StateOwner``: what reading and loading the
optimizer's state and the weights needs, which the loads implement), and a
worker's place through its ``Member`` record. So the jobs import the lane,
the lane imports no job, and no job imports the engine.
"""

from __future__ import annotations

import functools
import logging
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

__all__ = ["CallJob", "Job", "Kernel", "Offload", "Reservation", "UpdateLane", "run_kernel"]

log = logging.getLogger("aps.server")

#: A kernel: computes into memory set aside by ``prepare``; False means refused.
Kernel = Callable[[], Any]
#: ``offload(kernel, done)``: runs ``kernel`` off the loop and calls ``done(result)`` back on it.
Offload = Callable[[Kernel, Callable[[object], None]], None]


class Job(ABC):
    """One entry of the update lane (see the module docstring): the family of the lane's
    kinds of work (a call, a gradient, an aggregate update, a state copy or load, a
    checkpoint's capture)."""

    __slots__ = ()

    def prepare(self) -> int | None:
        """Plan the work; returns its size in elements, or None when there is no kernel."""
        return None

    def run(self) -> object:
        """The kernel: touches only the arrays ``prepare`` chose. False: refused."""
        return True

    @abstractmethod
    def commit(self, result: object) -> None:
        """Adopt or discard what ``run`` computed: ``result`` is its return value,
        or the exception it raised."""

    def fail(self, exc: BaseException) -> None:  # noqa: B027  (a hook: a job that claims nothing gives nothing back)
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
                        self._offload(job.run, functools.partial(self._finished, job))
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
        log.error("%s failed in the update lane: %s: %s", type(job).__name__, type(exc).__name__, exc, exc_info=exc)
        try:
            job.fail(exc)
        except Exception:  # its failure path failed too: what is left of it is lost, the lane goes on
            log.exception("the failure path of %s failed", type(job).__name__)
