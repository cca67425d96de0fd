"""The rows of a request and of its reply (Flag.ROWS; docs/protocol.md, "Rows"): where a
request's rows are read, what is made of them, and the rows its reply carries.

The transport says where rows travel: over TCP in the frames, over shared memory in
segments, the frames carrying a rows reference instead (:class:`aps.server.shm.ShmTransport`).
PULL, PUSH and PUSH_PULL carry rows; their handlers (:mod:`aps.server.requests.training`)
call these.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from ...errors import InternalServerError, InvalidIds, MalformedFrame, NotInitialized, ServerError
from ...wire.protocol import pack_header
from .base import GRADIENT_OPS, NONE, PULL_OPS, ROWS, check_gradient_dtype, op_name

if TYPE_CHECKING:
    from ..engine.members import Member
    from ..engine.table import Snapshot
    from .base import Exchange, Request

__all__ = ["request_rows", "rows_destination", "rows_of_reply", "rows_room"]


def rows_destination(conn: Exchange, request: Request) -> memoryview:
    """Admit a request with rows: its dense gradient goes where a push's goes, if it has one
    (its dtype is not NONE); room for its rows is made once they begin (:func:`rows_room`)."""
    header = request.header
    member = conn.member
    if member is None or member.grad is None:
        raise NotInitialized(f"{op_name(header.op)} before a successful INIT")
    if not conn.engine.model.rows:
        raise InvalidIds("the model declares no tables: there are no rows to pull or push")
    dense = None
    if header.op in GRADIENT_OPS and header.dtype != NONE:
        check_gradient_dtype(conn.transport, request)
        dense = conn.transport.gradient_destination(member, header, rows=True)
    at = len(dense) if dense else 0
    if header.length < at + 8:
        raise MalformedFrame(f"{op_name(header.op)} with rows of {header.length} bytes: its rows need 8 at least")
    request.rows_at = at
    conn.transport.check_rows_frame(header, at)
    return dense if dense is not None and at else memoryview(b"")


def rows_room(request: Request, got: int) -> memoryview | None:
    """Room for a request's rows once they begin (a member's, within the frame limit:
    8-aligned, for the arrays read in place); None for the rest of any other payload."""
    if request.rows_at is not None and got == request.rows_at:
        return np.empty(request.header.length - got, np.uint8).data
    return None


def request_rows(conn: Exchange, member: Member, request: Request, payload: memoryview) -> list:
    """The rows a request pushes (checked: refused before anything is made of them); the
    ones it pulls are kept on ``member`` until it is served."""
    member.rows_wanted = member.rows_out = None
    if not request.rows:
        return []
    header, engine = request.header, conn.engine
    pushing, pulling = header.op in GRADIENT_OPS, header.op in PULL_OPS
    fit = not (pushing and engine.training.is_duplicate(member, header.request_id, header.clock))
    rows_in = conn.transport.rows_payload(payload)  # (the frame's last part: its rows)
    pushed, pulled = engine.model.rows.intake(rows_in, pushing, pulling, fit, conn.transport.rows_shared)
    member.rows_wanted = pulled if pulling else None
    member.rows_room = conn.transport.rows_room
    return pushed


def rows_of_reply(
    conn: Exchange, request: Request, op: int, snap: Snapshot, clock: int, flags: int
) -> tuple[tuple, tuple] | None:
    """A reply's rows (what the transport carries them as); None when the reply has been sent
    already: rows alone, or the error that reading them failed with."""
    member = conn.member
    read = None
    if member is not None:
        read, member.rows_out = member.rows_out, None
    if isinstance(read, BaseException):
        snap.release()
        conn.fail(request, InternalServerError(f"reading the rows failed: {type(read).__name__}: {read}"))
        return None
    try:
        rows, fds = conn.transport.reply_rows(read or [])
    except (ServerError, OSError) as exc:  # (no room for a reply segment, say)
        snap.release()
        conn.fail(
            request, exc if isinstance(exc, ServerError) else InternalServerError(f"sending the rows failed: {exc}")
        )
        return None
    if request.dense_reply:
        return rows, fds
    version = snap.version  # rows alone: the reply says the model's version
    snap.release()
    length = sum(len(part) for part in rows)
    header = pack_header(op, flags | ROWS, NONE, request.rid, clock, version, length, conn.engine.policy.num_live)
    conn.reply_parts((header, *rows), len(header) + length, fds)
    return None
