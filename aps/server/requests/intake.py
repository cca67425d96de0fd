"""What a handler reads before it hands a request to the engine, piece by piece and only as
its bytes arrive: an INIT's layout block and values (:class:`InitIntake`), a LOAD_STATE
(:class:`StateIntake`) and a LOAD_WEIGHTS (:class:`WeightsIntake`), each checked before
anything is kept."""

from __future__ import annotations

import mmap
from typing import TYPE_CHECKING

import numpy as np

from ...errors import MalformedFrame, NotInitialized, PayloadSizeMismatch, ServerOverloaded
from ...wire.protocol import (
    WEIGHTS_DIGEST_BYTES,
    Flag,
    Header,
    InitRequest,
    StateHead,
    decode_layout_block,
    decode_state_head,
    state_head_bytes,
)
from ..admission import LAYOUT_BUDGET

if TYPE_CHECKING:
    from ..admission import StrangerGuard
    from ..engine import Engine

__all__ = ["STATE_FIXED", "InitIntake", "StateIntake", "WeightsIntake"]

_CHECK = int(Flag.CHECK)
STATE_FIXED = 8  # the fixed bytes that open a STATE reply or a LOAD_STATE payload


class InitIntake:
    """An INIT being read: its layout block first, in pieces that grow only as its
    bytes arrive (a header alone costs nothing), then its values only if needed.

    Every piece but the first is drawn from the server's layout budget
    (:data:`LAYOUT_BUDGET`, all connections together), and is a mapping of its own, so
    that what a sender made the server hold goes back to the OS when it is let go,
    rather than staying in the allocator's heap."""

    __slots__ = ("block_bytes", "pieces", "request", "values", "registering", "_guard", "_charged")

    PIECE = 64 << 10

    def __init__(self, block_bytes: int, guard: StrangerGuard) -> None:
        self.block_bytes = block_bytes
        self.pieces: list[bytearray | mmap.mmap] = []
        self.request: InitRequest | None = None
        self.values: np.ndarray | None = None
        self.registering = False
        self._guard = guard
        self._charged = 0

    def next_piece(self, got: int) -> memoryview:
        """Room for the next bytes of the layout block (``got`` of it have arrived);
        raises ServerOverloaded when the server's layout budget is spent."""
        size = min(self.PIECE, self.block_bytes - got)
        piece: bytearray | mmap.mmap
        if not self.pieces:
            piece = bytearray(size)
        else:
            guard = self._guard
            if guard.layout_free < size:
                self.release()
                raise ServerOverloaded(
                    f"the server is reading {LAYOUT_BUDGET >> 20} MiB of INIT layout blocks already (a layout "
                    f"block of {self.block_bytes} bytes is large: it describes tensors, not their values); "
                    "try again later"
                )
            guard.layout_free -= size
            self._charged += size
            piece = mmap.mmap(-1, size)
        self.pieces.append(piece)
        return memoryview(piece)

    def release(self) -> None:
        """Let go of the pieces, and give back what they drew from the budget."""
        self.pieces = []
        if self._charged:
            self._guard.layout_free += self._charged
            self._charged = 0

    def check(self, engine: Engine, payload_bytes: int) -> InitRequest:
        """Parse the layout block and check the join it asks for (raises a ServerError)."""
        if self.request is None:
            block = b"".join(self.pieces)
            self.release()
            request = decode_layout_block(block)
            values = payload_bytes - len(block)
            if values not in (0, request.layout.nbytes):
                raise PayloadSizeMismatch(
                    f"INIT carries {values} bytes of values; its layout needs {request.layout.nbytes} (or none, "
                    "to join a model the server has)"
                )
            engine.membership.check_join(request.rank, request.num_workers, request.layout)
            if (
                values == 0
                and request.layout.nbytes
                and engine.model.table is None
                and not engine.membership.registering
            ):
                raise NotInitialized("this INIT carries no initial values and the server has no model yet: send them")
            self.request = request
        return self.request


class StateIntake:
    """A LOAD_STATE being read: its 8 fixed bytes, its description, checked against the
    model and the run (the arrays' names and sizes, the payload's length, whether this
    state can be loaded now or was loaded already), and only then its arrays, in pieces
    made as their bytes arrive: what a sender makes the server hold is never more than
    it has sent (and at most the frame limit). A state loaded already is read and dropped."""

    __slots__ = ("fixed", "rest", "head", "kept", "arrays", "_numel")

    #: Elements of the largest piece an array is received in (16 MiB).
    PIECE = 4 << 20

    def __init__(self) -> None:
        self.fixed = memoryview(bytearray(STATE_FIXED))
        self.rest: bytearray | None = None
        self.head: StateHead | None = None
        self.kept = False
        self.arrays: dict[str, list[np.ndarray]] = {}
        self._numel = 0

    def check(self, engine: Engine, header: Header) -> StateHead:
        """Parse the description and check it (raises a ServerError); once the head has arrived."""
        if self.head is None:
            nbytes = state_head_bytes(self.fixed)
            if header.length < nbytes or (self.rest is None and nbytes > STATE_FIXED):
                raise MalformedFrame(f"LOAD_STATE payload of {header.length} bytes; its description takes {nbytes}")
            head = decode_state_head(bytes(self.fixed) + bytes(self.rest or b""))
            self.kept = engine.loads.check_state(head)
            expected = head.nbytes if header.flags & _CHECK else head.payload_bytes
            if header.length != expected:
                what = (
                    "its description alone (CHECK)"
                    if header.flags & _CHECK
                    else f"{len(head.arrays)} arrays of {head.numel} float32 after a {head.nbytes}-byte head"
                )
                raise PayloadSizeMismatch(f"LOAD_STATE payload of {header.length} bytes; {what} take {expected}")
            self.head, self._numel = head, head.numel
            self.arrays = {name: [] for name in head.arrays}
        return self.head

    def next_part(self, engine: Engine, header: Header, got: int) -> memoryview | None:
        """Where the payload's bytes from ``got`` on go (None: read and drop them)."""
        head = self.head
        if head is None:
            if self.rest is None:
                size = state_head_bytes(self.fixed) - STATE_FIXED
                if size > 0:
                    self.rest = bytearray(min(size, header.length - got))
                    return memoryview(self.rest)
            head = self.check(engine, header)
            if self.kept:
                return None
        offset = (got - head.nbytes) // 4  # elements of the arrays received so far
        index, start = divmod(offset, self._numel)
        piece = np.empty(min(self.PIECE, self._numel - start), np.float32)
        self.arrays[head.arrays[index]].append(piece)
        return piece.data.cast("B")


class WeightsIntake:
    """A LOAD_WEIGHTS being read: its digest, checked against the run (whether weights can
    be loaded now, or these were loaded already), and only then room for the weights, made
    when they are to be loaded (the rest is read and dropped)."""

    __slots__ = ("digest", "numel", "kept", "checked", "values")

    def __init__(self, numel: int) -> None:
        self.digest = memoryview(bytearray(WEIGHTS_DIGEST_BYTES))
        self.numel = numel
        self.kept = False
        self.checked = False
        self.values: np.ndarray | None = None

    def check(self, engine: Engine, header: Header) -> None:
        """Check the digest against the run (raises a ServerError); once it has arrived."""
        if not self.checked:
            self.kept = engine.loads.check_weights(bytes(self.digest), self.numel, header.version)
            self.checked = True

    def next_part(self, engine: Engine, header: Header, got: int) -> memoryview | None:
        """Where the weights go, once the digest is in (None: read and drop them)."""
        self.check(engine, header)
        if self.kept:
            return None
        self.values = np.empty(self.numel, np.float32)
        return self.values.data.cast("B")
