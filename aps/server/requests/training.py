"""The requests of training: INIT (join, with the model's initial weights or without), PULL,
PUSH, PUSH_PULL (with rows or without), LEAVE and PING, and the weights replies they end with.

A push's gradient goes where the transport says (:meth:`aps.server.transport.Transport.gradient_destination`:
straight into the worker's receive buffer over TCP, read in place from its segment over
shared memory); a large one is applied while it arrives when the engine allows it (a
streaming push). The engine answers through callbacks bound to the request, never to the
connection's state: a reply is the request's.
"""

from __future__ import annotations

import functools
import logging
from typing import TYPE_CHECKING

import numpy as np

from ...errors import (
    DTypeMismatch,
    InternalServerError,
    MalformedFrame,
    NonFiniteGradient,
    NotInitialized,
    OutOfOrder,
    ServerError,
    ServerOverloaded,
)
from ...wire.protocol import ANY_RANK, INIT_HEAD_BYTES, MAX_LAYOUT_BYTES, Flag, Op, encode_seated
from ...wire.quantized import Quantized, scales_problem
from .base import (
    DROPPED,
    FLOAT32,
    GATE,
    HALF,
    NARROW,
    QUANTIZED,
    SKIP,
    Handler,
    check_gradient_dtype,
    dtype_name,
    op_name,
    read_whole,
)
from .intake import InitIntake
from .rows import request_rows, rows_destination, rows_of_reply, rows_room

if TYPE_CHECKING:
    from ..engine.members import PushResult
    from ..engine.table import Snapshot
    from .base import Exchange, Request

__all__ = ["HANDLERS", "Init", "Leave", "Ping", "Pull", "Push", "PushPull"]

log = logging.getLogger("aps.server")


class Ping(Handler):
    """PING: the model's version, and proof of life."""

    op = Op.PING

    def handle(self, conn: Exchange, request: Request, payload: memoryview) -> None:
        conn.reply(request, Op.PING_REPLY, version=conn.engine.version)


class Init(Handler):
    """INIT: join as a rank. The layout block is read and checked first; room for the values
    is made only if this worker provides the model's initial weights (else they are dropped)."""

    op = Op.INIT

    def admit(self, conn: Exchange, request: Request) -> memoryview | None:
        header = request.header
        length = header.length
        if conn.member is not None:
            raise OutOfOrder(f"this connection already joined as rank {conn.member.rank}")
        if header.dtype != FLOAT32:
            raise DTypeMismatch(f"initial weights dtype is {dtype_name(header.dtype)}; models are float32")
        if length < INIT_HEAD_BYTES:
            raise MalformedFrame(f"INIT payload of {length} bytes is too short")
        block = header.version  # the INIT header's version field: the layout block's length
        if not INIT_HEAD_BYTES <= block <= min(length, MAX_LAYOUT_BYTES) or block % 8:
            raise MalformedFrame(
                f"INIT layout block of {block} bytes in a {length}-byte payload: it must be a multiple "
                f"of 8 from {INIT_HEAD_BYTES} to {MAX_LAYOUT_BYTES} bytes"
            )
        # Only the layout block, for now: room for the values is made once the block is
        # checked, and only if they are needed (more).
        intake = request.intake = InitIntake(block, conn.guard)
        return intake.next_piece(0)

    def more(self, conn: Exchange, request: Request, got: int) -> memoryview | None:
        intake, engine = request.intake, conn.engine
        assert isinstance(intake, InitIntake)
        try:
            if got < intake.block_bytes:
                return intake.next_piece(got)
            init = intake.check(engine, request.header.length)
        except ServerOverloaded:
            engine.stats.strangers["layout_refused"] += 1
            intake.release()
            raise
        if not engine.membership.claim_registration(init.layout, conn):
            return None  # the model exists, or another worker's values are on their way
        intake.registering = True
        intake.values = np.empty(init.layout.numel, np.float32)
        return intake.values.data.cast("B")

    def handle(self, conn: Exchange, request: Request, payload: memoryview) -> None:
        header, engine, intake = request.header, conn.engine, request.intake
        assert isinstance(intake, InitIntake)
        try:
            init = intake.check(engine, header.length)  # checked already, unless there were no values
            if init.rank == ANY_RANK and not header.flags & Flag.SEAT:
                raise MalformedFrame(
                    "an INIT asking for any rank must ask for its seat (Flag.SEAT): it would not learn its rank"
                )
            request.seat_notice = bool(header.flags & Flag.SEAT)
            rank = request.rank = engine.membership.assign_rank() if init.rank == ANY_RANK else init.rank
            values, intake.values = intake.values, None  # the engine's now: not kept here while INIT waits
            member = engine.membership.join(
                rank,
                init.num_workers,
                init.layout,
                values,
                functools.partial(_joined, conn, request),
                functools.partial(_join_failed, conn, request),
                grad=conn.transport.gradient_buffer(init),
                rejoin=bool(header.flags & Flag.REJOIN) and rank == init.rank,
                clock=header.clock,
            )
        except BaseException:
            request.end_intake(engine, conn)
            raise
        if member.connected:  # not refused while joining
            conn.member = member
            log.debug("%s: INIT as rank %d over %s", conn.peer, member.rank, conn.transport.kind)


class Pull(Handler):
    """PULL: the weights (dense, narrowed to 16 bits over TCP if asked, and/or rows)."""

    op = Op.PULL
    carries_rows = True

    def admit(self, conn: Exchange, request: Request) -> memoryview | None:
        check_narrowing(conn, request)
        if request.rows:
            return rows_destination(conn, request)
        return read_whole(request.header, 0)

    def more(self, conn: Exchange, request: Request, got: int) -> memoryview | None:
        return rows_room(request, got)

    def handle(self, conn: Exchange, request: Request, payload: memoryview) -> None:
        member = conn.require_member()
        request_rows(conn, member, request, payload)
        member.dense_wanted = request.dense_reply  # (rows alone: it keeps the weights it had)
        conn.engine.training.pull(member, functools.partial(_weights_ready, conn, request, Op.PULL_REPLY))


class Push(Handler):
    """PUSH: a gradient (dense and/or rows), applied as the sync policy says; the reply says
    the version it made, or that it was dropped."""

    op = Op.PUSH
    carries_rows = True

    def more(self, conn: Exchange, request: Request, got: int) -> memoryview | None:
        return rows_room(request, got)

    def admit(self, conn: Exchange, request: Request) -> memoryview | None:
        if request.header.flags & GATE:
            if request.rows:
                raise MalformedFrame("a PUSH that waits at the gate (GATE) carries a dense gradient alone, no rows")
            if conn.engine.policy.name == "bsp":  # (a round takes gradients of its own weights: no pipelining)
                raise MalformedFrame("a PUSH that waits at the gate (GATE) is for asp, ssp, dssp or softsync, not bsp")
        return push_destination(conn, request)

    def handle(self, conn: Exchange, request: Request, payload: memoryview) -> None:
        member = conn.require_member()
        header, training = request.header, conn.engine.training
        if (
            header.flags & GATE
            and conn.engine.policy.is_held(member.rank)
            and not training.is_duplicate(member, header.request_id, header.clock)  # (answered at once)
        ):
            # Held after its last push: this one waits at the gate as a pull would (its
            # gradient stays in the worker's receive buffer: the next frame waits its turn).
            member.dense_wanted = False  # (the weights it is released with are not pulled)
            training.wait(member, functools.partial(_released_then_push, conn, request, payload), gate=True)
            return
        push(conn, request, payload, functools.partial(_pushed, conn, request))


def _released_then_push(conn: Exchange, request: Request, payload: memoryview, snap: Snapshot, clock: int) -> None:
    """A push that waited at the gate (Flag.GATE): the worker may go on; apply it now."""
    snap.release()
    if conn.member is None:  # the connection went away meanwhile
        conn.done()
        return
    try:
        push(conn, request, payload, functools.partial(_pushed, conn, request))
    except ServerError as exc:
        conn.fail(request, exc)
    except Exception as exc:  # (answered all the same: the worker must not wait for ever)
        log.exception("applying a push released from the gate failed")
        conn.fail(request, InternalServerError(f"internal error: {exc}"))


class PushPull(Handler):
    """PUSH_PULL: a push, then the weights once the policy lets this worker go on. With
    Flag.SKIP it carries nothing: the worker takes no part in the open BSP round."""

    op = Op.PUSH_PULL
    carries_rows = True

    def admit(self, conn: Exchange, request: Request) -> memoryview | None:
        check_narrowing(conn, request)
        if request.header.flags & SKIP:
            check_skip(conn, request)
            return None
        return push_destination(conn, request)

    def more(self, conn: Exchange, request: Request, got: int) -> memoryview | None:
        return rows_room(request, got)

    def handle(self, conn: Exchange, request: Request, payload: memoryview) -> None:
        push(conn, request, payload, functools.partial(_pushed_then_pull, conn, request))


class Leave(Handler):
    """LEAVE: the worker leaves the run (finished, or for now)."""

    op = Op.LEAVE

    def handle(self, conn: Exchange, request: Request, payload: memoryview) -> None:
        member = conn.require_member()
        conn.member = None
        conn.engine.membership.leave(member, "finished" if request.header.flags & Flag.FINISHED else "left")
        conn.reply(request, Op.LEAVE_REPLY)


# Admission -----------------------------------------------------------------------------
def check_narrowing(conn: Exchange, request: Request) -> None:
    """A pull may ask for its weights as 16-bit values (Flag.NARROW): over TCP, as BFLOAT16 or FLOAT16."""
    header = request.header
    if header.flags & NARROW:
        if header.dtype not in HALF:
            raise DTypeMismatch(f"a narrowed pull is BFLOAT16 or FLOAT16, not {dtype_name(header.dtype)}")
        if not conn.transport.compressed:
            raise DTypeMismatch(f"narrowed weights cross TCP only, not {conn.transport.kind}")


def check_skip(conn: Exchange, request: Request) -> None:
    """A PUSH_PULL with Flag.SKIP: no payload, no rows, no shared gradient, under BSP."""
    header, member = request.header, conn.member
    if member is None or member.grad is None:
        raise NotInitialized(f"{op_name(header.op)} before a successful INIT")
    if header.length or header.flags & (Flag.ROWS | Flag.SHM):
        raise MalformedFrame("a PUSH_PULL that skips a round carries nothing: no gradient, no rows")
    policy = conn.engine.policy
    if not policy.skips_rounds:
        raise MalformedFrame(f"only a BSP round can be skipped; this server runs {policy.name}")


def push_destination(conn: Exchange, request: Request) -> memoryview | None:
    """Where a push's payload goes: its rows (and its dense gradient, if it has one before
    them), or its dense gradient alone."""
    if request.rows:
        return rows_destination(conn, request)
    return gradient_destination(conn, request)


def gradient_destination(conn: Exchange, request: Request) -> memoryview | None:
    """Where a push's dense gradient goes; a large one in the frame is applied as it arrives
    when the engine allows it (the request's stream, fed by the connection)."""
    header, member = request.header, conn.member
    if member is None or member.grad is None:
        raise NotInitialized(f"{op_name(header.op)} before a successful INIT")
    check_gradient_dtype(conn.transport, request)
    dest = conn.transport.gradient_destination(member, header)
    least = conn.engine.config.stream_min_bytes
    # (a quantized gradient is applied whole: its scales are checked first, in push)
    if dest is not None and least and header.length >= least and header.dtype not in QUANTIZED:
        request.stream = conn.engine.training.begin_streaming_push(
            member, header.version, header.request_id, header.clock
        )
    return dest


# Serving and replies -------------------------------------------------------------------
def push(conn: Exchange, request: Request, payload: memoryview, answered) -> None:
    """Hand the push of ``request`` to the engine (its stream, if it streams, is the engine's then)."""
    member = conn.require_member()
    header = request.header
    if header.dtype in QUANTIZED and not request.rows:
        check_scales(member.gradient)
    rows = request_rows(conn, member, request, payload)
    conn.engine.training.push(
        member,
        header.version,
        answered,
        functools.partial(conn.fail, request),
        stream=request.stream,
        request_id=header.request_id,
        clock=header.clock,
        rows=rows,
        dense=request.dense_reply,
        skip=header.op == Op.PUSH_PULL and bool(header.flags & SKIP),
    )
    request.stream = None


def check_scales(gradient: np.ndarray | Quantized) -> None:
    """Refuse a quantized gradient whose scales are not each finite and above 0 (nothing is
    applied): NonFiniteGradient for a NaN or an infinity (what a sender's NaN makes),
    MalformedFrame for the rest."""
    assert isinstance(gradient, Quantized), "a quantized push's gradient"
    problem = scales_problem(gradient)
    if problem is None:
        return
    if not np.isfinite(gradient.scales).all():
        raise NonFiniteGradient(f"{problem}; it was rejected and changed nothing")
    raise MalformedFrame(problem)


def _pushed(conn: Exchange, request: Request, result: PushResult) -> None:
    flags = DROPPED if result.dropped else 0
    conn.reply(request, Op.PUSH_REPLY, clock=result.clock, version=result.version, flags=flags)


def _pushed_then_pull(conn: Exchange, request: Request, result: PushResult) -> None:
    member = conn.member
    if member is None:  # the connection went away while the push was in the lane
        conn.done()
        return
    request.dropped = result.dropped
    member.dense_wanted = request.dense_reply  # (rows alone: it keeps the weights it had)
    conn.engine.training.pull(member, functools.partial(_weights_ready, conn, request, Op.PUSH_PULL_REPLY))


def _joined(conn: Exchange, request: Request, snap: Snapshot, clock: int) -> None:
    # The reply may come before engine.membership.join() returns: the member is found by rank.
    engine = conn.engine
    member = engine.roster.members.get(request.rank)
    request.intake = None
    if request.seat_notice:
        conn.notice(Op.SEATED, encode_seated(request.rank, engine.membership.quorum, engine.membership.num_workers))
    reply_weights(conn, request, Op.INIT_REPLY, snap, clock, Flag.RUNNING if member and member.joined_running else 0)


def _join_failed(conn: Exchange, request: Request, exc: ServerError) -> None:
    conn.member = None
    request.end_intake(conn.engine, conn)
    conn.fail(request, exc)


def _weights_ready(conn: Exchange, request: Request, op: int, snap: Snapshot, clock: int) -> None:
    reply_weights(conn, request, op, snap, clock, DROPPED if request.dropped else 0)


def reply_weights(conn: Exchange, request: Request, op: int, snap: Snapshot, clock: int, flags: int) -> None:
    """Answer ``request`` with the weights of ``snap``: its rows too (a request with rows), as
    16-bit values if it asked (rounded off the loop for a large model: answered when ready)."""
    rows: tuple = ()
    fds: tuple = ()
    if request.rows and op != Op.INIT_REPLY:
        reply = rows_of_reply(conn, request, op, snap, clock, flags)
        if reply is None:  # (sent: rows alone, or an error)
            return
        (rows, fds), flags = reply, flags | Flag.ROWS
    if request.weights_dtype != FLOAT32 and op != Op.INIT_REPLY and conn.can_reply():
        conn.engine.model.narrowed.get(
            snap,
            request.weights_dtype,
            functools.partial(conn.reply_weights, request, op, snap, clock, flags, rows, fds),
        )
        return
    conn.reply_weights(request, op, snap, clock, flags, rows, fds)


#: This module's handlers (aps.server.requests.HANDLERS gathers them).
HANDLERS = (Ping(), Init(), Pull(), Push(), PushPull(), Leave())
