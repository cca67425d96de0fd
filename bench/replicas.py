#!/usr/bin/env python
"""A replica set's cost and its failover, measured in one run.

Steady state: one worker's push_pull throughput against a replica set of a
primary and one backup (every reply waits for the backup to hold the state),
beside the same against a single server, at each ``--sizes`` (MiB of float32
weights, SGD), over TCP on loopback, interleaved over ``--repeats``; the ratio
is replicated over single (goal 0.8 or more; on a 2-core machine the worker,
the primary and the backup share the cores).

Failover: ``--failovers`` times, the primary is killed (SIGKILL) while a
worker pushes, and the time from the kill until the worker's next
acknowledged push is taken (detection, the coordinator's transaction, the
resume and the workers' reconnection included). A real etcd is started
(Debian's etcd-server).

The four figures of a checkpointing scheme, for the replica set beside a single
server that only checkpoints (every ``--checkpoint-every`` seconds, resumed at
once after each kill, as the best supervisor would): what a checkpoint (or a
replica set's capture) blocks the update lane for, how far apart they are, the
time a failure costs (until the workers push again, plus the work the lost
updates took), and the acknowledged updates lost (the ledger's count). Example:
``python bench/replicas.py --out bench/results/replicas.json``.
"""

from __future__ import annotations

import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from aps.cli._args import ArgumentParser
from aps.cli.status import fetch_stats
from aps.lab.bench import machine_info, write_report
from aps.testing.etcd import Etcd
from aps.testing.replicas import ReplicaCluster

PY = sys.executable

_STEPS = r"""
import os, sys, time, numpy as np, aps
address, numel, seconds = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
with aps.Worker(address, 0, 1, transport="tcp") as w:
    w.init({"w": np.zeros(numel, np.float32)})
    g = np.full(numel, 1e-6, np.float32)
    for _ in range(3):
        w.push_pull(g)
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        w.push_pull(g)
        n += 1
    print(n / (time.perf_counter() - start))
"""


def _rate(address: str, numel: int, seconds: float, env: dict) -> float:
    out = subprocess.run(
        [PY, "-c", _STEPS, address, str(numel), str(seconds)], env=env, capture_output=True, text=True, timeout=300
    )
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-2000:])
    return float(out.stdout.strip())


def _single(directory: Path, env: dict) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(
        [PY, "-m", "aps", "serve", "--host", "127.0.0.1", "--port", "0", "--workers", "1", "--lr", "0.01"],
        stdout=subprocess.PIPE,
        stderr=open(directory / "single.err", "w"),
        text=True,
        env=env,
    )
    line = proc.stdout.readline()
    return proc, line.split("serving on ")[1].strip()


def steady(directory: Path, etcd: Etcd, sizes: list[float], seconds: float, repeats: int) -> list[dict]:
    rows = []
    for mib in sizes:
        numel = int(mib * (1 << 20)) // 4
        replicated, single = [], []
        for repeat in range(repeats):
            cluster = ReplicaCluster(
                directory / f"steady-{mib}-{repeat}", etcd.url, workers=1, sync="asp", extra=("--lr", "0.01")
            )
            try:
                cluster.start_set()
                replicated.append(_rate(f"tcp://{cluster.addresses[0]}", numel, seconds, cluster.env))
                proc, address = _single(directory, cluster.env)
                try:
                    single.append(_rate(address, numel, seconds, cluster.env))
                finally:
                    proc.terminate()
                    proc.wait(30)
            finally:
                cluster.close()
        r, s = statistics.median(replicated), statistics.median(single)
        rows.append(
            {
                "mib": mib,
                "replicated_steps_per_s": round(r, 2),
                "single_steps_per_s": round(s, 2),
                "ratio": round(r / s, 3),
                "replicated_runs": replicated,
                "single_runs": single,
            }
        )
        print(f"{mib:g} MiB: replicated {r:.1f} steps/s, single {s:.1f}: {r / s:.2f}x", flush=True)
    return rows


def failovers(directory: Path, etcd: Etcd, count: int) -> dict:
    cluster = ReplicaCluster(directory / "failover", etcd.url, workers=2, sync="asp", slots=200000)
    times, took = [], []
    try:
        cluster.start_set()
        cluster.start_workers(first=0)
        cluster.wait_acks(50)
        primary = 0
        for n in range(count):
            backup = 1 - primary
            marker = cluster.log(backup).count("took over from")
            killed = time.monotonic()
            before = int(cluster.acked().sum())
            os.kill(cluster.procs[primary].pid, signal.SIGKILL)
            cluster.procs[primary].wait(10)
            times.append(_pushes_again(cluster, killed, before))
            while cluster.log(backup).count("took over from") == marker:
                time.sleep(0.01)
            line = [x for x in cluster.log(backup).splitlines() if "took over from" in x][-1]
            took.append(float(line.split(", ")[-2].split(" s after")[0]))
            listed = cluster.log(backup).count("holds the whole state")
            cluster.start_replica(primary)
            cluster.wait_count(backup, "holds the whole state", listed + 1, timeout=60)  # whole again
            cluster.wait_acks(50)
            print(f"failover {n + 1}: pushes again {times[-1]:.3f} s after the kill", flush=True)
            primary = backup
        ledger = cluster.finish(primary=primary)
    finally:
        cluster.close()
    return {
        "count": count,
        "pushes_again_s": {
            "median": round(statistics.median(times), 3),
            "max": round(max(times), 3),
            "all": [round(t, 3) for t in times],
        },
        "backup_took_over_after_loss_s": {"median": round(statistics.median(took), 3), "max": round(max(took), 3)},
        "applied_twice": ledger["applied_twice"],
        "acknowledged_lost": ledger["lost"],
        "acknowledged": ledger["acknowledged"],
    }


def _stats(cluster: ReplicaCluster, index: int) -> dict:
    return fetch_stats(f"tcp://{cluster.addresses[index]}", token=cluster.token)


def _pushes_again(cluster: ReplicaCluster, killed: float, before: int) -> float:
    while int(cluster.acked().sum()) <= before + 1:
        time.sleep(0.005)
    return time.monotonic() - killed


def checkpoint_only(directory: Path, count: int, every: float, seed: int) -> dict:
    """One server checkpointing every ``every`` s, killed ``count`` times at a random point
    of a checkpoint interval and resumed at once from its newest checkpoint."""
    rng = random.Random(seed)
    root = directory / "checkpoint-only"
    cluster = ReplicaCluster(
        root,
        None,
        replicas=1,
        workers=2,
        sync="asp",
        slots=200000,
        extra=("--checkpoint-dir", str(root / "ckpt"), "--checkpoint-every", str(every)),
    )
    back, blocking, rates = [], [], []
    try:
        cluster.start_replica(0, "--resume")
        cluster.start_workers(first=0)
        cluster.wait_acks(50)
        for n in range(count):
            started, acked = time.monotonic(), int(cluster.acked().sum())
            time.sleep(every + rng.uniform(0.0, every))  # (one checkpoint at least, then anywhere in an interval)
            checkpoint = _stats(cluster, 0)["server"].get("checkpoint") or {}
            if "loop_ms" in checkpoint:
                blocking.append(checkpoint["loop_ms"])
            before = int(cluster.acked().sum())
            rates.append((before - acked) / (time.monotonic() - started))
            killed = time.monotonic()
            cluster.kill(0)
            cluster.start_replica(0, "--resume")
            back.append(_pushes_again(cluster, killed, before))
            print(f"checkpoint-only kill {n + 1}: pushes again {back[-1]:.3f} s after the kill", flush=True)
            cluster.wait_acks(50)
        ledger = cluster.finish(primary=0)
    finally:
        cluster.close()
    rate = statistics.median(rates)
    lost = ledger["lost"]
    return {
        "kills": count,
        "blocking_ms_per_checkpoint": {"median": round(statistics.median(blocking), 3), "max": round(max(blocking), 3)},
        "interval_s": every,
        "pushes_again_s": {"median": round(statistics.median(back), 3), "max": round(max(back), 3)},
        "acknowledged_lost": lost,
        "acknowledged_lost_per_failure": round(lost / count, 1),
        # the time the lost updates had taken, at the run's rate: lost again on every failure
        "work_lost_s_per_failure": round(lost / count / rate, 3),
        "time_lost_s_per_failure": round(statistics.median(back) + lost / count / rate, 3),
        "applied_twice": ledger["applied_twice"],
        "acknowledged": ledger["acknowledged"],
    }


def replicated_costs(directory: Path, etcd: Etcd, seconds: float) -> dict:
    """What the captures of a replica set under the failover benchmark's load block the
    update lane for, and how far apart they are."""
    cluster = ReplicaCluster(directory / "captures", etcd.url, workers=2, sync="asp", slots=200000)
    try:
        cluster.start_set()
        cluster.start_workers(first=0)
        cluster.wait_acks(50)
        first = _stats(cluster, 0)["server"]["replicas"]
        began = time.monotonic()
        time.sleep(seconds)
        last = _stats(cluster, 0)["server"]["replicas"]
        took = time.monotonic() - began
        cluster.finish(primary=0)
    finally:
        cluster.close()
    captures = last["captures"] - first["captures"]
    return {
        "blocking_ms_per_capture": round(1e3 * (last["capture_seconds"] - first["capture_seconds"]) / captures, 3),
        "interval_s": round(took / captures, 4),
        "captures": captures,
    }


def four_figures(replicated: dict, costs: dict, checkpoints: dict) -> dict:
    """Side by side: blocking time, interval, time lost per failure, acknowledged updates lost."""
    return {
        "replica_set": {
            "blocking_ms": costs["blocking_ms_per_capture"],
            "interval_s": costs["interval_s"],
            "time_lost_s_per_failure": replicated["pushes_again_s"]["median"],
            "acknowledged_lost": replicated["acknowledged_lost"],
        },
        "checkpoint_only": {
            "blocking_ms": checkpoints["blocking_ms_per_checkpoint"]["median"],
            "interval_s": checkpoints["interval_s"],
            "time_lost_s_per_failure": checkpoints["time_lost_s_per_failure"],
            "acknowledged_lost": checkpoints["acknowledged_lost"],
        },
    }


def main() -> None:
    parser = ArgumentParser(description=__doc__)
    parser.add_argument("--sizes", default="1,16", help="MiB of weights, comma-separated")
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--failovers", type=int, default=10)
    parser.add_argument(
        "--checkpoint-every", type=float, default=5.0, help="the checkpoint-only server's interval, seconds"
    )
    parser.add_argument("--kills", type=int, default=5, help="kills of the checkpoint-only server")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="aps-bench-replicas-") as tmp, Etcd(Path(tmp) / "etcd") as etcd:
        report = {
            "machine": machine_info(),
            "steady": steady(Path(tmp), etcd, [float(s) for s in args.sizes.split(",")], args.seconds, args.repeats),
            "failover": failovers(Path(tmp), etcd, args.failovers),
            "captures": replicated_costs(Path(tmp), etcd, args.seconds),
            "checkpoint_only": checkpoint_only(Path(tmp), args.kills, args.checkpoint_every, args.seed),
        }
    report["four_figures"] = four_figures(report["failover"], report["captures"], report["checkpoint_only"])
    print("four figures:", report["four_figures"], flush=True)
    write_report(report, args.out)


if __name__ == "__main__":
    main()
