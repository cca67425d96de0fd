"""Replica sets (aps serve --replicas): real replicas, a real etcd deciding who is primary,
and ledger workers (each (rank, slot) pushes into a weight of its own, SGD lr=1, so every
weight counts its applications): a primary killed mid-run loses no acknowledged update and
applies none twice, a backup takes over and the workers follow it by themselves, a replica
killed and started again catches up from the live one, and a deposed primary answers nothing.
"""

from __future__ import annotations

import asyncio
import json
import pathlib
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import aps

from aps.server.coordinator import Coordinator, Record
from aps.server.replica_link import LinkRefused, connect_backup
from aps.testing.etcd import Etcd, etcd_available
from aps.testing.netns import Network, require_netns
from aps.testing.replicas import ReplicaCluster

pytestmark = pytest.mark.skipif(not etcd_available(), reason="etcd (Debian's etcd-server) is not installed")

TOOK_OVER = "took over from"


@pytest.fixture
def etcd(tmp_path):
    with Etcd(tmp_path / "etcd") as running:
        yield running


@pytest.mark.parametrize(
    "sync, transport, given",
    [
        ("asp", "tcp", 0),
        pytest.param("bsp", "tcp", 1, marks=pytest.mark.slow),  # (the slow call: many processes, two kills each)
        pytest.param("ssp", "shm", 1, marks=pytest.mark.slow),
    ],
)
def test_killed_primaries_lose_no_acknowledged_update_and_apply_none_twice(etcd, tmp_path, sync, transport, given):
    """``given``: the replica the workers are pointed at (1: the backup, which names its primary)."""
    cluster = ReplicaCluster(tmp_path / "run", etcd.url, sync=sync)
    try:
        cluster.start_set()
        cluster.start_workers(first=given, transport=transport)
        cluster.wait_acks(100)
        cluster.kill(0)  # mid-run: pushes in flight, captures on the wire
        took = cluster.wait_log(1, TOOK_OVER)
        cluster.wait_acks(100)
        # the killed replica comes back as a backup of the new primary, and catches up from it
        cluster.start_replica(0)
        cluster.wait_log(0, "following primary")
        cluster.wait_log(1, "holds the whole state")
        cluster.wait_acks(100)
        cluster.kill(1)  # a second failover, back to the first replica
        took_again = cluster.wait_log(0, TOOK_OVER)
        cluster.wait_acks(100)
        ledger = cluster.finish(primary=0)
    finally:
        cluster.close()
    print(f"took over {took:.2f} s and {took_again:.2f} s after the kills; {ledger['acknowledged']} acknowledged")
    assert ledger["applied_twice"] == 0, ledger["twice_at"]
    assert ledger["lost"] == 0, ledger["lost_at"]
    assert ledger["phantom"] == 0
    assert ledger["acknowledged"] >= 400


def test_a_backup_stops_when_told_to_and_the_primary_goes_on_without_it(etcd, tmp_path):
    cluster = ReplicaCluster(tmp_path / "run", etcd.url)
    try:
        cluster.start_set()
        cluster.kill(1, signal.SIGTERM)  # an operator's Ctrl-C or a pod's stop, while it is a backup
        assert cluster.procs[1].wait(20) == 0
        assert "this backup was stopped" in cluster.out(1)
        cluster.wait_log(0, "running without backups")
        assert TOOK_OVER not in cluster.log(1)
    finally:
        cluster.close()


@pytest.mark.slow  # (a replica set, its workers and a fault: the slow call)
def test_a_stopped_primary_is_deposed_and_answers_nothing_when_it_wakes(etcd, tmp_path):
    cluster = ReplicaCluster(tmp_path / "run", etcd.url)
    try:
        cluster.start_set()
        cluster.start_workers(first=0)
        cluster.wait_acks(50)
        cluster.kill(0, signal.SIGSTOP)  # stopped, not dead: it wakes up thinking it is primary
        took = cluster.wait_log(1, TOOK_OVER)
        back = took + cluster.wait_acks(1)  # the workers found the new primary (after 2 --failover-timeout)
        cluster.wait_acks(50)
        cluster.kill(0, signal.SIGCONT)
        cluster.wait_log(0, "was deposed")
        assert cluster.procs[0].wait(30) is not None  # it stopped by itself
        cluster.wait_acks(50)
        ledger = cluster.finish(primary=1)
    finally:
        cluster.close()
    print(f"took over {took:.2f} s after the stop; the workers pushed again {back:.2f} s after it")
    assert ledger["applied_twice"] == 0 and ledger["lost"] == 0, ledger


@pytest.mark.slow  # (a replica set, its workers and a fault: the slow call)
def test_a_primary_stopped_on_purpose_hands_its_shard_over(etcd, tmp_path):
    """SIGTERM (a pod evicted, a node drained): the primary stops cleanly and a backup takes
    over; the workers, told the server is shutting down, follow it."""
    cluster = ReplicaCluster(tmp_path / "run", etcd.url)
    try:
        cluster.start_set()
        cluster.start_workers(first=0)
        cluster.wait_acks(50)
        cluster.kill(0, signal.SIGTERM)
        assert cluster.procs[0].wait(30) == 0
        cluster.wait_log(1, TOOK_OVER)
        cluster.wait_acks(50)
        ledger = cluster.finish(primary=1)
    finally:
        cluster.close()
    assert ledger["applied_twice"] == 0 and ledger["lost"] == 0, ledger


@pytest.mark.slow  # (a replica set, its workers and a fault: the slow call)
def test_a_backup_that_stops_acknowledging_leaves_the_set_and_comes_back_after_catching_up(etcd, tmp_path):
    cluster = ReplicaCluster(tmp_path / "run", etcd.url)
    try:
        cluster.start_set()
        cluster.start_workers(first=0)
        cluster.wait_acks(50)
        cluster.kill(1, signal.SIGSTOP)  # it holds every acknowledged update so far, and says nothing
        cluster.wait_log(0, "running without backups")  # after --replica-timeout: the primary goes on alone
        cluster.wait_acks(50)
        assert TOOK_OVER not in cluster.log(1)
        cluster.kill(1, signal.SIGCONT)
        cluster.wait_count(0, "holds the whole state", 2, timeout=60)  # linked again, and whole again
        cluster.wait_acks(50)
        cluster.kill(0)  # it can take over again: it holds everything
        cluster.wait_log(1, TOOK_OVER)
        cluster.wait_acks(50)
        ledger = cluster.finish(primary=1)
    finally:
        cluster.close()
    assert ledger["applied_twice"] == 0 and ledger["lost"] == 0, ledger


@pytest.mark.slow  # (a replica set, its workers and a fault: the slow call)
def test_a_peer_without_the_token_or_not_the_primary_is_refused_by_a_backup(etcd, tmp_path):
    cluster = ReplicaCluster(tmp_path / "run", etcd.url)
    try:
        cluster.start_replica(0)
        cluster.wait_log(0, "primary at term")
        cluster.start_replica(1)
        cluster.wait_log(1, "following primary")
        host, port = cluster.addresses[1].split(":")

        async def knock(token: bytes, primary: str) -> str:
            reader, writer = await asyncio.open_connection(host, int(port))
            try:
                await connect_backup(reader, writer, token, {"set": cluster.name, "primary": primary, "term": 1}, 5)
                return "accepted"
            except LinkRefused as exc:
                return str(exc)
            finally:
                writer.close()

        wrong = asyncio.run(knock(b"not the token", cluster.addresses[0]))
        impostor = asyncio.run(knock(cluster.token.encode(), "127.0.0.1:1"))

        async def record() -> Record | None:
            coordinator = Coordinator(etcd.url, cluster.name)
            try:
                return await coordinator.read()
            finally:
                await coordinator.close()

        after = asyncio.run(record())
        log = cluster.log(1)
    finally:
        cluster.close()
    assert wrong != "accepted" and impostor != "accepted", (wrong, impostor)
    assert "not the primary" in impostor
    assert after is not None and after.primary == cluster.addresses[0], after  # nothing changed
    assert TOOK_OVER not in log


NUMEL, STEPS = 4096, 120


def _train(address: str, env_token: str | None, results: dict, errors: list, clocks: list) -> list[threading.Thread]:
    """Two BSP workers pushing seeded gradients (the same for a (rank, clock) in every run)."""

    def run(rank: int) -> None:
        try:
            with aps.Worker(address, rank, 2, transport="tcp", token=env_token, reconnect_timeout=60) as worker:
                worker.init({"w": np.zeros(NUMEL, np.float32)})
                weights = None
                while worker.clock < STEPS:
                    clocks[rank] = worker.clock
                    rng = np.random.default_rng(1000 * rank + worker.clock)
                    weights = worker.push_pull(rng.standard_normal(NUMEL).astype(np.float32))
                results[rank] = np.array(weights["w"], np.float32)
        except BaseException as exc:  # reported by the test
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(rank,), daemon=True) for rank in range(2)]
    for thread in threads:
        thread.start()
    return threads


def _wait_clock(clocks: list, clock: int, errors: list, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while min(clocks) < clock:
        assert not errors, errors
        assert time.monotonic() < deadline, f"clocks {clocks}, waiting for {clock}"
        time.sleep(0.01)


@pytest.mark.slow  # (four replicas, three failovers, and the unsharded run beside them)
def test_a_sharded_bsp_run_with_replicas_equals_the_unsharded_one_bit_for_bit_across_failovers(
    etcd, tmp_path, server_process
):
    optimizer = ("--lr", "0.05", "--momentum", "0.9")
    shards = [
        ReplicaCluster(
            tmp_path / f"shard{i}", etcd.url, sync="bsp", extra=("--shards", "2", "--shard", str(i), *optimizer)
        )
        for i in range(2)
    ]
    shards[1].token, shards[1].env = shards[0].token, shards[0].env  # one run, one token
    results: dict[int, np.ndarray] = {}
    errors: list[BaseException] = []
    clocks = [0, 0]
    try:
        for shard in shards:
            shard.start_replica(0)
        for shard in shards:
            shard.wait_log(0, "primary at term")
            shard.start_replica(1)
        for shard in shards:
            shard.wait_log(0, "holds the whole state")
        address = ",".join(f"tcp://{shard.addresses[0]}" for shard in shards)
        threads = _train(address, shards[0].token, results, errors, clocks)
        for at, index in ((30, 0), (60, 1), (90, 0)):  # kill -9 a shard's primary; the killed one comes back a backup
            _wait_clock(clocks, at, errors)
            shard = shards[index]
            primary = next(i for i, proc in shard.procs.items() if "serving on" in shard.out(i))
            shard.kill(primary)
            shard.wait_log(1 - primary, TOOK_OVER)
            shard.start_replica(primary)
            shard.wait_log(1 - primary, "holds the whole state")
        for thread in threads:
            thread.join(120)
        assert not errors, errors
        replicated = results[0]
        assert np.array_equal(results[0], results[1])
    finally:
        for shard in shards:
            shard.close()
    single = server_process("--workers", "2", "--sync", "bsp", *optimizer)
    results.clear()
    for thread in _train(single.address, single.token.decode(), results, errors, [0, 0]):
        thread.join(120)
    assert not errors, errors
    assert np.array_equal(replicated, results[0]), np.abs(replicated - results[0]).max()


@pytest.mark.slow  # (four hosts, a partition and its healing each: 7-17 s)
@pytest.mark.parametrize("cut", ["primary", "backup", "coordinator"])
def test_a_partition_loses_no_acknowledged_update_and_leaves_one_primary(tmp_path, cut):
    """Each replica, the coordinator and the workers on hosts of their own (network namespaces);
    one host's link is cut for a while: the primary's (the backup takes over, the workers
    follow, the old primary is deposed when it is back), the backup's (the primary goes on
    without it, then it catches up and is listed again), the coordinator's (nothing changes)."""
    require_netns()
    with Network() as net:
        e, a, b, w = (net.add_host(name) for name in ("etcd", "a", "b", "workers"))
        with Etcd(tmp_path / "etcd", host=e) as etcd:
            cluster = ReplicaCluster(tmp_path / "run", etcd.url, hosts=[a, b], worker_host=w)
            try:
                cluster.start_set()
                cluster.start_workers(first=0)
                cluster.wait_acks(50)
                host = {"primary": a, "backup": b, "coordinator": e}[cut]
                link = ["ip", "-n", net.bridge_netns, "link", "set", host.bridge_port]
                subprocess.run([*link, "down"], check=True)
                try:
                    if cut == "primary":
                        cluster.wait_log(1, TOOK_OVER)
                    elif cut == "backup":
                        cluster.wait_log(0, "running without backups")
                    cluster.wait_acks(50)  # training goes on meanwhile
                finally:
                    subprocess.run([*link, "up"], check=True)
                if cut == "primary":
                    cluster.wait_log(0, "was deposed")
                    assert cluster.procs[0].wait(30) is not None
                elif cut == "backup":
                    cluster.wait_count(0, "holds the whole state", 2, timeout=60)
                cluster.wait_acks(50)
                ledger = cluster.finish(primary=1 if cut == "primary" else 0)
                logs = cluster.log(0) + cluster.log(1)
            finally:
                cluster.close()
    assert ledger["applied_twice"] == 0 and ledger["lost"] == 0, ledger
    assert logs.count(TOOK_OVER) == (1 if cut == "primary" else 0)


@pytest.mark.slow  # (the benchmark at its smallest: a replica set, a failover and a checkpoint-only kill, ~60 s)
def test_the_replica_benchmark_sets_its_four_figures_beside_a_checkpoint_only_run(tmp_path):
    out = tmp_path / "replicas.json"
    bench = subprocess.run(
        [
            sys.executable,
            str(pathlib.Path(__file__).parents[2] / "bench" / "replicas.py"),
            "--sizes",
            "0.25",
            "--repeats",
            "1",
            "--seconds",
            "1",
            "--failovers",
            "1",
            "--kills",
            "1",
            "--checkpoint-every",
            "1",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,  # (its servers' `python -m aps` would take the checkout's package from the checkout)
    )
    assert bench.returncode == 0, bench.stderr[-3000:]
    report = json.loads(out.read_text())
    figures = report["four_figures"]
    assert set(figures) == {"replica_set", "checkpoint_only"}
    for side in figures.values():
        assert set(side) == {"blocking_ms", "interval_s", "time_lost_s_per_failure", "acknowledged_lost"}
        assert side["blocking_ms"] > 0 and side["interval_s"] > 0 and side["time_lost_s_per_failure"] > 0
    # The replica set loses nothing acknowledged; the checkpoint-only server loses what came after
    # its newest checkpoint (it was killed a second or more after one), and neither applies twice.
    assert figures["replica_set"]["acknowledged_lost"] == 0 == report["failover"]["applied_twice"]
    assert figures["checkpoint_only"]["acknowledged_lost"] > 0 == report["checkpoint_only"]["applied_twice"]
    assert figures["checkpoint_only"]["interval_s"] == 1.0
    assert report["steady"][0]["ratio"] > 0
