"""The aps wire protocol: frame header, op codes, flags, dtypes, payload codecs.

No I/O happens here. Every frame is a fixed 40-byte little-endian header
followed by ``length`` payload bytes; array payloads are the raw bytes of a
flat float32 vector, never serialized objects. docs/protocol.md is the
written specification; this module is its only implementation.
"""

from __future__ import annotations

import hashlib
import json
import struct
from enum import IntEnum, IntFlag
from typing import NamedTuple

import numpy as np

from ..errors import (
    BadMagic,
    FrameTooLarge,
    InvalidHyperparameters,
    InvalidState,
    MalformedFrame,
    PayloadSizeMismatch,
    UnsupportedVersion,
)
from ..layout import Layout
from .rows import decode_tables, encode_tables

__all__ = [
    "DType",
    "Flag",
    "HEADER_SIZE",
    "Header",
    "InitRequest",
    "MAGIC",
    "Op",
    "PROTOCOL_VERSION",
    "HANDSHAKE_OPS",
    "HyperGroup",
    "MAX_STATE_HEAD_BYTES",
    "MAX_STEPS",
    "StateHead",
    "decode_state_head",
    "encode_state_head",
    "negative_second_moment",
    "state_digest",
    "WEIGHTS_DIGEST_BYTES",
    "weights_digest",
    "check_stops",
    "MAX_HYPER_BYTES",
    "MAX_HYPER_GROUPS",
    "NONCE_BYTES",
    "auth_proof",
    "decode_auth_reply",
    "decode_error",
    "decode_init",
    "decode_layout_block",
    "decode_join_progress",
    "ANY_RANK",
    "MAX_COUNTER",
    "PACE_BYTES",
    "MAX_COUNTER_NAME",
    "MAX_COUNTERS",
    "decode_seated",
    "encode_seated",
    "encode_error",
    "decode_hello",
    "decode_hello_reply",
    "decode_hyper",
    "decode_slot",
    "describe_join_progress",
    "encode_hello",
    "encode_hello_reply",
    "encode_hyper",
    "encode_init",
    "encode_join_progress",
    "encode_slot",
    "host_identity",
    "is_known_op",
    "pack_header",
    "unpack_header",
]

MAGIC = 0x31535041  # b"APS1" read as a little-endian uint32
PROTOCOL_VERSION = 1

# magic u32, protocol version u16, op u8, flags u8, dtype u8, live u16 (replies; 0 in
# requests), 1 reserved byte, request id u32, clock u64, version u64, payload length u64.
_HEADER = struct.Struct("<IHBBBHxIQQQ")
HEADER_SIZE = _HEADER.size
assert HEADER_SIZE == 40


class Op(IntEnum):
    """Operation codes. A reply carries the request's op with the REPLY bit set."""

    INIT = 1
    PULL = 2
    PUSH = 3
    PUSH_PULL = 4
    LEAVE = 5
    PING = 6
    STATS = 7
    HELLO = 8
    AUTH = 9
    CHECKPOINT = 10
    SHARDS = 11
    HYPER = 12
    STATE = 13
    LOAD_STATE = 14
    LOAD_WEIGHTS = 15
    #: A sharded BSP worker brings every shard back to one round (docs/algorithms.md,
    #: "Sharded resume"): with Flag.CHECK, the versions of this run's checkpoints; else
    #: restart from the checkpoint at the version its header names.
    REWIND = 16
    #: Add the header's ``version`` to the run's counter named by the payload (UTF-8, at most
    #: MAX_COUNTER_NAME bytes) and answer with its value before (the reply's ``version``):
    #: an atomic fetch-and-add that claims work once across workers (aps.torch.ElasticSampler).
    CLAIM = 17
    #: What the worker's training loop reports (aps.Worker.log): its scalars, its process's
    #: CPU time and memory, its batches' digests; a JSON object (aps.wire.scalars), after INIT.
    LOG = 18
    #: How many local steps this worker has taken (the header's ``version``, at most 2**53) and
    #: the seconds they took (the payload, a little-endian float64), for the server to keep its
    #: step rate; the reply: UTF-8 JSON ``{"rate": R, "fastest": F}``, its rate and the fastest
    #: live worker's, null until measured (aps.torch.LocalSGD's dynamic local updates).
    PACE = 19

    REPLY = 0x80
    INIT_REPLY = 0x81
    PULL_REPLY = 0x82
    PUSH_REPLY = 0x83
    PUSH_PULL_REPLY = 0x84
    LEAVE_REPLY = 0x85
    PING_REPLY = 0x86
    STATS_REPLY = 0x87
    HELLO_REPLY = 0x88
    AUTH_REPLY = 0x89
    CHECKPOINT_REPLY = 0x8A
    SHARDS_REPLY = 0x8B
    HYPER_REPLY = 0x8C
    STATE_REPLY = 0x8D
    LOAD_STATE_REPLY = 0x8E
    LOAD_WEIGHTS_REPLY = 0x8F
    REWIND_REPLY = 0x90
    CLAIM_REPLY = 0x91
    LOG_REPLY = 0x92
    PACE_REPLY = 0x93
    #: Not a reply: a notice the server sends just before an INIT_REPLY (same request id) to an
    #: INIT that asked for it (Flag.SEAT):
    #: the rank the worker was seated under (it may have asked for ANY_RANK) and the
    #: server's MIN and MAX workers (equal for a fixed size). Payload: u32 rank, min, max.
    SEATED = 0xFC
    #: Not a reply: a notice the server sends while it holds a request (a pull
    #: at the gate, a push in the lane) to say it is alive; no payload.
    ALIVE = 0xFD
    #: Not a reply: a notice the server sends while an INIT waits for the other
    #: workers (same request id as the INIT); the INIT_REPLY follows later.
    JOIN_PROGRESS = 0xFE
    ERROR = 0xFF


REQUEST_OPS = frozenset(
    {
        Op.INIT,
        Op.PULL,
        Op.PUSH,
        Op.PUSH_PULL,
        Op.LEAVE,
        Op.PING,
        Op.STATS,
        Op.HELLO,
        Op.AUTH,
        Op.CHECKPOINT,
        Op.SHARDS,
        Op.HYPER,
        Op.STATE,
        Op.LOAD_STATE,
        Op.LOAD_WEIGHTS,
        Op.REWIND,
        Op.CLAIM,
        Op.LOG,
        Op.PACE,
    }
)
#: What a connection may ask before it has authenticated (when the server has a token).
HANDSHAKE_OPS = frozenset({Op.HELLO, Op.AUTH})
_KNOWN_OPS = frozenset(int(op) for op in Op)


class Flag(IntFlag):
    """Frame flags."""

    NONE = 0
    #: PUSH/PUSH_PULL reply: the gradient was dropped, not applied: it arrived for a
    #: closed BSP round (backup workers), or it is older than the SSP/DSSP bound allows
    #: (sent again after a reconnect). LOAD_STATE and LOAD_WEIGHTS replies: this state
    #: (these weights) was loaded into the run already (same digest); nothing was loaded again.
    DROPPED = 1
    #: ERROR of code SHUTTING_DOWN: the server can be resumed where it stops (it checkpoints
    #: as it shuts down: ``aps serve --checkpoint-dir DIR --resume``), so a worker waits for it
    #: and rejoins; without it the server ends for good, and the worker's call raises at once.
    RESUMABLE = 1
    #: Shared-memory transport: the array is not in the payload. On PUSH, the
    #: gradient is in the worker's shared gradient segment; on a weights reply,
    #: the payload is a slot descriptor (see encode_slot).
    SHM = 2
    #: INIT_REPLY: the worker joined a model that was already training; the
    #: weights are the server's and the values it sent were not used.
    RUNNING = 4
    #: LEAVE: this worker's training is done, the run is ending: an elastic server holds
    #: the workers still training below MIN no more (docs/algorithms.md, "Elastic membership").
    FINISHED = 4
    #: PUSH_PULL (no payload): a sharded BSP worker that a shard seated in the round before the
    #: one the other shards seated it in takes no part in this shard's open round: it is there
    #: without a gradient, and its reply is the round's weights (docs/algorithms.md, "Sharded
    #: BSP: a worker that joins").
    SKIP = 4
    #: PUSH (a dense gradient, no rows): if the policy holds this worker at its gate (its last
    #: push took it past the SSP/DSSP bound), the push waits there until the gate lets the
    #: worker go on, then is applied, instead of being refused: a worker that pipelines its
    #: pushes (docs/protocol.md, "Pipelining") runs at most the bound ahead.
    GATE = 4
    #: INIT: the worker reconnects after losing its connection (its header's
    #: clock is the clock it had); it goes on from there, and a push it sends
    #: again is recognised (docs/protocol.md, "Reconnecting").
    REJOIN = 8
    #: PULL/PUSH_PULL over TCP: send the weights as the request's dtype
    #: (BFLOAT16 or FLOAT16, rounded to nearest even) rather than float32; the
    #: reply's dtype says what it carries (a compressed pull).
    NARROW = 16
    #: HYPER: check the values only (refused or accepted as a HYPER would be), keep the
    #: ones in force. A sharded worker checks on every shard before it sets on any, so
    #: that a request is taken by all of them or by none. LOAD_STATE: check the
    #: description only (its arrays are not sent), load nothing. LOAD_WEIGHTS: check the
    #: digest only (the weights are not sent), load nothing.
    CHECK = 32
    #: PULL/PUSH/PUSH_PULL and their replies: the payload ends with rows of the model's
    #: embedding tables (aps.wire.rows; docs/protocol.md, "Rows"). A request's dtype then
    #: names its dense part, NONE for none: a push of rows alone, a pull of rows alone.
    ROWS = 64
    #: INIT: send a SEATED notice before the INIT_REPLY (the rank seated under, the server's
    #: MIN and MAX workers). aps.Worker always asks; it must when it asks for ANY_RANK.
    SEAT = 128


class DType(IntEnum):
    """Element type of an array payload. aps models are float32; gradients and
    weights may cross TCP as BFLOAT16 or FLOAT16 (wire compression), and gradients
    as INT8Q or INT4Q (block-quantized); the other codes exist so a peer can say
    what it sent and get a precise error back."""

    NONE = 0
    FLOAT32 = 1
    FLOAT64 = 2
    FLOAT16 = 3
    BFLOAT16 = 4
    INT32 = 5
    INT64 = 6
    UINT8 = 7
    #: A block-quantized gradient (aps.wire.quantized): float32 scales, then int8 codes.
    INT8Q = 8
    #: The same with 4-bit codes, two to a byte.
    INT4Q = 9

    @classmethod
    def of(cls, dtype: np.dtype) -> DType:
        return _NUMPY_DTYPES.get(np.dtype(dtype).str, cls.NONE)


_NUMPY_DTYPES = {
    "<f4": DType.FLOAT32,
    "<f8": DType.FLOAT64,
    "<f2": DType.FLOAT16,
    "<i4": DType.INT32,
    "<i8": DType.INT64,
    "|u1": DType.UINT8,
}


class Header(NamedTuple):
    """A decoded frame header. ``live``: in a reply to INIT, PULL, PUSH or PUSH_PULL, the
    workers live at the server when it answered (0: not said)."""

    op: int
    flags: int
    dtype: int
    request_id: int
    clock: int
    version: int
    length: int
    live: int = 0


def pack_header(
    op: int,
    flags: int = 0,
    dtype: int = 0,
    request_id: int = 0,
    clock: int = 0,
    version: int = 0,
    length: int = 0,
    live: int = 0,
) -> bytes:
    """The 40 header bytes of a frame (hot paths pass the fields positionally)."""
    return _HEADER.pack(MAGIC, PROTOCOL_VERSION, op, flags, dtype, live, request_id, clock, version, length)


def unpack_header(data, max_payload: int | None = None) -> Header:
    """Decode and check a header from the first 40 bytes of ``data``.

    Raises:
        BadMagic, UnsupportedVersion: framing is lost; the connection must close.
        FrameTooLarge: ``length`` is over ``max_payload``; the connection must close.

    An unknown op code is not an error here: the frame is intact and can be
    skipped; the receiver decides (see :func:`is_known_op`).
    """
    magic, version, op, flags, dtype, live, request_id, clock, weights_version, length = _HEADER.unpack_from(data)
    if magic != MAGIC:
        raise BadMagic(_bad_magic(magic))
    if version != PROTOCOL_VERSION:
        raise UnsupportedVersion(f"protocol version {version} is not supported (this side speaks {PROTOCOL_VERSION})")
    header = Header(op, flags, dtype, request_id, clock, weights_version, length, live)
    if max_payload is not None and length > max_payload:
        raise FrameTooLarge(f"frame payload of {length} bytes is over the limit of {max_payload} bytes")
    return header


#: The first four bytes of an HTTP response ("HTTP/1.1 400 ...") read as the magic: a worker
#: pointed at the server's dashboard/metrics port (``--http-port``) instead of its worker port.
_HTTP_MAGIC = int.from_bytes(b"HTTP", "little")


def _bad_magic(magic: int) -> str:
    if magic == _HTTP_MAGIC:
        return (
            f"bad magic 0x{magic:08x} ('HTTP'): this is an HTTP server (the dashboard/metrics port, "
            "--http-port?): point the worker at the server's worker port (the address `aps serve` "
            "prints first, 'aps: serving on tcp://...')"
        )
    return f"bad magic 0x{magic:08x}: not an aps frame (expected 0x{MAGIC:08x})"


def is_known_op(op: int) -> bool:
    return op in _KNOWN_OPS


# Error payload: u32 code, then the UTF-8 message.
_ERROR = struct.Struct("<I")


def encode_error(code: int, message: str) -> bytes:
    return _ERROR.pack(int(code)) + message.encode("utf-8", "replace")


def decode_error(payload) -> tuple[int, str]:
    if len(payload) < _ERROR.size:
        return 0, "malformed error frame"
    (code,) = _ERROR.unpack_from(payload)
    return code, bytes(payload[_ERROR.size :]).decode("utf-8", "replace")


# INIT payload: the layout block, zero padding to a multiple of 8, then the
# initial float32 values. Layout block: u32 rank, u32 num_workers,
# u32 tensor count, u32 table count; per tensor: u16 name length, u8 ndim,
# u8 reserved, the UTF-8 name, then ndim u64 dimensions; then the tables'
# declarations (aps.wire.rows: name and JSON description each). The INIT header's
# ``version`` field carries the layout block's length (padding included), so
# the server can read and check the block before it makes room for the values.
_INIT_HEAD = struct.Struct("<IIII")
_TENSOR_HEAD = struct.Struct("<HBx")
#: Limits of an INIT's layout block, checked before the server allocates anything for it.
MAX_TENSORS = 1 << 16
MAX_NAME_BYTES = 1024
MAX_NDIM = 32
MAX_LAYOUT_BYTES = 4 << 20
INIT_HEAD_BYTES = _INIT_HEAD.size


class InitRequest(NamedTuple):
    """A decoded INIT payload."""

    rank: int
    num_workers: int
    layout: Layout
    values_offset: int


def encode_init(rank: int, num_workers: int, layout: Layout) -> bytes:
    """The layout block of an INIT payload, padded so the values that follow are 8-aligned
    (its length goes in the INIT header's ``version`` field)."""
    parts = [_INIT_HEAD.pack(rank, num_workers, len(layout), len(layout.tables))]
    for name, shape in zip(layout.names, layout.shapes):
        raw = name.encode("utf-8")
        parts.append(_TENSOR_HEAD.pack(len(raw), len(shape)))
        parts.append(raw)
        parts.append(struct.pack(f"<{len(shape)}Q", *shape))
    parts.append(encode_tables(dict(layout.tables)))
    block = b"".join(parts)
    return block + b"\0" * (-len(block) % 8)


def decode_layout_block(block) -> InitRequest:
    """Parse an INIT's layout block (``block`` holds it and nothing else, padding included).

    Raises:
        MalformedFrame: the block is truncated, too long, or over the limits
            (MAX_TENSORS tensors, names of MAX_NAME_BYTES, MAX_NDIM dimensions).
        LayoutMismatch: the layout itself is invalid (duplicate names, bad shapes).
    """
    view = memoryview(block)
    rank, num_workers, layout, end = _parse_layout(view)
    if len(view) != end + (-end % 8):
        raise MalformedFrame(f"INIT layout block of {len(view)} bytes holds {end} bytes of layout")
    return InitRequest(rank, num_workers, layout, len(view))


def decode_init(payload) -> InitRequest:
    """Parse a whole INIT payload; checks that the values that follow have the layout's size.

    Raises:
        MalformedFrame: the layout block is truncated or inconsistent.
        PayloadSizeMismatch: the values do not have the layout's size.
        LayoutMismatch: the layout itself is invalid (duplicate names, bad shapes).
    """
    view = memoryview(payload)
    rank, num_workers, layout, offset = _parse_layout(view)
    offset += -offset % 8
    values = len(view) - offset
    if values != layout.nbytes:
        raise PayloadSizeMismatch(f"INIT carries {max(values, 0)} bytes of values; its layout needs {layout.nbytes}")
    return InitRequest(rank, num_workers, layout, offset)


def _parse_layout(view: memoryview) -> tuple[int, int, Layout, int]:
    """``(rank, num_workers, layout, end)`` from the start of ``view``; linear in its length."""
    try:
        rank, num_workers, count, table_count = _INIT_HEAD.unpack_from(view, 0)
        if count > MAX_TENSORS:
            raise MalformedFrame(f"INIT declares {count} tensors; at most {MAX_TENSORS} are accepted")
        offset = _INIT_HEAD.size
        names, shapes = [], []
        for _ in range(count):
            name_len, ndim = _TENSOR_HEAD.unpack_from(view, offset)
            offset += _TENSOR_HEAD.size
            if name_len > MAX_NAME_BYTES or ndim > MAX_NDIM:
                raise MalformedFrame(
                    f"INIT tensor name of {name_len} bytes or {ndim} dimensions; at most {MAX_NAME_BYTES} bytes "
                    f"and {MAX_NDIM} dimensions are accepted"
                )
            if offset + name_len + 8 * ndim > len(view):
                raise MalformedFrame("INIT layout block is truncated")
            names.append(bytes(view[offset : offset + name_len]).decode("utf-8"))
            offset += name_len
            shapes.append(tuple(struct.unpack_from(f"<{ndim}Q", view, offset)))
            offset += 8 * ndim
        tables, offset = decode_tables(view, offset, table_count)
    except (struct.error, UnicodeDecodeError) as exc:
        raise MalformedFrame(f"INIT layout block cannot be parsed: {exc}") from None
    return rank, num_workers, Layout(tuple(names), tuple(shapes), tuple(tables.items())), offset


# HELLO reply payload: u16 length + UTF-8 host identity, u16 length + UTF-8
# path of the server's Unix socket ("" when it has none), u16 length + UTF-8
# run id (the identity of the training run the server holds, kept across
# checkpoints and resumes; absent from older servers: read as ""), u16 length
# + UTF-8 JSON object of the shard's index and the options every shard of a
# model shares (ServerConfig.shard_description; absent from older servers),
# u16 length + ASCII lineage: the incarnations of the run that led to this
# server, comma-separated, oldest first, this server's own last (each start
# of a server draws an incarnation id of its own; a resume carries on its
# checkpoint's lineage; absent from older servers).
_U16 = struct.Struct("<H")
_HELLO_FIELDS = 5


class ServerInfo(NamedTuple):
    """What a server says of itself in the handshake."""

    host: str  # host identity: equal on both ends exactly when they share a kernel
    unix_path: str  # its Unix socket ("" when it has none)
    run_id: str
    shard: str = ""  # JSON: its shard index and the options the shards share ("" from older servers)
    lineage: str = ""  # the run's incarnations that led to this server, oldest first, its own last

    @property
    def incarnations(self) -> list[str]:
        """:attr:`lineage` as a list (empty from older servers)."""
        return self.lineage.split(",") if self.lineage else []


def host_identity() -> str:
    """Who this host is, this boot: equal on both ends exactly when they share a kernel."""
    import socket

    try:
        with open("/proc/sys/kernel/random/boot_id") as fh:
            boot = fh.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def encode_hello(host: str, unix_path: str, run_id: str = "", shard: str = "", lineage: str = "") -> bytes:
    parts = []
    for text in (host, unix_path, run_id, shard, lineage):
        raw = text.encode("utf-8")
        parts += [_U16.pack(len(raw)), raw]
    return b"".join(parts)


def decode_hello(payload) -> ServerInfo:
    """The HELLO fields (the trailing ones an older server does not send read as "")."""
    view = memoryview(payload)
    fields: list[str] = []
    offset = 0
    try:
        for index in range(_HELLO_FIELDS):
            if index >= 2 and offset == len(view):
                break  # an older server: no run id, no shard
            (size,) = _U16.unpack_from(view, offset)
            offset += 2
            if offset + size > len(view):
                raise MalformedFrame("HELLO reply is truncated")
            fields.append(bytes(view[offset : offset + size]).decode("utf-8"))
            offset += size
    except (struct.error, UnicodeDecodeError) as exc:
        raise MalformedFrame(f"HELLO reply cannot be parsed: {exc}") from None
    return ServerInfo(*fields, *[""] * (_HELLO_FIELDS - len(fields)))


# The handshake. HELLO carries the client's nonce (NONCE_BYTES, or nothing);
# HELLO_REPLY: u8 flags (bit 0: a token is required), 7 reserved bytes, the
# server's nonce, then (when no token is required) the HELLO fields above.
# AUTH carries the client's proof, then its claim (what it means to reach,
# "run=ID;shard=I/K", once it knows; empty before); AUTH_REPLY the server's
# proof, then the HELLO fields. A proof is HMAC-SHA256(token, role || server
# nonce || client nonce || bound): the client's binds its claim, the server's
# the claim and the HELLO fields after it. The token never crosses the wire,
# each connection's nonces are fresh (a proof from one connection is
# worthless on another), the worker checks the server's proof too (a server
# without the token cannot pass for the real one, nor change what it says of
# itself), and a server refuses (answers, proved, and closes) a claim that is
# not itself: a proof relayed to another shard of the run, or another run
# with the same token, opens nothing there.
NONCE_BYTES = 32
PROOF_BYTES = 32  # an HMAC-SHA256
_HELLO_REPLY = struct.Struct("<B7x")
_AUTH_REQUIRED = 1


#: The most a client's claim (what server it means to reach) may hold, in bytes.
MAX_CLAIM_BYTES = 512


def auth_proof(token: bytes, role: str, server_nonce: bytes, client_nonce: bytes, bound: bytes = b"") -> bytes:
    """``role`` is "client" or "server"; ``bound``: what else the proof vouches for (the
    client's claim; the server's: the claim and what the server says of itself)."""
    import hashlib
    import hmac

    return hmac.new(token, f"aps/1 {role}".encode() + server_nonce + client_nonce + bound, hashlib.sha256).digest()


def encode_claim(run_id: str, shard: int, shards: int) -> bytes:
    """A client's claim: the run and the shard it means to reach (it reached them before)."""
    return f"run={run_id};shard={shard}/{shards}".encode("ascii", "replace")[:MAX_CLAIM_BYTES]


def decode_claim(claim: bytes) -> dict[str, str]:
    """``{"run": ..., "shard": "I/K"}`` of a claim (empty: none; unknown parts ignored)."""
    out = {}
    for part in bytes(claim).decode("ascii", "replace").split(";"):
        key, sep, value = part.partition("=")
        if sep:
            out[key] = value
    return out


def encode_hello_reply(
    auth_required: bool,
    server_nonce: bytes,
    host: str,
    unix_path: str,
    run_id: str = "",
    shard: str = "",
    lineage: str = "",
) -> bytes:
    head = _HELLO_REPLY.pack(_AUTH_REQUIRED if auth_required else 0) + server_nonce
    return head if auth_required else head + encode_hello(host, unix_path, run_id, shard, lineage)


def decode_hello_reply(payload) -> tuple[bool, bytes, ServerInfo | None]:
    """``(auth_required, server_nonce, the server's ServerInfo or None)``."""
    view = memoryview(payload)
    if len(view) < _HELLO_REPLY.size + NONCE_BYTES:
        raise MalformedFrame(f"HELLO reply of {len(view)} bytes is too short")
    (flags,) = _HELLO_REPLY.unpack_from(view, 0)
    nonce = bytes(view[_HELLO_REPLY.size : _HELLO_REPLY.size + NONCE_BYTES])
    rest = view[_HELLO_REPLY.size + NONCE_BYTES :]
    required = bool(flags & _AUTH_REQUIRED)
    return required, nonce, None if required else decode_hello(rest)


def decode_auth_reply(payload) -> tuple[bytes, ServerInfo]:
    """``(server proof, the server's ServerInfo)``."""
    view = memoryview(payload)
    if len(view) < PROOF_BYTES:
        raise MalformedFrame(f"AUTH reply of {len(view)} bytes is too short")
    return bytes(view[:PROOF_BYTES]), decode_hello(view[PROOF_BYTES:])


# Shared-memory weights reply payload: u64 slot id, u64 slot bytes, u32 flags
# (bit 0: the slot's file descriptor comes with this frame), u32 n, then n u64
# ids of slots the worker may unmap.
_SLOT = struct.Struct("<QQII")
SLOT_HAS_FD = 1


def encode_slot(slot_id: int, nbytes: int, has_fd: bool, dropped: list[int]) -> bytes:
    return _SLOT.pack(slot_id, nbytes, SLOT_HAS_FD if has_fd else 0, len(dropped)) + struct.pack(
        f"<{len(dropped)}Q", *dropped
    )


def decode_slot(payload) -> tuple[int, int, bool, list[int]]:
    try:
        slot_id, nbytes, flags, count = _SLOT.unpack_from(payload, 0)
        dropped = list(struct.unpack_from(f"<{count}Q", payload, _SLOT.size))
    except struct.error as exc:
        raise MalformedFrame(f"slot descriptor cannot be parsed: {exc}") from None
    return slot_id, nbytes, bool(flags & SLOT_HAS_FD), dropped


# JOIN_PROGRESS payload: u32 workers joined, u32 workers expected, u32 n,
# then n u32 ranks that have not joined (the lowest, at most _MAX_MISSING).
#: A counter's name (CLAIM) is 1 to this many UTF-8 bytes; a run keeps at most MAX_COUNTERS.
MAX_COUNTER_NAME = 256
MAX_COUNTERS = 4096
#: The most a counter may hold (and a CLAIM add): exact in a float64, as JSON keeps it.
MAX_COUNTER = 1 << 53

#: A PACE's payload: the seconds the worker's steps took, a float64.
PACE_BYTES = 8

#: INIT's rank field asking the server for a free rank (``aps.Worker(rank=None)`` without $RANK).
ANY_RANK = 0xFFFFFFFF

#: The most pushes a worker keeps in flight on one connection (``AsyncWorker(pipeline=N)``):
#: a push sent again after a reconnect is at most this many requests before the last one taken.
MAX_IN_FLIGHT = 1024


def request_before(request_id: int, later: int, window: int = MAX_IN_FLIGHT) -> bool:
    """Whether request ``request_id`` was sent before request ``later``, at most ``window``
    requests before it (request ids count up by one from 1 to 2**32-1, then start again at 1)."""
    behind = (later - request_id) % 0xFFFFFFFF
    return 0 < behind <= window


_SEATED = struct.Struct("<III")


def encode_seated(rank: int, min_workers: int, max_workers: int) -> bytes:
    return _SEATED.pack(rank, min_workers, max_workers)


def decode_seated(payload) -> tuple[int, int, int]:
    """``(rank, min_workers, max_workers)`` of a SEATED notice."""
    if len(payload) != _SEATED.size:
        raise MalformedFrame(f"a SEATED notice carries {_SEATED.size} bytes, got {len(payload)}")
    rank, low, high = _SEATED.unpack_from(payload)
    if not 1 <= low <= high or rank >= high:
        raise MalformedFrame(f"a SEATED notice says rank {rank} of {low}:{high} workers")
    return rank, low, high


_PROGRESS = struct.Struct("<III")
_MAX_MISSING = 1024


def encode_join_progress(joined: int, workers: int, missing: list[int]) -> bytes:
    missing = missing[:_MAX_MISSING]
    return _PROGRESS.pack(joined, workers, len(missing)) + struct.pack(f"<{len(missing)}I", *missing)


def decode_join_progress(payload) -> tuple[int, int, list[int]]:
    """``(joined, workers, missing ranks)``; the list may be cut short (``workers - joined`` say how many)."""
    try:
        joined, workers, count = _PROGRESS.unpack_from(payload, 0)
        missing = list(struct.unpack_from(f"<{count}I", payload, _PROGRESS.size))
    except struct.error as exc:
        raise MalformedFrame(f"JOIN_PROGRESS notice cannot be parsed: {exc}") from None
    return joined, workers, missing


# HYPER payload: u32 group count G, then G records of u64 stop (the exclusive end
# of the group's range in the flat vector; the first group starts at 0) and
# float64 lr, weight_decay, momentum, dampening (for Adam and AdamW: beta1, beta2).
_HYPER_HEAD = struct.Struct("<I")
_HYPER_GROUP = struct.Struct("<Qdddd")
#: At most this many groups in one HYPER request (so it is at most MAX_HYPER_BYTES long, under
#: the smallest --max-frame-bytes). Each group is one kernel call per update on the server's
#: update lane (about 2.5 us), and neighbours with equal values are merged into one range.
MAX_HYPER_GROUPS = 1024
MAX_HYPER_BYTES = _HYPER_HEAD.size + MAX_HYPER_GROUPS * _HYPER_GROUP.size


class HyperGroup(NamedTuple):
    """One group of a HYPER request: the optimizer's values for the range that ends at
    ``stop`` (and starts where the group before it stops, or at 0). For Adam and AdamW,
    ``momentum`` and ``dampening`` carry beta1 and beta2."""

    stop: int
    lr: float
    weight_decay: float
    momentum: float
    dampening: float


def check_stops(groups: list[HyperGroup], numel: int) -> None:
    """Check that the groups' stops cut ``numel`` elements into consecutive ranges: strictly
    increasing from above 0, the last one ``numel``.

    Raises:
        InvalidHyperparameters: naming the first group whose stop is wrong.
    """
    previous = 0
    for index, group in enumerate(groups):
        if group.stop <= previous:
            raise InvalidHyperparameters(
                f"group {index}: stop {group.stop} is not after the previous group's stop ({previous}): "
                "stops must be strictly increasing, from above 0"
            )
        if group.stop > numel:
            raise InvalidHyperparameters(f"group {index}: stop {group.stop} is beyond the model's {numel} parameters")
        previous = group.stop
    if previous != numel:
        raise InvalidHyperparameters(
            f"the last group stops at {previous}, but the model has {numel} parameters: "
            "the last stop must be the model's size"
        )


def encode_hyper(groups: list[HyperGroup]) -> bytes:
    """A HYPER payload (the server checks the values; this only packs them)."""
    try:
        return _HYPER_HEAD.pack(len(groups)) + b"".join(
            _HYPER_GROUP.pack(int(g.stop), float(g.lr), float(g.weight_decay), float(g.momentum), float(g.dampening))
            for g in groups
        )
    except struct.error as exc:
        raise ValueError(f"hyperparameter groups cannot be encoded: {exc}") from None


def decode_hyper(payload) -> list[HyperGroup]:
    """The groups of a HYPER payload, as sent (their values are checked by the optimizer).

    Raises:
        InvalidHyperparameters: no groups, or more than MAX_HYPER_GROUPS.
        MalformedFrame: the payload is not as long as its group count says.
    """
    view = memoryview(payload)
    if len(view) < _HYPER_HEAD.size:
        raise MalformedFrame(f"HYPER payload of {len(view)} bytes is too short")
    (count,) = _HYPER_HEAD.unpack_from(view, 0)
    if not 1 <= count <= MAX_HYPER_GROUPS:
        raise InvalidHyperparameters(f"HYPER declares {count} groups; from 1 to {MAX_HYPER_GROUPS} are accepted")
    expected = _HYPER_HEAD.size + count * _HYPER_GROUP.size
    if len(view) != expected:
        raise MalformedFrame(f"HYPER payload of {len(view)} bytes; {count} groups take {expected}")
    return [HyperGroup(*fields) for fields in _HYPER_GROUP.iter_unpack(view[_HYPER_HEAD.size :])]


# STATE reply and LOAD_STATE payload: u32 D (the description's length), u32 reserved (0),
# D bytes of UTF-8 JSON describing the state, zero padding to a multiple of 8 bytes (from the
# payload's start), then the arrays: float32, ``numel`` each, end to end in the described order.
_STATE_HEAD = struct.Struct("<II")
#: The longest description of an optimizer state (a few names and numbers) accepted.
MAX_STATE_HEAD_BYTES = 64 << 10
#: The largest step count a state may carry (exact in a float64, as JSON numbers are read).
MAX_STEPS = 1 << 53
#: The largest step count a STATE reply may carry: a run that loaded MAX_STEPS counts on
#: (the digest holds steps as a u64).
MAX_REPLY_STEPS = (1 << 64) - 1
#: Bytes of a state's digest (BLAKE2b, see :func:`state_digest`).
STATE_DIGEST_BYTES = 16


class StateHead(NamedTuple):
    """The description of an optimizer state (a STATE reply's, a LOAD_STATE's).

    Attributes:
        optimizer: the optimizer's name (``sgd``, ``adam``, ``adamw``).
        steps: the optimizer's step count (updates it has applied).
        numel: elements of each array (the model's, or a shard's, size).
        arrays: the arrays' names, in the order they follow.
        version: the weights version the state belongs to (STATE replies; None in a load).
        digest: BLAKE2b-128 of the state (:func:`state_digest`; loads; None in a reply).
        nbytes: bytes of the head: the 8 fixed bytes, the description and its padding.
    """

    optimizer: str
    steps: int
    numel: int
    arrays: tuple[str, ...]
    version: int | None = None
    digest: bytes | None = None
    nbytes: int = 0

    @property
    def payload_bytes(self) -> int:
        """The whole payload's length with every array."""
        return self.nbytes + 4 * self.numel * len(self.arrays)


def encode_state_head(
    optimizer: str, steps: int, numel: int, arrays, *, version: int | None = None, digest: bytes | None = None
) -> bytes:
    """The head of a STATE reply or a LOAD_STATE payload (the arrays follow it, raw)."""
    described: dict = {"optimizer": optimizer, "steps": int(steps), "numel": int(numel), "arrays": list(arrays)}
    if version is not None:
        described["version"] = int(version)
    if digest is not None:
        described["digest"] = digest.hex()
    text = json.dumps(described, separators=(",", ":")).encode()
    head = _STATE_HEAD.pack(len(text), 0) + text
    return head + b"\0" * (-len(head) % 8)


def state_head_bytes(first: bytes | memoryview) -> int:
    """The head's length (padding included) from its first 8 bytes.

    Raises:
        MalformedFrame: the description is longer than MAX_STATE_HEAD_BYTES.
    """
    size, _ = _STATE_HEAD.unpack_from(first, 0)
    if size > MAX_STATE_HEAD_BYTES:
        raise MalformedFrame(
            f"optimizer state description of {size} bytes; at most {MAX_STATE_HEAD_BYTES} are accepted"
        )
    end = _STATE_HEAD.size + size
    return end + (-end % 8)


def decode_state_head(payload, max_steps: int = MAX_STEPS) -> StateHead:
    """The description at the start of ``payload`` (a STATE reply or a LOAD_STATE payload);
    the arrays after it are not looked at. ``max_steps``: the largest step count taken (a
    reply's may pass MAX_STEPS: a server goes on counting after a load of MAX_STEPS).

    Raises:
        MalformedFrame: truncated, or the description is not a JSON object of the
            documented fields and types.
        InvalidState: ``steps`` is not an integer from 0 to ``max_steps``.
    """
    view = memoryview(payload)
    if len(view) < _STATE_HEAD.size:
        raise MalformedFrame(f"optimizer state of {len(view)} bytes is too short")
    nbytes = state_head_bytes(view)
    size = _STATE_HEAD.unpack_from(view, 0)[0]
    if len(view) < nbytes:
        raise MalformedFrame(f"optimizer state of {len(view)} bytes; its description takes {nbytes}")
    try:
        described = json.loads(bytes(view[_STATE_HEAD.size : _STATE_HEAD.size + size]).decode("utf-8"))
    except (ValueError, RecursionError):
        raise MalformedFrame("the optimizer state's description is not UTF-8 JSON") from None
    if not isinstance(described, dict):
        raise MalformedFrame("the optimizer state's description is not a JSON object")
    optimizer, steps, numel = described.get("optimizer"), described.get("steps"), described.get("numel")
    arrays, version, digest = described.get("arrays"), described.get("version"), described.get("digest")
    if not isinstance(optimizer, str):
        raise MalformedFrame("the optimizer state's description names no optimizer")
    if not isinstance(steps, int) or isinstance(steps, bool) or not 0 <= steps <= max_steps:
        raise InvalidState(
            f"steps is {steps!r}; it must be an integer from 0 to "
            + ("2**53" if max_steps == MAX_STEPS else str(max_steps))
        )
    if not isinstance(numel, int) or isinstance(numel, bool) or numel < 0:
        raise MalformedFrame(f"the optimizer state's numel is {numel!r}; it must be an integer >= 0")
    if not isinstance(arrays, list) or not all(isinstance(name, str) for name in arrays):
        raise MalformedFrame("the optimizer state's arrays must be a JSON list of names")
    if version is not None and (not isinstance(version, int) or isinstance(version, bool) or version < 0):
        raise MalformedFrame(f"the optimizer state's version is {version!r}; it must be an integer >= 0")
    if digest is not None:
        try:
            digest = bytes.fromhex(digest) if isinstance(digest, str) else None
        except ValueError:
            digest = None
        if digest is None or len(digest) != STATE_DIGEST_BYTES:
            raise MalformedFrame(f"the optimizer state's digest must be {2 * STATE_DIGEST_BYTES} hex digits")
    return StateHead(optimizer, steps, numel, tuple(arrays), version, digest, nbytes)


#: Arrays that hold squares (Adam's second moment): a negative value would make every
#: later update NaN, so every push would be refused from then on.
NON_NEGATIVE_STATE = ("exp_avg_sq",)


def negative_second_moment(arrays) -> str | None:
    """Why ``arrays`` (name to an array or a list of consecutive flat pieces) cannot be
    loaded because of a negative value where only squares are summed, or None."""
    for name in NON_NEGATIVE_STATE:
        value = arrays.get(name)
        if value is None:
            continue
        offset = 0
        for part in value if isinstance(value, (list, tuple)) else (value,):
            if part.size and part.min() < 0:
                index = int(np.flatnonzero(part < 0)[0])
                return (
                    f"{name}[{offset + index}] is {part[index]}: a second moment (a running mean of "
                    "squares) is never negative"
                )
            offset += part.size
    return None


def state_digest(steps: int, pieces) -> bytes:
    """The digest a LOAD_STATE carries: BLAKE2b with a 16-byte digest of ``steps`` as a
    little-endian u64, then the arrays' bytes end to end (``pieces``: buffers in payload
    order, cut anywhere)."""
    digest = hashlib.blake2b(struct.pack("<Q", int(steps)), digest_size=STATE_DIGEST_BYTES)
    for piece in pieces:
        digest.update(memoryview(piece).cast("B"))
    return digest.digest()


def _ranks(ranks: list[int]) -> str:
    """``[0, 1, 2, 5, 7, 8]`` -> ``"0-2, 5, 7-8"``."""
    runs: list[list[int]] = []
    for rank in ranks:
        if runs and rank == runs[-1][1] + 1:
            runs[-1][1] = rank
        else:
            runs.append([rank, rank])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def describe_join_progress(joined: int, workers: int, missing: list[int]) -> str:
    """``"2 of 4 workers joined; missing ranks 1, 3"`` (for log lines and error messages)."""
    text = f"{joined} of {workers} workers joined"
    if missing:
        more = workers - joined - len(missing)
        text += f"; missing rank{'s' if workers - joined > 1 else ''} {_ranks(missing)}"
        text += f" and {more} more" if more > 0 else ""
    return text


# LOAD_WEIGHTS payload: the 16-byte digest of the weights (weights_digest), then the weights:
# float32, the model's (or the shard's) numel, in the layout's order; the digest alone with
# Flag.CHECK. The header's ``version`` field is the version of the weights the worker holds.
#: Bytes of a weights digest (BLAKE2b, see :func:`weights_digest`).
WEIGHTS_DIGEST_BYTES = 16
_WEIGHTS_PERSON = b"aps-weights"


def weights_digest(pieces) -> bytes:
    """The digest a LOAD_WEIGHTS carries: BLAKE2b with a 16-byte digest (personalised
    ``aps-weights``) of the float32 weights' bytes end to end (``pieces``: buffers in payload
    order, cut anywhere). The same weights give the same digest on every rank."""
    digest = hashlib.blake2b(digest_size=WEIGHTS_DIGEST_BYTES, person=_WEIGHTS_PERSON)
    for piece in pieces:
        digest.update(memoryview(piece).cast("B"))
    return digest.digest()
