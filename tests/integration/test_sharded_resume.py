"""A shard that comes back from an older checkpoint (docs/algorithms.md, "Sharded resume"),
checked with a ledger: SGD with lr=1, and every push (rank, clock) a gradient of -1 on a
weight of its own in every shard's range, so that each weight counts how often that
iteration was applied there. No shard may count an iteration twice; the shard that
crashed loses at most the iterations after the checkpoint it resumed from; the shards
that kept theirs lose none."""

from __future__ import annotations

import asyncio
import pathlib
import signal
import threading
import time

import numpy as np
import pytest

import aps
from aps.checkpoint import list_checkpoints, read_checkpoint
from aps.layout import shard_bounds

from aps.testing import ServerProcess, wait_for

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
        self.shard_clocks: dict[int, list[int]] = {}  # each rank's count on each shard, at the end
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
                    self.shard_clocks[rank] = [shard.clock for shard in worker.shards]
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
        self.resumed_clocks = read_checkpoint(written[1]).manifest["policy"]["clocks"]
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
    for rank in range(WORKERS):
        if policy == "bsp":
            # every shard went back to the round the crashed one resumed at: the worker took the
            # rounds after it again, as with one server
            pushed = run.pushed[rank]
            back = next(i for i in range(1, len(pushed)) if pushed[i] <= pushed[i - 1])
            assert pushed[back] == resumed_at + 1, pushed
            assert pushed[:back] == list(range(1, back + 1)) and pushed[back:] == list(range(resumed_at + 1, STEPS + 1))
        else:
            # each iteration 1..STEPS once: the worker does not go back with the shard
            assert run.pushed[rank] == list(range(1, STEPS + 1)), run.pushed[rank]
            # and every shard counts them all, the one that lost some of them too: the shards'
            # gates see the ranks in one order (else SSP's gates can hold two ranks in a cycle)
            assert run.shard_clocks[rank] == [STEPS, STEPS], run.shard_clocks
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
    if policy == "bsp":  # one round for every shard: nothing lost anywhere
        assert not lost, lost
        return
    # the one that crashed lost only iterations after the checkpoint it resumed from (BSP: its
    # rounds resumed_at+1 .. the kill; the others: at most the updates between, by any rank)
    assert lost.get(1), "the crash lost nothing: the test did not test"
    span = killed_at + 40 - resumed_at  # updates between the checkpoint and the kill (which came after the newest)
    assert len(lost[1]) <= 2 * span, lost[1]  # (each iteration holds a weight in both halves)
    # only iterations after the checkpoint: each rank's after its clock there
    assert all(clock > run.resumed_clocks[rank] for rank, clock in lost[1]), (run.resumed_clocks, lost[1])


@pytest.mark.parametrize("client", ["blocking", "asyncio"])
def test_a_sharded_bsp_run_equals_the_unsharded_one_across_a_shard_crash(server_process, tmp_path, transport,
                                                                          client):
    """Every shard goes back to the round the crashed one resumed at, so the run goes on exactly as
    if nothing had happened: with gradients that depend on (rank, clock) only, the final weights
    equal an unsharded run's without a crash, bit for bit (momentum included)."""
    if client == "asyncio" and transport == "shm":
        pytest.skip("aps.AsyncWorker speaks TCP only")
    numel, steps = 4099, 120
    options = ("--workers", str(WORKERS), "--sync", "bsp", "--lr", "0.25", "--momentum", "0.5")

    def gradient(rank: int, clock: int) -> np.ndarray:
        rng = np.random.default_rng([rank, clock])
        return (rng.integers(-8, 9, numel) / 64).astype(np.float32)

    def train(address: str, on_step=None) -> np.ndarray:
        errors: list[BaseException] = []
        final: list[np.ndarray] = []

        async def run_async(rank: int) -> None:
            worker = await aps.AsyncWorker.connect(address, rank, WORKERS, transport=transport, reconnect_timeout=60)
            try:
                await worker.init({"w": np.linspace(-1, 1, numel, dtype=np.float32)})
                while worker.clock < steps:
                    await worker.push_pull(gradient(rank, worker.clock + 1))
                    await asyncio.sleep(0.01)
                if rank == 0:
                    final.append(np.array(worker.weights["w"]))
            finally:
                await worker.close()

        def run(rank: int) -> None:
            try:
                if client == "asyncio":
                    asyncio.run(run_async(rank))
                    return
                with aps.Worker(address, rank, WORKERS, transport=transport, reconnect_timeout=60) as worker:
                    worker.init({"w": np.linspace(-1, 1, numel, dtype=np.float32)})
                    while worker.clock < steps:
                        worker.push_pull(gradient(rank, worker.clock + 1))
                        time.sleep(0.01)
                    if rank == 0:
                        final.append(np.array(worker.weights["w"]))
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

    reference = train(server_process(*options).address)
    run = LedgerRun.__new__(LedgerRun)
    run.server_process, run.errors = server_process, []
    run.dirs = [tmp_path / f"shard{i}" for i in range(2)]
    run.options = (*options, "--shards", "2", "--checkpoint-every", "0", "--checkpoint-every-updates", "10",
                   "--checkpoint-keep", "100")
    run.servers = [run._start(i) for i in range(2)]
    address = ",".join(s.address for s in run.servers)
    resumed: list[int] = []

    def crash(errors):
        run.errors = errors
        resumed.append(run.crash_and_resume_older(1)[1])

    sharded = train(address, crash)
    assert 0 < resumed[0] < steps
    assert np.array_equal(sharded, reference)
