"""A shard that comes back from an older checkpoint (docs/algorithms.md, "Sharded resume"),
checked with a ledger: SGD with lr=1, and every push (rank, clock) a gradient of -1 on a
weight of its own in every shard's range, so that each weight counts how often that
iteration was applied there. No shard may count an iteration twice; the shard that
crashed loses at most the iterations after the checkpoint it resumed from; the shards
that kept theirs lose none."""

from __future__ import annotations

import pathlib
import signal
import threading
import time

import numpy as np
import pytest

import aps
from aps.checkpoint import list_checkpoints, read_checkpoint
from aps.layout import shard_bounds

from ..helpers import ServerProcess, wait_for

WORKERS = 2
STEPS = 200  # iterations each worker pushes
CELLS = WORKERS * (STEPS + 1)  # one ledger weight per (rank, clock), in each half of the model
POLICIES = {
    "bsp": ("--sync", "bsp"),
    "ssp": ("--sync", "ssp", "--staleness", "2"),
    "asp": ("--sync", "asp"),
}


def cell(rank: int, clock: int) -> int:
    return rank * (STEPS + 1) + clock


class LedgerRun:
    """Two shards, WORKERS worker threads pushing ledger gradients until their clock is STEPS."""

    def __init__(self, server_process, tmp_path: pathlib.Path, policy: str, transport: str) -> None:
        self.server_process = server_process
        self.dirs = [tmp_path / f"shard{i}" for i in range(2)]
        self.options = ("--workers", str(WORKERS), *POLICIES[policy], "--lr", "1", "--shards", "2",
                        "--checkpoint-every", "0", "--checkpoint-every-updates", "10", "--checkpoint-keep", "100")
        self.policy, self.transport = policy, transport
        self.servers = [self._start(i) for i in range(2)]
        self.errors: list[BaseException] = []
        self.pushed: list[list[int]] = [[] for _ in range(WORKERS)]
        self.finished = threading.Event()

    def _start(self, index: int, *extra: str) -> ServerProcess:
        return self.server_process(*self.options, "--shard", str(index), "--checkpoint-dir", str(self.dirs[index]),
                                   *extra)

    def train(self) -> list[threading.Thread]:
        address = ",".join(s.address for s in self.servers)
        scale = float(WORKERS) if self.policy == "bsp" else 1.0  # BSP applies the mean of the round

        def run(rank: int) -> None:
            try:
                with aps.Worker(address, rank, WORKERS, transport=self.transport, reconnect_timeout=60) as worker:
                    worker.init({"ledger": np.zeros(2 * CELLS, np.float32)})
                    grad = np.zeros(2 * CELLS, np.float32)
                    while worker.clock < STEPS:
                        clock = worker.clock + 1  # the iteration this push ends
                        grad[:] = 0
                        grad[cell(rank, clock)] = grad[CELLS + cell(rank, clock)] = -scale
                        worker.push_pull(grad)
                        self.pushed[rank].append(clock)
                        time.sleep(0.01)
            except BaseException as exc:  # reported by the test
                self.errors.append(exc)

        threads = [threading.Thread(target=run, args=(rank,), daemon=True) for rank in range(WORKERS)]
        for thread in threads:
            thread.start()
        return threads

    def version(self, index: int) -> int:
        from aps.cli.status import fetch_stats

        return fetch_stats(self.servers[index].address, timeout=5)["server"]["version"]

    def crash_and_resume_older(self, index: int) -> tuple[int, int]:
        """kill -9 shard ``index`` once it has written three checkpoints, and start it again from
        the one before its newest: returns the newest checkpoint's version (the kill came a
        little after it) and the version it resumed at."""
        wait_for(lambda: len(list_checkpoints(self.dirs[index])) >= 3 or self.errors, timeout=60,
                 what=f"three checkpoints of shard {index}")
        assert not self.errors, self.errors
        killed = self.servers[index]
        port = killed.port
        killed.signal(signal.SIGKILL)
        killed.proc.wait(10)
        written = list_checkpoints(self.dirs[index])  # (newest first)
        versions = [read_checkpoint(p).manifest["version"] for p in written]
        killed_at = max(versions)
        self.servers[index] = self._start(index, "--port", str(port), "--resume", str(written[1]))  # not the newest
        return killed_at, versions[1]

    def final_ledgers(self) -> list[np.ndarray]:
        """Each shard's range of the ledger at the end (from the checkpoint a clean stop writes)."""
        out = []
        for index, server in enumerate(self.servers):
            assert server.stop() == 0, f"shard {index} did not stop cleanly"
            newest = list_checkpoints(self.dirs[index])[0]  # (newest first)
            out.append(read_checkpoint(newest).flat_weights())
        return out


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_a_shard_resumed_from_an_older_checkpoint_makes_no_shard_apply_an_iteration_twice(
        server_process, tmp_path, policy, transport):
    run = LedgerRun(server_process, tmp_path, policy, transport)
    threads = run.train()
    killed_at, resumed_at = run.crash_and_resume_older(1)
    for thread in threads:
        thread.join(120)
    assert not run.errors, run.errors
    assert all(not t.is_alive() for t in threads)
    # every worker pushed each iteration 1..STEPS once: the worker does not go back with the shard
    for rank in range(WORKERS):
        assert run.pushed[rank] == list(range(1, STEPS + 1)), run.pushed[rank]
    bounds = shard_bounds(2 * CELLS, 2)
    ledger = np.concatenate(run.final_ledgers())
    assert ledger.shape == (2 * CELLS,)
    assert ledger.max() <= 1.0, f"iterations applied twice at {np.flatnonzero(ledger > 1)[:20]}"
    assert ledger.min() >= 0.0
    lost = {}
    for rank in range(WORKERS):
        for clock in range(1, STEPS + 1):
            for half in (0, CELLS):
                index = half + cell(rank, clock)
                shard = 0 if index < bounds[1] else 1
                if ledger[index] != 1.0:
                    lost.setdefault(shard, []).append((rank, clock))
    # the shard that never crashed has every iteration exactly once
    assert 0 not in lost, lost.get(0)[:20]
    # the one that crashed lost only iterations after the checkpoint it resumed from (BSP: its
    # rounds resumed_at+1 .. the kill; the others: at most the updates between, by any rank)
    lost_clocks = sorted({clock for _, clock in lost.get(1, [])})
    assert lost.get(1), "the crash lost nothing: the test did not test"
    span = killed_at + 40 - resumed_at  # updates between the checkpoint and the kill (which came after the newest)
    assert len(lost[1]) <= 2 * span, lost[1]  # (each iteration holds a weight in both halves)
    if policy == "bsp":  # rounds: clocks and versions go together, and every rank lost the same rounds
        assert all(resumed_at < clock <= killed_at + 40 for clock in lost_clocks), lost_clocks
        per_rank = [sorted({c for r, c in lost[1] if r == rank}) for rank in range(WORKERS)]
        assert all(clocks == per_rank[0] for clocks in per_rank), per_rank
        assert per_rank[0] == list(range(per_rank[0][0], per_rank[0][-1] + 1)), per_rank[0]
