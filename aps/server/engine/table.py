"""The flat parameter table: the model's weights, versioned, in snapshot slots.

The weights of every version live in a *slot*, one flat float32 vector. An
update never writes the slot readers may be looking at: the optimizer reads
the current slot and writes the next version into a free one, in the same
single pass an in-place update would take, and only then is the new slot
published as current. A pull takes a *lease* on the current slot and holds it
until its reply has left the process (a slow socket may still be draining it
after several more updates); a leased slot is never reused. So every pull
returns the weights of exactly one version, whatever else is going on
(docs/algorithms.md, "Snapshot consistency").

Slots are allocated on demand and recycled; there are at most three plus
the number of replies still in flight (each connection has at most one: it
reads no further request until its reply has left). A worker joining a running
model will hold one more lease: :meth:`ParameterTable.add_spare` makes that
slot ahead, off the loop and off the update lane, its pages already faulted in
(a fresh 64 MiB slot costs its first writer some 50-80 ms of page faults, which
the lane would otherwise pay in the middle of everyone's updates).
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from ...layout import Layout, line_aligned
from .optim import Optimizer

if TYPE_CHECKING:
    from .compensation import Compensation

__all__ = ["ParameterTable", "Snapshot"]


class HeapBlock:
    """A slot's memory when nothing needs to share it: a plain array.

    The table accepts any block with the same attributes; the shared-memory
    transport gives it :class:`aps.wire.segments.Segment` (a memfd).
    """

    __slots__ = ("id", "fd", "array", "nbytes")
    _ids = itertools.count(1)

    def __init__(self, numel: int, *, populate: bool = False) -> None:
        self.id = next(self._ids)
        self.fd = -1
        self.array = line_aligned(numel)  # (whole cache lines for the kernels' streaming stores)
        if populate:  # its pages faulted in now, not by its first writer (numpy lets go of the GIL)
            self.array.fill(0)
        self.nbytes = self.array.nbytes

    def close(self) -> None:
        pass


class _Slot:
    __slots__ = ("block", "array", "bytes", "leases")

    def __init__(self, block) -> None:
        self.block = block
        self.array = block.array
        self.bytes = memoryview(block.array).cast("B")
        self.leases = 0


class Snapshot:
    """A lease on the weights of one version. Call :meth:`release` when done reading.

    Attributes:
        version: the version these weights are.
        array: the flat float32 weights (read-only by contract).
        bytes: the same memory as a byte view, for sending.
    """

    __slots__ = ("version", "_slot")

    def __init__(self, slot: _Slot, version: int) -> None:
        self._slot = slot
        self.version = version
        slot.leases += 1

    @property
    def array(self) -> np.ndarray:
        return self._slot.array

    @property
    def bytes(self) -> memoryview:
        return self._slot.bytes

    @property
    def segment(self):
        """The memory block holding these weights (its ``id``, and ``fd`` when shared)."""
        return self._slot.block

    def again(self) -> Snapshot:
        """One more lease on the same weights (released on its own)."""
        return Snapshot(self._slot, self.version)

    def release(self) -> None:
        """End the lease (idempotent)."""
        slot, self._slot = self._slot, None  # type: ignore[assignment]  # a released lease reads no slot again
        if slot is not None:
            slot.leases -= 1

    def __enter__(self) -> Snapshot:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


#: Updates over which the table remembers how many slots were in use at once (see begin_update).
SLOT_MEMORY = 256


class ParameterTable:
    """Versioned flat weights with out-of-place updates.

    Args:
        layout: the model's layout.
        initial: the initial flat weights (copied).
        optimizer: the update rule and its state.
        allocate: returns a new memory block of the given length in float32
            elements (:class:`HeapBlock` by default; the shared-memory
            transport allocates memfd segments that workers can map), its
            pages faulted in when called with ``populate=True``.
    """

    def __init__(
        self,
        layout: Layout,
        initial: np.ndarray,
        optimizer: Optimizer,
        allocate: Callable[..., Any] | None = None,
    ) -> None:
        if initial.shape != (layout.numel,):
            raise ValueError(f"initial weights have shape {initial.shape}, the layout needs ({layout.numel},)")
        self.layout = layout
        self.optimizer = optimizer
        #: The delay compensation stale gradients get (aps.server.engine.compensation), or None.
        self.compensation: Compensation | None = None
        self._allocate: Callable[..., Any] = allocate or HeapBlock
        self._slots: list[_Slot] = []
        self._spare_coming = self._closed = False
        self._spare_lock = threading.Lock()
        self._spare: Any = None  # made on the background thread, not yet taken in (add_spare)
        # The most slots in use at once (leased, or current) in this window of updates and in the last.
        self._peak = self._kept_peak = self._updates = 0
        self._current = self._new_slot()
        np.copyto(self._current.array, initial)
        self.version = 0

    @property
    def numel(self) -> int:
        return self.layout.numel

    @property
    def slot_count(self) -> int:
        return len(self._slots)

    @property
    def weights(self) -> np.ndarray:
        """The current weights (a read-only view; changes on the next publish)."""
        view = self._current.array.view()
        view.flags.writeable = False
        return view

    def snapshot(self) -> Snapshot:
        """Lease the current version."""
        return Snapshot(self._current, self.version)

    def current_array(self) -> np.ndarray:
        return self._current.array

    def begin_update(self) -> _Slot:
        """A free slot to write the next version into (not current, not leased).

        The table keeps as many slots as were in use at once over the last
        :data:`SLOT_MEMORY` updates or so, plus two, and gives back free slots
        beyond that: many readers, whose leases come and go, reuse the same
        slots instead of making and mapping new ones at every turn (a fresh
        shared-memory slot costs the server and every worker page faults and
        a descriptor), while a burst of slow readers does not keep its memory.
        """
        free = [slot for slot in self._slots if slot.leases == 0 and slot is not self._current]
        in_use = len(self._slots) - len(free)
        self._peak = max(self._peak, in_use)
        self._updates += 1
        if self._updates >= SLOT_MEMORY:  # a new window: remember the last one's peak
            self._kept_peak, self._peak, self._updates = self._peak, in_use, 0
        keep = max(self._peak, self._kept_peak) + 2 - in_use  # free slots worth keeping
        if len(free) > keep:
            for extra in free[keep:]:
                self._slots.remove(extra)
                extra.block.close()
        slot = free[0] if free else self._new_slot()
        slot.leases = 1  # reserved for the writer until publish/abandon
        return slot

    def publish(self, slot: _Slot) -> int:
        """Make ``slot`` (from :meth:`begin_update`) the current version; returns the new version."""
        slot.leases -= 1
        self._current = slot
        self.version += 1
        return self.version

    def advance(self) -> int:
        """A new version with the same weights (an update of the model's tables alone);
        returns it."""
        self.version += 1
        return self.version

    def replace(self, slot: _Slot) -> None:
        """Make ``slot`` (from :meth:`begin_update`) the current weights without a new
        version: weights loaded before the first update (LOAD_WEIGHTS). Readers of the
        old slot keep their lease on it, as after a publish."""
        slot.leases -= 1
        self._current = slot

    def abandon(self, slot: _Slot) -> None:
        """Give back a slot from :meth:`begin_update` without publishing it."""
        slot.leases -= 1

    def slot_ids(self) -> set[int]:
        """The ids of the blocks of every slot the table keeps."""
        return {slot.block.id for slot in self._slots}

    def add_spare(self, background: Callable[[Callable[[], object], Callable[[object], None]], None]) -> None:
        """Make one more free slot, unless two are free already: a worker is joining, and
        its lease will keep one more slot in use. ``background(make, done)`` runs ``make``
        on another thread (the allocation, and the page faults of the slot's first write,
        stay out of the loop and the update lane) and calls ``done`` on the loop with its
        result (the block, or the exception it raised: then the slot is made when needed,
        as without a spare). One spare at a time."""
        free = sum(1 for slot in self._slots if slot.leases == 0 and slot is not self._current)
        if self._spare_coming or self._closed or free >= 2:
            return
        self._spare_coming = True
        numel, lock = self.layout.numel, self._spare_lock

        def make():
            block = self._allocate(numel, populate=True)
            with lock:  # (on the background thread: the table may be closing)
                if self._closed:
                    block.close()
                    return None
                self._spare = block  # close() gives it back if ``made`` never runs (the loop stopped)
            return block

        def made(block) -> None:
            self._spare_coming = False
            if block is None or isinstance(block, BaseException):
                return
            with lock:
                if self._spare is block:
                    self._spare = None
                closed = self._closed
            if closed:
                block.close()  # (closing twice is nothing)
            else:
                self._slots.append(_Slot(block))

        background(make, made)

    def close(self) -> None:
        """Give back every block (the server is stopping), a spare still on its way too."""
        with self._spare_lock:
            self._closed = True
            spare, self._spare = self._spare, None
        if spare is not None:
            spare.close()
        for slot in self._slots:
            slot.block.close()
        self.optimizer.threads.close()

    def _new_slot(self) -> _Slot:
        slot = _Slot(self._allocate(self.layout.numel))
        self._slots.append(slot)
        return slot
