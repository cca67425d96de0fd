"""The rows of a request and of its reply (Flag.ROWS; docs/protocol.md, "Rows"): where a
request's rows are read, their intake, and the rows its reply carries (a mixin of
:class:`aps.server.session.ServerSession`, which holds the state it reads).

The transport says where rows travel. Over TCP they are in the frames (this class); over
shared memory in segments, the frames carrying a rows reference instead
(:class:`aps.server.shm.ShmSession` overrides :meth:`_rows_payload`, :meth:`_reply_rows`,
:attr:`_rows_room` and :attr:`_rows_shared`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from ..errors import InternalServerError, InvalidIds, MalformedFrame, NotInitialized, ServerError
from ..wire.protocol import DType, Flag, Header, Op, pack_header
from ..wire.rows import reply_rows_parts

if TYPE_CHECKING:
    from .engine import Engine
    from .engine.members import Member
    from .engine.table import Snapshot

__all__ = ["RowRequests"]

_GRADIENT_OPS = frozenset({Op.PUSH, Op.PUSH_PULL})
_PULL_OPS = frozenset({Op.PULL, Op.PUSH_PULL})
_ROW_OPS = _GRADIENT_OPS | _PULL_OPS
_ROWS = int(Flag.ROWS)
_NONE = int(DType.NONE)


class RowRequests:
    """Rows in requests and replies, for :class:`aps.server.session.ServerSession`."""

    engine: Engine
    member: Member | None
    _rid: int
    _rows_at: int | None
    _dense_reply: bool
    _traffic: object

    #: A request's rows lie in memory the worker may write again (its shared rows segment).
    _rows_shared = False
    #: Where a reply's rows are gathered (``room(nbytes)``: a uint8 array), None: new arrays.
    _rows_room: Callable[[int], np.ndarray] | None = None

    def _rows_destination(self, header: Header) -> memoryview:
        """A request with rows (Flag.ROWS): its dense gradient goes where a push's goes, if it
        has one (its dtype is not NONE); room for its rows is made once they begin (frame_more)."""
        op = header.op
        if op not in _ROW_OPS:
            raise MalformedFrame(f"{Op(op).name} carries no rows")
        member = self.member
        if member is None or member.grad is None:
            raise NotInitialized(f"{Op(op).name} before a successful INIT")
        if not self.engine.rows:
            raise InvalidIds("the model declares no tables: there are no rows to pull or push")
        if dense := op in _GRADIENT_OPS and header.dtype != _NONE:
            self._check_gradient_dtype(header)
            dense = self._gradient_destination(member, header, rows=True)
        at = len(dense) if dense else 0
        if header.length < at + 8:
            raise MalformedFrame(f"{Op(op).name} with rows of {header.length} bytes: its rows need 8 at least")
        self._rows_at = at
        return dense if at else memoryview(b"")

    def _request_rows(self, member: Member, header: Header, payload: memoryview) -> list:
        """The rows a request pushes (checked: refused before anything is made of them); the
        ones it pulls are kept on ``member`` until it is served."""
        member.rows_wanted = member.rows_out = None
        if not header.flags & _ROWS:
            return []
        pushing, pulling = header.op in _GRADIENT_OPS, header.op in _PULL_OPS
        fit = not (pushing and self.engine.is_duplicate(member, header.request_id, header.clock))
        pushed, pulled = self.engine.rows.intake(self._rows_payload(payload), pushing, pulling, fit,
                                                 self._rows_shared)
        member.rows_wanted = pulled if pulling else None
        member.rows_room = self._rows_room
        return pushed

    def _rows_payload(self, payload: memoryview) -> memoryview:
        """The rows part of a request (over TCP, the frame's: ``payload`` itself)."""
        return payload

    def _reply_rows(self, read: list[np.ndarray]) -> tuple[tuple, tuple[int, ...]]:
        """What a reply carries for the rows ``read`` (buffers, and descriptors to pass)."""
        return tuple(reply_rows_parts(read)), ()

    def _rows_of_reply(self, op: int, snap: Snapshot, clock: int, flags: int) -> tuple[tuple, tuple] | None:
        """A reply's rows (``_reply_rows``); None when the reply has been sent already: rows
        alone, or the error that reading them failed with."""
        member = self.member
        read = None
        if member is not None:
            read, member.rows_out = member.rows_out, None
        if isinstance(read, BaseException):
            snap.release()
            self._fail(InternalServerError(f"reading the rows failed: {type(read).__name__}: {read}"))
            return None
        try:
            rows, fds = self._reply_rows(read or [])
        except (ServerError, OSError) as exc:  # (no room for a reply segment, say)
            snap.release()
            self._fail(exc if isinstance(exc, ServerError) else InternalServerError(f"sending the rows failed: {exc}"))
            return None
        if self._dense_reply:
            return rows, fds
        version = snap.version  # rows alone: the reply says the model's version
        snap.release()
        if self._can_write() and not self._silenced:
            length = sum(len(part) for part in rows)
            header = pack_header(op, flags | _ROWS, _NONE, self._rid, clock, version, length,
                                 self.engine.policy.num_live)
            self._traffic.bytes_out += len(header) + length
            self._write_parts((header, *rows), fds)
        self._done()
        return None
