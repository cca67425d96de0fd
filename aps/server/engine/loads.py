"""Loading a run's optimizer state and weights, and reading the state back (STATE,
LOAD_STATE and LOAD_WEIGHTS, docs/protocol.md).

A part of the engine of its own because these requests replace what training computes
on, and must do it between two updates and only while the run allows it: each is
checked when it arrives and again at its turn in the update lane, where its job runs
(:mod:`aps.server.engine.jobs.state`, whose :class:`~aps.server.engine.jobs.state.StateOwner`
this part implements). It remembers what was loaded (the digests, kept in checkpoints,
so that loading the same again is a no-op) and shares one copy of the state among the
readers of one moment. Of training it needs one count, through :class:`Taken`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from types import ModuleType
from typing import TYPE_CHECKING, Protocol

import numpy as np

from ...config import ServerConfig
from ...errors import InvalidState, MalformedFrame, NotInitialized, PayloadSizeMismatch, WeightsRefused
from ...wire.protocol import StateHead
from .jobs.state import LoadStateJob, LoadWeightsJob, ReadStateJob, StateCopies, StateCopy
from .lane import UpdateLane
from .members import ErrorCallback, Member, Roster
from .model import Model

if TYPE_CHECKING:
    from .table import ParameterTable, _Slot

__all__ = ["Loads", "Taken"]

log = logging.getLogger("aps.server")


class Taken(Protocol):
    """What the loads read of training: weights may be loaded only before any gradient is taken."""

    @property
    def pushes(self) -> int:
        """Gradients committed in this run."""


class Loads:
    """STATE, LOAD_STATE and LOAD_WEIGHTS on the engine (see the module docstring).

    Args:
        config: the server's options.
        model: the model whose state and weights are read and replaced.
        roster: the members (the weights they were given are let go of when new ones are loaded).
        training: how many gradients were taken.
        lane: the update lane the jobs run in.
    """

    def __init__(self, config: ServerConfig, model: Model, roster: Roster, training: Taken, lane: UpdateLane) -> None:
        self.config = config
        self.model = model
        self.roster = roster
        self.training = training
        self.lane = lane
        self.kernels: ModuleType = model.kernels
        #: The digest of the optimizer state loaded into this run (LOAD_STATE), if any: kept in
        #: checkpoints, so that loading the same state again is a no-op, not a refusal.
        self.loaded_state: bytes | None = None
        #: The digest of the weights loaded into this run (LOAD_WEIGHTS), if any: kept in
        #: checkpoints, so that every rank may load the same weights, once taken.
        self.loaded_weights: bytes | None = None
        #: Counts the loads: a state copy made before one is not the state after it.
        self.state_generation = 0
        #: The newest copy of the optimizer's state that a STATE reply still holds (aps.server.engine.jobs.state).
        self.state_copies = StateCopies()

    @property
    def table(self) -> ParameterTable:
        """The model's weights table: the jobs run once it exists."""
        table = self.model.table
        assert table is not None, "a load runs once the model exists"
        return table

    # Optimizer state (docs/protocol.md, STATE and LOAD_STATE) ---------------
    def read_optimizer_state(self, member: Member, done: Callable[[StateCopy], None], failed: ErrorCallback) -> None:
        """Copy the optimizer's state between two updates (a job of the update lane, see
        :mod:`aps.server.engine.jobs.state`) and call ``done`` with it: its step count, the weights version it
        belongs to, and every array of ``state_arrays()`` in one buffer of its own.

        Raises:
            NotInitialized: ``member`` has not joined.
        """
        if not member.joined or self.model.table is None:
            raise NotInitialized("STATE before a successful INIT")
        self.lane.submit(ReadStateJob(self, member, done, failed))

    def check_state(self, head: StateHead) -> bool:
        """Whether the state ``head`` describes can be loaded now: False when it is to be
        loaded, True when it was loaded into this run already (same digest: a no-op).

        Raises:
            NotInitialized: there is no model yet.
            MalformedFrame: ``head`` carries no digest.
            InvalidState: another optimizer, other arrays (or in another order), arrays
                not of the model's size, or another state when this run has applied
                updates (or loaded one with steps) already. Nothing changed.
        """
        table = self.model.table
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
            raise InvalidState(
                f"the {optimizer.name} state holds the arrays {own}{extra}, in that order; the state "
                f"to load holds {list(head.arrays)}"
            )
        if head.numel != optimizer.numel:
            raise InvalidState(
                f"the state's arrays have {head.numel} elements each; the model has "
                f"{optimizer.numel}" + (" on this shard" if self.config.shards > 1 else "")
            )
        if head.digest == self.loaded_state:
            return True
        if table.version == 0 and optimizer.steps == 0:
            return False
        if table.version == 0:
            raise InvalidState(
                f"another optimizer state ({optimizer.steps} steps) was loaded into this run already: "
                "optimizer state can only be loaded into a run that has not started (loading the "
                "same state again is allowed)"
            )
        raise InvalidState(
            f"the server has applied {table.version} updates: optimizer state can only be loaded into "
            "a run that has not started (loading the same state again is allowed)"
        )

    def load_optimizer_state(
        self,
        member: Member,
        head: StateHead,
        arrays: dict[str, list[np.ndarray]],
        done: Callable[[bool], None],
        failed: ErrorCallback,
    ) -> None:
        """Load a state into the optimizer between two updates (a job of the update lane, see
        :mod:`aps.server.engine.jobs.state`), once everything is checked again at its turn: ``done(True)``
        when loaded, ``done(False)`` when the same state was loaded already, ``failed``
        with the refusal (nothing changed). ``arrays``: each of ``head.arrays`` as a list
        of consecutive flat float32 pieces.

        Raises:
            NotInitialized: ``member`` has not joined.
        """
        if not member.joined or self.model.table is None:
            raise NotInitialized("LOAD_STATE before a successful INIT")
        self.lane.submit(LoadStateJob(self, head, arrays, done, failed))

    # Weights (docs/protocol.md, LOAD_WEIGHTS) ---------------------------------
    def check_weights(self, digest: bytes, numel: int, version: int) -> bool:
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
        table = self.model.table
        if table is None:
            raise NotInitialized("LOAD_WEIGHTS before a successful INIT")
        if numel != table.numel:
            raise PayloadSizeMismatch(
                f"LOAD_WEIGHTS of {numel} weights; the model has {table.numel}"
                + (" on this shard" if self.config.shards > 1 else "")
            )
        how = (
            "load them (model.load_state_dict) on every rank before its first step(), or resume the server "
            "from its own checkpoint (aps serve --resume)"
        )
        if digest == self.loaded_weights and version == 0:
            return True
        if table.version > 0 or self.training.pushes > 0:
            taken = (
                f"applied {table.version} updates"
                if table.version > 0
                else f"taken {self.training.pushes} gradients computed on its initial weights"
            )
            raise WeightsRefused(f"the server has {taken}: weights can only be loaded before the first update; {how}")
        if self.loaded_weights is not None:
            raise WeightsRefused(
                "other weights were loaded into this run already (digest "
                f"{self.loaded_weights.hex()}): every rank must load the same weights (the same "
                "checkpoint)"
            )
        return False

    def load_weights(
        self,
        member: Member,
        digest: bytes,
        values: np.ndarray,
        version: int,
        done: Callable[[bool], None],
        failed: ErrorCallback,
    ) -> None:
        """Make ``values`` the server's weights between two updates (a job of the update lane,
        see :mod:`aps.server.engine.jobs.state`), once everything is checked again at its turn (see
        :meth:`check_weights`; the digest, every value finite): ``done(True)`` when loaded,
        ``done(False)`` when the same weights were loaded already, ``failed`` with the
        refusal (nothing changed).

        Raises:
            NotInitialized: ``member`` has not joined.
        """
        if not member.joined or self.model.table is None:
            raise NotInitialized("LOAD_WEIGHTS before a successful INIT")
        self.lane.submit(LoadWeightsJob(self, digest, values, version, done, failed))

    def weights_loaded(self, digest: bytes, slot: _Slot) -> None:
        """Weights were written into ``slot`` (by a LoadWeightsJob): they are the current
        ones, still version 0."""
        self.table.replace(slot)
        for member in self.roster.members.values():  # (the weights they were given are not these, still version 0)
            member.keep_pulled(None)
        self.loaded_weights = digest
        self.model.narrowed.forget()  # narrowed copies of the weights they replace
        log.info("weights loaded: the run starts from them (digest %s)", digest.hex())

    def state_loaded(self, head: StateHead) -> None:
        """A state was loaded (by a LoadStateJob): remember its digest."""
        digest = self.loaded_state = head.digest
        self.state_generation += 1
        log.info(
            "optimizer state loaded: %s, %d steps (digest %s)",
            head.optimizer,
            head.steps,
            digest.hex() if digest is not None else None,
        )
