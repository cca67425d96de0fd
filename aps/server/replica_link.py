"""The replication link between a primary and one backup: its handshake and its frames.

The primary connects to each backup it knows (``--replicas``). Both prove they
hold the run's token before anything else crosses (a challenge each way, HMAC
of the other's nonce, as the workers' handshake does), then the primary says
which set, which primary and which term it speaks for; the backup checks that
with the coordinator and accepts or refuses.

Frames are ``kind (4 bytes) | length (8 bytes, big-endian) | body``:

- ``STAT``: the whole state at one moment: ``json length (4) | json | arrays``,
  the JSON saying the capture's number, the checkpoint manifest (None before
  the model exists) and each array's name, dtype and shape, in the order their
  bytes follow (docs/protocol.md, "Replication");
- ``BEAT``: the primary is alive (sent when nothing else was for a quarter of
  ``--failover-timeout``);
- ``BYE ``: the primary retires the set (its run is over): the backup stops instead of
  taking over;
- ``ACK `` (backup to primary): ``number (8)``: the newest capture it holds.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import secrets
import struct
from typing import Any

import numpy as np

__all__ = [
    "ACK",
    "BEAT",
    "BYE",
    "LinkRefused",
    "STAT",
    "accept_primary",
    "connect_backup",
    "decode_state",
    "encode_state",
    "read_frame",
    "write_frame",
]

MAGIC = b"APSR\x01"
STAT, BEAT, ACK, BYE = b"STAT", b"BEAT", b"ACK ", b"BYE "
_FRAME = struct.Struct(">4sQ")
_U32 = struct.Struct(">I")
_U64 = struct.Struct(">Q")
_NONCE = 32
_MAX_JSON = 64 << 20  # a manifest is small; this only bounds what a broken peer can make us hold
_MAX_FRAME = 1 << 40
_DTYPES = {"float32", "float64", "float16", "int64", "int32", "uint8", "bool", "uint64", "int8"}


class LinkRefused(Exception):
    """The other end failed the handshake (its token, its term) or broke the framing."""


def _mac(token: bytes, who: bytes, nonce: bytes) -> bytes:
    return hmac.new(token, b"aps-replica-" + who + nonce, hashlib.sha256).digest()


async def connect_backup(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, token: bytes, hello: dict, timeout: float
) -> None:
    """The primary's side of the handshake, on a connection to a backup: raises LinkRefused."""
    try:
        magic = await asyncio.wait_for(reader.readexactly(len(MAGIC) + _NONCE), timeout)
        if magic[: len(MAGIC)] != MAGIC:
            raise LinkRefused("it is not an aps backup (no replication greeting)")
        mine = secrets.token_bytes(_NONCE)
        body = json.dumps(hello).encode()
        writer.write(mine + _mac(token, b"primary", magic[len(MAGIC) :]) + _U32.pack(len(body)) + body)
        answer = await asyncio.wait_for(reader.readexactly(32 + 1 + 4), timeout)
        if not hmac.compare_digest(answer[:32], _mac(token, b"backup", mine)):
            raise LinkRefused("it does not know the run's token")
        (length,) = _U32.unpack(answer[33:])
        reason = (await asyncio.wait_for(reader.readexactly(min(length, 4096)), timeout)).decode("utf-8", "replace")
        if answer[32] != 1:
            raise LinkRefused(reason or "refused")
    except (asyncio.IncompleteReadError, ConnectionError, TimeoutError) as exc:
        raise LinkRefused(f"the handshake broke off ({type(exc).__name__})") from None


async def accept_primary(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, token: bytes, timeout: float
) -> tuple[dict, Any]:
    """The backup's side, first half: the primary's proof and hello. Returns the hello and
    a function ``answer(ok, reason)`` that ends the handshake. Raises LinkRefused."""
    mine = secrets.token_bytes(_NONCE)
    writer.write(MAGIC + mine)
    try:
        head = await asyncio.wait_for(reader.readexactly(_NONCE + 32 + 4), timeout)
        if not hmac.compare_digest(head[_NONCE : _NONCE + 32], _mac(token, b"primary", mine)):
            raise LinkRefused("a peer that does not know the run's token asked to be this backup's primary")
        (length,) = _U32.unpack(head[_NONCE + 32 :])
        if length > 64 << 10:
            raise LinkRefused("the primary's hello is too long")
        hello = json.loads(await asyncio.wait_for(reader.readexactly(length), timeout))
        if not isinstance(hello, dict):
            raise LinkRefused("the primary's hello is not a JSON object")
    except (asyncio.IncompleteReadError, ConnectionError, TimeoutError, ValueError) as exc:
        raise LinkRefused(f"the handshake broke off ({type(exc).__name__})") from None
    theirs = head[:_NONCE]

    def answer(ok: bool, reason: str = "") -> None:
        raw = reason.encode()[:4096]
        writer.write(_mac(token, b"backup", theirs) + bytes([1 if ok else 0]) + _U32.pack(len(raw)) + raw)

    return hello, answer


def write_frame(writer: asyncio.StreamWriter, kind: bytes, *parts: bytes | memoryview) -> None:
    writer.write(_FRAME.pack(kind, sum(len(p) for p in parts)))
    for part in parts:
        writer.write(part)


async def read_frame(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    """The next frame (kind, body); raises LinkRefused on a frame no aps peer sends."""
    kind, length = _FRAME.unpack(await reader.readexactly(_FRAME.size))
    if kind not in (STAT, BEAT, ACK, BYE) or length > _MAX_FRAME:
        raise LinkRefused(f"a frame of kind {kind!r} and {length} bytes")
    return kind, await reader.readexactly(length) if length else b""


def encode_state(number: int, manifest: dict | None, arrays: dict[str, np.ndarray]) -> list[bytes | memoryview]:
    """A STAT frame's body, in parts (the arrays are not copied)."""
    head = json.dumps(
        {
            "number": number,
            "manifest": manifest,
            "arrays": [[name, str(a.dtype), list(a.shape)] for name, a in arrays.items()],
        },
        separators=(",", ":"),
    ).encode()
    raw = (np.ascontiguousarray(a).reshape(-1).view(np.uint8).data for a in arrays.values())
    return [_U32.pack(len(head)), head, *raw]


def decode_state(body: bytes) -> tuple[int, dict | None, dict[str, np.ndarray]]:
    """A STAT frame's number, manifest and arrays (views into ``body``); LinkRefused if it does not hold together."""
    try:
        (length,) = _U32.unpack_from(body)
        if length > _MAX_JSON:
            raise ValueError("its JSON is too long")
        head = json.loads(body[4 : 4 + length])
        number, manifest = int(head["number"]), head["manifest"]
        offset = 4 + length
        arrays: dict[str, np.ndarray] = {}
        for name, dtype, shape in head["arrays"]:
            if dtype not in _DTYPES or not all(isinstance(n, int) and n >= 0 for n in shape):
                raise ValueError(f"array {name!r}: dtype {dtype} shape {shape}")
            count = int(np.prod(shape, dtype=np.int64))
            nbytes = count * np.dtype(dtype).itemsize
            if offset + nbytes > len(body):
                raise ValueError(f"array {name!r} runs past the frame")
            arrays[str(name)] = np.frombuffer(body, dtype, count, offset).reshape(shape)
            offset += nbytes
        if offset != len(body) or (manifest is not None and not isinstance(manifest, dict)):
            raise ValueError("bytes left over, or a manifest that is not an object")
    except (ValueError, KeyError, TypeError, struct.error) as exc:
        raise LinkRefused(f"a state frame that does not hold together: {exc}") from None
    return number, manifest, arrays


def encode_ack(number: int) -> bytes:
    return _U64.pack(number)


def decode_ack(body: bytes) -> int:
    if len(body) != _U64.size:
        raise LinkRefused("an ACK of the wrong size")
    return int(_U64.unpack(body)[0])
