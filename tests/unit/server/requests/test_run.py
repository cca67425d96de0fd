"""The requests about the run (aps.server.requests.run): STATS, CHECKPOINT, REWIND, SHARDS,
CLAIM, LOG and PACE.

Seams: ``admit`` (the limit of each small payload, read whole); ``handle``: the engine call and
the reply (op, request id, version, payload) and who may ask (members only, but STATS and
CHECKPOINT); a checkpoint's and a rewind's answers when their future ends (the result, a
ServerError as it is, another failure as an internal error, nothing for a connection gone);
REWIND's CHECK (the versions, not a rewind); malformed SHARDS, CLAIM and LOG payloads."""

import asyncio
import json
import struct

import numpy as np
import pytest

from aps.config import ServerConfig
from aps.errors import CheckpointFailed, InternalServerError, LayoutMismatch, MalformedFrame, NotInitialized
from aps.server.engine import Engine
from aps.server.requests import HANDLERS, Request
from aps.server.requests.run import MAX_SHARDS_BYTES
from aps.wire.protocol import MAX_COUNTER_NAME, Flag, Op, pack_header, unpack_header
from aps.wire.scalars import MAX_LOG_BYTES, encode_log

from .conftest import Error, FakeExchange, Reply, frame, join

N = 8


def admit(conn, data):
    header = unpack_header(data)
    request = Request(header, HANDLERS[header.op])
    return request.handler.admit(conn, request)


class Asked:
    """A server's request_checkpoint / request_rewind: the futures it handed out (the loop's,
    whose callbacks run on the loop), and what it was asked."""

    def __init__(self, loop):
        self.loop, self.asked, self.futures = loop, [], []

    def __call__(self, what):
        self.asked.append(what)
        future = self.loop.create_future()
        self.futures.append(future)
        return future

    def settle(self):
        self.loop.run_until_complete(asyncio.sleep(0))


@pytest.mark.parametrize("op, limit", [(Op.SHARDS, MAX_SHARDS_BYTES), (Op.CLAIM, MAX_COUNTER_NAME),
                                       (Op.LOG, MAX_LOG_BYTES), (Op.STATS, 0), (Op.CHECKPOINT, 0), (Op.REWIND, 0),
                                       (Op.PACE, 8)])
def test_each_payload_is_read_whole_within_its_limit(conn, op, limit):
    if limit:
        assert len(admit(conn, pack_header(op, 0, 0, 1, 0, 0, limit))) == limit
    with pytest.raises(MalformedFrame, match=f"got {limit + 1}"):
        admit(conn, pack_header(op, 0, 0, 1, 0, 0, limit + 1))


@pytest.mark.parametrize("op", [Op.REWIND, Op.SHARDS, Op.CLAIM, Op.LOG, Op.PACE])
def test_members_only(conn, op):
    conn.feed(frame(op, b"x" if op in (Op.CLAIM, Op.LOG, Op.SHARDS) else b"\0" * 8 if op == Op.PACE else b"", rid=12))
    assert isinstance(conn.last, Error) and isinstance(conn.last.exc, NotInitialized) and conn.last.rid == 12


# STATS ---------------------------------------------------------------------------------------------
def test_stats_answers_with_the_counters_as_json_to_anyone(conn, engine):
    conn.feed(frame(Op.STATS, rid=3))  # (a stranger too: aps status)
    reply = conn.last
    assert (reply.op, reply.rid, reply.version) == (Op.STATS_REPLY, 3, 0)
    stats = json.loads(reply.payload)
    assert set(stats) == set(engine.stats_snapshot()) and stats["server"]["sync"] == "asp"
    join(conn, N)
    conn.feed(frame(Op.PUSH, np.ones(N, np.float32).tobytes(), dtype=1))
    conn.feed(frame(Op.STATS, rid=4))
    assert conn.last.version == 1


# CHECKPOINT ----------------------------------------------------------------------------------------
def test_checkpoint_on_a_server_that_writes_none_is_refused(conn):
    conn.feed(frame(Op.CHECKPOINT, rid=5))
    assert isinstance(conn.last.exc, CheckpointFailed) and "--checkpoint-dir" in conn.last.exc.message


def test_checkpoint_is_answered_when_it_is_written(conn, engine):
    engine.request_checkpoint = asked = Asked(conn.loop)
    conn.feed(frame(Op.CHECKPOINT, rid=5))
    assert asked.asked == ["request"] and not conn.sent  # (written off the loop: answered when done)
    asked.futures[0].set_result({"version": 3, "path": "/tmp/ckpt"})
    asked.settle()
    assert conn.last == Reply(Op.CHECKPOINT_REPLY, 5, version=3,
                              payload=json.dumps({"version": 3, "path": "/tmp/ckpt"}).encode())


def test_a_checkpoint_that_failed_is_the_replys_error(conn, engine):
    engine.request_checkpoint = asked = Asked(conn.loop)
    conn.feed(frame(Op.CHECKPOINT, rid=5))
    asked.futures[0].set_exception(CheckpointFailed("the disk is full"))
    asked.settle()
    assert conn.last.exc.message == "the disk is full" and conn.last.rid == 5
    conn.feed(frame(Op.CHECKPOINT, rid=6))
    asked.futures[1].set_exception(OSError("EIO"))
    asked.settle()
    assert isinstance(conn.last.exc, InternalServerError) and conn.last.exc.message == "the checkpoint failed: EIO"


def test_a_checkpoint_written_after_its_connection_went_is_not_answered(conn, engine):
    engine.request_checkpoint = asked = Asked(conn.loop)
    conn.feed(frame(Op.CHECKPOINT, rid=5))
    conn.gone = True
    asked.futures[0].set_result({"version": 1})
    asked.settle()
    assert not conn.sent and not conn.dones


# REWIND ---------------------------------------------------------------------------------------------
def test_rewind_on_a_server_that_cannot_is_refused(conn):
    join(conn, N)
    conn.feed(frame(Op.REWIND, rid=7, version=2))
    assert isinstance(conn.last.exc, CheckpointFailed) and "cannot rewind" in conn.last.exc.message


def test_rewind_asks_for_the_version_its_header_names_and_check_for_the_versions(conn, engine):
    join(conn, N)
    engine.request_rewind = asked = Asked(conn.loop)
    conn.feed(frame(Op.REWIND, rid=7, version=2))
    conn.feed(frame(Op.REWIND, flags=Flag.CHECK, rid=8, version=2))
    assert asked.asked == [2, None]
    asked.futures[1].set_result({"versions": [1, 2], "version": 2})
    asked.settle()
    asked.futures[0].set_exception(RuntimeError("no such checkpoint"))
    asked.settle()
    assert conn.sent[0] == Reply(Op.REWIND_REPLY, 8, version=2,
                                 payload=json.dumps({"versions": [1, 2], "version": 2}).encode())
    assert conn.sent[1].rid == 7 and conn.sent[1].exc.message == "the rewind failed: no such checkpoint"


# SHARDS --------------------------------------------------------------------------------------------
@pytest.fixture
def sharded(loop):
    conn = FakeExchange(Engine(ServerConfig(workers=1, sync="asp", shard=0, shards=2)), loop)
    join(conn, N)
    return conn


def test_shards_records_the_shards_runs_once(sharded):
    runs = [sharded.engine.durability.run_id, "other-shard"]
    sharded.feed(frame(Op.SHARDS, json.dumps(runs).encode(), rid=9))
    assert sharded.last == Reply(Op.SHARDS_REPLY, 9)
    sharded.feed(frame(Op.SHARDS, json.dumps([sharded.engine.durability.run_id, "a third"]).encode(), rid=10))
    assert isinstance(sharded.last.exc, LayoutMismatch) and sharded.last.rid == 10


@pytest.mark.parametrize("payload", [b"not json", b"\xff\xfe", b"[[[" * 2000])
def test_shards_that_are_not_json_are_malformed(sharded, payload):
    sharded.feed(frame(Op.SHARDS, payload, rid=9))
    assert isinstance(sharded.last.exc, MalformedFrame) and "a JSON list" in sharded.last.exc.message


def test_shards_on_a_server_of_one_shard_is_refused(conn):
    join(conn, N)
    conn.feed(frame(Op.SHARDS, b'["a"]', rid=9))
    assert isinstance(conn.last.exc, MalformedFrame) and "--shards > 1" in conn.last.exc.message


# CLAIM ------------------------------------------------------------------------------------------------
def test_claim_takes_the_next_values_of_a_named_counter(conn):
    join(conn, N)
    conn.feed(frame(Op.CLAIM, b"epoch/3", version=5, rid=11))
    assert conn.last == Reply(Op.CLAIM_REPLY, 11, version=0)
    conn.feed(frame(Op.CLAIM, b"epoch/3", version=2, rid=12))
    assert conn.last == Reply(Op.CLAIM_REPLY, 12, version=5)
    conn.feed(frame(Op.CLAIM, b"other", version=1, rid=13))
    assert conn.last.version == 0


def test_a_counters_name_is_utf8(conn):
    join(conn, N)
    conn.feed(frame(Op.CLAIM, b"\xff", version=1, rid=11))
    assert isinstance(conn.last.exc, MalformedFrame) and "UTF-8" in conn.last.exc.message


# LOG ----------------------------------------------------------------------------------------------------
def test_log_records_the_workers_scalars(conn, engine):
    join(conn, N)
    before = engine.scalars.seq
    conn.feed(frame(Op.LOG, encode_log([(1, {"loss": 0.5}), (2, {"loss": 0.25})]), rid=14))
    assert conn.last == Reply(Op.LOG_REPLY, 14)
    assert engine.scalars.seq > before and "loss" in json.dumps(engine.scalars.curves())


@pytest.mark.parametrize("payload", [b"{", b'{"points": [[1, {"bad name!": 1}]]}', b'{"extra": 1}'])
def test_a_malformed_log_is_refused_and_records_nothing(conn, engine, payload):
    join(conn, N)
    before = engine.scalars.seq
    conn.feed(frame(Op.LOG, payload, rid=15))
    assert isinstance(conn.last.exc, MalformedFrame) and conn.last.rid == 15 and engine.scalars.seq == before


# PACE ---------------------------------------------------------------------------------------------------
def _seconds(value):
    return struct.pack("<d", value)


def test_pace_answers_with_its_rate_and_the_fastest_live_workers(conn, engine):
    join(conn, N)
    conn.feed(frame(Op.PACE, _seconds(10.0), version=100, rid=16))
    assert conn.last == Reply(Op.PACE_REPLY, 16, payload=b'{"rate": null, "fastest": null}')  # (one report)
    conn.feed(frame(Op.PACE, _seconds(12.0), version=140, rid=17))
    assert json.loads(conn.last.payload) == {"rate": 20.0, "fastest": 20.0}  # 40 steps in 2 s
    conn.feed(frame(Op.PACE, _seconds(13.0), version=170, rid=18))
    assert json.loads(conn.last.payload) == {"rate": 25.0, "fastest": 25.0}  # half the newest (30/s), half the older


@pytest.mark.parametrize("payload, version, message", [
    (b"", 1, "8 bytes"), (b"\0" * 7, 1, "8 bytes"), (struct.pack("<d", 1.0), (1 << 53) + 1, "2\\*\\*53"),
    (struct.pack("<d", float("nan")), 1, "2\\*\\*53"), (struct.pack("<d", -1.0), 1, "2\\*\\*53"),
    (struct.pack("<d", float("inf")), 1, "2\\*\\*53"),
])
def test_a_pace_out_of_range_is_refused_and_kept_nowhere(conn, engine, payload, version, message):
    join(conn, N)
    conn.feed(frame(Op.PACE, payload, version=version, rid=19))
    assert isinstance(conn.last.exc, MalformedFrame) and conn.last.rid == 19
    assert engine.paces.rates([0]) == {} and not engine.paces._paces
