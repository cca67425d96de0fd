"""Rows of embedding tables pulled and pushed by id through real servers: exactly the table's
own update (bit for bit against :class:`aps.server.engine.rows.RowTable` run here), into the
caller's arrays, alone or in the same request as the dense part; bad ids, rows and frames
refused with a clear error and nothing changed; BSP rounds of rows summed by id and applied
once; three shards equal to one. Over TCP and shared memory, blocking and asyncio."""

from __future__ import annotations

import fcntl
import gc
import os
import threading

import numpy as np
import pytest

import aps
from aps.errors import ErrorCode, InvalidIds, NonFiniteGradient
from aps.server.engine.rows import RowTable
from aps.tables import Table
from aps.testing import RawClient
from aps.wire.protocol import DType, Flag, Op, pack_header
from aps.wire.rows import RowSection, encode_rows, encode_rows_ref
from aps.wire.segments import SEALS, Segment

DENSE = {"w": np.zeros(4, np.float32)}
TABLES = {
    "items": Table(rows=10**9, dim=8, init="normal:0.1", optimizer="adagrad", lr=0.05),
    "tags": Table(rows=1000, dim=3, init="uniform:0.5", optimizer="sgd", lr=0.5),
    "users": Table(rows=10**6, dim=5, init="normal:0.01", optimizer="adam", lr=0.01),
    "groups": Table(rows=50, dim=4, init="zeros", optimizer="rowwise_adagrad", lr=0.1),
}


class Local:
    """The tables as the server runs them, here: what every pull must equal, bit for bit."""

    def __init__(self, tables=TABLES):
        self.tables = {name: RowTable(name, table) for name, table in tables.items()}

    def push(self, rows):
        staged = [(self.tables[name], self.tables[name].prepare(np.asarray(ids, np.int64),
                                                                np.asarray(grads, np.float32)))
                  for name, (ids, grads) in rows.items()]
        for table, part in staged:
            table.commit(part)

    def pull(self, name, ids):
        return self.tables[name].pull(np.asarray(ids, np.int64))


def batch(rng, name, n=32, *, high=None):
    table = TABLES[name]
    ids = rng.integers(0, high or min(table.rows, 50), n)  # (duplicates within a batch)
    return ids, rng.standard_normal((n, table.dim)).astype(np.float32)


def test_rows_equal_the_tables_own_update_bit_for_bit(server_process, client):
    server = server_process("--workers", "1", "--sync", "asp", "--lr", "0.5")
    rng, local = np.random.default_rng(0), Local()
    with client(server.address, 0, 1) as worker:
        worker.init(DENSE, tables=TABLES)
        for name in TABLES:  # rows never touched start from their seeded initial values
            ids = rng.integers(0, 50, 16)
            assert np.array_equal(worker.pull_rows(name, ids), local.pull(name, ids))
        for step in range(12):
            names = [n for n in TABLES if rng.random() < 0.7] or ["items"]
            rows = {name: batch(rng, name) for name in names}
            clock = worker.clock
            if step % 3 == 0:
                worker.push_rows(rows)
            elif step % 3 == 1:
                worker.push(np.ones(4, np.float32), rows=rows)
            else:
                wanted = {name: rng.integers(0, 50, 20) for name in TABLES}
                weights, pulled = worker.push_pull(np.ones(4, np.float32), rows=rows, pull_rows=wanted)
                local.push(rows)
                for name, ids in wanted.items():  # read after the push, in the same round trip
                    assert np.array_equal(pulled[name], local.pull(name, ids)), (step, name)
                assert weights["w"].tolist() == [-0.5 * (step // 3 * 2 + 2)] * 4
                assert worker.clock == clock + 1
                continue
            local.push(rows)
            assert worker.clock == clock + 1  # a push of rows is an iteration
        ids = {name: rng.integers(0, 50, 64) for name in TABLES}
        pulled = worker.pull_rows(ids)
        for name in TABLES:
            assert np.array_equal(pulled[name], local.pull(name, ids[name]))
        _, both = worker.pull(rows={"tags": [3, 3, 1]})  # with the dense weights, in one request
        assert np.array_equal(both["tags"], local.pull("tags", [3, 3, 1]))


def test_pulled_rows_land_in_the_callers_array(server_process, client):
    server = server_process("--workers", "1", "--sync", "asp")
    with client(server.address, 0, 1) as worker:
        worker.init(DENSE, tables=TABLES)
        out = np.full((3, 8), 7.0, np.float32)
        assert worker.pull_rows("items", [1, 2, 1], out=out) is out
        assert np.array_equal(out, Local().pull("items", [1, 2, 1]))
        several = {"items": np.empty((2, 8), np.float32), "tags": np.empty((1, 3), np.float32)}
        pulled = worker.pull_rows({"items": [4, 5], "tags": [9]}, out=several)
        assert pulled["items"] is several["items"] and pulled["tags"] is several["tags"]
        assert worker.pull_rows("items", []).shape == (0, 8)


@pytest.mark.parametrize(("call", "error", "message"), [
    (lambda w: w.pull_rows("nope", [1]), InvalidIds, "unknown table 'nope'"),
    (lambda w: w.pull_rows("tags", [-1]), InvalidIds, "id -1 is negative"),
    (lambda w: w.pull_rows("tags", [1000]), InvalidIds, "id 1000 is not below its 1000 rows"),
    (lambda w: w.pull_rows("tags", [1.0]), InvalidIds, "ids must be integers"),
    (lambda w: w.pull_rows("tags", [[1]]), InvalidIds, "one-dimensional"),
    (lambda w: w.pull_rows("tags", np.array([2**63], np.uint64)), InvalidIds, "beyond int64"),
    (lambda w: w.pull_rows("tags", [1], out=np.empty((1, 4), np.float32)), InvalidIds, "out must be"),
    (lambda w: w.push_rows("tags", [1], np.ones((1, 4), np.float32)), InvalidIds, r"shape \(1, 3\)"),
    (lambda w: w.push_rows("tags", [1, 2], np.ones(3, np.float32)), InvalidIds, r"shape \(2, 3\)"),
    (lambda w: w.push_rows("tags", [1], np.full((1, 3), np.nan, np.float32)), NonFiniteGradient, "NaN"),
    (lambda w: w.push_rows({"tags": ([1], np.ones((1, 3), np.float32)),
                            "items": ([2], np.full((1, 8), np.inf, np.float32))}), NonFiniteGradient, "NaN"),
    (lambda w: w.push(np.ones(4, np.float32), rows={"tags": ([5], np.full((1, 3), np.inf, np.float32))}),
     NonFiniteGradient, "NaN or infinity"),
])
def test_bad_rows_are_refused_and_change_nothing(server_process, client, call, error, message):
    server = server_process("--workers", "1", "--sync", "asp", "--lr", "1")
    with client(server.address, 0, 1) as worker:
        worker.init(DENSE, tables=TABLES)
        ids = {"tags": [1, 2, 5], "items": [2]}
        before, clock = worker.pull_rows(ids), worker.clock
        with pytest.raises(error, match=message):
            call(worker)
        after = worker.pull_rows(ids)
        assert all(np.array_equal(before[name], after[name]) for name in ids)
        assert worker.clock == clock
        assert worker.pull()["w"].tolist() == [0.0] * 4  # the dense part of a refused push is not applied
        worker.push_rows("tags", [1], np.ones((1, 3), np.float32))  # and it goes on
        assert not np.array_equal(worker.pull_rows("tags", [1]), before["tags"][:1])


def test_a_model_without_tables_has_no_rows(server_process, client):
    server = server_process("--workers", "1", "--sync", "asp")
    with client(server.address, 0, 1) as worker:
        worker.init(DENSE)
        with pytest.raises(InvalidIds, match="unknown table 'items' .the model's tables: none"):
            worker.pull_rows("items", [1])


def test_a_million_ids_in_one_frame(server_process, transport):
    server = server_process("--workers", "1", "--sync", "asp")
    table = Table(rows=10**10, dim=2, optimizer="sgd", lr=1.0, init="zeros")
    with aps.Worker(server.address, 0, 1, transport=transport) as worker:
        worker.init(DENSE, tables={"big": table})
        ids = np.arange(10**6, dtype=np.int64) * 9973  # spread over the key space
        worker.push_rows("big", ids, np.ones((10**6, 2), np.float32))
        rows = worker.pull_rows("big", ids)
        assert rows.shape == (10**6, 2) and np.all(rows == -1.0)


def test_bsp_applies_a_rounds_rows_once(server_process, client):
    server = server_process("--workers", "2", "--sync", "bsp", "--lr", "1")
    tables = {"tags": TABLES["tags"], "users": TABLES["users"]}
    rng, local = np.random.default_rng(3), Local(tables)
    workers = [client(server.address, rank, 2) for rank in range(2)]
    threads = [threading.Thread(target=w.init, args=(DENSE,), kwargs={"tables": tables}) for w in workers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    try:
        for step in range(4):
            rows = [{name: batch(rng, name, 8, high=12) for name in tables} for _ in workers]
            dense = step % 2 == 0  # a round with the dense gradient, then a round of rows alone
            results = [None, None]

            def run(rank):
                w = workers[rank]
                if dense:
                    results[rank] = w.push_pull(np.full(4, rank + 1.0, np.float32), rows=rows[rank],
                                                pull_rows={"tags": np.arange(12)})
                else:
                    w.push_rows(rows[rank])
                    results[rank] = (None, w.pull_rows({"tags": np.arange(12)}))

            threads = [threading.Thread(target=run, args=(rank,)) for rank in range(2)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(30)
            # One update: each id's gradients over the round (in rank order), times the round's 1/n.
            for table in local.tables.values():
                name = table.name
                ids = np.concatenate([np.asarray(r[name][0], np.int64) for r in rows])
                grads = np.concatenate([r[name][1] for r in rows]) * np.float32(0.5)
                table.commit(table.prepare(ids, grads))
            for rank in range(2):
                assert np.array_equal(results[rank][1]["tags"], local.pull("tags", np.arange(12))), (step, rank)
            if dense:
                assert results[0][0]["w"].tolist() == [-1.5 * (step // 2 + 1)] * 4
        pulled = workers[0].pull_rows("users", np.arange(12))
        assert np.array_equal(pulled, local.pull("users", np.arange(12)))
        assert workers[0].pull()["w"].tolist() == [-3.0] * 4  # rounds of rows alone left the dense part
    finally:
        for w in workers:
            w.close()


def test_three_shards_equal_one_under_bsp(server_process, client):
    tables = {"items": TABLES["items"], "tags": TABLES["tags"]}

    def train(addresses):
        rng = np.random.default_rng(5)
        with client(addresses, 0, 1) as worker:
            worker.init({"w": np.zeros(64, np.float32)}, tables=tables)
            for _ in range(6):
                rows = {name: batch(rng, name, 40) for name in tables}
                _, pulled = worker.push_pull(np.ones(64, np.float32), rows=rows,
                                             pull_rows={"items": rng.integers(0, 50, 50)})
            return worker.pull()["w"].copy(), worker.pull_rows({name: np.arange(50) for name in tables}), pulled

    one = train(server_process("--workers", "1", "--sync", "bsp").address)
    shards = [server_process("--workers", "1", "--sync", "bsp", "--shard", str(i), "--shards", "3")
              for i in range(3)]
    three = train([s.address for s in shards])
    assert np.array_equal(one[0], three[0])
    for name in tables:
        assert np.array_equal(one[1][name], three[1][name])
    assert np.array_equal(one[2]["items"], three[2]["items"])


# Frames no worker would send ------------------------------------------------------
def raw_pair(server_process, transport):
    server = server_process("--workers", "1", "--sync", "asp")
    raw = RawClient.to(server, transport)
    raw.init(0, 1, DENSE, {"tags": TABLES["tags"]})
    assert raw.reply()[0].op == Op.INIT_REPLY
    return server, raw


def rows_frame(op, sections, with_values, dtype=DType.NONE, extra=b""):
    parts = b"".join(bytes(p) for p in encode_rows(sections, [3], with_values)) + extra
    return pack_header(op, int(Flag.ROWS), dtype, 7, 0, 0, len(parts)), parts


@pytest.mark.parametrize(("frame", "code", "message"), [
    (rows_frame(Op.PULL, [RowSection(0, np.array([-5]), None)], False), ErrorCode.INVALID_IDS, "id -5 is negative"),
    (rows_frame(Op.PUSH, [RowSection(0, np.array([5]), np.full((1, 3), np.nan, np.float32))], True),
     ErrorCode.NON_FINITE_GRADIENT, "NaN"),
    (rows_frame(Op.PULL, [RowSection(0, np.array([5]), None)], False, extra=b"\0" * 8),
     ErrorCode.MALFORMED_FRAME, "take 24 bytes; it carries 32"),
    ((pack_header(Op.PULL, int(Flag.ROWS), 0, 7, 0, 0, 8), (1).to_bytes(4, "little") + bytes(4)),
     ErrorCode.MALFORMED_FRAME, "truncated"),
])
def test_malformed_rows_are_refused_and_the_connection_goes_on(server_process, transport, frame, code, message):
    """(Over shared memory, the rows lie in the worker's rows segment: the same checks.)"""
    server, raw = raw_pair(server_process, transport)
    try:
        raw.send_rows(*frame)
        got, text = raw.error()
        assert got == code and message in text, text
        assert_served(raw, server)
    finally:
        raw.close()


@pytest.mark.parametrize(("frame", "message"), [
    ((pack_header(Op.PULL, int(Flag.ROWS), 0, 7, 0, 0, 4), bytes(4)), "its rows need 8 at least"),
    ((pack_header(Op.PING, int(Flag.ROWS), 0, 7, 0, 0, 8), bytes(8)), "PING carries no rows"),
])
def test_malformed_rows_frames_are_refused_and_the_connection_goes_on(server_process, transport, frame, message):
    server, raw = raw_pair(server_process, transport)
    try:
        raw.send(*frame)
        got, text = raw.error()
        assert got == ErrorCode.MALFORMED_FRAME and message in text, text
        assert_served(raw, server)
    finally:
        raw.close()


def assert_served(raw, server, local=None) -> None:
    """The same connection is served: a pull of rows gets their values (those of ``local``)."""
    header, payload = rows_frame(Op.PULL, [RowSection(0, np.array([5, 5]), None)], False)
    raw.send_rows(header, payload)
    reply, rows = raw.reply()
    assert reply.op == Op.PULL_REPLY and reply.flags & Flag.ROWS and reply.dtype == DType.NONE, reply
    values = np.frombuffer(raw.rows_of(reply, rows), np.float32)[:6].reshape(2, 3)
    assert np.array_equal(values, (local or Local({"tags": TABLES["tags"]})).pull("tags", [5, 5]))
    assert server.alive()


def test_a_half_sent_rows_frame_changes_nothing(server_process, transport):
    server, raw = raw_pair(server_process, transport)
    header, payload = rows_frame(Op.PUSH, [RowSection(0, np.arange(100), np.ones((100, 3), np.float32))], True)
    raw.send(header, payload[: len(payload) // 2])
    raw.close()
    raw = RawClient.to(server, transport)
    raw.init(0, 1, DENSE, {"tags": TABLES["tags"]}, flags=int(Flag.REJOIN))
    assert raw.reply()[0].op == Op.INIT_REPLY
    header, payload = rows_frame(Op.PULL, [RowSection(0, np.arange(100), None)], False)
    raw.send_rows(header, payload)
    reply, rows = raw.reply()
    assert np.array_equal(np.frombuffer(raw.rows_of(reply, rows), np.float32).reshape(100, 3),
                          Local({"tags": TABLES["tags"]}).pull("tags", np.arange(100)))
    raw.close()
    assert server.alive()


# Shared memory: rows references that lie ---------------------------------------------
def _sealed(nbytes: int, seal: bool = True) -> int:
    fd = os.memfd_create("test-lie", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, nbytes)
    if seal:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
    return fd


@pytest.mark.parametrize(("lie", "code", "message"), [
    ("length beyond the segment", ErrorCode.MALFORMED_FRAME, "bytes of rows in a segment of"),
    ("no segment yet", ErrorCode.MALFORMED_FRAME, "in a segment of none"),
    ("descriptor announced, not sent", ErrorCode.MALFORMED_FRAME, "descriptor did not come"),
    ("unsealed segment", ErrorCode.MALFORMED_FRAME, "not sealed"),
    ("segment smaller than it says", ErrorCode.PAYLOAD_SIZE_MISMATCH, "65536 needed"),
    ("rows over the frame limit", ErrorCode.FRAME_TOO_LARGE, "--max-frame-bytes"),
    ("segment size not a multiple of 8", ErrorCode.MALFORMED_FRAME, "a multiple of 8"),
    ("reference of the wrong size", ErrorCode.MALFORMED_FRAME, "24-byte rows reference"),
    ("unknown reference flags", ErrorCode.MALFORMED_FRAME, "unknown flags"),
])
def test_lying_rows_references_are_refused_and_the_connection_goes_on(server_process, lie, code, message):
    """A shared-memory worker's rows reference (aps.wire.rows) that names bytes it does not
    have, a segment it does not send, or one that is not what it says: refused, nothing
    changed, the connection served on; the server holds no descriptor it was sent."""
    server = server_process("--workers", "1", "--sync", "asp", "--max-frame-bytes", "1M")
    raw = RawClient.to(server, "shm")
    try:
        raw.init(0, 1, DENSE, {"tags": TABLES["tags"]})
        assert raw.reply()[0].op == Op.INIT_REPLY
        header, payload = rows_frame(Op.PUSH, [RowSection(0, np.array([5]), np.ones((1, 3), np.float32))], True)
        n = len(payload)
        fd = None
        if lie == "length beyond the segment":
            raw.send_rows(header, payload)  # (a good one first: the segment is mapped)
            assert raw.reply()[0].op == Op.PUSH_REPLY
            raw.send_rows(header, payload, ref=encode_rows_ref(1 << 17, 1 << 17, False), fds=[])
        elif lie == "no segment yet":
            raw.send_rows(header, payload, ref=encode_rows_ref(n, 1 << 16, False), fds=[])
        elif lie == "descriptor announced, not sent":
            raw.send_rows(header, payload, ref=encode_rows_ref(n, 1 << 16, True), fds=[])
        elif lie == "unsealed segment":
            fd = _sealed(1 << 16, seal=False)
            raw.send_rows(header, payload, ref=encode_rows_ref(n, 1 << 16, True), fds=[fd])
        elif lie == "segment smaller than it says":
            fd = _sealed(1 << 12)
            raw.send_rows(header, payload, ref=encode_rows_ref(n, 1 << 16, True), fds=[fd])
        elif lie == "rows over the frame limit":
            fd = _sealed(2 << 20)
            raw.send_rows(header, payload, ref=encode_rows_ref(2 << 20, 2 << 20, True), fds=[fd])
        elif lie == "segment size not a multiple of 8":
            fd = _sealed((1 << 16) + 4)
            raw.send_rows(header, payload, ref=encode_rows_ref(n, (1 << 16) + 4, True), fds=[fd])
        elif lie == "reference of the wrong size":
            raw.send(pack_header(Op.PUSH, int(Flag.ROWS), DType.NONE, 7, 0, 0, 16), bytes(16))
        else:
            raw.send_rows(header, payload, ref=encode_rows_ref(n, 1 << 16, False)[:16] + bytes([2, 0, 0, 0]) + bytes(4),
                          fds=[])
        got, text = raw.error()
        assert got == code and message in text, text
        if fd is not None:
            os.close(fd)
        raw.rows_segment = None  # (the next request sends its segment afresh)
        expected = Local({"tags": TABLES["tags"]})
        if lie == "length beyond the segment":
            expected.push({"tags": ([5], np.ones((1, 3), np.float32))})
        assert_served(raw, server, expected)
    finally:
        raw.close()


def test_a_model_without_tables_refuses_rows_on_the_wire(server_process, transport):
    server = server_process("--workers", "1", "--sync", "asp")
    raw = RawClient.to(server, transport)
    try:
        raw.init(0, 1, DENSE)
        assert raw.reply()[0].op == Op.INIT_REPLY
        raw.send(*rows_frame(Op.PULL, [], False))
        code, text = raw.error()
        assert code == ErrorCode.INVALID_IDS and "declares no tables" in text
    finally:
        raw.close()


def test_table_memory_evicts_the_least_recently_used_rows_or_refuses(server_process, client):
    server = server_process("--workers", "1", "--sync", "asp", "--table-memory", "256K")
    tables = {"cache": Table(rows=10**9, dim=16, init="normal:0.1", optimizer="sgd", lr=1.0, evict=True),
              "fixed": Table(rows=10**9, dim=16, init="zeros", optimizer="sgd", lr=1.0)}
    local = Local(tables)
    with client(server.address, 0, 1) as worker:
        worker.init(DENSE, tables=tables)
        hot = np.arange(8)
        worker.push_rows("cache", [10**6], np.ones((1, 16), np.float32))  # a cold row with an update
        for step in range(40):  # 40 x 500 rows of 64 bytes: five times the limit, through the cache
            worker.push_rows("cache", hot, np.ones((8, 16), np.float32))
            local.push({"cache": (hot, np.ones((8, 16), np.float32))})
            worker.push_rows("cache", 10**6 + step * 500 + np.arange(500), np.zeros((500, 16), np.float32))
        assert np.array_equal(worker.pull_rows("cache", hot), local.pull("cache", hot))  # the hot rows stayed
        # the cold row was evicted: touched again, it starts from its initial values, its update gone
        assert np.array_equal(worker.pull_rows("cache", [10**6]), Local(tables).pull("cache", [10**6]))
        assert not worker.pull_rows("fixed", np.arange(5000)).any()  # a pull makes no row: past the limit too
        with pytest.raises(aps.errors.TableMemoryFull, match="--table-memory"):
            worker.push_rows("fixed", np.arange(5000), np.ones((5000, 16), np.float32))  # more than all the limit
        assert not worker.pull_rows("fixed", np.arange(5000)).any()  # nothing changed
        worker.push_rows("fixed", [1], np.ones((1, 16), np.float32))  # and it goes on
        assert worker.pull_rows("fixed", [1]).tolist() == [[-1.0] * 16]


def test_the_servers_memory_follows_the_rows_touched(server_process, transport):
    """A table of 10^10 declared rows, 10^6 of them pushed through the wire: the server's RSS
    grows by at most 1.5x the bytes of those rows and their state."""
    import psutil

    server = server_process("--workers", "1", "--sync", "asp")
    table = Table(rows=10**10, dim=32, optimizer="adagrad", lr=0.1)
    process = psutil.Process(server.proc.pid)
    with aps.Worker(server.address, 0, 1, transport=transport) as worker:
        worker.init(DENSE, tables={"big": table})
        worker.push_rows("big", [1], np.ones((1, 32), np.float32))
        before = process.memory_info().rss
        ids = np.random.default_rng(0).choice(10**10, 10**6, replace=False)
        grads = np.full((10**5, 32), 0.5, np.float32)
        for chunk in np.split(ids, 10):
            worker.push_rows("big", chunk, grads)
        grown = process.memory_info().rss - before
        assert len(worker.pull_rows("big", ids)) == 10**6
    touched = 10**6 * table.row_bytes()
    assert grown <= 1.5 * touched, (grown / touched, grown, touched)


def test_a_failure_reading_rows_is_answered_and_the_server_goes_on(monkeypatch, client):
    """Reading the rows asked for fails (out of memory, say): the worker gets an error, not a
    wait without end, and the next request is served."""
    from aps.errors import InternalServerError
    from aps.server.engine.rows import Tables

    real, failures = Tables.pull, []

    def pull(self, pulled, room=None):
        if failures:
            failures.pop()
            raise MemoryError("no room for the rows")
        return real(self, pulled, room)

    monkeypatch.setattr(Tables, "pull", pull)
    with aps.Server(workers=1, sync="asp", port=0, log_level="error").run_in_background() as server:
        with client(server.address, 0, 1) as worker:
            worker.init(DENSE, tables=TABLES)
            failures.append(True)
            with pytest.raises(InternalServerError, match="reading the rows failed: MemoryError"):
                worker.pull_rows("tags", [1, 2])
            assert np.array_equal(worker.pull_rows("tags", [1, 2]), Local().pull("tags", [1, 2]))


def test_rows_gathered_elsewhere_still_reach_a_shared_memory_worker(monkeypatch):
    """Over shared memory the engine gathers a reply's rows straight into the reply
    segment; rows it read into arrays of their own instead are copied there, the same
    values (and a reply segment made larger for a larger pull is mapped anew)."""
    from aps.server.engine.rows import Tables

    real = Tables.pull
    monkeypatch.setattr(Tables, "pull", lambda self, pulled, room=None: real(self, pulled))
    local = Local()
    with aps.Server(workers=1, sync="asp", port=0, log_level="error").run_in_background() as server:
        with aps.Worker(server.address, 0, 1, transport="shm") as worker:
            worker.init(DENSE, tables=TABLES)
            for n in (3, 30_000, 5):  # (the last two take a new segment, then the same)
                ids = np.arange(n) % TABLES["tags"].rows
                assert np.array_equal(worker.pull_rows("tags", ids), local.pull("tags", ids))


def test_a_rows_segment_larger_than_the_frame_limit_serves_rows_within_it(server_process):
    """A worker's rows segment is twice its largest request: larger than --max-frame-bytes
    once a request passed half of it. The server maps the limit's worth and serves rows
    within it; descriptors left by refused requests are closed, not mistaken for the next."""
    server = server_process("--workers", "1", "--sync", "asp", "--max-frame-bytes", "1M")
    raw = RawClient.to(server, "shm")
    try:
        raw.send_rows(*rows_frame(Op.PULL, [RowSection(0, np.array([5]), None)], False))  # before INIT: refused
        assert raw.error()[0] == ErrorCode.NOT_INITIALIZED
        raw.rows_segment = None
        raw.init(0, 1, DENSE, {"tags": TABLES["tags"]})  # (its segment's descriptor, not the one left over)
        assert raw.reply()[0].op == Op.INIT_REPLY
        header, payload = rows_frame(Op.PUSH, [RowSection(0, np.array([5]), np.ones((1, 3), np.float32))], True)
        raw.rows_segment = Segment.create((2 << 20) // 4, "test-large")
        raw.send_rows(header, payload, ref=encode_rows_ref(len(payload), 2 << 20, True), fds=[raw.rows_segment.fd])
        assert raw.reply()[0].op == Op.PUSH_REPLY
        local = Local({"tags": TABLES["tags"]})
        local.push({"tags": ([5], np.ones((1, 3), np.float32))})
        assert_served(raw, server, local)
    finally:
        raw.close()


def test_a_closed_shared_memory_worker_holds_no_descriptor(server_process):
    """A worker's own segments (its gradient's, its rows') are closed with it; the server's
    (slots, reply segment) it was sent are not kept open either, once its arrays are gone."""
    def segments() -> set[tuple[str, str]]:
        """The shared segments this process holds open (other tests' run here too: compared as sets)."""
        held = set()
        for fd in os.listdir("/proc/self/fd"):
            try:
                target = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                continue
            if target.startswith("/memfd:"):
                held.add((fd, target))
        return held

    server = server_process("--workers", "1", "--sync", "asp")
    gc.collect()
    before = segments()
    worker = aps.Worker(server.address, 0, 1, transport="shm")
    worker.init(DENSE, tables=TABLES)
    worker.push_rows("tags", [1, 2], np.ones((2, 3), np.float32))
    assert np.array_equal(worker.pull_rows("tags", [1])[0], worker.pull_rows("tags", [1, 1])[1])
    assert len(segments() - before) >= 2  # (its gradient's and its rows' at least, while it is open)
    worker.close()
    del worker  # (a mapping keeps a descriptor of its own while the arrays on it live: Python's mmap)
    gc.collect()
    assert not segments() - before
