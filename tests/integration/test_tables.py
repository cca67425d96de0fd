"""Embedding tables declared at init: every worker declares the run's tables (a mismatch is
refused naming the table and the field; another model, saying the server holds one already),
every shard holds them, a checkpoint keeps the declarations (and the rows pushed, with their
state; not the rows only pulled) across a resume, and the guide's PyTorch script runs as
written. Real servers."""

from __future__ import annotations

import re
import threading
from pathlib import Path

import numpy as np
import pytest

import aps
from aps.checkpoint import load_checkpoint
from aps.cli.checkpoint import request_checkpoint
from aps.errors import LayoutMismatch, TableMismatch
from aps.tables import Table
from aps.testing import ServerProcess, wait_for
from aps.cli.status import fetch_stats

DENSE = {"w": np.zeros(64, np.float32)}
TABLES = {"items": Table(rows=10**9, dim=8, optimizer="adagrad", lr=0.05),
          "users": Table(rows=1000, dim=4, init="zeros")}


@pytest.mark.parametrize(("other", "message"), [
    ({**TABLES, "items": Table(rows=10**9, dim=16, optimizer="adagrad", lr=0.05)},
     "table 'items': dim is 8 in this run, 16 in the declaration"),
    ({**TABLES, "users": Table(rows=1000, dim=4, init="zeros", optimizer="adam")},
     "table 'users': optimizer is 'sgd' in this run, 'adam' in the declaration"),
    ({"items": TABLES["items"]}, r"tables differ \(missing \['users'\], unexpected \[\]\)"),
    (None, r"tables differ \(missing \['items', 'users'\]"),
    ({"users": TABLES["users"], "items": TABLES["items"]}, "the same tables in a different order"),
])
def test_a_worker_that_declares_other_tables_is_refused_naming_the_table_and_field(
        server_process, client, other, message):
    server = server_process("--workers", "2", "--sync", "asp")
    with client(server.address, 0, 2) as first:
        joined = threading.Thread(target=first.init, args=(DENSE,), kwargs={"tables": TABLES})
        joined.start()
        # (the first declaration is the run's: the second waits until it is in)
        wait_for(lambda: fetch_stats(server.address)["server"]["live"] == 1, what="the first worker seated")
        with client(server.address, 1, 2) as second:
            with pytest.raises(TableMismatch, match=message):
                second.init(DENSE, tables=other)
        with client(server.address, 1, 2) as third:  # the same declaration joins
            third.init(DENSE, tables=dict(TABLES))
            joined.join(30)
            assert first.layout.tables == third.layout.tables == tuple(TABLES.items())


def test_a_worker_cannot_change_its_own_tables_between_inits(server_process):
    server = server_process("--workers", "1", "--sync", "asp")
    with aps.Worker(server.address, 0, 1) as worker:
        worker.init(DENSE, tables=TABLES)
        with pytest.raises(TableMismatch, match="init with other tables than before"):
            worker.init(DENSE, tables={"items": TABLES["items"]})


def test_every_shard_holds_the_tables(server_process):
    servers = [server_process("--workers", "1", "--sync", "asp", "--shard", str(i), "--shards", "2")
               for i in range(2)]
    with aps.Worker([s.address for s in servers], 0, 1, transport="tcp") as worker:
        worker.init(DENSE, tables=TABLES)
        assert all(channel.layout.tables == tuple(TABLES.items()) for channel in worker.shards)
        assert worker.layout.tables == tuple(TABLES.items())


def test_a_checkpoint_keeps_the_declarations_across_a_resume(tmp_path):
    flags = ["--workers", "1", "--sync", "asp", "--checkpoint-dir", str(tmp_path), "--checkpoint-every", "0"]
    server = ServerProcess(*flags)
    try:
        with aps.Worker(server.address, 0, 1, reconnect=False) as worker:
            worker.init(DENSE, tables=TABLES)
            worker.push(np.ones(64, np.float32), rows={"items": ([10**8, 5, 5], np.ones((3, 8), np.float32))})
            held = worker.pull_rows("items", [5, 10**8])
            read = worker.pull_rows({"items": [77, 5], "users": [1, 2, 3]})  # pulled, never pushed: not kept
            path = request_checkpoint(server.address)["path"]
        checkpoint = load_checkpoint(path)
        assert checkpoint.layout.tables == tuple(TABLES.items())
        saved = checkpoint.tables  # the rows touched and their state, loadable as arrays
        assert set(saved) == {"items", "users"} and len(saved["users"]["ids"]) == 0  # (no row touched)
        assert sorted(saved["items"]) == ["ids", "rows", "sum"]
        order = np.argsort(saved["items"]["ids"])
        assert saved["items"]["ids"][order].tolist() == [5, 10**8]
        assert np.array_equal(saved["items"]["rows"][order], held)
        assert np.array_equal(read["items"][0], TABLES["items"].initial_rows("items", np.array([77]))[0])
        port = str(server.port)
        server.stop()
        server = ServerProcess("--port", port, "--checkpoint-dir", str(tmp_path), "--resume")
        with aps.Worker(server.address, 0, 1, reconnect=False) as worker:
            with pytest.raises(TableMismatch, match="table 'items': lr is 0.05 in this run, 0.1"):
                worker.init(DENSE, tables={**TABLES, "items": Table(rows=10**9, dim=8, optimizer="adagrad", lr=0.1)})
        with aps.Worker(server.address, 0, 1, reconnect=False) as worker:
            weights = worker.init(DENSE, tables=TABLES)
            assert np.array_equal(weights["w"], np.full(64, -0.01, np.float32)) and worker.version == 1
            assert np.array_equal(worker.pull_rows("items", [5, 10**8]), held)  # restored exactly
            again = worker.pull_rows({"items": [77, 5], "users": [1, 2, 3]})
            assert all(np.array_equal(again[name], read[name]) for name in read)  # initial values, as before
            assert fetch_stats(server.address)["server"]["tables"]["items"]["rows"] == 2
    finally:
        server.stop()


def test_declaring_many_wide_tables_costs_the_server_nothing_until_rows_are_touched(server_process):
    """A worker (or a stranger past the token) declares 1,000 tables of 65,536-wide rows with
    Adam state: nothing is made for a table before its first row."""
    import psutil

    server = server_process("--workers", "1", "--sync", "asp")
    process = psutil.Process(server.proc.pid)
    before = process.memory_info()
    wide = {f"t{i}": Table(rows=2**62, dim=65536, optimizer="adam") for i in range(1000)}
    with aps.Worker(server.address, 0, 1) as worker:
        worker.init(DENSE, tables=wide)
        after = process.memory_info()
    assert after.rss - before.rss < 64 << 20 and after.vms - before.vms < 1 << 30, (before, after)


def test_another_model_is_refused_saying_the_server_holds_one_and_what_to_do(server_process):
    """The README's tables example against the server its first example ran on: refused,
    saying what this server holds and that another model needs a fresh server."""
    server = server_process("--workers", "1", "--sync", "asp")
    dense = {"w": np.zeros(8, np.float32), "b": np.zeros(1, np.float32)}
    with aps.Worker(server.address, 0, 1) as first:
        first.init(dense)
        first.push(dense)
    held = r"^this server holds another model already \(2 tensors, 9 parameters, no tables\); "
    with aps.Worker(server.address, 0, 1) as second:
        with pytest.raises(LayoutMismatch, match=held + r"this model's tensors differ: tensor names differ \(missing "
                           r"\['w'\], unexpected \[\]\)\. Start a fresh server \(aps serve\) for a new model"):
            second.init({"b": np.zeros(1, np.float32)}, tables={"items": Table(rows=10**9, dim=4)})
    with aps.Worker(server.address, 0, 1) as third:
        with pytest.raises(TableMismatch, match=held + r"this model's tables differ: tables differ .*\. Start a "
                           r"fresh server"):
            third.init(dense, tables={"items": Table(rows=10**9, dim=4)})
    assert fetch_stats(server.address)["server"]["version"] == 1  # nothing changed


def test_the_guides_pytorch_script_runs_as_written(server_process, capsys):
    """docs/guide/tables.md's PyTorch script, against a fresh server as it says: it trains
    (the loss falls every epoch) and the server holds the rows it pushed."""
    pytest.importorskip("torch")
    guide = (Path(__file__).resolve().parents[2] / "docs" / "guide" / "tables.md").read_text()
    section = guide.split("\n## PyTorch\n", 1)[1].split("\n## ", 1)[0]
    (code,) = re.findall(r"```python\n(.*?)```", section, re.S)
    assert "aps serve --workers 1 --sync asp" in section and code.count("tcp://127.0.0.1:7450") == 1
    server = server_process("--workers", "1", "--sync", "asp")
    exec(compile(code.replace("tcp://127.0.0.1:7450", server.address), "tables.md", "exec"), {"__name__": "__main__"})
    losses = [float(v) for v in re.findall(r"^epoch \d: loss (\d+\.\d+)$", capsys.readouterr().out, re.M)]
    assert len(losses) == 3 and losses[0] > losses[1] > losses[2] and losses[2] < 0.2, losses
    tables = fetch_stats(server.address)["server"]["tables"]
    assert 0 < tables["items"]["rows"] <= 1000 and tables["recent"]["rows"] > 0
