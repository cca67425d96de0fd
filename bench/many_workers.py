#!/usr/bin/env python
"""Many workers on one server: aggregate updates per second at 4, 16 and 64 worker processes.

A real ``aps serve`` (ASP, plain SGD: every push is one update) and N worker
processes doing ``push_pull`` of a 1 MiB model in a loop, over TCP or shared
memory. A window counts the server's updates (its version) and its CPU time,
so each row gives updates/s, the cores the server got and its CPU time per
update. Every configuration is started afresh in each repeat, and repeats
interleave the configurations; a figure is the median over repeats.

On a machine with fewer cores than workers, the workers and the server share
the cores: past a few workers the single-threaded server gets less than a
core (the scheduler shares the CPU among everything runnable). ``--niced``
adds rows with the workers at nice 19, which leaves the server a core as it
has when its workers run on other hosts: the server's own scaling.

The ``bound`` rows do over shared memory, in the same run, the least any
server must: a plain asyncio server over a Unix socket that, per 1-byte
request, runs one fused update pass of the worker's gradient (in shared
memory) into a slot, and replies with one byte; each worker writes its
gradient, sends, waits, and copies the slot out. How the bound falls from 4
to 64 workers is the machine's (its cores, caches and scheduler); a
transport's ratio over the bound's is aps's own. ``shm-zc`` runs the
workers with ``zero_copy`` (no copy of the slot per step). Example:
``python bench/many_workers.py --niced --out bench/results/many-workers.json``.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import re
import statistics
import subprocess
import sys
import time

import numpy as np
import psutil


import aps
from aps.cli._args import ArgumentParser, choice_list, format_size, int_list, parse_size
from aps.lab.bench import machine_info, write_report
from aps.cli.status import fetch_stats

TARGET = 0.8


def _worker(address: str, rank: int, workers: int, numel: int, transport: str, nice: int, ready, stop) -> None:
    if nice:
        os.nice(nice)
    with aps.Worker(address, rank, workers, transport=transport.removesuffix("-zc"),
                    zero_copy=transport.endswith("-zc")) as worker:
        worker.init({"w": np.zeros(numel, np.float32)})
        grad = worker.flat_grad
        ready.wait()
        step = 0
        while not stop.is_set():
            step += 1
            grad.fill(1e-6 * (step % 7))  # written afresh each step, as a backward pass writes it
            worker.push_pull(grad)


# The bound: the same traffic with nothing of aps ----------------------------------------------
def _bare_server(path: str, numel: int, workers: int, counter, started, stop) -> None:
    """An asyncio server over a Unix socket doing per request what an aps server does over
    shared memory at the least: one fused update pass of the worker's gradient (in shared
    memory) into a fresh slot (two, alternating), and a 1-byte reply naming the slot."""
    import asyncio

    from aps import _core

    grads = np.memmap(path + ".grads", np.float32, "r", shape=(workers, numel))
    slots = np.memmap(path + ".slots", np.float32, "r+", shape=(2, numel))
    state = {"version": 0}

    class Conn(asyncio.Protocol):
        def connection_made(self, transport) -> None:
            self.transport = transport

        def data_received(self, data: bytes) -> None:
            for rank in data:
                version = state["version"] = state["version"] + 1
                counter.value = version
                _core.sgd_step(slots[version & 1], slots[(version - 1) & 1], grads[rank], None, None, 0.0)
                self.transport.write(bytes([version & 1]))

    async def main() -> None:
        server = await asyncio.get_running_loop().create_unix_server(Conn, path)
        started.set()
        while not stop.is_set():
            await asyncio.sleep(0.05)
        server.close()

    asyncio.run(main())


def _bare_worker(path: str, rank: int, workers: int, numel: int, nice: int, ready, stop) -> None:
    import socket

    if nice:
        os.nice(nice)
    grads = np.memmap(path + ".grads", np.float32, "r+", shape=(workers, numel))
    slots = np.memmap(path + ".slots", np.float32, "r", shape=(2, numel))
    weights = np.zeros(numel, np.float32)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(path)
    ready.wait()
    step = 0
    while not stop.is_set():
        step += 1
        grads[rank].fill(1e-6 * (step % 7))
        try:
            sock.send(bytes([rank]))
            reply = sock.recv(1)
        except (BrokenPipeError, ConnectionResetError):
            break  # (the window is over: the bare server closed first)
        if not reply:
            break
        np.copyto(weights, slots[reply[0]])
    sock.close()


def bare_window(workers: int, numel: int, nice: int, seconds: float) -> dict:
    """The bound of one configuration: updates/s of the bare server and workers."""
    import tempfile

    ctx = mp.get_context("fork")
    folder = tempfile.mkdtemp(prefix="aps-bare-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    path = os.path.join(folder, "sock")
    np.memmap(path + ".grads", np.float32, "w+", shape=(workers, numel)).flush()
    np.memmap(path + ".slots", np.float32, "w+", shape=(2, numel)).flush()
    started, ready, stop = ctx.Event(), ctx.Barrier(workers + 1), ctx.Event()
    counter = ctx.Value("q", 0, lock=False)
    server = ctx.Process(target=_bare_server, args=(path, numel, workers, counter, started, stop), daemon=True)
    server.start()
    started.wait(30)
    procs = [ctx.Process(target=_bare_worker, args=(path, rank, workers, numel, nice, ready, stop), daemon=True)
             for rank in range(workers)]
    try:
        for proc in procs:
            proc.start()
        ready.wait(timeout=120)
        time.sleep(0.5)
        me = psutil.Process(server.pid)
        v0, c0, t0 = counter.value, me.cpu_times(), time.time()
        time.sleep(seconds)
        v1, c1, t1 = counter.value, me.cpu_times(), time.time()
        stop.set()
        for proc in procs:
            proc.join(20)
        server.join(20)
    finally:
        for proc in [*procs, server]:
            if proc.is_alive():
                proc.kill()
        for name in os.listdir(folder):
            os.unlink(os.path.join(folder, name))
        os.rmdir(folder)
    cpu = (c1.user + c1.system) - (c0.user + c0.system)
    return {"transport": "bound", "workers": workers, "nice": nice, "updates_per_s": (v1 - v0) / (t1 - t0),
            "server_cores": cpu / (t1 - t0), "server_cpu_us_per_update": cpu / max(v1 - v0, 1) * 1e6,
            "server_involuntary_switches_per_update": 0.0}


def window(workers: int, numel: int, transport: str, nice: int, seconds: float) -> dict:
    """One configuration, started afresh: its server, its workers, one timed window."""
    server = subprocess.Popen([sys.executable, "-m", "aps", "serve", "--port", "0", "--workers", str(workers),
                               "--sync", "asp", "--lr", "0", "--log-level", "warning"],
                              stdout=subprocess.PIPE, text=True)
    ctx = mp.get_context("fork")
    procs = []
    try:
        address = re.search(r"tcp://\S+", server.stdout.readline()).group(0)
        ready, stop = ctx.Barrier(workers + 1), ctx.Event()
        procs = [ctx.Process(target=_worker, args=(address, rank, workers, numel, transport, nice, ready, stop),
                             daemon=True) for rank in range(workers)]
        for proc in procs:
            proc.start()
        ready.wait(timeout=120)
        time.sleep(0.5)  # past the first round of everyone's first push
        me = psutil.Process(server.pid)
        v0, c0, s0, t0 = fetch_stats(address)["server"]["version"], me.cpu_times(), me.num_ctx_switches(), time.time()
        time.sleep(seconds)
        v1, c1, s1, t1 = fetch_stats(address)["server"]["version"], me.cpu_times(), me.num_ctx_switches(), time.time()
        stop.set()
        cpu = (c1.user + c1.system) - (c0.user + c0.system)
        updates = v1 - v0
        return {"transport": transport, "workers": workers, "nice": nice, "updates_per_s": updates / (t1 - t0),
                "server_cores": cpu / (t1 - t0), "server_cpu_us_per_update": cpu / max(updates, 1) * 1e6,
                "server_involuntary_switches_per_update": (s1.involuntary - s0.involuntary) / max(updates, 1)}
    finally:
        for proc in procs:
            proc.join(20)
            if proc.is_alive():
                proc.kill()
        server.terminate()
        server.wait(20)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=parse_size, default=1 << 20, help="model size (default 1M)")
    parser.add_argument("--workers", type=int_list, default=[4, 16, 64], help="worker counts (default 4,16,64)")
    parser.add_argument("--transports", type=choice_list(("tcp", "shm", "shm-zc", "bound")),
                        default=["tcp", "shm", "bound"],
                        help="transports (default tcp,shm,bound: the bound is shared memory with nothing of aps, "
                             "see bare_window; shm-zc: shared memory with zero_copy workers)")
    parser.add_argument("--niced", action="store_true", help="also run every configuration with the workers at nice 19")
    parser.add_argument("--seconds", type=float, default=3.0, help="seconds per window (default 3)")
    parser.add_argument("--repeats", type=int, default=3, help="windows per configuration (default 3)")
    parser.add_argument("--out", help="also write the JSON report to this file")
    args = parser.parse_args(argv)
    numel = args.model // 4
    configs = [(t, n, nice) for nice in ((0, 19) if args.niced else (0,)) for t in args.transports for n in args.workers]
    rows = []
    started = time.monotonic()
    for repeat in range(args.repeats):
        for transport, workers, nice in (configs if repeat % 2 == 0 else configs[::-1]):
            if transport == "bound":
                row = bare_window(workers, numel, nice, args.seconds)
            else:
                row = window(workers, numel, transport, nice, args.seconds)
            row["repeat"] = repeat
            rows.append(row)
            print(f"repeat {repeat} {transport} x{workers}{' niced' if nice else ''}: {row['updates_per_s']:.0f} "
                  f"updates/s, server {row['server_cores']:.2f} cores, {row['server_cpu_us_per_update']:.0f} us of "
                  f"server cpu per update", flush=True)
    summary = []
    for transport, workers, nice in configs:
        mine = [r for r in rows if (r["transport"], r["workers"], r["nice"]) == (transport, workers, nice)]
        summary.append({"transport": transport, "workers": workers, "nice": nice,
                        **{key: statistics.median(r[key] for r in mine)
                           for key in ("updates_per_s", "server_cores", "server_cpu_us_per_update",
                                       "server_involuntary_switches_per_update")}})
    ratios = {}
    low = min(args.workers)
    for transport, workers, nice in configs:
        if workers == low:
            continue
        per_repeat = []
        for repeat in range(args.repeats):
            many = [r["updates_per_s"] for r in rows if r["repeat"] == repeat and
                    (r["transport"], r["workers"], r["nice"]) == (transport, workers, nice)]
            few = [r["updates_per_s"] for r in rows if r["repeat"] == repeat and
                   (r["transport"], r["workers"], r["nice"]) == (transport, low, nice)]
            per_repeat.append(many[0] / few[0])
        ratios[f"{transport}{' niced' if nice else ''} {workers}/{low}"] = {
            "median": statistics.median(per_repeat), "per_repeat": per_repeat}
    if "bound" in args.transports:  # each transport's falloff over the bound's, repeat by repeat
        for name, ratio in list(ratios.items()):
            transport, rest = name.split(" ", 1)
            if transport == "bound":
                continue
            bound = ratios.get("bound" + (" niced " if "niced" in rest else " ") + rest.split()[-1])
            if bound is not None:
                per_repeat = [a / b for a, b in zip(ratio["per_repeat"], bound["per_repeat"])]
                ratios[f"{name} over the bound's"] = {"median": statistics.median(per_repeat),
                                                       "per_repeat": per_repeat}
    report = {
        "benchmark": "many-workers",
        "command": " ".join(["python", "bench/many_workers.py", *argv]),
        **machine_info(),
        "model_bytes": numel * 4,
        "model": format_size(numel * 4),
        "seconds_per_window": args.seconds,
        "repeats": args.repeats,
        "wall_seconds": time.monotonic() - started,
        "target": {"ratio": TARGET, "of": f"updates/s at {max(args.workers)} workers over {low}"},
        "ratios": ratios,
        "summary": summary,
        "rows": rows,
    }
    for row in summary:
        print(f"{row['transport']} x{row['workers']}{' niced' if row['nice'] else ''}: {row['updates_per_s']:.0f} "
              f"updates/s, server {row['server_cores']:.2f} cores, {row['server_cpu_us_per_update']:.0f} us per update")
    for name, ratio in ratios.items():
        print(f"{name}: {ratio['median']:.2f} (per repeat {', '.join(f'{r:.2f}' for r in ratio['per_repeat'])})")
    write_report(report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
