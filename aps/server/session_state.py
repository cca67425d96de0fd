"""Requests about the run rather than a training step: the statistics, a checkpoint, a rewind,
the shards' run ids, a counter, the scalars a worker logs, per-group optimizer values, and the
optimizer state or weights read and loaded (a mixin of :class:`aps.server.session.ServerSession`,
which holds the state it reads and the replies it sends).
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from ..errors import CheckpointFailed, InternalServerError, MalformedFrame, ServerError
from ..wire.protocol import DType, Flag, Header, Op, decode_hyper, pack_header
from ..wire.scalars import decode_log

if TYPE_CHECKING:
    from .engine import Engine
    from .intake import StateIntake
    from .engine.jobs.state import StateCopy

__all__ = ["RunRequests"]

_FLOAT32 = int(DType.FLOAT32)
_CHECK = int(Flag.CHECK)


class RunRequests:
    """Requests about the run, for :class:`aps.server.session.ServerSession`."""

    engine: Engine
    _lost: bool
    _silenced: bool
    _rid: int
    _state_intake: StateIntake | None
    _traffic: object

    def _on_checkpoint(self, header: Header, payload: memoryview, stream) -> None:
        request = self.engine.request_checkpoint
        if request is None:
            raise CheckpointFailed("this server writes no checkpoints (start it with --checkpoint-dir)")
        request("request").add_done_callback(self._checkpoint_written)

    def _checkpoint_written(self, future) -> None:
        if self._lost:
            return
        exc = future.exception()
        if isinstance(exc, ServerError):
            self._fail(exc)
            return
        if exc is not None:
            self._fail(InternalServerError(f"the checkpoint failed: {exc}"))
            return
        info = future.result()
        self._reply(Op.CHECKPOINT_REPLY, version=info["version"], payload=json.dumps(info).encode())

    def _on_rewind(self, header: Header, payload: memoryview, stream) -> None:
        self._require_member()
        request = self.engine.request_rewind
        if request is None:
            raise CheckpointFailed("this server cannot rewind to a checkpoint: it writes none (--checkpoint-dir), "
                                   "or it is not an `aps serve` process (only those restart themselves)")
        request(None if header.flags & _CHECK else header.version).add_done_callback(self._rewind_answered)

    def _rewind_answered(self, future) -> None:
        if self._lost:
            return
        exc = future.exception()
        if exc is not None:
            self._fail(exc if isinstance(exc, ServerError) else InternalServerError(f"the rewind failed: {exc}"))
            return
        info = future.result()
        self._reply(Op.REWIND_REPLY, version=info["version"], payload=json.dumps(info).encode())

    def _on_shards(self, header: Header, payload: memoryview, stream) -> None:
        self._require_member()
        try:
            runs = json.loads(bytes(payload).decode("utf-8"))
        except (ValueError, RecursionError):
            raise MalformedFrame("SHARDS takes a JSON list of the shards' run ids") from None
        self.engine.record_shard_runs(runs)
        self._reply(Op.SHARDS_REPLY)

    def _on_claim(self, header: Header, payload: memoryview, stream) -> None:
        self._require_member()
        try:
            name = bytes(payload).decode("utf-8")
        except UnicodeDecodeError:
            raise MalformedFrame("a counter's name is UTF-8") from None
        self._reply(Op.CLAIM_REPLY, version=self.engine.claim(name, header.version))

    def _on_log(self, header: Header, payload: memoryview, stream) -> None:
        member = self._require_member()
        try:
            self.engine.scalars.record(member.rank, decode_log(payload))
        except ValueError as exc:  # (too many names)
            raise MalformedFrame(str(exc)) from None
        self._reply(Op.LOG_REPLY)

    def _on_hyper(self, header: Header, payload: memoryview, stream) -> None:
        self.engine.set_hyperparameters(self._require_member(), decode_hyper(payload),
                                        check_only=bool(header.flags & Flag.CHECK))
        self._reply(Op.HYPER_REPLY)

    def _on_state(self, header: Header, payload: memoryview, stream) -> None:
        self.engine.read_optimizer_state(self._require_member(), self._send_state, self._fail)

    def _send_state(self, copy: StateCopy) -> None:
        if self._can_write() and not self._silenced:
            frame = pack_header(Op.STATE_REPLY, 0, _FLOAT32, self._rid, 0, copy.version, copy.nbytes) + copy.head
            self._traffic.bytes_out += len(frame) + copy.arrays.nbytes
            # The transport keeps the copy alive until it has sent it: one reply per connection.
            self._write_parts((frame, memoryview(copy.arrays).cast("B")) if copy.arrays.size else (frame,))
        self._done()

    def _on_load_state(self, header: Header, payload: memoryview, stream) -> None:
        member = self._require_member()
        intake, self._state_intake = self._state_intake, None
        head = intake.check(self.engine, header)
        if header.flags & _CHECK or intake.kept:  # (Flag.CHECK: a sharded worker asks every shard first)
            self._state_loaded(not intake.kept)
            return
        self.engine.load_optimizer_state(member, head, intake.arrays, self._state_loaded, self._fail)

    def _state_loaded(self, loaded: bool) -> None:
        self._reply(Op.LOAD_STATE_REPLY, version=self.engine.version, flags=0 if loaded else Flag.DROPPED)

    def _on_load_weights(self, header: Header, payload: memoryview, stream) -> None:
        member = self._require_member()
        intake, self._state_intake = self._state_intake, None
        intake.check(self.engine, header)
        if header.flags & _CHECK or intake.kept:  # (Flag.CHECK: a sharded worker asks every shard first)
            self._weights_loaded(not intake.kept)
            return
        self.engine.load_weights(member, bytes(intake.digest), intake.values, header.version, self._weights_loaded,
                                 self._fail)

    def _weights_loaded(self, loaded: bool) -> None:
        self._reply(Op.LOAD_WEIGHTS_REPLY, version=self.engine.version, flags=0 if loaded else Flag.DROPPED)

    def _on_stats(self, header: Header, payload: memoryview, stream) -> None:
        snapshot = self.engine.stats_snapshot()
        self._reply(Op.STATS_REPLY, version=self.engine.version, payload=json.dumps(snapshot).encode())
