#!/usr/bin/env python
"""Fuzz a live server with 10^5 hostile frames while a legitimate worker trains beside it.

The cases (aps/testing/fuzzing.py: mutated headers, truncated frames, lengths up to 2^63
promised and never sent, valid handshakes followed by mutated frames, noise) go over
TCP and the shared-memory Unix socket of a token-protected ``aps serve`` with one seat,
taken by a worker that pushes all-ones gradients under ASP with SGD at learning rate 1
and checks after every step that its weights are exactly -k. Prints the frames sent,
server crashes, weight deviations, error frames and closes, and the server's memory
before and after. Example: ``python bench/fuzz.py --frames 100000 --out bench/results/fuzz.json``.
"""

from __future__ import annotations

import random
import sys
import time

import psutil


from aps.cli._args import ArgumentParser
from aps.lab.bench import machine_info, write_report
from aps.testing.fuzzing import Tally, Target, Trainer, run_case
from aps.testing import ServerProcess

TOKEN = "fuzz-token"


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--frames", type=int, default=100_000, help="frames to send (default 100000)")
    parser.add_argument("--transport", choices=("tcp", "shm"), default="shm",
                        help="the legitimate worker's transport (default shm)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the cases (default 0)")
    parser.add_argument("--out", help="also write the JSON report to this file")
    args = parser.parse_args(argv)
    server = ServerProcess("--workers", "1", "--sync", "asp", "--lr", "1", "--token", TOKEN,
                           "--max-frame-bytes", "64M", "--log-level", "warning")
    try:
        process = psutil.Process(server.proc.pid)
        trainer = Trainer(server.address, args.transport, TOKEN)
        trainer.start()
        time.sleep(0.5)
        rss_before = process.memory_info().rss
        target = Target(server.port, server.unix_path, TOKEN.encode())
        rng = random.Random(args.seed)
        tally = Tally()
        start = time.monotonic()
        crashed = False
        while tally.frames < args.frames:
            run_case(target, rng, tally, linger=0.005)
            if tally.cases % 1000 == 0:
                if not server.alive():
                    crashed = True
                    break
                print(f"  {tally.frames} frames, {tally.cases} cases, worker at step {trainer.steps}, "
                      f"server {process.memory_info().rss >> 20} MiB", flush=True)
        elapsed = time.monotonic() - start
        crashed = crashed or not server.alive()
        rss_after = process.memory_info().rss if not crashed else 0
        trainer.finish()
        log_bytes = len(server.log())
    finally:
        server.stop()
    report = {
        "benchmark": "fuzz", "command": " ".join(["python", *sys.argv]), **machine_info(),
        "frames": tally.frames, "cases": tally.cases, "seconds": elapsed, "server_crashes": int(crashed),
        "weight_deviations": trainer.deviations, "worker_steps": trainer.steps,
        "worker_error": None if trainer.error is None else repr(trainer.error),
        "error_frames": tally.error_frames, "other_replies": tally.replies,
        "closed_by_server": tally.closed_by_server, "refused_connections": tally.refused,
        "error_codes": {str(k): v for k, v in sorted(tally.errors.items())},
        "server_rss_before_mib": rss_before / 2**20, "server_rss_after_mib": rss_after / 2**20,
        "server_log_bytes": log_bytes,
    }
    print(f"{tally.frames} frames in {tally.cases} cases, {elapsed:.0f} s: {report['server_crashes']} server crashes, "
          f"{trainer.deviations} weight deviations in {trainer.steps} worker steps; {tally.error_frames} error "
          f"frames, {tally.closed_by_server} connections closed by the server; server memory "
          f"{report['server_rss_before_mib']:.0f} -> {report['server_rss_after_mib']:.0f} MiB; log {log_bytes} bytes")
    write_report(report, args.out)
    return 0 if not crashed and not trainer.deviations and trainer.error is None else 1


if __name__ == "__main__":
    sys.exit(main())
