#!/usr/bin/env python
"""Pipelined pushes: how many 4 KiB pushes per second one server process takes from
asyncio workers that keep several in flight (``AsyncWorker.connect(pipeline=N)``), and what
share of a core the server used for them; depth 1 (no pipeline: a round trip per push) is
measured in the same run. The goal is 50,000 pushes/s.

Each configuration: W worker processes (uvloop, as the server runs), each pushing for
``--seconds`` after a warm-up, then waiting for every answer; the server (ASP, SGD) is a
real ``aps serve``. The median of ``--repeats`` windows.

``--floor``: in the same run, the floor of a push handler written in Python: a bare uvloop
server (a ``BufferedProtocol``: the 40-byte header unpacked with ``struct``, the payload copied
into one gradient buffer, the same SGD kernel as aps's into a second weights buffer, a
40-byte answer; the answers to what one read brought written at once), fed by a raw socket
that keeps the same number of pushes in flight. No handshake, no policy, no statistics:
what is left of the server's time per push when everything aps adds is taken away.

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


def _floor_server(ports) -> None:
    """The bare handler (see the module docstring), serving until it is terminated."""
    import struct

    import uvloop

    from aps import _core

    header = struct.Struct("<IHBBBHxIQQQ")  # (aps.wire.protocol's layout)

    class Handler(asyncio.BufferedProtocol):
        def __init__(self) -> None:
            self.buf = memoryview(bytearray(1 << 22))
            self.start = self.end = 0
            self.grad = np.zeros(1 << 18, np.float32)
            self.grad_bytes = memoryview(self.grad).cast("B")
            self.weights = [np.zeros(1 << 18, np.float32), np.zeros(1 << 18, np.float32)]
            self.version = 0

        def connection_made(self, transport) -> None:
            self.transport = transport

        def get_buffer(self, sizehint: int) -> memoryview:
            if self.start == self.end:
                self.start = self.end = 0
            elif self.end == len(self.buf):
                size = self.end - self.start
                self.buf[:size] = self.buf[self.start : self.end]
                self.start, self.end = 0, size
            return self.buf[self.end :]

        def buffer_updated(self, nbytes: int) -> None:
            self.end += nbytes
            answers = []
            while self.end - self.start >= header.size:
                magic, version, op, _, _, _, rid, clock, _, length = header.unpack_from(self.buf, self.start)
                if self.end - self.start < header.size + length:
                    break
                at = self.start + header.size
                self.grad_bytes[:length] = self.buf[at : at + length]
                self.start = at + length
                n = length // 4
                w_in, w_out = self.weights
                _core.sgd_step(
                    w_out[:n],
                    w_in[:n],
                    self.grad[:n],
                    None,
                    None,
                    1e-6,
                    0.0,
                    0.0,
                    0.0,
                    False,
                    False,
                    1.0,
                    _core.FLOAT32,
                )
                self.weights.reverse()
                self.version += 1
                answers.append(header.pack(magic, version, op, 0, 0, 1, rid, clock, self.version, 0))
            if answers:
                self.transport.write(b"".join(answers))

    async def serve() -> None:
        server = await asyncio.get_running_loop().create_server(Handler, "127.0.0.1", 0)
        ports.put(server.sockets[0].getsockname()[1])
        await asyncio.Event().wait()

    uvloop.run(serve())


def _floor_client(port: int, depth: int, nbytes: int, seconds: float, go, results) -> None:
    """Pushes of ``nbytes`` to the bare handler, ``depth`` in flight, for ``seconds``."""
    import socket

    from aps.wire.protocol import HEADER_SIZE, Op, pack_header

    sock = socket.create_connection(("127.0.0.1", port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    payload = np.full(nbytes // 4, 1e-9, np.float32).tobytes()
    answers = bytearray(1 << 16)

    def push(count: int) -> None:
        sent = answered = pending = 0
        while answered < count:
            while sent < count and sent - answered < depth:
                sock.sendall(pack_header(Op.PUSH, 0, 0, sent, 0, 0, nbytes) + payload)
                sent += 1
            pending += sock.recv_into(answers)
            answered += pending // HEADER_SIZE
            pending %= HEADER_SIZE

    push(200)
    results.put(("ready", 0))
    go.wait()
    count, began = 0, time.perf_counter()
    while time.perf_counter() < began + seconds:
        push(64)
        count += 64
    results.put(("done", count, time.perf_counter() - began))
    sock.close()


def measure_floor(port: int, server_pid: int, depth: int, nbytes: int, seconds: float) -> dict:
    ctx = mp.get_context("spawn")
    go, results = ctx.Event(), ctx.Queue()
    proc = ctx.Process(target=_floor_client, args=(port, depth, nbytes, seconds, go, results))
    proc.start()
    assert results.get(timeout=120)[0] == "ready"
    cpu, began = _cpu_seconds(server_pid), time.perf_counter()
    go.set()
    _, count, took = results.get(timeout=seconds + 120)
    elapsed, cpu = time.perf_counter() - began, _cpu_seconds(server_pid) - cpu
    proc.join(30)
    return {
        "pushes_per_s": count / took,
        "server_core_share": cpu / elapsed,
        "server_cpu_us_per_push": cpu / count * 1e6,
    }


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
    return {
        "pushes_per_s": pushes / max(item[2] for item in done),
        "server_core_share": cpu / elapsed,
        "server_cpu_us_per_push": cpu / pushes * 1e6,
    }


def floor_rows(args) -> list[dict]:
    """The bare handler's rows (one raw-socket client), at each depth."""
    ctx = mp.get_context("spawn")
    ports = ctx.Queue()
    server = ctx.Process(target=_floor_server, args=(ports,), daemon=True)
    server.start()
    rows = []
    try:
        port = ports.get(timeout=60)
        for depth in [int(d) for d in args.depths.split(",")]:
            samples = [measure_floor(port, server.pid, depth, args.bytes, args.seconds) for _ in range(args.repeats)]
            row = {
                "system": "floor",
                "workers": 1,
                "depth": depth,
                "payload_bytes": args.bytes,
                "pushes_per_s": statistics.median(s["pushes_per_s"] for s in samples),
                "pushes_per_s_samples": [s["pushes_per_s"] for s in samples],
                "server_core_share": statistics.median(s["server_core_share"] for s in samples),
                "server_cpu_us_per_push": statistics.median(s["server_cpu_us_per_push"] for s in samples),
            }
            rows.append(row)
            print(
                f"floor, pipeline {depth:>3}: {row['pushes_per_s']:>9,.0f} pushes/s, server "
                f"{row['server_core_share']:.0%} of a core, {row['server_cpu_us_per_push']:.1f} us per push",
                flush=True,
            )
    finally:
        server.terminate()
        server.join(10)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--depths", default="1,4,16,64")
    parser.add_argument("--workers", default="1,2")
    parser.add_argument("--bytes", type=int, default=4096)
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--floor", action="store_true", help="also measure the bare handler (see above)")
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
                    "system": "aps",
                    "workers": workers,
                    "depth": depth,
                    "payload_bytes": args.bytes,
                    "pushes_per_s": rate,
                    "pushes_per_s_samples": [s["pushes_per_s"] for s in samples],
                    "server_core_share": share,
                    "server_cpu_us_per_push": statistics.median(s["server_cpu_us_per_push"] for s in samples),
                    "ratio_to_goal": rate / GOAL,
                }
                rows.append(row)
                print(
                    f"{workers} worker(s), pipeline {depth:>3}: {rate:>9,.0f} pushes/s "
                    f"({rate / GOAL:.2f} of {GOAL:,}), server {share:.0%} of a core, "
                    f"{row['server_cpu_us_per_push']:.1f} us per push",
                    flush=True,
                )
        finally:
            server.stop()
    if args.floor:
        rows += floor_rows(args)
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
