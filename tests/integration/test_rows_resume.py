"""Rows across a shard's crash: a sharded BSP run with embedding tables, one shard killed
(kill -9) and resumed from an older checkpoint, every shard brought back to one round
(docs/algorithms.md, "Sharded resume"), equals an unsharded run without a crash, rows and
their optimizer state included, bit for bit."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

import aps
from aps.checkpoint import list_checkpoints, read_checkpoint
from aps.tables import Table
from aps.testing import wait_for

from tests.integration.test_sharded_resume import WORKERS, LedgerRun

TABLES = {"items": Table(rows=10**9, dim=4, init="normal:0.1", optimizer="adagrad", lr=0.1),
          "tags": Table(rows=500, dim=3, init="uniform:0.2", optimizer="sgd", lr=0.5)}
NUMEL, STEPS = 256, 100


def gradients(rank: int, clock: int):
    rng = np.random.default_rng([rank, clock])
    dense = (rng.integers(-8, 9, NUMEL) / 64).astype(np.float32)
    rows = {name: (rng.integers(0, 60, 12), (rng.integers(-8, 9, (12, table.dim)) / 64).astype(np.float32))
            for name, table in TABLES.items()}
    return dense, rows


def train(address: str, transport: str, on_step=None):
    errors: list[BaseException] = []
    final: list = []

    def run(rank: int) -> None:
        try:
            with aps.Worker(address, rank, WORKERS, transport=transport, reconnect_timeout=60) as worker:
                worker.init({"w": np.linspace(-1, 1, NUMEL, dtype=np.float32)}, tables=TABLES)
                while worker.clock < STEPS:
                    dense, rows = gradients(rank, worker.clock + 1)
                    worker.push_pull(dense, rows=rows, pull_rows={"items": rows["items"][0]})
                    time.sleep(0.01)
                if rank == 0:
                    final.append((np.array(worker.weights["w"]),
                                  worker.pull_rows({name: np.arange(60) for name in TABLES})))
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(rank,), daemon=True) for rank in range(WORKERS)]
    for thread in threads:
        thread.start()
    if on_step is not None:
        on_step(errors)
    for thread in threads:
        thread.join(120)
    assert not errors, errors
    return final[0]


@pytest.mark.slow
def test_a_sharded_bsp_run_with_rows_equals_the_unsharded_one_across_a_shard_crash(server_process, tmp_path,
                                                                                   transport):
    options = ("--workers", str(WORKERS), "--sync", "bsp", "--lr", "0.25")
    reference = train(server_process(*options).address, transport)
    run = LedgerRun.__new__(LedgerRun)
    run.server_process, run.errors = server_process, []
    run.dirs = [tmp_path / f"shard{i}" for i in range(2)]
    run.options = (*options, "--shards", "2", "--checkpoint-every", "0", "--checkpoint-every-updates", "10",
                   "--checkpoint-keep", "100")
    run.servers = [run._start(i) for i in range(2)]
    resumed: list[int] = []

    def crash(errors):
        run.errors = errors
        resumed.append(run.crash_and_resume_older(1)[1])

    sharded = train(",".join(s.address for s in run.servers), transport, crash)
    assert 0 < resumed[0] < STEPS
    assert np.array_equal(sharded[0], reference[0])
    for name in TABLES:
        assert np.array_equal(sharded[1][name], reference[1][name]), name


@pytest.mark.slow
@pytest.mark.parametrize("sync", ["bsp", "asp"])
def test_no_row_is_applied_twice_across_kill_9_and_resume(server_process, tmp_path, transport, sync):
    """A ledger of rows: each iteration (rank, clock) pushes -1 to a row of its own, with the
    dense gradient or alone, while the server is killed (kill -9) and resumed from its newest
    checkpoint three times; the workers get back by themselves. No row may read -2 (applied
    twice); a row lost to a crash is one after the checkpoint the server resumed from."""
    steps, workers = 150, 2
    flags = ("--workers", str(workers), "--sync", sync, "--lr", "1", "--checkpoint-dir", str(tmp_path),
             "--checkpoint-every", "0", "--checkpoint-every-updates", "7")
    table = {"ledger": Table(rows=10**6, dim=1, init="zeros", optimizer="sgd", lr=1.0)}
    server = server_process(*flags)
    port = str(server.port)
    errors: list[BaseException] = []
    unit = float(workers) if sync == "bsp" else 1.0  # (BSP applies the mean of a round)
    clocks = [0] * workers
    done = threading.Event()  # the kills are over: a worker past its last iteration may leave

    def run(rank: int) -> None:
        try:
            with aps.Worker(server.address, rank, workers, transport=transport, reconnect_timeout=120) as worker:
                worker.init({"w": np.zeros(16, np.float32)}, tables=table)
                while worker.clock < steps:
                    clock = worker.clock + 1
                    rows = {"ledger": ([rank * 1000 + clock], np.full((1, 1), unit, np.float32))}  # the row: -1
                    if clock % 3:
                        worker.push_pull(np.zeros(16, np.float32), rows=rows)
                    else:
                        worker.push_rows(rows)
                        worker.pull()
                    clocks[rank] = worker.clock
                    time.sleep(0.005)
                while not done.wait(0.02):  # still a live member: back after a crash too, until the last one
                    worker.pull()
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(rank,), daemon=True) for rank in range(workers)]
    for thread in threads:
        thread.start()
    try:
        for kill in range(3):  # each once both went some way since the last (and a checkpoint was written)
            wait_for(lambda: errors or (min(clocks) >= 15 * (kill + 1) and list_checkpoints(tmp_path)), timeout=120,
                     what=f"progress before kill {kill + 1}")
            assert not errors, errors
            server.proc.kill()
            server.proc.wait(10)
            server.stop()
            server = server_process("--port", port, "--checkpoint-dir", str(tmp_path), "--resume")
    finally:
        done.set()
    for thread in threads:
        thread.join(180)
    assert not errors, errors
    assert server.stop() == 0  # (a clean stop writes a last checkpoint)
    saved = read_checkpoint(list_checkpoints(tmp_path)[0]).tables["ledger"]
    counts = dict(zip(saved["ids"].tolist(), (-saved["rows"][:, 0]).tolist()))
    ids = [rank * 1000 + clock for rank in range(workers) for clock in range(1, steps + 1)]
    applied = np.array([counts.get(i, 0.0) for i in ids])
    assert set(np.unique(applied).tolist()) <= {0.0, 1.0}, "a row was applied twice"
    # lost: at most the updates after the checkpoint each crash resumed from (7 versions: BSP's are rounds)
    assert applied.sum() >= len(ids) - 3 * 7 * (workers if sync == "bsp" else 1), applied.sum()
