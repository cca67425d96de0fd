#!/usr/bin/env python
"""Pipelined pushes: how many 4 KiB pushes per second one server process takes from
asyncio workers that keep several in flight (``AsyncWorker.connect(pipeline=N)``), and what
share of a core the server used for them; depth 1 (no pipeline: a round trip per push) is
measured in the same run. The goal is 50,000 pushes/s.

Each configuration: W worker processes (uvloop, as the server runs), each pushing for
``--seconds`` after a warm-up, then waiting for every answer; the server (ASP, SGD) is a
real ``aps serve``. The median of ``--repeats`` windows.

Example: ``python bench/pipeline.py --out bench/results/pipeline.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import statistics
import time

import numpy as np

GOAL = 50_000


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _worker(address: str, rank: int, workers: int, depth: int, nbytes: int, seconds: float, go, results) -> None:
    import logging

    import uvloop

    import aps

    logging.getLogger("aps.worker").setLevel(logging.ERROR)  # (each window joins a running model)

    async def main() -> None:
        worker = await aps.AsyncWorker.connect(address, rank, workers, pipeline=depth)
        await worker.init({"w": np.zeros(nbytes // 4, np.float32)})
        grad = np.full(nbytes // 4, 1e-9, np.float32)
        for _ in range(200):
            await worker.push(grad)
        await worker.flush()
        results.put(("ready", rank))
        go.wait()
        count, began = 0, time.perf_counter()
        end = began + seconds
        while True:
            for _ in range(64):
                await worker.push(grad)
            count += 64
            if time.perf_counter() >= end:
                break
        await worker.flush()
        results.put(("done", count, time.perf_counter() - began))
        await worker.close()

    uvloop.run(main())


def measure(address: str, server_pid: int, workers: int, depth: int, nbytes: int, seconds: float) -> dict:
    ctx = mp.get_context("spawn")
    go, results = ctx.Event(), ctx.Queue()
    procs = [
        ctx.Process(target=_worker, args=(address, rank, workers, depth, nbytes, seconds, go, results))
        for rank in range(workers)
    ]
    for proc in procs:
        proc.start()
    for _ in procs:
        assert results.get(timeout=120)[0] == "ready"
    cpu, began = _cpu_seconds(server_pid), time.perf_counter()
    go.set()
    done = [results.get(timeout=seconds + 120) for _ in procs]
    elapsed, cpu = time.perf_counter() - began, _cpu_seconds(server_pid) - cpu
    for proc in procs:
        proc.join(30)
    pushes = sum(item[1] for item in done)
    return {"pushes_per_s": pushes / max(item[2] for item in done), "server_core_share": cpu / elapsed}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--depths", default="1,4,16,64")
    parser.add_argument("--workers", default="1,2")
    parser.add_argument("--bytes", type=int, default=4096)
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out")
    args = parser.parse_args()
    from aps.lab.bench import machine_info
    from aps.testing import ServerProcess

    rows = []
    for workers in [int(w) for w in args.workers.split(",")]:
        server = ServerProcess("--workers", str(workers), "--sync", "asp", "--lr", "1e-6")
        try:
            for depth in [int(d) for d in args.depths.split(",")]:
                samples = [
                    measure(server.address, server.proc.pid, workers, depth, args.bytes, args.seconds)
                    for _ in range(args.repeats)
                ]
                rate = statistics.median(s["pushes_per_s"] for s in samples)
                share = statistics.median(s["server_core_share"] for s in samples)
                row = {
                    "workers": workers,
                    "depth": depth,
                    "payload_bytes": args.bytes,
                    "pushes_per_s": rate,
                    "pushes_per_s_samples": [s["pushes_per_s"] for s in samples],
                    "server_core_share": share,
                    "ratio_to_goal": rate / GOAL,
                }
                rows.append(row)
                print(
                    f"{workers} worker(s), pipeline {depth:>3}: {rate:>9,.0f} pushes/s "
                    f"({rate / GOAL:.2f} of {GOAL:,}), server {share:.0%} of a core",
                    flush=True,
                )
        finally:
            server.stop()
    report = {
        "benchmark": "pipeline",
        "command": "python bench/pipeline.py " + " ".join(f"--{k} {v}" for k, v in vars(args).items() if v),
        **machine_info(),
        "goal_pushes_per_s": GOAL,
        "rows": rows,
    }
    if args.out:
        with open(args.out, "w") as out:
            json.dump(report, out, indent=2)


if __name__ == "__main__":
    main()
