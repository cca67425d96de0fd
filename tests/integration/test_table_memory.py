"""The memory of embedding tables on a real server: a pull makes no row (the server's RSS stays
flat however many fresh ids are read, and what is read is what the first push starts from), a
push past the limit is refused and changes nothing, the default limit is finite (half the
memory available at start), said at start and shown on /metrics and /api/stats, and a push
sent again after a lost reply is still answered without being applied twice."""

from __future__ import annotations

import asyncio
import re
import time

import numpy as np
import psutil
import pytest

import aps
from aps.cli.status import fetch_stats
from aps.errors import TableMemoryFull
from aps.server import http as _http
from aps.server.engine.rows import RowTable
from aps.tables import Table
from aps.testing import RawClient
from aps.wire.protocol import Flag, Op
from aps.wire.rows import RowSection

from tests.integration.test_http import get, http_address, samples
from tests.integration.test_rows import rows_frame

DENSE = {"w": np.zeros(4, np.float32)}
MIB = 1 << 20


def test_pulling_fresh_ids_keeps_the_servers_memory_flat(server_process, transport):
    """20 pulls of 500 fresh ids of a 4,096-wide Adagrad table (rows and state that would take
    320 MiB if kept): the server's RSS grows by less than a tenth of that, it holds no row,
    and every row read is its initial value."""
    server = server_process("--workers", "1", "--sync", "asp")
    table = Table(rows=10**12, dim=4096, init="normal:0.1", optimizer="adagrad", lr=0.1)
    process = psutil.Process(server.proc.pid)
    ids = np.random.default_rng(0).choice(10**12, 21 * 500, replace=False)
    with aps.Worker(server.address, 0, 1, transport=transport) as worker:
        worker.init(DENSE, tables={"wide": table})
        out = np.empty((500, 4096), np.float32)
        worker.pull_rows("wide", ids[:500], out=out)  # (the reply's buffers made once)
        before = process.memory_info().rss
        for chunk in np.split(ids[500:], 20):
            worker.pull_rows("wide", chunk, out=out)
        grown = process.memory_info().rss - before
        assert np.array_equal(out, table.initial_rows("wide", ids[-500:]))
        stats = fetch_stats(server.address)["server"]
    would_hold = 10_000 * table.row_bytes()
    print(f"server RSS {before / MIB:.0f} -> {(before + grown) / MIB:.0f} MiB after pulling rows of "
          f"{would_hold / MIB:.0f} MiB")
    assert grown < would_hold / 10, (grown, would_hold)
    assert stats["tables"]["wide"]["rows"] == 0 and stats["tables"]["wide"]["rows_pulled"] == 10_500
    assert stats["table_memory"]["bytes"] == 0


def test_values_pulled_before_the_first_push_are_the_rows_it_makes(server_process, client):
    """Each initializer and row-wise optimizer: rows read before any push equal the rows after
    a push of zeros made them, and a push of a gradient starts from them, bit for bit against
    the table run here without any pull."""
    server = server_process("--workers", "1", "--sync", "asp")
    tables = {f"{init.split(':')[0]}_{optimizer}": Table(rows=10**9, dim=5, init=init, optimizer=optimizer,
                                                         lr=0.1)
              for init, optimizer in [("zeros", "sgd"), ("normal:0.5", "adagrad"),
                                      ("uniform:2", "rowwise_adagrad"), ("normal:0.01", "adam")]}
    ids = np.array([10**8, 3, 3, 777_777_777])
    grads = np.random.default_rng(1).standard_normal((4, 5)).astype(np.float32)
    with client(server.address, 0, 1) as worker:
        worker.init(DENSE, tables=tables)
        before = worker.pull_rows({name: ids for name in tables})
        assert all(fetch_stats(server.address)["server"]["tables"][name]["rows"] == 0 for name in tables)
        worker.push_rows({name: (ids, np.zeros((4, 5), np.float32)) for name in tables})
        after = worker.pull_rows({name: ids for name in tables})
        worker.push_rows({name: (ids, grads) for name in tables})
        trained = worker.pull_rows({name: ids for name in tables})
    for name, table in tables.items():
        assert np.array_equal(before[name], table.initial_rows(name, ids)), name
        assert np.array_equal(after[name], before[name]), name
        local = RowTable(name, table)
        local.push(ids, np.zeros((4, 5), np.float32))
        local.push(ids, grads)
        assert np.array_equal(trained[name], local.pull(ids)), name


def test_a_push_past_the_limit_is_refused_and_changes_nothing(server_process, client):
    server = server_process("--workers", "1", "--sync", "asp", "--table-memory", "1M")
    table = Table(rows=10**9, dim=64, init="normal:0.1", optimizer="adagrad", lr=0.1)  # 548 bytes a row
    held, fresh = np.arange(1500), 10**6 + np.arange(500)
    with client(server.address, 0, 1) as worker:
        worker.init(DENSE, tables={"items": table})
        worker.push_rows("items", held, np.ones((1500, 64), np.float32))
        before = fetch_stats(server.address)["server"]
        rows_before = worker.pull_rows("items", np.concatenate([held, fresh]))
        with pytest.raises(TableMemoryFull, match=r"take 822000 bytes of the 1048576 --table-memory allows \(as "
                                                  r"given\), and this push makes up to 274000 more; no table is "
                                                  r"declared evict=True: nothing changed\. Start the server with a "
                                                  r"larger --table-memory SIZE"):
            worker.push_pull(np.ones(4, np.float32), rows={"items": (np.concatenate([held[:10], fresh]),
                                                                     np.ones((510, 64), np.float32))})
        after = fetch_stats(server.address)["server"]
        assert np.array_equal(worker.pull_rows("items", np.concatenate([held, fresh])), rows_before)
        assert np.array_equal(worker.pull()["w"], DENSE["w"])
        for key in ("version", "pushes", "table_memory"):
            assert after[key] == before[key], key
        assert after["tables"]["items"]["rows"] == 1500 and after["table_memory"]["bytes"] == 1500 * 548
        worker.push_rows("items", held[:10], np.ones((10, 64), np.float32))  # rows held: it goes on
        worker.push_rows("items", fresh[:100], np.ones((100, 64), np.float32))  # and rows that fit
        assert fetch_stats(server.address)["server"]["tables"]["items"]["rows"] == 1600


def test_the_default_limit_is_finite_said_at_start_and_on_metrics(server_process):
    server = server_process("--workers", "1", "--sync", "asp", "--http-port", "0")
    base = http_address(server)
    found = re.search(r"table memory up to ([\d.]+) (GiB|MiB) \(half the ([\d.]+) (GiB|MiB) available at start; "
                      r"--table-memory sets it\)", server.wait_for_log("listening on"))
    assert found, server.log()
    available = psutil.virtual_memory().available
    with aps.Worker(server.address, 0, 1) as worker:
        worker.init(DENSE, tables={"items": Table(rows=10**9, dim=8)})
        worker.push_rows("items", np.arange(100), np.ones((100, 8), np.float32))
        stats = fetch_stats(server.address)["server"]["table_memory"]
        time.sleep(_http.METRICS_MAX_AGE_S + 0.05)
        metrics = samples(asyncio.run(get(base + "metrics"))[1])
    limit = stats["limit"]
    assert stats["default"] and 0 < limit <= psutil.virtual_memory().total // 2
    assert limit == pytest.approx(available / 2, rel=0.25)
    assert float(found[1]) * (1 << (30 if found[2] == "GiB" else 20)) == pytest.approx(limit, rel=0.01)
    assert stats["bytes"] == 100 * (Table(rows=10**9, dim=8).row_bytes() + 36)
    assert metrics[("aps_table_memory_limit_bytes", ())] == limit
    assert metrics[("aps_table_memory_bytes", ())] == stats["bytes"]


@pytest.mark.parametrize(("flag", "said", "limit"), [("0", "table memory unlimited (--table-memory 0)", None),
                                                     ("3M", "table memory up to 3.0 MiB (--table-memory)", 3 << 20)],
                         ids=["unlimited", "3M"])
def test_a_given_limit_overrides_the_default(server_process, flag, said, limit):
    server = server_process("--workers", "1", "--sync", "asp", "--table-memory", flag)
    assert said in server.wait_for_log("listening on")
    with aps.Worker(server.address, 0, 1) as worker:
        worker.init(DENSE, tables={"items": Table(rows=10**9, dim=8)})
        memory = fetch_stats(server.address)["server"]["table_memory"]
    assert (memory["limit"], memory["default"], memory["bytes"]) == (limit, False, 0)


def test_a_push_of_rows_sent_again_after_a_lost_reply_is_answered_not_applied(server_process):
    """The duplicate rule with rows, under a limit: the push comes again (the same request id
    and clock) on a new connection that rejoins; it is answered as the first time, and its
    rows (made by the first) are not applied twice."""
    server = server_process("--workers", "1", "--sync", "asp", "--table-memory", "64K")
    table = Table(rows=1000, dim=3, init="uniform:0.5", optimizer="sgd", lr=0.5)  # 48 bytes a row
    grads = np.ones((1300, 3), np.float32)
    push = rows_frame(Op.PUSH, [RowSection(0, np.arange(1300) % 1000, grads)], True)
    raw = RawClient(server.port)
    raw.init(0, 1, DENSE, {"tags": table})
    assert raw.reply()[0].op == Op.INIT_REPLY
    raw.send_rows(*push)
    first = raw.reply()[0]
    assert first.op == Op.PUSH_REPLY and first.version == 1
    raw.close()
    again = RawClient(server.port)
    again.init(0, 1, DENSE, {"tags": table}, flags=int(Flag.REJOIN), clock=1)
    assert again.reply()[0].op == Op.INIT_REPLY
    again.send_rows(*push)
    reply = again.reply()[0]
    assert (reply.op, reply.version, reply.clock) == (Op.PUSH_REPLY, 1, 1)
    again.close()
    with aps.Worker(server.address, 0, 1, reconnect=False) as worker:
        worker.init(DENSE, tables={"tags": table})
        local = RowTable("tags", table)
        local.push(np.arange(1300) % 1000, grads)
        assert np.array_equal(worker.pull_rows("tags", np.arange(1000)), local.pull(np.arange(1000)))
        stats = fetch_stats(server.address)["server"]
    assert stats["duplicates"] == 1 and stats["version"] == 1 and stats["tables"]["tags"]["rows"] == 1000


@pytest.mark.slow
def test_the_wide_rows_of_the_report_neither_grow_the_server_when_read_nor_pass_the_limit(server_process):
    """The figures of the report: one pull of 2,000 ids of a 65,536-wide Adagrad table took the
    server from 56 MB to 2.7 GB, and a push of them to 4 GB. A pull's reply (512 MiB) is given
    back once sent, three pulls over; a push of them past --table-memory is refused whole,
    its gradient read and dropped, and the server holds no row."""
    server = server_process("--workers", "1", "--sync", "asp", "--table-memory", "512M")
    table = Table(rows=2**62, dim=65536, optimizer="adagrad", lr=0.1)
    process = psutil.Process(server.proc.pid)
    out = np.empty((2000, 65536), np.float32)
    with aps.Worker(server.address, 0, 1, transport="tcp") as worker:
        worker.init(DENSE, tables={"wide": table})
        before = process.memory_info().rss
        for k in range(3):
            worker.pull_rows("wide", np.arange(2000) * 7919 + k, out=out)
        time.sleep(0.5)  # (the last reply's buffer given back once written)
        pulled = process.memory_info().rss
        with pytest.raises(TableMemoryFull, match="this push makes up to 1048648000 more"):
            worker.push_rows("wide", np.arange(2000) * 7919, out)
        time.sleep(0.5)
        pushed = process.memory_info().rss
        assert np.array_equal(worker.pull_rows("wide", [7919])[0], table.initial_rows("wide", np.array([7919]))[0])
        assert fetch_stats(server.address)["server"]["tables"]["wide"]["rows"] == 0
    print(f"server RSS {before / MIB:.0f} -> {pulled / MIB:.0f} MiB after three pulls, {pushed / MIB:.0f} MiB "
          "after the push refused")
    assert pulled - before < 64 * MIB and pushed - before < 64 * MIB
