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
(Debian's etcd-server). Example:
``python bench/replicas.py --out bench/results/replicas.json``.
"""

from __future__ import annotations

import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from aps.cli._args import ArgumentParser
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
    out = subprocess.run([PY, "-c", _STEPS, address, str(numel), str(seconds)], env=env, capture_output=True,
                         text=True, timeout=300)
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-2000:])
    return float(out.stdout.strip())


def _single(directory: Path, env: dict) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([PY, "-m", "aps", "serve", "--host", "127.0.0.1", "--port", "0", "--workers", "1",
                             "--lr", "0.01"], stdout=subprocess.PIPE, stderr=open(directory / "single.err", "w"),
                            text=True, env=env)
    line = proc.stdout.readline()
    return proc, line.split("serving on ")[1].strip()


def steady(directory: Path, etcd: Etcd, sizes: list[float], seconds: float, repeats: int) -> list[dict]:
    rows = []
    for mib in sizes:
        numel = int(mib * (1 << 20)) // 4
        replicated, single = [], []
        for repeat in range(repeats):
            cluster = ReplicaCluster(directory / f"steady-{mib}-{repeat}", etcd.url, workers=1, sync="asp",
                                     extra=("--lr", "0.01"))
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
        rows.append({"mib": mib, "replicated_steps_per_s": round(r, 2), "single_steps_per_s": round(s, 2),
                     "ratio": round(r / s, 3), "replicated_runs": replicated, "single_runs": single})
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
            while int(cluster.acked().sum()) <= before + 1:
                time.sleep(0.005)
            times.append(time.monotonic() - killed)
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
    return {"count": count, "pushes_again_s": {"median": round(statistics.median(times), 3),
                                               "max": round(max(times), 3), "all": [round(t, 3) for t in times]},
            "backup_took_over_after_loss_s": {"median": round(statistics.median(took), 3), "max": round(max(took), 3)},
            "applied_twice": ledger["applied_twice"], "acknowledged_lost": ledger["lost"],
            "acknowledged": ledger["acknowledged"]}


def main() -> None:
    parser = ArgumentParser(description=__doc__)
    parser.add_argument("--sizes", default="1,16", help="MiB of weights, comma-separated")
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--failovers", type=int, default=10)
    parser.add_argument("--out")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="aps-bench-replicas-") as tmp, Etcd(Path(tmp) / "etcd") as etcd:
        report = {
            "machine": machine_info(),
            "steady": steady(Path(tmp), etcd, [float(s) for s in args.sizes.split(",")], args.seconds, args.repeats),
            "failover": failovers(Path(tmp), etcd, args.failovers),
        }
    write_report(report, args.out)


if __name__ == "__main__":
    main()
