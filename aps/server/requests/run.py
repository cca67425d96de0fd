"""The requests about the run rather than a training step: its statistics (STATS), a
checkpoint (CHECKPOINT), a rewind to one (REWIND), the shards' run ids (SHARDS), a counter
(CLAIM), the scalars a worker logs (LOG) and its pace (PACE)."""

from __future__ import annotations

import functools
import json
import struct
from typing import TYPE_CHECKING

from ...errors import CheckpointFailed, InternalServerError, MalformedFrame, ServerError
from ...wire.protocol import MAX_COUNTER_NAME, PACE_BYTES, Op
from ...wire.scalars import MAX_LOG_BYTES, MAX_STEP, decode_log
from .base import CHECK, Handler

if TYPE_CHECKING:
    from ..engine.engine import Answer
    from .base import Exchange, Request

__all__ = ["HANDLERS", "MAX_SHARDS_BYTES", "Checkpoint", "Claim", "Log", "Pace", "Rewind", "Shards", "Stats"]

#: A SHARDS request (the shards' run ids, JSON) is at most this long.
MAX_SHARDS_BYTES = 16 << 10


class Stats(Handler):
    """STATS: everything the server counts (what ``aps status`` shows), as JSON."""

    op = Op.STATS

    def handle(self, conn: Exchange, request: Request, payload: memoryview) -> None:
        snapshot = conn.engine.stats_snapshot()
        conn.reply(request, Op.STATS_REPLY, version=conn.engine.version, payload=json.dumps(snapshot).encode())


class Checkpoint(Handler):
    """CHECKPOINT: write one now (the server's --checkpoint-dir); the reply says where."""

    op = Op.CHECKPOINT

    def handle(self, conn: Exchange, request: Request, payload: memoryview) -> None:
        ask = conn.engine.request_checkpoint
        if ask is None:
            raise CheckpointFailed("this server writes no checkpoints (start it with --checkpoint-dir)")
        ask("request").add_done_callback(
            functools.partial(_answered, conn, request, Op.CHECKPOINT_REPLY, "the checkpoint")
        )


class Rewind(Handler):
    """REWIND: restart the server from a checkpoint (Flag.CHECK: the newest; else the version asked)."""

    op = Op.REWIND

    def handle(self, conn: Exchange, request: Request, payload: memoryview) -> None:
        conn.require_member()
        ask = conn.engine.request_rewind
        if ask is None:
            raise CheckpointFailed(
                "this server cannot rewind to a checkpoint: it writes none (--checkpoint-dir), "
                "or it is not an `aps serve` process (only those restart themselves)"
            )
        version = None if request.header.flags & CHECK else request.header.version
        ask(version).add_done_callback(functools.partial(_answered, conn, request, Op.REWIND_REPLY, "the rewind"))


def _answered(conn: Exchange, request: Request, op: int, what: str, future: Answer) -> None:
    if conn.lost:
        return
    exc = future.exception()
    if exc is not None:
        conn.fail(request, exc if isinstance(exc, ServerError) else InternalServerError(f"{what} failed: {exc}"))
        return
    info = future.result()
    conn.reply(request, op, version=info["version"], payload=json.dumps(info).encode())


class Shards(Handler):
    """SHARDS: the run ids of every shard of a sharded run (kept with this shard's checkpoints)."""

    op = Op.SHARDS
    payload_limit = MAX_SHARDS_BYTES

    def handle(self, conn: Exchange, request: Request, payload: memoryview) -> None:
        conn.require_member()
        try:
            runs = json.loads(bytes(payload).decode("utf-8"))
        except (ValueError, RecursionError):
            raise MalformedFrame("SHARDS takes a JSON list of the shards' run ids") from None
        conn.engine.durability.record_shard_runs(runs)
        conn.reply(request, Op.SHARDS_REPLY)


class Claim(Handler):
    """CLAIM: take the next ``count`` values of a named counter (kept in checkpoints)."""

    op = Op.CLAIM
    payload_limit = MAX_COUNTER_NAME

    def handle(self, conn: Exchange, request: Request, payload: memoryview) -> None:
        conn.require_member()
        try:
            name = bytes(payload).decode("utf-8")
        except UnicodeDecodeError:
            raise MalformedFrame("a counter's name is UTF-8") from None
        conn.reply(request, Op.CLAIM_REPLY, version=conn.engine.durability.claim(name, request.header.version))


class Log(Handler):
    """LOG: scalars a worker logs (its curves on the dashboard)."""

    op = Op.LOG
    payload_limit = MAX_LOG_BYTES

    def handle(self, conn: Exchange, request: Request, payload: memoryview) -> None:
        member = conn.require_member()
        try:
            conn.engine.scalars.record(member.rank, decode_log(payload))
        except ValueError as exc:  # (too many names)
            raise MalformedFrame(str(exc)) from None
        conn.reply(request, Op.LOG_REPLY)


class Pace(Handler):
    """PACE: the worker's local steps and the seconds they took; the reply, its measured step
    rate and the fastest live worker's (aps.server.engine.paces)."""

    op = Op.PACE
    payload_limit = PACE_BYTES

    def handle(self, conn: Exchange, request: Request, payload: memoryview) -> None:
        member = conn.require_member()
        steps = request.header.version
        if len(payload) != PACE_BYTES:
            raise MalformedFrame(f"PACE carries the seconds its steps took, a float64: {PACE_BYTES} bytes")
        (seconds,) = struct.unpack("<d", payload)
        if steps > MAX_STEP or not 0.0 <= seconds <= MAX_STEP:
            raise MalformedFrame(f"PACE's steps and seconds are each 0 to 2**53, got {steps} and {seconds}")
        engine = conn.engine
        engine.paces.report(member.rank, steps, seconds)
        rate, fastest = engine.paces.answer(member.rank, engine.roster.members)
        conn.reply(request, Op.PACE_REPLY, payload=json.dumps({"rate": rate, "fastest": fastest}).encode())


#: This module's handlers (aps.server.requests.HANDLERS gathers them).
HANDLERS = (Stats(), Checkpoint(), Rewind(), Shards(), Claim(), Log(), Pace())
