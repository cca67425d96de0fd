"""The requests about the optimizer: per-group values (HYPER), its state read (STATE) and
loaded (LOAD_STATE), and the weights loaded (LOAD_WEIGHTS).

A load is read piece by piece and checked before anything is kept
(:mod:`aps.server.requests.intake`): its description or digest first, against the model
and the run, and room for its arrays only then, as their bytes arrive.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

from ...errors import DTypeMismatch, InvalidHyperparameters, MalformedFrame, NotInitialized, PayloadSizeMismatch
from ...wire.protocol import (
    MAX_HYPER_BYTES,
    MAX_HYPER_GROUPS,
    WEIGHTS_DIGEST_BYTES,
    Flag,
    Op,
    decode_hyper,
    pack_header,
)
from .base import CHECK, FLOAT32, Handler, dtype_name
from .intake import STATE_FIXED, StateIntake, WeightsIntake

if TYPE_CHECKING:
    from ..engine.jobs.state import StateCopy
    from .base import Exchange, Request

__all__ = ["HANDLERS", "Hyper", "LoadState", "LoadWeights", "State"]


class Hyper(Handler):
    """HYPER: per-group optimizer values (and stops), checked against the model."""

    op = Op.HYPER

    def admit(self, conn: Exchange, request: Request) -> memoryview | None:
        # Checked against the model once it arrives; nothing is read for a stranger.
        length = request.header.length
        if conn.member is None:
            raise NotInitialized("HYPER before a successful INIT: the groups are checked against the model")
        if length > MAX_HYPER_BYTES:
            raise InvalidHyperparameters(
                f"HYPER of {length} bytes: at most {MAX_HYPER_GROUPS} groups ({MAX_HYPER_BYTES} bytes) are accepted"
            )
        return memoryview(bytearray(length)) if length else None

    def handle(self, conn: Exchange, request: Request, payload: memoryview) -> None:
        conn.engine.training.set_hyperparameters(
            conn.require_member(), decode_hyper(payload), check_only=bool(request.header.flags & CHECK)
        )
        conn.reply(request, Op.HYPER_REPLY)


class State(Handler):
    """STATE: a copy of the optimizer's state (made off the loop), sent as it is."""

    op = Op.STATE

    def handle(self, conn: Exchange, request: Request, payload: memoryview) -> None:
        conn.engine.loads.read_optimizer_state(
            conn.require_member(), functools.partial(_send_state, conn, request), functools.partial(conn.fail, request)
        )


def _send_state(conn: Exchange, request: Request, copy: StateCopy) -> None:
    frame = pack_header(Op.STATE_REPLY, 0, FLOAT32, request.rid, 0, copy.version, copy.nbytes) + copy.head
    # The transport keeps the copy alive until it has sent it: one reply per connection.
    parts = (frame, copy.arrays.data.cast("B")) if copy.arrays.size else (frame,)
    conn.reply_parts(parts, len(frame) + copy.arrays.nbytes)


class LoadState(Handler):
    """LOAD_STATE: an optimizer state to load (Flag.CHECK: whether it could be, first)."""

    op = Op.LOAD_STATE

    def admit(self, conn: Exchange, request: Request) -> memoryview | None:
        # Its description first, checked against the model and the run; room for the
        # arrays only then, and only as their bytes arrive (more).
        header = request.header
        if conn.member is None:
            raise NotInitialized("LOAD_STATE before a successful INIT")
        if header.dtype != FLOAT32:
            raise DTypeMismatch(f"an optimizer state is float32, not {dtype_name(header.dtype)}")
        if header.length < STATE_FIXED:
            raise MalformedFrame(f"LOAD_STATE payload of {header.length} bytes is too short")
        intake = request.intake = StateIntake()
        return intake.fixed

    def more(self, conn: Exchange, request: Request, got: int) -> memoryview | None:
        assert isinstance(request.intake, StateIntake)
        return request.intake.next_part(conn.engine, request.header, got)

    def handle(self, conn: Exchange, request: Request, payload: memoryview) -> None:
        member = conn.require_member()
        intake, request.intake = request.intake, None
        assert isinstance(intake, StateIntake)
        head = intake.check(conn.engine, request.header)
        if request.header.flags & CHECK or intake.kept:  # (CHECK: a sharded worker asks every shard first)
            _state_loaded(conn, request, not intake.kept)
            return
        conn.engine.loads.load_optimizer_state(
            member,
            head,
            intake.arrays,
            functools.partial(_state_loaded, conn, request),
            functools.partial(conn.fail, request),
        )


def _state_loaded(conn: Exchange, request: Request, loaded: bool) -> None:
    conn.reply(request, Op.LOAD_STATE_REPLY, version=conn.engine.version, flags=0 if loaded else Flag.DROPPED)


class LoadWeights(Handler):
    """LOAD_WEIGHTS: weights to load, with their digest (Flag.CHECK: the digest alone, first)."""

    op = Op.LOAD_WEIGHTS

    def admit(self, conn: Exchange, request: Request) -> memoryview | None:
        # Its digest first, checked against the run; room for the weights only then, and
        # only when they are to be loaded (more).
        header, member, table = request.header, conn.member, conn.engine.model.table
        if member is None or not member.joined or table is None:
            raise NotInitialized("LOAD_WEIGHTS before a successful INIT")
        if header.dtype != FLOAT32:
            raise DTypeMismatch(f"weights are float32, not {dtype_name(header.dtype)}")
        numel = table.numel
        expected = WEIGHTS_DIGEST_BYTES + (0 if header.flags & CHECK else 4 * numel)
        if header.length != expected:
            what = (
                "its digest alone (CHECK)"
                if header.flags & CHECK
                else f"a {WEIGHTS_DIGEST_BYTES}-byte digest and {numel} float32 weights"
            )
            raise PayloadSizeMismatch(f"LOAD_WEIGHTS payload of {header.length} bytes; {what} take {expected}")
        intake = request.intake = WeightsIntake(numel)
        return intake.digest

    def more(self, conn: Exchange, request: Request, got: int) -> memoryview | None:
        assert isinstance(request.intake, WeightsIntake)
        return request.intake.next_part(conn.engine, request.header, got)

    def handle(self, conn: Exchange, request: Request, payload: memoryview) -> None:
        member = conn.require_member()
        intake, request.intake = request.intake, None
        assert isinstance(intake, WeightsIntake)
        header = request.header
        intake.check(conn.engine, header)
        if header.flags & CHECK or intake.kept:  # (CHECK: a sharded worker asks every shard first)
            _weights_loaded(conn, request, not intake.kept)
            return
        assert intake.values is not None
        conn.engine.loads.load_weights(
            member,
            bytes(intake.digest),
            intake.values,
            header.version,
            functools.partial(_weights_loaded, conn, request),
            functools.partial(conn.fail, request),
        )


def _weights_loaded(conn: Exchange, request: Request, loaded: bool) -> None:
    conn.reply(request, Op.LOAD_WEIGHTS_REPLY, version=conn.engine.version, flags=0 if loaded else Flag.DROPPED)


#: This module's handlers (aps.server.requests.HANDLERS gathers them).
HANDLERS = (Hyper(), State(), LoadState(), LoadWeights())
