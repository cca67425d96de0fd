#!/usr/bin/env python
"""A crowd at the door: 1,000 idle connections and slow-loris peers beside a training worker.

Measures a legitimate worker's push_pull round trip (TCP) in windows without and with
the crowd, interleaved: 1,000 connections that connect and send nothing, 10 that send
one byte a second of a frame that never ends, and then more connections than
``--max-connections`` allows (refused with an error frame). Reports the latency ratio
(crowd / no crowd), the server's descriptors, and how the overflow was refused. The
server is started with a long ``--handshake-timeout`` so the crowd stays for the whole
measurement (by default it would be closed after 10 s); at the limit, a new connection
closes the oldest of those strangers, or is refused when there is none. Example:
``python bench/crowd.py --out bench/results/crowd.json``.
"""

from __future__ import annotations

import socket
import statistics
import sys
import threading
import time

import numpy as np
import psutil


import aps
from aps.cli._args import ArgumentParser
from aps.lab.bench import machine_info, write_report
from aps.wire.protocol import Op, pack_header
from aps.testing import ServerProcess


def window(worker: aps.Worker, seconds: float) -> float:
    """Median push_pull round trip over ``seconds``, in microseconds."""
    rtts = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        start = time.perf_counter()
        worker.push_pull(worker.grads)
        rtts.append(time.perf_counter() - start)
    return statistics.median(rtts) * 1e6


def loris(port: int, stop: threading.Event) -> None:
    sock = socket.create_connection(("127.0.0.1", port))
    frame = pack_header(Op.PING, length=1 << 20)  # promises a megabyte, sends a byte a second
    i = 0
    try:
        while not stop.wait(1.0):
            sock.send(frame[i % len(frame) : i % len(frame) + 1])
            i += 1
    except OSError:
        pass
    finally:
        sock.close()


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--idle", type=int, default=1000, help="idle connections (default 1000)")
    parser.add_argument("--loris", type=int, default=10, help="slow-loris connections (default 10)")
    parser.add_argument("--overflow", type=int, default=50, help="connections beyond the limit (default 50)")
    parser.add_argument("--size", type=int, default=1 << 20, help="the worker's model in bytes (default 1 MiB)")
    parser.add_argument("--seconds", type=float, default=3.0, help="length of a window (default 3)")
    parser.add_argument("--repeats", type=int, default=3, help="windows of each kind (default 3)")
    parser.add_argument("--out", help="also write the JSON report to this file")
    args = parser.parse_args(argv)
    limit = args.idle + args.loris + 8  # the worker and a few of the tool's own
    server = ServerProcess("--workers", "1", "--sync", "asp", "--lr", "0", "--log-level", "warning",
                           "--max-connections", str(limit), "--handshake-timeout", "600")
    process = psutil.Process(server.proc.pid)
    try:
        worker = aps.Worker(server.address, 0, 1, transport="tcp")
        worker.init({"w": np.zeros(args.size // 4, np.float32)})
        quiet, crowded = [], []
        fds_quiet = process.num_fds()
        crowd: list[socket.socket] = []
        stop = threading.Event()
        threads = []
        refused = accepted_overflow = 0
        for repeat in range(args.repeats):
            quiet.append(window(worker, args.seconds))
            crowd = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(args.idle)]
            stop.clear()
            threads = [threading.Thread(target=loris, args=(server.port, stop), daemon=True) for _ in range(args.loris)]
            for t in threads:
                t.start()
            time.sleep(1.0)
            crowded.append(window(worker, args.seconds))
            fds_crowded = process.num_fds()
            if repeat == 0:  # the last free seats, then beyond the limit: each refused with an error frame
                extras = []
                for _ in range(limit - args.idle - args.loris - 1 + args.overflow):
                    extra = socket.create_connection(("127.0.0.1", server.port))
                    extra.settimeout(0.5)
                    extras.append(extra)
                    try:
                        data = extra.recv(64)
                        refused += len(data) > 6 and data[6] == Op.ERROR
                    except TimeoutError:
                        accepted_overflow += 1  # a free seat: it stays open, taking it
                for extra in extras:
                    extra.close()
            stop.set()
            for t in threads:
                t.join(5)
            for s in crowd:
                s.close()
            time.sleep(1.0)
        worker.close()
        alive = server.alive()
    finally:
        server.stop()
    ratio = statistics.median(c / q for c, q in zip(crowded, quiet))
    report = {
        "benchmark": "crowd", "command": " ".join(["python", *sys.argv]), **machine_info(),
        "idle": args.idle, "loris": args.loris, "model_bytes": args.size, "max_connections": limit,
        "rtt_us_quiet": quiet, "rtt_us_crowded": crowded, "ratio_crowded_to_quiet": ratio,
        "server_fds_quiet": fds_quiet, "server_fds_crowded": fds_crowded,
        "overflow_refused": refused, "overflow_accepted": accepted_overflow, "server_alive": alive,
    }
    print(f"push_pull {args.size >> 10} KiB: {statistics.median(quiet):.0f} us alone, "
          f"{statistics.median(crowded):.0f} us beside {args.idle} idle and {args.loris} slow-loris connections: "
          f"{ratio:.2f}x (median of {args.repeats} interleaved windows); server descriptors {fds_quiet} -> "
          f"{fds_crowded}; of {args.overflow} connections beyond --max-connections {limit}, {refused} were refused "
          f"with an error frame and {accepted_overflow - (limit - args.idle - args.loris - 1)} let in by closing "
          f"the oldest stranger (the crowd never authenticated)")
    write_report(report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
