#!/usr/bin/env python
"""How long a frozen worker stalls the others: SIGSTOP one of three worker processes.

Under BSP and SSP the others wait for the slowest worker, so they stop when one
freezes until the server drops it (``--heartbeat-timeout``). For each sync policy and
model size this stops worker 2 while the three train (real ``aps serve`` and worker
processes, TCP) and measures, from the freeze: when the server dropped it (its log),
and when the other two had taken five more steps. The target: the rest go on within
the heartbeat timeout plus one second. Example:
``python bench/stalls.py --out bench/results/stalls.json``.
"""

from __future__ import annotations

import datetime
import os
import re
import signal
import sys
import time


from aps.cli._args import ArgumentParser
from aps.lab.bench import machine_info, write_report
from aps.testing import ServerProcess, SteadyCluster

SYNCS = {"bsp": ["--sync", "bsp"], "ssp:1": ["--sync", "ssp", "--staleness", "1"]}
SIZES = {"4 KiB": 1024, "64 MiB": 16 << 20}


def freeze_once(sync: str, size: str, heartbeat: float, transport: str) -> dict:
    server = ServerProcess("--workers", "3", *SYNCS[sync], "--heartbeat-timeout", str(heartbeat), "--lr", "0")
    cluster = SteadyCluster(server, 3, SIZES[size], transport)
    try:
        cluster.wait_steps(range(3), 3, timeout=120)
        os.kill(cluster.procs[2].pid, signal.SIGSTOP)
        frozen_wall, frozen = time.time(), time.monotonic()
        cluster.wait_steps([0, 1], 5, timeout=heartbeat + 60)
        resumed = time.monotonic() - frozen
        dropped = None
        for line in server.log().splitlines():
            if "worker 2 left" in line:
                stamp = datetime.datetime.strptime(re.match(r"\S+ \S+", line).group(0), "%Y-%m-%d %H:%M:%S,%f")
                dropped = stamp.timestamp() - frozen_wall
                break
    finally:
        cluster.close()
        server.stop()
    return {"sync": sync, "model": size, "transport": transport, "heartbeat_timeout_s": heartbeat,
            "dropped_after_s": dropped, "others_went_on_after_s": resumed,
            "beyond_timeout_s": None if dropped is None else dropped - heartbeat}


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heartbeat-timeout", type=float, default=5.0, help="the server's (default 5)")
    parser.add_argument("--transport", choices=("tcp", "shm"), default="tcp", help="the workers' (default tcp)")
    parser.add_argument("--out", help="also write the JSON report to this file")
    args = parser.parse_args(argv)
    rows = []
    print(f"{'sync':<6} {'model':>7} {'dropped after':>14} {'beyond timeout':>15} {'others went on (5 steps)':>25}")
    for sync in SYNCS:
        for size in SIZES:
            row = freeze_once(sync, size, args.heartbeat_timeout, args.transport)
            rows.append(row)
            print(f"{sync:<6} {size:>7} {row['dropped_after_s']:>13.2f}s {row['beyond_timeout_s']:>14.2f}s "
                  f"{row['others_went_on_after_s']:>24.2f}s", flush=True)
    report = {"benchmark": "stalls", "command": " ".join(["python", *sys.argv]), **machine_info(), "rows": rows}
    write_report(report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
