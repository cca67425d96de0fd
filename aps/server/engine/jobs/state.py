"""Reading and loading the optimizer's state (STATE, LOAD_STATE) and loading the weights
(LOAD_WEIGHTS): jobs of the update lane.

The optimizer's state is double-buffered: an update writes the next state
into the spare (on a helper thread for a large model, or piece by piece while
a gradient streams in) and its commit swaps the two on the loop. A job of the
update lane runs between two updates: submitting it cancels a streaming
push's reservation (that push then takes the ordinary path), and no other job
runs, and no push streams, until it has committed. So:

- :class:`ReadStateJob` copies the current arrays into a buffer of the
  reply's own (one copy, on the kernels' helper thread when large), with the
  step count and the weights version of that same moment. Readers that ask
  at the same moment share one copy; it is freed once their replies have left.
- :class:`LoadStateJob` checks everything (the run has not started, or the
  same state was loaded already; the digest; every value finite) before it
  writes anything, then copies the arrays into the current state, where no
  kernel reads or writes meanwhile.
- :class:`LoadWeightsJob` checks the same way (no update applied and no
  gradient taken yet, or the same weights loaded already; the digest; every
  value finite), then writes the weights into a free snapshot slot and makes it
  the current one, still version 0: a reply being sent from the old slot keeps
  its lease and its weights (docs/protocol.md, LOAD_WEIGHTS).
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from types import ModuleType
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from ..lane import Job
from ....errors import InternalServerError, InvalidState, ServerError, WeightsRefused
from ....wire.protocol import StateHead, encode_state_head, negative_second_moment, state_digest, weights_digest

if TYPE_CHECKING:
    from ..members import Member
    from ..table import ParameterTable, _Slot

__all__ = ["LoadStateJob", "LoadWeightsJob", "ReadStateJob", "StateCopies", "StateCopy", "StateOwner"]

log = logging.getLogger("aps.server")


class StateOwner(Protocol):
    """What the jobs reading and loading the optimizer's state and the weights may see of
    the engine (its loads part)."""

    @property
    def table(self) -> ParameterTable:
        """The model's weights table (a job runs once the model exists)."""

    @property
    def kernels(self) -> ModuleType:
        """The native module or its reference twin."""

    @property
    def state_copies(self) -> StateCopies:
        """The newest copy of the optimizer's state a reply still holds."""

    @property
    def state_generation(self) -> int:
        """Counts the loads: a state copy made before one is not the state after it."""

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


class StateCopy:
    """The optimizer's state at one moment, ready to send: ``head`` (the STATE reply's
    description) then ``arrays`` (every array end to end, in one buffer of its own)."""

    __slots__ = ("head", "arrays", "version", "__weakref__")

    def __init__(self, head: bytes, arrays: np.ndarray, version: int) -> None:
        self.head = head
        self.arrays = arrays
        self.version = version

    @property
    def nbytes(self) -> int:
        return len(self.head) + self.arrays.nbytes


class ReadStateJob(Job):
    """Copy the optimizer's state between two updates; ``done(copy)`` with it, or
    ``failed(error)``."""

    __slots__ = ("engine", "member", "done", "failed", "copy", "pairs")

    def __init__(
        self,
        engine: StateOwner,
        member: Member,
        done: Callable[[StateCopy], None],
        failed: Callable[[ServerError], None],
    ) -> None:
        self.engine = engine
        self.member = member
        self.done = done
        self.failed = failed
        self.copy: StateCopy | None = None
        self.pairs: list[tuple[np.ndarray, np.ndarray]] = []

    def prepare(self) -> int | None:
        if not self.member.connected:  # nobody to answer: copy nothing
            return None
        engine = self.engine
        table = engine.table
        optimizer = table.optimizer
        key = (table.version, optimizer.steps, engine.state_generation)
        kept = engine.state_copies.get(key)
        if kept is not None:  # another reader's copy of this very moment, still alive
            self.copy = kept
            return None
        sources = optimizer.state_arrays()
        numel = table.optimizer.numel
        head = encode_state_head(optimizer.name, optimizer.steps, numel, sources, version=table.version)
        arrays = np.empty(numel * len(sources), np.float32)
        self.pairs = [(arrays[i * numel : (i + 1) * numel], source) for i, source in enumerate(sources.values())]
        self.copy = StateCopy(head, arrays, table.version)
        engine.state_copies.keep(key, self.copy)
        return arrays.size or None

    def run(self) -> bool:
        for target, source in self.pairs:
            np.copyto(target, source)  # numpy lets go of the GIL for a plain copy
        return True

    def commit(self, result: object) -> None:
        if result is not True:
            self.fail(result if isinstance(result, BaseException) else RuntimeError("copying the state failed"))
            return
        copy, self.copy, self.pairs = self.copy, None, []
        if copy is not None:
            self.done(copy)

    def fail(self, exc: BaseException) -> None:
        if self.copy is not None:
            self.engine.state_copies.forget(self.copy)
            self.copy = None
        self.failed(InternalServerError(f"reading the optimizer's state failed: {type(exc).__name__}: {exc}"))


class LoadStateJob(Job):
    """Load a state received in pieces (each array a list of consecutive flat pieces) into
    the optimizer, between two updates, if everything about it is right; ``done(loaded)``
    (False: the same state was loaded already, nothing changed) or ``failed(error)``."""

    __slots__ = ("engine", "head", "arrays", "done", "failed", "loading", "outcome")

    def __init__(
        self,
        engine: StateOwner,
        head: StateHead,
        arrays: dict[str, list[np.ndarray]],
        done: Callable[[bool], None],
        failed: Callable[[ServerError], None],
    ) -> None:
        self.engine = engine
        self.head = head
        self.arrays = arrays
        self.done = done
        self.failed = failed
        self.loading = False
        self.outcome: object = None  # decided without a kernel (in prepare): what commit reports

    def prepare(self) -> int | None:
        # Checked again at its turn: an update may have been applied since the bytes arrived.
        try:
            self.loading = not self.engine.check_state(self.head)
        except InvalidState as exc:
            self.outcome = exc
            return None
        if not self.loading:
            self.outcome = True
            return None
        size = sum(part.size for parts in self.arrays.values() for part in parts)
        if not size:  # sgd without momentum: a step count and no arrays
            self.outcome = self.run()
            return None
        return size

    def run(self) -> object:
        head, arrays = self.head, self.arrays
        if state_digest(head.steps, (part for parts in arrays.values() for part in parts)) != head.digest:
            return InvalidState(
                "the arrays do not match the state's digest: they were damaged on the way, or the "
                "digest was computed otherwise (BLAKE2b-128 of steps as u64, then the arrays)"
            )
        optimizer = self.engine.table.optimizer
        problem = optimizer.state_problem(arrays, head.steps) or negative_second_moment(arrays)
        if problem is not None:
            return InvalidState(problem)
        # Checked whole: from here on nothing refuses it. No update reads or writes the
        # state while a job of the lane runs.
        optimizer.load_state(arrays, head.steps)
        return True

    def commit(self, result: object) -> None:
        if self.outcome is not None:
            result = self.outcome
        if isinstance(result, InvalidState):
            self.arrays = {}
            self.failed(result)
            return
        if result is not True:
            self.fail(result if isinstance(result, BaseException) else RuntimeError(str(result)))
            return
        self.arrays = {}
        if self.loading:
            self.engine.state_loaded(self.head)
        self.done(self.loading)

    def fail(self, exc: BaseException) -> None:
        self.arrays = {}
        if isinstance(exc, ServerError):  # refused at its turn (prepare): nothing changed
            self.failed(exc)
            return
        log.error("loading the optimizer's state failed: %s: %s", type(exc).__name__, exc)
        self.failed(InternalServerError(f"loading the optimizer's state failed: {type(exc).__name__}: {exc}"))


class LoadWeightsJob(Job):
    """Make ``values`` (a flat float32 array of the model's size, received whole) the
    server's weights, between two updates, if everything about them is right:
    ``done(loaded)`` (False: the same weights were loaded already, nothing changed) or
    ``failed(error)``. ``version``: the version of the weights the sender holds."""

    __slots__ = ("engine", "digest", "values", "version", "done", "failed", "slot", "outcome")

    def __init__(
        self,
        engine: StateOwner,
        digest: bytes,
        values: np.ndarray,
        version: int,
        done: Callable[[bool], None],
        failed: Callable[[ServerError], None],
    ) -> None:
        self.engine = engine
        self.digest = digest
        self.values: np.ndarray | None = values
        self.version = version
        self.done = done
        self.failed = failed
        self.slot: _Slot | None = None  # the free snapshot slot the weights are written into
        self.outcome: object = None  # decided without a kernel (in prepare): what commit reports

    def prepare(self) -> int | None:
        # Checked again at its turn: a gradient may have been taken since the bytes arrived.
        assert self.values is not None, "the values are let go of at the commit"
        try:
            kept = self.engine.check_weights(self.digest, self.values.size, self.version)
        except ServerError as exc:
            self.outcome = exc
            return None
        if kept:
            self.outcome = False
            return None
        self.slot = self.engine.table.begin_update()
        return self.values.size

    def run(self) -> object:
        values, slot = self.values, self.slot
        assert values is not None and slot is not None, "prepare claimed a slot for the values"
        if weights_digest((values,)) != self.digest:
            return WeightsRefused(
                "the weights do not match their digest: they were damaged on the way, or the "
                "digest was computed otherwise (BLAKE2b-128, person 'aps-weights', of the "
                "float32 bytes)"
            )
        if not self.engine.kernels.all_finite(values):
            index = int(np.flatnonzero(~np.isfinite(values))[0])
            return WeightsRefused(f"weight {index} is {values[index]}: every value must be finite")
        np.copyto(slot.array, values)  # a free slot: nobody reads it until it is published
        return True

    def commit(self, result: object) -> None:
        if self.outcome is not None:
            result = self.outcome
        self.values = None
        if isinstance(result, ServerError):
            self._give_back()
            self.failed(result)
            return
        if result is False:  # loaded already: a no-op
            self.done(False)
            return
        if result is not True:
            self.fail(result if isinstance(result, BaseException) else RuntimeError(str(result)))
            return
        slot, self.slot = self.slot, None
        self.engine.weights_loaded(self.digest, slot)
        self.done(True)

    def fail(self, exc: BaseException) -> None:
        self.values = None
        self._give_back()
        if isinstance(exc, ServerError):
            self.failed(exc)
            return
        log.error("loading the weights failed: %s: %s", type(exc).__name__, exc)
        self.failed(InternalServerError(f"loading the weights failed: {type(exc).__name__}: {exc}"))

    def _give_back(self) -> None:
        slot, self.slot = self.slot, None
        if slot is not None:
            self.engine.table.abandon(slot)


class StateCopies:
    """The last state copy made, as long as a reply still holds it, so that readers asking
    at the same moment share one copy and nothing is kept after.

    A transport sending a reply holds the copy's ``arrays`` (a view of them), not the
    :class:`StateCopy` around them: both are referred to weakly, and while the arrays are
    still on their way a copy is made around them again."""

    __slots__ = ("_key", "_copy", "_arrays", "_head", "_version")

    def __init__(self) -> None:
        self._key: tuple | None = None
        self._copy: weakref.ref[StateCopy] | None = None
        self._arrays: weakref.ref[np.ndarray] | None = None
        self._head = b""
        self._version = 0

    def get(self, key: tuple) -> StateCopy | None:
        """The copy of the state at ``key`` (version, steps, generation), if a reply still holds it."""
        if self._arrays is None or self._copy is None or key != self._key:
            return None
        copy = self._copy()
        if copy is None:
            arrays = self._arrays()
            if arrays is None:
                return None
            copy = StateCopy(self._head, arrays, self._version)
            self._copy = weakref.ref(copy)
        return copy

    def keep(self, key: tuple, copy: StateCopy) -> None:
        self._key, self._head, self._version = key, copy.head, copy.version
        self._copy, self._arrays = weakref.ref(copy), weakref.ref(copy.arrays)

    def forget(self, copy: StateCopy) -> None:
        if self._arrays is not None and self._arrays() is copy.arrays:
            self._key = self._copy = self._arrays = None
            self._head = b""
