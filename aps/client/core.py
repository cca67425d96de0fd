"""The client's protocol without I/O: :class:`_ClientCore` builds every request a worker sends
and parses every reply it receives (docs/protocol.md), for the blocking and the asyncio
worker alike; the transports only move bytes.

Zero copy: the core keeps one flat float32 weight buffer, which replies are received into
directly, and exposes each tensor as a view into it; gradients are sent straight from the
caller's arrays (or from the worker's own flat gradient buffer) with vectored writes, never
joined into one payload.
"""

from __future__ import annotations

import json
import logging
import math
import struct
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import numpy as np

from .. import _core
from ..errors import (
    APSConnectionError,
    ConfigurationError,
    DTypeMismatch,
    LayoutMismatch,
    MalformedFrame,
    NonFiniteGradient,
    NotInitialized,
    ProtocolError,
    RunChanged,
    ShuttingDown,
    error_from_code,
)
from ..layout import Layout, check_floating
from ..tables import Table, check_tables
from ..wire.framing import FrameReader
from ..wire.rows import ROWS_REF_BYTES, encode_rows, padded, reply_rows_bytes
from ..wire.quantized import QUANTIZED, quantize
from ..wire.scalars import MAX_STEP
from ..wire.protocol import (
    MAX_STATE_HEAD_BYTES,
    DType,
    Flag,
    Header,
    Op,
    decode_error,
    decode_join_progress,
    decode_seated,
    decode_slot,
    ANY_RANK,
    MAX_COUNTER,
    MAX_COUNTER_NAME,
    encode_init,
    pack_header,
)
from .payloads import state_from_reply
from .rowsets import RowsCall
from .shm import ShmConnection

__all__ = ["COMPRESSION"]

log = logging.getLogger("aps.worker")

_WEIGHT_REPLIES = frozenset({Op.INIT_REPLY, Op.PULL_REPLY, Op.PUSH_PULL_REPLY})
_COUNTED_REPLIES = _WEIGHT_REPLIES | {Op.PUSH_REPLY}
_PUSH_REPLIES = frozenset({Op.PUSH_REPLY, Op.PUSH_PULL_REPLY})
_ERROR = int(Op.ERROR)
_REWIND_REPLY = int(Op.REWIND_REPLY)
_PACE_REPLY = int(Op.PACE_REPLY)
#: The replies that carry a small JSON object (REWIND's checkpoint versions, PACE's rates), at most this long.
_JSON_REPLIES = frozenset({_REWIND_REPLY, _PACE_REPLY})
_MAX_JSON_REPLY = 1 << 20
_REPLY = int(Op.REPLY)
_INIT_REPLY = int(Op.INIT_REPLY)
_JOIN_PROGRESS = int(Op.JOIN_PROGRESS)
_ALIVE = int(Op.ALIVE)
_SEATED = int(Op.SEATED)
_DROPPED = int(Flag.DROPPED)
_RESUMABLE = int(Flag.RESUMABLE)
_RUNNING = int(Flag.RUNNING)
_FLOAT32 = int(DType.FLOAT32)
_SHM = int(Flag.SHM)
_NARROW = int(Flag.NARROW)
_ROWS = int(Flag.ROWS)
_SKIP = int(Flag.SKIP)
_GATE = int(Flag.GATE)
_NONE = int(DType.NONE)
#: ``compression=`` names and the element types they send.
COMPRESSION = {
    "bf16": int(DType.BFLOAT16),
    "fp16": int(DType.FLOAT16),
    "int8": int(DType.INT8Q),
    "int4": int(DType.INT4Q),
}
_HALF = frozenset({int(DType.BFLOAT16), int(DType.FLOAT16)})
_QUANTIZED = frozenset(QUANTIZED)
_MAX_ERROR_PAYLOAD = 1 << 20
_STATE_REPLY = int(Op.STATE_REPLY)
_MAX_STATE_ARRAYS = 4  # a STATE reply holds at most this many model-sized arrays (Adam has 2)
_REQUEST_ID_MASK = 0xFFFFFFFF


def _compression(compression: str | None, compress_pulls: bool) -> int:
    """The element type ``compression=`` sends gradients as (FLOAT32: none)."""
    if compression is None or compression == "none":
        if compress_pulls:
            raise ConfigurationError("compress_pulls needs compression='bf16' or 'fp16'")
        return _FLOAT32
    try:
        dtype = COMPRESSION[compression]
    except (KeyError, TypeError):
        raise ConfigurationError(
            f"unknown compression {compression!r}: choose 'bf16', 'fp16', 'int8', 'int4' or None"
        ) from None
    if compress_pulls and dtype in _QUANTIZED:
        raise ConfigurationError("compress_pulls needs compression='bf16' or 'fp16' (pulls are not quantized)")
    return dtype


def _rate(value: Any) -> float | None:
    """A step rate of a PACE reply: None (not measured yet) or a positive finite number."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and value > 0):
        raise ProtocolError(f"a PACE reply with a rate that is not a positive number: {value!r}")
    return float(value)


class _ClientCore:
    """Requests and replies of one worker, without I/O (see the module docstring)."""

    def __init__(self, rank: int | None, num_workers: int | None) -> None:
        if not isinstance(rank, (int, np.integer, type(None))) or not isinstance(
            num_workers, (int, np.integer, type(None))
        ):
            raise ConfigurationError("rank and num_workers must be integers (or None: the server's)")
        if num_workers is not None and num_workers < 1:
            raise ConfigurationError(f"num_workers must be at least 1, got {num_workers}")
        if rank is not None and not 0 <= rank < (num_workers or ANY_RANK):
            raise ConfigurationError(f"rank {rank} is out of range 0..{(num_workers or ANY_RANK) - 1}")
        #: This worker's rank: None until the server seats a worker that asked for any (rank=None).
        self.rank = None if rank is None else int(rank)
        #: The server chose the rank (rank=None): if another worker takes it while this one
        #: reconnects, this one may take another (see :meth:`reseat`).
        self.rank_assigned = rank is None
        #: The rank changed while this call reconnected: the push in flight is not sent again.
        self.reseated = False
        #: The worker count it said it is one of (None: whatever the server runs).
        self.given_workers = None if num_workers is None else int(num_workers)
        #: The server's MIN and MAX workers (from its SEATED notice; None before the first INIT),
        #: and the workers live at the server when it last answered a call (0: not said yet).
        self.min_workers: int | None = None
        self.max_workers: int | None = None
        self.live = 0
        self.layout: Layout | None = None
        self.flat_weights: np.ndarray | None = None
        self.flat_grad: np.ndarray | None = None
        self.weights: Mapping[str, np.ndarray] = MappingProxyType({})
        self.grads: Mapping[str, np.ndarray] = MappingProxyType({})
        self.version = 0
        self.clock = 0
        self.dropped = False
        #: The server answered INIT: it counts this worker until it leaves or disconnects.
        self.joined = False
        #: The INIT_REPLY said the model was already training (the values sent were not used).
        self.joined_running = False
        #: The last JOIN_PROGRESS notice while INIT waited: (joined, workers, missing ranks).
        self.join_progress: tuple[int, int, list[int]] | None = None
        self.reader = FrameReader(self, max_payload=None)
        # The flat weight and gradient buffers' bytes (empty until the layout is known).
        self._weights_bytes = memoryview(b"")
        self._grad_bytes = memoryview(b"")
        self._request_id = 0
        self._expect: int | None = None
        self._reply: Header | None = None
        self._payload: memoryview | None = None
        self._init_block: bytes = b""
        self._unsent_values: Mapping[str, Any] | None = None  # init()'s values, not yet in flat_weights
        self.connection_lost = False
        #: The server answered an INIT of this worker at least once (it has a place in a run).
        self.ever_joined = False
        #: The run the server holds (from the handshake): a worker that reconnects
        #: to another run refuses to go on (see check_run).
        self.run_id: str | None = None
        self.incarnation: str | None = None  # the server that served this worker last (ServerInfo.lineage)
        # The push in flight (op, request id, clock, version, frames): what to send again
        # if its reply is lost.
        self._push: tuple | None = None
        #: The clock and version held when the current call began: the iteration and weights a
        #: push it sends was computed in, also when the connection is found lost before it goes
        #: out and a rejoin brings a newer clock and weights (the push then says its own, not the
        #: rejoin's: the staleness bound and BSP's round rule judge the gradient by them).
        self._computed_clock = 0
        self._computed_version = 0
        #: The shared-memory connection, when the worker shares the server's host.
        self.shm: ShmConnection | None = None
        self._fds: tuple[int, ...] = ()
        #: Over TCP, gradients go as this element type (FLOAT32, or BFLOAT16/FLOAT16:
        #: narrowed here, widened by the server's kernel), and with ``compress_pulls``
        #: the weights come back as it too (see docs/design/wire.md, "Wire compression").
        self.compression = _FLOAT32
        self.compress_pulls = False
        self._half_grad: np.ndarray | None = None  # the narrowed gradient being sent
        #: int8 and 4-bit compression's error feedback: what quantizing the pushes so far left out,
        #: added to the next (flat float32, this worker's part of the model), or None before the first.
        self.residual: np.ndarray | None = None
        self._half_weights: np.ndarray | None = None  # narrowed weights being received
        #: The half buffers are the caller's model (see Worker.half_buffers): a push of
        #: ``_half_grad`` goes as it is, and every weights reply ends in ``_half_weights``.
        self.half_views = False
        #: Shared-memory weights are read where they lie (aps.Worker's ``zero_copy``): the
        #: weights are read-only views into the slot of the last weights reply, replaced at
        #: the next one; over a socket, read-only views into the worker's own buffer.
        self.zero_copy = False
        self._own_weights = np.empty(0, np.float32)  # the buffer weights sent over a socket land in
        self._own_views: tuple[np.ndarray, Mapping[str, np.ndarray]] | None = None  # zero_copy: its read-only views
        self._slot_views: dict[int, tuple[np.ndarray, Mapping[str, np.ndarray]]] = {}  # and each slot's
        self._reply_dtype = _FLOAT32  # what the weights reply of the request in flight carries
        #: The HYPER payload the server last accepted from this worker: the values live with
        #: the connection, so the worker sends them again when it reconnects.
        self.hyperparameters: bytes | None = None
        self._state_reply: memoryview | None = None  # the last STATE reply's payload, until taken
        self._json_reply: bytes | None = None  # the last REWIND or PACE reply's payload, until taken
        #: The rows of the call in flight (until the call ends): what its request pulls, and
        #: where the reply's rows land (a pull sent again after a reconnect asks the same).
        self._rows: RowsCall | None = None
        self._row_parts: list[memoryview] = []  # the reply's rows still to arrive, in order
        self._rows_ref = memoryview(b"")  # over shared memory: the reply's rows reference
        self._rows_need = 0  # and the bytes of rows it must name
        self._dense_part: memoryview | None = None  # a reply with rows: where its dense part went

    @property
    def num_workers(self) -> int | None:
        """The workers of the run: for an elastic server (``--workers MIN:MAX``), those live
        when it last answered a call; else its fixed count. Before the first INIT, the count
        this worker was given (None: none)."""
        low, high = self.min_workers, self.max_workers
        if low is None or high is None:
            return self.given_workers
        if low < high:
            return self.live or low
        return high

    @property
    def compressing(self) -> bool:
        """Gradients go narrowed: compression is on and the transport is TCP (shared
        memory moves no bytes a narrower type would save)."""
        return self.compression != _FLOAT32 and self.shm is None

    def take_fds(self) -> tuple[int, ...]:
        """Descriptors the last request must carry (its gradient segment, for INIT over shm)."""
        fds, self._fds = self._fds, ()
        return fds

    # Requests -------------------------------------------------------------
    def _next_request(self, op: int) -> int:
        self._request_id = rid = (self._request_id & _REQUEST_ID_MASK) % _REQUEST_ID_MASK + 1  # 1..2^32-1
        self._expect = op | _REPLY
        self._reply = None
        return rid

    def _header(self, op: int, length: int = 0, dtype: int = 0, flags: int = 0) -> bytes:
        return pack_header(op, flags, dtype, self._next_request(op), self.clock, self.version, length)

    def _weights_request(self) -> tuple[int, int]:
        """(flags, dtype) asking for the weights narrowed, when pulls are compressed;
        notes what the reply will carry."""
        if self.compressing and self.compress_pulls:
            self._reply_dtype = self.compression
            self._half_weights_buffer()
            return _NARROW, self.compression
        self._reply_dtype = _FLOAT32
        return 0, 0

    def _half_weights_buffer(self) -> np.ndarray:
        """The buffer 16-bit weights are received into (made at the first compressed pull)."""
        half = self._half_weights
        if half is None:
            half = self._half_weights = np.zeros(self._require_layout().numel, np.uint16)
        return half

    def check_run(self, run_id: str, address: str, lineage: list[str] | tuple[str, ...] = ()) -> None:
        """The server at ``address`` holds run ``run_id``, and descends from ``lineage`` (its
        run's incarnations, its own last): refuse to go on in another run, or with a server of
        this run that the one that served this worker last did not lead to (a second server of
        the run, started from a copy of its checkpoints while the first went on)."""
        if self.ever_joined and self.run_id is not None and run_id != self.run_id:
            raise RunChanged(
                f"the server at {address} came back serving another run (run id {run_id or 'none'}, this worker's "
                f"is {self.run_id}): it restarted without --resume, or from another run's checkpoint, so this "
                "worker's weights and clock mean nothing there"
            )
        if self.ever_joined and self.incarnation is not None and self.incarnation not in lineage:
            raise RunChanged(
                f"the server at {address} serves this worker's run {run_id}, but it does not descend from the "
                f"server that served this worker last (incarnation {self.incarnation}; this one is "
                f"{lineage[-1] if lineage else 'of an aps that says none'}, resumed from "
                f"{lineage[-2] if len(lineage) > 1 else 'no checkpoint'}): two servers serve one run, "
                "one of them started from a copy of the other's checkpoints. A copy is a run of its own: start it "
                "with --fork-run"
            )
        self.run_id = run_id
        if lineage:
            self.incarnation = lineage[-1]

    def init_request(
        self,
        params: Mapping[str, Any] | None,
        rejoin: bool = False,
        tables: Mapping[str, Table] | None = None,
        values: bool = True,
    ) -> list:
        """INIT; ``values`` False sends the layout alone (the server has the model: the
        values would be read and dropped)."""
        if params is not None:
            if not isinstance(params, Mapping) or not params:
                raise ConfigurationError("init takes a non-empty mapping of name to float32 array")
            given = Layout.from_arrays(params, check_tables(tables))
            if self.layout is not None:
                self.layout.require_same(
                    given, "init with a different model than before", "init with other tables than before"
                )
            self._set_layout(given)
        layout = self.layout
        if layout is None:
            raise NotInitialized("no model to join with: call init(params) first")
        if params is not None:
            # Copied into the flat weights when they are sent: a server that has the model
            # answers with its own weights, so a join costs no pass over the model here.
            self._unsent_values = params
            self._init_block = encode_init(
                ANY_RANK if self.rank is None else self.rank, self.given_workers or 0, layout
            )
        block = self._init_block
        if values and self._unsent_values is not None:  # (a retry to a server without the model)
            layout.flatten_into(self._unsent_values, self._own_weights)
            self._unsent_values = None
        self.join_progress = None
        if self.shm is not None:
            segment = self.shm.grad_segment
            assert segment is not None  # (made with the layout: _set_layout)
            self._fds = (segment.fd,)
        # The header's version field carries the layout block's length (docs/protocol.md, INIT).
        flags = (Flag.REJOIN if rejoin and self.ever_joined else 0) | Flag.SEAT
        header = pack_header(
            Op.INIT,
            flags,
            _FLOAT32,
            self._next_request(Op.INIT),
            self.clock,
            len(block),
            len(block) + (layout.nbytes if values else 0),
        )
        self._reply_dtype = _FLOAT32
        return [header, block, self._weights_bytes] if values else [header, block]

    def pull_request(self, rows: RowsCall | None = None) -> list:
        """PULL: the weights; with ``rows`` (or the rows this call pulls already, when it is
        sent again after a reconnect) the rows too, or those alone (``rows.dense`` False)."""
        layout = self._require_layout()
        rows = self._rows if rows is None else rows
        if rows is None:
            flags, dtype = self._weights_request()
            return [self._header(Op.PULL, 0, dtype, flags)]
        self._rows = rows
        flags, dtype = self._weights_request() if rows.dense else (0, _NONE)
        if rows.dense and not flags:
            dtype = _FLOAT32  # (with rows, the dtype names the dense part: NONE is none)
        parts = self._rows_wire(encode_rows(rows.pull, layout.table_dims, False))
        return [self._header(Op.PULL, sum(len(p) for p in parts), dtype, flags | _ROWS), *parts]

    def begin_call(self) -> None:
        """A call begins: only its push is ever sent again, and a push it sends was
        computed on the weights held now."""
        self._push = None
        self._rows = None
        self.reseated = False
        self._computed_clock, self._computed_version = self.clock, self.version

    def push_request(self, grads: Any, then_pull: bool, rows: RowsCall | None = None) -> list:
        """PUSH (PUSH_PULL): the gradient ``grads``; with ``rows``, rows pushed (and pulled)
        too, after it, or alone (``rows.dense`` False: ``grads`` is not read)."""
        layout = self._require_layout()
        clock, version = self._computed_clock, self._computed_version
        op = Op.PUSH_PULL if then_pull else Op.PUSH
        flags, dtype, buffers = 0, _NONE, list[Any]()
        if rows is None or rows.dense:
            flags, dtype, buffers = self._dense_push(grads, then_pull, quantize=rows is None)
        if rows is not None:
            dims = layout.table_dims
            buffers += encode_rows(rows.push, dims, True)
            if then_pull:
                buffers += encode_rows(rows.pull, dims, False)
                self._rows = rows
            flags |= _ROWS
        wire = self._rows_wire(buffers) if flags & _ROWS else buffers
        frames = [
            pack_header(op, flags, dtype, self._next_request(op), clock, version, sum(len(b) for b in wire)),
            *wire,
        ]
        self._push = (op, self._request_id, clock, version, buffers, flags, dtype)
        return frames

    def pipelined_push(self, grads: Any, clock: int) -> tuple[list, int]:
        """A dense PUSH sent while earlier ones are unanswered (an asyncio worker's pipeline):
        its frames and request id; ``clock`` is the clock it counts at (this worker's clock
        plus the pushes in flight), the version the weights held. Nothing is kept for a
        resend here: the pipeline keeps its own copy."""
        self._require_layout()
        flags, dtype, buffers = self._dense_push(grads, False)
        flags |= _GATE  # (held past the SSP/DSSP bound: it waits at the gate, not refused)
        rid = self._next_request(Op.PUSH)
        header = pack_header(Op.PUSH, flags, dtype, rid, clock, self.version, sum(len(b) for b in buffers))
        return [header, *buffers], rid

    def push_acknowledged(self, header: Header) -> None:
        """A pipelined push was answered (``header``, its PUSH_REPLY): its clock, as
        :meth:`finish` takes a push's."""
        self.clock = header.clock
        if header.live:
            self.live = header.live
        self.dropped = bool(header.flags & _DROPPED)

    def skip_request(self) -> list:
        """PUSH_PULL with SKIP: no gradient; this worker takes no part in the server's open BSP
        round (docs/algorithms.md, "Sharded BSP: a worker that joins"), and the reply brings
        the round's weights. Sent again after a reconnect as a push is."""
        self._require_layout()
        clock, version = self._computed_clock, self._computed_version
        flags, dtype = self._weights_request()
        flags, dtype = flags | _SKIP, dtype or _FLOAT32
        frames = [pack_header(Op.PUSH_PULL, flags, dtype, self._next_request(Op.PUSH_PULL), clock, version, 0)]
        self._push = (Op.PUSH_PULL, self._request_id, clock, version, [], flags, dtype)
        return frames

    def _rows_wire(self, parts: list) -> list:
        """What carries a request's rows ``parts``: the parts themselves (TCP), or their
        rows reference, the rows being put in the rows segment (shared memory)."""
        if self.shm is None:
            return parts
        ref, fd = self.shm.rows_request(parts, self.rank)
        if fd is not None:
            self._fds += (fd,)
        return [ref]

    def _dense_push(self, grads: Any, then_pull: bool, quantize: bool = True) -> tuple[int, int, list]:
        """(flags, dtype, payload buffers) of a push's dense gradient (``quantize``: int8 and 4-bit
        compression apply; a push with rows sends its dense part in float32)."""
        # The caller's own 16-bit gradient (half_views, over TCP only): sent as it is.
        already_half = self.half_views and grads is self._half_grad
        buffers = [] if already_half else self._gradient_buffers(grads)
        if self.shm is not None:
            # The gradient must be in the shared segment: it is, unless the
            # caller computed it elsewhere (then one copy puts it there).
            if buffers[0] is not self._grad_bytes:
                offset = 0
                for view in buffers:
                    self._grad_bytes[offset : offset + len(view)] = view
                    offset += len(view)
            return _SHM, _FLOAT32, []
        flags, _ = self._weights_request() if then_pull else (0, 0)
        if self.compressing and self.compression in _QUANTIZED:
            if not quantize:
                return flags, _FLOAT32, buffers
            return flags, self.compression, [self._quantized(buffers).data]
        if self.compressing:
            half = self._half_grad if already_half and self._half_grad is not None else self._narrowed(buffers)
            return flags, self.compression, [half.data.cast("B")]
        return flags, _FLOAT32, buffers

    def _quantized(self, buffers: list) -> np.ndarray:
        """The gradient in ``buffers`` plus the error feedback, block-quantized (aps.wire.quantized);
        the new error feedback is what that left out (kept only when the sum and what is sent are
        finite: a push the server will refuse changes nothing here either)."""
        values = np.concatenate([np.frombuffer(view, np.float32) for view in buffers])
        residual = self.residual
        if residual is None:
            residual = self.residual = np.zeros(len(values), np.float32)
        wanted = values + residual
        payload, sent = quantize(wanted, self.compression)
        if np.isfinite(wanted).all() and np.isfinite(sent).all():
            np.subtract(wanted, sent, out=residual)
        return payload

    def _narrowed(self, buffers: list) -> np.ndarray:
        """The gradient in ``buffers`` rounded to the compression's 16 bits (to nearest
        even), in this worker's half buffer; refuses one that overflows fp16."""
        half = self._half_grad
        if half is None:
            half = self._half_grad = np.zeros(self._require_layout().numel, np.uint16)
        offset, overflowed = 0, 0
        for view in buffers:
            values = np.frombuffer(view, np.float32)
            overflowed += _core.narrow(half[offset : offset + len(values)], values, self.compression)
            offset += len(values)
        if overflowed:
            raise NonFiniteGradient(
                f"{overflowed} gradient element(s) beyond fp16's range (|x| > 65504): nothing was sent; "
                "scale the loss down, or use compression='bf16' (float32's range)"
            )
        return half

    @property
    def has_pending_push(self) -> bool:
        """A push was sent and its reply has not come."""
        return self._push is not None

    @property
    def pending_push_version(self) -> int:
        """The version of the weights the push of this call was computed on (sent or not)."""
        return self._push[3] if self._push is not None else self._computed_version

    def reseat(self) -> int | None:
        """The rank the server gave this worker went to another while it reconnected: ask
        for any rank again (returns the one lost). Only a worker whose rank the server chose."""
        lost, self.rank, self.reseated = self.rank, None, True
        self._init_block = encode_init(ANY_RANK, self.given_workers or 0, self._require_layout())
        return lost

    def forget_push(self, dropped: bool = False) -> None:
        """The push in flight will not be sent again (``dropped``: it was not applied)."""
        self._push = None
        if dropped:
            self.dropped = True

    def resend_push(self) -> list:
        """The push in flight again, exactly as first sent (same request id and clock:
        the server recognises it if it took it already, see docs/protocol.md)."""
        push = self._push
        assert push is not None  # (called for the push in flight: has_pending_push)
        op, rid, clock, version, buffers, flags, dtype = push
        self._request_id, self._expect, self._reply = rid, op | _REPLY, None
        if self.shm is None:
            self._reply_dtype = dtype if flags & _NARROW else _FLOAT32
        wire = self._rows_wire(buffers) if flags & _ROWS else buffers  # (over shm: the gradient is in its segment)
        return [pack_header(op, flags, dtype, rid, clock, version, sum(len(b) for b in wire)), *wire]

    def simple_request(self, op: Op, flags: int = 0) -> list:
        return [self._header(op, flags=flags)]

    def hyper_request(self, payload: bytes, check: bool = False) -> list:
        """HYPER: the per-group optimizer values (an :func:`aps.wire.protocol.encode_hyper` payload);
        ``check``: only have them checked (Flag.CHECK), keeping the ones in force."""
        return [self._header(Op.HYPER, len(payload), flags=Flag.CHECK if check else 0), payload]

    def state_request(self) -> list:
        """STATE: a copy of the server's optimizer state."""
        if self.layout is None:
            raise NotInitialized("call init(params) before optimizer_state")
        self._state_reply = None
        return [self._header(Op.STATE)]

    def load_state_request(self, head: bytes, arrays: list[np.ndarray], check: bool = False) -> list:
        """LOAD_STATE: ``head`` (from :func:`state_payload`) and the arrays; ``check``: the
        head alone, to be checked (Flag.CHECK), nothing loaded."""
        parts = [head] if check else [head, *(array.data.cast("B") for array in arrays if array.size)]
        return [
            self._header(Op.LOAD_STATE, sum(len(part) for part in parts), _FLOAT32, Flag.CHECK if check else 0),
            *parts,
        ]

    def load_weights_request(self, digest: bytes, values: np.ndarray | None) -> list:
        """LOAD_WEIGHTS: the digest and the flat weights; ``values`` None: the digest alone,
        to be checked (Flag.CHECK), nothing loaded. The header's version is the version of
        the weights this worker holds."""
        parts = [digest] if values is None else [digest, values.data.cast("B")]
        return [
            self._header(
                Op.LOAD_WEIGHTS, sum(len(part) for part in parts), _FLOAT32, Flag.CHECK if values is None else 0
            ),
            *parts,
        ]

    def rewind_request(self, version: int | None) -> list:
        """REWIND: the versions of the run's checkpoints (``version`` None, Flag.CHECK), or a
        restart from the one at ``version`` (in the header's version field)."""
        self._json_reply = None
        if version is None:
            return [pack_header(Op.REWIND, Flag.CHECK, 0, self._next_request(Op.REWIND), self.clock, 0, 0)]
        return [pack_header(Op.REWIND, 0, 0, self._next_request(Op.REWIND), self.clock, version, 0)]

    def take_rewind(self) -> dict[str, Any]:
        """What the last REWIND reply said (JSON)."""
        return self._take_json("REWIND")

    def _take_json(self, what: str) -> dict[str, Any]:
        payload, self._json_reply = self._json_reply, None
        if payload is None:
            raise ProtocolError(f"a {what} reply without its payload")
        try:
            info = json.loads(payload)
        except (ValueError, RecursionError):
            raise ProtocolError(f"a {what} reply that is not JSON") from None
        if not isinstance(info, dict):
            raise ProtocolError(f"a {what} reply that is not a JSON object")
        return info

    def pace_request(self, steps: int, seconds: float) -> list:
        """PACE: this worker has taken ``steps`` local steps in all (in the header's version), in
        ``seconds`` of its own time (the payload)."""
        if isinstance(steps, bool) or not isinstance(steps, (int, np.integer)) or not 0 <= steps <= MAX_STEP:
            raise ConfigurationError(f"a step count is 0 to 2**53, not {steps!r}")
        if not (isinstance(seconds, (int, float)) and 0.0 <= seconds <= MAX_STEP):
            raise ConfigurationError(f"the seconds the steps took are 0 to 2**53, not {seconds!r}")
        self._json_reply = None
        payload = struct.pack("<d", float(seconds))
        return [pack_header(Op.PACE, 0, 0, self._next_request(Op.PACE), self.clock, int(steps), len(payload)), payload]

    def take_pace(self) -> tuple[float | None, float | None]:
        """This worker's step rate and the fastest live worker's, as the last PACE reply gave them."""
        answer = self._take_json("PACE")
        return _rate(answer.get("rate")), _rate(answer.get("fastest"))

    def take_rewind_versions(self) -> list[int]:
        """The checkpoint versions the last REWIND (CHECK) reply listed."""
        versions = self.take_rewind().get("versions")
        if not isinstance(versions, list) or not all(isinstance(v, int) for v in versions):
            raise ProtocolError("a REWIND reply without its list of versions")
        return versions

    def take_state(self, header: Header) -> dict[str, Any]:
        """The state the last STATE reply (``header``'s) carried."""
        payload, self._state_reply = self._state_reply, None
        if payload is None:
            raise ProtocolError("a STATE reply without its payload")
        return state_from_reply(payload, header.version)

    def claim_request(self, name: str, count: int) -> list:
        """CLAIM: add ``count`` to the run's counter ``name``; the reply's version is its value before."""
        raw = name.encode("utf-8")
        if not 0 < len(raw) <= MAX_COUNTER_NAME:
            raise ConfigurationError(f"a counter's name is 1 to {MAX_COUNTER_NAME} UTF-8 bytes, got {len(raw)}")
        if not isinstance(count, (int, np.integer)) or not 0 <= count <= MAX_COUNTER:
            raise ConfigurationError(f"a claim adds 0 to 2**53, not {count!r}")
        header = pack_header(Op.CLAIM, 0, 0, self._next_request(Op.CLAIM), self.clock, int(count), len(raw))
        return [header, raw]

    def log_request(self, payload: bytes) -> list:
        """LOG: what the training loop reported (aps.client.logbook)."""
        return [self._header(Op.LOG, len(payload)), payload]

    def shards_request(self, runs: list[str]) -> list:
        """SHARDS: the run id of every shard of the model, for this one to keep."""
        payload = json.dumps(runs).encode()
        return [self._header(Op.SHARDS, len(payload)), payload]

    def _gradient_buffers(self, grads: Any) -> list:
        layout = self._require_layout()
        if grads is self.flat_grad or grads is self.grads:
            return [self._grad_bytes]
        if isinstance(grads, np.ndarray):
            if grads.shape != (layout.numel,):
                raise LayoutMismatch(f"a flat gradient must have shape ({layout.numel},), got {grads.shape}")
            if grads.dtype == np.float32:
                return [self._contiguous(grads, "flat gradient")]
            check_floating(grads.dtype, "the flat gradient")
            flat_grad = self.flat_grad
            assert flat_grad is not None  # (made with the layout)
            np.copyto(flat_grad, grads, casting="same_kind")  # float64/float16: one conversion, in place
            return [self._grad_bytes]
        if not isinstance(grads, Mapping):
            raise ConfigurationError("push takes a mapping of name to array, or a flat float32 array")
        layout.check(grads)
        if all(grads[name].dtype == np.float32 for name in layout.names):
            return [self._contiguous(grads[name], name) for name in layout.names]
        # Some are float64 (numpy's default) or float16: convert them into this worker's own
        # gradient buffer (over shm, the shared segment itself) instead of a copy per tensor.
        for name, view in self.grads.items():
            np.copyto(view, grads[name], casting="same_kind")
        return [self._grad_bytes]

    @staticmethod
    def _contiguous(array: np.ndarray, name: str) -> memoryview:
        if array.dtype != np.float32:
            raise DTypeMismatch(f"{name} is {array.dtype}, the model is float32")
        if not array.flags.c_contiguous:
            array = np.ascontiguousarray(array)
        return array.data.cast("B")

    def _require_layout(self) -> Layout:
        """The model's layout (NotInitialized before init)."""
        if self.layout is None:
            raise NotInitialized("call init(params) before pull or push")
        return self.layout

    def adopt(self, weights: np.ndarray, grad: np.ndarray) -> None:
        """Keep the weights and (over TCP) the gradients in these buffers, not in buffers of
        its own: the slices of one shard of a sharded worker's flat buffers."""
        self._adopted = (weights, grad)

    def _set_layout(self, layout: Layout) -> None:
        if self.layout is not None:
            return
        self.layout = layout
        adopted = getattr(self, "_adopted", None)
        weights = adopted[0] if adopted is not None else np.zeros(layout.numel, np.float32)
        if self.shm is not None:  # gradients are written straight into shared memory
            grad = self.shm.gradient_buffer(layout.numel, self.rank)
        else:
            grad = adopted[1] if adopted is not None else np.zeros(layout.numel, np.float32)
        self.flat_weights, self.flat_grad, self._own_weights = weights, grad, weights
        self._weights_bytes = weights.data.cast("B")
        self._grad_bytes = grad.data.cast("B")
        # Read-only mappings: the views are fixed; write into them, never replace them.
        self.weights = MappingProxyType(layout.views(weights))
        self.grads = MappingProxyType(layout.views(grad))
        if self.zero_copy:  # (over a read-only buffer: the views cannot be made writeable again)
            held = np.frombuffer(weights.data.toreadonly(), np.float32)
            self._own_views = (held, MappingProxyType(layout.views(held)))
            self._hold_own_views()

    def _hold_own_views(self) -> None:
        """zero_copy: the weights are the read-only views of this worker's own buffer."""
        if self._own_views is not None:
            self.flat_weights, self.weights = self._own_views

    def hold(self, values: np.ndarray) -> None:
        """The weights are ``values`` from now on (the server took them: LOAD_WEIGHTS)."""
        own = self._own_weights
        if values is not own and not np.shares_memory(values, own):
            np.copyto(own, values)
        if self.zero_copy:
            self._hold_own_views()

    def _hold_slot(self, slot_id: int, slot: np.ndarray, slots: Mapping[int, np.ndarray]) -> None:
        """zero_copy: the weights are read-only views into ``slot`` (one set of views per slot;
        those of slots the server has dropped, no longer in ``slots``, go, so that their memory can)."""
        views = self._slot_views
        held = views.get(slot_id)
        if held is None or held[0] is not slot:
            held = views[slot_id] = (slot, MappingProxyType(self._require_layout().views(slot)))
        if len(views) > 1:
            for gone in [sid for sid, (array, _) in views.items() if slots.get(sid) is not array]:
                del views[gone]
        self.flat_weights, self.weights = held

    def keep_weights(self) -> None:
        """zero_copy: before this worker's lease on its slot ends (it leaves, or its connection is
        gone), its weights become read-only views of its own copy of the slot, which the server
        may write again afterwards."""
        own, held = self._own_views, self.flat_weights
        if own is not None and held is not None and held is not own[0]:
            np.copyto(self._own_weights, held)
            self.flat_weights, self.weights = own
        self._slot_views.clear()

    # Replies (FrameHandler) -------------------------------------------------
    def frame_buffer(self, header: Header) -> memoryview | None:
        if header.op == _ALIVE:  # the server holds our request and says it is alive
            if header.length:
                raise MalformedFrame(f"ALIVE notice with a {header.length}-byte payload")
            return None
        if header.op == _SEATED:
            if header.length > 64:
                raise MalformedFrame(f"SEATED notice of {header.length} bytes")
            return memoryview(bytearray(header.length))
        if header.op == _ERROR or header.op == _JOIN_PROGRESS:
            if header.length > _MAX_ERROR_PAYLOAD:
                raise MalformedFrame(f"error frame of {header.length} bytes")
            return memoryview(bytearray(header.length))
        if header.op in _WEIGHT_REPLIES:
            length = header.length
            rows = self._rows if header.op != _INIT_REPLY else None
            asked = rows is not None
            if asked != bool(header.flags & _ROWS) or (rows is not None and rows.dense != (header.dtype != _NONE)):
                raise MalformedFrame("a weights reply that does not carry what was asked for (rows, dense weights)")
            if header.flags & _ROWS:
                length = self._expect_rows(header)
                if header.dtype == _NONE:  # rows alone
                    if length:
                        raise MalformedFrame(f"a reply of rows alone carries {length} bytes more")
                    return memoryview(b"")
            if header.flags & _SHM:  # a slot descriptor: the weights are in shared memory
                if self.shm is None or length > _MAX_ERROR_PAYLOAD:
                    raise MalformedFrame("unexpected shared-memory weights reply")
                target = memoryview(bytearray(length))
            elif header.dtype in _HALF and header.dtype == self._reply_dtype and header.op != _INIT_REPLY:
                target = self._half_weights_buffer().data.cast("B")  # widened into the weights once all here
            elif header.dtype == _FLOAT32:
                target = self._weights_bytes
            else:
                raise MalformedFrame(f"weights reply of dtype {header.dtype}; asked for {self._reply_dtype}")
            if length != len(target):
                raise MalformedFrame(f"weights reply of {length} bytes; the model has {len(target)}")
            self._dense_part = target
            return target
        if header.op == _STATE_REPLY and self.layout is not None:
            limit = 8 + MAX_STATE_HEAD_BYTES + 8 + _MAX_STATE_ARRAYS * self.layout.nbytes
            if header.length > limit:
                raise MalformedFrame(f"STATE reply of {header.length} bytes; at most {limit} are expected")
            return np.empty(header.length, np.uint8).data if header.length else None  # 8-aligned
        if header.op in _JSON_REPLIES:  # a small JSON object (checkpoint versions, step rates)
            if header.length > _MAX_JSON_REPLY:
                raise MalformedFrame(f"{Op(header.op).name} of {header.length} bytes")
            return memoryview(bytearray(header.length))
        if header.length:
            raise MalformedFrame(f"unexpected {header.length}-byte payload on op {header.op}")
        return None

    def _expect_rows(self, header: Header) -> int:
        """A reply with rows: where they go (the out arrays of the call in flight); returns the
        length of the dense part before them."""
        rows = self._rows
        if rows is None or header.op == _INIT_REPLY:
            raise MalformedFrame("a reply with rows to a request that asked for none")
        need = reply_rows_bytes(rows.pull, self._require_layout().table_dims)
        if self.shm is not None:  # the rows are in the reply segment: the payload ends with their reference
            if header.length < ROWS_REF_BYTES:
                raise MalformedFrame(f"a reply of {header.length} bytes has no rows reference")
            self._rows_ref = memoryview(bytearray(ROWS_REF_BYTES))
            self._rows_need = need
            self._row_parts = [self._rows_ref]
            return header.length - ROWS_REF_BYTES
        if header.length < need:
            raise MalformedFrame(f"a reply of {header.length} bytes; the rows asked for take {need}")
        parts = []
        for out in rows.outs:
            if out.nbytes:
                parts.append(out.data.cast("B"))
            if out.nbytes % 8:
                parts.append(memoryview(bytearray(4)))
        parts.reverse()  # (taken from the end)
        self._row_parts = parts
        return header.length - need

    def frame_more(self, header: Header, got: int) -> memoryview | None:
        """The next part of a reply's rows: straight into the caller's arrays."""
        if not self._row_parts:
            raise MalformedFrame("a reply carries more than the rows asked for")
        return self._row_parts.pop()

    def frame_received(self, header: Header, payload: memoryview) -> None:
        if header.flags & _ROWS and header.op in _WEIGHT_REPLIES:
            dense, self._dense_part = self._dense_part, None
            if header.dtype != _NONE and dense is not None:
                payload = dense
        if header.op == _JOIN_PROGRESS:  # a notice while INIT waits, not its reply
            if header.request_id == self._request_id and self._expect == _INIT_REPLY:
                self.join_progress = decode_join_progress(payload)
            return
        if header.op == _ALIVE:  # its bytes have reset the receive's silence timer: nothing else to do
            return
        if header.op == _SEATED:  # the INIT_REPLY follows: the rank seated under, the server's MIN:MAX
            if header.request_id == self._request_id and self._expect == _INIT_REPLY:
                rank, self.min_workers, self.max_workers = decode_seated(payload)
                if self.rank is not None and rank != self.rank:
                    raise ProtocolError(f"the server seated rank {rank}; this worker asked for rank {self.rank}")
                if self.rank is None:  # (asked for any rank: a rejoin asks for this one)
                    self.rank = rank
                    self._init_block = encode_init(rank, self.given_workers or 0, self._require_layout())
            return
        if header.op != _ERROR or header.request_id != 0:
            if header.request_id != self._request_id:
                raise ProtocolError(f"reply to request {header.request_id}, expected {self._request_id}")
            if header.op != self._expect and header.op != _ERROR:
                raise ProtocolError(f"reply op {header.op} to a request expecting {self._expect}")
        shm = self.shm
        if header.flags & _SHM and header.op in _WEIGHT_REPLIES:
            # The leased snapshot slot: read where it lies, or copied into this worker's weights.
            if shm is None:
                raise MalformedFrame("unexpected shared-memory weights reply")
            slot_id, nbytes, has_fd, dropped = decode_slot(payload)
            if nbytes != self._own_weights.nbytes:
                raise MalformedFrame(f"slot of {nbytes} bytes; the model has {self._own_weights.nbytes}")
            slot = shm.slot(slot_id, nbytes, has_fd, dropped)
            if self.zero_copy:
                self._hold_slot(slot_id, slot, shm.slots)
            else:
                np.copyto(self._own_weights, slot)
        elif header.dtype in _HALF and header.op in _WEIGHT_REPLIES:
            if not self.half_views:  # (with half views, the 16-bit weights are what the caller reads)
                _core.widen(self._own_weights, self._half_weights_buffer(), header.dtype)
        elif self.half_views and header.op in _WEIGHT_REPLIES:  # float32 weights (INIT, a rejoin)
            _core.narrow(self._half_weights_buffer(), self._own_weights, self.compression)
        elif header.op == _STATE_REPLY and header.request_id == self._request_id:
            self._state_reply = payload
        if self.zero_copy and header.op in _WEIGHT_REPLIES and not header.flags & _SHM and header.dtype != _NONE:
            self._hold_own_views()  # (they came over a socket)
        if header.flags & _ROWS and shm is not None and header.op in _WEIGHT_REPLIES:
            self._rows_from_segment(shm)
        elif header.op in _JSON_REPLIES and header.request_id == self._request_id:
            self._json_reply = bytes(payload)
        self._reply = header
        self._payload = payload

    def _rows_from_segment(self, shm: ShmConnection) -> None:
        """A reply's rows over shared memory: copied out of the reply segment into the
        caller's arrays (before the next request, which lets the server write there again)."""
        rows = self._rows
        if rows is None:  # (frame_buffer let no such reply through)
            raise MalformedFrame("a reply with rows to a request that asked for none")
        view = shm.reply_rows(self._rows_ref, self._rows_need)
        at = 0
        for out in rows.outs:
            np.copyto(out, view[at : at + out.nbytes].view(np.float32).reshape(out.shape))
            at += padded(out.nbytes)

    def reset_stream(self) -> None:
        """Forget any half-read reply: the next bytes come from a new connection."""
        self.reader = FrameReader(self, max_payload=None)
        self._reply = None
        self._payload = None
        self.connection_lost = False
        self.joined = False

    def has_reply(self) -> bool:
        return self._reply is not None

    def finish(self) -> Header:
        """Check the reply that arrived: raise the server's error, or record version and clock."""
        header, self._reply = self._reply, None
        if header is None:
            raise ProtocolError("no reply has arrived")
        op = header.op
        if op == _ERROR:
            code, message = decode_error(self._payload)
            self._payload = None
            error = error_from_code(code, message)
            if isinstance(error, ShuttingDown):
                error.resumable = bool(header.flags & _RESUMABLE)
            if self.shm is not None:  # (a refused request may have left its rows segment unmapped)
                self.shm.rows_unsent()
            # An error answering no request (id 0) means the server is closing
            # this connection: framing was lost, or it is shutting down.
            self.connection_lost = header.request_id == 0 or isinstance(error, APSConnectionError)
            raise error
        self._payload = None
        if op == _INIT_REPLY:
            self.joined = self.ever_joined = True
            self._unsent_values = None  # (the server's weights are in)
            self.joined_running = bool(header.flags & _RUNNING)
        if op in _COUNTED_REPLIES:
            self.clock = header.clock
            if header.live:
                self.live = header.live
            if op in _WEIGHT_REPLIES and (header.dtype != _NONE or self._rows is None or self._rows.versioned):
                # the version of the weights this worker holds
                # (a reply of rows alone too: the rows are of that version, and BSP's round rule needs it;
                # the dense weights it holds are as they were: docs/design/engine.md, "Embedding tables")
                self.version = header.version
            if op in _PUSH_REPLIES:
                self.dropped = bool(header.flags & _DROPPED)
                self._push = None
        return header
