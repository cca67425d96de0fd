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
from aps.tables import Table

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
