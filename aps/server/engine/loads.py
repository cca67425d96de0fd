"""Loading a run's optimizer state and weights, and reading the state back: the
:class:`Loads` part of :class:`aps.server.engine.Engine` (a mixin, as
:mod:`aps.server.engine.durable` is), whose work runs as jobs of the update lane
(:mod:`aps.server.engine.jobs.state`) between two updates."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from ...errors import InvalidState, MalformedFrame, NotInitialized, PayloadSizeMismatch, ServerError, WeightsRefused
from ...wire.protocol import StateHead
from .jobs.state import LoadStateJob, LoadWeightsJob, ReadStateJob, StateCopy

if TYPE_CHECKING:
    from . import Engine
    from .members import Member

__all__ = ["Loads"]

log = logging.getLogger("aps.server")

ErrorCallback = Callable[[ServerError], None]


class Loads:
    """STATE, LOAD_STATE and LOAD_WEIGHTS on the engine (docs/protocol.md)."""

    # Optimizer state (docs/protocol.md, STATE and LOAD_STATE) ---------------
    def read_optimizer_state(self: Engine, member: Member, done: Callable[[StateCopy], None],
                             failed: ErrorCallback) -> None:
        """Copy the optimizer's state between two updates (a job of the update lane, see
        :mod:`aps.server.engine.jobs.state`) and call ``done`` with it: its step count, the weights version it
        belongs to, and every array of ``state_arrays()`` in one buffer of its own.

        Raises:
            NotInitialized: ``member`` has not joined.
        """
        if not member.joined or self.table is None:
            raise NotInitialized("STATE before a successful INIT")
        self._lane.submit(ReadStateJob(self, member, done, failed))

    def check_state(self: Engine, head: StateHead) -> bool:
        """Whether the state ``head`` describes can be loaded now: False when it is to be
        loaded, True when it was loaded into this run already (same digest: a no-op).

        Raises:
            NotInitialized: there is no model yet.
            MalformedFrame: ``head`` carries no digest.
            InvalidState: another optimizer, other arrays (or in another order), arrays
                not of the model's size, or another state when this run has applied
                updates (or loaded one with steps) already. Nothing changed.
        """
        table = self.table
        if table is None:
            raise NotInitialized("LOAD_STATE before a successful INIT")
        optimizer = table.optimizer
        if head.digest is None:
            raise MalformedFrame("a LOAD_STATE carries the state's digest")
        if head.optimizer != optimizer.name:
            raise InvalidState(f"the state is {head.optimizer}'s; this server runs {optimizer.name}")
        own = list(optimizer.loadable_state(head.arrays))
        if list(head.arrays) != own:
            extra = " (sgd keeps none without --momentum)" if optimizer.name == "sgd" and not own else ""
            raise InvalidState(f"the {optimizer.name} state holds the arrays {own}{extra}, in that order; the state "
                               f"to load holds {list(head.arrays)}")
        if head.numel != optimizer.numel:
            raise InvalidState(f"the state's arrays have {head.numel} elements each; the model has "
                               f"{optimizer.numel}" + (" on this shard" if self.config.shards > 1 else ""))
        if head.digest == self.loaded_state:
            return True
        if table.version == 0 and optimizer.steps == 0:
            return False
        if table.version == 0:
            raise InvalidState(f"another optimizer state ({optimizer.steps} steps) was loaded into this run already: "
                               "optimizer state can only be loaded into a run that has not started (loading the "
                               "same state again is allowed)")
        raise InvalidState(f"the server has applied {table.version} updates: optimizer state can only be loaded into "
                           "a run that has not started (loading the same state again is allowed)")

    def load_optimizer_state(self: Engine, member: Member, head: StateHead, arrays: dict[str, list[np.ndarray]],
                             done: Callable[[bool], None], failed: ErrorCallback) -> None:
        """Load a state into the optimizer between two updates (a job of the update lane, see
        :mod:`aps.server.engine.jobs.state`), once everything is checked again at its turn: ``done(True)``
        when loaded, ``done(False)`` when the same state was loaded already, ``failed``
        with the refusal (nothing changed). ``arrays``: each of ``head.arrays`` as a list
        of consecutive flat float32 pieces.

        Raises:
            NotInitialized: ``member`` has not joined.
        """
        if not member.joined or self.table is None:
            raise NotInitialized("LOAD_STATE before a successful INIT")
        self._lane.submit(LoadStateJob(self, head, arrays, done, failed))

    # Weights (docs/protocol.md, LOAD_WEIGHTS) ---------------------------------
    def check_weights(self: Engine, digest: bytes, numel: int, version: int) -> bool:
        """Whether weights of ``digest`` can be loaded now, sent by a worker that holds the
        weights of ``version``: False when they are to be loaded, True when they were loaded
        into this run already and the worker holds version 0 (a no-op: every rank of a job
        may load the same checkpoint).

        Raises:
            NotInitialized: there is no model yet.
            PayloadSizeMismatch: ``numel`` is not the model's (this shard's) size.
            WeightsRefused: other weights were loaded already, or the server has taken a
                gradient (computed on the weights it holds) or applied an update. Nothing changed.
        """
        table = self.table
        if table is None:
            raise NotInitialized("LOAD_WEIGHTS before a successful INIT")
        if numel != table.numel:
            raise PayloadSizeMismatch(f"LOAD_WEIGHTS of {numel} weights; the model has {table.numel}"
                                      + (" on this shard" if self.config.shards > 1 else ""))
        how = ("load them (model.load_state_dict) on every rank before its first step(), or resume the server "
               "from its own checkpoint (aps serve --resume)")
        if digest == self.loaded_weights and version == 0:
            return True
        if table.version > 0 or self.pushes > 0:
            taken = (f"applied {table.version} updates" if table.version > 0
                     else f"taken {self.pushes} gradients computed on its initial weights")
            raise WeightsRefused(f"the server has {taken}: weights can only be loaded before the first update; "
                                 f"{how}")
        if self.loaded_weights is not None:
            raise WeightsRefused("other weights were loaded into this run already (digest "
                                 f"{self.loaded_weights.hex()}): every rank must load the same weights (the same "
                                 "checkpoint)")
        return False

    def load_weights(self: Engine, member: Member, digest: bytes, values: np.ndarray, version: int,
                     done: Callable[[bool], None], failed: ErrorCallback) -> None:
        """Make ``values`` the server's weights between two updates (a job of the update lane,
        see :mod:`aps.server.engine.jobs.state`), once everything is checked again at its turn (see
        :meth:`check_weights`; the digest, every value finite): ``done(True)`` when loaded,
        ``done(False)`` when the same weights were loaded already, ``failed`` with the
        refusal (nothing changed).

        Raises:
            NotInitialized: ``member`` has not joined.
        """
        if not member.joined or self.table is None:
            raise NotInitialized("LOAD_WEIGHTS before a successful INIT")
        self._lane.submit(LoadWeightsJob(self, digest, values, version, done, failed))

    def weights_loaded(self: Engine, digest: bytes, slot) -> None:
        """Weights were written into ``slot`` (by a LoadWeightsJob): they are the current
        ones, still version 0."""
        self.table.replace(slot)
        for member in self.members.values():  # (the weights they were given are not these, though still version 0)
            member.keep_pulled(None)
        self.loaded_weights = digest
        self.narrowed.forget()  # narrowed copies of the weights they replace
        log.info("weights loaded: the run starts from them (digest %s)", digest.hex())

    def state_loaded(self: Engine, head: StateHead) -> None:
        """A state was loaded (by a LoadStateJob): remember its digest."""
        self.loaded_state = head.digest
        self.state_generation += 1
        log.info("optimizer state loaded: %s, %d steps (digest %s)", head.optimizer, head.steps, head.digest.hex())
